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
from recycle_planner.executor.control.etcd_local import EtcdCluster, etcd_missing
from recycle_planner.executor.control.failover import STORE_UNAVAILABLE
from helpers.waiting import wait_for
from recycle_planner.executor.control.plane import HostMember, HostRecord, Keys
from recycle_planner.executor.control.store import EtcdStore
from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.library import Settings, build_library

ROOT = Path(__file__).resolve().parent.parent
PIPELINES, STAGES, PER_HOST, LEASE = 3, 2, 2, 4.0  # the executor's default: a loaded test machine
SLACK = 4.0   # what a loaded machine (CI's: a load of 30 on 2 cores) adds to a bound in seconds
START = 60.0  # three coordinators, three hosts and a first decision on such a machine

pytestmark = pytest.mark.skipif(etcd_missing() is not None, reason=str(etcd_missing()))


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
                [sys.executable, "-m", "recycle_planner.executor.control.failover", "decide",
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
    with EtcdCluster(3, fast=False) as c:  # etcd's own timings: a loaded machine
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


def alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def all_hold(hosts, gen, timeout):
    return wait_for(lambda: all(h.decision is not None and h.decision.gen == gen
                                for h in hosts), timeout)


@pytest.mark.parametrize("how", ["sigkill", "cut"])
def test_the_leader_lost_another_leads_and_decides_a_host_loss_once(job, how):
    store, keys, coords, hosts = job
    assert all_hold(hosts, 1, START), coords.lines
    # the leader says so after its write, which hosts may hear of first
    assert wait_for(lambda: coords.decisions() == ["1"], 20), coords.lines
    old = leader_name(store, keys)
    os.kill(coords.procs[old].pid, signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
    t0 = time.monotonic()
    assert wait_for(lambda: leader_name(store, keys) not in (old, None), 10)
    took = time.monotonic() - t0
    assert took < LEASE + SLACK, took        # within the lease (plus the watch and a campaign)
    new = leader_name(store, keys)
    hosts[1].close(leave=False)             # a host lost under the new leader
    assert all_hold(hosts[::2], 2, 10 + SLACK), coords.lines
    decision = hosts[0].decision
    assert decision.members == (0, 1, 4, 5) and decision.restart == 5
    if how == "cut":                         # the old leader's link comes back: deposed
        os.kill(coords.procs[old].pid, signal.SIGCONT)
        time.sleep(3 * LEASE)
        assert leader_name(store, keys) != old  # (the new one may lose its own on a loaded machine)
    assert wait_for(lambda: coords.decisions(new) == ["2"], 20), coords.lines
    assert sorted(coords.decisions()) == ["1", "2"]   # each generation decided exactly once
    assert hosts[0].decision.gen == 2


def test_a_host_lost_while_the_coordinators_fail_over(job):
    store, keys, coords, hosts = job
    assert all_hold(hosts, 1, START), coords.lines
    # the leader says so after its write, which hosts may hear of first
    assert wait_for(lambda: coords.decisions() == ["1"], 20), coords.lines
    old = leader_name(store, keys)
    os.kill(coords.procs[old].pid, signal.SIGKILL)
    hosts[2].close(leave=False)
    assert all_hold(hosts[:2], 2, 10 + SLACK), coords.lines
    assert hosts[0].decision.members == (0, 1, 2, 3)
    assert wait_for(lambda: len(coords.decisions()) == 2, 20), coords.lines
    assert sorted(coords.decisions()) == ["1", "2"]


def test_one_etcd_member_killed_changes_nothing(job, cluster):
    store, keys, coords, hosts = job
    assert all_hold(hosts, 1, START), coords.lines
    cluster.kill(0)
    try:
        hosts[2].close(leave=False)
        assert all_hold(hosts[:2], 2, 10 + SLACK), coords.lines
        assert all(h.lost is None for h in hosts[:2])
        assert all(p.poll() is None for p in coords.procs.values())
    finally:
        cluster.start(0)
        cluster.wait_ready()


def test_quorum_lost_the_store_says_so_to_hosts_and_coordinators(library):
    with EtcdCluster(3, fast=False) as cluster:
        keys = Keys("quorum")
        store = EtcdStore(cluster.endpoints, timeout=2)
        coords = Coordinators(cluster, library, keys.job, n=2)
        hosts = start_hosts(store, keys)
        try:
            assert all_hold(hosts, 1, START), coords.lines
            cluster.kill(1)
            cluster.kill(2)
            t0 = time.monotonic()
            assert wait_for(lambda: all(h.lost for h in hosts), 20)
            # no renewal for the lease, noticed at the next renewal (a third of the lease
            # later) once its call gives up (the store's timeout, 2 s); or its watch, which
            # no member serves (etcd ends a stream whose member has no leader), gave up first
            assert time.monotonic() - t0 < LEASE * 4 / 3 + 2 + SLACK
            assert "not renewed" in hosts[0].lost or "etcd watch" in hosts[0].lost
            for proc in coords.procs.values():
                assert proc.wait(30) == STORE_UNAVAILABLE
            assert any("control store is unavailable" in line
                       for lines in coords.lines.values() for line in lines)
        finally:
            for h in hosts:
                h.close(leave=False)
            coords.stop()
            store.close()


def test_the_leaders_link_cut_another_leads_and_the_old_leader_decides_nothing(library,
                                                                                tmp_path):
    """Hosts as network namespaces: etcd in one, a coordinator in each of two more, the
    stand-in host agents in a third; the leader's link is set down (nothing is closed), a host
    is lost, then the link comes back."""
    from helpers.netns import COORD_ADDR, IP, Hosts, unavailable

    why = unavailable()
    if why is not None:
        pytest.skip(f"no network namespaces: {why}")
    with Hosts(3) as net, EtcdCluster(3, host=COORD_ADDR, wrap=(IP, "netns", "exec", net.coord),
                                      folder=tmp_path / "etcd") as cluster:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        logs = {f"c{i}": tmp_path / f"c{i}.log" for i in range(2)}
        for i, (name, path) in enumerate(logs.items()):
            net.popen(net.hosts[i], [sys.executable, "-m",
                                     "recycle_planner.executor.control.failover", "decide",
                                     "--etcd",
                                     cluster.endpoints, "--job", "cut", "--library",
                                     str(library), "--lease", str(LEASE), "--name", name],
                      open(path, "w"), env=env)
        hosts = subprocess.Popen(
            [IP, "netns", "exec", net.hosts[2], sys.executable,
             str(ROOT / "tests" / "helpers" / "control_hosts.py"), "--etcd", cluster.endpoints,
             "--job", "cut", "--hosts", str(PIPELINES), "--per-host", str(PER_HOST),
             "--lease", str(LEASE)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        lines: list[str] = []
        threading.Thread(target=lambda: [lines.append(x.strip()) for x in hosts.stdout],
                         daemon=True).start()

        def leader():
            names = [x.split()[1] for x in lines if x.startswith("leader ")]
            return names[-1] if names else None

        def decisions(name):
            return [x.split()[1] for x in logs[name].read_text().splitlines()
                    if x.startswith("decision ")]

        try:
            assert wait_for(lambda: "hold 1 0,1,2,3,4,5" in lines, 60), lines
            assert wait_for(lambda: leader() not in (None, "None"), 10), lines
            old = leader()
            ns = net.hosts[int(old[1:])]
            subprocess.run([IP, "-n", ns, "link", "set", "eth0", "down"], check=True)
            assert wait_for(lambda: leader() not in (old, "None", None), 4 * LEASE), lines
            new = leader()
            hosts.stdin.write("lose 1\n")
            hosts.stdin.flush()
            assert wait_for(lambda: "hold 2 0,1,4,5" in lines, 10 + 2 * LEASE), lines
            subprocess.run([IP, "-n", ns, "link", "set", "eth0", "up"], check=True)
            time.sleep(3 * LEASE)
            assert leader() == new
            assert decisions(new) == ["2"] and decisions(old) == ["1"]  # once each, no split
            assert not any(x.startswith("hold 3") for x in lines)
        finally:
            hosts.stdin.close()
            hosts.wait(10)


def test_coordinate_and_follow_move_a_job_to_the_next_leader(cluster, tmp_path):
    """The process wrappers around today's commands, with stand-ins for them: the leader runs
    its coordinator command, a host agent command runs against it (and stops as a host agent
    does when it loses its coordinator); the leader is SIGKILLed, so is its coordinator (no
    coordinator outlives its leadership); the next leader's coordinator, started as a hot
    standby, is told to take over, and the host agent (told where to find the next leader) runs again against
    it."""
    from recycle_planner.executor.config import COORDINATOR_LOST

    job = "wrappers"
    stand_in = ("import os, sys, time; word = sys.stdin.readline().strip(); "
                "print('coordinating', word, os.getpid(), flush=True); time.sleep(120)")
    coords, outs = {}, {}
    for name in ("c0", "c1"):
        outs[name] = tmp_path / f"{name}.out"
        coords[name] = subprocess.Popen(
            [sys.executable, "-m", "recycle_planner.executor.control.failover", "coordinate",
             "--etcd", cluster.endpoints, "--job", job, "--lease", str(LEASE), "--name", name,
             "--endpoint", f"{name}.example:29400", "--", sys.executable, "-c", stand_in],
            stdout=open(outs[name], "w"), stderr=subprocess.DEVNULL)
    runs = tmp_path / "agent-runs"
    agent = ("import json, os, sys; runs = open(sys.argv[2], 'a'); "
             "told = json.loads(os.environ['RECYCLE_FOLLOW']); assert told['job'] == 'wrappers'"
             "; runs.write(sys.argv[1] + '\\n'); "
             f"runs.close(); n = len(open(sys.argv[2]).read().split()); "
             f"sys.exit({COORDINATOR_LOST} if n == 1 else 0)")
    follower = subprocess.Popen(
        [sys.executable, "-m", "recycle_planner.executor.control.failover", "follow",
         "--etcd", cluster.endpoints, "--job", job, "--lease", str(LEASE), "--timeout", "30",
         "--", sys.executable, "-c", agent, "{coordinator}", str(runs)])
    store = EtcdStore(cluster.endpoints, timeout=2)
    try:
        keys = Keys(job)
        assert wait_for(lambda: runs.exists() and runs.read_text().split(), 30)
        old = leader_name(store, keys)
        new = "c1" if old == "c0" else "c0"
        assert runs.read_text().split() == [f"{old}.example:29400"]
        assert wait_for(lambda: "coordinating lead" in outs[old].read_text(), 10)
        coords[old].kill()
        assert follower.wait(30) == 0
        assert runs.read_text().split() == [f"{old}.example:29400", f"{new}.example:29400"]
        assert wait_for(lambda: "coordinating take-over" in outs[new].read_text(), 10)
        # told the revision of its leader's publication: the fence of its writes
        told = outs[new].read_text().split()
        assert int(told[told.index("take-over") + 1]) == store.get(keys.coordinator).mod_revision
        pid = int(outs[old].read_text().split()[-1])
        assert wait_for(lambda: not alive(pid), 15)  # the deposed leader's coordinator died too
    finally:
        follower.kill()
        for proc in coords.values():
            proc.terminate()
            proc.wait(10)
        store.close()
