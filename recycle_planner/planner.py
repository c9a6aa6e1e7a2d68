"""Plan one failure situation: choose a schedule, time it, and attach its figures."""

from __future__ import annotations

import logging
from typing import Any, Iterable

from recycle_planner.failures import check_failed
from recycle_planner.plan import Plan, worker_stats
from recycle_planner.policy import Policy
from recycle_planner.simulate import Simulation
from recycle_planner.solvers.bounds import lower_bound
from recycle_planner.solvers.heuristic import Candidate, heuristic
from recycle_planner.spec import JobSpec

log = logging.getLogger(__name__)


def fault_free_reference(spec: JobSpec, policy: Policy) -> Candidate:
    """The best fault-free plan the planner finds under `policy`: the reference that
    degradation is measured against."""
    return heuristic(spec, policy, ())


def plan_situation(spec: JobSpec, policy: Policy, failed: Iterable[Iterable[int]] = (),
                   reference: Candidate | None = None) -> Plan:
    """The plan for one failure set, with its figures. `reference` (from
    `fault_free_reference`) saves recomputing the fault-free plan for many situations."""
    failed = check_failed(spec, failed)
    if reference is None:
        reference = fault_free_reference(spec, policy)
    best = heuristic(spec, policy, failed) if failed else reference
    info = {"name": "heuristic", "detail": best.name}
    log.debug("planned %s with %s: period %.3f", failed or "no failures", info,
              best.simulation.period)
    return finish_plan(best.simulation, reference.simulation.period, info)


def finish_plan(sim: Simulation, fault_free_period: float, solver: dict[str, Any],
                mapping: dict[str, Any] | None = None) -> Plan:
    """Attach metrics to a timed schedule."""
    return Plan(schedule=sim.schedule, timing=sim.timing,
                metrics=compute_metrics(sim, fault_free_period), solver=solver, mapping=mapping)


def compute_metrics(sim: Simulation, fault_free_period: float) -> dict[str, Any]:
    schedule = sim.schedule
    spec = schedule.spec
    stats = worker_stats(schedule, sim.timing, sim.period)
    alive = [i for i, o in enumerate(schedule.orders) if len(o)]
    bound = lower_bound(spec, schedule.policy, schedule.failed)
    lb = max(bound.value, 0.0)
    metrics: dict[str, Any] = {
        "iteration_time": sim.iteration_time,
        "period": sim.period,
        "fault_free_period": fault_free_period,
        "degradation": sim.period / fault_free_period - 1.0 if fault_free_period > 0 else 0.0,
        "lower_bound": lb,
        "lower_bound_reason": bound.reason,
        "gap": sim.period / lb - 1.0 if lb > 0 else 0.0,
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

