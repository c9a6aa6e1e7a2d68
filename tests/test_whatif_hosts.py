"""Hosts of several workers failing as one, correlated failures, and each strategy's own
policy, on traces small enough to compute by hand.

The job and costs are those of test_whatif_strategies.py: 2 stages x 2 pipelines x 2
micro-batches of 9 samples, every op 1 ms, plain 1F1B with a barrier; fault-free 9 ms (4000
samples/s); one dead worker 15 ms (2400/s); one dead worker in each stage also 15 ms
(the forward-backward improvement finds it; plain list scheduling 16 ms).
Detection 1 s, switch 2 s, a checkpoint every 100 s, restart 10 s. With 2 workers per host
and the pipeline placement, host 0 is workers 0:0 and 0:1, host 1 is 1:0 and 1:1.
"""

import re

import pytest

from recycle_planner.errors import RecycleError
from recycle_planner.library import PlanLibrary, Settings, build_library
from recycle_planner.job.policy import BASELINE, Policy
from recycle_planner.whatif.deadset import dead_states
from recycle_planner.whatif.engine import STRATEGIES, replay, simulate
from recycle_planner.whatif.hosts import Hosts
from recycle_planner.whatif.output import study_dict, study_text
from recycle_planner.whatif.strategy import Context, Costs
from recycle_planner.whatif.trace import FAIL, read_trace, sample_trace, write_trace

from conftest import make_spec, with_changes

COSTS = Costs(detect=1, switch=2, reconfigure=4, checkpoint_interval=100, restart=10, spares=1,
              plan=3)
SPEC = with_changes(make_spec(stages=2, pipelines=2, microbatches=2), microbatch_size=9)
HOSTS = Hosts(2, 2, 2)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lib")
    build_library(SPEC, BASELINE, 2, folder, Settings(solver="heuristic"), jobs=1)
    return PlanLibrary.open(folder, spec=SPEC)


def read(tmp_path, body, hosts=HOSTS, duration=400):
    path = tmp_path / "t.csv"
    path.write_text("time,event,worker\n" + body)
    return read_trace(path, SPEC, duration, hosts)


def test_host_placements():
    assert HOSTS.workers(1) == ((1, 0), (1, 1))
    by_stage = Hosts(2, 2, 2, "stage")
    assert by_stage.workers(0) == ((0, 0), (1, 0))
    assert [by_stage.host_of(w) for w in ((0, 1), (1, 1))] == [1, 1]
    big = Hosts(8, 4, 4)  # examples/gpt.toml: 8 hosts, each half a pipeline
    assert big.count == 8 and big.workers(3) == ((1, 4), (1, 5), (1, 6), (1, 7))
    with pytest.raises(RecycleError, match="--workers-per-host 3 does not divide the job's 32"):
        Hosts(8, 4, 3)
    with pytest.raises(RecycleError, match="unknown host 2"):
        HOSTS.workers(2)


def test_a_host_line_and_simultaneous_lines_are_one_step(tmp_path):
    tr = read(tmp_path, "150,fail,host:1\n250,repair,1:0 1:1\n300,fail,0:0\n300,fail,1:1\n")
    steps = tr.steps()
    assert [(s.time, s.kind, s.workers) for s in steps] == [
        (150, "fail", ((1, 0), (1, 1))), (250, "repair", ((1, 0), (1, 1))),
        (300, "fail", ((0, 0), (1, 1)))]
    assert (tr.failures, tr.worker_failures) == (2, 4)
    assert [s.per_stage for s in dead_states(tr)] == [(1, 1), (0, 0), (1, 1)]


@pytest.mark.parametrize("body, hosts, message", [
    ("150,fail,host:1\n", None, "line 2: 'host:1' names a host: give --workers-per-host"),
    ("150,fail,host:7\n", HOSTS, "line 2: unknown host 7 (the job has 2 hosts of 2 workers)"),
    ("150,fail,host:x\n", HOSTS, "line 2: 'host:x' is not host:NUMBER"),
    ("150,fail,0:1\n160,fail,host:0\n", HOSTS, "line 3: worker 0:1 fails but is already dead"),
    ("150,fail,0:1\n160,repair,host:0\n", HOSTS, "line 3: worker 0:0 is repaired but is not"),
])
def test_bad_host_lines_are_named(tmp_path, body, hosts, message):
    with pytest.raises(RecycleError, match=re.escape(message)):
        read(tmp_path, body, hosts)


def test_reroute_over_a_host_failure_by_hand(library):
    """Host 1 fails at 150 s: both its workers at once, one step. Lose the iteration in
    progress (20), pause 1 + 2 s once, then (1, 1) at 2400/s: 153-250 s, 232,800. The host's
    repair is one switch (2 s): 252-400 s at 4000/s, 592,000. Total 1,424,780. Worker by
    worker the same trace would have paused twice on each side."""
    ctx = Context.from_library(library, COSTS)
    tr = sample_free_trace(((150, FAIL, 1), (250, "repair", 1)))
    o = replay(STRATEGIES["reroute"](ctx), tr)
    assert o.samples == pytest.approx(1_424_780)
    assert (o.reconfigurations, o.paused, o.planned) == (2, pytest.approx(5), 0)


def test_drop_pipelines_over_a_host_failure_reports_its_smaller_batch(library):
    """Pipeline 1 is dropped (its host): 599,980 + 97 s x 2000 + 148 s x 4000 = 1,385,980,
    training 18 samples per iteration from 153 to 250 s: on average (150 x 36 + 97 x 18 + 148 x
    36) / 395 = 31.58 while training."""
    ctx = Context.from_library(library, COSTS)
    tr = sample_free_trace(((150, FAIL, 1), (250, "repair", 1)))
    o = replay(STRATEGIES["drop-pipelines"](ctx), tr)
    assert o.samples == pytest.approx(1_385_980)
    assert (o.batch_min, o.batch_mean) == (18, pytest.approx(12474 / 395))
    text = study_text(simulate(ctx, [("hosts", tr)], ["drop-pipelines"]))
    assert "drop pipelines trained with a smaller global batch on hosts: down to 18 samples " \
           "per iteration (fault-free 36), 31.58 on average" in text


def test_a_host_of_one_stage_wipes_the_stage_out(library, tmp_path):
    """Stage placement: host 0 holds 0:0 and 1:0, all of stage 0. Re-routing cannot plan that:
    back to the checkpoint at 100 s (400,000) at 150 s, wait for the host's repair at 250 s,
    restart until 260 s, then 260-400 s at 4000/s: 960,000."""
    tr = read(tmp_path, "150,fail,host:0\n250,repair,host:0\n", Hosts(2, 2, 2, "stage"))
    o = replay(STRATEGIES["reroute"](Context.from_library(library, COSTS)), tr)
    assert o.samples == pytest.approx(960_000)
    assert (o.fallbacks, o.restarts, o.planned) == (1, 1, 0)


def sample_free_trace(events):
    """A hand-written host trace on HOSTS: (time, kind, host)."""
    from recycle_planner.whatif.trace import Event, Trace

    evs = tuple(Event(float(t), kind, w, h) for t, kind, h in events for w in HOSTS.workers(h))
    return Trace(evs, 400.0, 2, 2, {"kind": "test"}, HOSTS)


def test_sampled_host_traces_fail_whole_hosts_and_round_trip(tmp_path):
    spec = make_spec(stages=4, pipelines=4)
    hosts = Hosts(4, 4, 4)
    tr = sample_trace(spec, 3600.0, 1800.0, 500 * 3600.0, seed=2, hosts=hosts)
    steps = tr.steps()
    assert all(len(s.workers) == 4 and len({hosts.host_of(w) for w in s.workers}) == 1
               for s in steps)
    assert 400 < tr.failures < 520 and tr.worker_failures == 4 * tr.failures
    write_trace(tr, tmp_path / "t.csv")
    text = (tmp_path / "t.csv").read_text()
    assert "--workers-per-host 4" in text and ",fail,host:" in text
    back = read_trace(tmp_path / "t.csv", spec, tr.duration, hosts)
    assert back.events == tr.events and back.failures == tr.failures


def test_each_strategy_runs_its_own_policy(tmp_path_factory):
    """A library of 1f1b/split/staggered against a baseline of plain 1F1B (9 ms): without
    failures the baseline strategies train at 100% of the baseline, re-routing at the
    library's faster period."""
    folder = tmp_path_factory.mktemp("split")
    build_library(SPEC, Policy(), 1, folder, Settings(solver="heuristic"), jobs=1)
    lib = PlanLibrary.open(folder, spec=SPEC)
    assert lib.fault_free_period < 9.0
    ctx = Context.from_library(lib, COSTS, BASELINE)
    assert ctx.fault_free_period == 9.0 and ctx.policy == BASELINE
    tr = sample_free_trace(())
    study = simulate(ctx, [("none", tr)], ["reroute", "checkpoint-wait", "oobleck"])
    rel = {o.strategy: o.relative for o in study.runs[0].outcomes}
    assert rel == {"reroute": pytest.approx(9.0 / lib.fault_free_period),
                   "checkpoint-wait": pytest.approx(1.0), "oobleck": pytest.approx(1.0)}
    text = study_text(study)
    assert "schedule: policy 1f1b/split/staggered (the library's)" in text
    assert text.count("schedule: policy 1f1b/fused/barrier (the baseline)") == 2
    assert "fault-free baseline (1f1b/fused/barrier): period 9 ms" in text
    data = study_dict(study)
    assert [s["policy_label"] for s in data["strategies"]] == [
        "1f1b/split/staggered", "1f1b/fused/barrier", "1f1b/fused/barrier"]
    assert data["policy"] == BASELINE.to_dict() and data["library_policy"] == Policy().to_dict()
