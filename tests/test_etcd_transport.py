"""The relay's transport on the control store (`transport.EtcdHost`, `EtcdCoordinator`), on the
embedded `MemoryStore`: what a takeover and a deposed coordinator mean for it, and that no key
outlives its need. The mail contract itself runs on it in tests/test_mail_contract.py."""

import threading
import time

import pytest

from recycle_planner.executor.control import messages as msg
from recycle_planner.executor.control.election import Deposed, Election
from recycle_planner.executor.control.mail import RelayMail
from recycle_planner.executor.control.protocol import Decision
from recycle_planner.executor.control.relay import Bulletin, HostReport
from recycle_planner.executor.control.store import MemoryStore
from recycle_planner.executor.control.transport import EtcdCoordinator, EtcdHost
from helpers.waiting import wait_for

PREFIX = "/recycle/job/relay/"


def _report(node: int, seq: int, *messages: msg.Message) -> str:
    return HostReport(node, seq, tuple((type(m).__name__, m.to_json()) for m in messages)).to_json()


def _keys(store: MemoryStore, under: str = PREFIX) -> list[str]:
    return [e.key for e in store.get_prefix(under)[0]]


def test_a_coordinator_taking_over_counts_what_a_host_re_sends_once_and_hosts_stay_put():
    """A report the lost leader did not take waits under its key; its successor takes a
    host's reports from its introduction on (the `Attach` after the re-sent journal), so an
    error in both counts once. The host's notice (its watch on the global bulletin) wakes on
    the successor's publication, which names another coordinator, without moving anywhere."""
    store = MemoryStore()
    host = EtcdHost(store, PREFIX, node=0, groups=None)
    old = RelayMail(EtcdCoordinator(store, PREFIX), nnodes=1, per_host=2, beat_every=1.0)
    host.push(_report(0, 0, msg.HostUp(0, "h", 1, (0, 1)), msg.CommError(1, 0)))
    old.refresh()
    assert old.count(msg.CommError, gen=1) == 1
    host.push(_report(0, 1, msg.CommError(1, 1)))       # the leader is lost before it reads
    first = Bulletin.from_json(host.bulletins(0)[0])
    new = RelayMail(EtcdCoordinator(store, PREFIX), nnodes=1, per_host=2, beat_every=1.0)
    assert host.wait_notice(first.version + 1, 1.0)      # its empty bulletins: a publication
    assert Bulletin.from_json(host.bulletins(0)[0]).by not in ("", first.by)
    host.push(_report(0, 2, msg.CommError(1, 0), msg.CommError(1, 1),
                      msg.Attach(0, -1, "", ((0, 0), (1, 0)))))
    new.refresh()
    assert new.count(msg.CommError, gen=1) == 2 and new.host_seq[0] == 2
    assert wait_for(lambda: _keys(store, f"{PREFIX}up/") == [], 5)  # taken (or passed over)
    host.close()


def test_a_deposed_coordinators_writes_are_refused():
    """Every write of the coordinator carries its election's fence: once another leads, the
    store refuses them (`Deposed`), so at most one coordinator's bulletins land."""
    store = MemoryStore()
    first = Election(store, "/recycle/job/election/", "a", ttl=5.0)
    leadership = first.campaign()
    transport = EtcdCoordinator(store, PREFIX, fence=leadership.fence)
    mail = RelayMail(transport, nnodes=1, per_host=1, beat_every=1.0)
    mail.put(msg.Finish(1))
    mail.flush()
    first.resign()                                       # another may lead from here
    mail.put(msg.Finish(2))
    with pytest.raises(Deposed):
        mail.flush()
    held = Bulletin.from_json(store.get(f"{PREFIX}bulletin/all").value)
    assert held.version == 1
    with pytest.raises(Deposed):                         # nor does it clear the job's keys
        transport.end()
    assert _keys(store) != []
    transport.close()


def test_no_key_outlives_its_need():
    """A direct record of a forgotten iteration and an old generation's keys leave the store;
    a report leaves once taken."""
    store = MemoryStore()
    host = EtcdHost(store, PREFIX, node=0, groups=None)
    mail = RelayMail(EtcdCoordinator(store, PREFIX), nnodes=1, per_host=1, beat_every=1.0)
    host.put_direct(msg.Stepped(3, 0))
    assert host.read(msg.Stepped.key_for(iteration=3, rank=0)) is not None
    mail.forget(3, [msg.Stepped.key_for(iteration=3, rank=0)])
    assert host.read(msg.Stepped.key_for(iteration=3, rank=0)) is None
    for gen in range(1, 5):
        mail.post_decision(Decision(gen=gen, action="run", members=(0,), dead=(), restart=0))
    assert _keys(store, f"{PREFIX}rec/") == [f"{PREFIX}rec/gen{g}/decision" for g in (3, 4)]
    host.push(_report(0, 0, msg.HostUp(0, "h", 1, (0,))))
    host.push(_report(0, 1, msg.CommError(1, 0)))
    mail.refresh()
    assert wait_for(lambda: _keys(store, f"{PREFIX}up/") == [], 5)
    mail.transport.close()


class HeldDeletes:
    """A store whose transactions that delete wait until `go` is set: etcd's leader far
    away, or busy."""

    def __init__(self, store):
        self.store, self.go = store, threading.Event()

    def transaction(self, compares, puts=(), deletes=(), delete_prefixes=()):
        if deletes:
            self.go.wait(10)
        return self.store.transaction(compares, puts, deletes, delete_prefixes)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_pass_does_not_wait_on_etcd_to_delete_the_reports_it_took():
    """Before, `take` deleted what it took before returning: a round trip to etcd's leader
    on every coordinator pass. A host's introduction is still deleted at once (a successor
    must not read it again); its later reports are taken at once and deleted meanwhile."""
    store = HeldDeletes(MemoryStore())
    host = EtcdHost(store, PREFIX, node=0, groups=None)
    transport = EtcdCoordinator(store, PREFIX)
    host.push(_report(0, 0, msg.HostUp(0, "h", 1, (0,))))
    store.go.set()
    assert len(transport.take()) == 1 and _keys(store, f"{PREFIX}up/") == []
    store.go.clear()
    for seq in (1, 2, 3):
        host.push(_report(0, seq, msg.CommError(1, 0)))
    t0 = time.monotonic()
    assert len(transport.take()) == 3
    assert time.monotonic() - t0 < 5 and len(_keys(store, f"{PREFIX}up/")) == 3
    store.go.set()
    assert wait_for(lambda: _keys(store, f"{PREFIX}up/") == [], 5)
    transport.close()


def test_the_jobs_traffic_leaves_etcd_once_every_host_said_goodbye():
    """The relay's keys outlive a coordinator, not the job: the pool's close posts the
    outcome, and once every host's `Bye` is in, every key under the prefix goes."""
    from types import SimpleNamespace

    from recycle_planner.executor.control.pool import HostPool

    store = MemoryStore()
    hosts = [EtcdHost(store, PREFIX, node=n, groups=None) for n in (0, 1)]
    mail = RelayMail(EtcdCoordinator(store, PREFIX), nnodes=2, per_host=1, beat_every=1.0)
    for n, host in enumerate(hosts):
        host.put_direct(msg.Stepped(3, n))
        host.push(_report(n, 0, msg.HostUp(n, "h", 1, (n,)), msg.Bye(n)))
    assert _keys(store) != []
    HostPool.close(SimpleNamespace(agent=SimpleNamespace(mail=mail), hosts=[0, 1],
                                   transport=mail.transport), {}, ("completed", "done"))
    assert _keys(store) == []
    for host in hosts:
        host.close()
    mail.transport.close()


def test_reports_whose_delete_failed_are_taken_on_the_next_pass():
    """A host's introduction not deleted (etcd did not answer) leaves the pass with the
    error and every report it read still waiting: before, they were dropped."""
    from recycle_planner.executor.control.store import StoreUnavailable

    class OneFailure(HeldDeletes):
        def transaction(self, compares, puts=(), deletes=(), delete_prefixes=()):
            if deletes and not self.go.is_set():
                self.go.set()
                raise StoreUnavailable("etcd did not answer")
            return self.store.transaction(compares, puts, deletes, delete_prefixes)

    store = OneFailure(MemoryStore())
    host = EtcdHost(store, PREFIX, node=0, groups=None)
    transport = EtcdCoordinator(store, PREFIX)
    host.push(_report(0, 0, msg.HostUp(0, "h", 1, (0,))))
    host.push(_report(0, 1, msg.CommError(1, 0)))
    with pytest.raises(StoreUnavailable):
        transport.take()
    assert len(transport.take()) == 2
    assert wait_for(lambda: _keys(store, f"{PREFIX}up/") == [], 5)
    transport.close()
