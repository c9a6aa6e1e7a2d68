"""The executor: run a plan library's plans on real torch models and survive dead workers.

Public API:

- `Job`: the user's stage modules, loss, optimizer factory, data source and plan library.
- `run(job)`: the body of a worker process (call it from a training script).
- `launch(target, LaunchConfig(nproc=...))`: start the workers, handle failures, return a
  `LaunchResult`; raises `TrainingStopped` when the job cannot finish.
- `train_reference(job, pipelines, microbatches)`: the single-process result to compare with.
- `parse_fault("1:2:F0")`: inject a real process death for tests and drills.

Names are imported on first use (PEP 562), so that the launcher does not pay for the worker's
torch imports; the worker side needs torch (`pip install recycle-planner[torch]`).
"""

from importlib import import_module

_WHERE = {
    "LaunchConfig": "agent", "LaunchResult": "agent", "TrainingStopped": "agent",
    "launch": "agent", "worker_command": "agent", "Fault": "faults", "parse_fault": "faults",
    "Job": "job", "load_job": "job", "ReferenceResult": "reference",
    "train_reference": "reference", "run": "worker", "DynamicDims": "shapes",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'recycle_planner.executor' has no attribute {name!r}")
    return getattr(import_module(f"recycle_planner.executor.{_WHERE[name]}"), name)
