"""What-if benchmarks (issues 5 and 12).

1. examples/gpt.toml (8 stages x 4 pipelines, library up to 2 failures, heuristic solver): mean
   throughput of every strategy over a week with a failure every 6 h, 2 h and 30 min (repairs of
   mean 1 h), for seeds 0 .. N-1; seed 0 is what `simulate-trace --mtbf 6h,2h,30min` prints.
   Three tables: (a, b) every strategy, re-routing with on-demand planning and with the library
   only (a library up to 4 failures added as one more row); (c) the same with every strategy
   but re-routing on plain 1F1B (`--baseline-policy 1f1b/fused/barrier`); (d) hosts of 4
   workers failing as one (`--workers-per-host 4`).
2. examples/large.toml (16 stages x 64 pipelines = 1,024 workers, library up to 2 failures): a
   week with a failure every 30 min. Target: the simulation (costing every configuration
   through the planner and replaying the strategies) under a minute on 2 cores. Re-routing
   with on-demand planning is left out there: it plans every unseen situation of the trace
   (the time of one is measured apart, on two situations of 3 dead workers).

Libraries are built when missing (resumable, in --work) and their build time is reported
apart. Usage: python benchmarks/bench_whatif.py [--seeds 5] [--work /tmp/whatif-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import machine, stopwatch

from recycle_planner.job.spec import load_spec
from recycle_planner.library import PlanLibrary, Settings, build_library
from recycle_planner.job.policy import BASELINE
from recycle_planner.job.situations import logical_failed, packed
from recycle_planner.planner import solve
from recycle_planner.whatif.engine import STRATEGIES, simulate
from recycle_planner.whatif.hosts import Hosts
from recycle_planner.whatif.strategy import Context, Costs
from recycle_planner.whatif.trace import sample_trace

ROOT = Path(__file__).resolve().parent.parent
WEEK = 7 * 86400.0
FREQUENCIES = (("every 6h", 6 * 3600.0), ("every 2h", 2 * 3600.0), ("every 30min", 1800.0))
# (table, baseline policy or None for the library's, workers per host)
TABLES = (("a-b", None, 1), ("c: baselines on plain 1F1B", BASELINE, 1),
          ("d: hosts of 4 workers", None, 4))


def library(spec_path: Path, max_failures: int, folder: Path, times: dict) -> PlanLibrary:
    spec = load_spec(spec_path)
    from recycle_planner.job.policy import Policy

    with stopwatch(times, f"build {folder.name}"):
        build_library(spec, Policy(), max_failures, folder, Settings(solver="heuristic"))
    return PlanLibrary.open(folder, spec=spec)


def gpt_tables(work: Path, seeds: int, times: dict) -> dict:
    spec_path = ROOT / "examples" / "gpt.toml"
    libs = {f: library(spec_path, f, work / f"gpt-plans-f{f}", times) for f in (2, 4)}
    spec = libs[2].spec
    out: dict = {}
    for table, policy, per_host in TABLES:
        hosts = Hosts(spec.stages, spec.pipelines, per_host) if per_host > 1 else None
        res: dict = {"rows": {}, "seed0": {}, "on_demand": {}}
        t0 = time.perf_counter()
        for label, mtbf in FREQUENCIES:
            traces = [(f"{label} seed {s}",
                       sample_trace(spec, mtbf, 3600.0, WEEK, seed=s, hosts=hosts))
                      for s in range(seeds)]
            costs = Costs(spares=Costs().spares * per_host)  # 2 spare hosts
            study = simulate(Context.from_library(libs[2], costs, policy), traces)
            runs4 = [None] * seeds
            if policy is None and per_host == 1:
                runs4 = simulate(Context.from_library(libs[4], Costs()), traces,
                                 ["reroute-library-only"]).runs
            res["fault_free"] = study.ctx.fault_free.rate
            res["library_fault_free"] = study.ctx.speed(libs[2].fault_free_period).rate
            for run, run4 in zip(study.runs, runs4):
                extra = [_renamed(run4.outcomes[0])] if run4 is not None else []
                for o in run.outcomes + extra:
                    res["rows"].setdefault(o.title, {}).setdefault(label, []).append(
                        (o.mean_rate, o.relative))
            first = study.runs[0]
            most, mean = first.trace.dead_counts()
            res["seed0"][label] = {"failures": first.trace.failures, "max_dead": most,
                                   "mean_dead": mean}
            reroute = next(o for o in first.outcomes if o.strategy == "reroute")
            res["on_demand"][label] = {"planned": reroute.planned,
                                       "planning_s": reroute.planning}
        res["seconds"] = time.perf_counter() - t0
        out[table] = res
    return out


def _renamed(outcome):
    outcome.title = "re-routing, library only, up to 4"
    return outcome


def large_timing(work: Path, times: dict, repeat: int) -> dict:
    spec_path = ROOT / "examples" / "large.toml"
    lib = library(spec_path, 2, work / "large-plans", times)
    names = [n for n in STRATEGIES if n != "reroute"]
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        trace = sample_trace(lib.spec, 1800.0, 3600.0, WEEK, seed=0)
        sampling = time.perf_counter() - t0
        study = simulate(Context.from_library(lib, Costs()), [("every 30min", trace)], names)
        runs.append({"sampling": sampling, **study.seconds,
                     "planner_evaluations": study.ctx.model.evaluations})
    run = study.runs[0]
    on_demand = []
    for counts in ((1, 1, 1) + (0,) * 13, (2, 0, 1) + (0,) * 13):
        t0 = time.perf_counter()
        solve(lib.spec, lib.policy, logical_failed(packed(counts)), "heuristic")
        on_demand.append(time.perf_counter() - t0)
    cli = [sys.executable, "-m", "recycle_planner.cli", "simulate-trace", str(spec_path),
           "--library", str(work / "large-plans"), "--mtbf", "30min", "--strategies",
           ",".join(names), "-o", str(work / "large-out")]
    walls = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(cli, check=True, capture_output=True)
        walls.append(time.perf_counter() - t0)
    cli_wall = statistics.median(walls)
    return {"workers": lib.spec.workers, "failures": run.trace.failures,
            "events": len(run.trace.events), "max_dead": run.trace.dead_counts()[0],
            "mean_dead": run.trace.dead_counts()[1],
            "seconds": {k: statistics.median(r[k] for r in runs) for k in runs[0]},
            "cli_wall_s": cli_wall, "cli": " ".join(cli[2:]), "repeat": repeat,
            "on_demand_plan_s": on_demand,
            "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "results": {o.title: (o.mean_rate, o.relative) for o in run.outcomes}}


def markdown(gpt: dict, large: dict | None, seeds: int) -> str:
    labels = [label for label, _ in FREQUENCIES]
    lines = []
    for table, res in gpt.items():
        lines += [f"{table}:", "", "| strategy | " + " | ".join(labels) + " |",
                  "| --- | " + " | ".join("---:" for _ in labels) + " |"]
        for title, cells in res["rows"].items():
            row = []
            for label in labels:
                values = cells[label]
                rate, rel = values[0]
                rels = [r for _, r in values]
                row.append(f"{rate:.1f} ({rel:.1%}); {statistics.mean(rels):.1%} "
                           f"[{min(rels):.0%}-{max(rels):.0%}]")
            lines.append(f"| {title} | " + " | ".join(row) + " |")
        lines.append("")
        lines.append(f"Cells: samples/s (relative) for seed 0; then the mean relative "
                     f"throughput [min-max] over seeds 0-{seeds - 1}. Fault-free "
                     f"{res['fault_free']:.1f} samples/s (library's policy "
                     f"{res['library_fault_free']:.1f}). Seed 0: " + "; ".join(
                         f"{label}: {v['failures']} failures, up to {v['max_dead']} dead, "
                         f"{v['mean_dead']:.2f} on average, {res['on_demand'][label]['planned']}"
                         f" planned on demand ({res['on_demand'][label]['planning_s']:.2f} s)"
                         for label, v in res["seed0"].items())
                     + f". {res['seconds']:.0f} s for the table.")
        lines.append("")
    if large is None:
        return "\n".join(lines)
    s = large["seconds"]
    lines += ["", f"1,024 workers, a week, a failure every 30 min: {large['failures']} failures, "
                  f"up to {large['max_dead']} dead at once; simulation {s['total']:.2f} s "
                  f"(costing {s['costing']:.2f} s with {s['planner_evaluations']:.0f} planner "
                  f"runs, replay {s['replay']:.3f} s), sampling {s['sampling']:.3f} s; "
                  f"CLI end to end (with plots) {large['cli_wall_s']:.1f} s (medians of "
                  f"{large['repeat']} runs; load average {large['load']}). Planning one unseen "
                  f"situation (3 dead) on demand with the heuristic: "
                  + ", ".join(f"{s:.1f} s" for s in large["on_demand_plan_s"]) + "."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/whatif-bench"))
    parser.add_argument("--only", choices=("gpt", "large"),
                        help="one part only (the 1,024-worker library takes minutes)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    times: dict = {}
    gpt = gpt_tables(args.work, args.seeds, times) if args.only != "large" else {}
    large = large_timing(args.work, times, args.repeat) if args.only != "gpt" else None
    print(json.dumps({"gpt": gpt, "large": large, "library_build_s": times,
                      "machine": machine()}, indent=1))
    print()
    print(markdown(gpt, large, args.seeds))


if __name__ == "__main__":
    main()
