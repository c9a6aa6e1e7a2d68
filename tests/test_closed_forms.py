"""Closed forms from the brief: uniform costs, no communication, p stages, m micro-batches."""

import pytest

from recycle_planner.job.policy import Policy
from recycle_planner.planner import plan_situation
from recycle_planner.schedules.generators import fault_free
from recycle_planner.solvers.bounds import lower_bound
from recycle_planner.timing.simulate import simulate

from conftest import make_spec

ONE_F_ONE_B = Policy("1f1b", decouple=False, stagger=False)
GPIPE = Policy("gpipe", decouple=False, stagger=False)
ZB_H1 = Policy("zb-h1", decouple=True, stagger=False)


@pytest.mark.parametrize("policy, expected", [(ONE_F_ONE_B, 33), (GPIPE, 33), (ZB_H1, 27)],
                         ids=["1f1b", "gpipe", "zb-h1"])
def test_uniform_costs_p4_m8(policy, expected):
    sim = simulate(fault_free(make_spec(), policy))
    assert sim.iteration_time == pytest.approx(expected)
    assert sim.period == pytest.approx(expected)


@pytest.mark.parametrize("f, i, w", [(1, 1, 1), (2, 2, 1), (1, 2, 1), (1, 1, 0.5), (3, 2, 2)])
@pytest.mark.parametrize("p, m", [(4, 8), (3, 6), (6, 12), (2, 5)])
def test_general_closed_forms(f, i, w, p, m):
    spec = make_spec(stages=p, microbatches=m, forward=f, backward_input=i, backward_weight=w)
    one_f_one_b = gpipe = (m + p - 1) * (f + i + w)
    zb_h1 = m * (f + i + w) + (p - 1) * (f + i - w)
    assert simulate(fault_free(spec, ONE_F_ONE_B)).iteration_time == pytest.approx(one_f_one_b)
    assert simulate(fault_free(spec, GPIPE)).iteration_time == pytest.approx(gpipe)
    assert simulate(fault_free(spec, ZB_H1)).iteration_time == pytest.approx(zb_h1)


@pytest.mark.parametrize("policy", [ONE_F_ONE_B, ZB_H1], ids=["1f1b", "zb-h1"])
def test_lower_bound_is_tight_without_failures(policy):
    spec = make_spec()
    assert lower_bound(spec, policy, ()).value == pytest.approx(
        simulate(fault_free(spec, policy)).period)


def test_fault_free_plan_peaks_match_the_schedules_memory():
    spec = make_spec()
    for policy, peaks in [(ONE_F_ONE_B, [4, 3, 2, 1]), (ZB_H1, [4, 4, 4, 4]), (GPIPE, [8] * 4)]:
        plan = plan_situation(spec, policy)
        from recycle_planner.timing.plan import worker_stats

        stats = worker_stats(plan.schedule, plan.timing, plan.metrics.period)
        assert stats.peak_inflight[:4].tolist() == peaks


def test_staggered_optimizer_overlaps_iterations():
    # In 1F1B the last stage finishes its backwards at 27 of 33. A costly optimizer step there
    # (8 ms) ends the iteration at 35 under a barrier; staggered, it overlaps the next
    # iteration's warm-up (stage 3 gets its first forward at 33 + 3) and the period stays 33.
    spec = make_spec(optimizer=[0, 0, 0, 8])
    barrier = simulate(fault_free(spec, Policy("1f1b", False, False)))
    stagger = simulate(fault_free(spec, Policy("1f1b", False, True)))
    assert barrier.period == pytest.approx(35)
    assert stagger.iteration_time == pytest.approx(35)
    assert stagger.period == pytest.approx(33)
    assert stagger.converged
