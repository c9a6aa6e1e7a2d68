"""The crowded-ends bound (solvers/crowded_ends.py): sound on random jobs against an optimum
found without it, tight where it decides, and its two small pieces (one stage-0 worker's fit,
the assignment search) on hand-made cases."""

from unittest import mock

import pytest
from hypothesis import HealthCheck, assume, given, settings

from recycle_planner.job.policy import Policy
from recycle_planner.solvers import bounds
from recycle_planner.solvers.bounds import all_bounds, lower_bound
from recycle_planner.solvers.crowded_ends import Job, assignable, crowded_ends, fits
from recycle_planner.solvers.heuristic import heuristic

from conftest import make_spec
from test_bounds import optimum, small_situations

REASON = "cannot all reach stage 0 in time"
BARRIER = Policy(stagger=False)


def without_it():
    """The other bounds only, also as the CP engine's floor: an optimum found this way does
    not lean on the bound under test."""
    return mock.patch.object(bounds, "crowded_ends", lambda *args: None)


def test_it_proves_the_4x4x8_uniform_plan():
    """The optimality table's last open row: worker 1:2 dead, split, staggered, unit costs.
    Two stage-2 peers run 11 micro-batches each with no room to spare; the micro-batches of
    their last two input backwards need four different stage-0 workers to finish by the
    period, and only three (pipelines 0, 2 and 1's) can run them: 35, the plan."""
    spec = make_spec(stages=4, pipelines=4, microbatches=8)
    failed = ((1, 2),)
    bound = lower_bound(spec, Policy(), failed)
    assert bound.value == pytest.approx(35.0)
    assert "stage-2" in bound.reason and REASON in bound.reason
    assert max(b.value for b in all_bounds(spec, Policy(), failed)
               if REASON not in b.reason) == pytest.approx(34.0)
    assert crowded_ends(spec, Policy(), failed, 35.0) is None  # 36 is not refuted
    assert heuristic(spec, Policy(), failed).simulation.period == pytest.approx(35.0)


@pytest.mark.parametrize("S, D, M, costs, failed, period", [
    (4, 4, 3, dict(forward=[1.5, 1, 0.5, 0.5], backward_input=[2, 0.5, 1, 0.5],
                   backward_weight=[0.5, 1.5, 1, 2], allreduce=1, optimizer=0.5),
     ((0, 2), (2, 2)), 19.5),
    (4, 3, 6, dict(forward=[1, 1.5, 1, 1.5], backward_input=[1.5, 1.5, 1, 0.5],
                   backward_weight=[2, 1, 2, 2], p2p=0.5, optimizer=0.5), ((1, 2),), 40.5),
])
def test_it_is_tight_on_barrier_jobs(S, D, M, costs, failed, period):
    """Two random jobs where it decides with a barrier (found by the soundness search): it
    equals the optimum, which the CP engine finds without it, half a unit above the rest."""
    spec = make_spec(stages=S, pipelines=D, microbatches=M, **costs)
    bound = lower_bound(spec, BARRIER, failed)
    assert REASON in bound.reason and bound.value == pytest.approx(period)
    with without_it():
        assert lower_bound(spec, BARRIER, failed).value == pytest.approx(period - 0.5)
        assert optimum(spec, BARRIER, failed) == pytest.approx(period)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_situations(max_stages=4, max_pipelines=3, max_microbatches=3))
def test_it_never_passes_the_optimum(case):
    """Climbing from 0 rather than from the other bounds, so that its own refutations are all
    checked; the optimum is exhaustive search's or the CP engine's without it."""
    spec, policy, failed = case
    found = crowded_ends(spec, policy, failed, 0.0)
    assume(found is not None)
    with without_it():
        best = optimum(spec, policy, failed)
    assume(best is not None)
    assert found[0] <= best + 1e-6, f"{found[1]}: {found[0]} above the optimum {best}"


def test_one_worker_fits_what_its_windows_allow():
    late, later = Job(31.0, 35.0, 2.0, (0,)), Job(32.0, 35.0, 2.0, (0,))
    assert fits([late]) and fits([later])
    assert not fits([late, later])  # 4 units in [31, 35): none left at a period below 35
    assert fits([Job(30.0, 35.0, 2.0, (0,)), later])
    assert not fits([Job(0.0, 2.0, 1.0, (0,)), Job(0.0, 2.0, 1.0, (0,))])


def test_the_assignment_search():
    """Four late jobs, each needing its own worker: three workers are too few, four do; a
    search that runs out of nodes refutes nothing."""
    jobs = [Job(31.0, 35.0, 2.0, (0, 1)), Job(32.0, 35.0, 2.0, (0, 1)),
            Job(31.0, 35.0, 2.0, (1, 2)), Job(32.0, 35.0, 2.0, (1, 2))]
    assert not assignable(jobs, 3, [1000])
    assert assignable(jobs[:3], 3, [1000])
    wider = [Job(j.release, j.deadline, j.amount, j.workers + (3,)) for j in jobs]
    assert assignable(wider, 4, [1000])
    assert assignable(jobs, 3, [0])
