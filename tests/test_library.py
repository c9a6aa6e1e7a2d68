import json
import math
import os
from itertools import combinations

import pytest
from click.testing import CliRunner

from recycle_planner.cli.main import main
from recycle_planner.errors import FailureSetError, PlanFileError, RecycleError
from recycle_planner.files.planfile import read_plan
from recycle_planner.job.policy import Policy
from recycle_planner.job.situations import (counts_of, failure_sets, logical_failed, map_failure,
                                            packed, placements, situations)
from recycle_planner.library import PlanLibrary, Settings, build_library
from recycle_planner.library import placement as placement_module
from recycle_planner.solvers import portfolio
from recycle_planner.timing.validate import validate
from recycle_planner.views.report import library_text, plot_library

from conftest import make_spec, with_changes

SETTINGS = Settings(solver="heuristic")


def test_situation_counts_from_the_issue():
    assert len(situations(make_spec(stages=8, pipelines=8, microbatches=16), 3)) == 165
    assert len(situations(make_spec(stages=16, pipelines=64, microbatches=64), 2)) == 153
    # Each stage keeps a live worker: with 2 pipelines a stage loses at most one.
    assert all(max(k) <= 1 for k in situations(make_spec(stages=3, pipelines=2), 3))
    spec = make_spec(stages=3, pipelines=3)
    total = sum(failure_sets(spec, k) for k in situations(spec, 2))
    raw = sum(1 for n in range(3) for c in combinations(range(9), n)
              if all(sum(1 for w in c if w % 3 == s) < 3 for s in range(3)))
    assert total == raw


def test_placements_line_up_holes():
    options = placements((1, 1, 1, 0), pipelines=4)
    assert options[0] == ((0, 1, 2),) and options[1] == ((0,), (1,), (2,))
    assert len(options) == len(set(options)) == 5
    for p in options:
        assert counts_of(p, 4) == (1, 1, 1, 0)
        assert all(len(set(g)) == len(g) for g in p)
    assert all(len(p) <= 2 for p in placements((1, 1, 1, 0), pipelines=2))
    assert packed((2, 0, 1)) == ((0, 2), (0,))
    assert logical_failed(((0, 2), (0,))) == ((0, 0), (0, 2), (1, 0))


@pytest.mark.parametrize("dead, placement", [
    ([(3, 1), (3, 2)], ((1, 2),)),
    ([(3, 1), (2, 2)], ((1, 2),)),
    ([(3, 1), (3, 2)], ((1,), (2,))),
    ([(0, 0), (1, 0), (2, 3)], ((0, 3), (0,))),
])
def test_mapping_sends_dead_workers_to_the_holes(dead, placement):
    spec = make_spec(stages=4, pipelines=4)
    mapping = map_failure(spec, dead, placement)
    holes = set(logical_failed(placement))
    assert {mapping.to_logical(w) for w in dead} == holes
    for s, row in enumerate(mapping.logical_of_physical):
        assert sorted(row) == list(range(4))
        for d in range(4):
            assert mapping.to_physical(mapping.to_logical((d, s))) == (d, s)
    moved = sum(row[d] != d for row in mapping.logical_of_physical for d in range(4))
    assert moved <= 2 * len(dead)


def test_mapping_keeps_a_dead_pipeline_together():
    spec = make_spec(stages=4, pipelines=4)
    m = map_failure(spec, [(3, 1), (3, 2)], ((1, 2),))
    assert m.to_logical((3, 1)) == (0, 1) and m.to_logical((3, 2)) == (0, 2)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lib")
    spec = make_spec(stages=3, pipelines=3, microbatches=4, p2p=0.1, allreduce=0.5)
    calls = []
    build_library(spec, Policy(), 2, folder, SETTINGS, jobs=2,
                  progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (len(situations(spec, 2)),) * 2
    return spec, folder


def test_index_format(library):
    spec, folder = library
    index = json.loads((folder / "index.json").read_text())
    assert index["format"] == "recycle-plan-library" and index["version"] == 3
    assert index["max_failures"] == 2 and index["complete"]
    assert len(index["entries"]) == len(situations(spec, 2))
    for entry in index["entries"]:
        assert {"failed_per_stage", "file", "metrics", "solver", "gap", "placement"} <= set(entry)
        assert (folder / entry["file"]).is_file()
        assert entry["metrics"]["period"] >= entry["metrics"]["lower_bound"] - 1e-9


def test_every_physical_failure_set_finds_a_valid_plan(library):
    spec, folder = library
    lib = PlanLibrary.open(folder)
    workers = [(d, s) for d in range(3) for s in range(3)]
    checked = 0
    for n in range(3):
        for dead in combinations(workers, n):
            if any(sum(1 for _, s in dead if s == t) == 3 for t in range(3)):
                continue
            hit = lib.lookup(dead)
            plan = hit.plan()
            assert {hit.mapping.to_logical(w) for w in dead} == set(plan.failed)
            assert sum(hit.failed_per_stage) == n
            checked += 1
    assert checked == 1 + 9 + 36 and validate(lib.lookup([(2, 1), (0, 2)]).plan()) == []


def test_rebuild_is_resumable_and_deterministic(library, tmp_path):
    spec, folder = library
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    calls = []
    build_library(spec, Policy(), 2, folder, SETTINGS, progress=lambda d, t: calls.append(d))
    assert calls[0] == calls[-1]  # nothing left to plan
    assert all(folder.joinpath(n).stat().st_mtime_ns == t for n, t in before.items()
               if n != "index.json")
    victim = sorted(p for p in folder.iterdir() if p.name.startswith("k1"))[0]
    victim.unlink()
    build_library(spec, Policy(), 2, folder, SETTINGS)
    assert victim.exists()
    other = tmp_path / "again"
    build_library(spec, Policy(), 2, other, SETTINGS, jobs=1)
    for p in folder.iterdir():
        if p.name != "index.json":
            assert p.read_bytes() == (other / p.name).read_bytes(), p.name
    a = json.loads((folder / "index.json").read_text())["entries"]
    b = json.loads((other / "index.json").read_text())["entries"]
    assert a == b


def test_changed_settings_make_entries_stale(library, tmp_path):
    spec, folder = library
    small = tmp_path / "s"
    build_library(spec, Policy(), 1, small, SETTINGS)
    calls = []
    build_library(spec, Policy(), 1, small, Settings(solver="heuristic", max_placements=2),
                  progress=lambda d, t: calls.append(d))
    assert calls[0] == 0


def test_lookup_errors(library):
    spec, folder = library
    lib = PlanLibrary.open(folder)
    with pytest.raises(FailureSetError, match="listed twice"):
        lib.lookup([(1, 1), (1, 1)])
    with pytest.raises(FailureSetError, match="outside the grid"):
        lib.lookup([(3, 0)])
    with pytest.raises(FailureSetError, match="beyond this library's threshold of 2"):
        lib.lookup([(0, 0), (1, 1), (2, 2)])
    with pytest.raises(FailureSetError, match="every worker of stage 0 is dead"):
        lib.lookup([(0, 0), (1, 0), (2, 0)])
    with pytest.raises(RecycleError, match="built for another spec"):
        PlanLibrary.open(folder, spec=with_changes(spec, forward=2))


def test_bad_thresholds_and_foreign_libraries(library, tmp_path):
    spec, folder = library
    with pytest.raises(RecycleError, match="cannot survive 1 failure"):
        build_library(make_spec(pipelines=1), Policy(), 1, tmp_path / "a", SETTINGS)
    with pytest.raises(RecycleError, match="at most 6 workers can die"):
        build_library(spec, Policy(), 7, tmp_path / "b", SETTINGS)
    with pytest.raises(RecycleError, match="holds a library for another spec"):
        build_library(with_changes(spec, forward=2), Policy(), 1, folder, SETTINGS)


def test_corrupted_index(tmp_path):
    spec = make_spec(stages=2, pipelines=2, microbatches=2)
    build_library(spec, Policy(), 1, tmp_path, SETTINGS)
    text = (tmp_path / "index.json").read_text()
    (tmp_path / "index.json").write_text(text[: len(text) // 2])
    with pytest.raises(PlanFileError, match="not a library index file"):
        PlanLibrary.open(tmp_path)
    with pytest.raises(PlanFileError, match="pass --force"):
        build_library(spec, Policy(), 1, tmp_path, SETTINGS)
    build_library(spec, Policy(), 1, tmp_path, SETTINGS, force=True)
    data = json.loads((tmp_path / "index.json").read_text())
    data["entries"][1]["file"] = "../../etc/passwd"
    (tmp_path / "index.json").write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match="must be a file in the folder"):
        PlanLibrary.open(tmp_path)
    with pytest.raises(PlanFileError, match="no plan library here"):
        PlanLibrary.open(tmp_path / "nowhere")


def test_damaged_plan_files_and_edited_indexes_are_caught(tmp_path):
    """A launcher must never run a missing, damaged or swapped plan; plan-all redoes them."""
    spec = make_spec(stages=3, pipelines=2, microbatches=4)
    build_library(spec, Policy(), 1, tmp_path, SETTINGS)
    files = {s: tmp_path / f"k{'-'.join('1' if t == s else '0' for t in range(3))}.json.gz"
             for s in range(3)}
    lib = PlanLibrary.open(tmp_path)
    assert lib.lookup([(1, 0)]).plan().failed == ((0, 0),)
    original = files[0].read_bytes()
    files[0].write_bytes(files[1].read_bytes())  # another situation's plan under this name
    with pytest.raises(PlanFileError, match="has changed since the library was built"):
        lib.lookup([(1, 0)])
    files[0].write_bytes(original[:100])  # truncated
    with pytest.raises(PlanFileError, match="has changed since the library was built"):
        lib.lookup([(0, 0)])
    files[2].unlink()
    with pytest.raises(PlanFileError, match=r"plan file for \[0, 0, 1\] is missing"):
        lib.lookup([(0, 2)])
    calls = []
    build_library(spec, Policy(), 1, tmp_path, SETTINGS, progress=lambda d, t: calls.append(d))
    assert calls[0] == 2  # the fault-free plan and stage 1's are intact; two are redone
    lib = PlanLibrary.open(tmp_path)
    assert lib.lookup([(1, 0)]).plan().failed == ((0, 0),)
    assert lib.lookup([(0, 2)]).plan().failed == ((0, 2),)
    # A file replaced after the lookup is still caught when it is read.
    hit = lib.lookup([(1, 0)])
    files[0].write_bytes(files[1].read_bytes())
    with pytest.raises(PlanFileError, match="not the library entry's"):
        hit.plan()

    index = json.loads((tmp_path / "index.json").read_text())
    edited = json.loads(json.dumps(index))
    edited["spec"]["microbatches"] = 16
    (tmp_path / "index.json").write_text(json.dumps(edited))
    with pytest.raises(PlanFileError, match="do not match its spec_hash"):
        PlanLibrary.open(tmp_path)
    for bad, message in (([[7]], "distinct stages below 3"), ([[1]], "does not hold")):
        edited = json.loads(json.dumps(index))
        edited["entries"][1]["placement"] = bad
        (tmp_path / "index.json").write_text(json.dumps(edited))
        with pytest.raises(PlanFileError, match=message):
            PlanLibrary.open(tmp_path)


def test_report_and_plot(library, tmp_path):
    _, folder = library
    lib = PlanLibrary.open(folder)
    text = library_text(lib)
    assert "failures" in text and "mean gap" in text
    plot_library(lib, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_plan_all_lookup_report(tmp_path):
    from conftest import EXAMPLES

    runner = CliRunner()
    r = runner.invoke(main, ["plan-all", str(EXAMPLES / "small.toml"), "-f", "1", "-o",
                             str(tmp_path / "lib"), "--jobs", "1", "--solver", "heuristic"])
    assert r.exit_code == 0, r.output
    assert "fault-free period" in r.output
    r = runner.invoke(main, ["lookup", str(tmp_path / "lib"), "--failed", "1:2", "--json"])
    assert r.exit_code == 0, r.output
    hit = json.loads(r.stdout)
    assert {"file", "failed_per_stage", "mapping"} <= set(hit)
    assert hit["failed_per_stage"] == [0, 0, 1, 0]
    assert read_plan(hit["file"]).failed == ((0, 2),)
    assert hit["mapping"]["logical_of_physical"][2] == [1, 0]
    r = runner.invoke(main, ["lookup", str(tmp_path / "lib"), "--failed", "1:2", "--failed", "0:1"])
    assert r.exit_code == 2 and "beyond this library's threshold" in r.output
    r = runner.invoke(main, ["report", str(tmp_path / "lib"), "-o", str(tmp_path / "d.svg")])
    assert r.exit_code == 0 and (tmp_path / "d.svg").exists()
    r = runner.invoke(main, ["plan-all", str(EXAMPLES / "small.toml"), "-f", "5", "-o",
                             str(tmp_path / "lib2")])
    assert r.exit_code == 2 and "cannot survive 5 failures" in r.output


def _boom(x: int) -> int:
    if x == 3:
        raise ValueError("situation 3 failed")
    return x


def _die(x: int) -> int:
    if x == 2:
        os._exit(9)  # as the out-of-memory killer or a crash in C would
    return x


class _Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("not picklable")


def _unpicklable(x: int) -> int:
    raise _Unpicklable(f"situation {x} failed")


def test_planning_pool_stops_its_workers_on_an_error():
    import multiprocessing

    from recycle_planner.library.pool import WorkerDied
    from recycle_planner.library.pool import planning_pool as _planning_pool
    with pytest.raises(ValueError, match="situation 3 failed"):
        with _planning_pool(2) as run:
            assert list(run(_boom, [0, 1, 2, 3, 4])) == [0, 1, 2]
    assert multiprocessing.active_children() == []
    with pytest.raises(WorkerDied, match="exit code 9 on task 2"):
        with _planning_pool(2) as run:
            list(run(_die, [0, 1, 2, 3]))
    assert multiprocessing.active_children() == []
    with pytest.raises(RuntimeError, match="_Unpicklable: situation 0 failed"):
        with _planning_pool(2) as run:
            list(run(_unpicklable, [0]))
    with _planning_pool(3) as run:  # answers come back in task order
        assert list(run(abs, range(-30, 0))) == list(range(30, 0, -1))
    assert multiprocessing.active_children() == []
    with _planning_pool(1) as run:
        assert list(run(_boom, [0, 1])) == [0, 1]


POOL_ERRORS = """
import multiprocessing, threading
from recycle_planner.library.pool import planning_pool
def _boom(x):
    if x == 3:
        raise ValueError("situation 3 failed")
    return x
threading.Thread(target=lambda: [sum(range(1000)) for _ in iter(int, 1)], daemon=True).start()
for _ in range(100):
    try:
        with planning_pool(2) as run:
            list(run(_boom, [0, 1, 2, 3, 4]))
    except ValueError:
        pass
    assert multiprocessing.active_children() == []
print("stopped 100 pools")
"""


def test_planning_pools_stopped_by_errors_never_hang():
    """multiprocessing.Pool's terminate() hung here about once in a few hundred (a worker
    held its task queue's lock); 100 pools stopped by an error, a busy thread beside them."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", POOL_ERRORS], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "stopped 100 pools" in out.stdout, out.stderr[-2000:]


def test_sigterm_to_plan_all_leaves_no_worker_and_no_partial_file(tmp_path):
    """A supervisor stopping `plan-all` must not leave planning processes writing on."""
    import os
    import signal
    import subprocess
    import sys
    import time

    spec = tmp_path / "job.toml"
    spec.write_text("stages = 8\npipelines = 8\nmicrobatches = 16\n[time]\nforward = 1\n"
                    "backward_input = 1\nbackward_weight = 1\np2p = 0.1\nallreduce = 1\noptimizer = 0.5\n")
    out = tmp_path / "lib"
    proc = subprocess.Popen([sys.executable, "-c", "from recycle_planner.cli.main import main; "
                             "main()", "plan-all", str(spec), "-f", "3", "-o", str(out), "-j", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (out / "index.json").exists() and proc.poll() is None:
        assert time.monotonic() < deadline, "plan-all never wrote its index"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode in (0, 130), err  # 0 if it happened to finish first
    time.sleep(0.5)
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if str(out).encode() in cmd:
            alive.append(pid)
    assert alive == []
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    PlanLibrary.open(out)  # the index is whole


def test_a_plan_left_with_a_gap_is_compared_with_the_other_placements_improved(monkeypatch):
    """The screening ranks placements by their fast plans before the improvement; the
    improvement shortens the other placement of this situation more (to its bound)."""
    spec = make_spec(stages=4, pipelines=4, microbatches=8, backward_input=1.1,
                     backward_weight=0.9, p2p=0.05, allreduce=4, optimizer=0.6)
    settings = Settings(solver="auto", work_limit=0.2, time_limit=1, node_limit=1)
    # This step alone: the critical-path swaps (the last step of `auto`) take the chosen
    # placement's plan to 41.9, within the 1% that calls for the other placements.
    monkeypatch.setattr(portfolio, "SWAP_ABOVE_GAP", math.inf)
    plan, chosen = placement_module.plan_best_placement(spec, Policy(), (1, 0, 0, 1), settings,
                                                        None)
    assert chosen == ((0, 3),)
    assert plan.metrics.period == pytest.approx(41.8) and plan.metrics.optimal
    assert validate(plan) == []
    monkeypatch.setattr(placement_module, "RETRY_ABOVE_GAP", math.inf)  # as before
    plan, chosen = placement_module.plan_best_placement(spec, Policy(), (1, 0, 0, 1), settings,
                                                        None)
    assert chosen == ((0,), (3,)) and plan.metrics.period == pytest.approx(42.6)
