"""Per-rank programs (issues 22 and 24): a worker's compile of its own program at scale, the
NCCL check once per plan, and the program files of every rank.

Usage: python benchmarks/bench_programs.py [compile|files|all] [--ranks N]

- `compile`: for examples/large.toml (16 stages x 64 pipelines x 32 micro-batches, 1,024
  workers) and the same job with 512 pipelines (8,192 workers), one dead worker (1:3), the plan
  made the way the coordinator makes a missing one (`plan_on_demand`, one list-scheduling pass
  when the whole heuristic does not fit 2 s) and stored compact: what one worker does when a
  generation starts with it (read the plan file, build the plan's index, compile its own program
  and bind it to the generation's group, as the executor does), for N sampled ranks (median and
  largest), and what is done once per plan (the NCCL check over every rank). One core.
- `files`: `recycle-planner plan examples/large.toml --fail 1:3` then `recycle-planner program`
  on that plan: the time and size of every rank's program file.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from common import machine

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(ROOT))

from recycle_planner.files.planfile import read_plan, write_plan  # noqa: E402
from recycle_planner.job.policy import Policy  # noqa: E402
from recycle_planner.job.spec import JobSpec, load_spec  # noqa: E402
from recycle_planner.job.workers import dead_per_stage  # noqa: E402
from recycle_planner.library.ondemand import plan_on_demand  # noqa: E402
from recycle_planner.programs import check_plan, compile_program, plan_index  # noqa: E402
from recycle_planner.programs.compile import _INDEXES  # noqa: E402

DEAD = [(1, 3)]


@contextmanager
def timed(out: dict, key: str):
    """Wall and CPU seconds of the block (the machine is shared: CPU is the steadier figure)."""
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    out[key + "_s"] = time.perf_counter() - wall
    out[key + "_cpu_s"] = time.process_time() - cpu


def jobs() -> dict[str, JobSpec]:
    large = load_spec(ROOT / "examples" / "large.toml")
    data = large.to_dict()
    data.update(name="grid-8192", pipelines=512)
    return {"large.toml (1,024 workers)": large, "8,192 workers": JobSpec.from_dict(data)}


def compile_figures(ranks: int) -> dict:
    os.sched_setaffinity(0, {0})
    try:
        import torch  # noqa: F401 - the executor's bind needs it; its import is not timed
        from recycle_planner.executor.data.runtime import bind
    except ImportError:
        bind = None
    out = {}
    for name, spec in jobs().items():
        row: dict = {"workers": spec.workers}
        with tempfile.TemporaryDirectory() as tmp:
            with timed(row, "plan"):
                plan, _ = plan_on_demand(spec, Policy(), dead_per_stage(spec, DEAD), None)
            path = Path(tmp) / "plan.json.gz"
            write_plan(plan, path, compact=True)
            with timed(row, "load"):
                loaded = read_plan(path)
            with timed(row, "index"):
                plan_index(loaded)
            live = [r for r in range(spec.workers) if (r // spec.stages, r % spec.stages)
                    not in set(plan.failed)]
            sample = live[:: max(1, len(live) // ranks)][:ranks]
            own, cpu, actions = [], [], []
            for rank in sample:
                t0, c0 = time.perf_counter(), time.process_time()
                program = compile_program(loaded, rank)
                if bind is not None:
                    bind(program, live)
                own.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                actions.append(len(program.actions))
            _INDEXES.pop(loaded, None)
            with timed(row, "check"):
                check_plan(loaded)
        row.update(ops=plan.schedule.n_ops, own_median_s=statistics.median(own),
                   own_max_s=max(own), own_median_cpu_s=statistics.median(cpu),
                   own_max_cpu_s=max(cpu), actions_median=statistics.median(actions),
                   sampled=len(sample), bind=bind is not None)
        out[name] = row
        print(name, json.dumps(row), flush=True)
    return out


def files_figures() -> dict:
    cli = [sys.executable, "-m", "recycle_planner.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "fail.json.gz"
        subprocess.run(cli + ["plan", str(ROOT / "examples" / "large.toml"), "--fail", "1:3",
                              "-o", str(plan)], check=True, capture_output=True)
        folder = Path(tmp) / "programs"
        t0 = time.perf_counter()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(cli + ["program", str(plan), "-o", str(folder), "--json"],
                              check=True, capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        wall = time.perf_counter() - t0
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        summary = json.loads(done.stdout)
        sizes = sorted(p.stat().st_size for p in folder.glob("rank-*.json"))
        out = {"wall_s": wall, "cpu_s": cpu, **summary,
               "manifest_bytes": (folder / "programs.json").stat().st_size,
               "rank_file_bytes": {"min": sizes[0], "median": sizes[len(sizes) // 2],
                                   "max": sizes[-1]}}
    print(json.dumps(out, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("compile", "files", "all"), nargs="?", default="all")
    parser.add_argument("--ranks", type=int, default=32, help="ranks sampled per job")
    args = parser.parse_args()
    result = {"machine": machine(), "load": os.getloadavg()}
    if args.what in ("files", "all"):
        result["files"] = files_figures()
    if args.what in ("compile", "all"):
        result["compile"] = compile_figures(args.ranks)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"programs-{args.what}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
