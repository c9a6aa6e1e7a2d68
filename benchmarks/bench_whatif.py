"""What-if benchmarks (issue 5).

1. examples/gpt.toml (8 stages x 4 pipelines, library up to 2 failures, heuristic solver): mean
   throughput of every strategy over a week with a failure every 6 h, 2 h and 30 min (repairs of
   mean 1 h), for seeds 0 .. N-1; seed 0 is what `simulate-trace --mtbf 6h,2h,30min` prints.
   Re-routing with a library up to 4 failures is added as one more row.
2. examples/large.toml (16 stages x 64 pipelines = 1,024 workers, library up to 2 failures): a
   week with a failure every 30 min. Target: the simulation (costing every configuration
   through the planner and replaying the six strategies) under a minute on 2 cores.

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
from recycle_planner.whatif.engine import simulate
from recycle_planner.whatif.strategy import Context, Costs
from recycle_planner.whatif.trace import sample_trace

ROOT = Path(__file__).resolve().parent.parent
WEEK = 7 * 86400.0
FREQUENCIES = (("every 6h", 6 * 3600.0), ("every 2h", 2 * 3600.0), ("every 30min", 1800.0))


def library(spec_path: Path, max_failures: int, folder: Path, times: dict) -> PlanLibrary:
    spec = load_spec(spec_path)
    from recycle_planner.job.policy import Policy

    with stopwatch(times, f"build {folder.name}"):
        build_library(spec, Policy(), max_failures, folder, Settings(solver="heuristic"))
    return PlanLibrary.open(folder, spec=spec)


def gpt_table(work: Path, seeds: int, times: dict) -> dict:
    spec_path = ROOT / "examples" / "gpt.toml"
    libs = {f: library(spec_path, f, work / f"gpt-plans-f{f}", times) for f in (2, 4)}
    spec = libs[2].spec
    out: dict = {"rows": {}, "seed0": {}, "fault_free": None}
    for label, mtbf in FREQUENCIES:
        traces = [(f"{label} seed {s}", sample_trace(spec, mtbf, 3600.0, WEEK, seed=s))
                  for s in range(seeds)]
        study = simulate(Context.from_library(libs[2], Costs()), traces)
        extra = simulate(Context.from_library(libs[4], Costs()), traces, ["reroute"])
        out["fault_free"] = study.ctx.fault_free.rate
        for run, run4 in zip(study.runs, extra.runs):
            for o in run.outcomes + [_renamed(run4.outcomes[0])]:
                out["rows"].setdefault(o.title, {}).setdefault(label, []).append(
                    (o.mean_rate, o.relative))
        out["seed0"][label] = {"failures": study.runs[0].trace.failures,
                               "mean_dead": study.runs[0].trace.dead_counts()[1]}
    return out


def _renamed(outcome):
    outcome.title = "re-routing, library up to 4"
    return outcome


def large_timing(work: Path, times: dict, repeat: int) -> dict:
    spec_path = ROOT / "examples" / "large.toml"
    lib = library(spec_path, 2, work / "large-plans", times)
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        trace = sample_trace(lib.spec, 1800.0, 3600.0, WEEK, seed=0)
        sampling = time.perf_counter() - t0
        study = simulate(Context.from_library(lib, Costs()), [("every 30min", trace)])
        runs.append({"sampling": sampling, **study.seconds,
                     "planner_evaluations": study.ctx.model.evaluations})
    run = study.runs[0]
    cli = [sys.executable, "-m", "recycle_planner.cli", "simulate-trace", str(spec_path),
           "--library", str(work / "large-plans"), "--mtbf", "30min", "-o",
           str(work / "large-out")]
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
            "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "results": {o.title: (o.mean_rate, o.relative) for o in run.outcomes}}


def markdown(gpt: dict, large: dict, seeds: int) -> str:
    labels = [label for label, _ in FREQUENCIES]
    lines = ["| strategy | " + " | ".join(labels) + " |",
             "| --- | " + " | ".join("---:" for _ in labels) + " |"]
    for title, cells in gpt["rows"].items():
        row = []
        for label in labels:
            values = cells[label]
            rate, rel = values[0]
            rels = [r for _, r in values]
            row.append(f"{rate:.1f} ({rel:.1%}); {statistics.mean(rels):.1%} "
                       f"[{min(rels):.0%}-{max(rels):.0%}]")
        lines.append(f"| {title} | " + " | ".join(row) + " |")
    lines.append("")
    lines.append(f"Cells: samples/s (relative) for seed 0; then the mean relative throughput "
                 f"[min-max] over seeds 0-{seeds - 1}. Fault-free {gpt['fault_free']:.1f} "
                 f"samples/s.")
    s = large["seconds"]
    lines += ["", f"1,024 workers, a week, a failure every 30 min: {large['failures']} failures, "
                  f"up to {large['max_dead']} dead at once; simulation {s['total']:.2f} s "
                  f"(costing {s['costing']:.2f} s with {s['planner_evaluations']:.0f} planner "
                  f"runs, replay {s['replay']:.3f} s), sampling {s['sampling']:.3f} s; "
                  f"CLI end to end (with plots) {large['cli_wall_s']:.1f} s (medians of "
                  f"{large['repeat']} runs; load average {large['load']})."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/whatif-bench"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    times: dict = {}
    gpt = gpt_table(args.work, args.seeds, times)
    large = large_timing(args.work, times, args.repeat)
    print(json.dumps({"gpt": gpt, "large": large, "library_build_s": times,
                      "machine": machine()}, indent=1))
    print()
    print(markdown(gpt, large, args.seeds))


if __name__ == "__main__":
    main()
