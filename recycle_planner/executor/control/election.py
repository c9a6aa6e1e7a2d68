"""Leader election on the control store, with fencing by the election's revision.

Two or more coordinators campaign; one leads, the others stand by. This is etcd's own recipe
(`clientv3/concurrency.Election`), written against `ControlStore` so that it runs on the
embedded store too:

1. A candidate takes a lease (`LeaseKeeper`) and writes `{prefix}{lease}` under it. The store
   numbers that write: the key's *create revision*.
2. The candidate whose key has the least create revision leads. Every other one watches only
   the key just before its own (no herd: one leader's loss wakes one candidate) and checks
   again when that key is deleted.
3. A leader that dies, or whose link to the store is cut, stops renewing its lease; the store
   deletes its key when the lease runs out, and the next candidate leads within the lease.

**Fencing.** A leader whose link was cut may not know yet that it was deposed, and may still
try to post a decision. Every write a leader makes as leader is a transaction that holds only
while its election key is the one created at the revision it won with (`Leadership.fence`):
once its lease ran out, that key is gone (or another one stands in its place), so the
deposed leader's write is refused by the store itself, whatever the leader believes. No split
brain: at most one coordinator's decisions land.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Iterable

from recycle_planner.executor.control.store import (DELETE, Compare, ControlStore, Entry,
                                                    LeaseKeeper, created_at)

log = logging.getLogger(__name__)


class Deposed(Exception):
    """This candidate's lease ended: it no longer leads (or never will in this campaign).
    `unreachable`: because the store stopped answering, not because the lease expired."""

    def __init__(self, reason: str, unreachable: bool = False):
        super().__init__(reason)
        self.unreachable = unreachable


@dataclass(frozen=True)
class Leadership:
    """Won: the election key and the revision it was created at."""

    key: str
    revision: int
    identity: str

    @property
    def fence(self) -> Compare:
        """The comparison every write of this leader carries."""
        return created_at(self.key, self.revision)


class Election:
    """One candidate in the election under `prefix` (see the module's docstring)."""

    def __init__(self, store: ControlStore, prefix: str, identity: str, ttl: float):
        self.store = store
        self.prefix = prefix
        self.identity = identity
        self.ttl = ttl
        self.deposed = threading.Event()
        self.reason = ""
        self._keeper: LeaseKeeper | None = None
        self.leadership: Leadership | None = None

    @property
    def lease(self) -> int:
        """This candidate's lease (from its campaign on): a leader's record that must vanish
        with its leadership is written under it."""
        assert self._keeper is not None, "campaign first"
        return self._keeper.lease

    def overdue(self) -> bool:
        """Its lease's renewal is overdue (`LeaseKeeper.overdue`): a leader must stop now,
        even before the renewal that hangs says so."""
        return self._keeper is not None and self._keeper.overdue()

    def _lost(self, reason: str) -> None:
        self.reason = reason
        self.deposed.set()

    def campaign(self, stop: threading.Event | None = None) -> Leadership | None:
        """Block until this candidate leads (its `Leadership`), `stop` is set (None), or its
        lease is lost (`Deposed`)."""
        self._keeper = LeaseKeeper(self.store, self.ttl, self._lost)
        key = f"{self.prefix}{self._keeper.lease:x}"
        self.store.put(key, self.identity, lease=self._keeper.lease)
        log.info("%s campaigns as %s", self.identity, key)
        while True:
            entries, read_at = self.store.get_prefix(self.prefix)
            own = next((e for e in entries if e.key == key), None)
            if own is None or self.deposed.is_set():
                raise self._deposed(f"election key {key} is gone")
            # its place is where the key was created, as read back: a put retried after its
            # answer was lost (`EtcdStore` retries) changed it again at a later revision
            mine = own.create_revision
            before = [e for e in entries if e.create_revision < mine]
            if not before:
                self.leadership = Leadership(key, mine, self.identity)
                log.info("%s leads (election revision %d)", self.identity, mine)
                return self.leadership
            if not self._wait_deleted(max(before, key=lambda e: e.create_revision), read_at,
                                      stop):
                return None

    def _wait_deleted(self, entry: Entry, read_at: int, stop: threading.Event | None) -> bool:
        """Wait until `entry` is deleted (True), or `stop` (False); `Deposed` if this
        candidate's own lease ends meanwhile."""
        watch = self.store.watch(entry.key, read_at + 1)
        try:
            while True:
                if stop is not None and stop.is_set():
                    return False
                if self.deposed.is_set():
                    raise self._deposed()
                event = watch.get(min(0.2, self.ttl / 4))
                if event is not None and event.kind == DELETE and event.key == entry.key:
                    return True
        finally:
            watch.cancel()

    def _deposed(self, reason: str = "") -> Deposed:
        keeper = self._keeper
        return Deposed(self.reason or reason, keeper is not None and keeper.unreachable)

    def leader(self) -> Entry | None:
        """Who leads now (the key with the least create revision), None when nobody
        campaigns."""
        entries, _ = self.store.get_prefix(self.prefix)
        return min(entries, key=lambda e: e.create_revision, default=None)

    def write(self, puts: Iterable[tuple[str, str, int]] = (), deletes: Iterable[str] = (),
              compares: Iterable[Compare] = (), delete_prefixes: Iterable[str] = ()) -> bool:
        """A leader's write: applied only while this candidate still leads (the fence) and
        the other comparisons hold."""
        if self.leadership is None:
            raise Deposed("not the leader")
        if self.deposed.is_set():
            raise self._deposed()
        return self.store.transaction([self.leadership.fence, *compares], puts, deletes,
                                      delete_prefixes)

    def resign(self) -> None:
        """Leave the election (the next candidate leads at once)."""
        if self._keeper is not None:
            self._keeper.close(revoke=True)
        self.leadership = None
