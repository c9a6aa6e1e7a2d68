"""Jobs whose workers hold several model chunks (virtual stages): the spec keys, ops and plan
files that carry the chunk, the fault-free generators' closed forms, re-routed plans and the
exact engines against exhaustive search (torch's own schedule classes: test_chunks_torch.py)."""

import json

import numpy as np
import pytest

from recycle_planner.errors import PlanFileError, RecycleError, SpecError
from recycle_planner.files.planfile import plan_to_dict, read_plan, write_plan
from recycle_planner.job.policy import BASELINE, Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.planner import plan_situation
from recycle_planner.schedules.generators import fault_free
from recycle_planner.schedules.ops import Op, OpSpace
from recycle_planner.solvers.cp import run_cp
from recycle_planner.solvers.exhaustive import exhaustive
from recycle_planner.solvers.heuristic import heuristic
from recycle_planner.solvers.milp import run_milp
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


# --- exact engines ---------------------------------------------------------------------------

CHUNKED_TINY = [
    (chunked(1, 2, 1, p2p=0.5), ONE_F_ONE_B, ((1, 0),)),          # 2,520 plans
    (chunked(2, 1, 1, layout="v", forward=[1, 2], p2p=0.25), Policy("1f1b", True, False), ()),
]


@pytest.fixture(scope="module", params=CHUNKED_TINY, ids=["one-stage-rerouted", "v-split"])
def tiny_truth(request):
    spec, policy, failed = request.param
    return spec, policy, failed, exhaustive(spec, policy, failed).best.period


@pytest.mark.parametrize("engine", ["cp", "milp"])
def test_the_exact_engines_match_exhaustive_search_with_chunks(tiny_truth, engine):
    spec, policy, failed, best = tiny_truth
    warm = heuristic(spec, policy, failed).simulation
    res = run_cp(spec, policy, failed, 10, warm) if engine == "cp" else \
        run_milp(spec, policy, failed, 60, "highs", warm, node_limit=5000)
    assert res.status == "Optimal"
    assert res.objective == pytest.approx(best, abs=1e-6)
    assert res.bound == pytest.approx(best, abs=1e-6)
    plan = plan_situation(spec, policy, failed, solver=engine, time_limit=10)
    assert validate(plan) == [] and plan.metrics.period == pytest.approx(best)


def test_the_dp_refuses_chunks_in_one_line():
    with pytest.raises(RecycleError, match="the dp solver plans jobs with one chunk per worker"):
        plan_situation(chunked(2, 2, 2), Policy(), [(1, 0)], solver="dp")


def test_size_thresholds_count_every_chunk():
    from recycle_planner.job.policy import compute_ops

    spec = chunked(4, 3, 8, 2)
    plan = plan_situation(spec, Policy(), ())
    assert compute_ops(spec, Policy()) == plan.schedule.n_ops - 2 * spec.workers == 576
