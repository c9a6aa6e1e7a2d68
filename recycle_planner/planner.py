"""Plan one failure situation: choose a schedule, time it, and attach its figures."""

from __future__ import annotations

import logging
from typing import Any, Iterable

from recycle_planner.errors import RecycleError
from recycle_planner.failures import check_failed, format_workers
from recycle_planner.plan import Plan, worker_stats
from recycle_planner.policy import Policy
from recycle_planner.simulate import Simulation
from recycle_planner.solvers import SOLVERS, Solution
from recycle_planner.solvers.bounds import Bound, lower_bound
from recycle_planner.solvers.dp import dp_plan
from recycle_planner.solvers.heuristic import Candidate, heuristic
from recycle_planner.solvers.milp import BACKENDS, estimated_pairs, milp_solution
from recycle_planner.spec import JobSpec

log = logging.getLogger(__name__)


# Order variables the MILP can handle per second of budget, for `auto` (measured on the
# benchmark instances: beyond this HiGHS rarely improves on the warm start in time).
MILP_PAIRS_PER_SECOND = 400


def solve(spec: JobSpec, policy: Policy, failed: tuple, solver: str = "heuristic",
          time_limit: float | None = None, backend: str = "highs",
          node_limit: int | None = None) -> Solution:
    """Run one solver on one failure set (already checked).

    heuristic: list scheduling; dp: the slot-matching DP (with no failures there is nothing to
    match and the heuristic's fault-free plan is returned); milp: the MILP warm-started from
    the better of the two; auto: heuristic and dp, plus the MILP when its model fits the time
    budget; the shortest period wins."""
    if solver not in SOLVERS:
        raise RecycleError(f"unknown solver {solver!r} (expected one of: {', '.join(SOLVERS)})")
    if backend not in BACKENDS:
        raise RecycleError(f"unknown MILP backend {backend!r} (expected one of: "
                           f"{', '.join(BACKENDS)})")
    time_limit = 10.0 if time_limit is None else float(time_limit)
    log.info("planning %s with the %s solver", "dead workers " + format_workers(failed)
             if failed else "the fault-free situation", solver)
    found: list[Candidate] = []
    if solver in ("heuristic", "milp", "auto") or not failed:
        found.append(heuristic(spec, policy, failed))
    if solver in ("dp", "milp", "auto") and failed:
        found.append(dp_plan(spec, policy, failed))
    best = min(found, key=lambda c: c.simulation.period)  # first wins ties
    for c in found:
        log.info("candidate %s: period %.6g ms", c.name, c.simulation.period)
    info: dict[str, Any] = {"name": solver, "detail": best.name,
                            "candidates": {c.name: c.simulation.period for c in found}}
    bound = None
    run = solver == "milp" or (solver == "auto" and estimated_pairs(spec, policy, failed)
                               <= MILP_PAIRS_PER_SECOND * time_limit)
    if run:
        sim, milp_info, bound = milp_solution(spec, policy, failed, time_limit, backend,
                                              best.simulation, node_limit)
        info["milp"] = milp_info
        log.info("milp: %s, objective %s, %s", milp_info["status"], milp_info["objective"],
                 "an improvement" if milp_info["improved"] else "no improvement: the plan "
                 "stays " + best.name)
        if milp_info["improved"]:
            info["detail"] = "milp"
            return Solution(sim, info, bound)
    return Solution(best.simulation, info, bound)


def plan_situation(spec: JobSpec, policy: Policy, failed: Iterable[Iterable[int]] = (),
                   solver: str = "heuristic", time_limit: float | None = None,
                   backend: str = "highs", reference: float | None = None,
                   node_limit: int | None = None, reference_bound: float | None = None) -> Plan:
    """The plan for one failure set, with its figures. `reference` is the fault-free period and
    `reference_bound` a proven lower bound of the fault-free situation (both computed when not
    given; pass them to save the work for many situations). A failure plan is also a valid
    fault-free plan (the dead workers just idle), so the fault-free bound bounds it too."""
    failed = check_failed(spec, failed)
    solution = solve(spec, policy, failed, solver, time_limit, backend, node_limit)
    bounds = []
    if solution.bound is not None:
        bounds.append(Bound(solution.bound, "the MILP's best bound"))
    if not failed:
        reference = solution.simulation.period
    elif reference is None:
        ff = solve(spec, policy, (), solver, time_limit, backend, node_limit)
        reference = ff.simulation.period
        if reference_bound is None:
            reference_bound = max(lower_bound(spec, policy, ()).value, ff.bound or 0.0)
    if failed and reference_bound is not None:
        bounds.append(Bound(reference_bound, "the fault-free optimum's bound"))
    log.debug("planned %s with %s: period %.3f", failed or "no failures", solution.info,
              solution.simulation.period)
    return finish_plan(solution.simulation, reference, solution.info, bounds=bounds)


def finish_plan(sim: Simulation, fault_free_period: float, solver: dict[str, Any],
                mapping: dict[str, Any] | None = None, bounds: Iterable[Bound] = ()) -> Plan:
    """Attach metrics to a timed schedule; `bounds` are proven bounds beyond the analytic
    ones (a solver's, the fault-free situation's)."""
    return Plan(schedule=sim.schedule, timing=sim.timing,
                metrics=compute_metrics(sim, fault_free_period, bounds), solver=solver,
                mapping=mapping)


def compute_metrics(sim: Simulation, fault_free_period: float,
                    bounds: Iterable[Bound] = ()) -> dict[str, Any]:
    schedule = sim.schedule
    spec = schedule.spec
    stats = worker_stats(schedule, sim.timing, sim.period)
    alive = [i for i, o in enumerate(schedule.orders) if len(o)]
    bound = lower_bound(spec, schedule.policy, schedule.failed)
    for other in bounds:
        if other.value > bound.value + 1e-9:
            # Never above the plan itself: a solver's bound is only trusted to its tolerance.
            bound = Bound(min(other.value, sim.period), other.reason)
    lb = max(bound.value, 0.0)
    metrics: dict[str, Any] = {
        "iteration_time": sim.iteration_time,
        "period": sim.period,
        "fault_free_period": fault_free_period,
        "degradation": _clean(sim.period / fault_free_period - 1.0) if fault_free_period > 0
        else 0.0,
        "lower_bound": lb,
        "lower_bound_reason": bound.reason,
        "gap": max(0.0, sim.period / lb - 1.0) if lb > 0 else 0.0,
        "optimal": bool(lb > 0 and sim.period <= lb * (1 + 1e-6)),
        "bubble_rate": float(stats.bubble_rate[alive].mean()) if alive else 0.0,
        "max_bubble_rate": float(stats.bubble_rate[alive].max()) if alive else 0.0,
        "peak_inflight": int(stats.peak_inflight.max()) if alive else 0,
        "rerouted_ops": schedule.rerouted_count(),
        "ops": schedule.n_ops,
        "steady_state_iterations": sim.iterations_simulated,
    }
    if spec.microbatch_size is not None and sim.period > 0:
        samples = spec.pipelines * spec.microbatches * spec.microbatch_size
        metrics["samples_per_iteration"] = samples
        metrics["throughput"] = samples / (sim.period / 1000.0)
    return metrics



def _clean(x: float) -> float:
    """Round float noise (a period equal to the reference up to rounding) to exactly 0."""
    return 0.0 if abs(x) < 1e-9 else x
