"""Plans made at run time, on real worker processes (gloo on CPU): a failure set beyond the
library's threshold planned on demand and refined in the background (the survivors switch at
an iteration boundary), and a run with no library at all. Each run must end with the
parameters and losses of the single-process (fault-free) reference."""

import hashlib
import json

import pytest

from recycle_planner.executor.control import protocol as P

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

from recycle_planner.executor import LaunchConfig, launch, parse_fault  # noqa: E402
from recycle_planner.library import PlanLibrary  # noqa: E402
from helpers.executor_checks import (TINY, assert_losses_equal,  # noqa: E402
                                     assert_params_equal, checkpoint_params, library, reference)


def _events(result, kind):
    return [e.to_json() for e in result.events if e.kind == kind]


def test_plan_decision_is_pure_and_leaves_the_planning_to_the_launcher():
    d = P.decide(4, pipelines=2, stages=2, steps={0: 3, 3: 3}, lookup=lambda dead: None)
    assert d.action == "plan" and d.dead == ((0, 1), (1, 0)) and d.restart == 3
    assert "no plan for dead workers" in d.reason
    d = P.decide(4, pipelines=2, stages=2, steps={0: 3}, lookup=lambda dead: None)
    assert d.action == "stop" and "stage 1" in d.reason  # a wiped-out stage is never planned


def test_beyond_the_threshold_is_planned_on_demand_then_refined_at_a_boundary(tmp_path):
    """2 stages x 2 pipelines, a library for one failure. Worker 1:0 dies (in the library),
    then 0:1 (two dead: beyond it). The launcher plans that set at once with one
    list-scheduling pass (budget 0), adds it to the library with its checksum, and training
    goes on; a background process refines it (the CP engine finds a period 7% shorter), and
    the survivors switch to it at an iteration boundary (worker 0:0 holds at iteration 5
    until the switch is asked, so that it surely comes before the end)."""
    lib = library(tmp_path / "lib", stages=2, pipelines=2, microbatches=4, max_failures=1)
    args = ["--library", str(lib), "--iterations", "9"]
    faults = [parse_fault(f) for f in ("2:2:F1", "1:3:I0", "0:5:hold")]
    run = tmp_path / "run"
    result = launch(TINY, LaunchConfig(nproc=4, run_dir=str(run), faults=faults,
                                       plan_budget=0.0, refine_budget=2.0,
                                       refine_margin=0.01), args)
    assert result.status == "completed" and result.iterations == 9
    planned = _events(result, "planned")
    assert [p["counts"] for p in planned] == [[1, 1]]
    gens = _events(result, "generation")
    assert [g["plan"] for g in gens] == ["k0-0.json.gz", "k1-0.json.gz",
                                         "k1-1.ondemand1.json.gz", "k1-1.refined1.json.gz"]
    refined = _events(result, "refined")[0]
    assert refined["better"] and refined["period"] < refined["previous"] * 0.99
    events = [e.to_json() for e in result.events]
    kinds = [e["kind"] for e in events]
    assert kinds.index("refined") < kinds.index("switch") < events.index(gens[3])
    # worker 0:0 sees the switch asked at iteration 5: the members leave at 5 + 2
    assert gens[3]["dead"] == gens[2]["dead"] and gens[3]["restart"] == 7

    index = json.loads((lib / "index.json").read_text())
    entry = next(e for e in index["entries"] if e["failed_per_stage"] == [1, 1])
    assert entry["made"] == "refined" and entry["file"] == "k1-1.refined1.json.gz"
    assert entry["sha256"] == hashlib.sha256((lib / entry["file"]).read_bytes()).hexdigest()
    assert (lib / "k1-1.ondemand1.json.gz").is_file()  # the plan the survivors ran before

    ref = reference(args[2:], 2, 4)
    iteration, params = checkpoint_params(run, 2)
    assert iteration == 9
    assert_params_equal(params, ref.params)
    assert_losses_equal(result.losses, ref.losses)


def test_a_run_without_a_library_plans_every_situation_when_first_met(tmp_path):
    """No library, a job spec: the fault-free plan is made at start, and the set left by a
    kill when it happens; both land in RUN_DIR/plans."""
    spec = tmp_path / "job.toml"
    spec.write_text('stages = 2\npipelines = 2\nmicrobatches = 4\n[time]\nforward = 1\n'
                    'backward_input = 1\nbackward_weight = 1\np2p = 0.1\n')
    args = ["--iterations", "6"]
    run = tmp_path / "run"
    result = launch(TINY, LaunchConfig(nproc=4, run_dir=str(run), spec=str(spec),
                                       refine="off", faults=[parse_fault("3:2:W0")]), args)
    assert result.status == "completed"
    assert [p["counts"] for p in _events(result, "planned")] == [[0, 0], [0, 1]]
    assert [g["plan"] for g in _events(result, "generation")] == [
        "k0-0.ondemand1.json.gz", "k0-1.ondemand1.json.gz"]
    lib = PlanLibrary.open(run / "plans")
    assert [(e.counts, e.made) for e in lib.entries()] == [((0, 0), "on-demand"),
                                                          ((0, 1), "on-demand")]
    ref = reference(args, 2, 4)
    _, params = checkpoint_params(run, 2)
    assert_params_equal(params, ref.params)
    assert_losses_equal(result.losses, ref.losses)


def test_a_run_without_a_library_gets_one_in_its_run_folder_checked_against_the_job(tmp_path):
    from recycle_planner.errors import RecycleError
    from recycle_planner.executor.control.agent import prepare_library

    spec = tmp_path / "job.toml"
    spec.write_text('stages = 2\npipelines = 2\nmicrobatches = 4\n[time]\nforward = 1\n'
                    'backward_input = 1\nbackward_weight = 1\n')
    config = prepare_library(LaunchConfig(nproc=4, run_dir=str(tmp_path / "run"),
                                          spec=str(spec)))
    assert config.library == str((tmp_path / "run" / "plans").resolve())
    assert PlanLibrary.open(config.library).entries() == []
    with pytest.raises(RecycleError, match="is for 2 pipelines x 2 stages = 4 workers, not 6"):
        prepare_library(LaunchConfig(nproc=6, run_dir=str(tmp_path / "run"), spec=str(spec)))
    other = tmp_path / "other.toml"
    other.write_text(spec.read_text().replace("microbatches = 4", "microbatches = 8"))
    with pytest.raises(RecycleError, match="built for another spec"):
        prepare_library(LaunchConfig(nproc=4, run_dir=str(tmp_path / "run"), spec=str(other),
                                     library=config.library))
    with pytest.raises(RecycleError, match="refine 'always' is not one of on-demand"):
        LaunchConfig(nproc=4, refine="always")
