"""A worker's channel to the control plane: the seam between control and data in a worker.

Everything a worker says to the control plane, or hears from it, crosses a `Link` as a typed
record of `messages.py`: it says hello and waits to be welcomed, waits for each generation's
`Decision`, reports when it leaves a generation (`Ready`), finishes an iteration, writes a
checkpoint or meets a bug; it is told to abort a generation, to leave it at an iteration
boundary, or that the job is finished. The data plane (`executor/data/`) never reads a control
key: it receives the decision, an abort call, and a c10d store for forming the generation's
process groups (`group_store`).

The link runs its own threads: one that only sends heartbeats (a slow abort or a long step
never delays a beat) and one that watches for the abort of the generation the worker is in and
hands it to `on_abort`, which must not block (the worker aborts on yet another thread). When
the control plane cannot be reached within the lease, every call raises `ControlLost` and
`on_abort` is called, so that a training thread blocked on a peer is released and the worker
can stop with a checkpoint. A worker whose own host agent is lost (`orphaned`: stopped, hung
or dead, while the coordinator may well go on without this host) stops without writing
anything instead: the survivors hold its stage's state.

Two implementations:

- `StoreLink`, over the launcher's c10d `TCPStore` (one machine): every worker writes its
  records under their keys and polls for aborts and decisions;
- `HostLink`, over a Unix domain socket to the worker's host agent (cluster jobs,
  `relay.py`): the host agent holds one lease for the whole host, relays the worker's records
  in per-host batches and pushes aborts and answers to it; the coordinator's store is used
  only to form each generation's process groups.

`link_from_env` picks the one the worker's environment names.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Protocol, TypeVar

from recycle_planner.errors import RecycleError
from recycle_planner.executor.config import LEASE
from recycle_planner.executor.control import messages as msg
from recycle_planner.executor.control.pause import PauseClock
from recycle_planner.executor.control.protocol import Decision, decision_key

log = logging.getLogger(__name__)

M = TypeVar("M", bound=msg.Message)


LOST = "control lost"
"""The reason `on_abort` is given when the control plane cannot be reached."""


class ControlLost(RecycleError):
    """The control plane cannot be reached: no decision can come, so the worker stops with a
    checkpoint (`--resume` continues)."""


class Link(Protocol):
    """A worker's side of the control plane. `orphaned`: the control plane was lost because
    this worker's own host agent went silent or away, not because the coordinator did."""

    orphaned: bool

    def send(self, message: msg.Message) -> Any:
        """Report `message` (the `first`/`count` rule's result, see `messages.put`)."""

    def wait(self, kind: type[M], abort: threading.Event | None = None, **ids: Any) -> M | None:
        """Block until the record of `kind` named by `ids` is there; None if `abort` is set
        first."""

    def peek(self, kind: type[M], **ids: Any) -> M | None:
        """The record if it is there now, else None."""

    def decision(self, gen: int) -> Decision:
        """Block until generation `gen`'s decision is posted."""

    def group_store(self, decision: Decision) -> Any:
        """The c10d store the members of `decision` form their process groups in."""

    def watch(self, beat: Callable[[], msg.Heartbeat], watched: Callable[[], int],
              on_abort: Callable[[int, str], None]) -> None:
        """Start the heartbeat and abort-watch threads: `beat()` is the next heartbeat,
        `watched()` the generation the worker is in (-1: none), `on_abort(gen, reason)`
        is called once per abandoned generation, and with reason `LOST` when the control
        plane is gone."""

    def close(self) -> None:
        """Stop the threads (the worker is leaving)."""


class StoreLink:
    """The link over a c10d `TCPStore` that the launcher (or coordinator) hosts: records are
    written under their keys; waiting is polling every `poll` seconds. The watch threads use
    their own connections whose timeout is the lease, so that a lost store is noticed within
    the lease rather than at TCP's own give-up. The store is the launcher's own: there is no
    host agent in between to lose (`orphaned` is always False)."""

    orphaned = False

    def __init__(self, host: str, port: int, timeout: float, lease: float, heartbeat: float,
                 poll: float):
        import torch.distributed as dist

        self._dist = dist
        self.where = f"{host}:{port}"
        self.poll = poll
        self.heartbeat = heartbeat
        self.store = self._connect(host, port, timeout)
        self._beat_store = self._connect(host, port, timeout, then=lease)
        self._watch_store = self._connect(host, port, timeout, then=lease)
        self.lost: str | None = None
        self._closed = False

    @classmethod
    def from_env(cls, config) -> "StoreLink":
        """The launcher's store, from torchrun's MASTER_ADDR and MASTER_PORT."""
        return cls(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                   config.pg_timeout, config.lease, config.heartbeat, config.poll)

    def _connect(self, host: str, port: int, timeout: float, then: float | None = None):
        """A connection made within `timeout` (a loaded host can take seconds to accept),
        whose calls then time out after `then` seconds (the lease, for the watch threads)."""
        try:
            store = self._dist.TCPStore(host, port, is_master=False,
                                        timeout=timedelta(seconds=timeout))
            if then is not None:
                store.set_timeout(timedelta(seconds=then))
            return store
        except (self._dist.DistError, RuntimeError) as exc:
            raise ControlLost(f"cannot reach the store at {host}:{port}: "
                              f"{_first_line(exc)}") from None

    def _call(self, fn: Callable[[], Any]) -> Any:
        if self.lost is not None:
            raise ControlLost(self.lost)
        try:
            return fn()
        except (self._dist.DistError, RuntimeError) as exc:
            self.lost = self.lost or f"store at {self.where}: {_first_line(exc)}"
            raise ControlLost(self.lost) from None

    def send(self, message: msg.Message) -> Any:
        return self._call(lambda: msg.put(self.store, message))

    def peek(self, kind: type[M], **ids: Any) -> M | None:
        return self._call(lambda: msg.get(self.store, kind, **ids))

    def wait(self, kind: type[M], abort: threading.Event | None = None, **ids: Any) -> M | None:
        key = kind.key_for(**ids)
        while not self._call(lambda: self.store.check([key])):
            if abort is not None and abort.is_set():
                return None
            time.sleep(self.poll)
        return self._call(lambda: kind.from_json(self.store.get(key)))

    def decision(self, gen: int) -> Decision:
        key = decision_key(gen)
        while not self._call(lambda: self.store.check([key])):
            time.sleep(self.poll)
        return Decision.from_json(self._call(lambda: self.store.get(key)))

    def group_store(self, decision: Decision) -> Any:
        return self.store

    def watch(self, beat: Callable[[], msg.Heartbeat], watched: Callable[[], int],
              on_abort: Callable[[int, str], None]) -> None:
        threading.Thread(target=self._beats, args=(beat, watched, on_abort),
                         name="recycle-heartbeat", daemon=True).start()
        threading.Thread(target=self._aborts, args=(watched, on_abort),
                         name="recycle-control", daemon=True).start()

    def _beats(self, beat, watched, on_abort) -> None:
        while not self._closed:
            try:
                msg.put(self._beat_store, beat())
            except (self._dist.DistError, RuntimeError) as exc:
                return self._lose(exc, watched, on_abort)
            time.sleep(self.heartbeat)

    def _aborts(self, watched, on_abort) -> None:
        seen = -1
        while not self._closed:
            gen = watched()
            try:
                if gen > seen and gen >= 0:
                    notice = msg.get(self._watch_store, msg.Abort, gen=gen)
                    if notice is not None:
                        seen = gen
                        on_abort(gen, notice.reason)
            except (self._dist.DistError, RuntimeError) as exc:
                return self._lose(exc, watched, on_abort)
            time.sleep(min(0.02, self.heartbeat))

    def _lose(self, exc: BaseException, watched, on_abort) -> None:
        if self._closed or self.lost is not None:
            return
        self.lost = f"store at {self.where}: {_first_line(exc)}"
        on_abort(watched(), LOST)

    def close(self) -> None:
        self._closed = True


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


class HostLink:
    """The link to the worker's host agent over the Unix domain socket at `path`
    (`relay.Relay`): length-prefixed JSON frames of the records. One thread reads the socket
    (answers to the calls blocked in `wait`/`decision`, aborts pushed by the host agent,
    and its word that the coordinator is lost); one sends a heartbeat every `heartbeat`
    seconds, which the host agent judges against the lease. The reader also judges the host
    agent's silence by this process's clock, after reading: the agent sends a frame at least
    every quarter of the `lease` (`relay.Relay`'s beat), so nothing for a lease means it is
    stopped, hung or gone (its socket is not closed when it is stopped), and the link is lost,
    `orphaned`. The process groups are formed in the current coordinator's store
    (`group_store`: the host agent names it; at first torchrun's MASTER_ADDR and
    MASTER_PORT)."""

    def __init__(self, path: str, rank: int, incarnation: int, master: tuple[str, int],
                 timeout: float, heartbeat: float, lease: float = LEASE):
        from recycle_planner.executor.control import relay

        self._relay = relay
        self.where = path
        self.heartbeat = heartbeat
        self.timeout = timeout
        self.master = master
        self.lease = lease
        self.lost: str | None = None
        self.orphaned = False
        self._heard = time.monotonic()           # when the host agent last sent anything
        self._closed = False
        self._ids = itertools.count()
        self._answers: dict[int, list] = {}      # id -> [event, record JSON]
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._on_abort: Callable[[int, str], None] | None = None
        self._watched: Callable[[], int] = lambda: -1
        self._aborts: list[tuple[int, str]] = []  # pushed before `watch` was called
        self._store = None
        try:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(path)
        except OSError as exc:
            raise ControlLost(f"cannot reach the host agent at {path}: {exc}") from None
        self._put({"op": "hi", "rank": rank, "incarnation": incarnation})
        threading.Thread(target=self._read, name="recycle-relay", daemon=True).start()

    @classmethod
    def from_env(cls, config) -> "HostLink":
        from recycle_planner.executor.control.relay import RELAY_ENV

        return cls(os.environ[RELAY_ENV], int(os.environ["RANK"]),
                   int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                   (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
                   config.pg_timeout, config.heartbeat, config.lease)

    # the socket
    def _put(self, frame: dict) -> None:
        if self.lost is not None:
            raise ControlLost(self.lost)
        try:
            with self._send_lock:
                self.sock.sendall(self._relay.encode(frame))
        except OSError as exc:
            self._lose(f"host agent at {self.where}: {exc}")
            raise ControlLost(self.lost) from None

    def _read(self) -> None:
        """Read the host agent's frames and judge its silence, in this one thread and in that
        order: after a stretch in which this thread could not run (this process paused, or a
        busy training thread holding the GIL), what the agent sent meanwhile is read before
        its silence is judged (`pause.PauseClock`)."""
        frames = self._relay.Frames()
        clock = PauseClock()
        while not self._closed:
            try:
                ready = select.select([self.sock], [], [], min(0.1, self.lease / 8))[0]
                data = self.sock.recv(1 << 16) if ready else None
            except (OSError, ValueError) as exc:  # ValueError: closed by `close`
                return self._lose(f"host agent at {self.where}: {exc}")
            if data == b"":
                return self._lose(f"host agent at {self.where}: it closed the connection")
            if data:
                self._heard = time.monotonic()
                for frame in frames.feed(data):
                    self._dispatch(frame)
            if self.lost is None:
                self._judge(clock)

    def _judge(self, clock: PauseClock) -> None:
        """The host agent's silence, by this process's clock, counted from the end of a pause
        of this process (see the class)."""
        now, paused = clock.look()
        if paused:
            self._heard = max(self._heard, now)
        silent = now - self._heard
        if silent > self.lease:
            self._lose(f"host agent at {self.where}: nothing from it for {silent:.1f} s "
                       f"(lease {self.lease:g} s): stopped, hung or gone")

    def _dispatch(self, frame: dict) -> None:
        push = frame.get("push")
        if push == "abort":
            with self._lock:
                on_abort = self._on_abort
                if on_abort is None:
                    self._aborts.append((frame["gen"], frame["reason"]))
            if on_abort is not None:
                on_abort(frame["gen"], frame["reason"])
        elif push == "lost":  # the host agent's word: the coordinator is lost
            self._lose(frame["reason"], orphaned=False)
        elif push == "beat":  # the host agent is alive (`_read` noted when)
            pass
        else:
            with self._lock:
                slot = self._answers.get(frame["id"])
            if slot is not None:
                slot[1] = frame["rec"]
                slot[0].set()

    def _lose(self, reason: str, orphaned: bool = True) -> None:
        """The control plane is lost: by the host agent's word that the coordinator is
        (`orphaned` False), or because the host agent itself is silent or gone."""
        with self._lock:  # one verdict: the first
            if self._closed or self.lost is not None:
                return
            self.orphaned = orphaned
            self.lost = reason
            slots = list(self._answers.values())
            on_abort = self._on_abort
        for slot in slots:
            slot[0].set()
        if on_abort is not None:
            on_abort(self._watched(), LOST)

    def _ask(self, frame: dict, abort: threading.Event | None = None) -> Any:
        """Send a call and block until its answer (None if `abort` is set first)."""
        n = next(self._ids)
        slot = [threading.Event(), None]
        with self._lock:
            self._answers[n] = slot
        try:
            self._put({**frame, "id": n})
            while not slot[0].wait(0.05 if abort is not None else None):
                if abort.is_set():
                    return None
            if self.lost is not None and slot[1] is None:
                raise ControlLost(self.lost)
            return slot[1]
        finally:
            with self._lock:
                self._answers.pop(n, None)

    # the Link
    def send(self, message: msg.Message) -> Any:
        frame = self._relay.record_frame(message)
        if message.RULE == msg.SET and not isinstance(message, self._relay.URGENT):
            return self._put({"op": "send", **frame})
        text = self._ask({"op": "send", **frame})
        if message.RULE == msg.FIRST and text is not None:
            return type(message).from_json(text)
        return text

    def wait(self, kind: type[M], abort: threading.Event | None = None, **ids: Any) -> M | None:
        text = self._ask({"op": "get", "kind": kind.__name__, "ids": ids}, abort)
        return kind.from_json(text) if text is not None else None

    def peek(self, kind: type[M], **ids: Any) -> M | None:
        text = self._ask({"op": "get", "kind": kind.__name__, "ids": ids, "block": False})
        return kind.from_json(text) if text is not None else None

    def decision(self, gen: int) -> Decision:
        return Decision.from_json(self._ask({"op": "decision", "gen": gen}))

    def group_store(self, decision: Decision) -> Any:
        """The current coordinator's store, where the members form their groups under the
        generation's prefix (the coordinator deletes an old generation's keys). Asked of the
        host agent for every generation: after a coordinator took over, later generations
        form in the new one's store (a generation already formed needs none, see
        docs/runtime-engines.md)."""
        where = self._ask({"op": "where"})
        if where:
            host, _, port = where.rpartition(":")
            master = (host.strip("[]"), int(port))
            if master != self.master:
                self.master, self._store = master, None
        if self._store is None:
            import torch.distributed as dist

            host, port = self.master
            try:
                self._store = dist.TCPStore(host, port, is_master=False,
                                            timeout=timedelta(seconds=self.timeout))
            except (dist.DistError, RuntimeError) as exc:
                raise ControlLost(f"cannot reach the store at {host}:{port}: "
                                  f"{_first_line(exc)}") from None
        return self._store

    def watch(self, beat: Callable[[], msg.Heartbeat], watched: Callable[[], int],
              on_abort: Callable[[int, str], None]) -> None:
        with self._lock:
            self._on_abort, self._watched = on_abort, watched
            early, self._aborts = self._aborts, []
        for gen, reason in early:
            on_abort(gen, reason)
        if self.lost is not None:
            on_abort(watched(), LOST)
        threading.Thread(target=self._beats, args=(watched,), name="recycle-heartbeat",
                         daemon=True).start()

    def _beats(self, watched: Callable[[], int]) -> None:
        while not self._closed and self.lost is None:
            watched()  # the worker's control watch: this thread is alive
            try:
                self._put({"op": "beat"})
            except ControlLost:
                return
            time.sleep(self.heartbeat)

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.close()
        except OSError:
            pass


def link_from_env(config) -> Link:
    """The link the worker's environment names: its host agent's relay (cluster jobs), else
    the launcher's store."""
    from recycle_planner.executor.control.relay import RELAY_ENV

    return HostLink.from_env(config) if os.environ.get(RELAY_ENV) else StoreLink.from_env(config)
