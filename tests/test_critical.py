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

from test_improve import assert_valid, unit_job
from test_properties import make, situations


@settings(max_examples=60, deadline=None)
@given(situations(max_stages=4, max_pipelines=3, max_microbatches=6))
def test_swapped_plans_keep_every_rule_and_never_get_longer(case):
    spec, policy, failed = case
    start = make(spec, policy, failed, heuristic)
    better = local_search(spec, policy, start)
    assert better.simulation.period <= start.simulation.period + 1e-9
    assert better is start or better.name == f"{start.name}, swapped"
    assert local_search(spec, policy, start).simulation.period == better.simulation.period
    # Every op once, dependencies, memory within the cap, no deadlock: the validator's rules.
    assert_valid(better.simulation, start.simulation.period)


@pytest.mark.parametrize("stagger", [True, False])
def test_a_critical_chain_is_tight_and_as_long_as_the_period(stagger):
    """Each op on a chain starts when the one before it ends (plus the p2p latency on a data
    edge); with a barrier the chain spans the iteration, staggered it closes a cycle."""
    spec, policy = unit_job(4, 3, 6), Policy("1f1b", True, stagger)
    sim = heuristic(spec, policy, ((0, 0), (1, 1))).simulation
    chains = critical_chains(sim)
    assert chains
    g = sim.graph
    start, end = critical._node_times(sim)
    for chain in chains:
        for (a, _), (b, waits) in zip(chain, chain[1:]):
            if waits:  # b waits for its worker's previous op, which is a
                assert g.wpred[b] == a and end[a] == pytest.approx(start[b])
            else:  # a data or all-reduce edge, or (staggered) the step before the next iteration
                lat = g.lat[(g.src == a) & (g.dst == b)]
                assert (len(lat) and start[b] == pytest.approx(end[a] + lat[0])) \
                    or (stagger and start[b] == pytest.approx(end[a] - sim.period))
        if not stagger:
            assert start[chain[0][0]] == pytest.approx(0)
            assert end[chain[-1][0]] == pytest.approx(sim.period)
    busy = sum(g.dur[x] for x, _ in chains[0])
    assert busy <= sim.period + 1e-9


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


def test_no_swap_breaks_the_memory_cap():
    """A forward moved before a weight gradient takes one more slot: where the worker is at its
    cap there, the swap is refused; every other swap is allowed."""
    spec, policy = unit_job(4, 3, 6), Policy()
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
