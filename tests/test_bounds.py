"""Every lower bound is sound: none exceeds the period of a feasible schedule, and none exceeds
the optimum (exhaustive search where it runs, else the CP engine's proven optimum, whose
schedule the simulator re-times). Random small jobs (hypothesis) cover costs, latency, memory
caps, the three schedules, fused or split backwards, barrier or staggered, and 0-2 failures."""

from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from recycle_planner.errors import RecycleError
from recycle_planner.job.policy import BASELINE, Policy
from recycle_planner.job.spec import load_spec
from recycle_planner.solvers import bounds
from recycle_planner.solvers.bounds import all_bounds, lower_bound
from recycle_planner.solvers.cp import close_gap, run_cp
from recycle_planner.solvers.exhaustive import exhaustive
from recycle_planner.solvers.heuristic import heuristic
from recycle_planner.timing.simulate import simulate

from conftest import make_spec
from test_properties import jobs

@st.composite
def small_situations(draw, max_stages=3, max_pipelines=3, max_microbatches=3):
    spec = draw(jobs(max_stages, max_pipelines, max_microbatches))
    workers = [(d, s) for d in range(spec.pipelines) for s in range(spec.stages)]
    failed = draw(st.lists(st.sampled_from(workers), unique=True, max_size=2))
    assume(all(sum(1 for _, s in failed if s == t) < spec.pipelines
               for t in range(spec.stages)))
    policy = Policy("1f1b", draw(st.booleans()), draw(st.booleans()))
    return spec, policy, tuple(sorted(failed))


def optimum(spec, policy, failed) -> float | None:
    """The shortest period of any schedule: exhaustive search when it is small enough, else
    the CP engine's proven optimum, re-timed by the simulator (so a bound the model was given
    too high cannot hide behind the model's own objective); None if the engine stops first."""
    try:
        return exhaustive(spec, policy, failed, limit=3000).best.period
    except RecycleError:
        pass
    warm = heuristic(spec, policy, failed).simulation
    res = run_cp(spec, policy, failed, 5, warm)
    if res.status != "Optimal" or not res.exact:
        return None
    return min(simulate(res.schedule).period, warm.period)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_situations())
def test_no_bound_exceeds_the_optimum(case):
    spec, policy, failed = case
    bound = lower_bound(spec, policy, failed)
    best = optimum(spec, policy, failed)
    assume(best is not None)
    assert bound.value <= best + 1e-6, f"{bound.reason}: {bound.value} above the optimum {best}"


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_situations(max_stages=3, max_pipelines=2, max_microbatches=4))
def test_no_schedule_under_x_probes_stay_below_the_optimum(case):
    """close_gap's bound (infeasibility proofs "no schedule under X") never passes the optimum,
    and its plan is never worse than the one it started from."""
    spec, policy, failed = case
    warm = heuristic(spec, policy, failed).simulation
    floor = lower_bound(spec, policy, failed).value
    plan, bound, probes = close_gap(spec, policy, failed, warm, floor, 2.0, 4)
    best = optimum(spec, policy, failed)
    assume(best is not None)
    assert floor <= bound <= best + 1e-6
    assert plan.period <= warm.period + 1e-9


def test_probes_prove_staggered_optima_the_formulas_do_not():
    """The 3x3x4 library job with worker 1:1 dead: the cycle formulas give 19.1, the optimum is
    19.9 (benchmarks/README.md, optimality table); from there the probes prove "no schedule
    under 19.2". The crowded-ends bound (test_crowded_ends.py) alone reaches 19.7."""
    spec = make_spec(stages=3, pipelines=3, microbatches=4, p2p=0.1, allreduce=0.5)
    failed = ((1, 1),)
    warm = heuristic(spec, Policy(), failed).simulation
    crowded = lower_bound(spec, Policy(), failed)
    assert crowded.value == pytest.approx(19.7) and "stage-1 workers" in crowded.reason
    with mock.patch.object(bounds, "crowded_ends", lambda *args: None):
        floor = lower_bound(spec, Policy(), failed).value
        assert floor == pytest.approx(19.1)
        plan, bound, _ = close_gap(spec, Policy(), failed, warm, floor, 12.0, 6)
    assert bound == pytest.approx(19.2)
    assert plan.period == pytest.approx(19.9)


def test_cycles_closing_at_a_middle_stage_and_both_memory_terms():
    """The memory-bound 8x8x16 job with stage 3 twice dead: the busiest stage-3 worker runs 22
    micro-batches through 8 slots; the highest bound with both memory terms."""
    spec = make_spec(stages=8, pipelines=8, microbatches=16, backward_input=1.1,
                     backward_weight=0.9, p2p=0.05, allreduce=4, optimizer=0.6)
    bound = max((b for b in all_bounds(spec, Policy(), ((0, 3), (1, 3)))
                 if "first gradient" in b.reason), key=lambda b: b.value)
    # 3 forwards and links, the round trip (9.8), 22 I, 14 late F and 14 late W, 3 links and
    # I up to stage 0, W_0, all-reduce and step.
    expected = 3 * 1.05 + 9.8 + 22 * 1.1 + 14 * 1 + 14 * 0.9 + 3 * 1.15 + 0.9 + 4.6
    assert bound.value == pytest.approx(expected)
    assert "first gradient" in bound.reason and "up to stage 0" in bound.reason
    assert bound.value <= heuristic(spec, Policy(), ((0, 3), (1, 3))).simulation.period


@pytest.mark.parametrize("S, D, M, policy, failed", [
    (2, 3, 3, Policy(), ((0, 0),)),
    (3, 3, 3, Policy(), ((0, 1),)),
    (3, 3, 2, Policy(stagger=False), ((0, 0),)),
    (2, 4, 4, BASELINE, ((0, 0),)),
])
def test_a_late_pipeline_bound_stays_below_the_optimum(S, D, M, policy, failed):
    """A heavy last stage makes the fault-free cycle through it the bound; a dead worker at an
    earlier stage leaves D pipelines to start on D - 1 workers, so one starts late, and the
    (late pipeline) bound decides (here with others tied). It stays below the optimum."""
    heavy = [1.0] * (S - 1) + [2.0]
    spec = make_spec(stages=S, pipelines=D, microbatches=M, forward=heavy,
                     backward_input=heavy, backward_weight=heavy)
    late = max((b for b in all_bounds(spec, policy, failed) if "late" in b.reason),
               key=lambda b: b.value)
    assert late.value >= lower_bound(spec, policy, ()).value
    best = optimum(spec, policy, failed)
    assert best is not None and late.value <= best + 1e-6


def test_the_late_pipeline_and_drain_bounds_on_the_gpt_example():
    """GPT example, stage 3 of pipeline 0 dead: 4 pipelines start on 3 stage-3 workers, one
    12 ms late, on top of the fault-free cycle through stage 7 (501.4): 513.4 (was 501.4, a
    2.5% gap). Their last gradients also reach stage 3 on 3 workers: one runs two I_3 in a row
    (12.5 ms): 513.9, the heuristic's period, so its plan is proven optimal."""
    spec = load_spec(Path(__file__).resolve().parent.parent / "examples" / "gpt.toml")
    failed = ((0, 3),)
    late = max((b for b in all_bounds(spec, Policy(), failed) if "late" in b.reason),
               key=lambda b: b.value)
    assert late.value == pytest.approx(501.4 + 12.0)
    bound = lower_bound(spec, Policy(), failed)
    assert bound.value == pytest.approx(501.4 + 12.5)
    assert "reach stage 3 on 3 live" in bound.reason
    assert heuristic(spec, Policy(), failed).simulation.period == pytest.approx(bound.value)


@pytest.mark.parametrize("kw, policy, failed, optimum_period", [
    # Found by random search: the exhaustive optimum equals the drain bound, above every other.
    (dict(stages=3, pipelines=3, microbatches=3, forward=[2, 0.5, 2],
          backward_input=[2, 0.5, 1], backward_weight=[0, 2, 2]),
     Policy(decouple=False, stagger=False), ((2, 1),), 24.5),
    (dict(stages=3, pipelines=3, microbatches=3, forward=[2, 0.5, 0.5],
          backward_input=[1, 1, 2], backward_weight=[1, 0.5, 0.5], allreduce=1),
     Policy(decouple=False), ((2, 1),), 17.5),
    (dict(stages=3, pipelines=3, microbatches=3, forward=[1, 0.5, 2],
          backward_input=[2, 1, 2], backward_weight=[2, 0, 0.5], allreduce=1),
     Policy(), ((0, 1),), 20.5),
])
def test_the_drain_bound_is_tight_on_small_jobs(kw, policy, failed, optimum_period):
    """Three pipelines' last gradients reach stage 1 on its two live workers: one of them runs
    two of those input backwards in a row. The bound equals the optimum here."""
    spec = make_spec(**kw)
    bound = lower_bound(spec, policy, failed)
    assert "last gradients of 3 pipelines reach stage 1 on 2 live" in bound.reason
    assert bound.value == pytest.approx(optimum_period)
    assert optimum(spec, policy, failed) == pytest.approx(optimum_period)


def test_the_drain_bound_proves_the_gpt_plan_with_a_dead_stage_0_worker():
    """GPT example, stage 0 of pipeline 0 dead: every pipeline's last gradient reaches stage 0
    no earlier than in the fault-free cycle through stage 7 (501.4), and one of the three live
    stage-0 workers runs two of those four I_0 + W_0 (24 ms more): 525.4, and the CP engine
    finds a plan of exactly that period (was: bound 514.4, plan 525.4, a 2.1% gap)."""
    spec = load_spec(Path(__file__).resolve().parent.parent / "examples" / "gpt.toml")
    failed = ((0, 0),)
    bound = lower_bound(spec, Policy(), failed)
    assert bound.value == pytest.approx(501.4 + 12.5 + 11.5)
    warm = heuristic(spec, Policy(), failed).simulation
    res = run_cp(spec, Policy(), failed, 1.0, warm)
    assert res.status == "Optimal"
    assert simulate(res.schedule).period == pytest.approx(bound.value)


# The memory-bound unit job of docs/solvers.md (F 1, I 1.1, W 0.9, p2p 0.05, AR 4, OPT 0.6).
MEMORY_BOUND = dict(backward_input=1.1, backward_weight=0.9, p2p=0.05, allreduce=4, optimizer=0.6)


@pytest.mark.parametrize("kw, policy, failed, optimum_period", [
    # Fault-free: the 4th forward waits for the 1st micro-batch's weight gradient (3 slots),
    # then makes its own round trip: 2 x 5.4 + 2 x (1.1 + 0.9) + 4.6.
    (dict(stages=3, pipelines=1, microbatches=4, **MEMORY_BOUND), Policy(), (), 19.4),
    (dict(stages=4, pipelines=1, microbatches=8, **MEMORY_BOUND), Policy(), (), 32.8),
    # The optimality table's (benchmarks/README.md): proven by exhaustive search or CP.
    (dict(stages=2, pipelines=3, microbatches=1, p2p=0.25), Policy(), ((1, 0), (0, 1)), 11.0),
    (dict(stages=3, pipelines=2, microbatches=3, p2p=0.25), BASELINE, ((0, 0),), 26.0),
    (dict(stages=4, pipelines=2, microbatches=4, forward=[1, 1.5, 1, 2],
          backward_input=[1, 1.5, 1, 2], backward_weight=[1, 1, 0.5, 1.5], p2p=0.5),
     Policy(), ((1, 1),), 39.0),
])
def test_the_last_forward_bound_is_tight(kw, policy, failed, optimum_period):
    """A worker's last forward waits for the weight gradients that free its memory; with the
    round trip of its own micro-batch after it, the bound equals the optimum, where every
    other bound is below it."""
    spec = make_spec(**kw)
    bounds = all_bounds(spec, policy, failed)
    best = max(bounds, key=lambda b: b.value)
    assert "last forward" in best.reason
    assert best.value == pytest.approx(optimum_period)
    assert max(b.value for b in bounds if "last forward" not in b.reason) < optimum_period - 0.1
    assert optimum(spec, policy, failed) == pytest.approx(optimum_period)


def test_the_last_forward_bound_proves_the_8x8x16_fault_free_plan():
    """The synthetic 8x8x16 job without failures: stage 0's 16th forward waits for 8 weight
    gradients (8 slots): 16.4 + 8 x 2 + 7 = 39.4, then its round trip, I_0, W_0 and the step:
    62.4, the heuristic's plan (the bound was 61.7, a 1.1% gap in the library)."""
    spec = make_spec(stages=8, pipelines=8, microbatches=16, **MEMORY_BOUND)
    bound = lower_bound(spec, Policy(), ())
    assert bound.value == pytest.approx(39.4 + 16.4 + 2.0 + 4.6)
    assert "stage 0's last forward" in bound.reason
    assert heuristic(spec, Policy(), ()).simulation.period == pytest.approx(bound.value)
