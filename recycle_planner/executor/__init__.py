"""The executor: run a plan library's plans on real torch models and survive dead workers.

Public API:

- `Job`: the user's stage modules, loss, optimizer factory, data source and plan library.
- `run(job)`: the body of a worker process (call it from a training script).
- `launch(target, LaunchConfig(nproc=...))`: start the workers, handle failures, return a
  `LaunchResult` (its `status`, a `Status`; its `events`, `Event` records of an `EventKind`;
  `LaunchResult.from_dict` reads a run folder's result.json back); raises `TrainingStopped`
  when the job cannot finish.
- `train_reference(job, pipelines, microbatches)`: the single-process result to compare with.
- `parse_fault("1:2:F0")`: inject a real process death for tests and drills.
- `ClipGradNorm(max_norm)`: global-norm gradient clipping across stages (a `StepHook`, and
  a `Validated` one: stages step without waiting for the global norm and check it after).

The package has two sides that meet in the worker (`worker.py`): `control/` (membership,
generations, leases, decisions, the launcher, the coordinator and host agents; every message
between processes is a typed record of `control/messages.py`, and a worker reaches the control
plane only through a `control.link.Link`) and `data/` (process groups, the program's ops, the
optimizer step, undo and checkpoints, abort). docs/executor.md, "How it is built", draws the
seam.

Names are imported on first use (PEP 562), so that the launcher does not pay for the worker's
torch imports; the worker side needs torch (`pip install recycle-planner[torch]`).
"""

from importlib import import_module

_WHERE = {
    "LaunchConfig": "control.agent", "LaunchResult": "control.result",
    "Status": "control.result", "Event": "control.result", "EventKind": "control.result",
    "TrainingStopped": "control.agent", "launch": "control.agent",
    "worker_command": "control.agent", "Fault": "faults", "parse_fault": "faults",
    "Job": "job", "load_job": "job", "ReferenceResult": "reference",
    "train_reference": "reference", "run": "worker", "DynamicDims": "data.shapes",
    "ClipGradNorm": "data.hooks", "StepHook": "data.hooks", "Validated": "data.hooks",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'recycle_planner.executor' has no attribute {name!r}")
    return getattr(import_module(f"recycle_planner.executor.{_WHERE[name]}"), name)
