"""Hooks between a stage's gradient all-reduce and its optimizer step that need every stage.

Global-norm gradient clipping and loss-scale overflow checks read a number summed over all
stages. A `StepHook` splits that into `stats` (what this stage contributes, from its reduced
gradients) and `apply` (act on the sum over stages); the executor sums with one small
all-reduce over all workers, the single-process reference by adding.

Waiting for that sum before stepping is a barrier: no stage could step before every stage
has reduced its gradients. A hook that also implements `Validated` avoids it (the Zero
Bubble paper's optimizer post-validation, `executor/data/validation.py`): it names the
*outcome* the sum decides (for clipping: the factor, or a skipped step), guesses it from the
stage's own contribution when that guess is likely right, and the executor steps with the
guess at once, then compares with the outcome of the real sum when it arrives and redoes the
step in the rare case they differ. Results are exactly those of the barrier. A hook without
`Validated` keeps the barrier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Hashable, Protocol, Sequence, runtime_checkable

import torch

SKIP = "skip"
"""The outcome of a step that is not taken (an overflow): the optimizer does not step."""


class StepHook(Protocol):
    def stats(self, stage: int, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """This stage's contribution (a float64 tensor, the same shape on every stage)."""

    def apply(self, stage: int, params: Sequence[torch.Tensor], total: torch.Tensor) -> bool:
        """Act on the gradients given the sum over stages; False skips the optimizer step."""


@runtime_checkable
class Validated(Protocol):
    """A `StepHook` whose action depends on the sum only through a small comparable value
    (the outcome), so that a step taken with a guessed outcome can be checked and redone."""

    def outcome(self, stage: int, total: torch.Tensor) -> Hashable:
        """What the sum over stages decides (compared with `==` to a guess)."""

    def guess(self, stage: int, local: torch.Tensor) -> Hashable | None:
        """The outcome to step with before the sum is known, from this stage's own
        contribution; None when the local view says the guess would likely be wrong (the
        step then waits for the sum, which costs the barrier only on those iterations).
        `act` with a guess must leave the gradients as they are: a wrong guess is redone
        from them."""

    def act(self, stage: int, params: Sequence[torch.Tensor], outcome: Hashable) -> bool:
        """Act on the gradients for `outcome`; False skips the optimizer step."""


def validates(hook: Any) -> bool:
    """Whether the executor may step before `hook`'s sum is known and check afterwards."""
    return isinstance(hook, Validated) and getattr(hook, "post_validate", True)


@dataclass(frozen=True)
class ClipGradNorm:
    """Scale every gradient by min(1, max_norm / global norm), the global norm taken over all
    stages' parameters (as `torch.nn.utils.clip_grad_norm_` on the whole model). A non-finite
    norm (an overflow under float16) skips the step.

    `post_validate` (default): step at once unclipped when this stage's own norm is finite
    and under `max_norm` (the global norm most likely is too), and check when the global norm
    arrives; a stage whose own norm already exceeds `max_norm` waits for the global one (the
    factor is then below 1 but unknown); one whose own norm is not finite skips at once (the
    global one is not finite either). False: every stage waits for the global norm before
    stepping (the barrier)."""

    max_norm: float
    eps: float = 1e-6
    post_validate: bool = True

    def stats(self, stage: int, params: Sequence[torch.Tensor]) -> torch.Tensor:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float64)
        return sum(g.detach().double().pow(2).sum() for g in grads)

    def apply(self, stage: int, params: Sequence[torch.Tensor], total: torch.Tensor) -> bool:
        return self.act(stage, params, self.outcome(stage, total))

    def outcome(self, stage: int, total: torch.Tensor) -> float | str:
        norm = float(total) ** 0.5  # one host read per iteration
        if not math.isfinite(norm):
            return SKIP
        return min(1.0, self.max_norm / (norm + self.eps))

    def guess(self, stage: int, local: torch.Tensor) -> float | str | None:
        """The global sum is at least this stage's (squares): an infinite or NaN local sum
        makes the global one so (SKIP is exact); a local factor below 1 makes the global
        factor below 1 too, but of unknown value (None: wait)."""
        local_outcome = self.outcome(stage, local)
        return None if local_outcome != SKIP and local_outcome < 1.0 else local_outcome

    def act(self, stage: int, params: Sequence[torch.Tensor], outcome: Any) -> bool:
        if outcome == SKIP:
            return False
        if outcome < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(outcome)
        return True
