"""Planning, at run time, a situation the library lacks: fast first, better in the background.

The coordinator meets a dead set with no plan (beyond the library's threshold, a situation
plan-all skipped, or no library at all) and must not stop training for it. `plan_on_demand`
gives a plan at once: one list-scheduling pass (0.9 s for 200k ops on one core; the
schedule's own generator for the fault-free situation), then the whole heuristic if the
budget leaves room for its passes. Its holes are packed (`situations.packed`), the placement
the heuristic screens first. `refine` is what a background process then runs: plan-all's own
planning of the situation (every placement, the fast solvers, then the exact engines that fit
the budget); the coordinator switches to it only when it is better by a margin.
"""

from __future__ import annotations

import time

from recycle_planner.job.policy import Policy
from recycle_planner.job.situations import Placement, logical_failed, packed
from recycle_planner.job.spec import JobSpec
from recycle_planner.library.placement import plan_best_placement
from recycle_planner.library.settings import Settings
from recycle_planner.planner import finish_plan, solve
from recycle_planner.solvers.heuristic import fault_free_simulation, list_schedule
from recycle_planner.timing.plan import Plan
from recycle_planner.timing.simulate import simulate

ON_DEMAND_BUDGET = 2.0
"""Seconds the coordinator may spend planning a missing situation (the first pass always
runs): GPT-sized jobs get the whole heuristic, 200k-op jobs one pass."""
HEURISTIC_PASSES = 5
"""The whole heuristic costs about this many first passes (its candidates, measured at 200k
ops: 4.4 s against 0.9 s)."""
REFINE_BUDGET = 60.0
"""Seconds of the background refinement's solver time limit (and CP work limit)."""
REFINE_MARGIN = 0.01
"""Switch to a refined plan only if its period is shorter by at least this fraction: a switch
costs the survivors an iteration boundary and a plan load."""


def plan_on_demand(spec: JobSpec, policy: Policy, counts: tuple[int, ...],
                   reference: float | None, budget: float = ON_DEMAND_BUDGET
                   ) -> tuple[Plan, Placement]:
    """A plan for the per-stage dead `counts` within about `budget` seconds, and its
    placement. `reference` is the fault-free period (None: computed, with the generator)."""
    t0 = time.perf_counter()
    placement = packed(counts)
    failed = logical_failed(placement)
    if failed:
        sim, detail = simulate(list_schedule(spec, policy, failed)), "template order"
    else:
        sim, detail = fault_free_simulation(spec, policy), f"{policy.schedule} generator"
    first = time.perf_counter() - t0
    passes = 1
    if first * (1 + HEURISTIC_PASSES) <= budget:
        whole = solve(spec, policy, failed, "heuristic")
        passes += HEURISTIC_PASSES
        if whole.simulation.period < sim.period - 1e-9:
            sim, detail = whole.simulation, whole.info.get("detail", detail)
    if reference is None:
        reference = sim.period if not failed else fault_free_simulation(spec, policy).period
    info = {"name": "heuristic", "detail": detail, "on_demand": {
        "budget_s": budget, "seconds": round(time.perf_counter() - t0, 3),
        "whole_heuristic": passes > 1}}
    return finish_plan(sim, reference, info), placement


def refine(spec: JobSpec, policy: Policy, counts: tuple[int, ...], reference: float | None,
           budget: float = REFINE_BUDGET) -> tuple[Plan, Placement]:
    """The best plan plan-all would make for `counts` with `budget` seconds of solver limits."""
    settings = Settings(solver="auto", time_limit=budget, work_limit=budget)
    return plan_best_placement(spec, policy, counts, settings, reference)


def refine_settings_hash(budget: float = REFINE_BUDGET) -> str:
    return Settings(solver="auto", time_limit=budget, work_limit=budget).hash
