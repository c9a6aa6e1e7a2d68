"""A stage's training state: parameters, optimizer state, step count; undo, copies, checkpoints.

With the staggered optimizer a stage steps as soon as its own gradients are reduced, while
other stages are still working on the same iteration. If a worker dies then, the iteration
is redone, so a stage that already stepped must undo that step. `StageState` keeps the state
from before its latest step (`undo.UndoCopy`: on the host by default, and skipped where no
undo can come): no stage can step iteration i+1 before every stage has stepped iteration i,
so when a stage takes its next step the previous iteration is complete everywhere and one
saved copy is always enough.

Checkpoints: `RUN/checkpoints/iter-NNNNNN/stage{s}/`, one `torch.distributed.checkpoint`
folder per stage (model and optimizer state dicts and the step count, written by the stage's
first live worker into a temporary folder renamed into place), `manifest.json` in the same
folder once every stage's is there (written by the launcher, or by the last writer when the
coordinator is lost), and `RUN/checkpoints/latest.json` naming the newest complete one. A
checkpoint of iteration k holds every stage's state after k optimizer steps. On a cluster RUN
is a shared filesystem.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from recycle_planner.errors import RecycleError
from recycle_planner.executor.config import UNDO_COPY
from recycle_planner.executor.data.undo import UndoCopy
from recycle_planner.io import write_json


class StageState:
    """`scheduler` (an LR scheduler of `optimizer`, or None) steps after every optimizer step
    and is undone, copied and checkpointed with it; `undo_copy` is where the copy that undoes
    a step lives (`config.UNDO_PLACES`)."""

    def __init__(self, module: torch.nn.Module, optimizer: Any, steps: int = 0,
                 scheduler: Any = None, undo_copy: str = UNDO_COPY):
        self.module = module
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.steps = steps
        self.undo = UndoCopy(undo_copy)

    def step(self, apply: bool = True, undoable: bool = True) -> None:
        """Save what an undo needs, then step (unless `apply` is False: a step skipped, as
        a loss scaler does on an overflow; the iteration still counts) and clear the
        gradients. `undoable` False: no other live worker can report fewer steps (the
        generation's only member), so nothing is saved."""
        self.take_step(apply, undoable)
        self.count_step()

    def take_step(self, apply: bool = True, undoable: bool = True) -> None:
        """The first half of `step`: save, step the optimizer and the scheduler; the
        gradients stay and the step is not counted yet. A step taken before its hook's sum
        is known (`validation.py`) stops here until it is checked: `revert` takes it back
        (to redo it from the same gradients), `count_step` counts it."""
        if undoable:
            self.undo.save(self.params, self.optimizer, self.scheduler, tensors=apply)
        else:
            self.undo.drop()
        if apply:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def revert(self) -> None:
        """Take back the step `take_step` took and nobody counted (the gradients stay)."""
        self.undo.restore(self.params, self.optimizer, self.scheduler)

    def count_step(self) -> None:
        """The step is final: clear the gradients and count it."""
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1

    @property
    def can_undo(self) -> bool:
        return self.undo.ready

    def rollback_to(self, steps: int) -> None:
        """Undo the latest step if the stage is one step past `steps`."""
        if self.steps == steps:
            return
        if self.steps != steps + 1 or not self.undo.ready:
            raise RecycleError(f"cannot undo from step {self.steps} to step {steps}: only the "
                               f"latest step can be undone")
        self.undo.restore(self.params, self.optimizer, self.scheduler)
        self.steps = steps

    def clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        torch.save(self.state_dict(), buf)
        return buf.getvalue()

    def state_dict(self) -> dict[str, Any]:
        """What a copy or a checkpoint holds."""
        out = {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
               "steps": self.steps}
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        return out

    def load_bytes(self, payload: bytes) -> None:
        self.load(torch.load(io.BytesIO(payload), map_location=_device_of(self.module),
                             weights_only=True))

    def load(self, data: dict[str, Any]) -> None:
        """Take a peer's or a checkpoint's state (`to_bytes`'s dict); nothing left to undo."""
        self.module.load_state_dict(data["model"])
        self.optimizer.load_state_dict(data["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(data["scheduler"])
        self.steps = int(data["steps"])
        self.undo.drop()


def _device_of(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def checkpoint_folder(run_dir: str | Path, iteration: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"iter-{iteration:06d}"


def write_stage_checkpoint(run_dir: str | Path, iteration: int, stage: int,
                           state: StageState) -> Path:
    """Write one stage's state with torch.distributed.checkpoint (each worker saves on its
    own: no process group). The state after k steps is the same on every replica and every
    attempt, so a folder that is already there is kept."""
    folder = checkpoint_folder(run_dir, iteration)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"stage{stage}"
    if (path / ".metadata").is_file():
        return path
    tmp = folder / f".stage{stage}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state.state_dict(), checkpoint_id=tmp, no_dist=True)
    try:
        os.replace(tmp, path)
    except OSError:  # another writer got there first with the same state
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def write_manifest(run_dir: str | Path, iteration: int, stages: int,
                   extra: dict[str, Any] | None = None) -> Path | None:
    """Mark the checkpoint of `iteration` complete if every stage's file is there, and point
    `latest.json` at it. Returns the folder, or None if a stage is missing."""
    folder = checkpoint_folder(run_dir, iteration)
    files = [folder / f"stage{s}" for s in range(stages)]
    if not all((f / ".metadata").is_file() for f in files):
        return None
    manifest = {"format": "recycle-checkpoint", "version": 1, "iteration": iteration,
                "stages": stages, "files": [f.name for f in files], **(extra or {})}
    write_json(folder / "manifest.json", manifest)
    latest = Path(run_dir) / "checkpoints" / "latest.json"
    current = latest_checkpoint(run_dir)
    if current is None or current[0] <= iteration:
        write_json(latest, {"iteration": iteration, "folder": folder.name})
    return folder


def latest_checkpoint(run_dir: str | Path) -> tuple[int, Path] | None:
    """(iteration, folder) of the newest complete checkpoint, or None."""
    latest = Path(run_dir) / "checkpoints" / "latest.json"
    if not latest.is_file():
        return None
    try:
        data = json.loads(latest.read_text())
        folder = latest.parent / data["folder"]
        iteration = int(data["iteration"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RecycleError(f"{latest}: unreadable checkpoint pointer ({exc})") from None
    if not (folder / "manifest.json").is_file():
        raise RecycleError(f"{latest} names {folder}, which has no manifest.json")
    return iteration, folder


def load_stage_checkpoint(folder: str | Path, stage: int) -> dict[str, Any]:
    """The saved dict of one stage: `model` and `optimizer` state dicts and `steps`."""
    path = Path(folder) / f"stage{stage}"
    if not (path / ".metadata").is_file():
        raise RecycleError(f"{path}: no checkpoint of stage {stage} there")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            # Loads every key without a template: the optimizer state of a fresh optimizer
            # is empty, so dcp.load has nothing to load into.
            data = _load_state_dict_from_keys(checkpoint_id=path)
    except (OSError, RuntimeError, ValueError) as exc:
        raise RecycleError(f"{path}: cannot read checkpoint ({exc})") from None
    optimizer = data["optimizer"]  # DCP keeps nested dict keys as strings
    optimizer["state"] = {int(k): v for k, v in optimizer["state"].items()}
    data["steps"] = int(data["steps"])
    return data
