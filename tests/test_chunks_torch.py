"""Our chunked generators against torch's own schedule classes (their `pipeline_order`, timed
by our simulator, and the same orders), and export-torch's virtual stages checked by torch's
own schedule validation and dry run."""

import pytest

from recycle_planner.files.export_torch import torch_rows
from recycle_planner.job.policy import Policy
from recycle_planner.planner import plan_situation
from recycle_planner.schedules.generators import fault_free, stage_orders
from recycle_planner.schedules.ops import KIND_CODES, OpSpace
from recycle_planner.schedules.schedule import Schedule, with_collectives
from recycle_planner.timing.simulate import simulate

from test_chunks import ONE_F_ONE_B, ZERO_BUBBLE, chunked

pytestmark = pytest.mark.torch
torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


def torch_pipeline_order(cls, S, v, M):
    """torch's own `pipeline_order` of a schedule class, without a process group: the classes
    compute each rank's actions from a few fields (`_calculate_single_rank_operations`), which
    is what their constructors do for every rank after reading those fields off the stages."""
    schedule = cls.__new__(cls)
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = S, v, M
    schedule.num_stages = S * v
    schedule.number_of_rounds = max(1, M // S)
    schedule.microbatches_per_round = M // schedule.number_of_rounds
    letter = {torch_schedules._ComputationType.FORWARD: "F",
              torch_schedules._ComputationType.FULL_BACKWARD: "B",
              torch_schedules._ComputationType.BACKWARD_INPUT: "I",
              torch_schedules._ComputationType.BACKWARD_WEIGHT: "W"}
    return [[(letter[a.computation_type], a.stage_index, a.microbatch_index)
             for a in schedule._calculate_single_rank_operations(r) if a is not None]
            for r in range(S)]


TORCH_CLASSES = [
    (torch_schedules.ScheduleInterleaved1F1B, "interleaved", ONE_F_ONE_B),
    (torch_schedules.ScheduleInterleavedZeroBubble, "interleaved", ZERO_BUBBLE),
    (torch_schedules.ScheduleZBVZeroBubble, "v", ZERO_BUBBLE),
]
SHAPES = [(2, 4, 2), (4, 8, 2), (4, 4, 2), (3, 6, 2), (4, 8, 4), (2, 2, 2), (4, 12, 2)]


@pytest.mark.parametrize("cls, layout, policy, S, M, v", [
    (*c, *shape) for c in TORCH_CLASSES for shape in SHAPES if c[1] != "v" or shape[2] == 2])
def test_our_generators_match_torchs_schedule_classes(cls, layout, policy, S, M, v):
    spec = chunked(S, 1, M, v, layout, forward=[1 + 0.3 * s for s in range(S)],
                   backward_input=1.2, backward_weight=0.7, p2p=0.1)
    theirs = torch_pipeline_order(cls, S, v, M)
    space = OpSpace.of(spec)
    orders = tuple(with_collectives(space, 0, r, [space.compute(KIND_CODES[k], 0, vs, m)
                                                  for k, vs, m in theirs[r]]) for r in range(S))
    torch_period = simulate(Schedule(spec, policy, (), orders)).period
    assert simulate(fault_free(spec, policy)).period == pytest.approx(torch_period)
    ours = [[("FIWB"[k], vs, m) for k, vs, m in order] for order in stage_orders(spec, policy)]
    assert ours == theirs  # the same orders, not only the same period


@pytest.mark.parametrize("layout", ["interleaved", "v"])
def test_export_torch_writes_virtual_stages_that_torch_validates_and_runs(layout):
    """torch's own checks on the exported rows: every stage's actions on one rank, every
    micro-batch once (`_validate_schedule`), and a dry run of the schedule with torch's sends
    and receives added finds no deadlock (`_simulate_comms_compute`)."""
    spec = chunked(3, 2, 6, 2, layout)
    plan = plan_situation(spec, Policy())
    rows = torch_rows(plan, pipeline=1)
    actions = {r: [torch_schedules._Action.from_str(a) for a in row] for r, row in enumerate(rows)}
    assert {a.stage_index for a in actions[0]} == {0, spec.virtual(0, 1)}
    stage_to_rank = torch_schedules._validate_schedule(actions, 3, 6, 6)
    assert stage_to_rank == {v: spec.holder(v) for v in range(6)}
    with_comms = torch_schedules._add_send_recv(actions, stage_to_rank.__getitem__, 6)
    torch_schedules._simulate_comms_compute(with_comms, stage_to_rank.__getitem__, 6)
