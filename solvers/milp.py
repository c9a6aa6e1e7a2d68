"""The exact re-routing engine as a MILP: build the model, warm-start it, solve it on a backend
and decode the answer.

One module per step: milp_model.py (the model and what it leaves out), milp_warm.py (a
schedule as a starting solution), milp_backends.py (HiGHS, PuLP), milp_decode.py (a solution
as a schedule). This one runs them in order and reports the result.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.schedules.ops import Worker
from recycle_planner.schedules.schedule import Schedule
from recycle_planner.solvers.milp_backends import BACKENDS
from recycle_planner.solvers.milp_decode import decode
from recycle_planner.solvers.milp_model import ReroutingModel
from recycle_planner.solvers.milp_warm import warm_values
from recycle_planner.timing.simulate import Simulation, simulate

log = logging.getLogger(__name__)


@dataclass
class MilpResult:
    schedule: Schedule | None
    status: str
    objective: float | None
    bound: float | None
    gap: float | None
    seconds: float
    size: dict[str, int]
    warm_start: str

    def against(self, warm: Simulation, **extra: Any
                ) -> tuple[Simulation, dict[str, Any], float | None]:
        """The engine's plan (or `warm` when it found nothing shorter), its report (with
        `extra`) and its proven bound."""
        info: dict[str, Any] = {"status": self.status, "objective": self.objective,
                                "best_bound": self.bound, "gap": self.gap, **extra,
                                "seconds": round(self.seconds, 3), "model": self.size,
                                "warm_start": self.warm_start}
        best = warm
        if self.schedule is not None:
            sim = simulate(self.schedule)
            if sim.period < warm.period - 1e-9:
                best = sim
        info["improved"] = best is not warm
        return best, info, self.bound


def run_milp(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...], time_limit: float,
             backend: str = "highs", warm: Simulation | None = None,
             node_limit: int | None = None) -> MilpResult:
    """Build, warm-start and solve the model; decode the best solution into a schedule.

    `node_limit` bounds the branch-and-bound tree: unlike the time limit it gives the same
    answer on every machine (one thread, fixed seed)."""
    t0 = time.perf_counter()
    model = ReroutingModel(spec, policy, failed, warm)
    values0 = warm_values(model, warm) if warm is not None else None
    warm_state = "none" if warm is None else ("used" if values0 is not None else
                                              "not in the model's shape (index order)")
    remaining = max(0.1, time_limit - (time.perf_counter() - t0))
    size = model.model.size()
    log.info("solving the MILP with %s: %d binaries, %d constraints, warm start %s, at most "
             "%.1f s%s", backend, size.get("binaries", 0), size.get("constraints", 0),
             warm_state, remaining, "" if node_limit is None else f" or {node_limit} nodes")
    status, obj, bound, values = BACKENDS[backend](model.model, remaining, values0, node_limit)
    schedule = decode(model, values) if values is not None else None
    gap = None
    if obj is not None and bound is not None and obj > 0:
        gap = max(0.0, (obj - bound) / obj)
    return MilpResult(schedule, status, obj, bound, gap, time.perf_counter() - t0, size,
                      warm_state)


def milp_solution(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...], time_limit: float,
                  backend: str, warm: Simulation, node_limit: int | None = None
                  ) -> tuple[Simulation, dict[str, Any], float | None]:
    """The MILP's plan (or the warm start when the MILP found nothing better), its report and
    its proven bound."""
    res = run_milp(spec, policy, failed, time_limit, backend, warm, node_limit)
    return res.against(warm, backend=backend)
