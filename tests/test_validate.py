"""Hand-broken plans: each is rejected, and for the right reason."""


from dataclasses import replace

import numpy as np
import pytest

from recycle_planner.job.policy import BASELINE, Policy
from recycle_planner.planner import plan_situation
from recycle_planner.schedules.ops import F, I, W, Op
from recycle_planner.schedules.schedule import Schedule
from recycle_planner.timing.plan import Plan
from recycle_planner.timing.simulate import Timing
from recycle_planner.timing.validate import validate

from conftest import make_spec, with_changes

FAILED = ((1, 2),)


@pytest.fixture(scope="module")
def plan():
    spec = make_spec(stages=4, pipelines=3, microbatches=6, p2p=0.25, allreduce=1, optimizer=0.5)
    p = plan_situation(spec, Policy(), FAILED)
    assert validate(p) == []
    return p


def rebuild(plan, orders=None, start=None, end=None, spec=None, metrics=None, policy=None):
    sched = plan.schedule
    schedule = Schedule(spec=spec or sched.spec, policy=policy or sched.policy, failed=sched.failed,
                        orders=tuple(orders if orders is not None else sched.orders))
    timing = Timing(plan.timing.start.copy() if start is None else start,
                    plan.timing.end.copy() if end is None else end)
    return Plan(schedule, timing, metrics or plan.metrics, plan.solver)


def rules(plan):
    return {v.rule for v in validate(plan)}


def idx(plan, worker):
    return plan.schedule.worker_index(worker)


def test_missing_op(plan):
    orders = list(plan.schedule.orders)
    w = idx(plan, (0, 1))
    space = plan.schedule.space
    orders[w] = orders[w][orders[w] != space.compute(W, 0, 1, 3)]
    assert rules(rebuild(plan, orders)) == {"missing-op"}


def test_duplicate_op(plan):
    orders = list(plan.schedule.orders)
    w = idx(plan, (0, 1))
    orders[w] = np.insert(orders[w], 1, orders[w][0])
    assert "duplicate-op" in rules(rebuild(plan, orders))


def test_op_on_dead_worker(plan):
    orders = list(plan.schedule.orders)
    dead, peer = idx(plan, FAILED[0]), idx(plan, (0, 2))
    space = plan.schedule.space
    moved = space.compute(W, 0, 2, 5)
    orders[peer] = orders[peer][orders[peer] != moved]
    orders[dead] = np.array([moved])
    assert "dead-worker" in rules(rebuild(plan, orders))


def moved(plan, op, src, dst):
    """The plan's orders with `op` taken from worker `src` to `dst`, before its collectives."""
    orders = list(plan.schedule.orders)
    src, dst = idx(plan, src), idx(plan, dst)
    orders[src] = orders[src][orders[src] != op]
    orders[dst] = np.insert(orders[dst], len(orders[dst]) - 2, op)
    return orders


def test_op_on_worker_of_another_stage(plan):
    op = plan.schedule.space.compute(W, 0, 1, 2)
    assert "wrong-stage" in rules(rebuild(plan, moved(plan, op, (0, 1), (0, 3))))


def test_microbatch_split_across_workers(plan):
    op = plan.schedule.space.compute(W, 0, 1, 2)
    assert rules(rebuild(plan, moved(plan, op, (0, 1), (2, 1)))) == {"split-microbatch"}


def test_dependency_ignores_transfer_latency(plan):
    # Start a stage-1 forward the moment its input is computed, without the 0.25 ms transfer.
    space = plan.schedule.space
    start, end = plan.timing.start.copy(), plan.timing.end.copy()
    op, src = space.compute(F, 0, 1, 0), space.compute(F, 0, 0, 0)
    shift = start[op] - end[src]
    assert shift == pytest.approx(0.25)
    start[op] -= shift
    end[op] -= shift
    assert rules(rebuild(plan, start=start, end=end)) == {"dependency"}


def test_overlapping_ops(plan):
    space = plan.schedule.space
    start, end = plan.timing.start.copy(), plan.timing.end.copy()
    order = plan.schedule.orders[idx(plan, (0, 3))]
    last_w = [o for o in order.tolist() if space.to_op(o).kind == "W"][-1]
    start[last_w] -= 0.5
    end[last_w] -= 0.5
    assert "overlap" in rules(rebuild(plan, start=start, end=end))


def test_wrong_duration(plan):
    end = plan.timing.end.copy()
    end[plan.schedule.space.compute(I, 2, 0, 0)] += 0.3
    assert "duration" in rules(rebuild(plan, end=end))


def test_memory_over_budget(plan):
    tight = with_changes(plan.spec, memory={"max_inflight": 2})
    assert rules(rebuild(plan, spec=tight)) == {"memory"}


def test_deadlocking_order(plan):
    # Put a backward before its own forward on the same worker: no times can satisfy that.
    orders = list(plan.schedule.orders)
    w = idx(plan, (0, 1))
    space = plan.schedule.space
    order = orders[w].tolist()
    f, i = space.compute(F, 0, 1, 3), space.compute(I, 0, 1, 3)
    a, b = order.index(f), order.index(i)
    order[a], order[b] = order[b], order[a]
    orders[w] = np.array(order)
    found = rules(rebuild(plan, orders))
    assert "deadlock" in found


def test_optimizer_before_all_reduce(plan):
    orders = list(plan.schedule.orders)
    w = idx(plan, (0, 0))
    orders[w] = np.concatenate([orders[w][:-2], orders[w][-2:][::-1]])
    assert "collective" in rules(rebuild(plan, orders))


def test_all_reduce_not_simultaneous(plan):
    space = plan.schedule.space
    start, end = plan.timing.start.copy(), plan.timing.end.copy()
    for op in (space.allreduce(0, 1), space.optimizer(0, 1)):
        start[op] += 1.0
        end[op] += 1.0
    metrics = replace(plan.metrics, iteration_time=float(np.nanmax(end) - np.nanmin(start)))
    assert rules(rebuild(plan, start=start, end=end, metrics=metrics)) == {"collective"}


def test_claimed_iteration_time_must_match(plan):
    metrics = replace(plan.metrics, iteration_time=plan.metrics.iteration_time - 1)
    assert rules(rebuild(plan, metrics=metrics)) == {"metrics"}


def test_split_backward_in_fused_policy(plan):
    assert "policy" in rules(rebuild(plan, policy=BASELINE))


def test_violation_messages_name_the_op(plan):
    end = plan.timing.end.copy()
    end[plan.schedule.space.compute(I, 2, 0, 0)] += 0.3
    (violation,) = [v for v in validate(rebuild(plan, end=end)) if v.rule == "duration"]
    assert str(Op("I", 2, 0, 0)) in violation.message


def test_simulating_a_duplicated_op_is_a_clear_error(plan):
    from recycle_planner.errors import ScheduleError
    from recycle_planner.timing.simulate import simulate

    orders = list(plan.schedule.orders)
    w = idx(plan, (0, 1))
    orders[w] = np.insert(orders[w], 1, orders[w][0])
    broken = rebuild(plan, orders).schedule
    with pytest.raises(ScheduleError, match=r"F\(p0 s1 mb0\) is scheduled more than once"):
        simulate(broken)
