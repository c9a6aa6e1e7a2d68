"""The critical-path local search (solvers/critical.py): its plans keep every rule, never get
longer, and reach bounds the forward-backward improvement does not."""

import numpy as np
import pytest
from hypothesis import given, settings

from recycle_planner.job.policy import Policy
from recycle_planner.planner import plan_situation
from recycle_planner.solvers import critical
from recycle_planner.solvers.bounds import lower_bound
from recycle_planner.solvers.critical import critical_chains, local_search
from recycle_planner.solvers.heuristic import heuristic
from recycle_planner.solvers.improve import improve
from recycle_planner.timing.validate import validate

from test_improve import assert_refines, assert_valid, unit_job
from test_properties import situations


@settings(max_examples=60, deadline=None)
@given(situations(max_stages=4, max_pipelines=3, max_microbatches=6))
def test_swapped_plans_keep_every_rule_and_never_get_longer(case):
    assert_refines(local_search, "swapped", case)


@pytest.mark.parametrize("stagger", [True, False])
@pytest.mark.parametrize("failed", [((0, 0), (1, 1)), ((0, 2),), ((0, 1), (1, 2)),
                                    ((0, 3), (1, 0))])
def test_a_critical_chain_is_tight_and_as_long_as_the_period(stagger, failed):
    """Each op on a chain starts when the one before it ends (plus the p2p latency on a data
    edge). With a barrier the chain spans the iteration; staggered it is a cycle whose ops and
    latencies add up to whole periods, and it starts at an op that does not wait for its
    worker (so no block is split between its ends)."""
    spec, policy = unit_job(4, 3, 6), Policy("1f1b", True, stagger)
    sim = heuristic(spec, policy, failed).simulation
    chains = critical_chains(sim)
    assert chains
    g = sim.graph
    start, end = critical._node_times(sim)

    def link(a, b, waits):
        """The length of the tight edge a -> b: its latency, or minus a period where b is the
        first op of the next iteration."""
        if waits:  # b waits for its worker's previous op, which is a
            assert g.wpred[b] == a and end[a] == pytest.approx(start[b])
            return 0.0
        lat = g.lat[(g.src == a) & (g.dst == b)]
        if len(lat) and start[b] == pytest.approx(end[a] + lat[0]):
            return float(lat[0])
        assert stagger and start[b] == pytest.approx(end[a] - sim.period)
        return -sim.period

    for chain in chains:
        total = sum(g.dur[x] for x, _ in chain)
        total += sum(link(a, b, waits) for (a, _), (b, waits) in zip(chain, chain[1:]))
        if stagger:  # a cycle: it closes back at its first op, which does not wait
            first, waits = chain[0]
            assert not waits
            total += link(chain[-1][0], first, False)
            assert total == pytest.approx(0.0, abs=1e-9)
        else:
            assert start[chain[0][0]] == pytest.approx(0)
            assert end[chain[-1][0]] == pytest.approx(sim.period)
            assert total == pytest.approx(sim.period)


@pytest.mark.parametrize("stagger, failed, justified, swapped", [
    (True, ((0, 0), (1, 1)), 37.4, 35.8),
    (False, ((0, 3), (1, 0)), 42.7, 42.0),
])
def test_swaps_shorten_what_the_passes_leave(stagger, failed, justified, swapped):
    """4x3x6 unit costs, staggered, workers 0:0 and 1:1 dead: the list scheduler's plan
    improved by the passes is 37.4; swapping ops on its critical cycle reaches the analytic
    bound 35.8 (so the plan is optimal). 4x4x8 with a barrier: 42.7 -> 42.0."""
    spec = unit_job(4, 3, 6) if stagger else unit_job(4, 4, 8)
    policy = Policy("1f1b", True, stagger)
    start = improve(spec, policy, heuristic(spec, policy, failed))
    assert start.simulation.period == pytest.approx(justified)
    better = local_search(spec, policy, start)
    assert better.simulation.period == pytest.approx(swapped)
    assert better.name == f"{start.name}, swapped"
    assert_valid(better.simulation, start.simulation.period)
    if stagger:
        assert swapped == pytest.approx(lower_bound(spec, policy, failed).value)
    # The swaps only reorder: every worker runs the same ops.
    for a, b in zip(start.simulation.schedule.orders, better.simulation.schedule.orders):
        assert sorted(np.asarray(a).tolist()) == sorted(np.asarray(b).tolist())


def test_at_the_same_period_a_swap_that_shortens_the_spans_is_kept():
    """4x3x6, staggered, worker 0:2 dead: from the heuristic's plan (35.1) no single swap
    shortens the period, since twin cycles set it; swaps that shorten the workers' spans lead
    to 34.4. With the period alone as the test the search stops at once."""
    spec, policy, failed = unit_job(4, 3, 6), Policy(), ((0, 2),)
    start = heuristic(spec, policy, failed)
    assert start.simulation.period == pytest.approx(35.1)
    assert local_search(spec, policy, start).simulation.period == pytest.approx(34.4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(critical, "key", lambda sim: (sim.period, 0.0))
        assert local_search(spec, policy, start) is start


@pytest.mark.parametrize("decouple", [True, False])
def test_no_swap_breaks_the_memory_cap(decouple):
    """A forward moved before a weight gradient (or fused backward) takes one more slot: where
    the worker is at its cap there, the swap is refused; every other swap is allowed."""
    spec, policy = unit_job(4, 3, 6), Policy("1f1b", decouple, True)
    sim = heuristic(spec, policy, ((0, 2),)).simulation
    holds = critical._holds(sim.schedule)
    caps = critical.worker_caps(spec, policy)
    refused = 0
    for w, order in enumerate(sim.schedule.orders):
        for i in range(1, len(order) - 2):
            swapped = np.array(order)
            swapped[i - 1], swapped[i] = swapped[i], swapped[i - 1]
            peak = np.cumsum(holds[swapped]).max()
            fits = critical._fits(np.asarray(order), i, holds, caps[w])
            assert fits == (peak <= caps[w]), (w, i)
            refused += not fits
    assert refused > 0


def test_auto_runs_the_swaps_last_where_a_gap_is_left():
    """`auto` (CP engine stopped at once) swaps on its best plan: 4x3x6 reaches the bound."""
    spec, policy, failed = unit_job(4, 3, 6), Policy(), ((0, 0), (1, 1))
    plan = plan_situation(spec, policy, failed, "auto", time_limit=0.5, work_limit=0.01)
    assert plan.metrics.period == pytest.approx(35.8) and plan.metrics.optimal
    assert plan.solver["detail"].endswith(", swapped")
    assert plan.solver["candidates"][plan.solver["detail"]] == pytest.approx(35.8)
    assert validate(plan) == []
