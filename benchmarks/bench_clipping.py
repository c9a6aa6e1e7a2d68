"""Step time with global-norm clipping: the barrier against optimizer post-validation.

Usage: python benchmarks/bench_clipping.py [--workload gpt|device] [--repeat N]
                                           [--iterations N] [--clip NORM] [--kill WORKER]
                                           [--cpu-quota CPUS] [--json FILE]

The small GPT of examples/gpt_small.py (float32, no LR schedule, clipped to `--clip`), or
with `--workload device` the tiny MLP whose passes sleep 2 ms each with the CPU free (as on a
GPU: step times show the schedule, not the machine's load; bench_executor.py's `device`), 2
stages x 2 pipelines x 8 micro-batches on local CPU processes (gloo), profiled once and
planned with the default policy (split backward, staggered optimizer). Each repeat trains it
four times, alternating: with `--clip-barrier` (every stage waits for the global norm before
its step) and without (each stage steps at once with the factor its own norm allows and
checks it when the global norm arrives, `executor/data/validation.py`), fault-free and with
a worker killed mid-forward at the middle iteration (`--kill`: 0:1 by default, whose
micro-batches 1:1 then runs too, so that stage 1 finishes last and stage 0 could start the
next iteration before it; or 1:0, whose micro-batches go to 0:0, the stage that finishes last
anyway). Step time: the median time between iteration ends from iteration 5 (or
from two iterations after the restart, for the re-routed plan); the table shows the median
over the repeats, and how many steps were redone (the guess was wrong) or taken late (the
stage's own norm was over the limit, so it waited for the global one) out of all steps.

`--cpu-quota CPUS` gives every worker and the profiling process a cgroup of its own with that
many CPUs (as `bench_executor.py`'s; root and cgroup v1): one "device" per worker, so that a
stage waiting for the norm leaves its CPU idle instead of lending it to the others, as a GPU
would.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path

from bench_executor import (D, GPT, KILLS, M, QUOTA_SHARES, S, TINY, WORKLOADS, median_step,
                            profile, run_ours)
from common import machine
from cpu_quota import CpuQuota, QuotaGroups

from recycle_planner.executor import parse_fault
from recycle_planner.io import write_json
from recycle_planner.job.policy import Policy
from recycle_planner.library import PlanLibrary, Settings, build_library

MODES = {"barrier": ["--clip-barrier"], "post-validated": []}
JOBS = {"gpt": (GPT, ["--dtype", "float32", "--warmup", "0"]),
        "device": (TINY, WORKLOADS["device"][1])}
"""Per `--workload`: the job and its arguments (clipping added)."""


def settled(res) -> dict[str, int]:
    """Steps counted, redone and taken late, over every worker and generation."""
    out = {"steps": 0, "REDO": 0, "LATE": 0}
    for by_gen in res.op_times.values():
        for table in by_gen.values():
            out["steps"] += table["OPTIMIZER"][0]
            for kind in ("REDO", "LATE"):
                out[kind] += table.get(kind, [0])[0]
    return out


def one_run(target: str, job_args: list[str], lib: PlanLibrary, work: Path,
            kill_at: int | None, rank: str, quota: QuotaGroups | None) -> dict:
    faults = [parse_fault(f"{rank}:{kill_at}:F1")] if kill_at is not None else []
    res = run_ours(target, job_args, lib, work, quota, faults)
    row = {"step_ms": median_step(res.iteration_end, 5, kill_at), **settled(res)}
    if kill_at is not None:
        gen = [e.data for e in res.events if e.kind == "generation"][-1]
        row["rerouted_ms"] = median_step(res.iteration_end, gen["restart"] + 2)
        row["plan"] = gen["plan"]
    return row


def run(workload: str, repeat: int, iterations: int, clip: float, kill: str, work: Path,
        quota: QuotaGroups | None) -> dict:
    target, base = JOBS[workload]
    job_args = [*base, "--clip", str(clip), "--iterations", str(iterations)]
    spec = profile(f"{workload}-clip", target, job_args, work, quota)
    folder = work / "lib"
    build_library(spec, Policy(), 1, folder, Settings(solver="heuristic"), jobs=1)
    lib = PlanLibrary.open(folder)
    rows: dict[str, list[dict]] = {f"{mode} {case}": [] for mode in MODES
                                   for case in ("fault-free", "kill")}
    for r in range(repeat):
        for mode, extra in MODES.items():
            for case, kill_at in (("fault-free", None), ("kill", iterations // 2)):
                row = one_run(target, job_args + extra, lib, work / f"{mode}-{case}-{r}",
                              kill_at, KILLS[kill], quota)
                logging.info("%s %s run %d: %s", mode, case, r, json.dumps(row))
                rows[f"{mode} {case}"].append(row)
    return {"spec": spec.to_dict(), "predicted_ms": lib.fault_free_period,
            "predicted_rerouted_ms": lib.lookup([tuple(map(int, kill.split(":")))]).entry.period,
            "runs": rows}


def markdown(results: dict) -> str:
    runs = results["runs"]
    lines = ["| clipping | fault-free step (ms) | step before the kill (ms) | step on the "
             f"re-routed plan, {results['kill']} dead (ms) | steps redone / taken late / all |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for mode in MODES:
        free, kill = runs[f"{mode} fault-free"], runs[f"{mode} kill"]
        counts = [sum(r[k] for r in free + kill) for k in ("REDO", "LATE", "steps")]
        lines.append(f"| {mode} | {statistics.median(r['step_ms'] for r in free):.1f} | "
                     f"{statistics.median(r['step_ms'] for r in kill):.1f} | "
                     f"{statistics.median(r['rerouted_ms'] for r in kill):.1f} | "
                     f"{counts[0]} / {counts[1]} / {counts[2]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(JOBS), default="gpt")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--clip", type=float, default=1.0, help="the global gradient norm")
    parser.add_argument("--kill", choices=sorted(KILLS), default="0:1",
                        help="the worker (pipeline:stage) killed mid-run")
    parser.add_argument("--cpu-quota", type=float, default=None, metavar="CPUS",
                        help="CPUs per worker process, fixed (cgroup v1 CFS quota)")
    parser.add_argument("--cpu-period-us", type=int, default=CpuQuota.period_us,
                        help="the quota's period")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally: workers, cgroups
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load = os.getloadavg()[0]
    quota = None
    if args.cpu_quota is not None:
        quota = QuotaGroups(CpuQuota(args.cpu_quota, args.cpu_period_us, QUOTA_SHARES))
    with tempfile.TemporaryDirectory(prefix="bench-clipping-") as tmp, \
            quota or contextlib.nullcontext():
        results = run(args.workload, args.repeat, args.iterations, args.clip, args.kill,
                      Path(tmp), quota)
    results.update(machine=machine(), grid=f"{S} stages x {D} pipelines x {M} micro-batches",
                   repeat=args.repeat, iterations=args.iterations, clip=args.clip,
                   kill=args.kill, workload=args.workload,
                   cpu_quota=quota.quota.to_dict() if quota else None,
                   load_average=[load, os.getloadavg()[0]])
    if args.json:
        write_json(args.json, results)
    quota_text = f"; {args.cpu_quota} CPU per process" if quota else ""
    print(f"machine: {results['machine']}; {args.workload}, clip {args.clip}; "
          f"{results['grid']}; {args.repeat} runs each"
          f"{quota_text}; "
          f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after; planner's "
          f"period {results['predicted_ms']:.1f} ms fault-free, "
          f"{results['predicted_rerouted_ms']:.1f} ms with {args.kill} dead")
    print(markdown(results))


if __name__ == "__main__":
    sys.exit(main())
