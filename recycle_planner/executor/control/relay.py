"""A host's relay: its workers talk to their host agent, the host agent to the coordinator.

Control traffic then grows with hosts, not ranks. A worker's `link.HostLink` speaks over a Unix
domain socket in the run folder (`RELAY_ENV` names it) with length-prefixed JSON frames that
carry the typed records of `messages.py`. The host agent's `Relay`:

- holds one lease for the whole host: it pushes a `HostReport` into the coordinator's queue
  (`UP_QUEUE`) at least every heartbeat, and batches into it whatever its workers reported
  since the last one (hello, ready, done, iteration ends, losses, checkpoints, exits): one
  record per host, however many workers it runs;
- watches the coordinator's notices once per host, not once per rank: the coordinator writes
  what it tells workers and host agents (aborts, decisions, join requests, welcomes, kills, the
  outcome) into a bulletin (`Bulletin`: one for everyone, one per host), then creates the
  notice key of the bulletin's next version, which wakes every host blocked in the store's
  `wait` on it; the relay reads its two bulletins in one round trip and pushes aborts to its
  workers and answers the calls they are blocked in (nothing is polled);
- notices a local worker's silence: no heartbeat over the socket for a lease (the host agent
  kills it; its exit is reported like any other, its death by process exit is the host
  agent's own, since it spawns the workers);
- beats to its workers: a frame to each at least every quarter of the lease (on every pass
  of its loop), so that a worker whose host agent is stopped, hung or gone hears nothing for
  a lease and leaves (`link.HostLink`): the coordinator declares such a host lost and
  re-routes, and its workers must not go on without control.

- never waits on the coordinator's store in its loop: the reports it pushes and the records it
  reads go through a thread of their own (`StoreCalls`), so that a coordinator whose link is
  cut (every call then blocks, for minutes) leaves the loop beating and judging its workers,
  and the agent follows the next leader while they train on;
- keeps what it relayed until the coordinator made it durable (`Journal`): when the coordinator
  is lost and another takes over (`detach`, then `attach` to the new one's store), it re-sends
  those records and an `Attach` naming the generation its workers run, which keep training
  meanwhile (their calls that need the coordinator wait).

The coordinator's side is `mail.RelayMail`; what carries the reports, bulletins, notices and
direct records between them is a transport (`transport.py`), here described on c10d's store.
Records between workers of different hosts (a stage's output shape, the agreed switch
iteration, the step reports an injected fault waits for) and the process groups stay on the
coordinator's c10d store (`DIRECT`). A coordinator
that takes over starts a new store: the relay puts the shapes again (a worker restarted
later waits for its input's), and tells in its `Attach` the switch iteration its workers
heard (`takeover.Adoption.abort_reason`).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from recycle_planner.executor.control import messages as msg
from recycle_planner.executor.control.pause import PauseClock
from recycle_planner.executor.control.protocol import decision_key
from recycle_planner.executor.control.transport import HostTransport

log = logging.getLogger(__name__)

RELAY_ENV = "RECYCLE_RELAY"
"""The environment variable that names a worker's relay socket (a path): set, the worker talks
to its host agent (`HostLink`); unset, to the launcher's store (`StoreLink`)."""

KINDS: dict[str, type[msg.Message]] = {
    cls.__name__: cls for cls in msg.Message.__subclasses__()}
"""Every record type by name, as frames carry them."""

DIRECT = (msg.Shape, msg.SwitchAt, msg.Stepped)
"""Records between workers, on the coordinator's store, not relayed through the bulletins."""
DOWN = (msg.Welcome, msg.Abort, msg.JoinRequest, msg.Finish, msg.Kill, msg.Outcome,
        msg.Progress)
"""Records the coordinator posts for workers and host agents: in the bulletins."""
PER_HOST = (msg.Welcome, msg.Kill)
"""Down records addressed to one rank: in its host's bulletin."""
URGENT = (msg.FaultFired,)
"""Records the sender waits to see on their way (an injected fault acts right after it, and
may stop this host agent): reported at once, then acknowledged."""


# -- frames --------------------------------------------------------------------------------------

HEADER = struct.Struct(">I")


def encode(frame: Mapping[str, Any]) -> bytes:
    data = json.dumps(frame, separators=(",", ":")).encode()
    return HEADER.pack(len(data)) + data


class Frames:
    """Bytes from a stream in, whole frames out. The frames of one read are cut at their
    offsets and what is left of a partial one kept once (cutting the buffer after each frame
    copied the rest of it every time: quadratic in the frames of a read)."""

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, data: bytes) -> list[dict]:
        buffer = self.buffer + data if self.buffer else data
        out, at, end = [], 0, len(buffer)
        while end - at >= HEADER.size:
            (n,) = HEADER.unpack_from(buffer, at)
            if end - at < HEADER.size + n:
                break
            out.append(json.loads(buffer[at + HEADER.size:at + HEADER.size + n]))
            at += HEADER.size + n
        self.buffer = buffer[at:]
        return out


def record_frame(message: msg.Message) -> dict:
    return {"kind": type(message).__name__, "rec": message.to_json()}


def frame_record(frame: Mapping[str, Any]) -> msg.Message:
    return KINDS[frame["kind"]].from_json(frame["rec"])


# -- what crosses the coordinator's store --------------------------------------------------------

@dataclass(frozen=True)
class HostReport:
    """Host `node`'s batch `seq` (0, 1, ...): its lease renewal, and the records its workers
    and its agent sent since the previous one, as (kind, record) pairs: the record's JSON
    text where the host made the report, its decoded fields where the coordinator read it.

    On the wire each record is a JSON object inside the report's, not a string: the
    coordinator decodes a report once, whatever it holds (a new leader takes in every host's
    journal at once, 26,624 records at 8,192 ranks, and decoding each from a string of its
    own was a third of its intake). The host writes the records' text into the report as it
    is."""

    node: int
    seq: int
    records: tuple[tuple[str, str | Mapping[str, Any]], ...] = ()

    def to_json(self) -> str:
        records = ",".join(f'["{kind}",{_encoded(record)}]' for kind, record in self.records)
        return f'{{"node":{self.node},"seq":{self.seq},"records":[{records}]}}'

    @classmethod
    def from_json(cls, text: str | bytes) -> "HostReport":
        d = json.loads(text)
        return cls(int(d["node"]), int(d["seq"]), tuple(tuple(r) for r in d["records"]))

    def messages(self) -> list[msg.Message]:
        """Each record, decoded once (the coordinator's mail keeps it as it is)."""
        return [KINDS[kind].from_fields(_decoded(record)) for kind, record in self.records]


def _encoded(record: str | Mapping[str, Any]) -> str:
    return record if isinstance(record, str) else json.dumps(record, separators=(",", ":"))


def _decoded(record: str | Mapping[str, Any]) -> Mapping[str, Any]:
    return json.loads(record) if isinstance(record, str) else record


@dataclass(frozen=True)
class Bulletin:
    """What the coordinator currently tells hosts: record key -> record JSON (a decision's
    key maps to "": the decision itself is read from its own key, once per host). `version`
    counts the global bulletin's changes (and the coordinator's beats); `by` names the
    coordinator's mail that wrote it (on keys that outlive a coordinator, `transport.EtcdHost`,
    another name there means another coordinator took over)."""

    version: int = 0
    records: Mapping[str, str] = field(default_factory=dict)
    by: str = ""

    def to_json(self) -> str:
        return json.dumps({"version": self.version, "records": dict(self.records),
                           "by": self.by}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Bulletin":
        d = json.loads(text)
        return cls(int(d["version"]), d["records"], str(d.get("by", "")))


class Journal:
    """The records a host relayed up that a coordinator taking over may need: kept until the
    coordinator made them durable (`Progress`: losses saved, checkpoint complete) or their
    generation is past. Keyed by the records' own keys with their rules, so that what is
    re-sent is each record once (`set`: the latest, `first`: the first) and each `count`
    message once: the new coordinator's counts start from nothing. The host's ranks' ends
    of an iteration are kept as one (`_add_end`)."""

    def __init__(self) -> None:
        self.entries: dict[str, list[tuple[str, str, msg.Message]]] = {}

    def add(self, message: msg.Message, text: str | None = None) -> None:
        """Keep `message` (`text`: its JSON, when the caller has it)."""
        if isinstance(message, msg.IterationDone):
            return self._add_end(message, text)
        text = message.to_json() if text is None else text
        key, entry = message.key(), (type(message).__name__, text, message)
        if message.RULE == msg.COUNT:
            self.entries.setdefault(key, []).append(entry)
        elif message.RULE != msg.FIRST or key not in self.entries:
            self.entries[key] = [entry]

    def _add_end(self, done: msg.IterationDone, text: str | None) -> None:
        """One end per iteration for the whole host: the latest time and generation its ranks
        reported, which is all a coordinator reads of an iteration's ends (their maximum,
        `IterationLog._end`). So a new leader takes in one per host, not one per rank (at
        8,192 ranks, 8 of 10 records re-sent were ends). The record kept is the latest
        end's, as its worker sent it, unless an earlier one's generation was later."""
        key = f"it/{done.iteration}"
        held = self.entries.get(key)
        if held is not None:
            kept = held[0][2]
            assert isinstance(kept, msg.IterationDone)
            if kept.t >= done.t and kept.gen >= done.gen:
                return
            if kept.t > done.t or kept.gen > done.gen:
                done, text = replace(done, t=max(kept.t, done.t), gen=max(kept.gen, done.gen)), None
        self.entries[key] = [(type(done).__name__, done.to_json() if text is None else text, done)]

    def prune(self, progress: msg.Progress | None, gen: int) -> None:
        """Drop what `progress` made durable and what generations before `gen - 1` said."""
        self.entries = {k: v for k, v in self.entries.items() if keeps(v[0][2], progress, gen)}

    def records(self) -> list[tuple[str, str]]:
        return [(kind, text) for entry in self.entries.values() for kind, text, _ in entry]


def keeps(message: msg.Message, progress: msg.Progress | None, gen: int) -> bool:
    """Whether a coordinator taking over may still need `message` (see `Journal`)."""
    if isinstance(message, msg.CheckpointWritten):
        return progress is None or message.iteration > progress.checkpoint
    if hasattr(message, "iteration"):
        return progress is None or message.iteration >= progress.losses
    if hasattr(message, "gen"):
        return message.gen >= gen - 1
    return True


class Detached(Exception):
    """The relay has no coordinator now (lost, or not yet re-attached): what needs its store
    waits."""


# -- the host agent's side ------------------------------------------------------------------------

@dataclass
class _Conn:
    """One local worker's connection."""

    sock: socket.socket
    frames: Frames = field(default_factory=Frames)
    rank: int | None = None
    incarnation: int | None = None
    beat: float | None = None            # when its last heartbeat came (monotonic)
    aborted: set[int] = field(default_factory=set)   # generations whose abort it was told
    waits: list[dict] = field(default_factory=list)  # calls it is blocked in


PENDING = object()
"""`StoreCalls.read`'s answer while the store thread has not read the record yet."""


class StoreCalls:
    """The relay's calls on one coordinator's transport (`transport.HostTransport`), made on a
    thread of their own: the host agent's loop hands it the reports to push (`push`) and the
    records to read (`read`: None until the answer came, asked once per key at a time), and
    never waits on the coordinator. The
    first failure calls `on_failure(reason)` and ends the thread; a relay that moves to
    another coordinator `abandon`s it: what was queued behind a call stuck on the cut link is
    given back at once (`undone`: re-sent to the next store, not minutes later), and the stuck
    call, when it ends, says nothing and is not acted on (its `done` becomes `undone`: a late
    answer of a deposed coordinator's store must not count)."""

    def __init__(self, transport: HostTransport, on_failure: Any):
        self.transport, self.on_failure = transport, on_failure
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._answers: dict[str, str | None] = {}
        self._asked: set[str] = set()
        self._abandoned = False
        self.thread = threading.Thread(target=self._run, name="relay-store", daemon=True)
        self.thread.start()

    def push(self, text: str, wait: float = 0.0) -> None:
        """Push a report; with `wait`, return once it is pushed, or after `wait` seconds."""
        pushed = threading.Event()
        self._todo.put(("push", (text, pushed)))
        if wait:
            pushed.wait(wait)

    def read(self, key: str) -> str | None | object:
        """The record under `key` once read (None: absent; each answer is given once), else
        `PENDING` (asked now, or still being read)."""
        if key in self._answers:
            return self._answers.pop(key)
        if key not in self._asked:
            self._asked.add(key)
            self._todo.put(("read", key))
        return PENDING

    def apply(self, fn: Any, done: Any, undone: Any) -> None:
        """`done(fn(transport))` on the thread; `undone()` if the call fails or never runs."""
        self._todo.put(("apply", (fn, done, undone)))

    def abandon(self) -> None:
        self._abandoned = True
        self._drop("stop", "")  # from this thread: the store thread may be stuck in a call
        self._todo.put(("stop", ""))  # then ends the store thread, idle or once unstuck

    def _run(self) -> None:
        while True:
            op, arg = self._todo.get()
            if op == "stop" or self._abandoned:
                return self._drop(op, arg)
            try:
                self._do(op, arg)
            except (RuntimeError, OSError) as exc:  # DistError is a RuntimeError
                if not self._abandoned:
                    text = str(exc).strip().splitlines()
                    self.on_failure(f"the coordinator's store failed: "
                                    f"{text[0] if text else type(exc).__name__}")
                return self._drop(op, arg)

    def _do(self, op: str, arg: Any) -> None:
        if op == "push":
            self.transport.push(arg[0])
            arg[1].set()
        elif op == "apply":
            fn, done, undone = arg
            result = fn(self.transport)
            if self._abandoned:
                undone()
            else:
                done(result)
        else:
            self._answers[arg] = self.transport.read(arg)
            self._asked.discard(arg)

    def _drop(self, op: str, arg: Any) -> None:
        """This store is done with: what waits for an answer is given back (`undone`; each
        queued call is taken by one thread only, this one or the store thread)."""
        while True:
            if op == "apply":
                arg[2]()
            try:
                op, arg = self._todo.get_nowait()
            except queue.Empty:
                return


class Relay:
    """The host agent's relay (see the module). The host agent calls `step` on every pass of
    its loop (and whenever one of `fds()` is readable); `report` batches its own records;
    `notice(kind, **ids)` reads a down record for the agent itself (kills, the outcome);
    `silent()` names the local workers whose lease ran out; `lose(reason)` tells every
    worker the coordinator is gone; `detach()` and `attach(...)` move it to a coordinator
    that took over, the workers left running. `transport`: how it reaches the coordinator;
    `endpoint`: where the coordinator's store listens (where the workers form their process
    groups)."""

    def __init__(self, transport: HostTransport, node: int, path: str, lease: float,
                 heartbeat: float, flush: float = 0.005, endpoint: str = ""):
        self.transport = transport
        self.endpoint = endpoint
        self.attached = True            # False between a lost coordinator and the next
        self.journal = Journal()
        self.deferred: list[tuple[_Conn, dict]] = []  # worker records for the next store
        self.shapes: dict[int, msg.Shape] = {}  # the stages' shapes put: again on a new store
        self.switches: dict[int, int] = {}      # gen -> the switch iteration agreed (heard)
        self._later: list[tuple[Any, Any, Any]] = []   # answers of `call` for the loop
        self.node, self.path = node, path
        self.lease, self.heartbeat, self.flush_after = lease, heartbeat, flush
        if os.path.exists(path):
            os.unlink(path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(256)
        self.listener.setblocking(False)
        self.conns: dict[int, _Conn] = {}          # by file descriptor
        self.pending: list[tuple[str, str]] = []   # records of the next report
        self.pending_since: float | None = None
        self.seq = 0
        self.sent_at = 0.0                         # when the last report went (monotonic)
        self.bulletin = Bulletin()
        self.mine = Bulletin()
        self.decisions: dict[int, str] = {}        # gen -> decision JSON, fetched once
        self.lost: str | None = None
        self.noticed_at = time.monotonic()         # the notice thread's last answer
        self._fresh: tuple[Bulletin, Bulletin] | None = None
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._closed = False
        self._pause = PauseClock()                 # `_awake`
        self._beaten_at = 0.0                      # when its workers were last sent a beat
        self._epoch = 0
        self._threads: list[threading.Thread] = []  # one per store watched, the last current
        self._start_notices()
        self.calls = self._calls(transport)

    def _calls(self, transport: HostTransport) -> StoreCalls:
        epoch = self._epoch

        def failed(reason: str) -> None:
            if self._epoch == epoch and not self._closed:
                self.lost = self.lost or reason
                self._wake()

        calls = StoreCalls(transport, failed)
        self._threads.append(calls.thread)
        return calls

    def _start_notices(self, stale: str = "") -> None:
        self._thread = threading.Thread(target=self._watch_notices,
                                        args=(self._epoch, self.transport, stale),
                                        name="relay-notices", daemon=True)
        self._threads.append(self._thread)
        self._thread.start()

    # the notice thread: the only place that blocks on the coordinator
    def _watch_notices(self, epoch: int, transport: HostTransport, stale: str = "") -> None:
        """Read the bulletins, then block until the coordinator's next notice; it comes at
        least every lease / 4 (its beat), so bulletins whose version did not move
        for a lease mean the coordinator is gone (or this host is cut off from it). A cut
        link makes the read itself fail after the lease (the store client's timeout). A thread
        of an `epoch` the relay left (it re-attached elsewhere) ends without a word."""
        version, moved, by = -1, time.monotonic(), ""
        while not self._closed and self._epoch == epoch:
            try:
                everyone, mine = (Bulletin.from_json(v) for v in transport.bulletins(self.node))
                if stale and everyone.by == stale:  # the lost one's, before its successor's
                    if time.monotonic() - moved > self.lease:
                        raise TimeoutError(f"the coordinator that took over published "
                                           f"nothing for {self.lease:g} s")
                    transport.wait_notice(version + 1, self.lease)
                    continue
                if self._epoch != epoch:
                    return
                if by and everyone.by != by:  # its successor writes the same keys
                    raise RuntimeError(f"another coordinator took over ({everyone.by})")
                by = everyone.by
                now = self.noticed_at = time.monotonic()
                if everyone.version != version:
                    version, moved = everyone.version, now
                elif now - moved > self.lease:
                    raise TimeoutError(f"the bulletins stayed at version {version} for "
                                       f"{now - moved:.1f} s")
                with self._lock:
                    if self._epoch != epoch:
                        return
                    self._fresh = (everyone, mine)
                self._wake()
                transport.wait_notice(version + 1, self.lease)
            except (RuntimeError, OSError) as exc:  # DistError is a RuntimeError
                if not self._closed and self._epoch == epoch:
                    text = str(exc).strip().splitlines()
                    self.lost = f"no notice from the coordinator: {text[0] if text else exc}"
                    self._wake()
                return

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass

    def fds(self) -> list:
        return [self.listener, self._wake_r, *(c.sock for c in self.conns.values())]

    # one pass
    def _awake(self) -> float:
        """Now; if this process was paused (`pause.PauseClock`) since it last looked, its
        workers and the coordinator were not silent: it could not hear them, so their silence
        counts from now. Looked at wherever silence is judged (`step`, `silent`), as the
        process may be stopped anywhere in between."""
        now, paused = self._pause.look()
        if paused:
            for c in self.conns.values():
                if c.beat is not None:
                    c.beat = now
            self.noticed_at = max(self.noticed_at, now)
        return now

    def step(self) -> None:
        now = self._awake()
        if self.attached and self.lost is None and now - self.noticed_at > self.lease:
            # a store call on a cut link can outlast its own timeout: judge by the clock
            self.lost = f"no notice from the coordinator for {now - self.noticed_at:.1f} s"
        self._drain_wake()
        self._accept()
        readable = select.select([c.sock for c in self.conns.values()], [], [], 0)[0]
        for sock in readable:
            conn = self.conns.get(sock.fileno())
            if conn is not None:
                self._read(conn)
        with self._lock:
            fresh, self._fresh = self._fresh, None
        if fresh is not None:
            self.bulletin, self.mine = fresh
            self.journal.prune(self.notice(msg.Progress), max(self.decisions, default=0))
            for conn in list(self.conns.values()):
                self._push_aborts(conn)
        for conn in list(self.conns.values()):
            self._answer(conn)
        self._redo_deferred()
        self._run_later()
        self._beat_workers(now)
        try:
            self._flush(now)
        except Detached:
            pass  # the batch waits for the next coordinator

    def call(self, fn: Any, done: Any, undone: Any) -> None:
        """`fn(transport)` on the current coordinator's transport, on the relay's store thread
        (the host agent's loop never waits on the store); a later `step` calls, on the loop's
        thread, `done(result)`, or `undone()` when there is no store now, the call failed, or
        the relay moved to another coordinator before the answer was acted on (an answer of
        an abandoned store never counts)."""
        try:
            calls = self._ready()
        except Detached:
            self._later.append((None, undone, undone))
            return

        def answered(result: Any) -> None:
            self._later.append((calls, lambda: done(result), undone))
            self._wake()

        calls.apply(fn, answered, lambda: self._later.append((None, undone, undone)))

    def _run_later(self) -> None:
        """The answers of `call`, on the loop's thread: each (the store calls it was asked on,
        what to do with the answer, what to do without one); the attachment it was asked on
        must still be the current one."""
        while self._later:
            calls, act, undone = self._later.pop(0)
            stale = calls is not None and (calls is not self.calls or not self.attached)
            (undone if stale else act)()

    def _ready(self) -> StoreCalls:
        """The current coordinator's store calls; `Detached` when there is none."""
        if not self.attached or self.lost is not None:
            raise Detached()
        return self.calls

    def _beat_workers(self, now: float) -> None:
        """A beat to every worker every quarter of the lease (see the module): what it hears
        from this agent, answers and pushes included, tells it the agent is alive."""
        if now - self._beaten_at < self.lease / 4:
            return
        self._beaten_at = now
        for conn in list(self.conns.values()):
            self._send(conn, {"push": "beat"})

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(512):
                pass
        except BlockingIOError:
            pass

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(True)
            sock.settimeout(1.0)
            self.conns[sock.fileno()] = _Conn(sock)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            return self._drop(conn)
        for frame in conn.frames.feed(data):
            self._handle(conn, frame)

    def _drop(self, conn: _Conn) -> None:
        self.conns.pop(conn.sock.fileno(), None)
        conn.sock.close()

    def _handle(self, conn: _Conn, frame: dict) -> None:
        op = frame["op"]
        if op == "hi":
            conn.rank, conn.incarnation = frame["rank"], frame["incarnation"]
            if self.lost is not None:
                self._send(conn, {"push": "lost", "reason": self.lost})
            self._push_aborts(conn)
        elif op == "beat":
            conn.beat = time.monotonic()
        elif op == "send":
            message = frame_record(frame)
            result = None
            if isinstance(message, DIRECT):
                self._put_direct(conn, frame, message)
                return
            else:
                self.report(message, frame["rec"])
                if isinstance(message, URGENT):
                    self.flush()
            if "id" in frame:
                self._send(conn, {"id": frame["id"], "rec": result})
        elif op in ("get", "decision", "where"):
            conn.waits.append(frame)

    def _put_direct(self, conn: _Conn, frame: dict, message: msg.Message) -> None:
        """A record between workers of different hosts, on the store itself (`call`): its
        answer, a count or the first record, goes back to the worker. Without one (no store
        now, or an answer from a store this relay left meanwhile) the record waits for the
        next store, so that what a worker hears is what the next `Attach` tells
        (`switches`)."""
        def done(result: Any) -> None:
            if isinstance(message, msg.Shape):
                self.shapes[message.stage] = message
            elif isinstance(result, msg.SwitchAt):
                self.switches[result.gen] = result.iteration
            if frame.get("id") is not None and self.conns.get(conn.sock.fileno()) is conn:
                text = result.to_json() if isinstance(result, msg.Message) else result
                self._send(conn, {"id": frame["id"], "rec": text})

        self.call(lambda transport: transport.put_direct(message), done,
                  lambda: self.deferred.append((conn, frame)))

    def _redo_deferred(self) -> None:
        """The workers' records that waited for a store: sent to the current one."""
        if not self.attached or self.lost is not None:
            return
        while self.deferred:
            conn, frame = self.deferred.pop(0)
            if self.conns.get(conn.sock.fileno()) is conn:
                self._handle(conn, frame)

    def _answer(self, conn: _Conn) -> None:
        """Answer the calls `conn` is blocked in whose record is there now; a peek is answered
        at once, with None if absent."""
        left = []
        for frame in conn.waits:
            if frame["op"] == "decision":
                text = self._decision(frame["gen"])
            elif frame["op"] == "where":  # where process groups form: the current store
                text = self.endpoint if self.attached and self.lost is None else None
            else:
                text = self._record(KINDS[frame["kind"]], frame["ids"])
            if text is PENDING or text is None and frame.get("block", True):
                left.append(frame)
            else:
                self._send(conn, {"id": frame["id"], "rec": text})
        conn.waits = left

    def _record(self, kind: type[msg.Message], ids: Mapping[str, Any]) -> str | None | object:
        key = kind.key_for(**ids)
        if issubclass(kind, DOWN):
            return (self.mine if issubclass(kind, PER_HOST) else self.bulletin).records.get(key)
        try:
            return self._ready().read(key)
        except Detached:
            return None

    def _decision(self, gen: int) -> str | None:
        if gen not in self.decisions:
            if decision_key(gen) not in self.bulletin.records:
                return None
            try:
                text = self._ready().read(decision_key(gen))
            except Detached:
                return None
            if text is PENDING or text is None:
                return None  # asked: a later pass answers
            self.decisions[gen] = text
            for old in [g for g in self.decisions if g < gen - 1]:
                del self.decisions[old]
                self.switches.pop(old, None)
        return self.decisions[gen]

    def _push_aborts(self, conn: _Conn) -> None:
        """Tell the worker of every abandoned generation it was not told of (a worker not yet
        in that generation keeps it: it is abandoned before it forms)."""
        if conn.rank is None:
            return
        for key, text in self.bulletin.records.items():
            if key.endswith("/abort"):
                notice = msg.Abort.from_json(text)
                if notice.gen not in conn.aborted:
                    conn.aborted.add(notice.gen)
                    self._send(conn, {"push": "abort", "gen": notice.gen,
                                      "reason": notice.reason})

    def _send(self, conn: _Conn, frame: dict) -> None:
        try:
            with self._send_lock:
                conn.sock.sendall(encode(frame))
        except OSError:  # the worker is gone (or stopped with a full buffer): its exit tells
            self._drop(conn)

    # the report
    def report(self, message: msg.Message, text: str | None = None) -> None:
        """Batch `message` into the host's next report; `text`: its JSON as a worker sent it
        (relayed as it came, encoded once for the report and the journal otherwise)."""
        if self.pending_since is None:
            self.pending_since = time.monotonic()
        text = message.to_json() if text is None else text
        self.pending.append((type(message).__name__, text))
        if not isinstance(message, msg.Attach):
            self.journal.add(message, text)

    def _flush(self, now: float, force: bool = False, wait: float = 0.0) -> None:
        due = self.pending_since is not None and now - self.pending_since >= self.flush_after
        if not (force or due or now - self.sent_at >= self.heartbeat):
            return
        report = HostReport(self.node, self.seq, tuple(self.pending))
        self._ready().push(report.to_json(), wait)
        self.seq += 1
        self.sent_at = now
        self.pending, self.pending_since = [], None

    def flush(self, wait: float = 0.0) -> None:
        """Send what is batched now; with `wait` (the host agent's goodbye), return once it
        is pushed, or after `wait` seconds."""
        try:
            self._flush(time.monotonic(), force=True, wait=wait)
        except Detached:
            pass

    def timeout(self) -> float:
        """How long the host agent's loop may sleep before the next `step` is due."""
        now = time.monotonic()
        if not self.attached or self.lost is not None:
            return self.heartbeat  # nothing is sent until a coordinator is there
        due = self.sent_at + self.heartbeat
        if self.pending_since is not None:
            due = min(due, self.pending_since + self.flush_after)
        return max(0.0, due - now)

    # what the host agent asks
    def notice(self, kind: type[msg.Message], **ids: Any) -> msg.Message | None:
        text = self._record(kind, ids)
        return kind.from_json(text) if isinstance(text, str) else None

    def silent(self) -> list[tuple[int, int, float]]:
        """(rank, incarnation, seconds) of the local workers that sent no heartbeat for longer
        than the lease (counted from their first one)."""
        now = self._awake()
        return [(c.rank, c.incarnation, now - c.beat) for c in self.conns.values()
                if c.beat is not None and now - c.beat > self.lease]

    def lose(self, reason: str) -> None:
        """The coordinator is gone: every worker stops with a checkpoint."""
        self.lost = self.lost or reason
        for conn in list(self.conns.values()):
            self._send(conn, {"push": "lost", "reason": self.lost})

    def detach(self) -> str:
        """The coordinator is lost and another may take over: stop using its store (what
        needs one waits; the workers keep training). Returns why it was lost."""
        why = self.lost or "the coordinator is gone"
        with self._lock:
            self._epoch += 1            # the lost store's threads say nothing more
            self._fresh = None
        self.calls.abandon()
        self.transport.close()
        self.attached, self.lost = False, None
        return why

    def attach(self, transport: HostTransport, endpoint: str,
               workers: tuple[tuple[int, int], ...] = (), another: bool = False) -> None:
        """Re-attach to the coordinator that took over, at `endpoint`: re-send the journal
        (which holds every batched record too) and this host's `Attach`, answer the workers'
        calls that waited, and watch the new coordinator's notices."""
        self.transport, self.endpoint = transport, endpoint
        self.pending = self.journal.records()
        self.pending.append((msg.Attach.__name__, self.attachment(workers).to_json()))
        self.pending_since = time.monotonic()
        self.attached, self.lost = True, None
        self.noticed_at = time.monotonic()
        # `another` coordinator, on keys that outlive one: its predecessor's bulletins may
        # still be there until its first publication, and are not its own
        self._start_notices(self.bulletin.by if another else "")
        self.calls = self._calls(transport)
        for shape in list(self.shapes.values()):  # a worker restarted later waits for them
            self.calls.apply(lambda t, m=shape: t.put_direct(m), lambda _: None, lambda: None)
        self._redo_deferred()
        try:
            self._flush(time.monotonic(), force=True)
        except Detached:
            pass  # lost again: the host agent sees `lost`

    def attachment(self, workers: tuple[tuple[int, int], ...] = ()) -> msg.Attach:
        """What this host tells a coordinator taking over: its live `workers` (rank,
        incarnation), the newest decision it holds and what the bulletin said about it."""
        progress = self.notice(msg.Progress)
        saved = progress.losses if progress is not None else -1
        if not self.decisions:
            return msg.Attach(self.node, -1, "", workers, saved=saved)
        gen = max(self.decisions)
        abort = self.notice(msg.Abort, gen=gen)
        return msg.Attach(self.node, gen, self.decisions[gen], workers,
                          abort.reason if abort is not None else None,
                          msg.JoinRequest.key_for(gen=gen) in self.bulletin.records, saved,
                          self.switches.get(gen, -1))

    def close(self) -> bool:
        """Stop; waits for the notice thread to leave its store call (the coordinator's next
        beat, or its store's end: at most the lease), since a process that exits while a
        thread returns from c10d is aborted. False if it is still inside one (a cut link):
        the process must then leave with `os._exit`."""
        self._closed = True
        self.transport.close()
        if self._thread is not threading.current_thread():
            self._thread.join(self.lease + 1.0)
        self.calls.abandon()
        self.calls.thread.join(1.0)  # inside a store call only on a cut link
        for conn in list(self.conns.values()):
            self._drop(conn)
        for sock in (self.listener, self._wake_r, self._wake_w):
            sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        return not any(t.is_alive() for t in self._threads)  # a lost store's too


def relay_path(folder: str, node: int, pid: int | None = None) -> str:
    """Where host `node`'s relay listens: a short path (Unix socket paths hold 107 bytes), in
    the run's log folder when that is short enough, else in the temporary folder."""
    name = f"relay-{node}-{pid or os.getpid()}.sock"
    path = os.path.join(folder, name)
    if len(path.encode()) < 100:
        return path
    return os.path.join(os.environ.get("TMPDIR", "/tmp"), name)

