"""The executor's figures: fault-free step time against torch's Schedule1F1B, step time after a
failure against the planner's prediction, and the time from a kill to the first iteration
completed after it.

Usage: python benchmarks/bench_executor.py [--repeat N] [--iterations N] [--workload W]

2 stages x 2 pipelines x 8 micro-batches, on local CPU processes (gloo), in three workloads:

- `device`: a small MLP plus 2 ms per forward, input-gradient and weight-gradient pass spent
  sleeping with the CPU free (`--device-ms 2,2,2`), as while a GPU kernel runs. Step times then
  show the schedule (bubbles, re-routed work) and the runtime's overhead, which is what the
  planner predicts.
- `cpu`: real compute only (width 256, 4 blocks per stage, 32 samples per micro-batch). The
  4 workers share the machine's cores, so step times mostly show total CPU work.
- `gpt`: the small GPT of examples/gpt_small.py (float32, no clipping and no LR schedule, as
  torch's baseline has neither; with clipping as one more configuration), and the memory and
  time of the step-undo copy per stage.

For each workload: `recycle-planner profile` writes the spec, `plan-all` builds one library per
policy; each configuration is trained `--repeat` times (median of the runs' median step time,
iterations 5 onwards). Failure runs kill worker 1:0 (stage 0) or 0:1 (stage 1) mid-forward at
iteration 15 with the default policy; "before" is the same run's steps 5..14, "after" the steps
from two iterations after the re-planned restart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from common import machine

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import torch_1f1b  # noqa: E402

from recycle_planner.executor import LaunchConfig, launch, load_job, parse_fault  # noqa: E402
from recycle_planner.library import PlanLibrary, Settings, build_library  # noqa: E402
from recycle_planner.job.policy import Policy  # noqa: E402
from recycle_planner.job.profiler import profile_job, write_spec  # noqa: E402

TINY = f"{ROOT / 'examples' / 'tiny_mlp.py'}:make_job"
GPT = f"{ROOT / 'examples' / 'gpt_small.py'}:make_job"
D, S, M = 2, 2, 8
KILL_AT = 15
WORKLOADS = {  # name -> (job, its arguments)
    "device": (TINY, ["--device-ms", "2,2,2", "--dtype", "float32", "--width", "16"]),
    "cpu": (TINY, ["--width", "256", "--blocks", "4", "--microbatch-size", "32",
                   "--dtype", "float32"]),
    # torch's Schedule1F1B neither clips nor schedules the LR: compare without both; the
    # cost of clipping is one more configuration of ours
    "gpt": (GPT, ["--dtype", "float32", "--clip", "0", "--warmup", "0"]),
}
EXTRA = {"gpt": {"split+staggered + global-norm clipping": ["--clip", "1.0"]}}
"""Further fault-free configurations of a workload (default policy, more job arguments)."""
POLICIES = {
    "split+staggered (default)": Policy(),
    "fused+staggered": Policy(decouple=False),
    "fused+barrier (plain)": Policy(decouple=False, stagger=False),
}
KILLS = {"1:0": "2", "0:1": "1"}   # worker -> rank


def median_step(ends: list, first: int, last: int | None = None) -> float:
    """Median time between consecutive iteration ends, iterations first..last (ms)."""
    ends = ends[first:last]
    steps = [b - a for a, b in zip(ends, ends[1:]) if a is not None and b is not None]
    return 1e3 * statistics.median(steps)


def run_workload(name: str, target: str, args: list[str], repeat: int, iterations: int,
                 work: Path) -> dict:
    job_args = args + ["--iterations", str(iterations)]
    spec, _ = profile_job(load_job(target, job_args), D, M, name=name)
    write_spec(spec, work / f"{name}.toml")
    libs = {}
    for label, policy in POLICIES.items():
        folder = work / f"{name}-{policy.label.replace('/', '-')}"
        build_library(spec, policy, 1, folder, Settings(solver="heuristic"), jobs=1)
        libs[label] = PlanLibrary.open(folder)
    out: dict = {"spec": spec.to_dict(), "fault_free": {}, "failures": {}}
    torch_steps = []
    for r in range(repeat):
        res = torch_1f1b.train(target, job_args, D, M, S, work / f"{name}-torch-{r}")
        torch_steps.append(median_step(res["iteration_end"], 5))
    out["fault_free"]["torch Schedule1F1B"] = {"step_ms": statistics.median(torch_steps),
                                               "runs": torch_steps}
    for label, lib in libs.items():
        steps = []
        for r in range(repeat):
            res = launch(target, LaunchConfig(nproc=D * S, run_dir=str(work / f"{name}-{r}")),
                         job_args + ["--library", str(lib.folder)])
            steps.append(median_step(res.iteration_end, 5))
        out["fault_free"][label] = {"step_ms": statistics.median(steps), "runs": steps,
                                    "predicted_ms": lib.fault_free_period}
    lib = libs["split+staggered (default)"]
    for label, more in EXTRA.get(name, {}).items():
        steps = []
        for r in range(repeat):
            res = launch(target, LaunchConfig(nproc=D * S, run_dir=str(work / f"{name}-x{r}")),
                         job_args + more + ["--library", str(lib.folder)])
            steps.append(median_step(res.iteration_end, 5))
        out["fault_free"][label] = {"step_ms": statistics.median(steps), "runs": steps,
                                    "predicted_ms": lib.fault_free_period}
    if name == "gpt":
        out["undo"] = undo_copy(load_job(target, job_args))
    for worker, rank in KILLS.items():
        rows = []
        for r in range(repeat):
            res = launch(target, LaunchConfig(nproc=D * S, run_dir=str(work / f"{name}-k{r}"),
                                            faults=[parse_fault(f"{rank}:{KILL_AT}:F1")]),
                         job_args + ["--library", str(lib.folder)])
            gen = [e for e in res.events if e["kind"] == "generation"][-1]
            before = median_step(res.iteration_end, 5, KILL_AT)
            after = median_step(res.iteration_end, gen["restart"] + 2)
            rows.append({"before_ms": before, "after_ms": after,
                         "measured_degradation": after / before - 1,
                         "predicted_degradation": gen["degradation"],
                         "predicted_period_ms": lib.lookup([tuple(map(int, worker.split(":")))])
                         .entry.period,
                         "recovery_s": res.recoveries[0]["seconds"],
                         "replan_s": res.recoveries[0]["replanned_after"], "plan": gen["plan"]})
        out["failures"][worker] = {key: statistics.median(r[key] for r in rows)
                                   for key in rows[0] if key != "plan"}
        out["failures"][worker]["plan"] = rows[0]["plan"]
        out["failures"][worker]["runs"] = rows
    return out


def undo_copy(job, repeats: int = 20) -> list[dict]:
    """Per stage: bytes of the undo copy (parameters and optimizer state) and the time a step
    takes with and without making it (fake gradients, one thread)."""
    import time

    import torch

    from recycle_planner.executor.state import StageState

    torch.set_num_threads(1)
    rows = []
    for s in range(len(job.stages)):
        module = job.build_stage(s)
        optimizer, _ = job.build_state(module)
        state = StageState(module, optimizer)
        times = {"with": [], "without": []}
        for r in range(2 * repeats):
            for p in state.params:
                p.grad = torch.full_like(p, 1e-3)
            t0 = time.perf_counter()
            if r % 2:
                state.step()
                key = "with"
            else:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                key = "without"
            times[key].append(time.perf_counter() - t0)
        params = sum(b.numel() * b.element_size() for b in state.undo.params)
        opt = sum(v.numel() * v.element_size() for st in state.undo.optimizer["state"].values()
                  for v in st.values() if isinstance(v, torch.Tensor))
        rows.append({"stage": s, "param_bytes": params, "optimizer_bytes": opt,
                     "step_ms": 1e3 * statistics.median(times["without"]),
                     "step_with_undo_ms": 1e3 * statistics.median(times["with"])})
    return rows


def markdown(results: dict) -> str:
    lines = ["| workload | configuration | step time (ms) | vs torch Schedule1F1B | planner's "
             "period (ms) |", "| --- | --- | ---: | ---: | ---: |"]
    for name, res in results["workloads"].items():
        base = res["fault_free"]["torch Schedule1F1B"]["step_ms"]
        for label, row in res["fault_free"].items():
            pred = f"{row['predicted_ms']:.1f}" if "predicted_ms" in row else ""
            lines.append(f"| {name} | {label} | {row['step_ms']:.1f} | "
                         f"{row['step_ms'] / base - 1:+.1%} | {pred} |")
    lines += ["", "| workload | dead worker | step before (ms) | step after (ms) | measured "
              "degradation | predicted degradation | predicted period (ms) | kill to new plan "
              "(s) | kill to first completed iteration (s) |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, res in results["workloads"].items():
        for worker, row in res["failures"].items():
            lines.append(f"| {name} | {worker} ({row['plan']}) | {row['before_ms']:.1f} | "
                         f"{row['after_ms']:.1f} | {row['measured_degradation']:+.1%} | "
                         f"{row['predicted_degradation']:+.1%} | "
                         f"{row['predicted_period_ms']:.1f} | {row['replan_s']:.3f} | "
                         f"{row['recovery_s']:.3f} |")
    for name, res in results["workloads"].items():
        if "undo" in res:
            lines += ["", "| workload | stage | undo copy: parameters (MB) | optimizer state (MB) "
                      "| step (ms) | step with the copy (ms) |",
                      "| --- | ---: | ---: | ---: | ---: | ---: |"]
            lines += [f"| {name} | {r['stage']} | {r['param_bytes'] / 1e6:.2f} | "
                      f"{r['optimizer_bytes'] / 1e6:.2f} | {r['step_ms']:.2f} | "
                      f"{r['step_with_undo_ms']:.2f} |" for r in res["undo"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), action="append")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    results = {"machine": machine(), "grid": f"{S} stages x {D} pipelines x {M} micro-batches",
               "repeat": args.repeat, "iterations": args.iterations, "workloads": {}}
    with tempfile.TemporaryDirectory(prefix="bench-executor-") as tmp:
        for name in args.workload or list(WORKLOADS):
            results["workloads"][name] = run_workload(name, *WORKLOADS[name], args.repeat,
                                                      args.iterations, Path(tmp))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(f"machine: {results['machine']}; {results['grid']}; {args.repeat} runs each")
    print(markdown(results))


if __name__ == "__main__":
    main()
