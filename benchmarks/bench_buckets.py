"""Fault-free GPT step time of the executor for several gradient-bucket sizes (issue 11).

Usage: python benchmarks/bench_buckets.py [--repeat N] [--iterations N] [--bucket-mb X ...]
                                          [--json FILE]

The small GPT of examples/gpt_small.py (float32, no clipping, no LR schedule; `--dim` and
`--layers` make it bigger), 2 stages x 2 pipelines x 8 micro-batches on local CPU processes
(gloo), under the default policy (split backward, staggered optimizer) and fused+barrier.
Each `--bucket-mb` value is one configuration (`default`: the launcher's default); the step
time is the median of the runs' median step time, iterations 5 onwards; beside it, the time a
worker spends per iteration in its ALLREDUCE op (waiting for the stage's all-reduce) and in
its W and B ops (where the buckets now start), averaged over workers and the whole run. Also
the memory and time of the step-undo copy per stage (bench_executor's `undo_copy`).

`--in-process`: instead, one worker per stage in this process, with a stand-in for the groups
that completes every operation at once, runs its program with the buckets started at its
last W or B (`Program.launch`) and, in the other half of the iterations (ABBA order), at
its ALLREDUCE op (as before buckets): what starting them early costs on the host, without
the other workers' processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import threading
import time
from pathlib import Path

from bench_executor import D, GPT, M, median_step, undo_copy
from common import machine

from recycle_planner.executor import LaunchConfig, launch, load_job
from recycle_planner.io import write_json
from recycle_planner.job.policy import Policy
from recycle_planner.executor.profile import profile_job
from recycle_planner.library import PlanLibrary, Settings, build_library

POLICIES = {"split+staggered (default)": Policy(), "fused+barrier": Policy(decouple=False,
                                                                            stagger=False)}


def run(job_args: list[str], buckets: list[str], repeat: int, work: Path) -> dict:
    spec, _ = profile_job(load_job(GPT, job_args), D, M, name="gpt")
    out: dict = {"configurations": [], "undo": undo_copy(load_job(GPT, job_args))}
    for label, policy in POLICIES.items():
        folder = work / policy.label.replace("/", "-")
        build_library(spec, policy, 0, folder, Settings(solver="heuristic"), jobs=1)
        lib = PlanLibrary.open(folder)
        for bucket in buckets:
            extra = {} if bucket == "default" else {"bucket_mb": float(bucket)}
            steps, waits = [], []
            for r in range(repeat):
                res = launch(GPT, LaunchConfig(nproc=D * spec.stages,
                                               run_dir=str(work / f"run-{r}"), **extra),
                             job_args + ["--library", str(lib.folder)])
                steps.append(median_step(res.iteration_end, 5))
                waits.append(per_iteration(res.op_times))
            out["configurations"].append({
                "policy": label, "bucket_mb": bucket, "step_ms": statistics.median(steps),
                "runs": steps, **{key: statistics.median(w[key] for w in waits)
                                  for key in waits[0]}})
    return out


class _Done:
    """A stand-in for the groups: every operation completes at once (receives read zeros)."""

    size = D * 2
    stage_group = True

    def irecv(self, buf, src, tag):
        return buf.zero_()

    def isend(self, buf, dst, tag):
        return None

    def sent(self, work):
        return True

    def wait(self, work, what=""):
        pass

    def confirm_received(self, what):
        pass

    def allreduce_start(self, flat, what):
        return None


def in_process(job_args: list[str], iterations: int, work: Path) -> list[dict]:
    """Per policy and stage: median iteration time with the buckets started at the launch op
    and at ALLREDUCE, alternating (ms)."""
    import torch

    from recycle_planner.executor.data.boundary import layout_of
    from recycle_planner.executor.faults import FaultInjector
    from recycle_planner.executor.data.runtime import StageRuntime, bind
    from recycle_planner.executor.data.state import StageState
    from recycle_planner.programs import compile_program

    torch.set_num_threads(1)
    job = load_job(GPT, job_args)
    spec, _ = profile_job(job, D, M, name="gpt")
    sample = job.data(0, 0, 0)[0]
    with torch.no_grad():
        hidden = job.build_stage(0)(sample)
    layouts = [(None, layout_of(hidden)), (layout_of(hidden), None)]
    rows = []
    for label, policy in POLICIES.items():
        folder = work / f"inproc-{policy.label.replace('/', '-')}"
        build_library(spec, policy, 0, folder, Settings(solver="heuristic"), jobs=1)
        hit = PlanLibrary.open(folder).lookup([])
        for s in range(spec.stages):
            module = job.build_stage(s)
            optimizer, _ = job.build_state(module)
            runtime = StageRuntime(StageState(module, optimizer), job.loss_fn, job.data, s,
                                   spec.stages, D, M, torch.device("cpu"), *layouts[s])
            runtime.comm = _Done()
            program = bind(compile_program(hit.plan(), s, hit.mapping),
                           list(range(D * spec.stages)))
            at_allreduce = dataclasses.replace(program, launch=next(
                k for k, ins in enumerate(program.instrs) if ins.kind == "ALLREDUCE"))
            times: dict[str, dict[str, list[float]]] = {"launch op": {}, "ALLREDUCE": {}}
            for it in range(4 + 2 * iterations):
                early = it % 4 in (1, 2)  # ABBA: each mode on as many odd as even iterations
                mode = "launch op" if early else "ALLREDUCE"
                before = {kind: spent[1] for kind, spent in runtime.op_times.items()}
                t0 = time.perf_counter()
                runtime.run_iteration(program if early else at_allreduce, it,
                                      threading.Event(), FaultInjector([], 0, 0, print))
                if it >= 4:
                    times[mode].setdefault("iteration", []).append(time.perf_counter() - t0)
                    for kind, spent in runtime.op_times.items():
                        times[mode].setdefault(kind, []).append(spent[1] - before[kind])
            rows.append({"policy": label, "stage": s, **{
                f"{mode} {kind} ms": 1e3 * statistics.median(t)
                for mode, kinds in times.items() for kind, t in kinds.items()}})
    return rows


def per_iteration(op_times: dict) -> dict:
    """ms per iteration in the ALLREDUCE op and in the W and B ops, mean over workers."""
    def mean(kinds):
        return 1e3 * statistics.mean(
            sum(t[k][1] for k in kinds) / t["ALLREDUCE"][0] for t in op_times.values())
    return {"allreduce_ms": mean(["ALLREDUCE"]), "backward_ms": mean(["W", "B"])}


def markdown(res: dict) -> str:
    lines = ["| policy | bucket (MB) | step (ms) | runs (ms) | in ALLREDUCE (ms/it) | in W and B "
             "(ms/it) |", "| --- | ---: | ---: | --- | ---: | ---: |"]
    lines += [f"| {c['policy']} | {c['bucket_mb']} | {c['step_ms']:.1f} | "
              f"{', '.join(f'{x:.1f}' for x in c['runs'])} | {c['allreduce_ms']:.2f} | "
              f"{c['backward_ms']:.2f} |" for c in res["configurations"]]
    lines += ["", "| stage | undo copy: parameters (MB) | optimizer state (MB) | step (ms) | "
              "step with the copy (ms) |", "| ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['stage']} | {r['param_bytes'] / 1e6:.2f} | {r['optimizer_bytes'] / 1e6:.2f}"
              f" | {r['step_ms']:.2f} | {r['step_with_undo_ms']:.2f} |" for r in res["undo"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--bucket-mb", action="append", metavar="MB|default",
                        help="a bucket size to measure (repeatable; default: 'default')")
    parser.add_argument("--in-process", action="store_true",
                        help="measure the host cost of starting buckets early, in one process")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    job_args = ["--dtype", "float32", "--clip", "0", "--warmup", "0", "--dim", str(args.dim),
                "--layers", str(args.layers), "--iterations", str(args.iterations)]
    if args.in_process:
        with tempfile.TemporaryDirectory(prefix="bench-buckets-") as tmp:
            rows = in_process(job_args, args.iterations, Path(tmp))
        if args.json:
            write_json(args.json, {"machine": machine(), "job_args": job_args,
                                   "in_process": rows})
        print(f"machine: {machine()}; {' '.join(job_args)}; one process")
        kinds = ("iteration", "F", "I", "W", "B", "ALLREDUCE")
        print("ms per iteration, buckets started at the last W/B / at ALLREDUCE")
        print(f"| policy | stage | {' | '.join(kinds)} |")
        print(f"| --- | ---: |{' ---: |' * len(kinds)}")
        for r in rows:
            print(f"| {r['policy']} | {r['stage']} | " + " | ".join(
                f"{r[f'launch op {k} ms']:.1f} / {r[f'ALLREDUCE {k} ms']:.1f}" for k in kinds)
                + " |")
        return
    with tempfile.TemporaryDirectory(prefix="bench-buckets-") as tmp:
        res = run(job_args, args.bucket_mb or ["default"], args.repeat, Path(tmp))
    res.update(machine=machine(), job_args=job_args, repeat=args.repeat)
    if args.json:
        write_json(args.json, res)
    print(f"machine: {res['machine']}; {' '.join(job_args)}; {args.repeat} runs each")
    print(markdown(res))


if __name__ == "__main__":
    main()
