"""The CUDA path end to end, as far as one GPU allows (issue 23, item 7).

Usage: python benchmarks/gpu_check.py [--out DIR] [--device cuda] [--iterations N]
                                      [--microbatches M] [JOB ARGS...]

On a machine with one GPU (`--device cpu` runs the same steps on gloo, to check the script):

1. profiles the small GPT of examples/gpt_small.py as one stage on the GPU
   (`recycle-planner profile --device cuda`: forward, backward and optimizer times, static and
   activation memory, the GPU's memory as the budget);
2. plans it (`plan-all`, one pipeline, no failure);
3. trains it with the plan on NCCL (`launch -n 1 --backend nccl`: a communicator of one rank,
   created non-blocking and connected eagerly, the step gate's stream synchronisation, the
   step-undo copy's pinned host buffer when a peer exists, `TORCH_NCCL_*` set), and reads the
   worker's peak device memory from its log, and the device memory in use beyond torch's
   allocator (the CUDA context and NCCL's buffers, against the spec's NCCL estimate);
4. trains the same stage with plain torch on the same device, the same micro-batches and the
   same schedule (one stage: forward and backward per micro-batch, then the step, which is what
   `Schedule1F1B` does with one stage), for the step time to compare;
5. writes OUT/gpu_check.json and prints: step time (executor against torch), peak memory
   against the plan's (static + the plan's peak micro-batches in flight x activation).

What one GPU cannot show: NCCL point-to-point messages and the stage all-reduce between
ranks (NCCL refuses two ranks on one device), aborts of a communicator with a dead peer, the
buffers of several in-flight messages. Those need two GPUs or more (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from recycle_planner.job.profiler import nccl_estimate

ROOT = Path(__file__).resolve().parents[1]
JOB = "examples/gpt_small.py:make_job"


def _run(cmd: list[str]) -> str:
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def _step_times(result: dict) -> list[float]:
    ends = [e for e in result["iteration_end"] if e is not None]
    return [b - a for a, b in zip(ends, ends[1:])][2:]


def _torch_step(job_args: list[str], device: str, microbatches: int, iterations: int) -> float:
    """Median seconds per iteration of the same stage trained by plain torch."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt_small import make_job

    if not device.startswith("cuda"):
        torch.set_num_threads(1)  # as the executor's worker
    job = make_job(job_args)
    module = job.build_stage(0).to(device)
    optimizer, scheduler = job.build_state(module)
    times = []
    for it in range(iterations):
        t0 = time.perf_counter()
        for m in range(microbatches):
            x, y = job.data(it, 0, m)
            loss = job.loss_fn(module(x.to(device)), y.to(device)) / microbatches
            loss.backward()
        if job.step_hook is not None:
            params = [p for p in module.parameters() if p.requires_grad]
            job.step_hook.apply(0, params, job.step_hook.stats(0, params))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/gpu-check")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--microbatches", type=int, default=8)
    args, job_args = parser.parse_known_args()
    job_args = [a for a in job_args if a != "--"]
    cuda = args.device.startswith("cuda")
    if cuda:
        import torch

        if not torch.cuda.is_available():
            sys.exit("no CUDA device here: run on a machine with a GPU (or --device cpu to "
                     "check the script on gloo)")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rp = str(Path(sys.executable).with_name("recycle-planner"))
    job_args = ["--stages", "1", *job_args]
    spec = out / "gpt.toml"
    _run([rp, "profile", JOB, "--pipelines", "1", "--microbatches", str(args.microbatches),
          "--device", args.device, "--name", "gpt-gpu-check", "-o", str(spec), "--",
          *job_args])
    plans = out / "plans"
    _run([rp, "plan-all", str(spec), "--max-failures", "0", "--force", "-o", str(plans)])
    run_dir = out / "run"
    _run([rp, "launch", "-n", "1", "--backend", "nccl" if cuda else "gloo", "--run-dir",
          str(run_dir), JOB, "--", "--library", str(plans), "--iterations",
          str(args.iterations), *job_args])
    result = json.loads((run_dir / "result.json").read_text())
    executor_step = statistics.median(_step_times(result))
    torch_step = _torch_step(job_args, args.device, args.microbatches, args.iterations)

    log = "\n".join(p.read_text() for p in sorted(run_dir.glob("logs/**/rank0.*.log")))
    peaks = [int(x) for x in re.findall(r"peak device memory (\d+) bytes", log)]
    # The device's memory in use beyond torch's allocator: the CUDA context and NCCL's own
    # buffers (one rank here: its communicators have no peer), against the spec's estimate.
    outside = [int(used) - int(reserved) for used, reserved in re.findall(
        r"in use on the device (\d+) bytes, reserved by torch (\d+) bytes", log)]
    spec_data = result["spec"]
    plan = json.loads(gzip.open(plans / "k0.json.gz").read()) \
        if (plans / "k0.json.gz").exists() else \
        json.loads(gzip.open(next(plans.glob("k*.json.gz"))).read())
    inflight = plan["metrics"]["peak_inflight"]
    memory = spec_data["memory"]
    planned = _first(memory["static"]) + inflight * _first(memory["activation"])
    report = {"device": args.device, "executor_step_s": executor_step,
              "torch_step_s": torch_step, "peak_memory_bytes": peaks[-1] if peaks else None,
              "planned_memory_bytes": planned, "peak_inflight": inflight,
              "outside_torch_bytes": outside[-1] if outside else None,
              "nccl_estimate_bytes": nccl_estimate(0, 1, 1, scalars=True).total,
              "losses_first_last": [result["losses"][0], result["losses"][-1]]}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"step time      executor {1e3 * executor_step:.2f} ms, torch {1e3 * torch_step:.2f} "
          f"ms ({executor_step / torch_step - 1:+.1%})")
    peak = report["peak_memory_bytes"]
    print(f"peak memory    {'n/a (cpu)' if peak is None else f'{peak / 2**20:.1f} MiB'} "
          f"against the plan's {planned / 2**20:.1f} MiB")
    if outside:
        print(f"outside torch  {outside[-1] / 2**20:.1f} MiB (CUDA context + NCCL; NCCL "
              f"estimated {report['nccl_estimate_bytes'] / 2**20:.1f} MiB)")
    print(f"written        {out / 'gpu_check.json'}")


def _first(value) -> float:
    return float(value[0] if isinstance(value, list) else value)


if __name__ == "__main__":
    main()
