"""The registered solvers: which candidate plans each one builds, and when the MILP runs.

heuristic: list scheduling, then the forward-backward improvement of its best plans
(improve.py); dp: the slot-matching DP (with no failures there is nothing to match and the
heuristic's fault-free plan is returned); milp: the MILP warm-started from the best of the
two; cp: the CP-SAT engine warm-started the same way, within its work limit (deterministic);
auto: heuristic and dp, the improvement of their plans, then, while a gap to the analytic bound
is left, the CP engine if the job is small enough for it and the MILP if its model fits the
time budget, then, where the gap is still above improve.RETRY_ABOVE_GAP, the improvement of
the heuristic's other candidates, and where any gap is left, the critical-path local search
(critical.py) on the best plan; it reports its budget. The shortest period wins; the first
candidate wins ties; the best bound of any engine certifies the plan.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Sequence

from recycle_planner.errors import RecycleError
from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.schedules.ops import Worker
from recycle_planner.solvers import Solution
from recycle_planner.solvers.bounds import lower_bound
from recycle_planner.solvers.cp import bound_reason, cp_fits, cp_prove, cp_solution
from recycle_planner.solvers.critical import local_search
from recycle_planner.solvers.dp import dp_plan
from recycle_planner.solvers.heuristic import Candidate, heuristic, heuristic_candidates
from recycle_planner.solvers.improve import RETRY_ABOVE_GAP, STARTS, UP_TO_OPS, justified
from recycle_planner.solvers.milp import milp_solution
from recycle_planner.solvers.milp_model import estimated_pairs

if TYPE_CHECKING:
    from recycle_planner.solvers.registry import SolverSettings

log = logging.getLogger(__name__)

# Order variables the MILP can handle per second of budget, for `auto` (measured on the
# benchmark instances: beyond this HiGHS rarely improves on the warm start in time).
MILP_PAIRS_PER_SECOND = 400


# Every solver takes `fast`: the fast solvers' candidates (fast_candidates) when the caller has
# already built them for this situation (the library's placement screening), else None.


def solve_heuristic(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...],
                    settings: SolverSettings, fast: Sequence[Candidate] | None = None) -> Solution:
    with_dp = failed and spec.chunks == 1  # fast_candidates ends with the DP's plan then
    starts = list(fast[:-1] if with_dp else fast) if fast else \
        heuristic_candidates(spec, policy, failed)[:STARTS]
    return best_of(settings, justified(spec, policy, starts))


def one_chunk_only(spec: JobSpec, solver: str) -> None:
    """The solvers that model one chunk per worker refuse a job with more, in one line."""
    if spec.chunks > 1:
        raise RecycleError(f"the {solver} solver plans jobs with one chunk per worker, but this "
                           f"one has {spec.chunks}: use --solver heuristic or auto")


def solve_dp(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...],
             settings: SolverSettings, fast: Sequence[Candidate] | None = None) -> Solution:
    one_chunk_only(spec, "dp")
    if fast:
        return best_of(settings, [fast[-1] if failed else fast[0]])
    found = dp_plan(spec, policy, failed) if failed else heuristic(spec, policy, failed)
    return best_of(settings, [found])


def solve_milp(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...],
               settings: SolverSettings, fast: Sequence[Candidate] | None = None) -> Solution:
    one_chunk_only(spec, "milp")
    warm = best_of(settings, fast or fast_candidates(spec, policy, failed))
    return with_milp(spec, policy, failed, settings, warm)


def solve_cp(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...],
             settings: SolverSettings, fast: Sequence[Candidate] | None = None) -> Solution:
    one_chunk_only(spec, "cp")
    warm = best_of(settings, fast or fast_candidates(spec, policy, failed))
    return with_cp(spec, policy, failed, settings, warm)


def solve_auto(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...],
               settings: SolverSettings, fast: Sequence[Candidate] | None = None) -> Solution:
    t0 = time.perf_counter()
    found = best_of(settings, justified(spec, policy,
                                        list(fast or fast_candidates(spec, policy, failed))))
    analytic = lower_bound(spec, policy, failed).value
    exact = spec.chunks == 1  # the engines model one chunk per worker
    if exact and _gap(analytic, found) > OPEN and cp_fits(spec, policy, failed):
        found = with_cp(spec, policy, failed, settings, found)
    if exact and _gap(analytic, found) > OPEN and estimated_pairs(
            spec, policy, failed) <= MILP_PAIRS_PER_SECOND * settings.time_limit:
        found = with_milp(spec, policy, failed, settings, found)
    if failed and found.simulation.schedule.n_ops <= UP_TO_OPS:  # else nothing is improved
        if _gap(analytic, found) > RETRY_ABOVE_GAP:
            found = with_more_starts(spec, policy, failed, found)
        if _gap(analytic, found) > SWAP_ABOVE_GAP:
            found = with_swaps(spec, policy, found)
    found.info["budget"] = {"time_limit": settings.time_limit, "work_limit": settings.cp_work,
                            "node_limit": settings.node_limit,
                            "seconds": round(time.perf_counter() - t0, 3)}
    return found


OPEN = 1e-6
"""A gap above this share is open: the engines run only then."""
SWAP_ABOVE_GAP = OPEN
"""Where the plan is still this far above its bound, the critical-path local search
(critical.py) runs last."""


def _gap(analytic: float, found: Solution) -> float:
    """How far the plan is above every bound proven so far (the situation's analytic bound,
    the engines' own), as a share of the highest."""
    return found.simulation.period / max(analytic, found.bound or 0.0) - 1


def with_more_starts(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...],
                     found: Solution) -> Solution:
    """`found`, or the shortest improvement of the heuristic's other candidates (those after
    the first improve.STARTS) if shorter. After the engines, so that their warm start, and so
    their plan, stays what it was without this step: a shorter warm start can lead CP-SAT's
    one-second search elsewhere (on the GPT library it then missed an optimum it had found)."""
    rest = heuristic_candidates(spec, policy, failed)[STARTS:]
    if not rest:
        return found
    better = min(justified(spec, policy, rest), key=lambda c: c.simulation.period)
    return _if_shorter(found, better, "more starts", tried=rest)


def with_swaps(spec: JobSpec, policy: Policy, found: Solution) -> Solution:
    """`found`, or the plan the critical-path local search reaches from it if shorter. Last,
    because it only refines one plan: what it swaps is what the others left waiting."""
    name = found.info.get("detail", "plan")
    return _if_shorter(found, local_search(spec, policy, Candidate(name, found.simulation)),
                       "critical-path swaps")


def _if_shorter(found: Solution, better: Candidate, step: str,
                tried: Sequence[Candidate] = ()) -> Solution:
    """`found` with the `tried` candidates' periods added to its report, and `better` in its
    place (named in the report) if shorter; the bound stays `found`'s."""
    shorter = better.simulation.period < found.simulation.period - 1e-9
    if not tried and not shorter:
        return found
    info = {**found.info, "candidates": {**found.info.get("candidates", {}),
                                         **{c.name: c.simulation.period for c in tried}}}
    if not shorter:
        return Solution(found.simulation, info, found.bound, found.bound_reason)
    log.info("%s: %s, period %.6g ms", step, better.name, better.simulation.period)
    info["candidates"][better.name] = better.simulation.period
    info["detail"] = better.name
    return Solution(better.simulation, info, found.bound, found.bound_reason)


def fast_candidates(spec: JobSpec, policy: Policy,
                    failed: tuple[Worker, ...]) -> list[Candidate]:
    """The fast solvers' plans: the heuristic's shortest (up to improve.STARTS of them, the
    improvement's starting points, shortest first), then (with failures) the DP's."""
    return heuristic_candidates(spec, policy, failed)[:STARTS] + (
        [dp_plan(spec, policy, failed)] if failed and spec.chunks == 1 else [])


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
    return _merge(warm, "milp", milp_info, sim, bound, "the MILP's best bound")


def with_cp(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...],
            settings: SolverSettings, warm: Solution) -> Solution:
    """The CP engine (its prove mode if asked) warm-started from `warm`: its plan if shorter,
    and its bound either way."""
    engine = cp_prove if settings.prove else cp_solution
    sim, cp_info, bound = engine(spec, policy, failed, settings.cp_work, warm.simulation)
    return _merge(warm, "cp", cp_info, sim, bound, bound_reason(cp_info))


def _merge(warm: Solution, name: str, report: dict[str, Any], sim: Any, bound: float | None,
           reason: str) -> Solution:
    """`warm` with an engine's report, plan (if shorter) and bound (if higher)."""
    info = {**warm.info, name: report}
    log.info("%s: %s, objective %s, %s", name, report["status"], report["objective"],
             "an improvement" if report["improved"] else
             f"no improvement: the plan stays {warm.info.get('detail')}")
    if report["improved"]:
        info["detail"] = name
    else:
        sim = warm.simulation
    if warm.bound is not None and (bound is None or warm.bound >= bound):
        bound, reason = warm.bound, warm.bound_reason
    return Solution(sim, info, bound, reason if bound is not None else None)
