"""The copy that undoes a stage's latest optimizer step: where it lives and what it holds.

With the staggered optimizer a stage steps while others still work on the same iteration; if
the iteration is abandoned, the launcher restarts it at the least step count any live worker
reports (`protocol.decide`), and a stage that already stepped goes back one step. Its copy of
the state from before that step (parameters, optimizer state, LR scheduler) is as large as
the parameters and the optimizer state together (3x the parameters with Adam).

Where it lives (`config.UNDO_PLACES`, chosen per run with `LaunchConfig.undo_copy`):

- `host` (the default): CPU memory, pinned when the stage is on a GPU and filled with
  non-blocking copies on the step's own stream, which orders them before the step's in-place
  updates: no GPU memory, at the cost of a transfer over the host link at every step.
- `device`: beside the parameters, for when that transfer costs more than the memory.

What it holds: a step that changes no tensor (`apply=False`: a loss scaler's skipped step)
keeps only the optimizer's hyper-parameters and the scheduler. A step no other live worker
can make undone (the generation's only member: every stage has a live member, so only a
one-stage job's lone survivor) keeps nothing. Every other step needs the whole copy, the
barrier policy included: its barrier follows the step, and a failure inside the barrier can
leave one worker stepped and another not, so the restart still undoes a step.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from recycle_planner.errors import RecycleError


def _on_host(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)


def _on_device(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t)


BUFFERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "host": _on_host, "device": _on_device}
"""Per place of `config.UNDO_PLACES`: an empty buffer for a tensor of the stage's state."""


class UndoCopy:
    """The state from before the latest step, in buffers reused from step to step."""

    def __init__(self, place: str):
        if place not in BUFFERS:
            raise RecycleError(f"undo copy place {place!r} is not one of {', '.join(BUFFERS)}")
        self.buffer = BUFFERS[place]
        self.params: list[torch.Tensor] | None = None
        self.optimizer: dict | None = None  # optimizer.state_dict() with copied tensors
        self.groups: list[dict] | None = None
        self.scheduler: dict | None = None
        self.tensors = False  # whether `params` and `optimizer` belong to the latest step
        self.ready = False

    def save(self, params: list[torch.Tensor], optimizer: Any, scheduler: Any,
             tensors: bool) -> None:
        """Copy what undoing the coming step needs (`tensors`: parameters and optimizer
        state too)."""
        current = optimizer.state_dict()
        self.groups = copy.deepcopy(current["param_groups"])
        self.scheduler = copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None
        self.tensors = tensors
        self.ready = True
        if not tensors:
            return
        with torch.no_grad():
            if self.params is None:
                self.params = [self.buffer(p) for p in params]
            for buf, p in zip(self.params, params):
                buf.copy_(p, non_blocking=True)
            self._save_optimizer(current)

    def _save_optimizer(self, current: dict) -> None:
        """Into the previous copy's buffers when the state's structure is unchanged (every
        step but the first), else into new ones."""
        saved = self.optimizer
        if saved is None or saved["state"].keys() != current["state"].keys() or any(
                saved["state"][i].keys() != st.keys() for i, st in current["state"].items()):
            saved = self.optimizer = {"state": {i: {} for i in current["state"]}}
        for i, st in current["state"].items():
            into = saved["state"][i]
            for key, value in st.items():
                old = into.get(key)
                if isinstance(value, torch.Tensor):
                    if not (isinstance(old, torch.Tensor) and old.shape == value.shape
                            and old.dtype == value.dtype):
                        old = into[key] = self.buffer(value)
                    old.copy_(value, non_blocking=True)
                else:
                    into[key] = copy.deepcopy(value)
        saved["param_groups"] = self.groups

    def drop(self) -> None:
        """The coming step can never be undone: keep nothing for it."""
        self.ready = False

    def restore(self, params: list[torch.Tensor], optimizer: Any, scheduler: Any) -> None:
        """Put the state from before the latest step back; the copy is used up."""
        if self.tensors:
            with torch.no_grad():
                for p, buf in zip(params, self.params):
                    p.copy_(buf, non_blocking=True)
            optimizer.load_state_dict(self.optimizer)
            self.optimizer = None  # the optimizer may now share its tensors
        else:
            for group, saved in zip(optimizer.param_groups, self.groups):
                group.update({k: v for k, v in saved.items() if k != "params"})
        if scheduler is not None:
            scheduler.load_state_dict(self.scheduler)
        self.ready = False
