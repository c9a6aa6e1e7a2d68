"""A plan's figures as one typed record: what the plan file's `metrics` object and a library
entry's `metrics` hold, and what reports, the library, the what-if, the executor's decision and
the command line read.

The plan file's `metrics` object stays as it was (in both the timed and the compact form):
`to_dict` writes the same keys in the same order, and `from_dict` reads every file the planner
has written. Five figures are required (a plan file without them was always refused); the
others are absent (None) from hand-made files and from library entries, which repeat only
`ENTRY_FIELDS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from recycle_planner.errors import PlanFileError

REQUIRED = ("iteration_time", "period", "fault_free_period", "degradation", "lower_bound")
# The figures a library entry repeats, so that reports and launchers need not open plan files.
ENTRY_FIELDS = REQUIRED + ("gap", "optimal")


@dataclass(frozen=True)
class Metrics:
    iteration_time: float       # ms, first op of an iteration to its last optimizer step
    period: float               # ms, steady-state time per iteration
    fault_free_period: float    # ms, the same policy's plan with nothing dead
    degradation: float          # period / fault_free_period - 1
    lower_bound: float          # ms, no plan for this failure set repeats faster
    lower_bound_reason: str | None = None
    gap: float | None = None    # period / lower_bound - 1
    optimal: bool | None = None  # the period meets the bound
    bubble_rate: float | None = None      # idle share of the period, mean over live workers
    max_bubble_rate: float | None = None  # ... of the idlest live worker
    peak_inflight: int | None = None      # most micro-batches in flight on one worker
    rerouted_ops: int | None = None
    ops: int | None = None
    steady_state_iterations: int | None = None  # iterations simulated to reach the period
    samples_per_iteration: int | None = None    # with the spec's microbatch_size only
    throughput: float | None = None             # samples/s, likewise

    def to_dict(self) -> dict[str, Any]:
        """The `metrics` object of a plan file (absent figures left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, data: Any, where: str = "metrics") -> "Metrics":
        """The record of a `metrics` object; a PlanFileError naming `where` for a missing
        required figure or a figure of the wrong type. Unknown keys are ignored."""
        if not isinstance(data, dict):
            raise PlanFileError(f"{where}: 'metrics' must be an object")
        values = {}
        for f in fields(cls):
            value = data.get(f.name)
            if value is None:
                if f.name in REQUIRED:
                    raise PlanFileError(f"{where}: metrics.{f.name} must be a number")
                continue
            if not _fits(value, f.type):
                what = {"str | None": "a string", "bool | None": "true or false"}.get(
                    f.type, "a number")
                raise PlanFileError(f"{where}: metrics.{f.name} must be {what}")
            values[f.name] = value
        return cls(**values)

    def entry(self) -> "Metrics":
        """The figures a library entry repeats (ENTRY_FIELDS), the others left out."""
        return Metrics(**{k: getattr(self, k) for k in ENTRY_FIELDS})


def _fits(value: Any, annotation: str) -> bool:
    if annotation.startswith("str"):
        return isinstance(value, str)
    if annotation.startswith("bool"):
        return isinstance(value, bool)
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))
