"""plan-all --prove: spend the CP engine's prove mode on an entry whose gap is still open."""

from __future__ import annotations

from recycle_planner.planner import finish_plan
from recycle_planner.solvers.bounds import Bound
from recycle_planner.solvers.cp import bound_reason, cp_prove
from recycle_planner.timing.plan import Plan
from recycle_planner.timing.simulate import simulate


def prove_plan(plan: Plan, reference: float, work: float) -> Plan:
    """The plan after the CP engine's prove mode, warm-started from it: a shorter plan if one
    is found, and the best bound proven (the plan's own bounds kept)."""
    sim = simulate(plan.schedule)
    new, info, bound = cp_prove(plan.spec, plan.policy, plan.failed, work, sim)
    bounds = [Bound(plan.metrics.lower_bound, plan.metrics.lower_bound_reason or "")]
    if bound is not None:
        bounds.append(Bound(bound, bound_reason(info, "prove mode")))
    solver = dict(plan.solver, prove=info)
    if info["improved"]:
        solver["detail"] = "cp (prove)"
    return finish_plan(new, reference if plan.failed else new.period, solver, bounds=bounds)
