"""etcd's members lost under real training (issue 22, item 3): a 3-member etcd and two
`recycle-planner coordinator --rdzv-backend etcd` in the coordinator's network namespace, one
`recycle-planner launch --rdzv-backend etcd` per training host (each a namespace joined by a
veth pair). One etcd member is SIGKILLed mid-run, which changes nothing; then a second, and
the quorum is lost: nobody can lead, so the leader steps down (its coordinator dies with its
leadership), the standby cannot take over, and the host agents stop their workers with a
checkpoint and leave. etcd comes back, the coordinators
and host agents are started again with `--resume`, and the run ends with the fault-free
parameters and every iteration's loss, no iteration trained twice into the result."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recycle_planner.executor.control.etcd_local import EtcdCluster, etcd_missing
from recycle_planner.executor.control.runfolder import read_losses

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

from helpers.executor_checks import (TINY, assert_losses_equal,  # noqa: E402
                                     assert_params_equal, checkpoint_params, library, reference)
from helpers.netns import COORD_ADDR, IP, Hosts, unavailable  # noqa: E402

WHY = unavailable() or etcd_missing()
pytestmark = [pytestmark, pytest.mark.skipif(WHY is not None, reason=f"{WHY}")]

ITERATIONS = 18
CLI = [sys.executable, "-m", "recycle_planner.cli"]
ROOT = Path(__file__).resolve().parent.parent


def _env(**more: str) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **more)


def _start(net: Hosts, etcd: EtcdCluster, run: Path, lib: Path, logs: dict, *extra: str):
    """Two campaigning coordinators and one host agent per host; `extra`: for both."""
    coords = [net.popen(net.coord, [
        *CLI, "coordinator", "--nnodes", "2", "--nproc-per-node", "2", "--port", str(29400 + i),
        "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints, "--rdzv-id", "train",
        "--advertise", COORD_ADDR, "--run-dir", str(run), "--lease", "3", "--heartbeat", "0.1",
        "--checkpoint-every", "2", *extra], open(logs[f"c{i}"], "ab"), env=_env())
        for i in range(2)]
    hosts = [net.popen(ns, [
        *CLI, "launch", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(i),
        "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints, "--rdzv-id", "train",
        "--rdzv-timeout", "60", TINY, "--", "--library", str(lib), "--iterations",
        str(ITERATIONS), "--data-delay", "0.25"], open(logs[f"h{i}"], "ab"),
        env=_env(GLOO_SOCKET_IFNAME="eth0")) for i, ns in enumerate(net.hosts)]
    return coords, hosts


def _until(what, hosts, logs: dict, seconds: float = 240) -> None:
    """Until `what()`, the host agents running (a loaded machine starts workers slowly)."""
    deadline = time.time() + seconds
    while not what():
        assert time.time() < deadline and all(p.poll() is None for p in hosts), _tails(logs)
        time.sleep(0.05)


def _wait_all(procs, seconds: float, logs: dict) -> list[int]:
    deadline = time.time() + seconds
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(1.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            raise AssertionError(_tails(logs)) from None
    return codes


def _tails(logs: dict) -> str:
    return "".join(f"\n== {n}\n" + p.read_text(errors="replace")[-2500:]
                   for n, p in logs.items() if p.exists())


def test_one_etcd_member_lost_changes_nothing_the_quorum_lost_stops_and_resume_continues(
        tmp_path):
    lib = library(tmp_path / "lib", stages=2, pipelines=2, microbatches=4, max_failures=2)
    ref = reference(["--iterations", str(ITERATIONS)], 2, 4)
    run = tmp_path / "run"
    logs = {name: tmp_path / f"{name}.log" for name in ("c0", "c1", "h0", "h1")}
    with Hosts(2) as net, EtcdCluster(3, host=COORD_ADDR, wrap=(IP, "netns", "exec", net.coord),
                                      folder=tmp_path / "etcd") as etcd:
        coords, hosts = _start(net, etcd, run, lib, logs)
        _until(lambda: 2 in read_losses(run), hosts, logs)
        etcd.kill(0)  # one member (the first endpoint every client tries) changes nothing
        _until(lambda: 5 in read_losses(run), hosts, logs)
        assert "leads" in logs["c0"].read_text() + logs["c1"].read_text()
        assert "lost its leadership" not in logs["c0"].read_text() + logs["c1"].read_text()
        etcd.kill(1)  # mid-run, past the checkpoint of iteration 4: the quorum is lost
        codes = _wait_all(hosts + coords, 180, logs)
        # the host agents and the standby cannot reach etcd (3); the leader was deposed (4)
        assert codes[:2] == [3, 3] and sorted(codes[2:]) == [3, 4], (codes, _tails(logs))
        assert all("workers stopped (exit status {" in logs[h].read_text() for h in ("h0", "h1"))
        stopped_at, _ = checkpoint_params(run, 2)
        assert 2 <= stopped_at < ITERATIONS, stopped_at

        etcd.start(0)
        etcd.start(1)
        etcd.wait_ready(60)
        coords, hosts = _start(net, etcd, run, lib, logs, "--resume")
        codes = _wait_all(hosts, 240, logs)
        assert codes == [0, 0], (codes, _tails(logs))
        # the leader completed; its standby left with the same status, not taking over
        assert [c.wait(60) for c in coords] == [0, 0], _tails(logs)
        assert "standing down" in logs["c0"].read_text() + logs["c1"].read_text()
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "completed" and result["iterations"] == ITERATIONS
    assert sorted(read_losses(run)) == list(range(ITERATIONS))
    _, params = checkpoint_params(run, 2)
    assert_params_equal(params, ref.params)
    assert_losses_equal(result["losses"], ref.losses)
