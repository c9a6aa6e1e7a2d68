"""Run a plan's per-rank programs with nothing but torch.distributed and torch modules.

A stand-in for your own launcher (torchtitan, Megatron-LM, a loop over torch.distributed): it
reads the programs that `recycle-planner program` wrote, starts one process per live rank on
gloo, runs each rank's actions for a few steps, and checks that the parameters and gradients
equal one process training the whole model on the whole batch. No recycle-planner executor.

    recycle-planner plan-all examples/launcher.toml -f 1 -o /tmp/plans
    recycle-planner program /tmp/plans --fail 1:1 -o /tmp/programs
    python examples/own_launcher.py /tmp/programs --steps 3
"""

import argparse
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recycle_planner.programs import AllReduce, Compute, Recv, Send
from recycle_planner.programs.files import read_manifest, read_program

WIDTH, SAMPLES, LR = 8, 2, 0.1  # one Linear+Tanh per stage; samples per micro-batch


def whole_model(stages):
    torch.manual_seed(0)  # the same initial parameters in every process
    return torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH),
                                                   torch.nn.Tanh()) for _ in range(stages)).double()


def global_batch(step, count):
    """The step's micro-batches of (input, target): micro-batch (p, m) is number p * M + m."""
    g = torch.Generator().manual_seed(step)
    return [tuple(torch.randn(SAMPLES, WIDTH, generator=g, dtype=torch.float64) for _ in "xy")
            for _ in range(count)]


def run_rank(index, folder, ranks, steps, out):
    torch.set_num_threads(1)
    prog = read_program(folder, ranks[index])  # checked against programs.json
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=index,
                            world_size=len(ranks))
    proc = {rank: i for i, rank in enumerate(ranks)}  # physical rank -> process rank
    groups = [dist.new_group([proc[r] for r in ranks if r % prog.stages == s])
              for s in range(prog.stages)]  # every process makes every group, in one order
    stage = whole_model(prog.stages)[prog.stage]
    params = list(stage.parameters())
    optimizer = torch.optim.SGD(params, lr=LR)
    last = prog.stage == prog.stages - 1
    for step in range(steps):
        batch = global_batch(step, prog.pipelines * prog.microbatches)
        parity = (step % 2) * prog.tag_stride  # keeps two steps' messages apart on gloo
        posted, forward, upstream, pending, sends = {}, {}, {}, {}, []

        def received(what, key):
            work, buf = posted.pop((what, *key))
            work.wait()
            return buf

        for a in prog.actions:
            if isinstance(a, Recv):
                buf = torch.empty(SAMPLES, WIDTH, dtype=torch.float64)
                posted[a.what, a.pipeline, a.microbatch] = (
                    dist.irecv(buf, proc[a.peer], tag=a.tag + parity), buf)
            elif isinstance(a, Send):
                key = (a.pipeline, a.microbatch)
                tensor = forward[key][1] if a.what == "activation" else upstream.pop(key)
                sends.append(dist.isend(tensor.detach().contiguous(), proc[a.peer],
                                        tag=a.tag + parity))
            elif isinstance(a, Compute):
                key = (a.pipeline, a.microbatch)
                if a.kind == "F":
                    sample, target = batch[a.pipeline * prog.microbatches + a.microbatch]
                    x = sample if a.stage == 0 else received("activation", key).requires_grad_()
                    y = stage(x)
                    if last:  # each micro-batch's loss times 1/(D*M); gradients are summed
                        y = torch.nn.functional.mse_loss(y, target) * prog.loss_scale
                    forward[key] = (x, y)
                    continue
                x, y = forward[key]
                if a.kind in "IB":
                    pending[key] = None if last else received("gradient", key)
                if a.kind == "I" and a.stage > 0:  # input gradient now, weights later
                    upstream[key] = torch.autograd.grad(y, x, pending[key], retain_graph=True)[0]
                if a.kind in "WB":
                    inputs = params + ([x] if a.kind == "B" and a.stage > 0 else [])
                    torch.autograd.backward(y, pending.pop(key), inputs=inputs)
                    if len(inputs) > len(params):
                        upstream[key] = x.grad
                    del forward[key]
            elif isinstance(a, AllReduce):
                if len(a.ranks) > 1:  # SUM over the stage's live ranks
                    for p in params:
                        dist.all_reduce(p.grad, group=groups[prog.stage])
                grads = [p.grad.clone() for p in params]
            else:  # Optimizer
                optimizer.step()
                optimizer.zero_grad()
        for work in sends:
            work.wait()
    torch.save({"params": [p.detach() for p in params], "grads": grads},
               f"{out}/rank{prog.rank}.pt")
    dist.destroy_process_group()


def one_process(stages, count, steps):
    """The reference: the whole model on the whole batch, mean of the micro-batch losses."""
    parts = whole_model(stages)
    model = torch.nn.Sequential(*parts)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        loss = sum(torch.nn.functional.mse_loss(model(x), y)
                   for x, y in global_batch(step, count)) / count
        loss.backward()
        grads = [[p.grad.clone() for p in part.parameters()] for part in parts]
        optimizer.step()
        optimizer.zero_grad()
    return [list(part.parameters()) for part in parts], grads


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("programs", help="folder written by 'recycle-planner program'")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    manifest = read_manifest(args.programs)
    ranks = [entry["rank"] for entry in manifest["ranks"]]
    job = manifest["job"]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(run_rank, args=(args.programs, ranks, args.steps, out),
                           nprocs=len(ranks), start_method="fork")
        params, grads = one_process(job["stages"], job["pipelines"] * job["microbatches"],
                                    args.steps)
        worst = 0.0
        for rank in ranks:
            got = torch.load(f"{out}/rank{rank}.pt")
            stage = rank % job["stages"]
            for mine, ref in zip(got["params"] + got["grads"], params[stage] + grads[stage]):
                worst = max(worst, (mine - ref).abs().max().item())
    ok = worst < 1e-12
    print(f"{len(ranks)} ranks (dead: {manifest['dead']}), {args.steps} steps: parameters and "
          f"gradients {'equal' if ok else 'DIFFER FROM'} one process's (largest difference "
          f"{worst:.1e})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
