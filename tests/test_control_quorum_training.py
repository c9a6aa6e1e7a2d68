"""etcd's members and a host lost under real training while the coordinators fail over (issue
22, item 3): a 3-member etcd and two `recycle-planner coordinator --rdzv-backend etcd` in the
coordinator's network namespace, one `recycle-planner launch --rdzv-backend etcd` per training
host (3 hosts x 2 workers, 3 pipelines of 2 stages, each a namespace joined by a veth pair).

One run, in turn: one etcd member SIGKILLed changes nothing (nobody is deposed); the leading
coordinator's wrapper SIGKILLed together with every process of host 2: the standby takes over
live from the two hosts that re-attach, and re-routes host 2's workers in generation 1; host
2 comes back rebooted and its workers re-join at an iteration boundary (generation 2); a
second etcd member SIGKILLed takes the quorum away: nobody can lead, the leader is deposed and
the host agents stop their workers with a checkpoint and leave. With etcd back, the same
commands with `--resume` (host 2 repaired) end the run with the fault-free parameters and
every iteration's loss once, and the standby coordinator leaves when the job is done."""

import json
import signal
import time
from pathlib import Path

import pytest

from recycle_planner.executor.control.etcd_local import EtcdCluster
from recycle_planner.executor.control.runfolder import read_losses

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

from helpers.etcd_training import CLI, WHY, tails, wait_all  # noqa: E402
from helpers.etcd_training import env as _env  # noqa: E402
from helpers.executor_checks import (TINY, assert_losses_equal,  # noqa: E402
                                     assert_params_equal, checkpoint_params, library, reference)
from helpers.netns import COORD_ADDR, IP, Hosts  # noqa: E402

pytestmark = [pytestmark, pytest.mark.skipif(WHY is not None, reason=f"{WHY}")]

ITERATIONS = 36


def _start(net: Hosts, etcd: EtcdCluster, run: Path, lib: Path, logs: dict, *extra: str):
    """Two campaigning coordinators and one host agent per host; `extra`: for both."""
    n = str(len(net.hosts))
    coords = [net.popen(net.coord, [
        *CLI, "coordinator", "--nnodes", n, "--nproc-per-node", "2", "--port", str(29400 + i),
        "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints, "--rdzv-id", "train",
        "--advertise", COORD_ADDR, "--run-dir", str(run), "--lease", "3", "--heartbeat", "0.1",
        "--checkpoint-every", "2", *extra], open(logs[f"c{i}"], "ab"), env=_env())
        for i in range(2)]
    return coords, [_host(net, etcd, lib, logs, i) for i in range(len(net.hosts))]


def _host(net: Hosts, etcd: EtcdCluster, lib: Path, logs: dict, i: int):
    """Host `i`'s agent (the same command when the host comes back rebooted)."""
    return net.popen(net.hosts[i], [
        *CLI, "launch", "--nnodes", str(len(net.hosts)), "--nproc-per-node", "2",
        "--node-rank", str(i), "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints,
        "--rdzv-id", "train", "--rdzv-timeout", "60", TINY, "--", "--library", str(lib),
        "--iterations", str(ITERATIONS), "--data-delay", "0.25"], open(logs[f"h{i}"], "ab"),
        env=_env(GLOO_SOCKET_IFNAME="eth0"))


def _until(what, hosts, logs: dict, seconds: float = 240) -> None:
    """Until `what()`, the host agents running (a loaded machine starts workers slowly)."""
    deadline = time.time() + seconds
    while not what():
        assert time.time() < deadline and all(p.poll() is None for p in hosts), tails(logs)
        time.sleep(0.05)


def _leader(coords, logs) -> int:
    return next(i for i, c in enumerate(coords) if c.poll() is None
                and "coordinator for" in logs[f"c{i}"].read_text())


def test_etcd_members_and_a_host_lost_while_the_coordinators_fail_over(tmp_path):
    lib = library(tmp_path / "lib", stages=2, pipelines=3, microbatches=2, max_failures=2)
    ref = reference(["--iterations", str(ITERATIONS)], 3, 2)
    run = tmp_path / "run"
    logs = {name: tmp_path / f"{name}.log" for name in ("c0", "c1", "h0", "h1", "h2")}
    with Hosts(3) as net, EtcdCluster(3, host=COORD_ADDR, wrap=(IP, "netns", "exec", net.coord),
                                      folder=tmp_path / "etcd") as etcd:
        coords, hosts = _start(net, etcd, run, lib, logs)
        _until(lambda: 2 in read_losses(run), hosts, logs)
        etcd.kill(0)  # one member (the first endpoint every client tries) changes nothing
        _until(lambda: 4 in read_losses(run), hosts, logs)
        text = logs["c0"].read_text() + logs["c1"].read_text()
        assert "leads" in text and "lost its leadership" not in text
        first = _leader(coords, logs)
        coords[first].kill()  # the leader, and host 2 with it (every process of that host)
        net.signal(net.hosts[2], signal.SIGKILL)
        second = logs[f"c{1 - first}"]
        _until(lambda: "generation 1:" in second.read_text(), hosts[:2], logs)
        assert "took over generation 0" in second.read_text()
        assert "hosts [2] hold no lease on etcd (lost), not waited for" in second.read_text()
        # host 2 comes back rebooted: its workers count on from the incarnations the lost
        # coordinator had (not 0 again, the incarnation killed) and re-join at a boundary
        hosts[2] = _host(net, etcd, lib, logs, 2)
        _until(lambda: "generation 2:" in second.read_text(), hosts, logs)
        assert "generation 2: 6 live workers, dead none" in second.read_text()
        assert "worker 2:0 started again by its host agent (incarnation 1)" in second.read_text()
        gen2 = max(read_losses(run))
        _until(lambda: gen2 + 2 in read_losses(run), hosts, logs)
        etcd.kill(1)  # the quorum is lost: nobody can lead
        codes = wait_all(hosts + [coords[1 - first]], 180, logs)
        # the host agents cannot reach etcd (3); the leader was deposed (4)
        assert codes == [3, 3, 3, 4], (codes, tails(logs))
        assert all("workers stopped (exit status {" in logs[h].read_text()
                   for h in ("h0", "h1", "h2"))
        stopped_at, _ = checkpoint_params(run, 2)
        assert gen2 <= stopped_at < ITERATIONS, (gen2, stopped_at)

        etcd.start(0)
        etcd.start(1)
        etcd.wait_ready(60)
        before = {i: logs[f"c{i}"].stat().st_size for i in (0, 1)}
        coords, hosts = _start(net, etcd, run, lib, logs, "--resume")  # host 2 repaired
        codes = wait_all(hosts, 240, logs)
        assert codes == [0, 0, 0], (codes, tails(logs))
        codes = [c.wait(60) for c in coords]
        said = [logs[f"c{i}"].read_bytes()[before[i]:].decode(errors="replace") for i in (0, 1)]
        if 4 in codes:  # a loaded machine let etcd expire the leader's lease (3 s) mid-run:
            deposed = codes.index(4)  # deposed, and the standby took over and completed
            assert codes[1 - deposed] == 0 and "lost its leadership" in said[deposed], said
            assert " leads; " in said[1 - deposed], said
        else:  # the leader completed; its standby left with the same status, not taking over
            assert codes == [0, 0] and "standing down" in "".join(said), (codes, said)
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "completed" and result["iterations"] == ITERATIONS
    assert sorted(read_losses(run)) == list(range(ITERATIONS))
    _, params = checkpoint_params(run, 2)
    assert_params_equal(params, ref.params)
    assert_losses_equal(result["losses"], ref.losses)
