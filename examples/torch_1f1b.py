"""Train a recycle-planner job with torch's own Schedule1F1B: the baseline the executor is
compared with (same model, same data, same machine), without any fault tolerance. With
`--csv`, torch's `_PipelineScheduleRuntime` runs a compute-only schedule CSV instead, such as
a fault-free plan exported by `recycle-planner export-torch` (ZB-H1 with I/W, say): then the
two runtimes execute the same schedule.

    python examples/torch_1f1b.py --pipelines 2 --microbatches 4 --out torch-run \
        examples/tiny_mlp.py:make_job -- --iterations 6

Starts pipelines x stages processes on gloo. Each pipeline is one `Schedule1F1B` over its
stages (torch's `PipelineStage`, default `scale_grads=True`, so gradients are averaged over the
pipeline's micro-batches); each stage's gradients are then summed over the pipelines and
divided by their number, before every stage's optimizer step. That is the same step as the
executor's (every micro-batch loss scaled by 1/(D*M), SUM). Pipeline d's batch is the
concatenation of the job's micro-batches (iteration, d, 0..M-1), which torch splits back into
the same micro-batches.

Writes OUT/stage{s}.pt (final parameters of each stage), OUT/result.json (per-iteration mean
loss and end time of every iteration, seconds since the first iteration began).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable


def worker(rank: int, world: int, port: int, target: str, job_args: list[str], D: int, M: int,
           out: Path, csv: str | None = None) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B, _PipelineScheduleRuntime

    from recycle_planner.executor.job import load_job
    from recycle_planner.io import atomic_write, write_json

    torch.set_num_threads(1)
    job = load_job(target, job_args)
    S = len(job.stages)
    d, s = divmod(rank, S)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("torch-1f1b", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    pipes = [dist.new_group([q * S + t for t in range(S)]) for q in range(D)]
    stage_groups = [dist.new_group([q * S + t for q in range(D)]) for t in range(S)]
    module = job.build_stage(s)
    optimizer = job.optimizer(module.parameters())
    stage = PipelineStage(module, s, S, torch.device("cpu"), group=pipes[d])
    if csv:
        schedule = _PipelineScheduleRuntime([stage], n_microbatches=M, loss_fn=job.loss_fn)
        schedule._load_csv(csv, format="compute_only")
    else:
        schedule = Schedule1F1B(stage, n_microbatches=M, loss_fn=job.loss_fn)
    losses, ends = [], []
    dist.barrier()
    t0 = time.time()
    for i in range(job.iterations):
        batch = [job.data(i, d, m) for m in range(M)]
        mb_losses: list = []
        if s == 0 and S == 1:
            schedule.step(torch.cat([b[0] for b in batch]),
                          target=torch.cat([b[1] for b in batch]), losses=mb_losses)
        elif s == 0:
            schedule.step(torch.cat([b[0] for b in batch]))
        elif s == S - 1:
            schedule.step(target=torch.cat([b[1] for b in batch]), losses=mb_losses)
        else:
            schedule.step()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p)
                 for p in module.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=stage_groups[s])
        flat /= D
        offset = 0
        for p in module.parameters():
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ends.append(time.time() - t0)
        if s == S - 1:
            losses.append(sum(float(l.detach()) for l in mb_losses) / M)
    write_json(out / f"rank{rank}.json", {"ends": ends, "losses": losses})
    if d == 0:
        atomic_write(out / f"stage{s}.pt", lambda fh: torch.save(module.state_dict(), fh),
                     binary=True)
    dist.barrier()
    dist.destroy_process_group()


def train(target: str, job_args: list[str], pipelines: int, microbatches: int, stages: int,
          out: str | Path, timeout: float = 600, csv: str | Path | None = None,
          wrap: Callable[[list[str]], list[str]] = list) -> dict:
    """Run the baseline on pipelines x stages local processes (each command rewritten by
    `wrap`), torch's runtime on schedule `csv` if given; returns OUT/result.json."""
    import torch.distributed as dist

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    world = pipelines * stages
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(wrap([sys.executable, __file__, "--worker", str(r), str(world),
                                    str(store.port), str(pipelines), str(microbatches),
                                    str(out), str(csv or ""), target, *job_args]), env=env)
             for r in range(world)]
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        raise SystemExit(f"torch 1F1B workers failed with exit codes {codes}")
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    last = [rec for r, rec in enumerate(records) if r % stages == stages - 1]
    losses = [sum(rec["losses"][i] for rec in last) / pipelines
              for i in range(len(last[0]["losses"]))]
    ends = [max(rec["ends"][i] for rec in records) for i in range(len(records[0]["ends"]))]
    result = {"losses": losses, "iteration_end": ends}
    from recycle_planner.io import write_json

    write_json(out / "result.json", result)
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, world, port, D, M = (int(x) for x in sys.argv[2:7])
        worker(rank, world, port, sys.argv[9], sys.argv[10:], D, M, Path(sys.argv[7]),
               sys.argv[8] or None)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--csv", default=None,
                        help="run this compute-only schedule with _PipelineScheduleRuntime")
    parser.add_argument("job")
    parser.add_argument("job_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from recycle_planner.executor.job import load_job

    job_args = args.job_args[1:] if args.job_args[:1] == ["--"] else args.job_args
    stages = len(load_job(args.job, job_args).stages)
    result = train(args.job, job_args, args.pipelines, args.microbatches, stages, args.out,
                   csv=args.csv)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
