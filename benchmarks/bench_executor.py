"""The executor's figures: fault-free step time against torch's Schedule1F1B and against torch's
own runtime executing our exported ZB-H1 plan, step time after a failure against the planner's
prediction, and the time from a kill to the first iteration completed after it.

Usage: python benchmarks/bench_executor.py [--repeat N] [--iterations N] [--workload W]
                                           [--cpu-quota CPUS]

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

For each workload: the stages are profiled (in a process of their own, one torch thread, as a
worker), `plan-all` builds one library per policy; each configuration is trained `--repeat`
times (median of the runs' median step time, iterations 5 onwards). torch runs twice: its own
Schedule1F1B, and `_PipelineScheduleRuntime` on the CSV that `export-torch` writes for the
fault-free plan of the ZB-H1 library (the same schedule as our "zb-h1" configuration). Failure
runs kill worker 1:0 (stage 0) or 0:1 (stage 1) mid-forward at iteration 15 with the default
policy; "before" is the same run's steps 5..14, "after" the steps from two iterations after the
re-planned restart. Each of our runs is also replayed: its plan re-timed with the per-stage op
costs the run measured (timing/replay.py), which tells op times that differ from the profile
from a model that misses something.

`--cpu-quota CPUS` gives every worker process (ours and torch's) and the profiling processes
a cgroup of its own with that many CPUs (benchmarks/cpu_quota.py; root and cgroup v1 needed):
one device per worker, as the planner models it, so that the survivors of a kill do not get
the dead worker's share of the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine
from cpu_quota import CpuQuota, QuotaGroups, wrap_command

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import torch_1f1b  # noqa: E402

from recycle_planner.errors import RecycleError  # noqa: E402
from recycle_planner.executor import LaunchConfig, launch, load_job, parse_fault  # noqa: E402
from recycle_planner.executor.control.agent import worker_command  # noqa: E402
from recycle_planner.files.export_torch import export_torch_csv  # noqa: E402
from recycle_planner.io import write_json  # noqa: E402
from recycle_planner.library import PlanLibrary, Settings, build_library  # noqa: E402
from recycle_planner.job.policy import Policy  # noqa: E402
from recycle_planner.executor.profile import profile_job  # noqa: E402
from recycle_planner.job.profiler import write_spec  # noqa: E402
from recycle_planner.job.spec import JobSpec, load_spec  # noqa: E402
from recycle_planner.timing.replay import measured_spec, replay_period, stage_costs  # noqa

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
DEFAULT = "split+staggered (default)"
ZB_H1 = "zb-h1 split+staggered"
POLICIES = {
    DEFAULT: Policy(),
    ZB_H1: Policy("zb-h1"),
    "fused+staggered": Policy(decouple=False),
    "fused+barrier (plain)": Policy(decouple=False, stagger=False),
}
KILLS = {"1:0": "2", "0:1": "1"}   # worker -> rank
QUOTA_SHARES = 65536
"""cpu.shares of the quota groups' parent: on a machine other work keeps busy, groups with an
ordinary process's weight get less than their quotas, and more once a peer dies; 64 times
that weight makes the quotas the CPU the workers actually get (the machine's other processes
keep what the quotas leave)."""


def median_step(ends: list, first: int, last: int | None = None) -> float:
    """Median time between consecutive iteration ends, iterations first..last (ms)."""
    ends = ends[first:last]
    steps = [b - a for a, b in zip(ends, ends[1:]) if a is not None and b is not None]
    return 1e3 * statistics.median(steps)


def profile(name: str, target: str, job_args: list[str], work: Path,
            quota: QuotaGroups | None) -> JobSpec:
    """Profile the job in a process of its own (under the workers' quota if any)."""
    path = work / f"{name}.toml"
    job = {"name": name, "target": target, "args": job_args, "out": str(path),
           "root": str(quota.root) if quota else None,
           "quota": quota.quota.to_dict() if quota else None}
    subprocess.run(wrap(quota, [sys.executable, __file__, "--profile-child", json.dumps(job)]),
                   check=True)
    return load_spec(path)


def profile_child(job: dict) -> None:
    import torch

    torch.set_num_threads(1)
    comm_wrap = None
    if job["root"]:
        quota = CpuQuota.from_dict(job["quota"])
        comm_wrap = lambda command: wrap_command(command, job["root"], quota)  # noqa: E731
    spec, _ = profile_job(load_job(job["target"], job["args"]), D, M, name=job["name"],
                          wrap=comm_wrap)
    write_spec(spec, job["out"])


def wrap(quota: QuotaGroups | None, command: list[str]) -> list[str]:
    return quota.wrap(command) if quota else command


def replayed(res, lib: PlanLibrary, failed: list, generation: int) -> dict:
    """The plan the run used after `failed` died, re-timed with the run's op costs of
    `generation` (timing/replay.py), and the time per iteration the busiest worker spent in
    ops, waits included (ms; the step minus it is time outside ops)."""
    spec = lib.spec
    costs = stage_costs(res.op_times, generation, spec.stages)
    plan = lib.lookup(failed).plan()
    in_ops = []
    for by_gen in res.op_times.values():
        table = by_gen.get(str(generation))
        if table and table["OPTIMIZER"][0]:
            in_ops.append(1e3 * sum(row[1] for row in table.values()) / table["OPTIMIZER"][0])
    return {"replayed_ms": replay_period(plan, measured_spec(spec, costs)),
            "ops_per_iteration_ms": max(in_ops) if in_ops else None,
            "measured_costs_ms": [c.ms for c in costs]}


def run_ours(target: str, job_args: list[str], lib: PlanLibrary, run_dir: Path,
             quota: QuotaGroups | None, faults=()):
    return launch(wrap(quota, worker_command(target, job_args + ["--library", str(lib.folder)])),
                  LaunchConfig(nproc=D * S, run_dir=str(run_dir), faults=list(faults)))


def run_workload(name: str, target: str, args: list[str], repeat: int, iterations: int,
                 work: Path, quota: QuotaGroups | None) -> dict:
    job_args = args + ["--iterations", str(iterations)]
    spec = profile(name, target, job_args, work, quota)
    libs = {}
    for label, policy in POLICIES.items():
        folder = work / f"{name}-{policy.label.replace('/', '-')}"
        build_library(spec, policy, 1, folder, Settings(solver="heuristic"), jobs=1)
        libs[label] = PlanLibrary.open(folder)
    out: dict = {"spec": spec.to_dict(), "fault_free": {}, "failures": {}}
    csv = work / f"{name}-zb-h1.csv"
    export_torch_csv(libs[ZB_H1].lookup([]).plan(), csv)
    out["zb_h1_csv"] = csv.read_text()
    for t, (label, schedule) in enumerate((("torch Schedule1F1B", None),
                                           ("torch _PipelineScheduleRuntime, our ZB-H1 CSV",
                                            csv))):
        steps = []
        for r in range(repeat):
            res = torch_1f1b.train(target, job_args, D, M, S, work / f"{name}-torch{t}-{r}",
                                   csv=schedule, wrap=lambda c: wrap(quota, c))
            steps.append(median_step(res["iteration_end"], 5))
        out["fault_free"][label] = {"step_ms": statistics.median(steps), "runs": steps}
    runs = [(label, lib, []) for label, lib in libs.items()]
    runs += [(label, libs[DEFAULT], more) for label, more in EXTRA.get(name, {}).items()]
    for label, lib, more in runs:
        rows = []
        for r in range(repeat):
            res = run_ours(target, job_args + more, lib, work / f"{name}-{r}", quota)
            rows.append({"step_ms": median_step(res.iteration_end, 5),
                         **replayed(res, lib, [], 0)})
        out["fault_free"][label] = {"step_ms": statistics.median(r["step_ms"] for r in rows),
                                    "runs": rows, "predicted_ms": lib.fault_free_period,
                                    "replayed_ms": statistics.median(r["replayed_ms"]
                                                                     for r in rows)}
    lib = libs[DEFAULT]
    if name == "gpt":
        out["undo"] = undo_copy(load_job(target, job_args))
    for worker, rank in KILLS.items():
        failed = [tuple(map(int, worker.split(":")))]
        rows = []
        for r in range(repeat):
            res = run_ours(target, job_args, lib, work / f"{name}-k{r}", quota,
                           [parse_fault(f"{rank}:{KILL_AT}:F1")])
            gen = [e.data for e in res.events if e.kind == "generation"][-1]
            before = median_step(res.iteration_end, 5, KILL_AT)
            after = median_step(res.iteration_end, gen["restart"] + 2)
            ff = replayed(res, lib, [], 0)["replayed_ms"]
            rep = replayed(res, lib, failed, gen["gen"])
            rows.append({"before_ms": before, "after_ms": after,
                         "measured_degradation": after / before - 1,
                         "predicted_degradation": gen["degradation"],
                         "predicted_period_ms": lib.lookup(failed).entry.period,
                         "replayed_before_ms": ff, "replayed_after_ms": rep["replayed_ms"],
                         "replayed_degradation": rep["replayed_ms"] / ff - 1,
                         "ops_per_iteration_ms": rep["ops_per_iteration_ms"],
                         "measured_costs_ms": rep["measured_costs_ms"],
                         "recovery_s": res.recoveries[0].seconds,
                         "replan_s": res.recoveries[0].replanned_after, "plan": gen["plan"]})
        out["failures"][worker] = {key: statistics.median(r[key] for r in rows)
                                   for key in rows[0] if isinstance(rows[0][key], float)}
        out["failures"][worker]["plan"] = rows[0]["plan"]
        out["failures"][worker]["runs"] = rows
    return out


def undo_copy(job, repeats: int = 20) -> list[dict]:
    """Per stage: bytes of the undo copy (parameters and optimizer state) and the time a step
    takes with and without making it (fake gradients, one thread)."""
    import time

    import torch

    from recycle_planner.executor.data.state import StageState

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
             "period (ms) | replayed with the run's op costs (ms) |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for name, res in results["workloads"].items():
        base = res["fault_free"]["torch Schedule1F1B"]["step_ms"]
        for label, row in res["fault_free"].items():
            pred = f"{row['predicted_ms']:.1f}" if "predicted_ms" in row else ""
            rep = f"{row['replayed_ms']:.1f}" if "replayed_ms" in row else ""
            lines.append(f"| {name} | {label} | {row['step_ms']:.1f} | "
                         f"{row['step_ms'] / base - 1:+.1%} | {pred} | {rep} |")
    lines += ["", "| workload | dead worker | step before (ms) | step after (ms) | measured "
              "degradation | predicted degradation | replayed degradation | predicted period "
              "(ms) | replayed before / after (ms) | ops per iteration after (ms) | kill to "
              "new plan (s) | kill to first completed iteration (s) |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
              "---: |"]
    for name, res in results["workloads"].items():
        for worker, row in res["failures"].items():
            ops = row.get("ops_per_iteration_ms")
            lines.append(f"| {name} | {worker} ({row['plan']}) | {row['before_ms']:.1f} | "
                         f"{row['after_ms']:.1f} | {row['measured_degradation']:+.1%} | "
                         f"{row['predicted_degradation']:+.1%} | "
                         f"{row['replayed_degradation']:+.1%} | "
                         f"{row['predicted_period_ms']:.1f} | {row['replayed_before_ms']:.1f} / "
                         f"{row['replayed_after_ms']:.1f} | "
                         f"{'' if ops is None else f'{ops:.1f}'} | {row['replan_s']:.3f} | "
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
    if sys.argv[1:2] == ["--profile-child"]:
        profile_child(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), action="append")
    parser.add_argument("--cpu-quota", type=float, default=None, metavar="CPUS",
                        help="CPUs per worker process, fixed (cgroup v1 CFS quota)")
    parser.add_argument("--cpu-period-us", type=int, default=CpuQuota.period_us,
                        help="the quota's period")
    parser.add_argument("--cpu-shares", type=int, default=QUOTA_SHARES,
                        help="cpu.shares of all the quota groups together (1024: one "
                             "ordinary process)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally: workers, cgroups
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = {"machine": machine(), "grid": f"{S} stages x {D} pipelines x {M} micro-batches",
               "repeat": args.repeat, "iterations": args.iterations, "workloads": {},
               "load_average_before": os.getloadavg()}
    quota = None
    if args.cpu_quota is not None:
        quota = QuotaGroups(CpuQuota(args.cpu_quota, args.cpu_period_us, args.cpu_shares))
        results["cpu_quota"] = quota.quota.to_dict()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-executor-") as tmp, \
                quota or contextlib.nullcontext():
            for name in args.workload or list(WORKLOADS):
                results["workloads"][name] = run_workload(name, *WORKLOADS[name], args.repeat,
                                                          args.iterations, Path(tmp), quota)
    except RecycleError as exc:
        sys.exit(f"bench_executor: {exc}")
    results["load_average_after"] = os.getloadavg()
    if args.json:
        write_json(args.json, results)
    quota_text = (f"; {args.cpu_quota} CPU per process every {args.cpu_period_us} us, "
                  f"cpu.shares {args.cpu_shares}" if quota else "")
    print(f"machine: {results['machine']}; {results['grid']}; {args.repeat} runs each"
          f"{quota_text}; load average {results['load_average_before'][0]:.1f} before, "
          f"{results['load_average_after'][0]:.1f} after")
    print(markdown(results))


if __name__ == "__main__":
    main()
