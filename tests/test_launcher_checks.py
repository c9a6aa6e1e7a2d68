"""The launcher's checks before any process starts, and a run folder that belongs to one run.

Each misuse is one line and exit status 2 at once, before a worker (or the store) starts: a
port already in use, a worker count the library does not fit, a job that names no library or
a missing one, `--resume` with nothing to resume, a library another writer holds, a folder
holding another run's checkpoints; a host agent whose coordinator is not there says so and
gives up after --rdzv-timeout. One real run checks that `--start-over` trains anew into a
reused folder, with the fault-free run's parameters and losses, and that the result names it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

from helpers.executor_checks import (TINY, assert_losses_equal,  # noqa: E402
                                     assert_params_equal, checkpoint_params, library, reference)
from helpers.procs import children  # noqa: E402

CLI = [sys.executable, "-m", "recycle_planner.cli"]


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> Path:
    return library(tmp_path_factory.mktemp("lib") / "lib", stages=2, pipelines=2,
                   microbatches=2, max_failures=1)


def _cli(*args: str, timeout: float = 120) -> tuple[int, str, float]:
    t0 = time.monotonic()
    done = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    return done.returncode, done.stderr, time.monotonic() - t0


def _one_line(code: int, err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture
def busy_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_port_in_use_is_one_line(tmp_path, lib, busy_port):
    code, err, _ = _cli("launch", "-n", "4", "--master-port", busy_port, "--run-dir",
                        tmp_path / "run", TINY, "--", "--library", lib)
    _one_line(code, err, f"127.0.0.1:{busy_port}", "in use", "--master-port")
    code, err, _ = _cli("coordinator", "--nnodes", "2", "--nproc-per-node", "2", "--port",
                        busy_port, "--library", lib, "--run-dir", tmp_path / "run2")
    _one_line(code, err, "in use", "--port")


@pytest.mark.parametrize("case", ["wrong -n", "no library", "missing library", "resume"])
def test_what_can_be_checked_before_start_is_checked_first(tmp_path, lib, case):
    """Today's launcher started four workers and reported these after their start-up (10-19
    s); now no process starts and no folder is touched (the resume case claims the folder
    only)."""
    run = tmp_path / "run"
    args = {"wrong -n": ["-n", "3", TINY, "--", "--library", lib],
            "no library": ["-n", "4", TINY],
            "missing library": ["-n", "4", TINY, "--", "--library", tmp_path / "nowhere"],
            "resume": ["-n", "4", "--resume", TINY, "--", "--library", lib]}[case]
    words = {"wrong -n": ["2 pipelines x 2 stages = 4 workers, not 3"],
             "no library": ["names no plan library"],
             "missing library": ["no plan library here"],
             "resume": ["--resume: no complete checkpoint"]}[case]
    code, err, _ = _cli("launch", "--run-dir", run, *args)
    _one_line(code, err, *words)
    assert not (run / "logs").exists()


def test_a_library_being_written_refuses_the_run(tmp_path, lib):
    """The run holds the library's lock for its life (it adds the plans it makes on demand):
    a plan-all writing it now means one line, not a failed on-demand plan mid-run."""
    from recycle_planner.library import library_lock

    with library_lock(lib, "plan-all"):
        code, err, _ = _cli("launch", "-n", "4", "--run-dir", tmp_path / "run", TINY, "--",
                            "--library", lib)
    _one_line(code, err, "being written by plan-all")


def test_a_folder_with_another_runs_checkpoints_is_refused(tmp_path, lib):
    run = tmp_path / "run"
    (run / "checkpoints" / "iter-000030").mkdir(parents=True)
    code, err, _ = _cli("launch", "-n", "4", "--run-dir", run, TINY, "--", "--library", lib)
    _one_line(code, err, "iter-000030", "--resume", "--start-over")
    assert (run / "checkpoints" / "iter-000030").is_dir()  # nothing dropped


def test_a_host_agent_without_its_coordinator_gives_up_in_one_line(tmp_path, busy_port):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # closed again: nothing listens there
    done = subprocess.run([*CLI, "launch", "--nnodes", "2", "--nproc-per-node", "2",
                           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "3", TINY],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "waiting for the coordinator at" in done.stdout, done.stdout
    _one_line(done.returncode, done.stderr, "no coordinator at", "after 3 s")


def test_start_over_trains_anew_and_the_result_names_its_run(tmp_path, lib):
    """A first run (another learning rate) leaves its checkpoints; a second run of another
    length into the same folder is refused, then with --start-over trains exactly as if the
    folder were new (today the old iter-000003 checkpoint was taken as the new run's)."""
    from recycle_planner.executor import LaunchConfig, launch
    from recycle_planner.errors import RecycleError

    run = tmp_path / "run"
    first = launch(TINY, LaunchConfig(nproc=4, run_dir=str(run)),
                   ["--library", str(lib), "--iterations", "3", "--lr", "0.05"])
    args = ["--library", str(lib), "--iterations", "3"]
    with pytest.raises(RecycleError, match="--start-over"):
        launch(TINY, LaunchConfig(nproc=4, run_dir=str(run)), args)
    second = launch(TINY, LaunchConfig(nproc=4, run_dir=str(run), start_over=True), args)
    assert second.run_id and second.run_id != first.run_id
    saved = json.loads((run / "result.json").read_text())
    assert saved["run_id"] == second.run_id and saved["version"] == 3
    gen0 = saved["generations"][0]
    assert gen0["iterations"] == 3 and gen0["measured_ms"] > 0 and gen0["replayed_ms"] > 0
    assert (run / "logs" / "attempt-1").is_dir() and (run / "logs" / "attempt-2").is_dir()
    ref = reference(args, 2, 2)
    _, params = checkpoint_params(run, 2)
    assert_params_equal(params, ref.params)
    assert_losses_equal(second.losses, ref.losses)


def test_the_summary_shows_predicted_replayed_and_measured_side_by_side():
    from recycle_planner.cli.executor import result_summary
    from recycle_planner.executor.control.result import GenerationRecord, LaunchResult

    gens = [GenerationRecord(0, (), "k0-0.json.gz", 1.27, 0.0, 10, 17.0, 15.5),
            GenerationRecord(1, ((1, 0),), "k1-0.json.gz", 1.31, 0.035, 20, 20.4, 18.0)]
    result = LaunchResult("completed", "trained 30 iterations", 30, [1.0] * 30,
                          [0.017 * i for i in range(30)], [], [], None, "run",
                          generations=gens)
    text = result_summary(result)
    assert "generation 0    dead none: period predicted 1.27 ms, replayed 15.5 ms, measured " \
           "17 ms" in text
    assert "dead 1:0: period predicted 1.31 ms, replayed 18 ms, measured 20.4 ms; " \
           "degradation predicted +3.5%, measured +20.0%" in text


def test_sigterm_stops_with_a_checkpoint_that_resumes_with_every_loss(tmp_path, lib):
    """SIGTERM to every process of the job (what SLURM and Kubernetes send at preemption):
    the launcher abandons the generation, every worker undoes a half-finished iteration, the
    stage's first worker writes a consistent checkpoint, and all leave within --grace; a
    --resume continues to the fault-free parameters, and its result holds every iteration's
    loss (those before the checkpoint from the first attempt), the first attempt's logs kept.
    Today everything died within 0.1 s with no checkpoint."""
    import signal

    from recycle_planner.executor import LaunchConfig, launch

    run = tmp_path / "run"
    args = ["--library", str(lib), "--iterations", "14", "--data-delay", "0.02"]
    out = tmp_path / "out.log"
    with open(out, "wb") as log:
        proc = subprocess.Popen([*CLI, "launch", "-n", "4", "--run-dir", str(run), "--grace",
                                 "20", TINY, "--", *args], stdout=log, stderr=subprocess.STDOUT,
                                cwd=ROOT)
    try:
        deadline = time.monotonic() + 180
        losses = run / "losses.jsonl"
        while not (losses.is_file() and len(losses.read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline and proc.poll() is None, out.read_text()
            time.sleep(0.02)
        t0 = time.monotonic()
        for pid in [proc.pid, *children(proc.pid)]:
            os.kill(pid, signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.read_text()
    assert code == 2 and "preempted (SIGTERM)" in text, text
    assert time.monotonic() - t0 < 20
    iteration, _ = checkpoint_params(run, 2)
    assert 3 <= iteration < 14, text
    resumed = launch(TINY, LaunchConfig(nproc=4, run_dir=str(run), resume=True), args)
    ref = reference(args, 2, 2)
    _, params = checkpoint_params(run, 2)
    assert_params_equal(params, ref.params)
    assert_losses_equal(resumed.losses, ref.losses)
    assert resumed.attempt == 2 and (run / "logs" / "attempt-1" / "rank0.0.log").is_file()
    assert (run / "logs" / "attempt-2" / "rank0.0.log").is_file()


def test_a_coordinator_taking_over_waits_for_the_deposed_one_to_leave_the_folder(tmp_path):
    """A deposed coordinator whose link was cut holds the run folder until its watchdog
    kills it: the one taking over waits for the folder (bounded), where a new run is refused
    at once."""
    from recycle_planner.errors import RecycleError
    from recycle_planner.executor.control.runfolder import claim

    run = tmp_path / "run"
    claim(run, False, False).release()  # the run being taken over
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from recycle_planner.executor.control.runfolder import claim; "
        "claim(sys.argv[1], False, False, take_over=True); print('held', flush=True); "
        "time.sleep(1.0)"), str(run)], stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RecycleError, match="in use by another run"):
            claim(run, False, False, take_over=True)
        folder = claim(run, False, False, take_over=True, wait=30)
        assert holder.poll() is not None and folder.record.attempt == 3
        folder.release()
    finally:
        holder.kill()
        holder.wait()
