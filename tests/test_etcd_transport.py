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
    """A report the lost leader did not take waits under its key, addressed to it; its
    successor takes the reports addressed to itself only (the journal re-sent with the
    `Attach`), so an error in both counts once. The host's notice (its watch on the global
    bulletin) wakes on the successor's publication, which names another coordinator, without
    moving anywhere."""
    store = MemoryStore()
    host = EtcdHost(store, PREFIX, node=0, groups=None, to=1)
    old = RelayMail(EtcdCoordinator(store, PREFIX, to=1), nnodes=1, per_host=2, beat_every=1.0)
    host.push(_report(0, 0, msg.HostUp(0, "h", 1, (0, 1)), msg.CommError(1, 0)))
    old.refresh()
    assert old.count(msg.CommError, gen=1) == 1
    host.push(_report(0, 1, msg.CommError(1, 1)))       # the leader is lost before it reads
    first = Bulletin.from_json(host.bulletins(0)[0])
    new = RelayMail(EtcdCoordinator(store, PREFIX, to=2), nnodes=1, per_host=2, beat_every=1.0)
    assert host.wait_notice(first.version + 1, 1.0)      # its empty bulletins: a publication
    assert Bulletin.from_json(host.bulletins(0)[0]).by not in ("", first.by)
    EtcdHost(store, PREFIX, node=0, groups=None, to=2).push(_report(
        0, 2, msg.CommError(1, 0), msg.CommError(1, 1), msg.Attach(0, -1, "", ((0, 0), (1, 0)))))
    new.refresh()
    assert new.count(msg.CommError, gen=1) == 2 and new.host_seq[0] == 2
    assert wait_for(lambda: _keys(store, f"{PREFIX}up/2/") == [], 5)  # taken: gone
    host.close()


def test_a_third_coordinator_takes_the_journal_sent_to_it_only():
    """The host re-attached to a second coordinator, which was lost before it took the
    journal and the `Attach`; the third takes what the host sent it, once. Before, the second
    one's untaken `Attach` read as the host's introduction to the third, and the journal sent
    to the second counted again."""
    store = MemoryStore()
    errors = (msg.CommError(1, 0), msg.CommError(1, 1))
    EtcdHost(store, PREFIX, node=0, groups=None, to=2).push(_report(
        0, 2, *errors, msg.Attach(0, -1, "", ((0, 0), (1, 0)))))   # to the second: lost
    third = RelayMail(EtcdCoordinator(store, PREFIX, to=3), nnodes=1, per_host=2,
                      beat_every=1.0)
    EtcdHost(store, PREFIX, node=0, groups=None, to=3).push(_report(
        0, 3, *errors, msg.Attach(0, -1, "", ((0, 0), (1, 0)))))
    third.refresh()
    assert third.count(msg.CommError, gen=1) == 2


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
    on every coordinator pass. The reports are taken at once and deleted meanwhile."""
    store = HeldDeletes(MemoryStore())
    host = EtcdHost(store, PREFIX, node=0, groups=None)
    transport = EtcdCoordinator(store, PREFIX)
    host.push(_report(0, 0, msg.HostUp(0, "h", 1, (0,))))
    for seq in (1, 2, 3):
        host.push(_report(0, seq, msg.CommError(1, 0)))
    t0 = time.monotonic()
    assert len(transport.take()) == 4
    assert time.monotonic() - t0 < 5 and len(_keys(store, f"{PREFIX}up/")) == 4
    store.go.set()
    assert wait_for(lambda: _keys(store, f"{PREFIX}up/") == [], 5)
    transport.close()


def test_a_coordinator_starting_the_job_clears_what_an_earlier_run_left():
    """An earlier run of the same job (crashed, or a host agent that never said goodbye)
    left a `first` record and bulletins: a coordinator that starts the job removes them
    before anything (the record would win over this run's own); one taking over keeps what
    its predecessor left."""
    store = MemoryStore()
    host = EtcdHost(store, PREFIX, node=0, groups=None, to=1)
    RelayMail(EtcdCoordinator(store, PREFIX, to=1), nnodes=1, per_host=1, beat_every=1.0).flush()
    host.put_direct(msg.SwitchAt(1, 7))
    host.push(_report(0, 0, msg.HostUp(0, "h", 1, (0,))))          # never taken
    EtcdCoordinator(store, PREFIX, to=2).close()                  # taking over: kept
    assert _keys(store, f"{PREFIX}rec/") != [] and _keys(store, f"{PREFIX}bulletin/") != []
    mine = EtcdHost(store, PREFIX, node=0, groups=None, to=3)
    mine.push(_report(0, 0, msg.HostUp(0, "h", 1, (0,))))          # before its coordinator read
    fresh = EtcdCoordinator(store, PREFIX, to=3, fresh=True)
    assert _keys(store, f"{PREFIX}rec/") == _keys(store, f"{PREFIX}bulletin/") == []
    assert [k.split("/")[-2] for k in _keys(store, f"{PREFIX}up/")] == ["3"]  # its own only
    assert len(fresh.take()) == 1
    fresh.close()
    assert mine.put_direct(msg.SwitchAt(1, 9)) == msg.SwitchAt(1, 9)   # this run's own


class LostAnswers:
    """A store whose first transaction is applied but answered as if it failed, as when
    the client sends it again after its answer was lost and the comparison then fails."""

    def __init__(self, store):
        self.store, self.lost = store, 0

    def transaction(self, compares, puts=(), deletes=(), delete_prefixes=()):
        applied = self.store.transaction(compares, puts, deletes, delete_prefixes)
        if applied and not self.lost:
            self.lost += 1
            return self.store.transaction(compares, puts, deletes, delete_prefixes)
        return applied

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_count_whose_answer_was_lost_counts_once():
    """Before, the count read back after the failed comparison was counted on again: one
    communication error counted as two."""
    store = LostAnswers(MemoryStore())
    host = EtcdHost(store, PREFIX, node=0, groups=None)
    assert host.put_direct(msg.CommError(1, 0)) == 1 and store.lost == 1
    assert host.put_direct(msg.CommError(1, 1)) == 2


def test_a_coordinator_taking_over_deletes_the_reports_left_for_the_lost_one():
    """Before, the reports the lost leader had not taken stayed until the job's end (or the
    next run's start): the new leader never reads them (their content is in the journals
    the hosts re-send it), and now deletes them, off its start."""
    store = MemoryStore()
    EtcdHost(store, PREFIX, node=0, groups=None, to=1).push(_report(
        0, 0, msg.HostUp(0, "h", 1, (0,))))                       # never taken: lost with it
    mine = EtcdHost(store, PREFIX, node=0, groups=None, to=2)
    new = EtcdCoordinator(store, PREFIX, to=2)
    mine.push(_report(0, 1, msg.CommError(1, 0)))
    assert wait_for(lambda: [k.split("/")[-2] for k in _keys(store, f"{PREFIX}up/")] in
                    (["2"], []), 5)
    assert len(new.take()) == 1
    assert wait_for(lambda: _keys(store, f"{PREFIX}up/") == [], 5)
    new.close()


def test_a_coordinator_starts_with_its_bulletins_empty_in_one_transaction():
    """A coordinator taking over replaces what the lost one left in every host's bulletin
    (a host reads a missing one as empty) and names itself in the global one, in one
    transaction: writing each host's empty bulletin took three at 128 hosts."""
    store = MemoryStore()
    host = EtcdHost(store, PREFIX, node=1, groups=None, to=1)
    old = RelayMail(EtcdCoordinator(store, PREFIX, to=1), nnodes=2, per_host=1, beat_every=1.0)
    old.put(msg.Kill(1, 0))
    old.flush()
    assert msg.Kill.key_for(rank=1, incarnation=0) in Bulletin.from_json(host.bulletins(1)[1]).records
    counted = CountedWrites(store)
    new = RelayMail(EtcdCoordinator(counted, PREFIX, to=2), nnodes=2, per_host=1,
                    beat_every=1.0)
    everyone, mine = (Bulletin.from_json(b) for b in host.bulletins(1))
    assert everyone.by == new.by and everyone.version == 0 and mine.records == {}
    assert counted.bulletin_writes == 1
    new.transport.close()


class CountedWrites:
    """A store that counts the transactions that write bulletins."""

    def __init__(self, store):
        self.store, self.bulletin_writes = store, 0

    def transaction(self, compares, puts=(), deletes=(), delete_prefixes=()):
        puts = list(puts)
        if any("/bulletin/" in key for key, _, _ in puts):
            self.bulletin_writes += 1
        return self.store.transaction(compares, puts, deletes, delete_prefixes)

    def __getattr__(self, name):
        return getattr(self.store, name)
