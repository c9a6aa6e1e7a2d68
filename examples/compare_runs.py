"""Compare the final parameters and losses of two training runs, and of a single process.

    python examples/compare_runs.py RUN_A RUN_B [--reference JOB] [--rtol 1e-5] [-- JOB ARGS]

RUN_A and RUN_B are run folders of `recycle-planner launch` (their latest complete checkpoint
and result.json are read). With --reference, the job is also trained in one process
(recycle_planner.executor.train_reference) with the runs' pipelines and micro-batches. Prints
the largest relative differences and exits 1 if one exceeds --rtol.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from recycle_planner.executor import load_job, train_reference
from recycle_planner.executor.data.state import latest_checkpoint, load_stage_checkpoint


def run_state(folder: Path) -> tuple[dict, list[dict]]:
    result = json.loads((folder / "result.json").read_text())
    found = latest_checkpoint(folder)
    if found is None:
        raise SystemExit(f"{folder}: no complete checkpoint")
    stages = result["spec"]["stages"]
    return result, [load_stage_checkpoint(found[1], s)["model"] for s in range(stages)]


def param_diff(a: list[dict], b: list[dict]) -> float:
    worst = 0.0
    for sa, sb in zip(a, b):
        for name, want in sb.items():
            err = (sa[name] - want).abs().max() / want.abs().max().clamp_min(1e-30)
            worst = max(worst, float(err))
    return worst


def loss_diff(a: list, b: list) -> float:
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    if len(pairs) != len(b):
        return float("inf")
    return max((abs(x - y) / max(abs(y), 1e-30) for x, y in pairs), default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--reference", metavar="JOB", help="also train JOB in one process")
    parser.add_argument("--rtol", type=float, default=1e-5)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, job_args = parser.parse_args(argv[:cut]), argv[cut + 1:]
    res_a, params_a = run_state(args.run_a)
    res_b, params_b = run_state(args.run_b)
    rows = [(f"{args.run_b.name} vs {args.run_a.name}", param_diff(params_b, params_a),
             loss_diff(res_b["losses"], res_a["losses"]))]
    if args.reference:
        spec = res_a["spec"]
        ref = train_reference(load_job(args.reference, job_args), spec["pipelines"],
                              spec["microbatches"])
        for name, res, params in ((args.run_a.name, res_a, params_a),
                                  (args.run_b.name, res_b, params_b)):
            rows.append((f"{name} vs one process", param_diff(params, ref.params),
                         loss_diff(res["losses"], ref.losses)))
    print(f"{'comparison':<40} {'parameters':>12} {'losses':>12}   (largest relative "
          f"difference)")
    for name, p, l in rows:
        print(f"{name:<40} {p:12.3g} {l:12.3g}")
    ok = all(p <= args.rtol and l <= args.rtol for _, p, l in rows)
    print(f"{'equal' if ok else 'DIFFERENT'} within {args.rtol:g}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
