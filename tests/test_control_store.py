"""One contract for both control stores: the embedded `MemoryStore` and `EtcdStore` on a real
etcd (started here on loopback ports; skipped with the reason when etcd is not installed)."""

import itertools
import threading
import time

import pytest

from recycle_planner.errors import RecycleError
from recycle_planner.executor.control.store import (DELETE, PUT, Compare, LeaseKeeper,
                                                    StoreRefused, absent, created_at,
                                                    parse_endpoints)


_names = itertools.count()


@pytest.fixture
def p():
    """A prefix of this test's own, so that tests sharing one etcd never meet."""
    return f"/t{next(_names)}-{time.monotonic_ns()}/"


def events_until(watch, n, timeout=5.0):
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        e = watch.get(deadline - time.monotonic())
        if e is not None:
            out.append(e)
    return out


def test_put_get_delete_and_revisions(store, p):
    r1 = store.put(p + "a", "1")
    r2 = store.put(p + "a", "2")
    assert r2 > r1
    e = store.get(p + "a")
    assert (e.value, e.create_revision, e.mod_revision) == ("2", r1, r2)
    assert store.revision() >= r2
    assert store.delete(p + "a") and not store.delete(p + "a")
    assert store.get(p + "a") is None


def test_prefix_reads_and_deletes_only_their_prefix(store, p):
    for k in ["b", "a", "c/d"]:
        store.put(p + "x/" + k, k)
    store.put(p + "y", "outside")
    entries, rev = store.get_prefix(p + "x/")
    assert [e.key for e in entries] == [p + "x/a", p + "x/b", p + "x/c/d"]
    assert rev >= max(e.mod_revision for e in entries)
    assert store.delete_prefix(p + "x/") == 3
    assert store.get_prefix(p + "x/")[0] == [] and store.get(p + "y").value == "outside"


def test_get_many_reads_each_key_at_one_revision(store, p):
    store.put(p + "a", "1")
    rev = store.put(p + "b", "2")
    (a, missing, b), read_at = store.get_many([p + "a", p + "none", p + "b"])
    assert (a.value, missing, b.value) == ("1", None, "2") and read_at >= rev
    assert store.get_many([]) == ([], store.revision())


def test_an_expired_lease_deletes_its_keys_and_watchers_see_it(store, p):
    lease = store.grant(1)
    store.put(p + "host/0", "up", lease=lease)
    _, rev = store.get_prefix(p)
    watch = store.watch(p, rev + 1)
    t0 = time.monotonic()
    [event] = events_until(watch, 1, timeout=6)
    took = time.monotonic() - t0
    watch.cancel()
    assert (event.kind, event.key) == (DELETE, p + "host/0")
    assert 0.5 < took < 4, took
    assert store.get(p + "host/0") is None
    assert store.keep_alive(lease) == 0


def test_kept_alive_lease_outlives_its_ttl_and_revoke_ends_it_at_once(store, p):
    lease = store.grant(1)
    store.put(p + "k", "v", lease=lease)
    for _ in range(6):
        time.sleep(0.3)
        assert store.keep_alive(lease) > 0
    assert store.get(p + "k").lease == lease
    store.revoke(lease)
    assert store.get(p + "k") is None


def test_watch_from_a_read_revision_misses_nothing_and_replays_nothing_earlier(store, p):
    store.put(p + "a", "before")
    _, rev = store.get_prefix(p)
    store.put(p + "a", "between")  # after the read, before the watch starts
    watch = store.watch(p, rev + 1)
    store.put(p + "b", "after")
    store.delete(p + "a")
    store.put(p.rstrip("/") + "-other/x", "not under the prefix")
    got = events_until(watch, 3)
    assert [(e.kind, e.key, e.value) for e in got] == [
        (PUT, p + "a", "between"), (PUT, p + "b", "after"), (DELETE, p + "a", "")]
    assert [e.revision for e in got] == sorted(e.revision for e in got)
    assert watch.get(0.2) is None
    watch.cancel()


def test_watch_from_now_sees_only_later_changes(store, p):
    store.put(p + "old", "1")
    watch = store.watch(p)
    store.put(p + "new", "2")
    assert [e.key for e in events_until(watch, 1)] == [p + "new"]
    watch.cancel()


def test_transaction_compare_and_put_decides_once(store, p):
    key = p + "gen1/decision"
    results = []
    barrier = threading.Barrier(4)

    def propose(i):
        barrier.wait()
        results.append((i, store.transaction([absent(key)], [(key, f"from {i}", 0)])))

    threads = [threading.Thread(target=propose, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, ok in results if ok]
    assert len(winners) == 1
    assert store.get(key).value == f"from {winners[0]}"


def test_a_fence_on_the_election_key_refuses_a_deposed_writer(store, p):
    lease = store.grant(5)
    leader = p + "election/a"
    rev = store.put(leader, "coordinator a", lease=lease)
    fence = created_at(leader, rev)
    assert store.transaction([fence], [(p + "decision", "a's", 0)])
    store.revoke(lease)                 # a is deposed (its lease ended) ...
    store.put(leader, "coordinator b")  # ... and the key is made again by someone else
    assert not store.transaction([fence], [(p + "decision", "a's late one", 0)])
    assert store.get(p + "decision").value == "a's"
    store.put(p + "ready/1/0", "r")
    store.put(p + "ready/1/1", "r")
    assert store.transaction([Compare(p + "decision", "value", "a's")], deletes=[p + "decision"],
                             delete_prefixes=[p + "ready/1/"])
    assert store.get(p + "decision") is None and store.get_prefix(p + "ready/")[0] == []


def test_a_put_under_an_unknown_lease_is_refused(store, p):
    lease = store.grant(1)
    store.revoke(lease)
    with pytest.raises(StoreRefused):
        store.put(p + "k", "v", lease=lease)
    assert store.get(p + "k") is None


def test_lease_keeper_holds_the_key_then_removes_it_when_closed(store, p):
    lost = []
    keeper = LeaseKeeper(store, 1, lost.append)
    store.put(p + "host/3", "up", lease=keeper.lease)
    time.sleep(2.2)
    assert store.get(p + "host/3") is not None and lost == []
    keeper.close()
    assert store.get(p + "host/3") is None  # no key lives longer than its holder


def test_lease_keeper_reports_a_lease_that_ended_under_it(store, p):
    lost = threading.Event()
    reasons = []
    keeper = LeaseKeeper(store, 1, lambda r: (reasons.append(r), lost.set()))
    store.revoke(keeper.lease)  # as when the store expired it during an outage
    assert lost.wait(3)
    assert "expired" in reasons[0]
    keeper.close()


def test_endpoints_are_checked():
    assert parse_endpoints("http://10.0.0.1:2379, [::1]:2380") == [("10.0.0.1", 2379),
                                                                   ("::1", 2380)]
    for bad in ["", "host", "host:port"]:
        with pytest.raises(RecycleError):
            parse_endpoints(bad)
