"""Single-process reference training: the numbers every distributed run must reproduce.

Chains all stages in one process and takes, per iteration, one optimizer step per stage on the
gradient of the mean loss over all D*M micro-batches, exactly the step the executor computes
(each micro-batch loss scaled by 1/(D*M), gradients summed over the stage's live workers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recycle_planner.executor.job import Job


@dataclass
class ReferenceResult:
    params: list[dict[str, torch.Tensor]]   # per stage: name -> tensor after training
    losses: list[float]                     # per iteration: mean micro-batch loss


def train_reference(job: Job, pipelines: int, microbatches: int,
                    iterations: int | None = None) -> ReferenceResult:
    modules = [job.build_stage(s) for s in range(len(job.stages))]
    optimizers = [job.optimizer(m.parameters()) for m in modules]
    n = job.iterations if iterations is None else iterations
    scale = 1.0 / (pipelines * microbatches)
    losses = []
    for i in range(n):
        total = 0.0
        for d in range(pipelines):
            for m in range(microbatches):
                x, y = job.data(i, d, m)
                for module in modules:
                    x = module(x)
                loss = job.loss_fn(x, y)
                total += float(loss.detach())
                (loss * scale).backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(total * scale)
    params = [{k: v.detach().clone() for k, v in m.named_parameters()} for m in modules]
    return ReferenceResult(params, losses)
