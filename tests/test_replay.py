"""Re-timing a plan with the op costs a run measured (timing/replay.py)."""

import pytest

from recycle_planner.job.policy import Policy
from recycle_planner.planner import plan_situation
from recycle_planner.timing.replay import measured_spec, replay_period, stage_costs

from conftest import make_spec


def op_times(per_stage, gen=0, pipelines=2, count=8):
    """Executor-style op times: every worker ran `count` ops of each kind, own work in ms."""
    return {f"{d}:{s}": {str(gen): {k: [count, 9.9, count * ms / 1e3] for k, ms in kinds.items()}}
            for d in range(pipelines) for s, kinds in enumerate(per_stage)}


def test_the_profiled_costs_give_back_the_plans_period():
    spec = make_spec(stages=2, pipelines=2, microbatches=4, forward=[2, 3], optimizer=1)
    plan = plan_situation(spec, Policy())
    times = op_times([{"F": 2, "I": 1, "W": 1, "OPTIMIZER": 1},
                      {"F": 3, "I": 1, "W": 1, "OPTIMIZER": 1}])
    costs = stage_costs(times, 0, 2)
    assert costs[1].ms["F"] == pytest.approx(3) and costs[0].count["F"] == 16
    assert replay_period(plan, measured_spec(spec, costs)) == pytest.approx(plan.metrics.period)


def test_slower_ops_lengthen_the_period_and_other_generations_are_ignored():
    spec = make_spec(stages=2, pipelines=2, microbatches=4)
    plan = plan_situation(spec, Policy(), [(1, 0)])
    times = op_times([{"F": 2, "I": 2, "W": 2}, {"F": 2, "I": 2, "W": 2}], gen=1)
    for name, by_gen in op_times([{"F": 50}, {"F": 50}], gen=0).items():
        times[name].update(by_gen)
    costs = stage_costs(times, 1, 2)
    assert costs[0].ms == pytest.approx({"F": 2, "I": 2, "W": 2})
    assert replay_period(plan, measured_spec(spec, costs)) == pytest.approx(
        2 * plan.metrics.period)


def test_a_fused_backward_scales_i_and_w():
    spec = make_spec(stages=2, pipelines=1, microbatches=2, backward_input=1, backward_weight=3)
    got = measured_spec(spec, stage_costs(op_times([{"B": 8}, {"F": 1}], pipelines=1), 0, 2))
    assert got.backward_input == (2, 1) and got.backward_weight == (6, 3)
