"""Single-process reference training: the numbers every distributed run must reproduce.

Chains all stages in one process and takes, per iteration, one optimizer step per stage on the
gradient of the mean loss over all D*M micro-batches, exactly the step the executor computes
(each micro-batch loss scaled by 1/(D*M), gradients summed over the stage's live workers).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from recycle_planner.executor.data.boundary import call
from recycle_planner.executor.job import Job


@dataclass
class ReferenceResult:
    params: list[dict[str, torch.Tensor]]   # per stage: name -> tensor after training
    losses: list[float]                     # per iteration: mean micro-batch loss


def train_reference(job: Job, pipelines: int, microbatches: int,
                    iterations: int | None = None) -> ReferenceResult:
    modules = [job.build_stage(s) for s in range(len(job.stages))]
    states = [job.build_state(m) for m in modules]
    params = [[p for p in m.parameters() if p.requires_grad] for m in modules]
    autocast = job.autocast_dtype()
    n = job.iterations if iterations is None else iterations
    scale = 1.0 / (pipelines * microbatches)
    losses = []
    for i in range(n):
        total = 0.0
        for d in range(pipelines):
            for m in range(microbatches):
                x, y = job.data(i, d, m)
                with (torch.autocast("cpu", dtype=autocast) if autocast is not None
                      else contextlib.nullcontext()):
                    for module in modules:
                        x = call(module, x)
                loss = job.loss_fn(x, y)
                total += float(loss.detach())
                (loss * scale).backward()
        apply = [True] * len(modules)
        hook = job.step_hook
        if hook is not None:
            summed = sum(hook.stats(s, params[s]) for s in range(len(modules)))
            apply = [hook.apply(s, params[s], summed) is not False for s in range(len(modules))]
        for (opt, scheduler), ok in zip(states, apply):
            if ok:
                opt.step()
            if scheduler is not None:
                scheduler.step()
            opt.zero_grad(set_to_none=True)
        losses.append(total * scale)
    out = [{k: v.detach().clone() for k, v in m.named_parameters()} for m in modules]
    return ReferenceResult(out, losses)
