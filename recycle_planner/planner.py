"""Plan one failure situation: choose a schedule, time it, and attach its figures."""

from __future__ import annotations

import logging
from typing import Any, Iterable

from recycle_planner.errors import RecycleError
from recycle_planner.failures import check_failed
from recycle_planner.plan import Plan, worker_stats
from recycle_planner.policy import Policy
from recycle_planner.simulate import Simulation
from recycle_planner.solvers import SOLVERS, Solution
from recycle_planner.solvers.bounds import Bound, lower_bound
from recycle_planner.solvers.heuristic import heuristic
from recycle_planner.spec import JobSpec

log = logging.getLogger(__name__)


def solve(spec: JobSpec, policy: Policy, failed: tuple, solver: str = "heuristic",
          time_limit: float | None = None, backend: str = "highs") -> Solution:
    """Run one solver on one failure set (already checked)."""
    if solver not in SOLVERS:
        raise RecycleError(f"unknown solver {solver!r} (expected one of: {', '.join(SOLVERS)})")
    best = heuristic(spec, policy, failed)
    return Solution(best.simulation, {"name": "heuristic", "detail": best.name})


def plan_situation(spec: JobSpec, policy: Policy, failed: Iterable[Iterable[int]] = (),
                   solver: str = "heuristic", time_limit: float | None = None,
                   backend: str = "highs", reference: float | None = None) -> Plan:
    """The plan for one failure set, with its figures. `reference` is the fault-free period
    (computed when not given; pass it to save the work for many situations)."""
    failed = check_failed(spec, failed)
    solution = solve(spec, policy, failed, solver, time_limit, backend)
    if reference is None:
        reference = solution.simulation.period if not failed else \
            solve(spec, policy, (), solver, time_limit, backend).simulation.period
    log.debug("planned %s with %s: period %.3f", failed or "no failures", solution.info,
              solution.simulation.period)
    return finish_plan(solution.simulation, reference, solution.info, bound=solution.bound)


def finish_plan(sim: Simulation, fault_free_period: float, solver: dict[str, Any],
                mapping: dict[str, Any] | None = None, bound: float | None = None) -> Plan:
    """Attach metrics to a timed schedule; `bound` is a solver's proven bound, if any."""
    return Plan(schedule=sim.schedule, timing=sim.timing,
                metrics=compute_metrics(sim, fault_free_period, bound), solver=solver,
                mapping=mapping)


def compute_metrics(sim: Simulation, fault_free_period: float,
                    solver_bound: float | None = None) -> dict[str, Any]:
    schedule = sim.schedule
    spec = schedule.spec
    stats = worker_stats(schedule, sim.timing, sim.period)
    alive = [i for i, o in enumerate(schedule.orders) if len(o)]
    bound = lower_bound(spec, schedule.policy, schedule.failed)
    if solver_bound is not None and solver_bound > bound.value:
        bound = Bound(min(solver_bound, sim.period), "the MILP's best bound")
    lb = max(bound.value, 0.0)
    metrics: dict[str, Any] = {
        "iteration_time": sim.iteration_time,
        "period": sim.period,
        "fault_free_period": fault_free_period,
        "degradation": sim.period / fault_free_period - 1.0 if fault_free_period > 0 else 0.0,
        "lower_bound": lb,
        "lower_bound_reason": bound.reason,
        "gap": max(0.0, sim.period / lb - 1.0) if lb > 0 else 0.0,
        "optimal": bool(lb > 0 and sim.period <= lb * (1 + 1e-9)),
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

