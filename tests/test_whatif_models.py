"""The cost models behind Oobleck and Bamboo, the batch split, and properties of the replay
over random traces."""

import itertools

import pytest
from hypothesis import given, strategies as st

from recycle_planner.job.policy import BASELINE, Policy
from recycle_planner.job.spec import load_spec
from recycle_planner.library import PlanLibrary, Settings, build_library
from recycle_planner.planner import plan_situation
from recycle_planner.whatif.bamboo import bamboo_spec, groups_of, recoverable
from recycle_planner.whatif.engine import STRATEGIES, replay, simulate
from recycle_planner.whatif.oobleck import Oobleck, fits, pipeline_spec, window
from recycle_planner.whatif.strategy import Context, Costs, PeriodModel, min_max_split
from recycle_planner.whatif.trace import Event, Trace

from conftest import EXAMPLES, make_spec, with_changes

GPT = load_spec(EXAMPLES / "gpt.toml")


def test_window_recuts_the_same_layers():
    assert window([1, 1, 1, 1], 3) == pytest.approx([4 / 3] * 3)
    assert window([1, 2, 3, 4], 4) == [1, 2, 3, 4]
    # Two slices of three stages: [0, 1.5) and [1.5, 3).
    assert window([2, 4, 6], 2) == pytest.approx([2 + 0.5 * 4, 0.5 * 4 + 6])
    for length in range(1, 9):
        assert sum(window(GPT.forward, length)) == pytest.approx(sum(GPT.forward))


def test_pipeline_of_all_stages_is_the_job_itself():
    """One pipeline of the job's own shape plans to the same period as the whole job."""
    policy = Policy()
    one = pipeline_spec(GPT, GPT.stages, GPT.microbatches)
    assert one.forward == GPT.forward and one.memory.static == GPT.memory.static
    assert PeriodModel(policy).period(one) == pytest.approx(
        plan_situation(GPT, policy).metrics.period)


def test_shortest_gpt_pipeline_that_fits():
    """3 slices of 8/3 stages: slice 0 holds 21 + 17 + 2/3 x 17 = 49.3 GiB static and 3
    micro-batches of 8/3 x 3.4 GiB (27.2 GiB): 76.5 <= 80. With 2 slices, slice 0 holds
    21 + 3 x 17 = 72 GiB plus 2 x 13.6 GiB: 99 > 80."""
    assert fits(GPT, 3) and not fits(GPT, 2)
    assert fits(GPT, 8) and fits(make_spec(), 1)
    ctx = Context(GPT, Policy(), Costs(), 501.4, None, PeriodModel(Policy()))
    assert Oobleck(ctx).shortest == 3


def test_oobleck_configurations():
    spec = make_spec(stages=4, pipelines=3)
    ctx = Context(spec, BASELINE, Costs(), 33.0, None, PeriodModel(BASELINE))
    oob = Oobleck(ctx)
    from recycle_planner.whatif.deadset import DeadState

    def state(*dead):
        per_pipe = {}
        for d, s in dead:
            per_pipe.setdefault(d, []).append(s)
        per_stage = tuple(sum(1 for _, s in dead if s == t) for t in range(4))
        return DeadState(frozenset(dead), per_stage,
                         tuple((d, tuple(sorted(v))) for d, v in sorted(per_pipe.items())), 3)

    assert oob.config(state()) == (3, (), 0)
    assert oob.config(state((0, 1))) == (2, (3,), 0)
    # Two broken pipelines with 3 + 2 survivors: two pipelines of 3 and 2 stages.
    assert oob.config(state((0, 1), (1, 0), (1, 3))) == (1, (3, 2), 0)
    assert oob.config(state((0, 1), (1, 1), (2, 1))) is None  # stage 1 is gone


def test_bamboo_takes_over_from_the_predecessor():
    assert groups_of(4, ()) == [(0,), (1,), (2,), (3,)]
    assert groups_of(4, (2,)) == [(0,), (1, 2), (3,)]
    assert groups_of(4, (0, 2)) == [(1, 2), (3, 0)]
    assert recoverable(4, (0, 2)) and not recoverable(4, (1, 2)) and not recoverable(4, (0, 3))
    spec = make_spec(stages=4, memory={"activation": "1GB", "static": ["1GB", "2GB", "3GB",
                                                                         "4GB"],
                                       "budget": "20GB"})
    normal = bamboo_spec(spec)
    assert normal.backward_weight == (2, 2, 2, 2)  # W plus the successor's forward
    assert normal.memory.static == (3e9, 5e9, 7e9, 5e9)  # own + successor (stage 3 holds 0)
    assert normal.memory.activation == (2e9,) * 4
    failed = bamboo_spec(spec, (2,))
    assert failed.stages == 3
    assert failed.forward == (1, 2, 1) and failed.backward_weight == (2, 2, 2)
    assert failed.memory.static == (3e9, 5e9, 5e9)


def test_bamboo_redundancy_hides_in_bubbles_with_the_split():
    """The split policy defers the redundant forward into bubbles; fused, it lengthens every
    backward: (8 + 3) x (1 + 3) = 44 ms instead of 33."""
    spec = make_spec()
    split, fused = PeriodModel(Policy()), PeriodModel(BASELINE)
    assert fused.period(bamboo_spec(spec)) == 44.0
    assert split.period(bamboo_spec(spec)) < 44.0


@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=6), min_size=1, max_size=4),
       st.integers(1, 9))
def test_min_max_split_is_optimal(steps, total):
    """Against brute force over every allocation, for nondecreasing periods."""
    tables = [list(itertools.accumulate(s)) for s in steps]
    horizon = total + 1

    def period(g, m):
        row = tables[g]
        return 0.0 if m == 0 else float(row[min(m, len(row)) - 1] + max(0, m - len(row)) * 7)

    groups = list(range(len(tables)))
    best, alloc = min_max_split(groups, total, period, lambda g: 1.0 + g)
    assert sum(alloc) == total
    assert max(period(g, m) for g, m in zip(groups, alloc)) == best
    brute = min(max(period(g, m) for g, m in zip(groups, a))
                for a in itertools.product(range(horizon), repeat=len(groups)) if sum(a) == total)
    assert best == brute


SMALL = with_changes(make_spec(stages=2, pipelines=3, microbatches=3), microbatch_size=2)


@pytest.fixture(scope="module")
def small_ctx(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lib")
    build_library(SMALL, Policy(), 2, folder, Settings(solver="heuristic"), jobs=1)
    return Context.from_library(PlanLibrary.open(folder, spec=SMALL),
                                Costs(detect=1, switch=2, reconfigure=5, checkpoint_interval=60,
                                      restart=30, spares=1, plan=0.5))


@st.composite
def traces(draw):
    workers = [(d, s) for d in range(3) for s in range(2)]
    t, dead, events = 0.0, set(), []
    for _ in range(draw(st.integers(0, 12))):
        t += draw(st.sampled_from([0.0, 0.5, 3.0, 20.0, 90.0]))
        w = draw(st.sampled_from(workers))
        events.append(Event(t, "repair" if w in dead else "fail", w))
        dead ^= {w}
    return Trace(tuple(events), t + draw(st.sampled_from([1.0, 100.0])), 2, 3, {})


@given(tr=traces())
def test_no_strategy_beats_fault_free_and_replays_are_deterministic(small_ctx, tr):
    """Every configuration of this job is at most as fast as fault-free (checked), so no
    strategy can train more than fault-free over any trace; none ends below zero."""
    ff = small_ctx.fault_free.rate
    study = simulate(small_ctx, [("t", tr)])
    for strategy in study.strategies:
        assert all(s.rate <= ff * (1 + 1e-12) for s in strategy._speeds.values())
    for o in study.runs[0].outcomes:
        assert -1e-6 <= o.samples <= ff * tr.duration * (1 + 1e-9)
        assert o.cumulative([tr.duration])[0] == pytest.approx(o.samples, abs=1e-6)
        assert o.paused + o.waiting <= tr.duration + 1e-9
        again = replay(STRATEGIES[o.strategy](small_ctx), tr)
        assert again.samples == o.samples
