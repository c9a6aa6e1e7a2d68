"""Issue 25: one writer per library folder, one typed index, and a report that does not call a
damaged library complete."""

import json
import signal
import subprocess
import sys

import pytest

from conftest import EXAMPLES, make_spec
from helpers.cli import one_line_error, run
from recycle_planner.errors import RecycleError
from recycle_planner.job.policy import Policy
from recycle_planner.library import LibraryBusy, PlanLibrary, Settings, build_library
from recycle_planner.library.entries import ON_DEMAND
from recycle_planner.library.ondemand import plan_on_demand

SMALL = str(EXAMPLES / "small.toml")
HOLD = """
import sys, time
from recycle_planner.library import library_lock
with library_lock(sys.argv[1], "plan-all"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_second_writer_is_refused_and_a_crashed_writers_lock_is_taken_over(tmp_path):
    lib = tmp_path / "lib"
    assert run("plan-all", SMALL, "-f", "1", "-o", lib, "--solver", "heuristic").exit_code == 0
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lib)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        r = run("plan-all", SMALL, "-f", "2", "-o", lib, "--solver", "heuristic")
        one_line_error(r, f"{lib}: the plan library is being written by plan-all",
                       f"pid {holder.pid}")
        opened = PlanLibrary.open(lib)  # readers do not wait for writers
        assert opened.lookup([(0, 1)]).plan().failed == ((0, 1),)
        plan, placement = plan_on_demand(opened.spec, opened.policy, (0, 1, 1, 0),
                                         opened.reference_period)
        with pytest.raises(LibraryBusy, match="being written by plan-all"):
            opened.add(plan, placement, ON_DEMAND)
    finally:
        holder.send_signal(signal.SIGKILL)  # a writer that crashes keeps no lock
        holder.wait(timeout=30)
    r = run("plan-all", SMALL, "-f", "2", "-o", lib, "--solver", "heuristic")
    assert r.exit_code == 0, r.output
    assert f"the previous writer, plan-all (pid {holder.pid}" in r.stderr
    assert "ended without releasing the lock" in r.stderr
    assert not (lib / ".lock").exists()
    assert "INCOMPLETE" not in r.output


def test_additions_by_two_writers_in_turn_are_both_kept_and_complete_follows(tmp_path):
    """The index has one read/write path: `add` reads it again under the lock (a stale view
    loses nothing) and `complete` is derived from the entries, never left behind."""
    spec = make_spec(stages=2, pipelines=2, microbatches=4)
    first = PlanLibrary.create(tmp_path, spec)
    second = PlanLibrary.open(tmp_path)
    assert not json.loads((tmp_path / "index.json").read_text())["complete"]
    zero, _ = plan_on_demand(spec, Policy(), (0, 0), None)
    first.add(zero, (), ON_DEMAND)
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["complete"] and index["fault_free_period"] == zero.metrics.period
    one, placement = plan_on_demand(spec, Policy(), (1, 0), zero.metrics.period)
    second.add(one, placement, ON_DEMAND)  # opened before the first addition
    lib = PlanLibrary.open(tmp_path)
    assert {e.counts for e in lib.entries()} == {(0, 0), (1, 0)}
    assert lib.lookup([(1, 0)]).plan().failed == ((0, 0),)
    assert lib.problems() == []


def test_report_says_a_library_with_a_missing_plan_file_is_incomplete(tmp_path):
    lib = tmp_path / "lib"
    build_library(make_spec(stages=2, pipelines=2, microbatches=4), Policy(), 1, lib,
                  Settings(solver="heuristic"), jobs=1)
    assert "INCOMPLETE" not in run("report", lib).output
    (lib / "k0-1.json.gz").unlink()
    r = run("report", lib)
    assert r.exit_code == 0 and "INCOMPLETE: 1 problem, first plan file k0-1.json.gz missing" \
        in r.output
    data = json.loads(run("report", lib, "--json").output)
    assert data["complete"] is False and data["problems"] == ["plan file k0-1.json.gz missing"]


def test_a_plan_all_that_fails_leaves_no_folder_behind(tmp_path, monkeypatch):
    import recycle_planner.library.build as build

    def broken(args):
        raise RecycleError("the solver gave up")

    monkeypatch.setattr(build, "build_entry", broken)
    r = run("plan-all", SMALL, "-f", "1", "-o", tmp_path / "new" / "lib")
    one_line_error(r, "the solver gave up")
    assert list(tmp_path.iterdir()) == []
