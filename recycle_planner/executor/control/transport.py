"""What a host's relay and the coordinator's mail carry between them, whatever carries it:
one interface per side, implemented on the coordinator's c10d store.

- `HostTransport`, the host agent's side (`relay.Relay`): push a report, read the two
  bulletins and block until the next notice, read a record, put a direct record between
  workers by its rule, count a rank's incarnations. Every call may block (a cut link): the
  relay makes them on threads of its own (`relay.StoreCalls`, and its notice thread), never
  on its loop.
- `CoordinatorTransport`, the coordinator's side (`mail.RelayMail`): take the reports that
  arrived, publish bulletins and wake the hosts (also as its beat, with nothing changed), post
  a record hosts read by key (a decision), and delete what is no longer needed.

`C10dHost` and `C10dCoordinator` carry it on the coordinator's c10d store (`TCPStore`): the
reports in one queue (`UP_QUEUE`), the bulletins under their keys, a notice key per version
that wakes every host blocked in the store's `wait`, the direct records under their own keys
(see `relay.py` for why each)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

from recycle_planner.executor.control import messages as msg

log = logging.getLogger(__name__)

UP_QUEUE = "relay/up"
"""The coordinator's queue of `HostReport`s."""
GLOBAL_BULLETIN = "relay/all"
"""The bulletin for every host: aborts, decisions, join requests, finish, the outcome."""


def host_bulletin(node: int) -> str:
    """The bulletin for host `node` only: its workers' welcomes and kill notices."""
    return f"relay/host/{node}"


def notice_key(version: int) -> str:
    """Created when the bulletins reach `version`: the key every host waits on."""
    return f"relay/v/{version}"


class HostTransport(Protocol):
    def push(self, report: str) -> None:
        """Hand a `HostReport` (JSON) to the coordinator."""

    def read(self, key: str) -> str | None:
        """The record under `key` (a decision, a direct record), or None."""

    def put_direct(self, message: msg.Message) -> Any:
        """Write a record between workers by its rule (`messages.put`): the count for `count`,
        the winning record for `first`, else None."""

    def next_incarnation(self, rank: int) -> int:
        """The incarnation of `rank` to spawn next (`messages.next_incarnation`)."""

    def bulletins(self, node: int) -> tuple[str, str]:
        """The global bulletin and host `node`'s (JSON), as of one moment."""

    def wait_notice(self, version: int, timeout: float) -> bool:
        """Block until the bulletins reach `version` (True) or `timeout` seconds pass
        (False); a failure raises `RuntimeError` or `OSError`."""

    def close(self) -> None:
        """Done with this coordinator (the relay moved on, or stops): a blocked
        `wait_notice` returns soon."""


class CoordinatorTransport(Protocol):
    def start(self, empty: str, nodes: int) -> None:
        """Publish version 0: the global bulletin and each of the `nodes` hosts' `empty`
        (naming this coordinator), replacing whatever a lost coordinator left there."""

    def take(self) -> list[str]:
        """The reports (JSON) that arrived since the last call, in arrival order."""

    def publish(self, version: int, bulletins: Sequence[tuple[str, str]]) -> None:
        """Write `bulletins` (key, JSON), then wake the hosts to `version` (nothing else
        changed: the coordinator's beat)."""

    def post(self, key: str, text: str) -> None:
        """Write a record hosts read by key (a decision)."""

    def delete(self, keys: Sequence[str]) -> None:
        """Remove these keys (direct records of a forgotten iteration)."""

    def delete_prefixed(self, prefixes: tuple[str, ...]) -> None:
        """Remove every key under these prefixes (an old generation's)."""

    def raise_incarnations(self, rank: int, first: int) -> None:
        """Make `first` at least the next incarnation of `rank` given out, for a rank no host
        runs (`messages.count_incarnations_from`)."""

    def end(self) -> None:
        """The job is over and every host said goodbye: remove what is left of the traffic."""


class C10dHost:
    """A host's side on the coordinator's c10d store: `store` for the calls, `notices` (a
    second client) for the blocking waits, so that a wait never holds up a call."""

    def __init__(self, store: Any, notices: Any):
        self.store, self.notices = store, notices

    def push(self, report: str) -> None:
        self.store.queue_push(UP_QUEUE, report)

    def read(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def put_direct(self, message: msg.Message) -> Any:
        return msg.put(self.store, message)

    def next_incarnation(self, rank: int) -> int:
        return msg.next_incarnation(self.store, rank)

    def bulletins(self, node: int) -> tuple[str, str]:
        everyone, mine = self.notices.multi_get([GLOBAL_BULLETIN, host_bulletin(node)])
        return everyone, mine

    def wait_notice(self, version: int, timeout: float) -> bool:
        import torch.distributed as dist

        try:
            self.notices.wait([notice_key(version)], timedelta(seconds=timeout))
        except dist.DistStoreError as exc:
            if "timeout" not in str(exc).lower():
                raise
            return False
        return True

    def close(self) -> None:
        """Nothing to release: the clients close when dropped, and a wait ends with the
        coordinator's next beat or the lease (`relay.Relay.close` waits that long)."""


class C10dCoordinator:
    """The coordinator's side on its own c10d store."""

    def __init__(self, store: Any):
        self.store = store

    def start(self, empty: str, nodes: int) -> None:
        """Every key written: a host's read of a missing one would wait for it."""
        self.publish(0, [(key, empty) for key in
                         (GLOBAL_BULLETIN, *(host_bulletin(n) for n in range(nodes)))])

    def take(self) -> list[str]:
        return [self.store.queue_pop(UP_QUEUE, False)
                for _ in range(self.store.queue_len(UP_QUEUE))]

    def publish(self, version: int, bulletins: Sequence[tuple[str, str]]) -> None:
        """The bulletins, then the notice key of `version`; the one two versions back leaves
        (a host waits on the next version of the bulletins it read)."""
        self.store.multi_set([k for k, _ in bulletins], [v for _, v in bulletins])
        self.store.set(notice_key(version), "")
        if version >= 2:
            self.store.delete_key(notice_key(version - 2))

    def post(self, key: str, text: str) -> None:
        self.store.set(key, text)

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.store.delete_key(key)

    def delete_prefixed(self, prefixes: tuple[str, ...]) -> None:
        delete_prefixed(self.store, prefixes)

    def raise_incarnations(self, rank: int, first: int) -> None:
        msg.count_incarnations_from(self.store, rank, first)

    def end(self) -> None:
        """Nothing to remove: the store ends with the coordinator's process."""


def delete_prefixed(store: Any, prefixes: tuple[str, ...]) -> None:
    """Remove every key of a c10d `store` under these prefixes."""
    if prefixes:
        for key in store.list_keys():
            if key.startswith(prefixes):
                store.delete_key(key)


# -- on etcd (`store.ControlStore`) ---------------------------------------------------------------

def _up(prefix: str, to: int | None = None) -> str:
    """The reports' keys: all of them, or those addressed to coordinator `to`."""
    return f"{prefix}up/" if to is None else f"{prefix}up/{to}/"


def _bulletin(prefix: str, name: str) -> str:
    return f"{prefix}bulletin/{name}"


def _record(prefix: str, key: str) -> str:
    return f"{prefix}rec/{key}"


def _count(store: Any, key: str) -> int:
    """Add one to the count under `key` (absent: 0) by compare-and-set; the new count. The
    count is written with a token of this call's: a transaction the client sent again after
    its answer was lost (`store.EtcdStore` tries another member) and that had been applied
    fails its comparison, and the count read back is found to be this call's own, not
    counted again (raced by another counter in between, it would be)."""
    import uuid

    from recycle_planner.executor.control.store import Compare, absent

    token = uuid.uuid4().hex[:12]
    for _ in range(16):  # raced only by the same record's other counters
        entry = store.get(key)
        held, _, by = entry.value.partition(" ") if entry is not None else ("0", "", "")
        if by == token:
            return int(held)
        guard = absent(key) if entry is None else Compare(key, "mod", entry.mod_revision)
        if store.transaction([guard], [(key, f"{int(held) + 1} {token}", 0)]):
            return int(held) + 1
    raise RuntimeError(f"the count under {key!r} kept changing")


@contextlib.contextmanager
def _as_failure() -> Iterator[None]:
    """A control store's failure as the relay takes any transport's: a `RuntimeError`."""
    from recycle_planner.executor.control.store import StoreRefused, StoreUnavailable

    try:
        yield
    except (StoreUnavailable, StoreRefused) as exc:
        raise RuntimeError(str(exc)) from exc


class EtcdHost:
    """A host's side on etcd, every key under the job's `prefix`: a report is a key of its own
    under `up/{to}/`, addressed to the coordinator published at revision `to` (0: the only one),
    deleted by it once taken (what no coordinator took goes with the job's end,
    `EtcdCoordinator.end`); the bulletins are two keys the host reads, and the notice is the
    watch on the global one (each publication rewrites it), resumed from the revision the
    bulletins were read at, so no publication is missed; the direct records and the decisions
    are keys under `rec/`, a `first` one created only if absent, a count raised by
    compare-and-set. The keys are the same whoever leads: a coordinator taking over reads what
    its predecessor left. The ranks' incarnations are counted where the current coordinator's
    process groups form (its c10d store, which `groups` gives: a coordinator that starts the
    run again counts from 0, as without etcd, and the protocol takes an incarnation above 0
    for a restarted worker). A new leader's store counts from 0 too: `counted` (rank -> the
    latest incarnation this host spawned) is what it is raised past before this host counts
    that rank there, when a worker is restarted, not when the host re-attaches. So a host
    that re-attaches makes no call on the new store, which is still starting (before, 128
    hosts dialled it at once and raised 8 counts each, one by one on its one thread: most of
    a takeover's 1.8 s per host at 1,024 ranks); `groups` dials it when it is first needed."""

    def __init__(self, store: Any, prefix: str, node: int, groups: Callable[[], Any],
                 to: int = 0, counted: Mapping[int, int] | None = None):
        import uuid

        self.store, self.prefix, self.node, self.to = store, prefix, node, to
        self.groups = groups
        self.behind = dict(counted or {})  # rank -> the latest incarnation: not raised yet
        self.sender = f"{node:06d}-{uuid.uuid4().hex[:8]}"  # a restarted host's keys differ
        self.seq = 0
        self.read_at = 0          # the revision the bulletins were last read at
        self._watch: Any = None
        self._closed = False

    def push(self, report: str) -> None:
        with _as_failure():
            self.store.put(f"{_up(self.prefix, self.to)}{self.sender}-{self.seq:012d}", report)
        self.seq += 1

    def read(self, key: str) -> str | None:
        with _as_failure():
            entry = self.store.get(_record(self.prefix, key))
        return entry.value if entry is not None else None

    def put_direct(self, message: msg.Message) -> Any:
        with _as_failure():
            return self._put_direct(message)

    def _put_direct(self, message: msg.Message) -> Any:
        key, text = _record(self.prefix, message.key()), message.to_json()
        if message.RULE == msg.COUNT:
            return _count(self.store, key)
        if message.RULE == msg.FIRST:
            from recycle_planner.executor.control.store import absent

            if not self.store.transaction([absent(key)], [(key, text, 0)]):
                held = self.store.get(key)
                text = held.value if held is not None else text
            return type(message).from_json(text)
        self.store.put(key, text)
        return None

    def next_incarnation(self, rank: int) -> int:
        groups = self.groups()
        if rank in self.behind:
            msg.count_incarnations_from(groups, rank, self.behind[rank] + 1)
            del self.behind[rank]
        return msg.next_incarnation(groups, rank)

    def bulletins(self, node: int) -> tuple[str, str]:
        with _as_failure():
            return self._bulletins(node)

    def _bulletins(self, node: int) -> tuple[str, str]:
        from recycle_planner.executor.control.relay import Bulletin

        (everyone, mine), read_at = self.store.get_many(
            [_bulletin(self.prefix, "all"), _bulletin(self.prefix, f"host/{node}/")])
        empty = Bulletin().to_json()
        if self._watch is None:
            self._watch = self.store.watch(_bulletin(self.prefix, "all"), read_at + 1)
        self.read_at = read_at
        return (everyone.value if everyone is not None else empty,
                mine.value if mine is not None else empty)

    def wait_notice(self, version: int, timeout: float) -> bool:
        """A publication after the bulletins were read (every one rewrites the global
        bulletin); events the last read already saw are skipped."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and not self._closed:
            with _as_failure():
                event = self._watch.get(left)
            if event is not None and event.revision > self.read_at:
                return True
        return False

    def close(self) -> None:
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()


class EtcdCoordinator:
    """The coordinator's side on etcd (see `EtcdHost`): it watches the reports addressed to
    it (`to`: the revision its leader's publication was written at, which the hosts found it
    by) from the revision it read them at, and takes them as the watch brings them (no read
    per pass), deleting each once taken; it publishes the bulletins in one transaction. The
    reports' keys outlive a coordinator, and what a host sent a lost one (left there, or
    sent before the host noticed the change) is in the journal the host re-sends with its
    `Attach` (`relay.Journal`): taken from both, a count would count twice. So a coordinator
    takes only the reports addressed to it, however many coordinators were lost before it.
    Every write carries `fence` (`election.Leadership.fence`, where an election exists): a
    deposed coordinator's writes are refused by etcd itself (`election.Deposed`). `groups`:
    the c10d store the generations' process groups form in, whose keys leave with their
    generation's records. `fresh`: it starts the job (it takes over from none), so what an
    earlier run of the same job left (a crashed one's, or one whose host agents did not all
    say goodbye) goes first: its records and bulletins are not this run's (a `first` record
    left there would win over this run's own), nor are reports addressed to another
    coordinator (never read, they would stay until the job's end). Taking over, it deletes
    the reports addressed to the coordinators before it too, off its start
    (`_clear_left`): what they held is in the journals the hosts re-send to it."""

    def __init__(self, store: Any, prefix: str, fence: Any = None, groups: Any = None,
                 to: int = 0, fresh: bool = False):
        self.store, self.prefix, self.groups = store, prefix, groups
        self.compares = [fence] if fence is not None else []
        if fresh:
            self._write(delete_prefixes=[_record(prefix, ""), _bulletin(prefix, "")])
            self._delete(self._left_for_others(to))
        entries, read_at = store.get_prefix(_up(prefix, to))  # sent before it read
        self.waiting = [(e.key, e.value)             # (key, report), until taken
                        for e in sorted(entries, key=lambda e: e.create_revision)]
        self.watch = store.watch(_up(prefix, to), read_at + 1)
        self._reaping: queue.Queue[list[str] | None] = queue.Queue()
        threading.Thread(target=self._reap, name="relay-reap", daemon=True).start()
        if not fresh:
            threading.Thread(target=self._clear_left, args=(to,), name="relay-left",
                             daemon=True).start()

    def _left_for_others(self, to: int) -> list[str]:
        """The keys of the reports addressed to coordinators other than `to`."""
        left, _ = self.store.get_prefix(_up(self.prefix))
        return [e.key for e in left if not e.key.startswith(_up(self.prefix, to))]

    def _clear_left(self, to: int) -> None:
        """Hand the reaper the reports addressed to other coordinators (lost ones: a later
        one would have deposed this one, whose deletes etcd then refuses)."""
        from recycle_planner.executor.control.store import StoreRefused, StoreUnavailable

        try:
            self._reaping.put(self._left_for_others(to))
        except (StoreUnavailable, StoreRefused) as exc:
            log.warning("the reports left for the lost coordinator stay: %s", exc)

    def _write(self, puts: Sequence[tuple[str, str, int]] = (), deletes: Sequence[str] = (),
               delete_prefixes: Sequence[str] = ()) -> None:
        from recycle_planner.executor.control.election import Deposed

        if not self.store.transaction(self.compares, puts, deletes, delete_prefixes):
            raise Deposed("the coordinator's write was fenced off: another one leads")

    def take(self) -> list[str]:
        """What arrived since the last call. The reports taken are deleted on a thread of
        their own (`_reap`), not on the coordinator's pass, which they held up by a round
        trip to etcd's leader per 100 (a pass of 11 to 15 ms at 32 hosts against under
        1 ms): addressed to this coordinator, no other takes them meanwhile."""
        from recycle_planner.executor.control.store import PUT

        while (event := self.watch.get(0)) is not None:
            if event.kind == PUT:
                self.waiting.append((event.key, event.value))
        taken, self.waiting = self.waiting, []
        if taken:
            self._reaping.put([key for key, _ in taken])
        return [value for _, value in taken]

    def _delete(self, keys: Sequence[str]) -> None:
        for start in range(0, len(keys), 100):  # etcd takes 128 operations a transaction
            self._write(deletes=keys[start:start + 100])

    def _reap(self) -> None:
        """Delete the reports `take` queued, until `close`. A failure loses nothing: what is
        left goes with the job's `end`, and no other coordinator takes them."""
        from recycle_planner.executor.control.election import Deposed
        from recycle_planner.executor.control.store import StoreRefused, StoreUnavailable

        while (keys := self._reaping.get()) is not None:
            try:
                self._delete(keys)
            except (Deposed, StoreUnavailable, StoreRefused) as exc:
                log.warning("%d taken reports were not deleted: %s", len(keys), exc)

    def start(self, empty: str, nodes: int) -> None:
        """One transaction: the global bulletin, and the hosts' deleted (a host reads a
        missing one as empty). Writing 128 empty ones took 3 transactions, 1.3 s of a
        takeover at 1,024 ranks with etcd starved on 2 cores."""
        self._write([(_bulletin(self.prefix, "all"), empty, 0)],
                    delete_prefixes=[_bulletin(self.prefix, "host/")])

    def publish(self, version: int, bulletins: Sequence[tuple[str, str]]) -> None:
        """One transaction: the hosts' watch on the global bulletin (the last) wakes them."""
        def name(key: str) -> str:
            if key == GLOBAL_BULLETIN:
                return "all"
            return f"host/{key.rsplit('/', 1)[1]}/"
        puts = [(_bulletin(self.prefix, name(k)), v, 0) for k, v in bulletins]
        for start in range(0, len(puts) - 1, 100):
            self._write(puts[start:start + 100])
        self._write(puts[-1:])

    def post(self, key: str, text: str) -> None:
        self._write([(_record(self.prefix, key), text, 0)])

    def delete(self, keys: Sequence[str]) -> None:
        self._delete([_record(self.prefix, k) for k in keys])

    def delete_prefixed(self, prefixes: tuple[str, ...]) -> None:
        if prefixes:
            self._write(delete_prefixes=[_record(self.prefix, p) for p in prefixes])
            if self.groups is not None:
                delete_prefixed(self.groups, prefixes)

    def raise_incarnations(self, rank: int, first: int) -> None:
        msg.count_incarnations_from(self.groups, rank, first)

    def end(self) -> None:
        """Every key of the job's traffic, in one fenced transaction: they outlive a
        coordinator, not the job."""
        self._write(delete_prefixes=[self.prefix])

    def close(self) -> None:
        self.watch.cancel()
        self._reaping.put(None)
