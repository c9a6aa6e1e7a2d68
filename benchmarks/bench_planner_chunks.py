"""Re-routing under the schedules large jobs run: interleaved 1F1B and ZB-V (issue 26).

1. examples/gpt.toml (8 stages x 4 pipelines x 8 micro-batches) with v = 1, 2, 4 chunks per
   worker (interleaved) and with ZB-V (two chunks in a V), one dead worker (1:3) and two (1:3
   and 2:6): the fault-free period, the period with the failure, the degradation and the gap to
   the plan's lower bound, for plain re-routing (1f1b/fused/barrier) and for the default policy
   (1f1b/split/staggered; the heuristic solver, as `recycle-planner plan` runs it).
2. The what-if of the same jobs: a week with a failure every 6 h, 2 h and 30 min (repairs of
   mean 1 h, seed 0), each strategy's mean throughput in samples/s (libraries up to 2 failures,
   heuristic solver, built in --work when missing).
3. examples/large.toml (16 stages x 64 pipelines = 1,024 workers) with v = 2: the time to plan
   one failure on demand (what the coordinator does for a dead set its library lacks), best of
   --repeat runs, target under 2 s.

Usage: python benchmarks/bench_planner_chunks.py [--work /tmp/chunks-bench] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import time
import tomllib
from pathlib import Path

from common import machine, stopwatch

from recycle_planner.job.policy import BASELINE, Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.library import PlanLibrary, Settings, build_library
from recycle_planner.library.ondemand import plan_on_demand
from recycle_planner.planner import plan_situation
from recycle_planner.solvers.heuristic import fault_free_simulation
from recycle_planner.whatif.engine import simulate
from recycle_planner.whatif.strategy import Context, Costs
from recycle_planner.whatif.trace import sample_trace

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = (("1F1B (v = 1)", 1, "interleaved"), ("interleaved, v = 2", 2, "interleaved"),
           ("interleaved, v = 4", 4, "interleaved"), ("ZB-V (v = 2)", 2, "v"))
DEAD = (("1:3", ((1, 3),)), ("1:3, 2:6", ((1, 3), (2, 6))))
POLICIES = (("plain re-routing", BASELINE), ("default", Policy()))
WEEK = 7 * 86400.0
FREQUENCIES = (("6 h", 6 * 3600.0), ("2 h", 2 * 3600.0), ("30 min", 1800.0))


def job(path: Path, chunks: int, layout: str) -> JobSpec:
    data = tomllib.loads(path.read_text())
    if chunks > 1:
        data.update(chunks=chunks, layout=layout)
    return JobSpec.from_dict(data, str(path))


def periods_table() -> list[dict]:
    rows = []
    for name, chunks, layout in LAYOUTS:
        spec = job(ROOT / "examples" / "gpt.toml", chunks, layout)
        for label, policy in POLICIES:
            fault_free = plan_situation(spec, policy).metrics.period
            for dead, failed in DEAD:
                t0 = time.perf_counter()
                m = plan_situation(spec, policy, failed, reference=fault_free).metrics
                rows.append({"schedule": name, "dead": dead, "policy": label,
                             "fault_free": fault_free, "period": m.period,
                             "degradation": m.degradation, "gap": m.gap,
                             "seconds": time.perf_counter() - t0})
    return rows


def whatif_table(work: Path, times: dict) -> dict:
    out: dict = {}
    for name, chunks, layout in LAYOUTS:
        spec = job(ROOT / "examples" / "gpt.toml", chunks, layout)
        folder = work / f"gpt-v{chunks}-{layout}"
        with stopwatch(times, f"library {folder.name}"):
            build_library(spec, Policy(), 2, folder, Settings(solver="heuristic"))
        lib = PlanLibrary.open(folder, spec=spec)
        for label, mtbf in FREQUENCIES:
            trace = sample_trace(spec, mtbf, 3600.0, WEEK, seed=0)
            study = simulate(Context.from_library(lib, Costs()), [(label, trace)])
            out.setdefault(name, {})[label] = {o.title: o.mean_rate
                                               for o in study.runs[0].outcomes}
            out[name]["fault-free"] = study.ctx.fault_free.rate
    return out


def large_on_demand(repeat: int) -> dict:
    spec = job(ROOT / "examples" / "large.toml", 2, "interleaved")
    reference = fault_free_simulation(spec, Policy()).period
    counts = (0, 0, 0, 1) + (0,) * 12
    seconds, period = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan, _ = plan_on_demand(spec, Policy(), counts, reference)
        seconds.append(time.perf_counter() - t0)
        period = plan.metrics.period
    return {"ops": plan.schedule.n_ops, "seconds": min(seconds), "all_seconds": seconds,
            "period": period, "fault_free": reference}


def markdown(periods: list[dict], whatif: dict, large: dict) -> str:
    lines = ["| schedule | dead | policy | fault-free (ms) | with failure (ms) | degradation "
             "| gap to bound |", "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in periods:
        lines.append(f"| {r['schedule']} | {r['dead']} | {r['policy']} | {r['fault_free']:.1f} "
                     f"| {r['period']:.1f} | {r['degradation']:+.1%} | {r['gap']:.1%} |")
    strategies = list(next(iter(next(iter(whatif.values())).values())).keys())
    lines += ["", "| schedule | failure every | fault-free | " + " | ".join(strategies) + " |",
              "| --- | --- | ---: | " + " | ".join("---:" for _ in strategies) + " |"]
    for name, per in whatif.items():
        for label, _ in FREQUENCIES:
            cells = " | ".join(f"{per[label][s]:.1f}" for s in strategies)
            lines.append(f"| {name} | {label} | {per['fault-free']:.1f} | {cells} |")
    lines += ["", f"large.toml, v = 2, one failure on demand: {large['seconds']:.2f} s "
              f"({large['ops']:,} ops; period {large['period']:.2f} ms, fault-free "
              f"{large['fault_free']:.2f} ms)"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/chunks-bench"))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    times: dict = {}
    with stopwatch(times, "periods"):
        periods = periods_table()
    whatif = whatif_table(args.work, times)
    large = large_on_demand(args.repeat)
    result = {"machine": machine(), "periods": periods, "whatif": whatif,
              "large_on_demand": large, "seconds": times}
    out = ROOT / "benchmarks" / "results" / "planner_chunks.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(periods, whatif, large))
    print(f"\n{machine()}; seconds: {json.dumps({k: round(v, 1) for k, v in times.items()})}")


if __name__ == "__main__":
    main()
