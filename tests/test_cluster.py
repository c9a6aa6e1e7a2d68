"""The executor across hosts: a coordinator and one host agent per host, each host a network
namespace joined to the others by a veth pair on a bridge (made and removed by the tests).

2 hosts x 2 workers, 2 stages x 2 pipelines (host h holds pipeline h), a library for two
failures (a whole host). Whole hosts are taken away mid-iteration by the workers' injected
faults: the link set down (nothing is ever closed), every process SIGSTOPped, agent and
workers SIGKILLed (including the host that started first), then the coordinator killed.
Every case ends with the fault-free run's parameters and losses, or a clean stop whose
checkpoint resumes to them. Machines where namespaces cannot be made skip these tests and
say why."""

from __future__ import annotations

import json
import os
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
from helpers.netns import COORD_ADDR, Hosts, unavailable  # noqa: E402
from helpers.procs import children  # noqa: E402

WHY = unavailable()
if WHY is not None:
    print(f"tests/test_cluster.py skipped: {WHY}", file=sys.stderr)
pytestmark = [pytestmark, pytest.mark.skipif(WHY is not None, reason=f"no hosts: {WHY}")]

PORT = "29400"
LEASE = "2"
ITERATIONS = 8
CLI = [sys.executable, "-m", "recycle_planner.cli"]


def _coordinator(net: Hosts, run: Path, log, *extra: str):
    return net.popen(net.coord, [*CLI, "coordinator", "--nnodes", str(len(net.hosts)),
                                 "--nproc-per-node", "2",
                                 "--port", PORT, "--run-dir", str(run), "--lease", LEASE,
                                 "--heartbeat", "0.1", *extra], log, env=_env())


def _agents(net: Hosts, lib: Path, log, *job: str, iterations: int = ITERATIONS,
            only: int | None = None) -> list[subprocess.Popen]:
    env = _env(GLOO_SOCKET_IFNAME="eth0")
    return [net.popen(ns, [*CLI, "launch", "--nnodes", str(len(net.hosts)), "--nproc-per-node",
                           "2", "--node-rank", str(i), "--rdzv-endpoint",
                           f"{COORD_ADDR}:{PORT}", TINY, "--", "--library", str(lib),
                           "--iterations", str(iterations), *job], log, env=env)
            for i, ns in enumerate(net.hosts) if only is None or i == only]


def _env(**more: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **more)
    return env


def _wait(proc: subprocess.Popen, seconds: float, what: str, log: Path) -> int:
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{what} did not end within {seconds} s:\n"
                             + log.read_text(errors="replace")[-4000:]) from None


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    lib = library(tmp_path_factory.mktemp("lib") / "lib", stages=2, pipelines=2,
                  microbatches=4, max_failures=2)
    return lib, reference(["--iterations", str(ITERATIONS)], 2, 4)


def _run_with_fault(tmp_path: Path, lib: Path, fault: str) -> dict:
    run = tmp_path / "run"
    out = tmp_path / "out.log"
    with open(out, "wb") as log, Hosts(2) as net:
        coord = _coordinator(net, run, log, "--inject-fault", fault)
        _agents(net, lib, log)
        code = _wait(coord, 240, "the coordinator", out)
    text = out.read_text(errors="replace")
    assert code == 0, text[-4000:]
    assert "exited with status 0" not in text  # a worker that finished is no news
    return json.loads((run / "result.json").read_text())


@pytest.mark.parametrize("fault, dead", [
    ("2:3:F1:host-down", [[1, 0], [1, 1]]),   # host 1's link goes down mid-forward
    ("2:3:I1:host-stop", [[1, 0], [1, 1]]),   # every process of host 1 stopped
    ("0:3:W0:host-kill", [[0, 0], [0, 1]]),   # host 0 (the first started) agent+workers killed
])
def test_a_host_vanishes_and_training_goes_on_exactly(tmp_path, fault_free, fault, dead):
    """The coordinator declares the host's workers dead when their lease (2 s) expires,
    aborts the survivors' groups (they are blocked on the vanished host: nothing ever
    arrives), re-routes the dead pipeline's micro-batches with the library's plan for the
    physical dead set, and training ends with the fault-free parameters and losses, well
    before any group timeout (60 s)."""
    lib, ref = fault_free
    result = _run_with_fault(tmp_path, lib, fault)
    gens = [e for e in result["events"] if e["kind"] == "generation"]
    assert [g["dead"] for g in gens] == [[], dead]
    assert result["status"] == "completed" and result["iterations"] == ITERATIONS
    recovery = result["recoveries"][0]
    assert recovery["seconds"] < 2 * float(LEASE) + 5
    _, params = checkpoint_params(tmp_path / "run", 2)
    assert_params_equal(params, ref.params)
    assert_losses_equal(result["losses"], ref.losses)


def test_the_coordinator_is_killed_workers_checkpoint_and_a_restart_resumes(tmp_path,
                                                                            fault_free):
    """SIGKILL of the coordinator after the periodic checkpoint of iteration 2: every worker
    notices within its lease, writes its stage's state (after its step count and after the
    one before), the host agents exit with status 5; a coordinator started again with
    --resume and new host agents finish the job with the fault-free parameters."""
    lib, ref = fault_free
    run = tmp_path / "run"
    out = tmp_path / "out.log"
    with open(out, "wb") as log, Hosts(2) as net:
        coord = _coordinator(net, run, log, "--checkpoint-every", "2")
        agents = _agents(net, lib, log)
        _until(lambda: (run / "checkpoints" / "iter-000002" / "manifest.json").is_file(), 180,
               out, [coord])
        coord.kill()
        codes = [_wait(a, 60, "a host agent", out) for a in agents]
    text = out.read_text(errors="replace")
    assert codes == [5, 5], text[-4000:]
    assert "lost the coordinator" in text
    iteration, _ = checkpoint_params(run, 2)
    assert 2 <= iteration <= ITERATIONS

    result = _resume(tmp_path, run, lib)
    assert [e["restart"] for e in result["events"] if e["kind"] == "generation"] == [iteration]
    _, params = checkpoint_params(run, 2)
    assert_params_equal(params, ref.params)
    assert_losses_equal(result["losses"][iteration:], ref.losses[iteration:])


def _resume(tmp_path: Path, run: Path, lib: Path) -> dict:
    """A new coordinator with --resume and new host agents finish the run; its result."""
    out = tmp_path / "out2.log"
    with open(out, "wb") as log, Hosts(2) as net:
        coord = _coordinator(net, run, log, "--resume")
        _agents(net, lib, log)
        assert _wait(coord, 240, "the resumed coordinator", out) == 0, out.read_text()
    return json.loads((run / "result.json").read_text())


# -- drills with 3 hosts x 2 workers (2 stages x 3 pipelines; host h holds pipeline h) ----------

DRILL_ITERATIONS = 16


@pytest.fixture(scope="module")
def three_pipelines(tmp_path_factory):
    lib = library(tmp_path_factory.mktemp("lib3") / "lib", stages=2, pipelines=3,
                  microbatches=2, max_failures=2)
    return lib, reference(["--iterations", str(DRILL_ITERATIONS)], 3, 2)


def _until(what, seconds: float, log: Path, procs=()) -> None:
    deadline = time.time() + seconds
    while not what():
        assert time.time() < deadline, log.read_text(errors="replace")[-4000:]
        for p in procs:
            assert p.poll() is None, log.read_text(errors="replace")[-4000:]
        time.sleep(0.05)


def _worker_log(run: Path, rank: int, incarnation: int = 0) -> Path:
    return run / "logs" / "attempt-1" / f"rank{rank}.{incarnation}.log"


def test_a_returning_hosts_stale_workers_are_fenced(tmp_path, three_pipelines):
    """Every process of host 2 is stopped mid-forward (SIGSTOP: nothing is closed); its lease
    expires and the job goes on without pipeline 2. Then the host comes back (every process
    continued): worker 2:1, blocked on its peers when it was stopped, reads the next decision
    through its host agent, which excludes it, and leaves without acting on it (fenced)
    before its host agent carries out the coordinator's kill notice (a lease later). Before
    the fence, such a worker ran it ("4 is not in list" in comm.py, taken for a bug in user
    code) and the healthy job stopped. A slow data loader (0.2 s a micro-batch) keeps training
    going meanwhile; it ends with the fault-free parameters and losses. (A short group
    timeout, only as a backstop.)"""
    import signal

    lib, ref = three_pipelines
    run, out = tmp_path / "run", tmp_path / "out.log"
    with open(out, "wb") as log, Hosts(3) as net:
        coord = _coordinator(net, run, log, "--inject-fault", "4:3:F1:host-stop",
                             "--pg-timeout", "5")
        agents = _agents(net, lib, log, "--data-delay", "0.2", iterations=DRILL_ITERATIONS)
        _until(lambda: "generation 1:" in out.read_text(errors="replace"), 180, out, [coord])
        for pid in children(agents[2].pid):
            os.kill(pid, signal.SIGCONT)
        os.kill(agents[2].pid, signal.SIGCONT)
        # rank 4 fired the fault (its thread never trains again: it leaves as stalled);
        # rank 5 was blocked on its peers
        _until(lambda: "excludes this worker" in _worker_log(run, 5).read_text(), 120, out,
               [coord])
        code = _wait(coord, 240, "the coordinator", out)
    text = out.read_text(errors="replace")
    assert code == 0 and "user code" not in text, text[-4000:]
    result = json.loads((run / "result.json").read_text())
    gens = [g["dead"] for g in result["events"] if g["kind"] == "generation"]
    assert gens == [[], [[2, 0], [2, 1]]] and "rank 5 was fenced" in text
    _, params = checkpoint_params(run, 2)
    assert_params_equal(params, ref.params)
    assert_losses_equal(result["losses"], ref.losses)


def _exited(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie too: its parent may be stopped)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_stopped_host_agents_workers_leave_within_the_lease(tmp_path, three_pipelines):
    """Only host 2's agent is stopped (SIGSTOP), its workers run on: the coordinator hears no
    report from the host for its lease and re-routes around it; the workers hear no beat from
    their agent for the lease and leave (status 8) without writing anything, instead of
    training on without control, blocked on their peers or not. Before, they kept running
    until their agent came back. The agent, continued once the job went on, reaps them,
    hears the job's end and leaves with status 0; the job ends with the fault-free
    parameters and losses. (A slow data loader, 0.2 s a micro-batch, keeps training going
    for longer than the lease after the stop.)"""
    import signal

    lib, ref = three_pipelines
    run, out = tmp_path / "run", tmp_path / "out.log"
    losses = run / "losses.jsonl"
    with open(out, "wb") as log, Hosts(3) as net:
        coord = _coordinator(net, run, log)
        agents = _agents(net, lib, log, "--data-delay", "0.2", iterations=DRILL_ITERATIONS)
        _until(lambda: losses.is_file() and losses.read_text(), 180, out, [coord])
        workers = children(agents[2].pid)
        assert len(workers) == 2
        os.kill(agents[2].pid, signal.SIGSTOP)
        t0 = time.time()
        try:
            _until(lambda: all(_exited(p) for p in workers), float(LEASE) + 8, out, [coord])
            took = time.time() - t0
            _until(lambda: "generation 1:" in out.read_text(errors="replace"), 60, out, [coord])
        finally:
            os.kill(agents[2].pid, signal.SIGCONT)
        code = _wait(coord, 240, "the coordinator", out)
        codes = [_wait(a, 60, "a host agent", out) for a in agents]
    text = out.read_text(errors="replace")
    assert code == 0 and codes == [0, 0, 0], text[-4000:]
    assert took < float(LEASE) + 4, took
    for rank in (4, 5):
        assert "lost its host agent" in _worker_log(run, rank).read_text()
    assert "worker rank 4 lost its host agent" in text
    result = json.loads((run / "result.json").read_text())
    gens = [g["dead"] for g in result["events"] if g["kind"] == "generation"]
    assert gens == [[], [[2, 0], [2, 1]]]
    _, params = checkpoint_params(run, 2)
    assert_params_equal(params, ref.params)
    assert_losses_equal(result["losses"], ref.losses)


def test_a_rebooted_host_rejoins_at_an_iteration_boundary(tmp_path, three_pipelines):
    """Host 2's agent and workers are SIGKILLed mid-backward (a host that reboots); its lease
    expires and the job goes on. A host agent started again there with the same --node-rank
    gives its workers new incarnations (counted in the coordinator's store), so it meets no
    stale kill notice: they say hello, the members stop at an iteration boundary (one or two
    re-joins, as the newcomers are ready), the newcomers copy their stages' state from
    peers, and the job ends on all three pipelines with the fault-free parameters and
    losses. (Training holds at iterations 8 and 12 while a worker is dead, so that the
    re-joins surely come before the end.) Today the new agent spawned incarnation 0 again
    and killed its workers at once."""
    lib, ref = three_pipelines
    run, out = tmp_path / "run", tmp_path / "out.log"
    with open(out, "wb") as log, Hosts(3) as net:
        coord = _coordinator(net, run, log, "--inject-fault", "4:3:I0:host-kill",
                             "--inject-fault", "0:8:hold", "--inject-fault", "0:12:hold")
        _agents(net, lib, log, iterations=DRILL_ITERATIONS)
        _until(lambda: "generation 1:" in out.read_text(errors="replace"), 180, out, [coord])
        _agents(net, lib, log, iterations=DRILL_ITERATIONS, only=2)
        code = _wait(coord, 240, "the coordinator", out)
    text = out.read_text(errors="replace")
    assert code == 0, text[-4000:]
    result = json.loads((run / "result.json").read_text())
    gens = [g for g in result["events"] if g["kind"] == "generation"]
    assert [g["dead"] for g in gens[:2]] == [[], [[2, 0], [2, 1]]] and gens[-1]["dead"] == []
    assert sorted(r for g in gens[2:] for r in g["joined"]) == [4, 5]
    _, params = checkpoint_params(run, 2)
    assert_params_equal(params, ref.params)
    assert_losses_equal(result["losses"], ref.losses)


def test_a_coordinator_cut_off_is_noticed_within_the_lease(tmp_path, fault_free):
    """The coordinator's address vanishes after the checkpoint of iteration 2 (nothing is
    closed: every store call of the workers and host agents just blocks, until TCP's own
    give-up after about 15 minutes, which is what happened before). Every worker notices
    within its lease that no heartbeat gets through, writes its stage's state, and the host
    agents leave with status 5; a new coordinator with --resume and new agents finish the job
    with the fault-free parameters and every iteration's loss."""
    lib, ref = fault_free
    run, out = tmp_path / "run", tmp_path / "out.log"
    with open(out, "wb") as log, Hosts(2) as net:
        coord = _coordinator(net, run, log, "--checkpoint-every", "2")
        agents = _agents(net, lib, log, "--data-delay", "0.05")
        _until(lambda: (run / "checkpoints" / "iter-000002" / "manifest.json").is_file(), 180,
               out, [coord])
        subprocess.run(["ip", "-n", net.coord, "addr", "del", f"{COORD_ADDR}/24", "dev", "br0"],
                       check=True)
        t0 = time.time()
        codes = [_wait(a, 90, "a host agent", out) for a in agents]
        took = time.time() - t0
    text = out.read_text(errors="replace")
    assert codes == [5, 5] and "lost the coordinator" in text, text[-4000:]
    assert took < 6 * float(LEASE) + 10, took
    iteration, _ = checkpoint_params(run, 2)
    assert 2 <= iteration <= ITERATIONS

    result = _resume(tmp_path, run, lib)
    _, params = checkpoint_params(run, 2)
    assert_params_equal(params, ref.params)
    assert_losses_equal(result["losses"], ref.losses)
