"""Plans made at run time (issue 12): the latency of a situation missing from the library, and
the size and lookup time of the compact library storage.

Usage: python benchmarks/bench_ondemand.py [latency|refine|storage|executor|all]
       [--max-failures F]

- `latency`: on one core (the process pins itself to CPU 0), for examples/gpt.toml and a
  synthetic 1,024-worker job (S=16, D=64, M=64, about 200k ops per plan): the time from the
  launcher's decision that a dead set has no plan to that plan in use by a worker, in steps:
  planning it (`plan_on_demand`, default budget), adding it to the library (compact plan file,
  checksum, index), a worker's lookup (it reads the changed index), loading the plan (parse
  the action strings, recompute the times with the simulator) and compiling that worker's
  program (each worker compiles its own, in parallel). Three missing situations per job, and
  the start of a run without a library (its empty library created, the fault-free situation
  planned the same way).
- `refine`: on one core, the background refinement of the first missing situation of each
  job (plan-all's planning, default budget): its time and its period against the on-demand
  plan's.
- `storage`: the 1,024-worker job's library up to F failures (plan-all defaults, all cores):
  its size on disk in the compact form against the same plans in the timed form (what every
  library held before), the time to open it, look up a dead set and load its plan.
- `executor`: real processes (tiny MLP, 2 stages x 2 pipelines, gloo): seconds from a kill to
  the next generation formed and to the first iteration completed, for a dead set in the
  library and for one planned on demand.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import machine

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"

from recycle_planner.executor.control import protocol as P  # noqa: E402
from recycle_planner.programs import compile_program  # noqa: E402
from recycle_planner.files.planfile import read_plan, write_plan  # noqa: E402
from recycle_planner.job.policy import Policy  # noqa: E402
from recycle_planner.job.spec import JobSpec, load_spec  # noqa: E402
from recycle_planner.job.workers import dead_per_stage  # noqa: E402
from recycle_planner.library import PlanLibrary, Settings, build_library  # noqa: E402
from recycle_planner.library.ondemand import (ON_DEMAND_BUDGET, REFINE_BUDGET,  # noqa: E402
                                              plan_on_demand, refine)


def big_spec() -> JobSpec:
    """The synthetic uniform job of the planner's speed benchmark (benchmarks/README.md)."""
    return JobSpec.from_dict(dict(stages=16, pipelines=64, microbatches=64, time=dict(
        forward=1, backward_input=1.1, backward_weight=0.9, p2p=0.05, allreduce=4,
        optimizer=0.6)))


JOBS = {"gpt": lambda: load_spec(ROOT / "examples" / "gpt.toml"), "1024": big_spec}
MISSING = {"gpt": [[(1, 3)], [(0, 7), (2, 7)], [(0, 0), (1, 4), (3, 7)]],
           "1024": [[(5, 3)], [(0, 15), (9, 15)], [(0, 0), (1, 8), (2, 15)]]}


def latency_once(lib: PlanLibrary, reader: PlanLibrary, dead: list) -> dict:
    spec = lib.spec
    steps = {r: 0 for r in range(spec.workers) if P.worker_of(r, spec.stages) not in dead}
    times = {}
    t0 = time.perf_counter()
    decision = P.decide(1, spec.pipelines, spec.stages, steps, lambda d: None)
    assert decision.action == "plan"
    counts = dead_per_stage(spec, dead)
    plan, placement = plan_on_demand(spec, lib.policy, counts, lib.reference_period,
                                     ON_DEMAND_BUDGET)
    t1 = time.perf_counter()
    entry = lib.add(plan, placement, "on-demand")
    t2 = time.perf_counter()
    hit = reader.lookup(dead, entry.file)
    t3 = time.perf_counter()
    loaded = hit.plan()
    t4 = time.perf_counter()
    members = sorted(steps)
    compile_program(loaded, members[-1], hit.mapping)
    t5 = time.perf_counter()
    times.update(plan_s=t1 - t0, add_s=t2 - t1, lookup_s=t3 - t2, load_s=t4 - t3,
                 compile_s=t5 - t4, total_s=t5 - t0, ops=plan.schedule.n_ops,
                 whole_heuristic=plan.solver["on_demand"]["whole_heuristic"],
                 degradation=plan.metrics.degradation,
                 file_kb=(lib.folder / entry.file).stat().st_size / 1024)
    return times


def latency() -> dict:
    os.sched_setaffinity(0, {0})  # one core
    out = {}
    for name, make in JOBS.items():
        spec = make()
        with tempfile.TemporaryDirectory() as tmp:
            build_library(spec, Policy(), 0, tmp, Settings(solver="heuristic"), jobs=1)
            lib = PlanLibrary.open(tmp)
            reader = PlanLibrary.open(tmp)  # a worker's copy, opened at its start
            rows = [latency_once(lib, reader, dead) for dead in MISSING[name]]
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            lib = PlanLibrary.create(tmp, spec)
            created = time.perf_counter() - t0
            start = latency_once(lib, PlanLibrary.open(tmp), [])
            start["total_s"] += created
        out[name] = {"rows": rows, "median_total_s": statistics.median(r["total_s"] for r in rows),
                     "max_total_s": max(r["total_s"] for r in rows), "startup": start}
        print(f"{name}: " + "; ".join(
            f"{len(d)} dead: plan {r['plan_s']:.3f} + add {r['add_s']:.3f} + lookup "
            f"{r['lookup_s']:.3f} + load {r['load_s']:.3f} + compile {r['compile_s']:.3f} = "
            f"{r['total_s']:.3f} s" for d, r in zip(MISSING[name], rows))
              + f"; start without a library {start['total_s']:.3f} s", flush=True)
    return out


def refinement() -> dict:
    os.sched_setaffinity(0, {0})
    out = {}
    for name, make in JOBS.items():
        spec = make()
        dead = MISSING[name][0]
        counts = dead_per_stage(spec, dead)
        reference = plan_on_demand(spec, Policy(), (0,) * spec.stages, None)[0].metrics.period
        t0 = time.perf_counter()
        quick, _ = plan_on_demand(spec, Policy(), counts, reference)
        t1 = time.perf_counter()
        better, _ = refine(spec, Policy(), counts, reference, REFINE_BUDGET)
        t2 = time.perf_counter()
        out[name] = {"dead": dead, "on_demand_s": t1 - t0, "refine_s": t2 - t1,
                     "on_demand_period": quick.metrics.period,
                     "refined_period": better.metrics.period,
                     "refined_solver": better.solver.get("detail"),
                     "gain": 1 - better.metrics.period / quick.metrics.period}
        print(name, out[name], flush=True)
    return out


def storage(max_failures: int) -> dict:
    spec = big_spec()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "lib"
        t0 = time.perf_counter()
        build_library(spec, Policy(), max_failures, folder, Settings())
        build_s = time.perf_counter() - t0
        compact = sum(p.stat().st_size for p in folder.iterdir())
        index_bytes = (folder / "index.json").stat().st_size
        timed = index_bytes
        sizes = []
        for p in sorted(folder.glob("k*.json.gz")):
            plan = read_plan(p)
            timed += len(write_plan(plan, Path(tmp) / "timed.json.gz"))
            sizes.append(p.stat().st_size)
        opens, lookups, loads = [], [], []
        for dead in ([(5, 3)], [(0, 15)], [(0, 15), (9, 15)] if max_failures > 1 else [(2, 7)]):
            t0 = time.perf_counter()
            lib = PlanLibrary.open(folder)
            t1 = time.perf_counter()
            hit = lib.lookup(dead)
            t2 = time.perf_counter()
            hit.plan()
            t3 = time.perf_counter()
            opens.append(t1 - t0)
            lookups.append(t2 - t1)
            loads.append(t3 - t2)
    out = {"max_failures": max_failures, "situations": len(sizes), "build_s": build_s,
           "compact_bytes": compact, "timed_bytes": timed, "index_bytes": index_bytes,
           "compact_per_plan_kb": statistics.mean(sizes) / 1024,
           "timed_per_plan_kb": (timed - index_bytes) / len(sizes) / 1024,
           "open_s": max(opens), "lookup_s": max(lookups), "load_s": max(loads),
           "open_lookup_load_s": max(a + b + c for a, b, c in zip(opens, lookups, loads))}
    print(json.dumps(out, indent=2), flush=True)
    return out


def executor() -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.executor_checks import TINY, library

    from recycle_planner.executor import LaunchConfig, launch, parse_fault

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, threshold in (("in the library", 1), ("planned on demand", 0)):
            runs = []
            for r in range(3):
                lib = library(Path(tmp) / f"lib{threshold}-{r}", stages=2, pipelines=2,
                              microbatches=8, max_failures=threshold)
                res = launch(TINY, LaunchConfig(nproc=4, run_dir=f"{tmp}/{threshold}-{r}",
                                                faults=[parse_fault("2:6:F1")], refine="off"),
                             ["--library", str(lib), "--iterations", "12",
                              "--device-ms", "2,2,2"])
                planned = [e.data["seconds"] for e in res.events if e.kind == "planned"]
                runs.append({"replanned_s": res.recoveries[0].replanned_after,
                             "first_iteration_s": res.recoveries[0].seconds,
                             "planning_s": planned[0] if planned else 0.0})
            out[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(name, out[name], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="?", default="all",
                        choices=["latency", "refine", "storage", "executor", "all"])
    parser.add_argument("--max-failures", type=int, default=1,
                        help="threshold of the 1,024-worker library of `storage`")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    parts = {"latency": latency, "refine": refinement,
             "storage": lambda: storage(args.max_failures),
             "executor": executor}
    for part in parts if args.part == "all" else [args.part]:
        result = {"machine": machine(), **parts[part]()}
        (RESULTS / f"ondemand-{part}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
