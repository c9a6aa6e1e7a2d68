"""Solvers for one failure situation: each returns a timed schedule and what it knows about it.

- heuristic: list scheduling guided by the fault-free schedule (fast, any size);
- dp: dynamic programs that place re-routed micro-batches into the peers' idle time;
- milp: the exact model (peer assignment, op order, start times) with HiGHS or PuLP;
- auto: heuristic and dp always, milp as well when the model is small enough for the time
  budget; the best plan wins, and the best bound of any of them certifies it.

`registry.py` lists them by name with their settings; `portfolio.py` says what each runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from recycle_planner.timing.simulate import Simulation

@dataclass(frozen=True, eq=False)
class Solution:
    simulation: Simulation
    info: dict[str, Any] = field(default_factory=dict)
    bound: float | None = None  # a proven lower bound on the period, beyond the analytic ones
