"""The CP-SAT engine: exactness against exhaustive search, the MILP cross-check, determinism,
the bounds it proves, `auto` and `--prove`."""

import json
from itertools import combinations

import pytest

from recycle_planner.job.policy import BASELINE, Policy
from recycle_planner.library import PlanLibrary, Settings, build_library
from recycle_planner.planner import finish_plan, plan_situation, solve
from recycle_planner.solvers.bounds import lower_bound
from recycle_planner.solvers import cp as cp_module
from recycle_planner.solvers.cp import (CP_WORKERS, INTERLEAVED_WORKERS, cp_prove, cp_solution,
                                       intervals, relaxations, run_cp)
from recycle_planner.solvers.exhaustive import exhaustive
from recycle_planner.solvers.grid import time_scale
from recycle_planner.solvers.heuristic import heuristic
from recycle_planner.solvers.milp import run_milp
from recycle_planner.timing.simulate import simulate
from recycle_planner.timing.validate import validate

from conftest import make_spec
from test_solvers import TINY

SPLIT = Policy("1f1b", decouple=True, stagger=False)


def warm_of(spec, policy, failed):
    return heuristic(spec, policy, failed).simulation


@pytest.mark.parametrize("kw, policy, failed", TINY)
def test_cp_matches_exhaustive_search(kw, policy, failed):
    spec = make_spec(**kw)
    truth = exhaustive(spec, policy, failed)
    res = run_cp(spec, policy, failed, 10, warm_of(spec, policy, failed))
    assert res.status == "Optimal" and res.exact
    assert res.objective == pytest.approx(truth.best.period, abs=1e-6)
    assert res.bound == pytest.approx(truth.best.period, abs=1e-6)


CROSS = [
    (dict(stages=3, pipelines=2, microbatches=3, p2p=0.25), BASELINE, ((0, 0),)),
    (dict(stages=2, pipelines=2, microbatches=2, p2p=0.5), BASELINE, ((1, 1),)),
    (dict(stages=4, pipelines=2, microbatches=4), BASELINE, ((0, 2),)),
    (dict(stages=3, pipelines=3, microbatches=2, p2p=0.25), SPLIT, ((1, 0), (0, 2))),
    (dict(stages=2, pipelines=3, microbatches=2, p2p=0.25, memory={"max_inflight": 2}),
     Policy(), ((1, 0),)),
]


@pytest.mark.parametrize("kw, policy, failed", CROSS)
def test_cp_and_milp_cross_check(kw, policy, failed):
    """Each engine's bound holds against the other's plan; where both prove optimality, the CP
    optimum (over every schedule) is at most the MILP's (over index-ordered ones) and here they
    agree; and every CP plan is valid once re-timed by the simulator."""
    spec = make_spec(**kw)
    warm = warm_of(spec, policy, failed)
    cp = run_cp(spec, policy, failed, 10, warm)
    milp = run_milp(spec, policy, failed, 120, "highs", warm, node_limit=5000)
    assert cp.bound <= milp.objective + 1e-6 and milp.bound <= cp.objective + 1e-6
    assert cp.status == "Optimal" and milp.status == "Optimal"
    assert cp.objective == pytest.approx(milp.objective, abs=1e-6)
    plan = plan_situation(spec, policy, failed, solver="cp", time_limit=10)
    assert validate(plan) == [] and plan.metrics.optimal
    assert plan.metrics.period == pytest.approx(cp.objective)


def test_the_issues_example_is_proven_optimal():
    """4x2x8 unit costs, workers 0:1 and 1:2 dead, split, barrier: the fast solvers find 51,
    the engine 50 and proves it."""
    spec = make_spec(stages=4, pipelines=2, microbatches=8)
    failed = ((0, 1), (1, 2))
    plan = plan_situation(spec, SPLIT, failed, solver="cp", time_limit=10)
    assert plan.solver["candidates"]["template order"] == pytest.approx(51)
    cp = plan.solver["cp"]
    assert cp["engine"] == "cp-sat" and cp["status"] == "Optimal" and cp["improved"]
    assert cp["best_bound"] == pytest.approx(50) and cp["seconds"] >= 0
    assert plan.metrics.period == pytest.approx(50) and plan.metrics.optimal
    assert plan.solver["detail"] == "cp" and validate(plan) == []


def test_the_engine_is_deterministic():
    spec = make_spec(stages=3, pipelines=3, microbatches=4, p2p=0.1, allreduce=0.5)
    failed = ((1, 1),)
    warm = warm_of(spec, Policy(), failed)
    a = run_cp(spec, Policy(), failed, 0.5, warm)
    b = run_cp(spec, Policy(), failed, 0.5, warm)
    assert a.status == b.status and a.objective == b.objective and a.bound == b.bound
    assert all((x == y).all() for x, y in zip(a.schedule.orders, b.schedule.orders))


def test_no_schedule_under_x_is_a_bound():
    spec = make_spec(stages=4, pipelines=2, microbatches=8)
    failed = ((0, 1), (1, 2))
    warm = warm_of(spec, SPLIT, failed)
    res = run_cp(spec, SPLIT, failed, 10, warm, below=50)
    assert res.status == "Infeasible" and res.bound == 50 and res.schedule is None


def test_prove_mode_bisects_the_gap(monkeypatch):
    """3x2x4 with p2p, split, barrier: the fast plan is 26.2 above a bound of 25.6; prove mode
    finds a shorter plan (25.8), keeps a bound between the analytic one and the plan, and
    records each "schedule under X?" probe it ran. (The relaxed bounds, off here, prove 25.8
    before any probe.)"""
    monkeypatch.setattr(cp_module, "RELAX_SHARE", 0.0)
    spec = make_spec(stages=3, pipelines=2, microbatches=4, p2p=0.2)
    failed = ((1, 1),)
    warm = warm_of(spec, SPLIT, failed)
    sim, info, bound = cp_prove(spec, SPLIT, failed, 2, warm)
    floor = lower_bound(spec, SPLIT, failed).value
    assert sim.period < warm.period - 0.3 and floor <= bound <= sim.period
    assert info["improved"] and info["probes"]
    for probe in info["probes"]:
        assert bound < probe["under"] < warm.period and probe["status"]


def test_interleaved_workers_shorten_what_one_worker_does_not():
    """4x4x8 with p2p 0.5, workers 0:1 and 2:2 dead, staggered (the optimality table): from
    the fast plan (40), one worker's search stays at 40 where eight interleaved workers (their
    large-neighbourhood search) find 39 with the same limit; both deterministic."""
    spec = make_spec(stages=4, pipelines=4, microbatches=8, p2p=0.5)
    failed = ((0, 1), (2, 2))
    warm = warm_of(spec, Policy(), failed)
    assert warm.period == pytest.approx(40)
    one = run_cp(spec, Policy(), failed, 2, warm, workers=CP_WORKERS)
    many = run_cp(spec, Policy(), failed, 2, warm, workers=INTERLEAVED_WORKERS)
    assert one.objective == pytest.approx(40)
    assert many.objective == pytest.approx(39) and validate_sim(many.schedule) == []


def validate_sim(schedule):
    """The validator's findings on a schedule re-timed by the simulator (memory included)."""
    sim = simulate(schedule)
    return validate(finish_plan(sim, sim.period, {}))


@pytest.mark.parametrize("work, interleaved", [(3.0, True), (1.5, False)])
def test_an_interleaved_pass_follows_where_a_gap_and_the_budget_are_left(monkeypatch, work,
                                                                         interleaved):
    """cp_solution minimises with one worker first; where that leaves a gap and the probes'
    share is at least INTERLEAVE_FROM deterministic seconds (here lowered to 1), half of what
    is left goes to interleaved workers from its best plan, the probes get the rest; with a
    smaller budget (auto's, plan's) no such pass."""
    seen = []
    real = cp_module.run_cp

    def recording(*args, workers=CP_WORKERS, **kw):
        if kw.get("machine_stages") is None:  # not a relaxed bound
            seen.append(workers)
        return real(*args, **{**kw, "workers": workers})

    monkeypatch.setattr(cp_module, "run_cp", recording)
    monkeypatch.setattr(cp_module, "INTERLEAVE_FROM", 1.0)
    spec = make_spec(stages=4, pipelines=4, microbatches=8, p2p=0.5)
    failed = ((0, 1), (2, 2))
    sim, info, bound = cp_solution(spec, Policy(), failed, work, warm_of(spec, Policy(), failed))
    assert seen[0] == CP_WORKERS and ("interleaved" in info) == interleaved
    assert seen[1:2] == ([INTERLEAVED_WORKERS] if interleaved else [CP_WORKERS])
    assert all(w == CP_WORKERS for w in seen[2:]) and info["probes"]  # the probes: one worker
    assert bound <= sim.period <= 40


def test_costs_off_the_grid_round_down_and_say_so():
    assert time_scale([1, 0.5, 0.25]) == (100, True)
    assert time_scale([1, 1 / 3]) == (10_000, False)
    spec = make_spec(stages=2, pipelines=2, microbatches=1, p2p=1 / 3)
    res = run_cp(spec, Policy(), ((1, 1),), 5, warm_of(spec, Policy(), ((1, 1),)))
    assert not res.exact and "rounded down" in res.status
    truth = exhaustive(spec, Policy(), ((1, 1),)).best.period
    assert res.bound <= truth + 1e-9  # still a valid lower bound


def test_auto_reports_its_budget_and_uses_the_winner():
    spec = make_spec(stages=3, pipelines=2, microbatches=3, p2p=0.25)
    sol = solve(spec, BASELINE, ((0, 0),), "auto", time_limit=5, node_limit=200)
    assert sol.simulation.period == pytest.approx(26.0) and sol.info["detail"] == "cp"
    assert sol.bound == pytest.approx(26.0) and "milp" not in sol.info  # proven: MILP skipped
    assert sol.info["budget"]["work_limit"] == 5 and sol.info["budget"]["seconds"] > 0
    closed = solve(make_spec(stages=2, pipelines=2, microbatches=2), Policy(), ((1, 1),), "auto")
    assert "cp" not in closed.info  # the fast plan meets the analytic bound: nothing to run
    assert intervals(make_spec(16, 64, 64), Policy(), ((0, 0),)) > 100_000


def test_plan_all_prove_closes_gaps_and_resumes(tmp_path):
    spec = make_spec(stages=3, pipelines=3, microbatches=3, p2p=0.2)
    folder = tmp_path / "lib"
    fast = Settings(solver="heuristic", max_placements=1)
    # Up to 2 failures: with one, the improved heuristic plans already meet their bounds.
    build_library(spec, Policy(), 2, folder, fast, jobs=1)
    before = {e.counts: e.to_dict() for e in PlanLibrary.open(folder).entries()}
    proving = Settings(solver="heuristic", max_placements=1, prove_work=2)
    index = build_library(spec, Policy(), 2, folder, proving, jobs=1)
    after = {e.counts: e.to_dict() for e in index.entries}
    assert set(after) == set(before)
    for k, e in after.items():
        m, old = e["metrics"], before[k]["metrics"]
        assert m["period"] <= old["period"] + 1e-9
        assert m["lower_bound"] >= old["lower_bound"] - 1e-9
        assert e.get("proved") == 2 or old["optimal"]  # optional: absent when never proved
    assert sum(e["metrics"]["gap"] for e in after.values()) < \
        sum(e["metrics"]["gap"] for e in before.values())
    lib = PlanLibrary.open(folder)
    for e in lib.entries():
        assert validate(lib.lookup([tuple(w) for w in e.failed]).plan()) == []
    stamp = (folder / "index.json").stat().st_mtime_ns
    mtimes = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    build_library(spec, Policy(), 2, folder, proving, jobs=1)  # resumes: nothing to redo
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.name != "index.json"} \
        == {k: v for k, v in mtimes.items() if k != "index.json"}
    assert json.loads((folder / "index.json").read_text())["complete"] and stamp


@pytest.mark.parametrize("first", ["highspy", "ortools.sat.python.cp_model"])
def test_highspy_and_ortools_load_in_one_process(first):
    """Both ship libhighs.so.1: whichever loads first must serve the other (pinned together)."""
    import subprocess
    import sys

    code = (f"import {first}; import highspy; from ortools.sat.python import cp_model; "
            "h = highspy.Highs(); h.setOptionValue('output_flag', False); h.run(); "
            "print(cp_model.CpSolver().Solve(cp_model.CpModel()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-500:]


def test_placement_screening_builds_the_fast_plans_once(monkeypatch):
    """With the exact engines, the placements are screened by the fast solvers, and the chosen
    placement's engine starts from the plans screening built (issue 13: they were built twice)."""
    from recycle_planner.library import placement as placement_module
    from recycle_planner.job.situations import placements
    from recycle_planner.solvers import portfolio

    spec = make_spec(stages=3, pipelines=3, microbatches=3, p2p=0.2)
    counts = (1, 1, 0)
    calls = []
    real = portfolio.fast_candidates

    def counting(*args):
        calls.append(args[2])
        return real(*args)

    monkeypatch.setattr(portfolio, "fast_candidates", counting)
    monkeypatch.setattr(placement_module, "fast_candidates", counting)
    settings = Settings(solver="cp", work_limit=0.5)
    options = placements(counts, spec.pipelines, settings.max_placements)
    assert len(options) > 1
    plan, chosen = placement_module.plan_best_placement(spec, Policy(), counts, settings, 20.0)
    assert len(calls) == len(options)  # once per placement, none for the chosen one's engine
    assert "cp" in plan.solver and chosen in options


RELAXED = TINY + CROSS + [
    # Stage 0 lives only in pipeline 1 and stage 1 only in pipeline 0: every micro-batch meets
    # the same two machines, so the relaxation orders all of them as one class.
    (dict(stages=2, pipelines=2, microbatches=2, p2p=0.25), BASELINE, ((0, 0), (1, 1))),
    (dict(stages=3, pipelines=2, microbatches=2), Policy(), ((0, 1), (1, 2))),
]


@pytest.mark.parametrize("kw, policy, failed", RELAXED)
def test_relaxations_never_exceed_the_optimum(kw, policy, failed):
    """Keeping only some stages as machines is a relaxation: its optimum is at most the
    job's (the whole model's, which the tests above check) for every set of stages; keeping every stage, its symmetry breaking (micro-batches
    of one class ordered where they first meet a machine) keeps the optimum. No plan comes
    out of a relaxation."""
    spec = make_spec(**kw)
    whole = run_cp(spec, policy, failed, 10)  # proven: against exhaustive search and the MILP
    assert whole.status == "Optimal"
    truth, S = whole.objective, spec.stages
    for size in range(1, S + 1):
        for stages in combinations(range(S), size):
            res = run_cp(spec, policy, failed, 10, machine_stages=frozenset(stages))
            assert res.status == "Optimal" and res.schedule is None, stages
            assert res.objective <= truth + 1e-6, stages
            if size == S:
                assert res.objective == pytest.approx(truth, abs=1e-6)


def test_a_relaxation_proves_what_the_whole_model_does_not():
    """4x2x8 unit costs, workers 0:1 and 1:2 dead, fused backward, barrier: workers 1:1 and
    0:2 each run all 16 micro-batches, the analytic bound is 54 and the plans are 55. The whole
    model proves nothing in 400 deterministic seconds; kept to those two workers' stages it
    proves 55 in well under one, so the plan is optimal."""
    spec = make_spec(stages=4, pipelines=2, microbatches=8)
    failed = ((0, 1), (1, 2))
    warm = warm_of(spec, BASELINE, failed)
    assert lower_bound(spec, BASELINE, failed).value == 54 and warm.period == 55
    assert relaxations(spec, failed)[:2] == [frozenset({1}), frozenset({1, 2})]
    res = run_cp(spec, BASELINE, failed, 1, warm, below=55, machine_stages=frozenset({1, 2}))
    assert res.status == "Infeasible" and res.work < 1
    sim, info, bound = cp_solution(spec, BASELINE, failed, 6, warm)
    assert bound == 55 and sim.period == 55 and info["gap"] == 0
    assert [r["stages"] for r in info["relaxed"]] == [[1], [1, 2]]
    assert info["relaxed"][-1]["bound"] == 55 and "probes" not in info
    # auto's budget (1 deterministic second) leaves the relaxations less than RELAX_FROM
    assert "relaxed" not in cp_solution(spec, BASELINE, failed, 1, warm)[1]
    plan = plan_situation(spec, BASELINE, failed, solver="cp", work_limit=6)
    assert plan.metrics.optimal and plan.metrics.lower_bound == 55
    assert plan.metrics.lower_bound_reason == \
        "the CP engine's bound (stages 1, 2 alone as machines)"


@pytest.mark.parametrize("failed", [((0, 1), (2, 0)), ((1, 2), (2, 0)), ((1, 2), (3, 0))])
def test_every_fast_plan_is_a_warm_start(failed):
    """The issue's cross-check: on a memory-capped staggered 3 x 4 x 8 job with two dead
    workers some fast plans ran a pipeline's first forwards out of index order, which the
    model's symmetry breaking forbids ("warm start not representable"); relabelling the
    micro-batches (interchangeable within a pipeline) makes every one a warm start."""
    from recycle_planner.solvers.cp import CpModel
    from recycle_planner.solvers.portfolio import fast_candidates

    spec = make_spec(stages=3, pipelines=4, microbatches=8, forward=[1, 2, 1],
                     backward_input=[2, 1, 1.5], backward_weight=0.5, p2p=0.25,
                     memory={"max_inflight": 2})
    for candidate in fast_candidates(spec, Policy(), failed):
        assert CpModel(spec, Policy(), failed, candidate.simulation).warm_state == "used"
