"""Plan one situation for the library: try the placements of its holes, keep the best."""

from __future__ import annotations

from recycle_planner.job.policy import Policy, compute_ops
from recycle_planner.job.situations import Placement, logical_failed, placements
from recycle_planner.job.spec import JobSpec
from recycle_planner.job.workers import check_failed
from recycle_planner.library.settings import Settings
from recycle_planner.planner import plan_situation
from recycle_planner.solvers.heuristic import Candidate, list_schedule
from recycle_planner.solvers.improve import RETRY_ABOVE_GAP, justified
from recycle_planner.solvers.portfolio import fast_candidates
from recycle_planner.timing.plan import Plan
from recycle_planner.timing.simulate import simulate

# Above this many ops per plan, placements are compared with one list-scheduling pass and only
# the best one is planned with the full solver.
SCREEN_ABOVE_OPS = 50_000


def plan_best_placement(spec: JobSpec, policy: Policy, counts: tuple[int, ...],
                        settings: Settings, reference: float | None) -> tuple[Plan, Placement]:
    """Plan every placement of the holes (up to the settings' limit) and keep the shortest
    period; ties go to the placement listed first (packed before spread). On large jobs the
    placements are screened by one list-scheduling pass first; with the exact engines (cp,
    auto) by the fast solvers, whose plans the chosen placement's solver then starts from (not
    built twice), so that the engines' budget goes to one placement."""
    options = placements(counts, spec.pipelines, settings.max_placements)
    everyone, built = options, None
    fast = None
    if len(options) > 1 and compute_ops(spec, policy) > SCREEN_ABOVE_OPS:
        periods = [simulate(list_schedule(spec, policy, logical_failed(p))).period for p in options]
        options = [options[min(range(len(options)), key=lambda i: (periods[i], i))]]
    elif len(options) > 1 and settings.solver in ("cp", "auto"):
        built = [fast_candidates(spec, policy, check_failed(spec, logical_failed(p)))
                 for p in options]
        periods = [min(c.simulation.period for c in found) for found in built]
        pick = min(range(len(options)), key=lambda i: (periods[i], i))
        options, fast = [options[pick]], built[pick]
    best: tuple[Plan, Placement] | None = None
    for placement in options:
        plan = plan_situation(spec, policy, logical_failed(placement), settings,
                              reference=reference, fast=fast)
        if best is None or plan.metrics.period < best[0].metrics.period - 1e-9:
            best = (plan, placement)
    assert best is not None
    # The screening ranks the placements before the improvement, which shortens them
    # unequally: a plan left with a gap is compared with the other placements' fast plans
    # improved (8x8x16: 1.27% -> 1.08% mean gap for 10 s more CPU, +16%).
    if built is not None and best[0].metrics.gap is not None \
            and best[0].metrics.gap > RETRY_ABOVE_GAP:
        best = _retried(spec, policy, settings, reference, best, everyone, built)
    return best


def _retried(spec: JobSpec, policy: Policy, settings: Settings, reference: float | None,
             best: tuple[Plan, Placement], options: list[Placement],
             built: list[list[Candidate]]) -> tuple[Plan, Placement]:
    """`best`, or the plan of the placement whose improved fast plans are the shortest, if that
    is shorter; placements listed first win ties."""
    others = [(min(c.simulation.period for c in found), i, found) for i, found in
              ((i, justified(spec, policy, built[i])) for i, p in enumerate(options)
               if p != best[1])]
    if not others:
        return best
    period, i, found = min(others, key=lambda o: o[:2])
    if period >= best[0].metrics.period - 1e-9:
        return best
    shortest = min(found, key=lambda c: c.simulation.period)
    plan = plan_situation(spec, policy, logical_failed(options[i]), settings,
                          reference=reference, fast=[shortest])
    return (plan, options[i]) if plan.metrics.period < best[0].metrics.period - 1e-9 else best
