"""The control store: membership, leases and decisions, behind one interface with two homes.

What the control plane keeps between its processes (which hosts are alive, who leads, each
generation's decision) needs four things that a plain key-value store lacks, and that etcd
(the store Kubernetes, torch elastic's etcd rendezvous and Bamboo rest on) has:

- **leases**: a key written under a lease lives only while its holder keeps the lease alive
  (`keep_alive` within its TTL); when the holder dies, or its link does, the store deletes the
  key itself. A host's liveness is one key under one lease, not a heartbeat value that a
  reader must poll and judge on its own clock;
- **watches**: a reader is told of every change under a prefix, in revision order, from a
  revision it names (so nothing between its read and its watch is missed), instead of polling;
- **transactions**: a put that happens only if every comparison holds (`Compare`), in one
  step; the generation decision is written only if the writer still leads (the create
  revision of its election key is unchanged) and the generation's key is still free;
- **revisions**: every change has a number, the same on every reader.

`ControlStore` is that interface. `MemoryStore` is the embedded default, for a job on one
machine, where every control participant (the launcher is its own coordinator and host agent)
lives in one process: no network, no extra process, nothing to install. `EtcdStore` is etcd
itself, for a cluster job: three or five members outside the training hosts, replicated with
Raft, so that losing one changes nothing. Both pass one contract test suite
(`tests/test_control_store.py`).

A store that cannot answer (every endpoint down, or etcd has lost its quorum) raises
`StoreUnavailable` from every call, so that its caller can stop training with a consistent
checkpoint instead of waiting for TCP's own give-up.
"""

from __future__ import annotations

import base64
import heapq
import itertools
import json
import logging
import os
import queue
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

from recycle_planner.errors import RecycleError

log = logging.getLogger(__name__)

PUT, DELETE = "put", "delete"


class StoreUnavailable(RecycleError):
    """The control store cannot answer: its endpoints are down or etcd lost its quorum."""


class HistoryCompacted(StoreUnavailable):
    """A watch cannot resume: etcd compacted away the changes it was to be told of (it was
    away longer than etcd's `--auto-compaction-retention`)."""


class StoreRefused(RecycleError):
    """The control store answered no: a put under a lease that has expired, for example."""


@dataclass(frozen=True)
class Entry:
    """A key as the store holds it: its value, the revision that created it (0: absent), the
    revision of its last change, and the lease it lives under (0: none)."""

    key: str
    value: str
    create_revision: int
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True)
class Event:
    """A change under a watched prefix: `kind` is `put` or `delete`; `revision` is the store's
    revision of that change (`value` is empty for a delete)."""

    kind: str
    key: str
    value: str
    revision: int


@dataclass(frozen=True)
class Compare:
    """One comparison of a transaction: `target` of `key` (`create`: its create revision, 0
    when absent; `mod`: its last change; `value`) equals `expected`."""

    key: str
    target: str
    expected: int | str

    def holds(self, entry: Entry | None) -> bool:
        if self.target == "value":
            return entry is not None and entry.value == self.expected
        actual = 0 if entry is None else getattr(entry, f"{self.target}_revision")
        return actual == self.expected


def absent(key: str) -> Compare:
    """The transaction holds only while `key` does not exist."""
    return Compare(key, "create", 0)


def created_at(key: str, revision: int) -> Compare:
    """The transaction holds only while `key` is the one created at `revision` (a fence: the
    election key of the leader that won at that revision)."""
    return Compare(key, "create", revision)


class Watch(Protocol):
    """Changes under a prefix, in revision order."""

    def get(self, timeout: float) -> Event | None:
        """The next change, or None when none came within `timeout` seconds or the watch was
        cancelled (which wakes a blocked reader). Raises `StoreUnavailable` when the watch is
        broken and cannot be resumed."""

    def cancel(self) -> None:
        """Stop watching."""


class ControlStore(Protocol):
    """What the control plane needs of its store (see the module's docstring)."""

    def put(self, key: str, value: str, lease: int = 0) -> int:
        """Write `key`; returns the store's revision after the write."""

    def get(self, key: str) -> Entry | None:
        """The key, or None."""

    def get_prefix(self, prefix: str) -> tuple[list[Entry], int]:
        """Every key under `prefix` (sorted by key) and the revision they were read at: watch
        from that revision + 1 to miss nothing."""

    def get_many(self, keys: Sequence[str]) -> tuple[list[Entry | None], int]:
        """Each key (None where absent) as of one revision, and that revision: records that
        belong together are never read half before and half after a change."""

    def delete(self, key: str) -> bool:
        """Delete `key`; whether it existed."""

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under `prefix`; how many there were."""

    def grant(self, ttl: float) -> int:
        """A new lease of `ttl` seconds (rounded up to whole seconds on etcd)."""

    def keep_alive(self, lease: int) -> float:
        """Renew `lease` for its TTL; the seconds it now has, 0 when it already expired."""

    def revoke(self, lease: int) -> None:
        """End `lease` now: its keys are deleted."""

    def transaction(self, compares: Iterable[Compare], puts: Iterable[tuple[str, str, int]] = (),
                    deletes: Iterable[str] = (), delete_prefixes: Iterable[str] = ()) -> bool:
        """If every comparison holds, apply the puts (key, value, lease), the deletes and the
        prefix deletes as one change; whether they held. (etcd allows 128 operations in one
        transaction by default: a prefix delete is one, whatever it deletes.)"""

    def watch(self, prefix: str, start_revision: int = 0) -> Watch:
        """Changes under `prefix` from `start_revision` on (0: from now)."""

    def revision(self) -> int:
        """The store's current revision."""

    def close(self) -> None:
        """Release connections and threads (leases are left to expire)."""


# -- the embedded default ------------------------------------------------------------------------

HISTORY = 100_000
"""How many changes a `MemoryStore` keeps for watches that start in the past (etcd keeps its
own until compaction)."""


class _MemoryWatch:
    def __init__(self, store: "MemoryStore", prefix: str):
        self.store = store
        self.prefix = prefix
        self.events: queue.Queue[Event | None] = queue.Queue()

    def get(self, timeout: float) -> Event | None:
        try:
            return self.events.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None

    def cancel(self) -> None:
        self.store._unwatch(self)
        self.events.put(None)  # wakes a reader blocked in get


class MemoryStore:
    """`ControlStore` in this process: a dict, a revision counter, leases on the monotonic
    clock (one timer thread deletes the keys of an expired lease), and watchers fed under the
    same lock as the change, so that they see changes in revision order."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._data: dict[str, Entry] = {}
        self._revision = 0
        self._history: deque[Event] = deque(maxlen=HISTORY)
        self._watches: list[_MemoryWatch] = []
        self._leases: dict[int, tuple[float, float]] = {}   # id -> (ttl, deadline)
        self._deadlines: list[tuple[float, int]] = []        # heap of (deadline, id)
        self._ids = itertools.count(1)
        self._closed = False
        threading.Thread(target=self._expire_loop, name="memory-store-leases",
                         daemon=True).start()

    # changes, under the lock
    def _change(self, kind: str, key: str, value: str = "", lease: int = 0) -> None:
        self._revision += 1
        if kind == PUT:
            old = self._data.get(key)
            created = old.create_revision if old is not None else self._revision
            self._data[key] = Entry(key, value, created, self._revision, lease)
        else:
            del self._data[key]
        event = Event(kind, key, value, self._revision)
        self._history.append(event)
        for watch in self._watches:
            if key.startswith(watch.prefix):
                watch.events.put(event)

    def put(self, key: str, value: str, lease: int = 0) -> int:
        with self._lock:
            self._check_lease(lease)
            self._change(PUT, key, value, lease)
            return self._revision

    def _check_lease(self, lease: int) -> None:
        if lease and lease not in self._leases:
            raise StoreRefused(f"lease {lease:x} not found (expired or revoked)")

    def get(self, key: str) -> Entry | None:
        with self._lock:
            return self._data.get(key)

    def get_prefix(self, prefix: str) -> tuple[list[Entry], int]:
        with self._lock:
            return ([self._data[k] for k in sorted(self._data) if k.startswith(prefix)],
                    self._revision)

    def get_many(self, keys: Sequence[str]) -> tuple[list[Entry | None], int]:
        with self._lock:
            return [self._data.get(k) for k in keys], self._revision

    def delete(self, key: str) -> bool:
        with self._lock:
            if key not in self._data:
                return False
            self._change(DELETE, key)
            return True

    def delete_prefix(self, prefix: str) -> int:
        with self._lock:
            keys = [k for k in sorted(self._data) if k.startswith(prefix)]
            for key in keys:
                self._change(DELETE, key)
            return len(keys)

    def grant(self, ttl: float) -> int:
        with self._lock:
            lease = next(self._ids)
            self._renew(lease, ttl)
            return lease

    def _renew(self, lease: int, ttl: float) -> None:
        deadline = time.monotonic() + ttl
        self._leases[lease] = (ttl, deadline)
        heapq.heappush(self._deadlines, (deadline, lease))
        self._lock.notify_all()

    def keep_alive(self, lease: int) -> float:
        with self._lock:
            if lease not in self._leases:
                return 0.0
            ttl, _ = self._leases[lease]
            self._renew(lease, ttl)
            return ttl

    def revoke(self, lease: int) -> None:
        with self._lock:
            self._end_lease(lease)

    def _end_lease(self, lease: int) -> None:
        if self._leases.pop(lease, None) is None:
            return
        for key in [k for k, e in self._data.items() if e.lease == lease]:
            self._change(DELETE, key)

    def _expire_loop(self) -> None:
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, lease = heapq.heappop(self._deadlines)
                    held = self._leases.get(lease)
                    if held is not None and held[1] <= now:
                        self._end_lease(lease)
                wait = self._deadlines[0][0] - now if self._deadlines else None
                self._lock.wait(wait)

    def transaction(self, compares: Iterable[Compare], puts: Iterable[tuple[str, str, int]] = (),
                    deletes: Iterable[str] = (), delete_prefixes: Iterable[str] = ()) -> bool:
        with self._lock:
            if not all(c.holds(self._data.get(c.key)) for c in compares):
                return False
            puts = list(puts)
            for _, _, lease in puts:
                self._check_lease(lease)
            for key, value, lease in puts:
                self._change(PUT, key, value, lease)
            for key in deletes:
                if key in self._data:
                    self._change(DELETE, key)
            for prefix in delete_prefixes:
                for key in [k for k in sorted(self._data) if k.startswith(prefix)]:
                    self._change(DELETE, key)
            return True

    def watch(self, prefix: str, start_revision: int = 0) -> Watch:
        watch = _MemoryWatch(self, prefix)
        with self._lock:
            if start_revision:
                if self._history and start_revision < self._history[0].revision:
                    raise RecycleError(f"revision {start_revision} is no longer kept (the "
                                       f"oldest is {self._history[0].revision})")
                for event in self._history:
                    if event.revision >= start_revision and event.key.startswith(prefix):
                        watch.events.put(event)
            self._watches.append(watch)
        return watch

    def _unwatch(self, watch: _MemoryWatch) -> None:
        with self._lock:
            if watch in self._watches:
                self._watches.remove(watch)

    def revision(self) -> int:
        with self._lock:
            return self._revision

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._watches.clear()
            self._lock.notify_all()


# -- etcd ------------------------------------------------------------------------------------------

def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str | None) -> str:
    return base64.b64decode(text or "").decode()


def _prefix_end(prefix: str) -> str:
    """etcd's range end for a prefix: the prefix with its last byte incremented."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return bytes(raw).decode()


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """`HOST:PORT[,HOST:PORT...]` (an `http://` or `https://` in front is allowed) as (host,
    port) pairs."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        host, _, port = item.removeprefix("http://").removeprefix("https://").rpartition(":")
        if not host or not port.isdigit():
            raise RecycleError(f"etcd endpoint {item!r} is not HOST:PORT")
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise RecycleError("no etcd endpoint given")
    return out


def _https(text: str) -> bool:
    """Whether endpoints are named with `https://` (all or none of them)."""
    schemes = {item.strip().startswith("https://") for item in text.split(",")}
    if len(schemes) > 1:
        raise RecycleError(f"etcd endpoints {text!r} mix https:// and http://: give one")
    return schemes == {True}


@dataclass(frozen=True)
class EtcdTls:
    """TLS to etcd: the CA that signed its members' certificates (`ca`, None: the system's),
    and this client's certificate and key, for members that ask for one
    (`--client-cert-auth`). Read from etcdctl's own variables, so that a machine set up for
    `etcdctl` is set up for this: every process of the job (coordinators, host agents,
    their wrappers) inherits them."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    ENV = ("ETCDCTL_CACERT", "ETCDCTL_CERT", "ETCDCTL_KEY")

    @classmethod
    def from_env(cls) -> "EtcdTls | None":
        """None when none of the variables is set; a one-line `RecycleError` when a file is
        missing, or only one of a certificate and its key is given."""
        values = [os.environ.get(name) or None for name in cls.ENV]
        if not any(values):
            return None
        for name, path in zip(cls.ENV, values):
            if path is not None and not os.path.isfile(path):
                raise RecycleError(f"{name}={path}: no such file")
        if (values[1] is None) != (values[2] is None):
            raise RecycleError("ETCDCTL_CERT and ETCDCTL_KEY go together: give both or neither")
        return cls(*values)


class _EtcdWatch:
    """One watch stream of etcd's JSON gateway, read on its own thread. A stream that breaks
    (its member died), or that stays silent for the store's `timeout`, is resumed on the next
    endpoint from the next revision, so that no change is lost; when no endpoint takes it
    within the `timeout`, `get` raises.

    Silence is how a member that cannot serve looks from here: a member cut off from its
    peers keeps its streams open but hears of no change (etcd ends a stream that asked for a
    leader, `hasleader`, once its member has had none for three election timeouts), and a
    member whose machine vanished closes nothing at all. Healthy streams are not silent: each
    asks for etcd's progress notifications, sent to a quiet watch at the member's
    `--experimental-watch-progress-notify-interval` (run etcd with it below the timeout,
    docs/runtime-engines.md; at etcd's default of 10 minutes a quiet stream is resumed
    every `timeout`, which costs one request and loses nothing). A notification also says
    that every change up to its revision was sent, so a resumed stream starts after it."""

    def __init__(self, store: "EtcdStore", prefix: str, start_revision: int):
        self.store = store
        self.prefix = prefix
        self.next_revision = start_revision
        self.events: queue.Queue[Event | BaseException | None] = queue.Queue()
        self.member = ""              # HOST:PORT of the member whose stream is open
        self._cancelled = False
        self._response = None
        self._opened = threading.Event()
        threading.Thread(target=self._run, name="etcd-watch", daemon=True).start()
        self._opened.wait(store.timeout)

    def _run(self) -> None:
        failed_since: float | None = None
        while not self._cancelled:
            try:
                self._stream()
            except Exception as exc:  # a broken or silent stream of any kind: resume or give up
                if self._cancelled:
                    return
                if failed_since is None or self._opened.is_set():  # a new break since it served
                    failed_since = time.monotonic()
                    self._opened.clear()
                gone = isinstance(exc, HistoryCompacted)
                if gone or time.monotonic() - failed_since > self.store.timeout:
                    error = HistoryCompacted if gone else StoreUnavailable
                    self.events.put(error(f"etcd watch on {self.prefix!r}: "
                                          f"{_first_line(exc)}"))
                    return
                log.info("etcd watch on %r at %s broke (%s): resuming from revision %d",
                         self.prefix, self.member, _first_line(exc), self.next_revision)
                self.store._rotate()
                time.sleep(0.05)

    def _stream(self) -> None:
        client = self.store._client()
        self.member = f"{client.host}:{client.port}"
        request = {"key": _b64(self.prefix), "range_end": _b64(_prefix_end(self.prefix)),
                   "progress_notify": True}
        if self.next_revision:
            request["start_revision"] = self.next_revision
        response = client.session.post(client.get_url("/watch"),
                                       json={"create_request": request}, stream=True,
                                       headers={"Grpc-Metadata-hasleader": "true"},
                                       timeout=(self.store.timeout, self.store.timeout))
        self._response = response
        if response.status_code != 200:
            raise StoreUnavailable(f"watch refused: {response.status_code} {response.reason}")
        for line in response.iter_lines(chunk_size=None):
            if self._cancelled:
                return
            if line.strip():
                self._take(json.loads(line))
        raise StoreUnavailable("watch stream ended")

    def _take(self, message: dict) -> None:
        """One message of the stream: its events, in order, or what it says of the stream."""
        if "error" in message:
            raise StoreUnavailable(f"etcd ended the watch: {_first_line(str(message['error']))}")
        result = message.get("result", {})
        if result.get("canceled"):
            compacted = int(result.get("compact_revision", 0))
            if compacted:
                raise HistoryCompacted(f"etcd compacted its history past revision "
                                       f"{self.next_revision} (to {compacted}): the watch was "
                                       f"away longer than etcd keeps changes")
            raise StoreUnavailable(f"watch cancelled by etcd: {result.get('cancel_reason')}")
        if result.get("created"):
            self._opened.set()
            return
        events = result.get("events", ())
        for raw in events:
            kv = raw["kv"]
            revision = int(kv.get("mod_revision", 0))
            kind = DELETE if raw.get("type") == "DELETE" else PUT
            self.events.put(Event(kind, _unb64(kv["key"]), _unb64(kv.get("value")), revision))
            self.next_revision = revision + 1
        if not events:  # a progress notification: every change up to its revision was sent
            revision = int(result.get("header", {}).get("revision", 0))
            self.next_revision = max(self.next_revision, revision + 1)

    def get(self, timeout: float) -> Event | None:
        try:
            item = self.events.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            self.events.put(item)
            raise item
        return item

    def cancel(self) -> None:
        self._cancelled = True
        self.events.put(None)  # wakes a reader blocked in get
        response = self._response
        if response is not None:
            try:
                response.raw._fp.fp.raw._sock.shutdown(2)  # wake the reading thread now
            except Exception:  # already closed, or another urllib3 layout
                pass
            response.close()


class EtcdStore:
    """`ControlStore` on an etcd cluster (3.4 or later) through its v3 JSON gateway, with the
    `etcd3gw` client (see docs/runtime-engines.md for why this client). Every call goes to one
    endpoint and moves to the next when that one cannot be reached or does not answer within
    half the `timeout`; a call that no endpoint answers within `timeout` seconds raises
    `StoreUnavailable` (etcd answers only with a quorum: reads are linearizable, so a minority
    member answers nothing). Choose `timeout` above etcd's leader election (its
    `--election-timeout`, 1 s by default), or losing etcd's leader looks like losing etcd."""

    def __init__(self, endpoints: str | list[tuple[str, int]], timeout: float = 5.0,
                 tls: EtcdTls | None = None):
        """`endpoints` with `https://`, or `tls` (by default `EtcdTls.from_env()`): over TLS."""
        import etcd3gw  # the one optional import of this module: only a cluster job needs it

        self._etcd3gw = etcd3gw
        self.endpoints = parse_endpoints(endpoints) if isinstance(endpoints, str) else endpoints
        self.timeout = timeout
        tls = tls or EtcdTls.from_env()
        https = tls is not None or isinstance(endpoints, str) and _https(endpoints)
        self._clients = [etcd3gw.client(host=h, port=p, timeout=timeout / 2, api_path="/v3/",
                                        protocol="https" if https else "http",
                                        **(_tls_args(tls) if tls else {}))
                         for h, p in self.endpoints]
        if tls is not None and tls.ca is not None:
            for client in self._clients:  # else requests takes REQUESTS_CA_BUNDLE over it
                client.session.trust_env = False
        self._current = random.randrange(len(self._clients))  # clients spread over members

    def _client(self):
        return self._clients[self._current % len(self._clients)]

    def _rotate(self) -> None:
        self._current = (self._current + 1) % len(self._clients)

    def _call(self, fn: Callable) -> dict:
        """`fn(client)` on the current endpoint, then on the others; StoreUnavailable when
        none answers within the timeout."""
        exceptions = self._etcd3gw.exceptions
        deadline = time.monotonic() + self.timeout
        last: BaseException | None = None
        while True:
            for _ in range(len(self._clients)):
                try:
                    return fn(self._client())
                except (exceptions.ConnectionFailedError, exceptions.ConnectionTimeoutError,
                        exceptions.InternalServerError) as exc:
                    last = exc
                    self._rotate()
                except exceptions.Etcd3Exception as exc:
                    raise StoreRefused(f"etcd: {_etcd_reason(exc)}") from None
                if time.monotonic() > deadline:
                    break
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        raise StoreUnavailable(f"etcd at {self._where()}: {_etcd_reason(last)}")

    def _where(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def _post(self, path: str, body: dict) -> dict:
        return self._call(lambda c: c.post(c.get_url(path), json=body))

    def put(self, key: str, value: str, lease: int = 0) -> int:
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = lease
        return int(self._post("/kv/put", body)["header"]["revision"])

    def get(self, key: str) -> Entry | None:
        found = self._range({"key": _b64(key)})[0]
        return found[0] if found else None

    def get_prefix(self, prefix: str) -> tuple[list[Entry], int]:
        return self._range({"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix)),
                            "sort_order": 1, "sort_target": 0})

    def get_many(self, keys: Sequence[str]) -> tuple[list[Entry | None], int]:
        """One transaction of reads (no comparison: it always holds), served at one
        revision."""
        result = self._post("/kv/txn", {"success": [{"request_range": {"key": _b64(k)}}
                                                    for k in keys]})
        found = [result_range.get("response_range", {}).get("kvs", ())
                 for result_range in result.get("responses", ())]
        return ([_entry(kvs[0]) if kvs else None for kvs in found],
                int(result["header"]["revision"]))

    def _range(self, body: dict) -> tuple[list[Entry], int]:
        result = self._post("/kv/range", body)
        return ([_entry(kv) for kv in result.get("kvs", ())],
                int(result["header"]["revision"]))

    def delete(self, key: str) -> bool:
        return int(self._post("/kv/deleterange", {"key": _b64(key)}).get("deleted", 0)) > 0

    def delete_prefix(self, prefix: str) -> int:
        return int(self._post("/kv/deleterange", {"key": _b64(prefix), "range_end":
                                                  _b64(_prefix_end(prefix))}).get("deleted", 0))

    def grant(self, ttl: float) -> int:
        return int(self._post("/lease/grant", {"TTL": max(1, int(-(-ttl // 1))), "ID": 0})["ID"])

    def keep_alive(self, lease: int) -> float:
        result = self._post("/lease/keepalive", {"ID": lease})
        return float(result.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        try:
            self._post("/kv/lease/revoke", {"ID": lease})
        except StoreRefused:
            pass  # already expired: its keys are gone, which is what revoking wants

    def transaction(self, compares: Iterable[Compare], puts: Iterable[tuple[str, str, int]] = (),
                    deletes: Iterable[str] = (), delete_prefixes: Iterable[str] = ()) -> bool:
        body = {"compare": [_compare(c) for c in compares],
                "success": [{"request_put": {"key": _b64(k), "value": _b64(v),
                                             **({"lease": lease} if lease else {})}}
                            for k, v, lease in puts]
                + [{"request_delete_range": {"key": _b64(k)}} for k in deletes]
                + [{"request_delete_range": {"key": _b64(p), "range_end": _b64(_prefix_end(p))}}
                   for p in delete_prefixes],
                "failure": []}
        return bool(self._post("/kv/txn", body).get("succeeded", False))

    def watch(self, prefix: str, start_revision: int = 0) -> Watch:
        return _EtcdWatch(self, prefix, start_revision)

    def revision(self) -> int:
        return self._range({"key": _b64("\0"), "count_only": True})[1]

    def members(self) -> list[str]:
        """The client URLs of the cluster's members, as etcd lists them."""
        result = self._post("/cluster/member/list", {})
        return [url for m in result.get("members", ()) for url in m.get("clientURLs", ())]

    def close(self) -> None:
        for client in self._clients:
            client.session.close()


def _tls_args(tls: EtcdTls) -> dict:
    return {"ca_cert": tls.ca, "cert_cert": tls.cert, "cert_key": tls.key}


def _entry(kv: dict) -> Entry:
    return Entry(_unb64(kv["key"]), _unb64(kv.get("value")), int(kv.get("create_revision", 0)),
                 int(kv.get("mod_revision", 0)), int(kv.get("lease", 0)))


_TARGETS = {"create": ("CREATE", "create_revision"), "mod": ("MOD", "mod_revision"),
            "value": ("VALUE", "value")}


def _compare(c: Compare) -> dict:
    target, field = _TARGETS[c.target]
    expected = _b64(c.expected) if c.target == "value" else c.expected
    return {"key": _b64(c.key), "result": "EQUAL", "target": target, field: expected}


def _etcd_reason(exc: BaseException | None) -> str:
    if exc is None:
        return "no answer"
    detail = getattr(exc, "detail_text", None)
    if detail:
        try:
            return json.loads(detail).get("error") or json.loads(detail).get("message") or detail
        except (ValueError, AttributeError):
            return _first_line(detail)
    return _first_line(exc)


def _first_line(exc: BaseException | str) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


# -- one lease kept alive ----------------------------------------------------------------------

class LeaseKeeper:
    """Keeps one lease alive from its own thread (renewed every third of its TTL, so that two
    lost renewals in a row still leave time). When a renewal finds the lease expired, or none
    has succeeded for the TTL (the store is gone, or this process's link to it), the holder
    can no longer count on its keys: `on_lost(reason)` is called once and the thread ends."""

    def __init__(self, store: ControlStore, ttl: float, on_lost: Callable[[str], None]):
        self.store = store
        self.ttl = ttl
        self.on_lost = on_lost
        self.lease = store.grant(ttl)
        self.confirmed = time.monotonic()   # the latest renewal the store confirmed
        self.lost: str | None = None
        self.unreachable = False  # lost because the store did not answer (not an expiry)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._thread.start()

    def overdue(self) -> bool:
        """No renewal confirmed for the TTL (judged by this process's clock, also while a
        renewal hangs on a cut link): the store has let the lease go, or is about to."""
        return time.monotonic() - self.confirmed >= self.ttl

    def _run(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                if self.store.keep_alive(self.lease) <= 0:
                    return self._lose(f"lease {self.lease:x} expired")
                self.confirmed = time.monotonic()
            except StoreUnavailable as exc:
                if self.overdue():
                    self.unreachable = True
                    return self._lose(f"lease {self.lease:x} not renewed for {self.ttl:g} s: "
                                      f"{exc}")

    def _lose(self, reason: str) -> None:
        if self._stop.is_set():
            return
        self.lost = reason
        log.warning("%s", reason)
        self.on_lost(reason)

    def close(self, revoke: bool = True) -> None:
        """Stop renewing; with `revoke`, end the lease now so its keys go at once."""
        self._stop.set()
        if revoke and self.lost is None:
            try:
                self.store.revoke(self.lease)
            except StoreUnavailable:
                pass  # it expires by itself within its TTL
