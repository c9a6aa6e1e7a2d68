"""One contract for the launcher's two control planes (issue 22, item 5): a worker's `Link` and
the launcher's (or coordinator's) `Mail` must agree on every rule, whichever pair carries them.

- "store": one machine, `StoreLink` and `StoreMail` on the launcher's c10d store (the embedded
  default: nothing to install, no network beyond loopback);
- "relay": a cluster job, `HostLink` to a host agent's `Relay` and `RelayMail` on the
  coordinator's store (`transport.C10dHost`, `C10dCoordinator`);
- "etcd": the same relay and mail over the control store (`transport.EtcdHost`,
  `EtcdCoordinator`), here the embedded `MemoryStore`; one case runs on a real 3-member etcd.

Each case is written once and runs on all, on loopback against a real TCPStore (where the
process groups form). The relay
carries records asynchronously (batched per host), so reads are awaited, bounded."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

pytestmark = pytest.mark.torch
dist = pytest.importorskip("torch.distributed")

from recycle_planner.executor.control import messages as msg  # noqa: E402
from recycle_planner.executor.control.link import HostLink, StoreLink  # noqa: E402
from recycle_planner.executor.control.mail import RelayMail, StoreMail  # noqa: E402
from recycle_planner.executor.control.protocol import Decision  # noqa: E402
from recycle_planner.executor.control.relay import Relay  # noqa: E402
from recycle_planner.executor.control.etcd_local import etcd_missing  # noqa: E402
from recycle_planner.executor.control.store import MemoryStore  # noqa: E402
from recycle_planner.executor.control.transport import (C10dCoordinator, C10dHost,  # noqa: E402
                                                        EtcdCoordinator, EtcdHost)

LEASE = 2.0
PREFIX = "/recycle/job/relay/"


class Plane:
    """The launcher's side (`mail`, used under `lock`) and a way to connect workers;
    `control`: the control store of kind "etcd" (a `MemoryStore` unless given)."""

    def __init__(self, kind: str, folder, control=None):
        self.kind = kind
        self.control = control if control is not None or kind != "etcd" else MemoryStore()
        self.server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=10))
        self.lock = threading.Lock()
        self.links: list = []
        self.stop = threading.Event()
        self.thread = None
        if kind == "store":
            self.mail = StoreMail(self.server)
            return
        if kind == "etcd":
            up = EtcdHost(self.control, PREFIX, 0, lambda: self.server)
            down = EtcdCoordinator(self.control, PREFIX, groups=self.server)
        else:
            up = C10dHost(self._client(10.0), self._client(LEASE))
            down = C10dCoordinator(self.server)
        self.mail = RelayMail(down, nnodes=1, per_host=4, beat_every=LEASE / 4)
        self.relay = Relay(up, 0,
                           str(folder / "relay.sock"), lease=LEASE, heartbeat=0.1, flush=0.02)
        self.relay.report(msg.HostUp(0, "host", 0, (0, 1, 2, 3)))  # as its host agent does
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _client(self, timeout: float):
        """Calls time out after `timeout`; connecting may take longer (this sandbox delays
        about one new connection in 25 by 5 s)."""
        store = dist.TCPStore("127.0.0.1", self.server.port, is_master=False,
                              timeout=timedelta(seconds=max(timeout, 30.0)))
        store.set_timeout(timedelta(seconds=timeout))
        return store

    def _loop(self) -> None:
        """The host agent's passes and the coordinator's publishing, as their loops run."""
        while not self.stop.is_set():
            self.relay.step()
            with self.lock:
                self.mail.flush()
            time.sleep(0.005)

    def link(self, rank: int):
        """A worker's link, watching generation 1; returns it and the aborts it heard."""
        if self.kind == "store":
            link = StoreLink("127.0.0.1", self.server.port, 10.0, LEASE, 0.1, 0.01)
        else:
            link = HostLink(self.relay.path, rank, 0, ("127.0.0.1", self.server.port), 10.0,
                            0.1)
        aborts: list = []
        link.watch(lambda: msg.Heartbeat(rank, 0, time.time()), lambda: 1,
                   lambda gen, reason: aborts.append((gen, reason)))
        self.links.append(link)
        return link, aborts

    def direct(self, key: str) -> bool:
        """Whether a record workers exchange directly (`relay.DIRECT`) is held under `key`."""
        if self.kind == "etcd":
            return self.control.get(f"{PREFIX}rec/{key}") is not None
        return self.server.check([key])

    def read(self, what, seconds: float = 10.0):
        """`what(mail)` once it is truthy, after taking in what arrived (bounded)."""
        deadline = time.monotonic() + seconds
        while True:
            with self.lock:
                self.mail.refresh()
                value = what(self.mail)
            if value or time.monotonic() > deadline:
                return value
            time.sleep(0.01)

    def tell(self, *messages, decision: Decision | None = None) -> None:
        with self.lock:
            for m in messages:
                self.mail.put(m)
            if decision is not None:
                self.mail.post_decision(decision)
            self.mail.flush()

    def close(self) -> None:
        for link in self.links:
            link.close()
        self.stop.set()
        if self.thread is not None:
            self.thread.join(5)
            self.relay.close()
        if self.kind == "etcd":
            self.mail.transport.close()


@pytest.fixture(params=["store", "relay", "etcd"])
def plane(request, tmp_path):
    p = Plane(request.param, tmp_path)
    yield p
    p.close()


def test_a_set_record_is_read_as_last_sent_and_present_for_every_rank(plane):
    a, _ = plane.link(0)
    b, _ = plane.link(1)
    a.send(msg.IterationDone(0, 0, 1, 1.0))
    a.send(msg.IterationDone(0, 0, 1, 2.0))   # a later attempt of the same iteration
    b.send(msg.Losses(0, 1, 1, ((0, 0, 0.5), (1, 0, 0.25))))
    b.send(msg.IterationDone(0, 1, 1, 3.0))
    ids = [{"iteration": 0, "rank": r} for r in (0, 1)]
    assert plane.read(lambda m: m.present(msg.IterationDone, ids))
    assert plane.read(lambda m: m.get(msg.IterationDone, iteration=0, rank=0).t == 2.0)
    assert plane.read(lambda m: m.get(msg.Losses, iteration=0, rank=1)).losses == \
        ((0, 0, 0.5), (1, 0, 0.25))
    assert plane.mail.get(msg.Losses, iteration=0, rank=0) is None
    assert [d.t for d in plane.mail.get_many(msg.IterationDone, ids)] == [2.0, 3.0]
    assert plane.mail.get_many(msg.IterationDone, [*ids, {"iteration": 0, "rank": 2}])[2:] \
        == [None]


def test_the_first_report_wins(plane):
    """A bug report: the launcher reads the first one sent. A proposal between workers (the
    boundary where they leave a generation): the second proposer is told the first, and every
    worker reads it."""
    a, _ = plane.link(0)
    b, _ = plane.link(1)
    a.send(msg.Bug(1, 0, 4, "Traceback: first"))
    assert plane.read(lambda m: m.get(msg.Bug, gen=1)).traceback == "Traceback: first"
    b.send(msg.Bug(1, 1, 4, "Traceback: second"))
    time.sleep(0.2)
    assert plane.read(lambda m: m.get(msg.Bug, gen=1)).traceback == "Traceback: first"
    first = msg.SwitchAt(1, 5)
    assert a.send(first) == first
    assert b.send(msg.SwitchAt(1, 7)) == first
    assert b.peek(msg.SwitchAt, gen=1) == a.wait(msg.SwitchAt, gen=1) == first


def test_counted_reports_add_up(plane):
    links = [plane.link(r)[0] for r in range(3)]
    for rank, link in enumerate(links):
        link.send(msg.CommError(1, rank))
    assert plane.read(lambda m: m.count(msg.CommError, gen=1) == 3)
    assert plane.mail.count(msg.CommError, gen=2) == 0


def test_new_records_are_handed_once_each_where_the_mail_can_say(plane):
    """`take_new`: the relay's mail hands each record of a kind taken in since the last call
    (`Ready`: since the start) once, in arrival order (the coordinator's recovery takes in
    only the `Ready`s that arrived); the store's cannot say (None), and its reader looks
    every record up."""
    assert plane.mail.take_new(msg.Ready) == ([] if plane.kind != "store" else None)
    link, _ = plane.link(0)
    link.send(msg.Ready(1, 0, 3, "failure"))
    link.send(msg.Ready(1, 1, 3, "failure"))
    if plane.kind == "store":
        assert plane.read(lambda m: m.get(msg.Ready, gen=1, rank=1))
        assert plane.mail.take_new(msg.Ready) is None
        return
    taken: list = []
    assert plane.read(lambda m: taken.extend(m.take_new(msg.Ready)) or len(taken) >= 2)
    assert [(r.gen, r.rank, r.steps) for r in taken] == [(1, 0, 3), (1, 1, 3)]
    assert plane.mail.take_new(msg.Ready) == []


def test_a_welcome_a_decision_and_an_abort_reach_the_worker(plane):
    link, aborts = plane.link(2)
    got = {}
    waiter = threading.Thread(target=lambda: got.update(
        welcome=link.wait(msg.Welcome, rank=2, incarnation=0), decision=link.decision(1)))
    waiter.start()
    decision = Decision(gen=1, action="run", members=(0, 1, 2, 3), dead=(), restart=0)
    plane.tell(msg.Welcome(2, 0, 1), decision=decision)
    waiter.join(10)
    assert got == {"welcome": msg.Welcome(2, 0, 1), "decision": decision}
    plane.tell(msg.Abort(1, "worker 0:1 died"))
    assert plane.read(lambda m: aborts) == [(1, "worker 0:1 died")]
    stop = threading.Event()
    stop.set()
    assert link.wait(msg.Welcome, stop, rank=2, incarnation=1) is None  # given up when asked


def test_a_live_worker_lease_is_renewed(plane):
    plane.link(3)
    first = plane.read(lambda m: m.beat(3, 0))
    assert first is not None
    assert plane.read(lambda m: m.beat(3, 0) != first)


def test_the_groups_meet_in_a_store_the_plane_names(plane):
    a, _ = plane.link(0)
    b, _ = plane.link(1)
    decision = Decision(gen=1, action="run", members=(0, 1), dead=(), restart=0)
    sa, sb = a.group_store(decision), b.group_store(decision)
    sa.add("gen1/test/arrived", 1)
    assert sb.add("gen1/test/arrived", 1) == 2


def test_the_mail_holds_a_window_of_iterations_not_the_run(plane, tmp_path):
    """The launcher's iteration log (`iterations.IterationLog`) saves each iteration's losses
    once final and, a lease later, drops its records from the mail (and their keys from the
    store): over 30 iterations of 2 stages x 2 pipelines (each rank's end, the last stage's
    losses, a checkpoint every 5, the step an injected fault of iteration 3 waits for), what the
    mail holds does not grow, every iteration's loss and end are still there at the end, and
    the step record left the store with its iteration."""
    import json
    import math

    from recycle_planner.executor.control.iterations import IterationLog
    from recycle_planner.executor.control.runfolder import LOSSES, claim

    links = [plane.link(r)[0] for r in range(4)]
    folder = claim(tmp_path / "run", False, False)
    log = IterationLog(plane.mail, folder, pipelines=2, stages=2, microbatches=2, start=0,
                       linger=1.0, stepped={3: (0,)})
    stepped = msg.Stepped.key_for(iteration=3, rank=0)

    def held() -> int:
        if plane.kind == "store":
            return plane.server.num_keys()
        return len(plane.mail.records) + len(plane.mail.counts)

    def loss(i: int, p: int, m: int) -> float:
        return 1.0 / (1 + i) + p + 0.5 * m

    sizes = []
    for i in range(30):
        if i == 3:  # before its end: on the store once the end is in the mail
            links[0].send(msg.Stepped(3, 0))
        for rank, link in enumerate(links):
            link.send(msg.IterationDone(i, rank, 1, 100.0 + i + 0.01 * rank))
            if rank % 2 == 1:  # the last stage: every micro-batch's loss
                link.send(msg.Losses(i, rank, 1, tuple((p, m, loss(i, p, m))
                                                       for p in range(2) for m in range(2))))
        if i % 5 == 0:
            for s in range(2):
                links[s].send(msg.CheckpointWritten(i, s))
        ids = [{"iteration": i, "rank": r} for r in range(4)]
        assert plane.read(lambda m: m.present(msg.IterationDone, ids)
                          and m.present(msg.Losses, [ids[1], ids[3]]))
        assert plane.direct(stepped) or i != 3  # on the store until 3 is retired
        with plane.lock:
            log.save(now=0.5 * i)
            log.retire(now=0.5 * i)
            sizes.append(held())
    assert log.next_loss == 29 and log.retired == 27  # saved once final; a lease later gone
    assert max(sizes[8:]) <= max(sizes[:8]), sizes   # a window: no more at 30 than at 8
    assert plane.mail.get(msg.IterationDone, iteration=3, rank=0) is None
    assert not plane.direct(stepped)
    assert plane.mail.get(msg.IterationDone, iteration=29, rank=0) is not None
    with plane.lock:
        log.save(now=15.0, upto=30)
        ends, gens = log.ends_upto(30)
    rows = [json.loads(line) for line in (folder.run_dir / LOSSES).read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(30))
    assert all(math.isclose(r["loss"], sum(loss(r["iteration"], p, m) for p in range(2)
                                           for m in range(2)) / 4) for r in rows)
    assert ends == [100.0 + i + 0.03 for i in range(30)] and gens == [1] * 30
    assert [r["end"] for r in rows] == ends  # each row holds its iteration's end
    folder.release()


@pytest.mark.skipif(etcd_missing() is not None, reason=f"{etcd_missing()}")
def test_the_etcd_pair_carries_a_case_on_a_real_etcd(tmp_path):
    """The etcd transport on a real 3-member etcd (its JSON gateway, its watch streams): the
    welcome, the decision and the abort reach the worker, as on the embedded store."""
    from recycle_planner.executor.control.etcd_local import EtcdCluster
    from recycle_planner.executor.control.store import EtcdStore

    with EtcdCluster() as etcd:
        control = EtcdStore(etcd.endpoints)
        plane = Plane("etcd", tmp_path, control)
        try:
            test_a_welcome_a_decision_and_an_abort_reach_the_worker(plane)
        finally:
            plane.close()
            control.close()
