"""Planning, at run time, a situation the library lacks: fast first, better in the background.

The coordinator meets a dead set with no plan (beyond the library's threshold, a situation
plan-all skipped, or no library at all) and must not stop training for it. `plan_on_demand`
gives a plan at once: one list-scheduling pass (0.9 s for 200k ops on one core; the schedule's
own generator for the fault-free situation), then the whole heuristic if the budget leaves room
for it at the planner's own estimate of its speed (`OPS_PER_SECOND`). Its holes are packed
(`situations.packed`), the placement the heuristic screens first. `refine` is what a background
process then runs: plan-all's own planning of the situation (every placement, the fast solvers,
then the exact engines that fit the budget, with plan-all's deterministic node and work
limits), so that a refined entry is the one plan-all would have stored, and a later plan-all
keeps it. The coordinator switches to it only when it is better by a margin.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from recycle_planner.job.policy import Policy
from recycle_planner.job.situations import Placement, logical_failed, packed
from recycle_planner.job.spec import JobSpec
from recycle_planner.library.entries import ON_DEMAND, LibraryEntry
from recycle_planner.library.placement import plan_best_placement
from recycle_planner.library.settings import Settings
from recycle_planner.limits import LIMITS
from recycle_planner.planner import OPS_PER_SECOND, finish_plan, solve
from recycle_planner.solvers.registry import TIME_LIMIT
from recycle_planner.solvers.heuristic import fault_free_simulation, list_schedule
from recycle_planner.timing.plan import Plan
from recycle_planner.timing.simulate import simulate

ON_DEMAND_BUDGET = 2.0
"""Seconds the coordinator may spend planning a missing situation (the first pass always
runs): GPT-sized jobs get the whole heuristic, 200k-op jobs one pass."""
REFINE_BUDGET = TIME_LIMIT
"""Seconds of the background refinement's solver time limit: plan-all's, so that a refined
entry counts as plan-all's own."""
REFINE_MARGIN = 0.01
"""Switch to a refined plan only if its period is shorter by at least this fraction: a switch
costs the survivors an iteration boundary and a plan load."""
REFINE_WHICH = ("on-demand", "heuristic", "off")
"""Which plans a run refines in the background once it uses them: those made on demand; those
and the library's heuristic plans; none."""


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
    whole = time.perf_counter() - t0 + sim.schedule.n_ops / OPS_PER_SECOND <= budget
    if whole:  # at 200k ops it would take 4.4 s (estimated 8 s): not within 2 s
        found = solve(spec, policy, failed, "heuristic")
        if found.simulation.period < sim.period - 1e-9:
            sim, detail = found.simulation, found.info.get("detail", detail)
    if reference is None:
        reference = sim.period if not failed else fault_free_simulation(spec, policy).period
    info = {"name": "heuristic", "detail": detail, "on_demand": {
        "budget_s": budget, "seconds": round(time.perf_counter() - t0, 3),
        "whole_heuristic": whole}}
    return finish_plan(sim, reference, info), placement


def refine(spec: JobSpec, policy: Policy, counts: tuple[int, ...], reference: float | None,
           budget: float = REFINE_BUDGET) -> tuple[Plan, Placement]:
    """The plan plan-all would make for `counts`, with `budget` seconds of solver time limit."""
    return plan_best_placement(spec, policy, counts, _refine_settings(budget), reference)


def refine_settings_hash(budget: float = REFINE_BUDGET) -> str:
    return _refine_settings(budget).hash


def _refine_settings(budget: float) -> Settings:
    """plan-all's settings with `budget` as the time limit (at least the smallest a solver
    takes: --refine-budget 0.05 refines with 0.1 s)."""
    return Settings(time_limit=max(budget, LIMITS["time_limit"].low))


def wants_refinement(entry: LibraryEntry, which: str) -> bool:
    """Whether a run using `entry` should refine it (`which` is one of REFINE_WHICH); a plan
    proven optimal never is."""
    if entry.metrics.optimal or which == "off":
        return False
    heuristic = (entry.solver or {}).get("name") == "heuristic"
    return entry.made == ON_DEMAND or (which == "heuristic" and heuristic)


def refine_command(folder: Path, counts: tuple[int, ...], budget: float, out: Path) -> list[str]:
    """The background process that refines `counts` and writes the plan (compact) to `out`;
    it dies with the process that starts it."""
    return [sys.executable, "-m", "recycle_planner.library.ondemand", str(folder),
            ",".join(map(str, counts)), repr(budget), str(out), str(os.getpid())]


def main(argv: list[str]) -> None:
    from recycle_planner.files.planfile import write_plan
    from recycle_planner.library.lookup import PlanLibrary
    from recycle_planner.library.pool import _worker_setup

    folder, counts_text, budget, out, parent = argv
    _worker_setup(int(parent))
    os.nice(10)  # the workers come first on a shared core
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    lib = PlanLibrary.open(folder)
    counts = tuple(int(k) for k in counts_text.split(","))
    t0 = time.perf_counter()
    plan, placement = refine(lib.spec, lib.policy, counts, lib.reference_period, float(budget))
    plan = Plan(plan.schedule, plan.timing, plan.metrics, plan.solver,
                mapping={"placement": [list(g) for g in placement]})
    write_plan(plan, out, compact=True)
    logging.info("refined %s in %.1f s: period %.6g ms (%s)", list(counts),
                 time.perf_counter() - t0, plan.metrics.period, plan.solver.get("detail"))


if __name__ == "__main__":
    main(sys.argv[1:])
