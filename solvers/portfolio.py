"""The registered solvers: which candidate plans each one builds, and when the MILP runs.

heuristic: list scheduling; dp: the slot-matching DP (with no failures there is nothing to
match and the heuristic's fault-free plan is returned); milp: the MILP warm-started from the
better of the two; auto: heuristic and dp, plus the MILP when its model fits the time budget.
The shortest period wins; the first candidate wins ties.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.schedules.ops import Worker
from recycle_planner.solvers import Solution
from recycle_planner.solvers.dp import dp_plan
from recycle_planner.solvers.heuristic import Candidate, heuristic
from recycle_planner.solvers.milp import estimated_pairs, milp_solution

if TYPE_CHECKING:
    from recycle_planner.solvers.registry import SolverSettings

log = logging.getLogger(__name__)

# Order variables the MILP can handle per second of budget, for `auto` (measured on the
# benchmark instances: beyond this HiGHS rarely improves on the warm start in time).
MILP_PAIRS_PER_SECOND = 400


def solve_heuristic(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...],
                    settings: SolverSettings) -> Solution:
    return best_of(settings, [heuristic(spec, policy, failed)])


def solve_dp(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...],
             settings: SolverSettings) -> Solution:
    found = dp_plan(spec, policy, failed) if failed else heuristic(spec, policy, failed)
    return best_of(settings, [found])


def solve_milp(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...],
               settings: SolverSettings) -> Solution:
    return with_milp(spec, policy, failed, settings, best_of(settings, _both(spec, policy, failed)))


def solve_auto(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...],
               settings: SolverSettings) -> Solution:
    found = best_of(settings, _both(spec, policy, failed))
    if estimated_pairs(spec, policy, failed) > MILP_PAIRS_PER_SECOND * settings.time_limit:
        return found
    return with_milp(spec, policy, failed, settings, found)


def _both(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...]) -> list[Candidate]:
    return [heuristic(spec, policy, failed)] + ([dp_plan(spec, policy, failed)] if failed else [])


def best_of(settings: SolverSettings, found: list[Candidate]) -> Solution:
    """The shortest candidate (the first on ties), with the candidates' periods as its report."""
    best = min(found, key=lambda c: c.simulation.period)
    for c in found:
        log.info("candidate %s: period %.6g ms", c.name, c.simulation.period)
    info: dict[str, Any] = {"name": settings.solver, "detail": best.name,
                            "candidates": {c.name: c.simulation.period for c in found}}
    return Solution(best.simulation, info)


def with_milp(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...],
              settings: SolverSettings, warm: Solution) -> Solution:
    """The MILP warm-started from `warm`: its plan if shorter, and its bound either way."""
    sim, milp_info, bound = milp_solution(spec, policy, failed, settings.time_limit,
                                          settings.backend, warm.simulation, settings.node_limit)
    info = {**warm.info, "milp": milp_info}
    log.info("milp: %s, objective %s, %s", milp_info["status"], milp_info["objective"],
             "an improvement" if milp_info["improved"] else
             f"no improvement: the plan stays {warm.info['detail']}")
    if milp_info["improved"]:
        info["detail"] = "milp"
        return Solution(sim, info, bound)
    return Solution(warm.simulation, info, bound)
