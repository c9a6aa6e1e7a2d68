"""Coordinators that fail over, as real processes on a real 3-member etcd started here on
loopback ports: the leader SIGKILLed, the leader cut off (SIGSTOP: it can renew nothing, as
with its link down) and come back deposed, a host lost while the coordinators fail over, one
etcd member killed, and etcd's quorum lost. Host agents are in-process stand-ins
(`plane.HostMember`) that report step counts. Skipped with the reason when etcd is absent."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from recycle_planner.executor.control.election import Election
from recycle_planner.executor.control.etcd_local import EtcdCluster, etcd_binary
from recycle_planner.executor.control.failover import STORE_UNAVAILABLE
from recycle_planner.executor.control.plane import HostMember, HostRecord, Keys, wait_for
from recycle_planner.executor.control.store import EtcdStore
from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.library import Settings, build_library

ROOT = Path(__file__).resolve().parent.parent
PIPELINES, STAGES, PER_HOST, LEASE = 3, 2, 2, 2.0

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason=(
    "etcd is not installed (make test installs Debian's etcd-server where it runs as root)"))


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lib")
    spec = JobSpec.from_dict({"stages": STAGES, "pipelines": PIPELINES, "microbatches": 4,
                              "time": {"forward": 1, "backward_input": 1, "backward_weight": 1,
                                       "p2p": 0.1, "allreduce": 0.5, "optimizer": 0.2}})
    build_library(spec, Policy(), 2, folder, Settings(solver="heuristic"), jobs=1)
    return folder


class Coordinators:
    """`n` coordinator processes campaigning for `job`; their stdout lines collected."""

    def __init__(self, cluster, library, job, n=3):
        self.lines: dict[str, list[str]] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        for i in range(n):
            name = f"c{i}"
            self.lines[name] = []
            proc = subprocess.Popen(
                [sys.executable, "-m", "recycle_planner.executor.control.failover",
                 "--etcd", cluster.endpoints, "--job", job, "--library", str(library),
                 "--lease", str(LEASE), "--name", name],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
            self.procs[name] = proc
            threading.Thread(target=self._read, args=(name, proc), daemon=True).start()

    def _read(self, name, proc):
        for line in proc.stdout:
            self.lines[name].append(line.rstrip())

    def decisions(self, name=None):
        names = [name] if name else list(self.lines)
        return [line.split()[1] for n in names for line in self.lines[n]
                if line.startswith("decision ")]

    def stop(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_hosts(store, keys, steps=lambda: 5):
    return [HostMember(store, keys, HostRecord(i, f"h{i}", tuple(range(i * PER_HOST,
                                                                       (i + 1) * PER_HOST))),
                       LEASE, lambda i=i: {r: steps() for r in range(i * PER_HOST,
                                                                     (i + 1) * PER_HOST)})
            for i in range(PIPELINES)]


def leader_name(store, keys):
    entry = Election(store, keys.election, "observer", LEASE).leader()
    return entry.value if entry else None


@pytest.fixture(scope="module")
def cluster():
    with EtcdCluster(3) as c:
        yield c


@pytest.fixture
def job(cluster, library, request):
    keys = Keys(request.node.name.replace("[", "-").replace("]", ""))
    store = EtcdStore(cluster.endpoints, timeout=2)
    coords = Coordinators(cluster, library, keys.job)
    hosts = start_hosts(store, keys)
    yield store, keys, coords, hosts
    for h in hosts:
        h.close()
    coords.stop()
    store.close()


def all_hold(hosts, gen, timeout):
    return wait_for(lambda: all(h.decision is not None and h.decision.gen == gen
                                for h in hosts), timeout)


@pytest.mark.parametrize("how", ["sigkill", "cut"])
def test_the_leader_lost_another_leads_and_decides_a_host_loss_once(job, how):
    store, keys, coords, hosts = job
    assert all_hold(hosts, 1, 30), coords.lines
    old = leader_name(store, keys)
    os.kill(coords.procs[old].pid, signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
    t0 = time.monotonic()
    assert wait_for(lambda: leader_name(store, keys) not in (old, None), 10)
    took = time.monotonic() - t0
    assert took < LEASE + 2, took            # within the lease (plus the watch and a campaign)
    new = leader_name(store, keys)
    hosts[1].close(leave=False)             # a host lost under the new leader
    assert all_hold(hosts[::2], 2, 10), coords.lines
    decision = hosts[0].decision
    assert decision.members == (0, 1, 4, 5) and decision.restart == 5
    if how == "cut":                         # the old leader's link comes back: deposed
        os.kill(coords.procs[old].pid, signal.SIGCONT)
        time.sleep(3 * LEASE)
        assert leader_name(store, keys) == new
    assert wait_for(lambda: coords.decisions(new) == ["2"], 5), coords.lines
    assert sorted(coords.decisions()) == ["1", "2"]   # each generation decided exactly once
    assert hosts[0].decision.gen == 2


def test_a_host_lost_while_the_coordinators_fail_over(job):
    store, keys, coords, hosts = job
    assert all_hold(hosts, 1, 30), coords.lines
    old = leader_name(store, keys)
    os.kill(coords.procs[old].pid, signal.SIGKILL)
    hosts[2].close(leave=False)
    assert all_hold(hosts[:2], 2, 10), coords.lines
    assert hosts[0].decision.members == (0, 1, 2, 3)
    assert wait_for(lambda: len(coords.decisions()) == 2, 5), coords.lines
    assert sorted(coords.decisions()) == ["1", "2"]


def test_one_etcd_member_killed_changes_nothing(job, cluster):
    store, keys, coords, hosts = job
    assert all_hold(hosts, 1, 30), coords.lines
    cluster.kill(0)
    try:
        hosts[2].close(leave=False)
        assert all_hold(hosts[:2], 2, 10), coords.lines
        assert all(h.lost is None for h in hosts[:2])
        assert all(p.poll() is None for p in coords.procs.values())
    finally:
        cluster.start(0)
        cluster.wait_ready()


def test_quorum_lost_the_store_says_so_to_hosts_and_coordinators(library):
    with EtcdCluster(3) as cluster:
        keys = Keys("quorum")
        store = EtcdStore(cluster.endpoints, timeout=2)
        coords = Coordinators(cluster, library, keys.job, n=2)
        hosts = start_hosts(store, keys)
        try:
            assert all_hold(hosts, 1, 30), coords.lines
            cluster.kill(1)
            cluster.kill(2)
            t0 = time.monotonic()
            assert wait_for(lambda: all(h.lost for h in hosts), 10)
            assert time.monotonic() - t0 < LEASE + 2 + 1
            assert "not renewed" in hosts[0].lost
            for proc in coords.procs.values():
                assert proc.wait(15) == STORE_UNAVAILABLE
            assert any("control store is unavailable" in line
                       for lines in coords.lines.values() for line in lines)
        finally:
            for h in hosts:
                h.close(leave=False)
            coords.stop()
            store.close()
