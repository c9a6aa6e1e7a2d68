"""Plan one situation for the library: try the placements of its holes, keep the best."""

from __future__ import annotations

from recycle_planner.job.policy import Policy
from recycle_planner.job.situations import Placement, logical_failed, placements
from recycle_planner.job.spec import JobSpec
from recycle_planner.library.settings import Settings
from recycle_planner.planner import plan_situation, solve
from recycle_planner.solvers.heuristic import list_schedule
from recycle_planner.timing.plan import Plan
from recycle_planner.timing.simulate import simulate

# Above this many ops per plan, placements are compared with one list-scheduling pass and only
# the best one is planned with the full solver.
SCREEN_ABOVE_OPS = 50_000


def plan_best_placement(spec: JobSpec, policy: Policy, counts: tuple[int, ...],
                        settings: Settings, reference: float | None,
                        reference_bound: float | None = None) -> tuple[Plan, Placement]:
    """Plan every placement of the holes (up to the settings' limit) and keep the shortest
    period; ties go to the placement listed first (packed before spread). On large jobs the
    placements are screened by one list-scheduling pass first; with the exact engines (cp,
    auto) by the fast solvers, so that the engines' budget goes to one placement."""
    options = placements(counts, spec.pipelines, settings.max_placements)
    ops = spec.workers * spec.microbatches * (3 if policy.decouple else 2)
    if len(options) > 1 and ops > SCREEN_ABOVE_OPS:
        periods = [simulate(list_schedule(spec, policy, logical_failed(p))).period for p in options]
        options = [options[min(range(len(options)), key=lambda i: (periods[i], i))]]
    elif len(options) > 1 and settings.solver in ("cp", "auto"):
        periods = [min(solve(spec, policy, logical_failed(p), name).simulation.period
                       for name in ("heuristic", "dp")) for p in options]
        options = [options[min(range(len(options)), key=lambda i: (periods[i], i))]]
    best: tuple[Plan, Placement] | None = None
    for placement in options:
        plan = plan_situation(spec, policy, logical_failed(placement), settings,
                              reference=reference, reference_bound=reference_bound)
        if best is None or plan.metrics.period < best[0].metrics.period - 1e-9:
            best = (plan, placement)
    assert best is not None
    return best
