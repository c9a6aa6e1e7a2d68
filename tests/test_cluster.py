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

WHY = unavailable()
if WHY is not None:
    print(f"tests/test_cluster.py skipped: {WHY}", file=sys.stderr)
pytestmark = [pytestmark, pytest.mark.skipif(WHY is not None, reason=f"no hosts: {WHY}")]

PORT = "29400"
LEASE = "2"
ITERATIONS = 8
CLI = [sys.executable, "-m", "recycle_planner.cli"]


def _coordinator(net: Hosts, run: Path, log, *extra: str):
    return net.popen(net.coord, [*CLI, "coordinator", "--nnodes", "2", "--nproc-per-node", "2",
                                 "--port", PORT, "--run-dir", str(run), "--lease", LEASE,
                                 "--heartbeat", "0.1", *extra], log, env=_env())


def _agents(net: Hosts, lib: Path, log) -> list[subprocess.Popen]:
    env = _env(GLOO_SOCKET_IFNAME="eth0")
    return [net.popen(ns, [*CLI, "launch", "--nnodes", "2", "--nproc-per-node", "2",
                           "--node-rank", str(i), "--rdzv-endpoint", f"{COORD_ADDR}:{PORT}",
                           TINY, "--", "--library", str(lib), "--iterations", str(ITERATIONS)],
                      log, env=env)
            for i, ns in enumerate(net.hosts)]


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
        deadline = time.time() + 180
        while not (run / "checkpoints" / "iter-000002" / "manifest.json").is_file():
            assert time.time() < deadline and coord.poll() is None, out.read_text()[-4000:]
            time.sleep(0.05)
        coord.kill()
        codes = [_wait(a, 60, "a host agent", out) for a in agents]
    text = out.read_text(errors="replace")
    assert codes == [5, 5], text[-4000:]
    assert "lost the coordinator" in text
    iteration, _ = checkpoint_params(run, 2)
    assert 2 <= iteration <= ITERATIONS

    out2 = tmp_path / "out2.log"
    with open(out2, "wb") as log, Hosts(2) as net:
        coord = _coordinator(net, run, log, "--resume")
        _agents(net, lib, log)
        assert _wait(coord, 240, "the resumed coordinator", out2) == 0, out2.read_text()
    result = json.loads((run / "result.json").read_text())
    assert [e["restart"] for e in result["events"] if e["kind"] == "generation"] == [iteration]
    _, params = checkpoint_params(run, 2)
    assert_params_equal(params, ref.params)
    assert_losses_equal(result["losses"][iteration:], ref.losses[iteration:])
