"""Each strategy on traces small enough to compute by hand.

The job: 2 stages x 2 pipelines x 2 micro-batches of 9 samples, every op 1 ms, no p2p,
all-reduce or optimizer cost, plain 1F1B with a barrier (BASELINE). So:

- fault-free period (m + p - 1)(F + B) = (2 + 1) x 3 = 9 ms: 36 samples per iteration,
  4000 samples/s;
- one dead worker: its peer runs all four micro-batches of its stage, 4 x (1 + 2) = 12 ms,
  after the first forward of stage 0 (1 ms) and before its last backward (2 ms): 15 ms,
  2400 samples/s;
- Oobleck: a pipeline of 1 stage holds both stages' layers, F = 2, B = 4 ms: m micro-batches
  take 6m ms; the 2-stage pipeline takes 3(m + 1) ms. Four micro-batches over one of each:
  the four smallest of {6, 9, 12, 15, ...} and {6, 12, 18, ...} are 6, 6, 9, 12: 12 ms,
  3000 samples/s;
- Bamboo: the redundant forward (1 ms) joins the backward, B = 3: (2 + 1) x (1 + 3) = 12 ms;
  after a fail-over one worker runs both stages, F = 2, B = 4: 2 x 6 = 12 ms; 3000 samples/s.

Costs: detection 1 s, switch 2 s, Oobleck reconfiguration 4 s, a checkpoint every 100 s,
restart 10 s, 1 spare. Trace A: worker 1:1 fails at 150 s and is repaired at 250 s; 400 s.
At 150 s the last checkpoint (100 s) is 50 s old: 50 / 0.009 = 5555.56 iterations, so the
iteration in progress is 5/9 done: 20 samples.
"""

import pytest

from dataclasses import replace

from recycle_planner.errors import RecycleError
from recycle_planner.job.policy import BASELINE
from recycle_planner.library import PlanLibrary, Settings, build_library
from recycle_planner.whatif.engine import STRATEGIES, replay, simulate
from recycle_planner.whatif.strategy import Context, Costs, PeriodModel
from recycle_planner.whatif.trace import Event, Trace

from conftest import make_spec, with_changes

COSTS = Costs(detect=1, switch=2, reconfigure=4, checkpoint_interval=100, restart=10, spares=1)
SPEC = with_changes(make_spec(stages=2, pipelines=2, microbatches=2), microbatch_size=9)


def trace(*events, duration=400.0):
    evs = tuple(Event(float(t), kind, (d, s)) for t, kind, (d, s) in events)
    return Trace(evs, duration, 2, 2, {"kind": "test"})


TRACE_A = trace((150, "fail", (1, 1)), (250, "repair", (1, 1)))


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    out = {}
    for f in (1, 2):
        folder = tmp_path_factory.mktemp(f"lib{f}")
        build_library(SPEC, BASELINE, f, folder, Settings(solver="heuristic"), jobs=1)
        out[f] = PlanLibrary.open(folder, spec=SPEC)
    return out


def context(libraries, f=2, costs=COSTS, spec=None):
    if spec is None:
        return Context.from_library(libraries[f], costs)
    return Context(spec, BASELINE, costs, 9.0, None, PeriodModel(BASELINE))


def run(ctx, name, tr=TRACE_A):
    return replay(STRATEGIES[name](ctx), tr)


def test_the_periods_the_hand_computations_use(libraries):
    lib = libraries[2]
    assert lib.fault_free_period == 9.0
    assert lib.entry((0, 1)).period == 15.0
    assert lib.entry((1, 0)).period == 15.0
    assert lib.entry((1, 1)).period == 15.0  # what on-demand planning finds too
    ctx = context(libraries)
    assert ctx.fault_free.rate == pytest.approx(4000.0)
    oob = STRATEGIES["oobleck"](ctx)
    assert [oob.period(1, m) for m in (1, 2, 3)] == [6.0, 12.0, 18.0]
    assert [oob.period(2, m) for m in (1, 2, 3, 4)] == [6.0, 9.0, 12.0, 15.0]


def test_reroute_by_hand(libraries):
    """0-150 s at 4000/s: 600,000, minus the iteration in progress (20): 599,980.
    Pause 1 + 2 s, then 153-250 s at 2400/s: 232,800. The repair pauses 2 s (no loss), then
    252-400 s at 4000/s: 592,000. Total 1,424,780: 3561.95/s, 89.04875% of fault-free."""
    o = run(context(libraries), "reroute")
    assert o.samples == pytest.approx(1_424_780)
    assert o.lost_iterations == pytest.approx(20)
    assert o.mean_rate == pytest.approx(3561.95)
    assert o.relative == pytest.approx(0.8904875)
    assert (o.restarts, o.reconfigurations, o.paused) == (0, 2, pytest.approx(5))


def test_reroute_library_only_falls_back_to_a_checkpoint_restart_beyond_it(libraries):
    """Library for 1 failure, no on-demand planning. 0:0 dies at 150 s: 599,980 as above,
    pause to 153 s, then 2400/s until 1:1 dies at 180 s (664,780). Two dead is beyond the
    library: roll back to the checkpoint at 100 s (400,000), wait. 1:1 is repaired at 300 s:
    restart (10 s) from a checkpoint, 310-350 s at 2400/s: 496,000. 0:0 is repaired at 350 s:
    switch (2 s), then 352-500 s at 4000/s: 1,088,000."""
    tr = trace((150, "fail", (0, 0)), (180, "fail", (1, 1)), (300, "repair", (1, 1)),
               (350, "repair", (0, 0)), duration=500)
    o = run(context(libraries, f=1), "reroute-library-only", tr)
    assert o.samples == pytest.approx(1_088_000)
    assert o.lost_rollback == pytest.approx(264_780)
    assert (o.fallbacks, o.restarts) == (1, 1)
    assert o.waiting == pytest.approx(120)
    assert o.cumulative([180.0 - 1e-9, 500.0]) == pytest.approx([664_780, 1_088_000], rel=1e-6)


def test_reroute_plans_a_situation_beyond_the_library_on_demand(libraries):
    """Library for 1 failure; planning charged 3 s (--plan-time). 0:0 dies at 150 s: 599,980,
    pause to 153 s, 2400/s. 1:1 dies at 181 s: 153-181 s is 1866.67 iterations of 15 ms, so
    2/3 of 36 samples (24) are lost: 599,980 + 67,200 - 24 = 667,156. (1, 1) is not in the
    library: planned on demand (the heuristic: 15 ms, 2400/s), pause 1 + 2 + 3 = 6 s, then
    187-300 s: 271,200. Repairs at 300 s and 350 s switch plans (2 s each): 302-350 s at 2400/s
    (115,200), 352-500 s at 4000/s (592,000). Total 1,645,556."""
    tr = trace((150, "fail", (0, 0)), (181, "fail", (1, 1)), (300, "repair", (1, 1)),
               (350, "repair", (0, 0)), duration=500)
    ctx = context(libraries, f=1, costs=replace(COSTS, plan=3))
    o = run(ctx, "reroute", tr)
    assert o.samples == pytest.approx(1_645_556)
    assert (o.planned, o.planning, o.fallbacks, o.restarts) == (1, 3, 0, 0)
    assert o.paused == pytest.approx(3 + 6 + 2 + 2)
    # Met again, the situation is in the library: a plain switch.
    again = trace(*tr_events(tr), (400, "fail", (0, 0)), (420, "fail", (1, 1)),
                  (450, "repair", (1, 1)), (460, "repair", (0, 0)), duration=500)
    o = run(ctx, "reroute", again)
    assert (o.planned, o.planning) == (1, 3)
    assert o.paused == pytest.approx(13 + 3 + 3 + 2 + 2)


def tr_events(tr):
    return [(e.time, e.kind, e.worker) for e in tr.events]


def test_on_demand_planning_charges_the_time_measured_on_the_job(libraries):
    tr = trace((150, "fail", (0, 0)), (181, "fail", (1, 1)), duration=300)
    strategy = STRATEGIES["reroute"](context(libraries, f=1))
    o = replay(strategy, tr)
    measured = strategy.measured[(1, 1)]
    assert 0 < measured < 5 and o.planning == measured and o.planned == 1
    assert strategy.record()["on_demand"] == {"1-1": {"measured_s": measured,
                                                      "charged_s": measured}}
    assert "measured on this job" in " ".join(strategy.assumptions())


def test_reroute_falls_back_only_when_a_stage_is_wiped_out(libraries):
    """Both stage-0 workers dead at 160 s: no plan can exist. 599,980 at 150 s, pause to 153 s,
    153-160 s at 2400/s: 616,780; roll back to the checkpoint at 100 s (400,000) and wait; 0:0 is
    repaired at 200 s: restart until 210 s, 2400/s until 300 s (616,000), switch 2 s, 4000/s from
    302 s to 400 s: 1,008,000."""
    tr = trace((150, "fail", (1, 0)), (160, "fail", (0, 0)), (200, "repair", (0, 0)),
               (300, "repair", (1, 0)))
    o = run(context(libraries, f=1, costs=replace(COSTS, plan=3)), "reroute", tr)
    assert o.samples == pytest.approx(1_008_000)
    assert (o.fallbacks, o.restarts, o.planned) == (1, 1, 0)


def test_checkpoint_with_spares_by_hand(libraries):
    """At 150 s the work since the checkpoint at 100 s is lost (600,000 -> 400,000); the job
    restarts on the spare: 150 + 1 + 10 = 161 s, then 161-400 s at 4000/s: 956,000. The repair
    only refills the spare pool. Total 1,356,000: 3390/s."""
    o = run(context(libraries), "checkpoint-spares")
    assert o.samples == pytest.approx(1_356_000)
    assert o.lost_rollback == pytest.approx(200_000)
    assert o.mean_rate == pytest.approx(3390)
    assert (o.restarts, o.paused) == (1, pytest.approx(11))


def test_checkpoint_with_spares_waits_when_they_run_out(libraries):
    """1 spare. 0:0 dies at 150 s: back to 400,000, restart until 161 s; 1:1 dies at 155 s:
    two dead, one spare: wait. 0:0 is repaired at 200 s: restart until 210 s, then 210-400 s at
    4000/s: 760,000. Total 1,160,000."""
    tr = trace((150, "fail", (0, 0)), (155, "fail", (1, 1)), (200, "repair", (0, 0)),
               (300, "repair", (1, 1)))
    o = run(context(libraries), "checkpoint-spares", tr)
    assert o.samples == pytest.approx(1_160_000)
    assert o.restarts == 2


def test_checkpoint_without_spares_by_hand(libraries):
    """Back to 400,000 at 150 s, wait for the repair at 250 s, restart until 260 s, then
    260-400 s at 4000/s: 560,000. Total 960,000: 2400/s, 60%."""
    o = run(context(libraries), "checkpoint-wait")
    assert o.samples == pytest.approx(960_000)
    assert o.relative == pytest.approx(0.6)
    assert o.waiting == pytest.approx(100)


def test_drop_pipelines_by_hand(libraries):
    """Pipeline 1 is dropped at 150 s (lose 20, pause 3 s): 153-250 s at 2000/s: 194,000. It
    is re-admitted at 250 s (pause 2 s): 252-400 s at 4000/s: 592,000. Total 1,385,980."""
    o = run(context(libraries), "drop-pipelines")
    assert o.samples == pytest.approx(1_385_980)


def test_drop_pipelines_ignores_a_second_failure_in_a_dropped_pipeline(libraries):
    """1:1 then 1:0 die (150 s, 160 s): the second changes nothing (no pause, no loss); 1:0
    is repaired at 200 s (pipeline still broken: no pause), 1:1 at 250 s. Same as trace A."""
    tr = trace((150, "fail", (1, 1)), (160, "fail", (1, 0)), (200, "repair", (1, 0)),
               (250, "repair", (1, 1)))
    o = run(context(libraries), "drop-pipelines", tr)
    assert o.samples == pytest.approx(1_385_980)
    assert o.reconfigurations == 2


def test_drop_pipelines_restarts_when_a_stage_is_lost(libraries):
    """Both stage-1 workers dead at 160 s: their parameters are gone. 0-150 s: 599,980; pause
    to 153 s; 153-160 s at 2000/s: 613,980; roll back to 400,000; 0:1 is repaired at 200 s:
    restart until 210 s, 2000/s until 1:1 is repaired at 300 s (580,000), pause 2 s, 4000/s
    from 302 to 400 s: 972,000."""
    tr = trace((150, "fail", (1, 1)), (160, "fail", (0, 1)), (200, "repair", (0, 1)),
               (300, "repair", (1, 1)))
    o = run(context(libraries), "drop-pipelines", tr)
    assert o.samples == pytest.approx(972_000)
    assert (o.fallbacks, o.restarts) == (1, 1)


def test_oobleck_by_hand(libraries):
    """At 150 s (lose 20) the survivor of pipeline 1 becomes a 1-stage pipeline; pause 1 + 4
    s, then 155-250 s at 3000/s: 285,000. The repair re-instantiates (4 s): 254-400 s at
    4000/s: 584,000. Total 1,468,980."""
    o = run(context(libraries), "oobleck")
    assert o.samples == pytest.approx(1_468_980)
    assert o.reconfigurations == 2


def test_oobleck_within_a_memory_budget(libraries):
    """1 GB static and 1 GB per in-flight micro-batch per stage, 3.5 GB per worker: a 1-stage
    pipeline needs 2 + 2 GB, so the survivor stays idle and the whole pipeline runs all 4
    micro-batches: 3 x (4 + 1) = 15 ms, 2400/s: 599,980 + 95 x 2400. Nothing moves on the
    failure (the survivor idles); the repair loads 1 GB at 1 GB/s onto the returning worker:
    4 + 1 s, then 255-400 s at 4000/s: 580,000. Total 1,407,980."""
    spec = with_changes(SPEC, memory={"activation": "1GB", "static": "1GB", "budget": "3.5GB"})
    ctx = context(libraries, spec=spec, costs=replace(COSTS, bandwidth=1e9))
    oob = STRATEGIES["oobleck"](ctx)
    assert oob.shortest == 2
    assert "shorter pipelines do not fit" in oob.assumptions()[0]
    o = replay(oob, TRACE_A)
    assert o.samples == pytest.approx(1_407_980)
    assert o.paused == pytest.approx(5 + 5)


def test_oobleck_reconfiguration_moves_the_layers_a_worker_lacks(libraries):
    """10 GB of state per stage, 1 GB/s. At 150 s the survivor 1:0 becomes a 1-stage
    pipeline: it holds stage 0 and receives stage 1's 10 GB: 10 s on top of 1 + 4 s. Then
    165-250 s at 3000/s: 255,000. The repair loads 10 GB onto 1:1: 4 + 10 s, then 264-400 s at
    4000/s: 544,000. Total 599,980 + 255,000 + 544,000 = 1,398,980. Without sizes in the spec
    --parameter-bytes 20 GB gives the same; with neither only the fixed 4 s is charged."""
    costs = replace(COSTS, bandwidth=1e9)
    spec = with_changes(SPEC, memory={"activation": "1GB", "static": "10GB", "budget": "100GB"})
    o = replay(STRATEGIES["oobleck"](context(libraries, spec=spec, costs=costs)), TRACE_A)
    assert o.samples == pytest.approx(1_398_980)
    assert o.paused == pytest.approx(15 + 14)
    by_option = replay(STRATEGIES["oobleck"](context(
        libraries, spec=SPEC, costs=replace(costs, parameter_bytes=20e9))), TRACE_A)
    assert by_option.samples == pytest.approx(1_398_980)
    oob = STRATEGIES["oobleck"](context(libraries, spec=SPEC, costs=costs))
    assert "not costed" in oob.assumptions()[-1]
    assert replay(oob, TRACE_A).samples == pytest.approx(1_468_980)


def test_bamboo_by_hand(libraries):
    """3000/s always; a fail-over keeps the iteration in progress. 0-150 s: 450,000; pause 3 s;
    153-250 s: 291,000; fail-back 2 s; 252-400 s: 444,000. Total 1,185,000."""
    o = run(context(libraries), "bamboo")
    assert o.samples == pytest.approx(1_185_000)
    assert o.lost_iterations == 0


def test_bamboo_cannot_take_over_two_neighbours(libraries):
    """1:0 and 1:1 dead at once (180 s): nobody holds stage 1's layers in pipeline 1. Back to
    the checkpoint at 100 s (300,000); 1:1 is repaired at 300 s: restart until 310 s at
    3000/s until the fail-back at 350 s (120,000), then 352-500 s: 444,000. Total 864,000."""
    tr = trace((150, "fail", (1, 0)), (180, "fail", (1, 1)), (300, "repair", (1, 1)),
               (350, "repair", (1, 0)), duration=500)
    o = run(context(libraries), "bamboo", tr)
    assert o.samples == pytest.approx(864_000)
    assert o.fallbacks == 1


def test_bamboo_that_does_not_fit_is_reported_not_run(libraries):
    spec = with_changes(SPEC, memory={"activation": "1GB", "static": "1GB", "budget": "3.5GB"})
    study = simulate(context(libraries, spec=spec), [("A", TRACE_A)], ["bamboo", "oobleck"])
    assert [o.strategy for o in study.runs[0].outcomes] == ["oobleck"]
    assert "do not fit the memory budget" in study.runs[0].infeasible["bamboo"]


def test_bamboo_whose_schedule_cannot_run_in_the_budget_is_reported(libraries):
    """GPipe keeps both micro-batches in flight; with its successor's state a worker has room
    for one only (1 + 1 GB static, 2 GB per micro-batch, 5 GB)."""
    from recycle_planner.job.policy import Policy

    spec = with_changes(SPEC, memory={"activation": "1GB", "static": "1GB", "budget": "5GB"})
    gpipe = Policy("gpipe", decouple=False, stagger=False)
    ctx = Context(spec, gpipe, COSTS, 8.0, None, PeriodModel(gpipe))
    bamboo = STRATEGIES["bamboo"](ctx)
    assert "gpipe keeps all 2 micro-batches in flight" in bamboo.infeasible()
    with pytest.raises(RecycleError, match="Bamboo-style cannot run this job"):
        replay(bamboo, TRACE_A)


def test_without_failures_every_strategy_but_bamboo_runs_at_fault_free_speed(libraries):
    study = simulate(context(libraries), [("none", trace(duration=1000))])
    for o in study.runs[0].outcomes:
        assert o.relative == pytest.approx(0.75 if o.strategy == "bamboo" else 1.0)


def test_rerouting_is_not_ahead_of_checkpoint_restart_on_every_trace(libraries):
    """Why no test claims re-routing always beats checkpoint-restart without spares: their
    checkpoints fall at different times. Library for 1 failure; 1:0 dies at 0.5 s, is back at
    40.5 s, dies again at 190.5 s, and 1:1 dies at 193.5 s; the trace ends at 194.5 s.

    Re-routing: 2000 - 20 (iteration in progress) + 37 s x 2400 + 57.5 s x 4000 = 320,780 at
    its checkpoint at 100 s; at 193.5 s two are dead, beyond the library: back to 320,780.
    Checkpoint-restart: back to 0 at 0.5 s, restart from 40.5 s to 50.5 s, checkpoint at
    150.5 s after 100 s x 4000 = 400,000; back to it at 190.5 s."""
    tr = trace((0.5, "fail", (1, 0)), (40.5, "repair", (1, 0)), (190.5, "fail", (1, 0)),
               (193.5, "fail", (1, 1)), duration=194.5)
    ctx = context(libraries, f=1)
    assert run(ctx, "reroute-library-only", tr).samples == pytest.approx(320_780)
    assert run(ctx, "checkpoint-wait", tr).samples == pytest.approx(400_000)
