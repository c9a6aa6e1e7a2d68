"""Planner benchmarks (issue 3): optimality on small instances, plan quality per policy on the
examples, and the speed of whole libraries.

Usage:
  python benchmarks/bench_planner.py optimality [--node-limit N] [--time-limit S] [--work-limit W]
  python benchmarks/bench_planner.py quality
  python benchmarks/bench_planner.py speed [--big] [--prove]
  python benchmarks/bench_planner.py library [--prove]
Each prints a markdown table and writes JSON next to it under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import machine

from recycle_planner.errors import RecycleError
from recycle_planner.job.policy import BASELINE, Policy
from recycle_planner.job.spec import JobSpec, load_spec
from recycle_planner.library import PlanLibrary, Settings, build_library
from recycle_planner.planner import plan_situation
from recycle_planner.solvers.bounds import lower_bound
from recycle_planner.solvers.dp import dp_plan
from recycle_planner.solvers.exhaustive import exhaustive
from recycle_planner.solvers.heuristic import heuristic
from recycle_planner.solvers.cp import cp_solution
from recycle_planner.solvers.milp import run_milp
from recycle_planner.solvers.milp_model import estimated_pairs

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SPLIT = Policy("1f1b", decouple=True, stagger=False)
POLICIES = [("plain re-routing", BASELINE), ("+ I/W split", SPLIT),
            ("+ staggered optimizer", Policy())]


def spec(S, D, M, **time) -> JobSpec:
    costs = dict(forward=1, backward_input=1, backward_weight=1, p2p=0, allreduce=0, optimizer=0)
    costs.update(time)
    return JobSpec.from_dict(dict(stages=S, pipelines=D, microbatches=M, time=costs))


NON_UNIFORM = dict(forward=[1, 1.5, 1, 2], backward_input=[1, 1.5, 1, 2],
                   backward_weight=[1, 1, 0.5, 1.5], p2p=0.5)
OPTIMALITY = [
    # (name, spec, policy, failed)
    ("2x2x1 uniform", spec(2, 2, 1), Policy(), ((1, 1),)),
    ("2x3x1 p2p, 2 failures", spec(2, 3, 1, p2p=0.25), Policy(), ((1, 0), (0, 1))),
    ("3x3x1 p2p, 2 failures", spec(3, 3, 1, p2p=0.25), SPLIT, ((1, 0), (0, 2))),
    ("2x2x2 p2p, plain", spec(2, 2, 2, p2p=0.5), BASELINE, ((1, 1),)),
    ("2x2x2 uniform", spec(2, 2, 2), Policy(), ((1, 1),)),
    ("3x2x3 p2p, plain", spec(3, 2, 3, p2p=0.25), BASELINE, ((0, 0),)),
    ("3x2x4 p2p", spec(3, 2, 4, p2p=0.2), Policy(), ((1, 1),)),
    ("4x2x4 plain", spec(4, 2, 4), BASELINE, ((0, 2),)),
    ("4x2x4 non-uniform", spec(4, 2, 4, **NON_UNIFORM), Policy(), ((1, 1),)),
    ("4x3x6 non-uniform, barrier", spec(4, 3, 6, **NON_UNIFORM), SPLIT, ((1, 2),)),
    ("4x4x8 uniform", spec(4, 4, 8), Policy(), ((1, 2),)),
    ("4x4x8 non-uniform", spec(4, 4, 8, **NON_UNIFORM), Policy(), ((2, 3),)),
    ("4x4x8 p2p, 2 failures", spec(4, 4, 8, p2p=0.5), Policy(), ((0, 1), (2, 2))),
    # Issue 13's instances (costs as the issue gives them; where it does not, as noted).
    ("issue: 4x2x8 unit", spec(4, 2, 8), SPLIT, ((0, 1), (1, 2))),
    ("issue: 4x4x16 F=I=W=20", spec(4, 4, 16, forward=20, backward_input=20,
                                    backward_weight=20), Policy(), ((1, 2),)),
    ("issue: 3x3x4 (test library's job)", spec(3, 3, 4, p2p=0.1, allreduce=0.5), Policy(),
     ((1, 1),)),
    ("issue: 4x4x16 unit, barrier", spec(4, 4, 16), SPLIT, ((1, 2),)),
    ("issue: 4x2x8 unit, plain", spec(4, 2, 8), BASELINE, ((0, 1), (1, 2))),
    ("issue: GPT example, M=16", None, SPLIT, ((1, 3),)),
]


MILP_MAX_PAIRS = 200_000  # beyond this the big-M model takes minutes just to build


def gpt16() -> JobSpec:
    """The GPT example with 16 micro-batches (a spec is edited as its dict and read back, which
    re-validates it)."""
    data = load_spec(ROOT / "examples" / "gpt.toml").to_dict()
    return JobSpec.from_dict({**data, "microbatches": 16})


def optimality(node_limit: int, time_limit: float, work_limit: float,
               only: tuple[str, ...] = ()) -> dict:
    """The optimality table; `only`: the instances whose names contain one of these words."""
    rows = []
    for name, job, policy, failed in OPTIMALITY:
        if only and not any(word in name for word in only):
            continue
        job = job or gpt16()
        h = heuristic(job, policy, failed).simulation
        d = dp_plan(job, policy, failed).simulation
        warm = h if h.period <= d.period else d
        t0 = time.perf_counter()
        res = None
        if estimated_pairs(job, policy, failed) <= MILP_MAX_PAIRS:
            res = run_milp(job, policy, failed, time_limit, "highs", warm, node_limit=node_limit)
        secs = time.perf_counter() - t0
        print(f"{name}: MILP {res and res.status} {res and res.objective} in {secs:.1f} s",
              file=sys.stderr, flush=True)
        t0, c0 = time.perf_counter(), time.process_time()
        cp_sim, cp_info, cp_bound = cp_solution(job, policy, failed, work_limit, warm)
        cp_secs, cp_cpu = time.perf_counter() - t0, time.process_time() - c0
        cp_proven = cp_bound is not None and cp_sim.period <= cp_bound * (1 + 1e-9)
        exact = None
        try:
            t1 = time.perf_counter()
            truth = exhaustive(job, policy, failed, limit=60_000)
            exact = {"period": truth.best.period, "plans": truth.plans_tried,
                     "seconds": time.perf_counter() - t1}
        except RecycleError:
            pass
        milp = {"objective": None, "status": "not run (model too large)", "bound": None,
                "size": {}} if res is None else vars(res)
        best = min(x for x in (milp["objective"], cp_sim.period, warm.period) if x is not None)
        proven = max(x for x in (milp["bound"], cp_bound, lower_bound(job, policy, failed).value)
                     if x is not None)
        rows.append({"instance": name, "policy": policy.label, "failed": failed,
                     "lower_bound": lower_bound(job, policy, failed).value,
                     "heuristic": h.period, "dp": d.period, "milp": milp["objective"],
                     "milp_status": milp["status"], "milp_bound": milp["bound"],
                     "milp_seconds": secs,
                     "cp": cp_sim.period, "cp_status": cp_info["status"], "cp_bound": cp_bound,
                     "cp_proven": cp_proven, "cp_probes": cp_info.get("probes", []),
                     "cp_seconds": cp_secs, "cp_cpu": cp_cpu, "best": best, "best_bound": proven,
                     "gap": best / proven - 1,
                     "binaries": milp["size"].get("binaries"),
                     "exhaustive": exact,
                     "heuristic_gap": h.period / best - 1, "dp_gap": d.period / best - 1})
    lines = ["| instance | policy | lower bound | heuristic | DP | MILP (status) | MILP bound | "
             "MILP time | CP (status) | CP bound | CP time (wall / CPU) | exhaustive | "
             "best / proven gap |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def num(x):
        return "-" if x is None else f"{x:.4g}"

    for r in rows:
        ex = "-" if r["exhaustive"] is None else \
            f"{r['exhaustive']['period']:.4g} ({r['exhaustive']['plans']} plans)"
        status = "optimal" if r["milp_status"] == "Optimal" else \
            "not run" if r["milp"] is None and r["milp_status"].startswith("not") else "stopped"
        cp_status = "optimal" if r["cp_proven"] else "stopped"
        lines.append(f"| {r['instance']} | {r['policy']} | {r['lower_bound']:.4g} | "
                     f"{r['heuristic']:.4g} | {r['dp']:.4g} | {num(r['milp'])} ({status}) | "
                     f"{num(r['milp_bound'])} | {r['milp_seconds']:.1f} s | {num(r['cp'])} "
                     f"({cp_status}) | {num(r['cp_bound'])} | "
                     f"{r['cp_seconds']:.1f} / {r['cp_cpu']:.1f} s | "
                     f"{ex} | "
                     f"{num(r['best'])} / {num(r['best_bound'])} ({r['gap']:.1%}) |")
    return {"rows": rows, "table": "\n".join(lines),
            "settings": {"node_limit": node_limit, "time_limit": time_limit,
                         "work_limit": work_limit, "only": list(only)}}


def quality() -> dict:
    """Degradation with 1, 2, 3 failures for each policy on the examples, libraries built
    with solver auto; the gap of each plan to its lower bound."""
    rows = []
    for path in (ROOT / "examples" / "gpt.toml", ROOT / "examples" / "small.toml"):
        job = load_spec(path)
        plain_ff = plan_situation(job, BASELINE).metrics.period
        for label, policy in POLICIES:
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                build_library(job, policy, 3, tmp, Settings(solver="auto", time_limit=10,
                                                             node_limit=500))
                secs = time.perf_counter() - t0
                lib = PlanLibrary.open(tmp)
                entries = lib.entries()
            for n in (1, 2, 3):
                es = [e for e in entries if sum(e.failed_per_stage) == n]
                if not es:
                    continue
                deg = [e.metrics.degradation for e in es]
                vs_plain = [e.metrics.period / plain_ff - 1 for e in es]
                gap = [e.metrics.gap for e in es]
                rows.append({"example": job.name, "policy": label, "failures": n,
                             "situations": len(es), "mean_degradation": statistics.mean(deg),
                             "worst_degradation": max(deg),
                             "mean_vs_plain_fault_free": statistics.mean(vs_plain),
                             "worst_vs_plain_fault_free": max(vs_plain),
                             "mean_gap": statistics.mean(gap), "worst_gap": max(gap),
                             "optimal": sum(bool(e.metrics.optimal) for e in es),
                             "library_seconds": secs, "fault_free": lib.fault_free_period,
                             "plain_fault_free": plain_ff})
            all_gaps = [e.metrics.gap for e in entries]
            rows.append({"example": job.name, "policy": label, "failures": "all",
                         "situations": len(entries), "mean_gap": statistics.mean(all_gaps),
                         "worst_gap": max(all_gaps), "library_seconds": secs,
                         "optimal": sum(bool(e.metrics.optimal) for e in entries)})
    lines = ["| example | policy | failures | situations | mean / worst degradation | "
             "mean / worst vs plain 1F1B fault-free | mean / worst gap | optimal |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["failures"] == "all":
            lines.append(f"| {r['example']} | {r['policy']} | library (0-3) | {r['situations']} "
                         f"| | | {r['mean_gap']:.2%} / {r['worst_gap']:.2%} | "
                         f"{r['optimal']}/{r['situations']} |")
            continue
        lines.append(f"| {r['example']} | {r['policy']} | {r['failures']} | {r['situations']} | "
                     f"{r['mean_degradation']:+.1%} / {r['worst_degradation']:+.1%} | "
                     f"{r['mean_vs_plain_fault_free']:+.1%} / {r['worst_vs_plain_fault_free']:+.1%}"
                     f" | {r['mean_gap']:.2%} / {r['worst_gap']:.2%} | "
                     f"{r['optimal']}/{r['situations']} |")
    return {"rows": rows, "table": "\n".join(lines)}


def speed(big: bool) -> dict:
    cases = [("S=8, D=8, M=16, F=3", spec(8, 8, 16, forward=1, backward_input=1.1,
                                         backward_weight=0.9, p2p=0.05, allreduce=4,
                                         optimizer=0.6), 3)]
    if big:
        cases.append(("S=16, D=64, M=64, F=2", spec(16, 64, 64, forward=1, backward_input=1.1,
                                                    backward_weight=0.9, p2p=0.05, allreduce=4,
                                                    optimizer=0.6), 2))
    rows = []
    for name, job, f in cases:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            index = build_library(job, Policy(), f, tmp, Settings(solver="auto"))
            secs = time.perf_counter() - t0
            size = sum(p.stat().st_size for p in Path(tmp).iterdir())
            gaps = [e.metrics.gap or 0.0 for e in index.entries]
        rows.append({"library": name, "situations": len(index.entries), "seconds": secs,
                     "mean_gap": statistics.mean(gaps), "worst_gap": max(gaps),
                     "megabytes": size / 1e6})
    lines = ["| library | situations | time (2 cores) | mean / worst gap | size on disk |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['library']} | {r['situations']} | {r['seconds']:.1f} s | "
                     f"{r['mean_gap']:.2%} / {r['worst_gap']:.2%} | {r['megabytes']:.0f} MB |")
    return {"rows": rows, "table": "\n".join(lines)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=["optimality", "quality", "speed"])
    parser.add_argument("--node-limit", type=int, default=20_000)
    parser.add_argument("--time-limit", type=float, default=120.0)
    parser.add_argument("--work-limit", type=float, default=30.0,
                        help="the CP engine's deterministic seconds per instance")
    parser.add_argument("--big", action="store_true", help="also the 1,024-worker library")
    parser.add_argument("--only", action="append", default=[], metavar="WORDS",
                        help="optimality: only the instances whose names contain WORDS "
                             "(repeatable; the results then go to planner-optimality-only.json)")
    args = parser.parse_args()
    if args.which == "optimality":
        out = optimality(args.node_limit, args.time_limit, args.work_limit, tuple(args.only))
    elif args.which == "quality":
        out = quality()
    else:
        out = speed(args.big)
    out["machine"] = machine()
    RESULTS.mkdir(exist_ok=True)
    suffix = "-only" if args.only else ""
    (RESULTS / f"planner-{args.which}{suffix}.json").write_text(
        json.dumps(out, indent=1, default=str))
    print(out["table"])
    print(f"\nmachine: {out['machine']}", file=sys.stderr)


if __name__ == "__main__":
    main()
