"""Optimizer post-validation: step before the all-stage sum is known, check it when it arrives.

A step hook that needs a sum over all stages (global-norm clipping, `hooks.py`) would make
every stage wait at OPTIMIZER for the last stage's last W. With a `hooks.Validated` hook a
stage instead, at OPTIMIZER(i), computes its contribution, starts the sum without waiting and
steps with the outcome its own view gives (`Validated.guess`: unclipped, when its own norm is
finite and under the limit), keeping its reduced gradients. Before its first forward of
iteration i+1 (the first op that reads the parameters; before it waits for its activation,
so that a redo overlaps that wait), the sum has normally arrived: the
stage compares the outcome it gives with the one used and, in the rare case they differ,
reverts the step with the undo copy (`undo.py`, the LR scheduler included) and redoes it from
the same gradients. Only then is the step counted (`StageState.steps`, the fault injector's
after-step record), so results are exactly those of waiting for the sum (Zero Bubble's
optimizer post-validation, Qi et al., ICLR 2024).

Under failures a step may still be pending when the generation ends: the sum completed on some
workers and not on others, or the abort came first. The worker keeps the step, its gradients
and the undo copy, and reports the step and the sums it knows (`known`, in its `Ready`);
`protocol.decide` counts the pending step of iteration i iff some survivor knows iteration i's
sum and passes that sum in the `Decision`, and every pending worker settles before the next
generation runs (`settle_with`): it validates (redoing the step if needed) or reverts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Sequence

import torch

from recycle_planner.executor.data.comm import Comm, _error_of
from recycle_planner.executor.data.state import StageState

log = logging.getLogger(__name__)


@dataclass
class Pending:
    """A step taken (or, with `guess` None, waiting to be taken) before its sum is known."""

    iteration: int
    work: Any                # the sum's all-reduce; None once the generation has ended
    total: torch.Tensor | None  # what `work` sums into; after the end, the sum if it completed
    guess: Hashable | None   # the outcome the step was taken with; None: not taken yet
    shape: torch.Size        # the sum's


@dataclass(frozen=True)
class Settled:
    """How a pending step ended: counted (`counted`), and whether it was redone (the guess
    was wrong) or taken only now (the stage had no guess)."""

    counted: bool
    redone: bool = False
    late: bool = False


class PostValidation:
    """One stage's pending step. `on_counted(iteration)` is told when a step is counted."""

    def __init__(self, hook: Any, stage: int, state: StageState,
                 on_counted: Callable[[int], None] = lambda iteration: None):
        self.hook = hook
        self.stage = stage
        self.state = state
        self.on_counted = on_counted
        self.pending: Pending | None = None
        self.last: tuple[int, torch.Tensor] | None = None
        """The latest counted step's iteration and sum: a worker that counted step i knows
        iteration i's sum, which settles a peer's pending step i after a failure."""

    def begin(self, iteration: int, comm: Comm) -> None:
        """OPTIMIZER(iteration): start the sum and step with the local guess, if any."""
        params = self.state.params
        local = self.hook.stats(self.stage, params)
        work, total = comm.all_stages_start(local)
        guess = self.hook.guess(self.stage, local)
        if guess is not None:
            self.state.take_step(self.hook.act(self.stage, params, guess) is not False)
        self.pending = Pending(iteration, work, total, guess, total.shape)

    def settle(self, comm: Comm) -> Settled:
        """Wait for the pending step's sum (normally already there) and validate the step;
        `PeerFailure` if the sum failed or the generation was abandoned (the step stays
        pending)."""
        work = self.pending.work
        comm.wait(work, "all-stage sum")
        comm.confirm([work], "all-stage sum", synchronize=False)  # no device-wide wait
        return self._resolve(self.pending.total)

    def detach(self) -> None:
        """The generation ends: keep the pending step's sum if its all-reduce completed
        without error, and drop the work (no reference to a closed group may remain)."""
        pending = self.pending
        if pending is None or pending.work is None:
            return
        work, pending.work = pending.work, None
        if not (work.is_completed() and _error_of(work) is None):
            pending.total = None

    def known(self) -> dict[int, tuple[float, ...]]:
        """The sums this worker knows, by iteration (its `Ready` report)."""
        self.detach()
        out = {}
        if self.last is not None and self.last[0] == self.state.steps - 1:  # not undone since
            out[self.last[0]] = _values(self.last[1])
        if self.pending is not None and self.pending.total is not None:
            out[self.pending.iteration] = _values(self.pending.total)
        return out

    def settle_with(self, sums: Mapping[int, Sequence[float]]) -> Settled:
        """A decision settles the pending step: validate it with the sum it carries for the
        step's iteration, else revert it (nobody alive knows the sum: the iteration is
        redone)."""
        pending = self.pending
        values = sums.get(pending.iteration)
        if values is None:
            self.discard()
            return Settled(False)
        return self._resolve(torch.tensor(values, dtype=torch.float64).reshape(pending.shape))

    def settle_alone(self) -> Settled:
        """No decision can come (the control plane is lost): validate with the sum if this
        worker has it, else revert."""
        return self.settle_with(self.known())

    def discard(self) -> None:
        """Revert the pending step, if taken, and drop its gradients."""
        if self.pending.guess is not None:
            self.state.revert()
        self.state.clear_grads()
        self.pending = None

    def _resolve(self, total: torch.Tensor) -> Settled:
        pending, params = self.pending, self.state.params
        outcome = self.hook.outcome(self.stage, total)
        redo = pending.guess is not None and pending.guess != outcome
        if redo:
            log.info("iteration %d: the step taken with %r is redone with %r", pending.iteration,
                     pending.guess, outcome)
            self.state.revert()
        if redo or pending.guess is None:
            self.state.take_step(self.hook.act(self.stage, params, outcome) is not False)
        self.state.count_step()
        self.pending = None
        self.last = (pending.iteration, total)
        self.on_counted(pending.iteration)
        return Settled(True, redo, pending.guess is None)


def _values(total: torch.Tensor) -> tuple[float, ...]:
    return tuple(float(v) for v in total.detach().double().flatten().tolist())
