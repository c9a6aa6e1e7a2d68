"""The library's compact storage: per-worker action strings with times recomputed on load,
the format versions it reads, and the entries a run adds (on demand, refined)."""

import gzip
import hashlib
import json

import numpy as np
import pytest

from recycle_planner.errors import PlanFileError
from recycle_planner.files.planfile import plan_to_dict, read_plan, write_plan
from recycle_planner.io import write_json
from recycle_planner.job.policy import Policy
from recycle_planner.job.situations import logical_failed, packed
from recycle_planner.library import PlanLibrary, Settings, build_library
from recycle_planner.library.entries import LibraryEntry
from recycle_planner.library.lookup import MissingPlan
from recycle_planner.library.ondemand import plan_on_demand
from recycle_planner.planner import plan_situation
from recycle_planner.timing.validate import validate

from conftest import make_spec


@pytest.fixture(scope="module")
def plan():
    return plan_situation(make_spec(stages=4, pipelines=4, microbatches=8, p2p=0.1), Policy(),
                          [(1, 0), (2, 3)])


def test_compact_round_trip_recomputes_the_same_times(plan, tmp_path):
    write_plan(plan, tmp_path / "p.json.gz", compact=True)
    data = json.loads(gzip.decompress((tmp_path / "p.json.gz").read_bytes()))
    assert data["version"] == 4 and set(data["workers"][0]) == {"pipeline", "stage", "actions"}
    # worker 0:0 runs pipeline 1's re-routed micro-batches (p1) next to its own
    assert "p1" in " ".join(w["actions"] for w in data["workers"] if w["stage"] == 0)
    assert data["workers"][0]["actions"].endswith(" A O")
    back = read_plan(tmp_path / "p.json.gz")
    assert all(np.array_equal(a, b) for a, b in zip(back.schedule.orders, plan.schedule.orders))
    assert np.array_equal(back.timing.start, plan.timing.start, equal_nan=True)
    assert np.array_equal(back.timing.end, plan.timing.end, equal_nan=True)
    assert back.metrics == plan.metrics and validate(back) == []


def test_compact_is_far_smaller_than_timed(tmp_path):
    big = plan_situation(make_spec(stages=8, pipelines=8, microbatches=32), Policy(), [(3, 5)],
                         "heuristic")
    timed = len(write_plan(big, tmp_path / "t.json.gz"))
    compact = len(write_plan(big, tmp_path / "c.json.gz", compact=True))
    assert compact * 10 < timed


@pytest.mark.parametrize("mutate, message", [
    (lambda w: w[0].update(actions=w[0]["actions"].replace("F1", "X1", 1)),
     r"workers\[0\]: action [0-9]+ 'X1' is not one"),
    (lambda w: w[0].update(actions=w[0]["actions"].replace("F1", "F99", 1)),
     r"'F99' is outside the job \(4 pipelines, 8 micro-batches\)"),
    (lambda w: w[0].update(actions=w[0]["actions"].replace(" A O", " O A")), "deadlocks"),
    (lambda w: w[5].update(actions=w[5]["actions"].replace("F2 ", "F2 F2 ", 1)),
     "more than once"),
    (lambda w: w[0].pop("actions"), "'actions' must be a string"),
])
def test_an_edited_compact_file_is_refused_in_one_line(plan, tmp_path, mutate, message):
    data = plan_to_dict(plan, compact=True)
    mutate(data["workers"])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=message) as err:
        read_plan(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_compact_file_whose_period_is_not_its_actions_is_refused(plan, tmp_path):
    data = plan_to_dict(plan, compact=True)
    data["metrics"]["period"] *= 0.9
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match="edited or damaged"):
        read_plan(tmp_path / "p.json")


@pytest.fixture
def small_library(tmp_path):
    spec = make_spec(stages=3, pipelines=3, microbatches=4)
    folder = tmp_path / "lib"
    build_library(spec, Policy(), 1, folder, Settings(solver="heuristic"), jobs=1)
    return spec, folder


def test_a_version_1_library_is_still_read(small_library):
    """An index of version 1 with timed plan files (what earlier releases wrote)."""
    spec, folder = small_library
    index = json.loads((folder / "index.json").read_text())
    for entry in index["entries"]:
        old = plan_to_dict(read_plan(folder / entry["file"]))
        old["version"] = 1  # a timed plan file as earlier releases wrote it: ops without chunks
        for worker in old["workers"]:
            for op in worker["ops"]:
                op.pop("chunk")
        entry["sha256"] = hashlib.sha256(write_json(folder / entry["file"], old)).hexdigest()
        entry.pop("made")
    index["version"] = 1
    (folder / "index.json").write_text(json.dumps(index))
    assert json.loads(gzip.decompress((folder / "k0-1-0.json.gz").read_bytes()))["version"] == 1
    lib = PlanLibrary.open(folder)
    hit = lib.lookup([(2, 1)])
    assert hit.entry.made is None and validate(hit.plan()) == []


def test_a_future_library_version_is_refused_in_one_line(small_library):
    _, folder = small_library
    index = json.loads((folder / "index.json").read_text())
    index["version"] = 4
    (folder / "index.json").write_text(json.dumps(index))
    with pytest.raises(PlanFileError, match="library version 4 is not supported .this "
                                            "recycle-planner reads versions 1, 2, 3.: rebuild"):
        PlanLibrary.open(folder)


def test_entries_are_typed_and_say_who_made_them(small_library):
    _, folder = small_library
    entries = PlanLibrary.open(folder).entries()
    assert entries and all(isinstance(e, LibraryEntry) and e.made == "plan-all" for e in entries)
    assert entries[0].counts == (0, 0, 0) and entries[0].period == entries[0].metrics.period


def test_a_plan_added_on_demand_is_found_by_another_reader_and_kept_by_plan_all(small_library):
    spec, folder = small_library
    lib = PlanLibrary.open(folder)
    reader = PlanLibrary.open(folder)  # a worker's copy, opened before the addition
    with pytest.raises(MissingPlan, match="beyond this library's threshold of 1") as err:
        lib.lookup([(0, 0), (1, 1)])
    assert err.value.counts == (1, 1, 0)
    plan, placement = plan_on_demand(spec, Policy(), (1, 1, 0), lib.fault_free_period, 1.0)
    entry = lib.add(plan, placement, "on-demand", "x")
    assert entry.file == "k1-1-0.ondemand1.json.gz" and entry.made == "on-demand"
    assert entry.sha256 == hashlib.sha256((folder / entry.file).read_bytes()).hexdigest()
    hit = reader.lookup([(0, 0), (1, 1)])  # reads the index again
    assert hit.entry == entry and validate(hit.plan()) == []
    # a refined plan replaces it; a generation decided before still finds the one it runs
    better, where = plan_on_demand(spec, Policy(), (1, 1, 0), lib.fault_free_period, 10.0)
    refined = lib.add(better, where, "refined")
    assert refined.file == "k1-1-0.refined1.json.gz"
    assert reader.lookup([(1, 1), (0, 0)]).entry == refined
    assert reader.lookup([(1, 1), (0, 0)], entry.file).entry == entry
    with pytest.raises(PlanFileError, match="no plan file k0-1-0.json.gz for per-stage"):
        reader.lookup([(1, 1), (0, 0)], "k0-1-0.json.gz")
    entry = refined
    # a plan-all rebuild keeps what runs added beyond its threshold
    build_library(spec, Policy(), 1, folder, Settings(solver="heuristic"), jobs=1)
    assert PlanLibrary.open(folder).entry((1, 1, 0)) == entry
    assert (folder / entry.file).is_file()


def test_a_run_without_a_library_starts_from_an_empty_one(tmp_path):
    spec = make_spec(stages=2, pipelines=2, microbatches=4)
    lib = PlanLibrary.create(tmp_path / "plans", spec)
    assert lib.entries() == []
    with pytest.raises(MissingPlan):
        lib.lookup([])
    with pytest.raises(PlanFileError, match="no fault-free plan yet"):
        lib.fault_free_period
    plan, placement = plan_on_demand(spec, Policy(), (0, 0), None, 1.0)
    lib.add(plan, placement, "on-demand")
    assert lib.fault_free_period == plan.metrics.period
    again = PlanLibrary.create(tmp_path / "plans", spec)  # a resumed run keeps its plans
    assert [e.counts for e in again.entries()] == [(0, 0)]
    assert logical_failed(packed((0, 0))) == ()


def test_on_demand_planning_spends_its_budget_only_where_the_heuristic_fits():
    spec = make_spec(stages=2, pipelines=2, microbatches=4, p2p=0.1)
    quick, where = plan_on_demand(spec, Policy(), (1, 1), None, 0.0)
    assert where == ((0, 1),) and quick.failed == ((0, 0), (0, 1))
    assert quick.solver["detail"] == "template order"
    assert not quick.solver["on_demand"]["whole_heuristic"]
    full, _ = plan_on_demand(spec, Policy(), (1, 1), None, 10.0)
    assert full.solver["on_demand"]["whole_heuristic"]
    assert full.metrics.period < quick.metrics.period
    assert full.metrics.fault_free_period == quick.metrics.fault_free_period > 0
    assert validate(full) == [] and validate(quick) == []


def test_which_plans_a_run_refines():
    from recycle_planner.library.ondemand import wants_refinement
    from recycle_planner.timing.metrics import Metrics

    def entry(made, solver, optimal=False):
        metrics = Metrics(iteration_time=1.0, period=1.0, fault_free_period=1.0,
                          degradation=0.0, lower_bound=1.0, optimal=optimal)
        return LibraryEntry([0, 1], "k.json.gz", [[1]], metrics, solver={"name": solver},
                            made=made)

    assert wants_refinement(entry("on-demand", "heuristic"), "on-demand")
    assert not wants_refinement(entry("on-demand", "heuristic", optimal=True), "on-demand")
    assert not wants_refinement(entry("plan-all", "heuristic"), "on-demand")
    assert wants_refinement(entry("plan-all", "heuristic"), "heuristic")
    assert not wants_refinement(entry("plan-all", "auto"), "heuristic")
    assert not wants_refinement(entry("on-demand", "heuristic"), "off")


def test_a_refined_entry_is_plan_alls_own(tmp_path):
    """The background refinement plans as plan-all does, so plan-all keeps what it stored."""
    from recycle_planner.library.ondemand import REFINE_BUDGET, refine, refine_settings_hash

    spec = make_spec(stages=2, pipelines=2, microbatches=2, p2p=0.1)
    folder = tmp_path / "plans"
    lib = PlanLibrary.create(folder, spec)
    plan, where = plan_on_demand(spec, Policy(), (0, 0), None, 0.0)
    lib.add(plan, where, "on-demand")
    plan, where = refine(spec, Policy(), (1, 0), lib.fault_free_period)
    entry = lib.add(plan, where, "refined", refine_settings_hash())
    assert refine_settings_hash(REFINE_BUDGET) == Settings().hash
    build_library(spec, Policy(), 1, folder, jobs=1)
    assert PlanLibrary.open(folder).entry((1, 0)) == entry  # kept, not planned again
    assert PlanLibrary.open(folder).entry((0, 0)).made == "plan-all"  # replanned
