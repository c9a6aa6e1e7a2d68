"""The forward-backward improvement (solvers/improve.py): its plans keep every rule, never get
longer, and reach the optimum where the list scheduler alone does not."""

import pytest
from hypothesis import given, settings

from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.planner import finish_plan, plan_situation
from recycle_planner.solvers.heuristic import heuristic
from recycle_planner.solvers import improve as improve_module
from recycle_planner.solvers.improve import backward_pass, improve, op_graph, worker_caps
from recycle_planner.timing.validate import validate

from test_properties import make, situations

# Unit-cost job of the memory-bound library analogues (docs/solvers.md).
UNIT = dict(forward=1, backward_input=1.1, backward_weight=0.9, p2p=0.05, allreduce=4,
            optimizer=0.6)


def unit_job(stages: int, pipelines: int, microbatches: int) -> JobSpec:
    return JobSpec.from_dict(dict(stages=stages, pipelines=pipelines, microbatches=microbatches,
                                  time=UNIT))


def assert_valid(sim, reference):
    assert validate(finish_plan(sim, reference, {"name": "heuristic"})) == []


def assert_refines(refine, suffix, case):
    """`refine(spec, policy, start)` from the heuristic's plan keeps every rule, never gets
    longer, names its plan `<start>, <suffix>` and gives the same plan every time."""
    spec, policy, failed = case
    start = make(spec, policy, failed, heuristic)
    better = refine(spec, policy, start)
    assert better.simulation.period <= start.simulation.period + 1e-9
    assert better is start or better.name == f"{start.name}, {suffix}"
    assert refine(spec, policy, start).simulation.period == better.simulation.period  # same
    # Every op once, dependencies, memory within the cap, no deadlock: the validator's rules.
    assert_valid(better.simulation, start.simulation.period)


@settings(max_examples=60, deadline=None)
@given(situations(max_stages=4, max_pipelines=3, max_microbatches=6))
def test_improved_plans_keep_every_rule_and_never_get_longer(case):
    assert_refines(improve, "justified", case)


@settings(max_examples=40, deadline=None)
@given(situations(max_stages=4, max_pipelines=3, max_microbatches=6))
def test_the_backward_pass_alone_gives_a_valid_plan(case):
    spec, policy, failed = case
    start = make(spec, policy, failed, heuristic)
    schedule = start.simulation.schedule
    mirrored, op_keys = backward_pass(start.simulation, op_graph(schedule),
                                      worker_caps(spec, policy))
    assert_valid(mirrored, start.simulation.period)
    assert len(op_keys) == sum(len(o) - 2 for o in schedule.orders if len(o))  # every compute op


@pytest.mark.parametrize("stagger, before, after", [(True, 30.3, 29.2), (False, 30.3, 29.85)])
def test_improvement_reaches_the_bound_where_list_scheduling_does_not(stagger, before, after):
    """3x2x4 unit costs, worker 0:1 dead: the list scheduler's best candidate is 30.3; the
    passes run the remaining input gradients before the weight gradients and reach the
    analytic lower bound (29.2 staggered: the CP engine's proven optimum; 29.85 barrier)."""
    spec, policy, failed = unit_job(3, 2, 4), Policy("1f1b", True, stagger), ((0, 1),)
    start = heuristic(spec, policy, failed)
    assert start.simulation.period == pytest.approx(before)
    plan = plan_situation(spec, policy, failed, "heuristic")
    assert plan.metrics.period == pytest.approx(after)
    assert plan.metrics.lower_bound == pytest.approx(after) and plan.metrics.optimal
    assert plan.solver["detail"].endswith(", justified")
    candidates = plan.solver["candidates"]
    assert candidates[start.name] == pytest.approx(before)
    assert candidates[f"{start.name}, justified"] == pytest.approx(after)
    assert validate(plan) == []


def test_auto_improves_the_dp_plan_too():
    """`auto` improves each fast plan, so it is never longer than the heuristic solver."""
    spec, policy, failed = unit_job(4, 3, 6), Policy(), ((0, 2),)
    auto = plan_situation(spec, policy, failed, "auto", time_limit=0.5, work_limit=0.01)
    alone = plan_situation(spec, policy, failed, "heuristic")
    assert auto.metrics.period <= alone.metrics.period + 1e-9
    assert any(name.startswith("dp") and name.endswith(", justified")
               for name in auto.solver["candidates"])


def test_plans_above_the_size_limit_are_left_alone(monkeypatch):
    """Above UP_TO_OPS (the 1,024-worker library's speed) the passes do not run."""
    spec, policy, failed = unit_job(3, 2, 4), Policy(), ((0, 1),)
    monkeypatch.setattr(improve_module, "UP_TO_OPS", 81)  # this plan has 82 ops
    plan = plan_situation(spec, policy, failed, "heuristic")
    assert plan.metrics.period == pytest.approx(30.3)
    assert not any(name.endswith("justified") for name in plan.solver["candidates"])
