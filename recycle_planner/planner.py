"""Plan one failure situation: choose a schedule, time it, and attach its figures."""

from __future__ import annotations

import logging
from typing import Any, Iterable, Sequence

from recycle_planner.job.policy import Policy, compute_ops
from recycle_planner.job.spec import JobSpec
from recycle_planner.job.workers import check_failed, format_workers
from recycle_planner.solvers import Solution
from recycle_planner.solvers.bounds import Bound, lower_bound
from recycle_planner.solvers.heuristic import Candidate
from recycle_planner.solvers.registry import SolverSettings
from recycle_planner.timing.metrics import Metrics
from recycle_planner.timing.plan import Plan, worker_stats
from recycle_planner.timing.simulate import Simulation

log = logging.getLogger(__name__)


# What planning costs, for the estimate `plan` announces before a long job (measured with the
# heuristic on 48k to 800k-op plans, including the shared machines of CI: about 25k ops a
# second per situation solved, and about 2 KiB of memory per op).
OPS_PER_SECOND = 25_000
BYTES_PER_OP = 2048


def _ops(spec: JobSpec, policy: Policy) -> int:
    return compute_ops(spec, policy) + 2 * spec.workers  # and each worker's all-reduce and step


def expected_seconds(spec: JobSpec, policy: Policy, failed: tuple,
                     settings: SolverSettings) -> float:
    """About how long plan_situation takes: each situation solved (the failure and its
    fault-free reference) costs its ops at OPS_PER_SECOND, plus the time limit of a solver
    that has one."""
    solves = 2 if failed else 1
    budget = settings.time_limit if "time_limit" in settings.entry.options else 0.0
    return solves * (_ops(spec, policy) / OPS_PER_SECOND + budget)


def expected_memory(spec: JobSpec, policy: Policy) -> float:
    """About how many bytes planning one situation holds at its peak."""
    return _ops(spec, policy) * BYTES_PER_OP


def solve(spec: JobSpec, policy: Policy, failed: tuple,
          solver: str | SolverSettings | None = None,
          fast: Sequence[Candidate] | None = None, **options: Any) -> Solution:
    """Run one registered solver (solvers/registry.py) on one failure set (already checked).
    `solver` is a name or settings; `fast` the fast solvers' candidates if already built
    (portfolio.fast_candidates); `options` change settings (time_limit=..., backend=...,
    node_limit=...; None keeps the default)."""
    settings = SolverSettings.of(solver, **options)
    log.info("planning %s with the %s solver", "dead workers " + format_workers(failed)
             if failed else "the fault-free situation", settings.solver)
    return settings.entry.run(spec, policy, failed, settings, fast)


def plan_situation(spec: JobSpec, policy: Policy, failed: Iterable[Iterable[int]] = (),
                   solver: str | SolverSettings | None = None, reference: float | None = None,
                   fast: Sequence[Candidate] | None = None, **options: Any) -> Plan:
    """The plan for one failure set, with its figures. `reference` is the fault-free period
    (computed when not given; pass it to save the work for many situations); `fast` the fast
    solvers' plans of this failure set when the caller already has them. Only this situation's
    own bounds certify the plan: the fault-free optimum's does not, since moving re-routed ops
    back to their dead owners can break the owner's memory cap."""
    settings = SolverSettings.of(solver, **options)
    failed = check_failed(spec, failed)
    solution = solve(spec, policy, failed, settings, fast)
    bounds = []
    if solution.bound is not None:
        bounds.append(Bound(solution.bound, solution.bound_reason or "a solver's bound"))
    if not failed:
        reference = solution.simulation.period
    elif reference is None:
        reference = solve(spec, policy, (), settings).simulation.period
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
                    bounds: Iterable[Bound] = ()) -> Metrics:
    """The plan's figures; the best of the analytic bound and `bounds` certifies it."""
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
    samples = throughput = None
    if spec.microbatch_size is not None and sim.period > 0:
        samples = spec.pipelines * spec.microbatches * spec.microbatch_size
        throughput = samples / (sim.period / 1000.0)
    return Metrics(
        iteration_time=sim.iteration_time,
        period=sim.period,
        fault_free_period=fault_free_period,
        degradation=_clean(sim.period / fault_free_period - 1.0) if fault_free_period > 0
        else 0.0,
        lower_bound=lb,
        lower_bound_reason=bound.reason,
        gap=max(0.0, sim.period / lb - 1.0) if lb > 0 else 0.0,
        optimal=bool(lb > 0 and sim.period <= lb * (1 + 1e-6)),
        bubble_rate=float(stats.bubble_rate[alive].mean()) if alive else 0.0,
        max_bubble_rate=float(stats.bubble_rate[alive].max()) if alive else 0.0,
        peak_inflight=int(stats.peak_inflight.max()) if alive else 0,
        rerouted_ops=schedule.rerouted_count(),
        ops=schedule.n_ops,
        steady_state_iterations=sim.iterations_simulated,
        samples_per_iteration=samples,
        throughput=throughput,
    )



def _clean(x: float) -> float:
    """Round float noise (a period equal to the reference up to rounding) to exactly 0."""
    return 0.0 if abs(x) < 1e-9 else x
