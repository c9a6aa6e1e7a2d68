"""Coordinators that fail over with real training: a 3-member etcd and three `recycle-planner
coordinator --rdzv-backend etcd` in the coordinator's network namespace, one `recycle-planner
launch --rdzv-backend etcd` per training host (each a namespace joined by a veth pair).

The first leader is SIGKILLed (its wrapper: its coordinator dies with it) before any generation
is decided: nothing runs to take over, so the host agents stop their workers, the next leader
(`--take-over`) finds every host come back fresh and starts the run as a new attempt. That
leader is SIGKILLed mid-run, between checkpoints: the third takes over live, the host agents
re-attach with their workers running (same processes, no checkpoint round trip), a worker
killed at iteration 8 (while the coordinators change, or just after: the timing decides which,
and both must end well) is re-routed by the new leader in a generation whose groups form in its
store, and training ends with the parameters and every loss of the fault-free run. The control
traffic between the host agents and the coordinators runs on the etcd (`transport.EtcdHost`,
`EtcdCoordinator`): the takeover moves none of it, the c10d stores serve the process groups."""

import json
import os
import signal
import subprocess
import time

import pytest

from recycle_planner.executor.control.etcd_local import EtcdCluster
from recycle_planner.executor.control.runfolder import read_losses

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

from helpers.executor_checks import (TINY, assert_losses_equal,  # noqa: E402
                                     assert_params_equal, checkpoint_params, library, reference)
from helpers.etcd_training import CLI, WHY, wait_all  # noqa: E402
from helpers.etcd_training import env as _env  # noqa: E402
from helpers.netns import COORD_ADDR, IP, Hosts  # noqa: E402
from helpers.procs import children  # noqa: E402

pytestmark = [pytestmark, pytest.mark.skipif(WHY is not None, reason=f"{WHY}")]

ITERATIONS = 12


def test_the_leading_coordinator_killed_mid_run_the_standby_takes_over_live(tmp_path):
    lib = library(tmp_path / "lib", stages=2, pipelines=2, microbatches=4, max_failures=2)
    ref = reference(["--iterations", str(ITERATIONS)], 2, 4)
    run = tmp_path / "run"
    logs = {name: tmp_path / f"{name}.log" for name in ("c0", "c1", "c2", "h0", "h1")}
    with Hosts(2) as net, EtcdCluster(3, host=COORD_ADDR, wrap=(IP, "netns", "exec", net.coord),
                                      folder=tmp_path / "etcd") as etcd:
        wrappers = {}
        for i in range(3):
            port = str(29400 + i)
            wrappers[f"c{i}"] = net.popen(net.coord, [
                *CLI, "coordinator", "--nnodes", "2", "--nproc-per-node", "2", "--port", port,
                "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints, "--rdzv-id",
                "train", "--advertise", COORD_ADDR, "--run-dir", str(run), "--lease", "2",
                "--heartbeat", "0.1", "--checkpoint-every", "5", "--inject-fault", "3:8:F0"],
                open(logs[f"c{i}"], "wb"),
                env=_env())
        # a slow data loader (0.1 s a micro-batch): training runs on while the coordinators
        # change (the losses do not depend on it)
        followers = [net.popen(ns, [
            *CLI, "launch", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(i),
            "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints, "--rdzv-id", "train",
            "--rdzv-timeout", "120", TINY, "--", "--library", str(lib),
            "--iterations", str(ITERATIONS), "--data-delay", "0.1"], open(logs[f"h{i}"], "wb"),
            env=_env(GLOO_SOCKET_IFNAME="eth0")) for i, ns in enumerate(net.hosts)]

        def text(name):
            return logs[name].read_text(errors="replace")

        def leader():
            return next(n for n in wrappers if wrappers[n].poll() is None
                        and "coordinator for" in text(n))

        deadline = time.time() + 300  # a loaded machine: the first workers start slowly
        while not all(f"host {h} (" in "".join(text(n) for n in wrappers) for h in (0, 1)):
            assert time.time() < deadline, "".join(text(n)[-2000:] for n in logs)
            time.sleep(0.02)
        first = leader()  # both hosts are there, their workers still starting
        os.kill(wrappers[first].pid, signal.SIGKILL)
        while 2 not in read_losses(run):  # mid-run, between the checkpoints of 0 and 5
            assert time.time() < deadline, "".join(text(n)[-2000:] for n in logs)
            time.sleep(0.05)
        second = leader()
        os.kill(wrappers[second].pid, signal.SIGKILL)
        codes = wait_all(followers, 480, logs)
        assert codes == [0, 0], "".join(text(n)[-3000:] for n in logs)
        third = next(n for n in wrappers if n not in (first, second))
        assert wrappers[third].wait(60) == 0, text(third)[-3000:]
    for host in ("h0", "h1"):  # stopped once (nothing ran yet), then re-attached
        assert text(host).count("before any generation ran here") == 1, text(host)
        assert text(host).count("re-attached") == 1, text(host)
    workers = sorted(str(p.relative_to(run / "logs")) for p in (run / "logs").rglob("rank*.log"))
    assert workers == [f"attempt-{a}/rank{r}.0.log" for a in (1, 2) for r in range(4)], workers
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "completed" and result["iterations"] == ITERATIONS
    assert result["attempt"] == 3  # the third coordinator's, which took over
    assert None not in result["iteration_end"]  # those before the take-over from losses.jsonl
    assert "took over generation 0" in text(third)
    assert "no host agent runs a generation" in text(second)
    generations = [(e["gen"], e["dead"]) for e in result["events"] if e["kind"] == "generation"]
    assert generations == [(1, [[1, 1]])], result["events"]  # only the re-routing
    assert sorted(read_losses(run)) == list(range(ITERATIONS))
    _, params = checkpoint_params(run, 2)
    assert_params_equal(params, ref.params)
    assert_losses_equal(result["losses"], ref.losses)


def test_the_leaders_link_cut_mid_run_the_standby_takes_over_live(tmp_path):
    """Each coordinator in a namespace of its own. First the leading coordinator's process is
    stopped (SIGSTOP) for two and a half leases while its wrapper keeps its etcd lease: the
    host agents lose it, find on etcd that it still leads and re-attach to it; continued, it
    counts the workers' silence from then, and training goes on in the same generation. Then
    the leader's link is set down mid-run (nothing is closed: its store calls hang, as with a
    host that vanished). The host agents notice within the lease (their loops never wait on
    the store), follow the standby that leads once the cut leader's etcd lease ran out, and
    re-attach with the same workers; the cut leader, deposed, has its coordinator killed (its
    link, set up again once the hosts re-attached, changes nothing); the run ends with every
    loss once and the fault-free parameters."""
    iterations = 3 * ITERATIONS
    lib = library(tmp_path / "lib", stages=2, pipelines=2, microbatches=4, max_failures=2)
    ref = reference(["--iterations", str(iterations)], 2, 4)
    run = tmp_path / "run"
    logs = {name: tmp_path / f"{name}.log" for name in ("c0", "c1", "h0", "h1")}
    with Hosts(4) as net, EtcdCluster(3, host=COORD_ADDR, wrap=(IP, "netns", "exec", net.coord),
                                      folder=tmp_path / "etcd") as etcd:
        wrappers = {f"c{i}": net.popen(net.hosts[2 + i], [
            *CLI, "coordinator", "--nnodes", "2", "--nproc-per-node", "2", "--port", "29400",
            "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints, "--rdzv-id", "train",
            "--advertise", Hosts.address(2 + i), "--run-dir", str(run), "--lease", "2",
            "--heartbeat", "0.1", "--checkpoint-every", "5"], open(logs[f"c{i}"], "wb"),
            env=_env()) for i in range(2)}
        followers = [net.popen(net.hosts[i], [
            *CLI, "launch", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(i),
            "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints, "--rdzv-id", "train",
            "--rdzv-timeout", "120", TINY, "--", "--library", str(lib),
            "--iterations", str(iterations), "--data-delay", "0.1"], open(logs[f"h{i}"], "wb"),
            env=_env(GLOO_SOCKET_IFNAME="eth0")) for i in range(2)]

        def text(name):
            return logs[name].read_text(errors="replace")

        deadline = time.time() + 300  # a loaded machine: the first workers start slowly
        while 2 not in read_losses(run):  # mid-run, between the checkpoints of 0 and 5
            assert time.time() < deadline, "".join(text(n)[-2000:] for n in logs)
            time.sleep(0.05)
        first = next(n for n in wrappers if "coordinator for" in text(n))
        second = "c1" if first == "c0" else "c0"
        coordinator = children(wrappers[first].pid)
        for pid in coordinator:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(5.0)  # 2.5 leases: the hosts lose it, and find it still leads
        for pid in coordinator:
            os.kill(pid, signal.SIGCONT)
        while not all("still leads" in text(h) for h in ("h0", "h1")):
            assert time.time() < deadline, "".join(text(n)[-2000:] for n in logs)
            time.sleep(0.05)
        going = max(read_losses(run))
        while going + 1 not in read_losses(run):
            assert time.time() < deadline, "".join(text(n)[-2000:] for n in logs)
            time.sleep(0.05)
        assert "generation 1" not in text(first), text(first)[-3000:]
        veth = f"vh{2 + int(first[1])}"
        subprocess.run([IP, "-n", net.coord, "link", "set", veth, "down"], check=True)
        while not all(text(h).count("re-attached to the coordinator") == 2
                      for h in ("h0", "h1")):
            assert time.time() < deadline, "".join(text(n)[-2000:] for n in logs)
            time.sleep(0.05)
        # the link comes back: the hosts moved on, the deposed leader decides nothing
        subprocess.run([IP, "-n", net.coord, "link", "set", veth, "up"], check=True)
        codes = wait_all(followers, 480, logs)
        assert codes == [0, 0], "".join(text(n)[-3000:] for n in logs)
        assert wrappers[second].wait(60) == 0, text(second)[-3000:]
        assert wrappers[first].wait(60) != 0, text(first)[-3000:]  # deposed
    assert "lost its leadership" in text(first)
    for host in ("h0", "h1"):  # once to the stopped leader, once to the standby
        assert text(host).count("re-attached to the coordinator at") == 2, text(host)
        assert text(host).count(f"at {Hosts.address(2 + int(second[1]))}:29400 after") == 1
    workers = sorted(str(p.relative_to(run / "logs")) for p in (run / "logs").rglob("rank*.log"))
    assert workers == [f"attempt-1/rank{r}.0.log" for r in range(4)], workers  # the same ones
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "completed" and result["iterations"] == iterations
    assert "took over generation 0" in text(second)
    assert sorted(read_losses(run)) == list(range(iterations))
    _, params = checkpoint_params(run, 2)
    assert_params_equal(params, ref.params)
    assert_losses_equal(result["losses"], ref.losses)
