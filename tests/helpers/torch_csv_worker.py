"""One rank of torch's own pipeline runtime executing CSVs that recycle-planner exported.

Run as: python torch_csv_worker.py RANK WORLD STORE_FILE OUT_DIR CSV [CSV ...]
Each rank holds one stage (a Linear layer) of a 2-stage MLP and runs every CSV with
_PipelineScheduleRuntime (a CSV whose name ends in .comms.csv in torch's compute_comms format,
the others compute_only); rank WORLD-1 writes the losses and every rank its gradients.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


def data(n):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def main():
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    csvs = sys.argv[5:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    full = model()
    parts = [torch.nn.Sequential(full[0], full[1]), full[2]]
    n_mb = 4
    x, y = data(8)
    results = {}
    for path in csvs:
        for p in full.parameters():
            p.grad = None
        stage = PipelineStage(parts[rank], rank, world, torch.device("cpu"))
        sched = _PipelineScheduleRuntime([stage], n_microbatches=n_mb,
                                         loss_fn=torch.nn.functional.mse_loss)
        sched._load_csv(path, format="compute_comms" if path.endswith(".comms.csv")
                        else "compute_only")
        losses = []
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=losses)
        results[path] = {
            "losses": [float(l) for l in losses],
            "grads": [p.grad.flatten().tolist() for p in parts[rank].parameters()],
        }
    with open(f"{out}/rank{rank}.json", "w") as fh:
        json.dump(results, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
