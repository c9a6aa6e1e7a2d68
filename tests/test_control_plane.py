"""Election, membership and decisions on both control stores (in one process; the real-process
failover on a 3-member etcd is in test_control_failover.py)."""

import sys
import threading
import time

import pytest

from recycle_planner.executor.control.election import Deposed, Election
from recycle_planner.executor.control.failover import stand_by_or_lead
from helpers.waiting import wait_for
from recycle_planner.executor.control.plane import HostMember, HostRecord, Keys, Leader
from recycle_planner.executor.control.store import MemoryStore

PIPELINES, STAGES, PER_HOST = 3, 2, 2   # 3 hosts, each one whole pipeline


_jobs = iter(range(10**6))


@pytest.fixture
def keys():
    return Keys(f"job{next(_jobs)}-{time.monotonic_ns()}")


def lookup(dead):
    return f"plan-dead-{len(dead)}", 0.0


def hosts(store, keys, n=PIPELINES, steps=lambda: 7):
    return [HostMember(store, keys, HostRecord(i, f"h{i}", tuple(range(i * PER_HOST,
                                                                       (i + 1) * PER_HOST))),
                       1, lambda i=i: {r: steps() for r in range(i * PER_HOST,
                                                                 (i + 1) * PER_HOST)})
            for i in range(n)]


def coordinators(store, keys, names, stop, decisions):
    threads = [threading.Thread(target=stand_by_or_lead, daemon=True,
                                args=(store, keys, name, 1, PIPELINES, STAGES, lookup, stop),
                                kwargs={"on_decision": decisions.append}) for name in names]
    for t in threads:
        t.start()
    return threads


def test_one_candidate_leads_and_the_next_leads_when_it_resigns(store, keys):
    a = Election(store, keys.election, "a", 1)
    b = Election(store, keys.election, "b", 1)
    won_a = a.campaign()
    got = []
    t = threading.Thread(target=lambda: got.append(b.campaign()))
    t.start()
    time.sleep(0.3)
    assert got == [] and a.leader().value == "a"
    a.resign()
    t.join(5)
    assert got and got[0].revision > won_a.revision and b.leader().value == "b"
    b.resign()
    assert b.leader() is None


class PutTwice:
    """A store that applies every put twice: a put retried after its answer was lost."""

    def __init__(self, store):
        self.store = store

    def put(self, key, value, lease=0):
        self.store.put(key, value, lease)
        return self.store.put(key, value, lease)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_candidate_whose_put_was_applied_twice_leads_and_writes(store, keys):
    """Before, it took the second put's revision for its place: it waited for its own key to
    go (never, while it lived) and, had it led, its fence held no write."""
    a = Election(PutTwice(store), keys.election, "a", 1)
    stop = threading.Event()
    threading.Timer(5, stop.set).start()
    try:
        assert a.campaign(stop) is not None
        assert a.write([(keys.root + "x", "1", 0)])
    finally:
        stop.set()
        a.resign()


def test_a_deposed_leaders_writes_are_refused(store, keys):
    a = Election(store, keys.election, "a", 1)
    a.campaign()
    assert a.write([(keys.decision, "from a", 0)])
    store.revoke(a._keeper.lease)           # a's lease ran out while it was cut off
    b = Election(store, keys.election, "b", 1)
    b.campaign()
    a.deposed.clear()                       # a has not noticed yet: the store refuses anyway
    assert not a.write([(keys.decision, "late, from a", 0)])
    assert b.write([(keys.decision, "from b", 0)])
    assert store.get(keys.decision).value == "from b"
    b.resign()
    a._keeper.close(revoke=False)


def test_host_loss_gives_every_survivor_the_next_decision(store, keys):
    stop, decisions = threading.Event(), []
    threads = coordinators(store, keys, ["c0", "c1"], stop, decisions)
    members = hosts(store, keys)
    try:
        assert wait_for(lambda: all(m.decision and m.decision.gen == 1 for m in members), 10)
        first = members[0].decision
        assert (first.action, first.members, first.plan) == ("run", tuple(range(6)),
                                                            "plan-dead-0")
        members[2].close(leave=False)   # host 2 vanishes: its lease runs out
        t0 = time.monotonic()
        assert wait_for(lambda: all(m.decision.gen == 2 for m in members[:2]), 10)
        took = time.monotonic() - t0
        second = members[0].decision
        assert second.members == (0, 1, 2, 3) and second.dead == ((2, 0), (2, 1))
        assert (second.restart, second.plan) == (7, "plan-dead-2")
        assert took < 1 + 2.5, took      # the lease (1 s) plus the reports and the decision
        # (a host may hear of the decision before its writer's call returns)
        assert wait_for(lambda: len(decisions) >= 2, 15)
        time.sleep(0.2)
        assert [d.gen for d in decisions] == [1, 2]  # each generation decided once
        assert store.get(keys.host(2)) is None
        assert store.get_prefix(keys.root + "ready/")[0] == []  # reports gone with their use
    finally:
        stop.set()
        for m in members[:2]:
            m.close()
        for t in threads:
            t.join(5)
    assert store.get_prefix(keys.election)[0] == [] and store.get_prefix(keys.hosts)[0] == []


def test_a_new_leader_finishes_the_collection_its_predecessor_started(store, keys):
    members = hosts(store, keys)
    first = Election(store, keys.election, "first", 1)
    first.campaign()
    leader = Leader(first, keys, PIPELINES, STAGES, lookup)
    leader._load()
    leader._settle()                       # every host is up: abort 0 ("start")
    assert wait_for(lambda: len(store.get_prefix(keys.ready(0))[0]) == 3, 15)
    first.resign()                         # gone before deciding generation 1
    stop, decisions = threading.Event(), []
    threads = coordinators(store, keys, ["second"], stop, decisions)
    try:
        assert wait_for(lambda: all(m.decision and m.decision.gen == 1 for m in members), 10)
        assert wait_for(lambda: decisions, 15)
        time.sleep(0.3)
        assert [d.gen for d in decisions] == [1]
    finally:
        stop.set()
        for m in members:
            m.close()
        for t in threads:
            t.join(5)


def test_a_host_sees_the_store_go_as_lost(keys):
    store = MemoryStore()
    lost = threading.Event()
    member = HostMember(store, keys, HostRecord(0, "h0", (0, 1)), 1, dict,
                        on_lost=lambda reason: lost.set())
    store.revoke(member.keeper.lease)
    assert lost.wait(3) and "expired" in member.lost
    member.close()


def test_writing_without_leading_is_refused(keys):
    with pytest.raises(Deposed):
        Election(MemoryStore(), keys.election, "x", 1).write([("k", "v", 0)])


def test_lead_then_publishes_the_leaders_store_and_stops_a_deposed_leader(store, keys):
    from recycle_planner.executor.control.failover import (DEPOSED, lead_then,
                                                           published_coordinator)

    release = {name: threading.Event() for name in "ab"}
    deposed, results = [], {}

    def coordinator(name):
        results[name] = lead_then(store, keys, name, 1, f"{name}.example:29400",
                                  lambda previous: (release[name].wait(10), (name, previous))[1],
                                  on_deposed=lambda code: (deposed.append((name, code)),
                                                           release[name].set()))

    first = threading.Thread(target=coordinator, args=("a",))
    first.start()
    assert published_coordinator(store, keys, 5)[0] == "a.example:29400"
    second = threading.Thread(target=coordinator, args=("b",))
    second.start()
    time.sleep(0.3)
    assert "b" not in results and store.get(keys.coordinator).value == "a.example:29400"
    leader = Election(store, keys.election, "observer", 1).leader()
    store.revoke(leader.lease)            # a's lease ran out: it must stop coordinating
    first.join(5)
    assert deposed == [("a", DEPOSED)]
    assert wait_for(lambda: _value(store, keys.coordinator) == "b.example:29400", 15)
    release["b"].set()
    second.join(5)
    assert results == {"a": ("a", None), "b": ("b", "a.example:29400")}
    assert store.get_prefix(keys.election)[0] == []
    # the publication ends with the leadership: no host agent dials a lost leader's store
    assert store.get(keys.coordinator) is None
    assert _value(store, keys.led) == "b.example:29400"


def test_a_run_after_one_that_ended_starts_afresh_not_as_its_takeover(store, keys):
    """The job's end deletes `Keys.led` with its outcome: a second run under the same name
    is its own first leader (before, it took over the ended run's store)."""
    from recycle_planner.executor.control.failover import Outcome, lead_then

    def run():
        return lead_then(store, keys, "a", 1, "a.example:29400", lambda previous: previous,
                         ended=lambda previous: Outcome(0, "a"))

    assert run() is None
    assert store.get(keys.led) is None and store.get(keys.outcome) is not None
    assert run() is None


def test_a_host_agent_finds_the_next_leader_or_the_same_one_still_leading(store, keys):
    """A host agent that lost its coordinator takes the next leader's publication, or the
    same leader's if it still stands `same_after` on: its key lives under the leader's
    election lease, so a lost leader's is gone by then and the next one's is awaited."""
    from recycle_planner.errors import RecycleError
    from recycle_planner.executor.control.failover import lead_then, published_coordinator

    release = {name: threading.Event() for name in "ab"}

    def coordinator(name):
        lead_then(store, keys, name, 1, f"{name}.example:29400",
                  lambda previous: release[name].wait(10),
                  on_deposed=lambda code: release[name].set())

    threads = [threading.Thread(target=coordinator, args=("a",))]
    threads[0].start()
    endpoint, revision = published_coordinator(store, keys, 5)
    with pytest.raises(RecycleError):  # only a later one was asked for
        published_coordinator(store, keys, 0.3, revision)
    t = time.monotonic()
    assert published_coordinator(store, keys, 5, revision, same_after=0.3) == (endpoint,
                                                                                revision)
    assert time.monotonic() - t >= 0.3
    store.revoke(Election(store, keys.election, "observer", 1).leader().lease)  # a is lost
    threads.append(threading.Thread(target=coordinator, args=("b",)))
    threads[1].start()
    endpoint, later = published_coordinator(store, keys, 10, revision, same_after=0.1)
    assert endpoint == "b.example:29400" and later > revision
    release["b"].set()
    for thread in threads:
        thread.join(10)


def _value(store, key):
    entry = store.get(key)
    return None if entry is None else entry.value


def test_a_standby_leaves_with_the_leaders_status_when_the_job_ends(store, keys, tmp_path):
    """The leader's coordinator ends by itself (here: status 7): its end is published and
    the standby leaves with the same status instead of taking over a finished run."""
    from recycle_planner.executor.control.failover import Outcome, coordinate

    told = tmp_path / "told"
    command = [sys.executable, "-c", "import sys; word = sys.stdin.readline().strip(); "
               "open(sys.argv[1], 'a').write(word + '\\n') if word else None; "
               "sys.exit(7 if word else 0)", str(told)]
    results = {}

    def coordinator(name):
        results[name] = coordinate(store, keys, name, 2, f"{name}.example:29400", command)

    threads = [threading.Thread(target=coordinator, args=(n,)) for n in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == {"a": 7, "b": 7}
    told = [line.split() for line in told.read_text().splitlines()]
    assert [word for word, _ in told] == ["lead"]  # one coordinator led; none took over
    assert int(told[0][1]) > 0                     # told its leader's publication
    outcome = Outcome.from_json(store.get(keys.outcome).value)
    assert outcome.code == 7 and outcome.by in "ab"
    assert store.get(keys.led) is None  # nothing is left to take over


def test_a_coordinator_writes_under_its_own_leaders_publication_only(store, keys):
    """Its fence is the revision its leader's publication was written at, as its leader told
    it, never one read later: read after a next leader published, it would be that one's, and
    the deposed coordinator's writes would land."""
    from dataclasses import replace

    from recycle_planner.executor.control.failover import HostLeases

    leases = HostLeases("unused", keys.job, 1.0, publication=store.put(keys.coordinator, "a:1"))
    leases.__dict__["_store"] = store     # (its etcd, here the test's store)
    mine = leases.relay(None, fresh=False)
    mine.post("k", "1")
    store.put(keys.coordinator, "b:1")   # the next leader's publication
    with pytest.raises(Deposed):
        mine.post("k", "2")
    with pytest.raises(Deposed):
        replace(leases, publication=0).relay(None, fresh=False)  # not told: does not lead
    mine.close()


def test_host_leases_are_held_while_their_hosts_live(store, keys):
    from recycle_planner.executor.control.failover import HostLeases
    from recycle_planner.executor.control.plane import HostRecord

    first = HostLeases.hold(store, keys, HostRecord(0, "h0", (0, 1)), 1)
    second = HostLeases.hold(store, keys, HostRecord(1, "h1", (2, 3)), 1)

    def held():
        return {HostRecord.from_json(e.value).node
                for e in store.get_prefix(keys.hosts)[0]}

    assert held() == {0, 1}
    store.revoke(second.keeper.lease)  # a lapse (etcd did not answer for a lease): taken again
    assert wait_for(lambda: held() == {0, 1} and second.keeper.lost is None, 10)
    second.close(revoke=False)  # host 1 vanishes: nothing renews its lease
    assert wait_for(lambda: held() == {0}, 10)
    time.sleep(1.5)  # a lease longer than its TTL: still held while renewed
    assert held() == {0}
    first.close()  # a host that leaves: its key goes at once
    assert held() == set()
