"""Jobs whose workers hold several model chunks (virtual stages): the spec keys, ops and plan
files that carry the chunk, the fault-free generators (closed forms, and torch's own schedule
classes timed by our simulator), and re-routed plans."""

import json

import numpy as np
import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from recycle_planner.errors import PlanFileError, SpecError
from recycle_planner.files.export_torch import torch_rows
from recycle_planner.files.planfile import plan_to_dict, read_plan, write_plan
from recycle_planner.job.policy import BASELINE, Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.planner import plan_situation
from recycle_planner.schedules.generators import fault_free, stage_orders
from recycle_planner.schedules.ops import KIND_CODES, Op, OpSpace
from recycle_planner.schedules.schedule import Schedule, with_collectives
from recycle_planner.timing.simulate import simulate
from recycle_planner.timing.validate import validate

ONE_F_ONE_B = Policy("1f1b", decouple=False, stagger=False)
ZERO_BUBBLE = Policy("zb-h1", decouple=True, stagger=False)


def chunked(stages=4, pipelines=1, microbatches=8, chunks=2, layout="interleaved", **time):
    costs = dict(forward=1, backward_input=1, backward_weight=1)
    costs.update(time)
    data = dict(stages=stages, pipelines=pipelines, microbatches=microbatches, chunks=chunks,
                time=costs)
    if layout != "interleaved":
        data["layout"] = layout
    return JobSpec.from_dict(data)


# --- spec -------------------------------------------------------------------------------------

def test_per_worker_costs_are_split_among_the_chunks_and_round_trip():
    spec = chunked(forward=[2, 4, 6, 8], p2p=0.5)
    assert spec.virtual_stages == 8
    assert spec.forward == (1, 2, 3, 4, 1, 2, 3, 4)  # a worker's cost, halved per chunk
    assert spec.p2p == (0.5,) * 8                     # a message's latency is not split
    assert spec.allreduce == (0,) * 4                 # one per worker
    assert JobSpec.from_dict(spec.to_dict()) == spec
    assert spec.to_dict()["time"]["backward_input"] == 1  # the worker's total, as written


def test_the_v_layout_places_chunk_1_back_up_the_stages():
    spec = chunked(layout="v", forward=[2, 4, 6, 8])
    assert [spec.holder(v) for v in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert spec.forward == (1, 2, 3, 4, 4, 3, 2, 1)
    assert spec.virtual(1, 1) == 6 and JobSpec.from_dict(spec.to_dict()) == spec


def test_a_list_per_virtual_stage_is_taken_as_it_is():
    spec = chunked(forward=[1, 2, 3, 4, 5, 6, 7, 8])
    assert spec.forward == (1, 2, 3, 4, 5, 6, 7, 8)
    assert JobSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize("change, message", [
    ({"chunks": 0}, "'chunks' must be at least 1"),
    ({"chunks": 2.5}, "'chunks' must be a whole number"),
    ({"layout": "zigzag"}, "'layout' must be one of: interleaved, v, got 'zigzag'"),
    ({"chunks": 3, "layout": "v"}, "layout 'v' places exactly 2 chunks per worker"),
    ({"chunks": 1, "layout": "interleaved"}, "'layout' places several chunks per worker"),
    ({"time": {"forward": [1, 2, 3], "backward_input": 1}},
     "'time.forward' lists 3 values but there are 4 stages .8 virtual stages."),
    ({"time": {"forward": [1, 2, 3, 4, 5, 6, 7, -8], "backward_input": 1}},
     "'time.forward\\[7\\]' must be positive"),
])
def test_bad_chunk_keys_are_refused_in_one_line(change, message):
    data = {"stages": 4, "pipelines": 2, "microbatches": 8, "chunks": 2,
            "time": {"forward": 1, "backward_input": 1}}
    data.update(change)
    with pytest.raises(SpecError, match=message) as err:
        JobSpec.from_dict(data, "job.toml")
    assert "\n" not in str(err.value) and str(err.value).startswith("job.toml: ")


def test_memory_caps_count_micro_batch_chunks():
    spec = JobSpec.from_dict({"stages": 2, "pipelines": 2, "microbatches": 4, "chunks": 2,
                              "time": {"forward": 1, "backward_input": 1},
                              "memory": {"activation": 10, "budget": 35, "max_inflight": 2}})
    assert spec.caps() == (4, 4)  # 2 micro-batches' worth: 4 halves (bytes allow 7)


# --- ops and plan files ----------------------------------------------------------------------

def test_ops_carry_their_chunk_in_text_ids_and_torch_actions():
    spec = chunked(pipelines=2, layout="v")
    space = OpSpace.of(spec)
    op = Op("I", 1, 0, 3, chunk=1)
    assert str(op) == "I(p1 s0 c1 mb3)" and Op.parse(str(op)) == op
    assert Op.parse("F(p0 s2 mb1)") == Op("F", 0, 2, 1, 0)
    assert space.to_op(space.id_of(op)) == op
    vstage = int(space.vstage_of[0, 1])
    assert vstage == 7 and op.torch_action(vstage) == "7I3"
    assert Op.from_torch_action("7I3", 1, space) == op
    every = np.arange(space.size)
    assert [space.id_of(o) for o in space.to_ops(every)] == every.tolist()


@pytest.fixture(scope="module")
def rerouted_plan():
    spec = chunked(pipelines=3, microbatches=4, p2p=0.1, allreduce=1)
    return plan_situation(spec, Policy(), [(1, 2)])


@pytest.mark.parametrize("compact", [False, True])
def test_a_chunked_plan_file_round_trips(rerouted_plan, tmp_path, compact):
    path = tmp_path / ("p.json.gz" if compact else "p.json")
    write_plan(rerouted_plan, path, compact=compact)
    back = read_plan(path)
    assert all(np.array_equal(a, b) for a, b in zip(back.schedule.orders,
                                                     rerouted_plan.schedule.orders))
    assert back.metrics.period == pytest.approx(rerouted_plan.metrics.period)
    data = plan_to_dict(rerouted_plan, compact=compact)
    assert data["version"] == (4 if compact else 3)
    if compact:  # worker 0:2 runs chunk 1 of pipeline 1's micro-batches too
        actions = next(w["actions"] for w in data["workers"] if (w["pipeline"], w["stage"])
                       == (0, 2))
        assert "c1p1" in actions and "F0c1" in actions


def test_an_old_compact_file_is_still_read_and_cannot_hold_chunks(tmp_path):
    plain = plan_situation(JobSpec.from_dict({"stages": 2, "pipelines": 2, "microbatches": 2,
                                              "time": {"forward": 1, "backward_input": 1}}),
                           Policy(), [(0, 1)])
    old = plan_to_dict(plain, compact=True)
    old["version"] = 2
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert validate(read_plan(tmp_path / "old.json")) == []
    old["workers"][0]["actions"] = old["workers"][0]["actions"].replace("F0", "F0c1", 1)
    (tmp_path / "bad.json").write_text(json.dumps(old))
    with pytest.raises(PlanFileError, match="'F0c1' is not one"):
        read_plan(tmp_path / "bad.json")


def test_an_old_version_cannot_carry_a_chunked_job(rerouted_plan, tmp_path):
    data = plan_to_dict(rerouted_plan, compact=True)
    data["version"] = 2
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match="version-2 plan file has one chunk per worker"):
        read_plan(tmp_path / "p.json")


# --- fault-free generators -------------------------------------------------------------------

@pytest.mark.parametrize("v", [2, 4])
@pytest.mark.parametrize("S, M", [(4, 8), (4, 4), (3, 6)])
def test_interleaved_1f1b_bubble_is_1_over_v_of_1f1b(S, M, v):
    work = M * 2.0  # F + B per micro-batch, per worker
    plain = simulate(fault_free(chunked(S, 1, M, 1, backward_weight=0), ONE_F_ONE_B))
    inter = simulate(fault_free(chunked(S, 1, M, v, backward_weight=0), ONE_F_ONE_B))
    assert plain.iteration_time - work == pytest.approx((S - 1) * 2.0)
    assert inter.iteration_time - work == pytest.approx((S - 1) * 2.0 / v)


@pytest.mark.parametrize("S, M", [(2, 4), (3, 6), (4, 8), (4, 12)])
def test_zb_v_has_no_bubble_when_f_i_w_are_equal(S, M):
    """With M >= 2S - 1 every worker is busy from its first op to its last, and with the
    staggered optimizer the period is exactly the work."""
    spec = chunked(S, 1, M, layout="v")
    sched = fault_free(spec, ZERO_BUBBLE)
    sim = simulate(sched)
    for order in sched.orders:
        compute = order[:-2]
        gaps = sim.timing.start[compute][1:] - sim.timing.end[compute][:-1]
        assert gaps.max() == pytest.approx(0.0)
    assert sim.iteration_time == pytest.approx(3.0 * M + (S - 1) * 0.5)
    assert simulate(fault_free(spec, Policy("zb-h1"))).period == pytest.approx(3.0 * M)


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


def test_interleaved_schedules_need_equal_rounds():
    with pytest.raises(SpecError, match="9 micro-batches do not split into 2 equal rounds"):
        fault_free(chunked(4, 1, 9, 2), ONE_F_ONE_B)


def test_gpipe_runs_one_chunk_per_worker():
    with pytest.raises(SpecError, match="gpipe runs one chunk per worker"):
        fault_free(chunked(), Policy("gpipe", decouple=False, stagger=False))


# --- re-routing ------------------------------------------------------------------------------

@pytest.mark.parametrize("layout, v", [("interleaved", 2), ("interleaved", 4), ("v", 2)])
def test_rerouted_plans_are_valid_and_keep_their_certificate(layout, v):
    spec = chunked(4, 3, 8, v, layout, p2p=0.1, allreduce=1, optimizer=0.5)
    for failed in ([(1, 0)], [(1, 2), (2, 3)]):
        plain = plan_situation(spec, BASELINE, failed)
        best = plan_situation(spec, Policy(), failed)
        for plan in (plain, best):
            assert validate(plan) == []
            assert plan.metrics.lower_bound <= plan.metrics.period + 1e-9
            assert plan.schedule.rerouted_count() > 0
        assert best.metrics.period <= plain.metrics.period + 1e-9
        # every chunk of the dead workers' micro-batches runs on a live peer of their stage
        ops = [op for w in best.schedule.live_workers() for op in best.schedule.ops(w)
               if (op.pipeline, op.stage) in {tuple(f) for f in failed}]
        assert {op.chunk for op in ops} == set(range(v))


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
