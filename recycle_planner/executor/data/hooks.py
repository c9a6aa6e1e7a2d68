"""Hooks between a stage's gradient all-reduce and its optimizer step that need every stage.

Global-norm gradient clipping and loss-scale overflow checks read a number summed over all
stages. A `StepHook` splits that into `stats` (what this stage contributes, from its reduced
gradients) and `apply` (act on the sum over stages); the executor sums with one small
all-reduce over all workers, the single-process reference by adding. The price under the
staggered optimizer: no stage can step before every stage has reduced its gradients, so the
cool-down of iteration i and the warm-up of iteration i+1 no longer overlap (stage 0 waits for
the last stage's last W). docs/executor.md gives the measured cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


class StepHook(Protocol):
    def stats(self, stage: int, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """This stage's contribution (a float64 tensor, the same shape on every stage)."""

    def apply(self, stage: int, params: Sequence[torch.Tensor], total: torch.Tensor) -> bool:
        """Act on the gradients given the sum over stages; False skips the optimizer step."""


@dataclass(frozen=True)
class ClipGradNorm:
    """Scale every gradient by min(1, max_norm / global norm), the global norm taken over all
    stages' parameters (as `torch.nn.utils.clip_grad_norm_` on the whole model). A non-finite
    norm (an overflow under float16) skips the step."""

    max_norm: float
    eps: float = 1e-6

    def stats(self, stage: int, params: Sequence[torch.Tensor]) -> torch.Tensor:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float64)
        return sum(g.detach().double().pow(2).sum() for g in grads)

    def apply(self, stage: int, params: Sequence[torch.Tensor], total: torch.Tensor) -> bool:
        norm = float(total) ** 0.5  # one host read per iteration
        if not math.isfinite(norm):
            return False
        factor = min(1.0, self.max_norm / (norm + self.eps))
        if factor < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(factor)
        return True
