"""The host relay of a cluster job (`relay.py`, `link.HostLink`, `mail.RelayMail`): workers talk
to their host agent over a Unix socket; the host agent batches their reports into one record
per host on the coordinator's queue, reads the coordinator's notices once for the host and
pushes them to its workers, and notices a local worker's death or silence.

On loopback, against a real c10d TCPStore; the host agent's test runs the real `recycle-planner
launch --nnodes` with stand-in workers that only report. (The drills of tests/test_cluster.py
run real training through the same relay and compare parameters and losses with the
fault-free run.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import timedelta

import pytest

from conftest import ROOT

pytestmark = pytest.mark.torch
dist = pytest.importorskip("torch.distributed")

from recycle_planner.executor.config import CONFIG_KEY, WorkerConfig  # noqa: E402
from recycle_planner.executor.control import messages as msg  # noqa: E402
from recycle_planner.executor.control.link import HostLink  # noqa: E402
from recycle_planner.executor.control.mail import RelayMail  # noqa: E402
from recycle_planner.executor.control.protocol import Decision, decision_key  # noqa: E402
from recycle_planner.executor.control.relay import HostReport, Relay  # noqa: E402
from recycle_planner.executor.control.transport import (UP_QUEUE, C10dCoordinator,  # noqa: E402
                                                        C10dHost)

SLACK = 4.0  # what a loaded machine (CI's: a load of 30 on 2 cores) adds to an upper bound, s


LOCK = threading.Lock()
"""Held around the coordinator's mail by whoever uses it (a test and the relay's loop)."""


def _client(port: int, timeout: float = 10.0):
    """A store client whose calls time out after `timeout`; connecting may take longer (this
    sandbox delays about one new connection in 25 by 5 s)."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=timedelta(seconds=max(timeout, 30.0)))
    store.set_timeout(timedelta(seconds=timeout))
    return store


class _Counting:
    """A store client that counts its calls by (method, first key)."""

    def __init__(self, store):
        self.store, self.calls = store, Counter()

    def __getattr__(self, name):
        attr = getattr(self.store, name)

        def call(*args, **kwargs):
            key = args[0] if args and isinstance(args[0], str) else None
            self.calls[(name, key)] += 1
            return attr(*args, **kwargs)
        return call


@pytest.fixture
def coordinator():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    yield store, RelayMail(C10dCoordinator(store), nnodes=1, per_host=2, beat_every=0.25)


def _until(what, seconds: float = 10.0, every: float = 0.01, then=lambda: None):
    deadline = time.time() + seconds
    while not what():
        assert time.time() < deadline, "timed out"
        then()
        time.sleep(every)


@pytest.fixture
def relay(coordinator, tmp_path):
    store, _ = coordinator
    up = _Counting(_client(store.port))
    relay = Relay(C10dHost(up, _client(store.port, 2.0)), 0, str(tmp_path / "relay.sock"), lease=1.0,
                  heartbeat=0.2, flush=0.05)
    stop = threading.Event()
    _, mail = coordinator

    def loop():  # the host agent's passes, and the coordinator's beat (every 0.25 s)
        while not stop.is_set():
            relay.step()
            with LOCK:
                mail.flush()
            time.sleep(0.005)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield relay, up
    stop.set()
    thread.join()
    relay.close()


def _link(relay, rank: int, port: int, heartbeat: float = 0.05):
    aborts = []
    link = HostLink(relay.path, rank, 0, ("127.0.0.1", port), 10.0, heartbeat)
    link.watch(lambda: msg.Heartbeat(rank, 0, time.time()), lambda: 1,
               lambda gen, reason: aborts.append((gen, reason)))
    return link, aborts


def test_frames_come_out_whole_however_the_stream_is_cut():
    """A burst of frames read in pieces of any size (one byte, a frame and a half, all at
    once) gives each frame once, in order, and keeps only the partial one."""
    from recycle_planner.executor.control.relay import Frames, encode

    frames = [{"op": "send", "id": i, "rec": "x" * (i % 7)} for i in range(300)]
    stream = b"".join(encode(f) for f in frames)
    for size in (1, 5, len(encode(frames[0])) * 3 // 2, 4096, len(stream)):
        reader, out = Frames(), []
        for at in range(0, len(stream), size):
            out.extend(reader.feed(stream[at:at + size]))
        assert out == frames and reader.buffer == b""
    reader = Frames()
    assert reader.feed(stream[:-3]) == frames[:-1] and reader.buffer == encode(frames[-1])[:-3]


def test_a_host_report_carries_its_records_as_objects_decoded_with_it():
    """The records a host relays sit in its report's JSON as objects, as the workers wrote
    them, so that the coordinator decodes a whole report at once (not each record again from
    a string of its own: 11,000 of them when a new leader takes in every journal)."""
    sent = [msg.Ready(3, 0, 7, "failure", 6, ((5, (0.5, 1.0)),)),
            msg.Losses(4, 0, 3, ((0, 1, float("nan")),)), msg.Bye(2)]
    report = HostReport(2, 9, tuple((type(m).__name__, m.to_json()) for m in sent))
    wire = json.loads(report.to_json())
    assert wire["records"] == [[type(m).__name__, json.loads(m.to_json())] for m in sent]
    decoded = HostReport.from_json(report.to_json())
    assert (decoded.node, decoded.seq) == (2, 9)
    assert repr(decoded.messages()) == repr(sent)   # nan != nan: compared as written
    assert HostReport.from_json(decoded.to_json()).records == decoded.records


def test_workers_reports_reach_the_coordinator_in_one_record_per_host(coordinator, relay):
    """Two workers' iteration ends and losses, sent together, arrive in one host report; the
    coordinator reads them from memory (no key per rank on its store); the host's lease is its
    report number, which moves with every report (at least every heartbeat)."""
    store, mail = coordinator
    relay, up = relay
    links = [_link(relay, r, store.port)[0] for r in (0, 1)]
    for rank, link in enumerate(links):
        link.send(msg.IterationDone(0, rank, 1, 1.0))
        link.send(msg.Losses(0, rank, 1, ((rank, 0, 0.5),)))
    reports = []

    def drain():
        for _ in range(store.queue_len(UP_QUEUE)):
            report = HostReport.from_json(store.queue_pop(UP_QUEUE, False))
            reports.append(report)
            for message in report.messages():
                mail._take(message)
            mail.host_seq[report.node] = report.seq

    _until(lambda: mail.present(msg.Losses, [{"iteration": 0, "rank": r} for r in (0, 1)]),
           then=drain)
    full = [r for r in reports if r.records]
    assert len(full) == 1 and len(full[0].records) == 4
    assert mail.get(msg.IterationDone, iteration=0, rank=1).gen == 1
    assert not [k for k in store.list_keys() if k.startswith(("it/", "loss/", "hb/"))]
    beat = mail.beat(1, 0)
    _until(lambda: mail.beat(1, 0) != beat, then=drain)
    assert {name for name, _ in up.calls} == {"queue_push"}  # no per-rank key
    for link in links:
        link.close()


def test_the_relay_batches_a_workers_record_as_sent_and_encodes_nothing_again(
        coordinator, relay, monkeypatch):
    """What a worker's link sent reaches the host report and the relay's journal as the
    worker's own JSON: the relay decodes each record once (it must know its kind and rule)
    and never encodes it again (that was two encodes per record on the host agent's thread:
    16,000 for a recovery's `Ready`s at 8,192 ranks)."""
    store, _ = coordinator
    relay, _ = relay
    encoded = Counter()
    to_json = msg.Message.to_json

    def counted(self):
        encoded[threading.current_thread() is threading.main_thread()] += 1
        return to_json(self)
    monkeypatch.setattr(msg.Message, "to_json", counted)
    link, _ = _link(relay, 0, store.port)
    sent = [msg.Ready(3, 0, 7, "failure", 6, ((5, (0.5, 1.0)),)), msg.IterationDone(4, 0, 3, 1.5)]
    for message in sent:
        link.send(message)
    reports = []
    _until(lambda: reports.extend(HostReport.from_json(store.queue_pop(UP_QUEUE, False))
                                  for _ in range(store.queue_len(UP_QUEUE)))
           or sum(len(r.records) for r in reports) >= 2)
    records = [record for r in reports for record in r.records]
    assert records == [(type(m).__name__, json.loads(to_json(m))) for m in sent]
    assert [m for r in reports for m in r.messages()] == sent
    assert [text for _, text in relay.journal.records()] == [to_json(m) for m in sent]
    assert encoded == {True: 2}  # the link's, one per record; none on the relay's loop
    link.close()


def test_an_abort_and_a_decision_are_read_once_per_host_and_pushed_to_every_worker(
        coordinator, relay):
    """The coordinator posts an abort and the next decision once; the host's relay is woken
    by the notice key, reads its bulletins in one round trip, pushes the abort to both workers
    (each hears it once) and answers both workers' wait for the decision with one read of the
    decision's key."""
    store, mail = coordinator
    relay, up = relay
    (a, aborts_a), (b, aborts_b) = (_link(relay, r, store.port) for r in (0, 1))
    got = {}
    waiters = [threading.Thread(target=lambda r=r, link=link: got.__setitem__(
        r, link.decision(2))) for r, link in ((0, a), (1, b))]
    for w in waiters:
        w.start()
    decision = Decision(gen=2, action="run", members=(0, 1), dead=(), restart=3)
    with LOCK:
        mail.put(msg.Abort(1, "worker 1:0 died"))
        mail.post_decision(decision)
        mail.flush()
    for w in waiters:
        w.join(30)  # a loaded machine (CI's) can hold a thread for seconds
    assert got == {0: decision, 1: decision}
    _until(lambda: aborts_a and aborts_b, seconds=30)
    time.sleep(0.6)  # the coordinator's beats meanwhile: nothing new, no second push
    assert aborts_a == aborts_b == [(1, "worker 1:0 died")]
    assert up.calls[("get", decision_key(2))] == 1
    a.close()
    b.close()


def test_a_silent_worker_is_noticed_within_the_lease(coordinator, relay):
    """A worker whose heartbeats stop (its process stopped, or its link's thread stuck) is
    named by the relay once the lease (1 s) has passed since its last one; one that beats
    is not."""
    store, _ = coordinator
    relay, _ = relay
    quiet, _ = _link(relay, 0, store.port, heartbeat=30.0)   # one beat, then none
    loud, _ = _link(relay, 1, store.port)
    _until(lambda: relay.silent(), seconds=5 + SLACK)
    (rank, incarnation, silent), = relay.silent()
    assert (rank, incarnation) == (0, 0) and 1.0 < silent < 2.5 + SLACK
    quiet.close()
    loud.close()


def test_a_host_agent_stopped_between_its_looks_counts_its_workers_silence_from_then(
        coordinator, tmp_path):
    """A host agent stopped (SIGSTOP) or starved for over a second could not hear its workers
    meanwhile: whatever looks first after it (`silent`, not only `step`) counts their silence
    from then. Before, an agent continued in the middle of its pass judged its continued
    workers by their beats from before the stop and killed them at once; then, with no
    look missed, a silent worker is named once the lease (1 s) has passed."""
    store, _ = coordinator
    relay = Relay(C10dHost(_client(store.port), _client(store.port, 2.0)), 0,
                  str(tmp_path / "relay.sock"), lease=1.0, heartbeat=0.2, flush=0.05)
    quiet, _ = _link(relay, 0, store.port, heartbeat=30.0)   # one beat, then none
    try:
        _until(lambda: any(c.beat is not None for c in relay.conns.values()), then=relay.step)
        time.sleep(1.5)  # "stopped": no look at all
        assert relay.silent() == []
        t = time.monotonic()
        _until(lambda: relay.silent(), then=relay.step, every=0.05)
        assert time.monotonic() - t >= 1.0
    finally:
        quiet.close()
        relay.close()


def test_a_worker_whose_host_agent_falls_silent_loses_its_link_within_the_lease(
        coordinator, tmp_path):
    """The host agent beats to its workers every quarter of the lease (0.5 s here) on every
    pass of its loop. While it steps, its workers' links stay up over two leases; when its
    passes stop (its process stopped or hung: the socket stays open), each link is lost
    within the lease plus its check's period, `orphaned` (the worker then leaves without
    writing anything) and its abort callback hears it. The agent's own word that the
    coordinator is lost is not orphaned (that worker stops with a checkpoint)."""
    from recycle_planner.executor.control.link import LOST, ControlLost

    store, _ = coordinator
    lease = 0.5
    relay = Relay(C10dHost(_client(store.port), _client(store.port, 2.0)), 0, str(tmp_path / "r.sock"),
                  lease=lease, heartbeat=0.1, flush=0.05)
    stepping, stop = threading.Event(), threading.Event()
    stepping.set()

    def loop():
        while not stop.is_set():
            if stepping.is_set():
                relay.step()
            time.sleep(0.01)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    links = []
    for rank in (0, 1):
        aborts = []
        link = HostLink(relay.path, rank, 0, ("127.0.0.1", store.port), 10.0, 0.05, lease)
        link.watch(lambda r=rank: msg.Heartbeat(r, 0, time.time()), lambda: 3,
                   lambda gen, reason, a=aborts: a.append((gen, reason)))
        links.append((link, aborts))
    try:
        time.sleep(2 * lease)
        assert all(link.lost is None for link, _ in links)
        stepping.clear()  # the host agent stopped
        t0 = time.monotonic()
        _until(lambda: all(link.lost for link, _ in links), seconds=5)
        took = time.monotonic() - t0
        assert 0.75 * lease < took < lease + 0.4 + SLACK, took  # from its last beat: a lease
        for link, aborts in links:
            assert link.orphaned and "nothing from it for" in link.lost
            assert aborts == [(3, LOST)]
            with pytest.raises(ControlLost):
                link.send(msg.IterationDone(0, 0, 1, 1.0))
        word, _ = _link(relay, 2, store.port)
        stepping.set()
        relay.lose("no notice from the coordinator for 4.1 s")
        _until(lambda: word.lost is not None)
        assert not word.orphaned and word.lost.startswith("no notice from the coordinator")
        word.close()
    finally:
        stop.set()
        thread.join()
        for link, _ in links:
            link.close()
        relay.close()


FAKE_AGENT = """
import socket, sys, time
from recycle_planner.executor.control.relay import encode
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1])
listener.listen(1)
print("ready", flush=True)
conn, _ = listener.accept()
while True:                          # a host agent that only beats, every 50 ms
    conn.sendall(encode({"push": "beat"}))
    time.sleep(0.05)
"""


def test_a_worker_whose_training_thread_holds_the_gil_keeps_its_link(tmp_path):
    """A training thread may hold the GIL for longer than the lease (user code in a C
    extension): the link's threads cannot run, but the host agent, another process, beats on
    and its frames wait in the socket. The process was busy, not paused (`pause.PauseClock`),
    so the link reads what waits before it judges the agent's silence, in one thread, and
    stays up; a judge on a thread of its own raced the reader and could take the unread
    beats for silence."""
    path = str(tmp_path / "agent.sock")
    agent = subprocess.Popen([sys.executable, "-c", FAKE_AGENT, path], stdout=subprocess.PIPE,
                             text=True, cwd=ROOT)
    interval = sys.getswitchinterval()
    try:
        assert agent.stdout.readline().strip() == "ready"
        lease = 1.0
        link = HostLink(path, 0, 0, ("127.0.0.1", 1), 10.0, 0.05, lease)
        time.sleep(0.3)
        assert link.lost is None
        sys.setswitchinterval(30.0)  # no other thread of this process runs until we wait
        end = time.monotonic() + 1.5 * lease
        while time.monotonic() < end:
            pass
        sys.setswitchinterval(interval)
        time.sleep(0.3)
        assert link.lost is None, link.lost
        link.close()
    finally:
        sys.setswitchinterval(interval)
        agent.kill()
        agent.wait()


STAND_IN = """
import os, signal, sys, time
from recycle_planner.executor.config import WorkerConfig
from recycle_planner.executor.control import messages as msg
from recycle_planner.executor.control.link import link_from_env
rank, inc = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
link = link_from_env(WorkerConfig.from_env())
link.watch(lambda: msg.Heartbeat(rank, inc, time.time()), lambda: -1, lambda g, r: None)
link.send(msg.Hello(rank, inc, os.getpid(), "stand-in", "lib", 0))
time.sleep(0.3)
if inc:
    sys.exit(0)                      # restarted: leaves
if rank == 0:
    sys.exit(9)                      # a death: the host agent sees its exit
os.kill(os.getpid(), signal.SIGSTOP)  # silent: the host agent kills it after the lease
"""


def test_the_host_agent_reports_a_local_death_and_a_silent_worker(coordinator, tmp_path):
    """The real host agent (`recycle-planner launch --nnodes 1`) with two stand-in workers:
    one exits with status 9, the other stops itself (SIGSTOP). Both deaths reach the
    coordinator in the host's reports: the exit within milliseconds, the stopped worker
    killed by its host agent once its heartbeats have been missing for the lease (2 s). Each
    is restarted once (`--restart-delay 0 --max-restarts 1`) as incarnation 1, counted in the
    coordinator's store through the relay's store thread (the host agent's loop never waits
    on the store), and leaves. The coordinator's outcome then ends the host agent, which says
    goodbye."""
    store, mail = coordinator
    script = tmp_path / "standin.py"
    script.write_text(STAND_IN)
    store.set(CONFIG_KEY, WorkerConfig(run_dir=str(tmp_path / "run"), lease=2.0, heartbeat=0.1,
                                       log_dir=str(tmp_path / "logs")).to_json())
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    agent = subprocess.Popen([sys.executable, "-m", "recycle_planner.cli", "launch", "--nnodes",
                              "1", "--nproc-per-node", "2", "--rdzv-endpoint",
                              f"127.0.0.1:{store.port}", "--restart-delay", "0",
                              "--max-restarts", "1", str(script)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        def exits():
            mail.refresh()
            mail.flush()  # the coordinator's beat keeps the host agent's notices coming
            return all(mail.get(msg.WorkerExit, rank=r, incarnation=i) for r in (0, 1)
                       for i in (0, 1))

        _until(exits, seconds=60, every=0.05)
        dead, silent = (mail.get(msg.WorkerExit, rank=r, incarnation=0) for r in (0, 1))
        assert dead.code == 9 and "exited with status 9" in dead.how
        assert silent.code == -9 and "lost its lease" in silent.how
        assert mail.get(msg.HostUp, node=0).ranks == (0, 1)
        assert mail.get(msg.Hello, rank=1, incarnation=0).host == "stand-in"
        for r in (0, 1):  # restarted once, as the store counted
            assert mail.get(msg.Spawned, rank=r, incarnation=1) is not None
            assert mail.get(msg.Hello, rank=r, incarnation=1) is not None
            assert mail.get(msg.WorkerExit, rank=r, incarnation=1).code == 0
            assert store.add(f"incarnation/{r}", 0) == 2
        mail.put(msg.Outcome("completed", "done"))

        def bye():
            mail.flush()
            mail.refresh()
            return mail.get(msg.Bye, node=0) is not None

        _until(bye, seconds=30, every=0.05)
        assert agent.wait(30) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
        out = agent.communicate()[0].decode(errors="replace")
    assert "worker rank 1 lost its lease" in out, out[-3000:]


def test_a_relay_re_attached_to_a_new_coordinator_re_sends_and_moves_the_groups(tmp_path):
    """The coordinator is lost (`detach`): the worker keeps reporting, its record for other
    workers (`Shape`) and its question where to form groups wait; re-attached to a new
    coordinator's store, the relay re-sends what the lost one had not made durable and its
    `Attach`, then answers: the record lands in the new store, the groups form there. The
    shape put on the lost store is put again (a worker restarted later waits for it), and the
    `Attach` tells the switch iteration the members had agreed there."""
    old, new = (dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=10)) for _ in range(2))
    mails = [RelayMail(C10dCoordinator(s), nnodes=1, per_host=1, beat_every=0.25) for s in (old, new)]
    relay = Relay(C10dHost(_client(old.port), _client(old.port, 2.0)), 0, str(tmp_path / "r.sock"),
                  lease=1.0, heartbeat=0.2, flush=0.01, endpoint=f"127.0.0.1:{old.port}")
    lock, stop = threading.Lock(), threading.Event()

    def loop():
        while not stop.is_set():
            with lock:
                relay.step()
            time.sleep(0.005)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    link = HostLink(relay.path, 0, 0, ("127.0.0.1", old.port), 10.0, 0.05)
    link.watch(lambda: msg.Heartbeat(0, 0, time.time()), lambda: 0, lambda g, r: None)
    try:
        mails[0].post_decision(Decision(gen=0, action="run", members=(0,), dead=(), restart=0))
        mails[0].flush()
        assert link.decision(0).gen == 0
        assert link.send(msg.SwitchAt(0, 7)).iteration == 7
        link.send(msg.Shape(1, "before"))
        link.send(msg.Losses(0, 0, 0, ((0, 0, 0.5),)))
        _until(lambda: mails[0].refresh() or mails[0].get(msg.Losses, iteration=0, rank=0))
        with lock:
            relay.detach()
        link.send(msg.Losses(1, 0, 0, ((0, 0, 0.25),)))
        link.send(msg.Shape(0, "layout"))              # for other workers: waits
        formed = []
        asking = threading.Thread(target=lambda: formed.append(link.group_store(None)))
        asking.start()
        time.sleep(0.3)
        assert not formed and not new.check(["shape/0"])
        with lock:
            relay.attach(C10dHost(_client(new.port), _client(new.port, 2.0)),
                         f"127.0.0.1:{new.port}", ((0, 0),))
        asking.join(10)
        assert formed and link.master == ("127.0.0.1", new.port)
        _until(lambda: mails[1].refresh() or mails[1].get(msg.Attach, node=0))
        for i in (0, 1):  # nothing was made durable: both losses re-sent
            assert mails[1].get(msg.Losses, iteration=i, rank=0) is not None
        attach = mails[1].get(msg.Attach, node=0)
        assert attach.workers == ((0, 0),) and (attach.gen, attach.switch_at) == (0, 7)
        assert new.check(["shape/0", "shape/1"])
    finally:
        link.close()
        stop.set()
        thread.join()
        relay.close()


class _Gated:
    """A store client whose `add` on `key` hangs until `gate` is set (a call on a cut link)."""

    def __init__(self, store, key: str):
        self.store, self.key, self.gate, self.inside = store, key, threading.Event(), \
            threading.Event()

    def __getattr__(self, name):
        return getattr(self.store, name)

    def add(self, key, amount):
        if key == self.key:
            self.inside.set()
            self.gate.wait(10)
        return self.store.add(key, amount)


def test_a_relay_leaves_a_hung_store_call_behind_and_never_acts_on_its_late_answer(tmp_path):
    """The host agent's calls on the coordinator's store (`Relay.call`: a restart's next
    incarnation) run on the relay's store thread. One hangs (the link is cut) with another
    queued behind it: moved to the next coordinator, the relay gives the queued one back at
    once (to be asked again there), and when the hung call ends, its answer from the
    deposed coordinator's store is not acted on: it comes back as not done."""
    old, new = (dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=10)) for _ in range(2))
    mails = [RelayMail(C10dCoordinator(s), nnodes=1, per_host=1, beat_every=0.1) for s in (old, new)]
    gated = _Gated(_client(old.port), "incarnation/0")
    relay = Relay(C10dHost(gated, _client(old.port, 5.0)), 0, str(tmp_path / "r.sock"), lease=5.0,
                  heartbeat=0.2, flush=0.01, endpoint=f"127.0.0.1:{old.port}")
    lock, stepping, stop = threading.Lock(), threading.Event(), threading.Event()
    answers: list[tuple] = []
    stepping.set()

    def loop():  # the coordinators beat until the relay is closed (its notice thread waits)
        while not stop.is_set():
            with lock:
                if stepping.is_set():
                    relay.step()
                for mail in mails:
                    mail.flush()
            time.sleep(0.005)

    def ask(key: str) -> None:
        relay.call(lambda transport: transport.store.add(key, 1) - 1,
                   lambda value: answers.append((key, value)),
                   lambda: answers.append((key, "undone")))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        with lock:
            ask("incarnation/0")
            ask("incarnation/1")
        assert gated.inside.wait(10)          # the first hangs; the second waits behind it
        time.sleep(0.1)
        assert answers == []
        with lock:
            relay.detach()
        _until(lambda: answers == [("incarnation/1", "undone")])
        with lock:
            relay.attach(C10dHost(_client(new.port), _client(new.port, 5.0)),
                         f"127.0.0.1:{new.port}")
            ask("incarnation/1")
        _until(lambda: answers[1:] == [("incarnation/1", 0)])
        gated.gate.set()                      # the hung call ends (the link came back)
        _until(lambda: len(answers) == 3)
        assert answers[2] == ("incarnation/0", "undone")
        assert old.add("incarnation/0", 0) == 1 and not new.check(["incarnation/0"])
    finally:
        gated.gate.set()
        stepping.clear()
        with lock:
            pass
        assert relay.close()  # every store thread ended (the abandoned one once unstuck)
        stop.set()
        thread.join()
