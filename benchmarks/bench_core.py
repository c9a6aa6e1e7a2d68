"""Build, simulate and validate one large failure plan: S = 16, D = 64, M = 64, 2 failures.

Usage: python benchmarks/bench_core.py [--repeat N]
Target (issue 2): under 10 s on 2 cores for the whole build + simulate + validate.
"""

from __future__ import annotations

import argparse
import json
import statistics

from common import machine, stopwatch

from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.planner import plan_situation
from recycle_planner.timing.validate import validate

SPEC = JobSpec.from_dict({
    "stages": 16, "pipelines": 64, "microbatches": 64,
    "time": {"forward": 1.0, "backward_input": 1.1, "backward_weight": 0.9, "p2p": 0.05,
             "allreduce": 4.0, "optimizer": 0.6},
})
FAILED = [(3, 5), (40, 11)]


def once() -> dict:
    times: dict = {}
    policy = Policy()
    with stopwatch(times, "fault-free reference"):
        reference = plan_situation(SPEC, policy).metrics.period
    with stopwatch(times, "build + simulate"):
        plan = plan_situation(SPEC, policy, FAILED, reference=reference)
    with stopwatch(times, "validate"):
        problems = validate(plan)
    assert not problems, problems
    times["total"] = sum(times.values())
    times["ops"] = plan.schedule.n_ops
    times["period"] = plan.metrics.period
    times["degradation"] = plan.metrics.degradation
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    runs = [once() for _ in range(args.repeat)]
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["machine"] = machine()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
