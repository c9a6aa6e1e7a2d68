"""How the launcher (or coordinator) reads what workers report and posts what it tells them:
one interface, two implementations.

- `StoreMail` (the single-machine launcher, its workers on `link.StoreLink`): every record
  under its own key in the launcher's c10d store, read key by key (its workers are its own
  children on the same machine; see docs/runtime-engines.md for why it keeps that);
- `RelayMail` (the coordinator of a cluster job, its workers on `link.HostLink` through their
  host agents, `relay.py`): once per pass it takes the per-host reports into memory, and
  every read is then a dictionary lookup; what it tells workers goes into the bulletins (one
  for every host, one per host), published once per pass, which wakes every host. What
  carries them is its `transport.CoordinatorTransport`. A worker's lease is its host's: the
  host agent judges its own workers. The store keeps only the decisions and what the members
  form their process groups with, and a generation's keys are deleted once two newer
  generations were decided.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Mapping, Protocol, Sequence, TypeVar

from recycle_planner.executor.control import messages as msg
from recycle_planner.executor.control.protocol import Decision, decision_key
from recycle_planner.executor.control.relay import DOWN, PER_HOST, Bulletin, HostReport
from recycle_planner.executor.control.transport import (GLOBAL_BULLETIN, CoordinatorTransport,
                                                        delete_prefixed, host_bulletin)

M = TypeVar("M", bound=msg.Message)


class Mail(Protocol):
    def refresh(self) -> None:
        """Take in what arrived (once per pass of the agent's loop)."""

    def get(self, kind: type[M], **ids: Any) -> M | None:
        """The record of `kind` named by `ids`, or None."""

    def present(self, kind: type[msg.Message], ids: list[Mapping[str, Any]]) -> bool:
        """Whether a record of `kind` is there for every set of `ids`."""

    def get_many(self, kind: type[M], ids: list[Mapping[str, Any]]) -> list[M | None]:
        """The records of `kind` for each set of `ids` (None where there is none)."""

    def count(self, kind: type[msg.Message], **ids: Any) -> int:
        """How many `count` records of `kind` arrived under `ids`."""

    def beat(self, rank: int, incarnation: int) -> Any:
        """A value that changes while the worker's lease is renewed (None: none yet)."""

    def arrivals(self, kind: type[msg.Message]) -> int | None:
        """How many records of `kind` were taken in so far (None: this mail cannot say, so a
        reader looks each one up every time)."""

    def take_new(self, kind: type[M]) -> list[M] | None:
        """The records of `kind` taken in since the last call for `kind` (for the kinds of
        `AS_THEY_COME`, on the first call: since the start), in arrival order; None: this
        mail cannot say, or the first call for another kind (from then on they are kept for
        the next). One reader per kind."""

    def put(self, message: msg.Message) -> None:
        """Tell workers (or host agents) `message`."""

    def post_decision(self, decision: Decision) -> None:
        """Post generation `decision.gen`'s decision."""

    def flush(self) -> None:
        """Publish what was put in this pass."""

    def forget(self, iteration: int, keys: Sequence[str]) -> None:
        """Iteration `iteration` is over for good (`iterations.IterationLog` says when): drop
        its records (`keys`, every key they can have). The relay's mail also ignores any of
        them that arrive later (a stale worker's); on the launcher's store none can, since a
        worker's write returns once the store holds it. Records workers exchange through the
        store (`ON_STORE`: the steps an injected fault waits for) leave it too."""


AS_THEY_COME = (msg.Ready, msg.WorkerExit, msg.Spawned)
"""The records the coordinator reads as they arrive (`Mail.take_new`), none missed: the
members' `Ready`s of a recovery, the host agents' exits and restarts of workers."""

PER_ITERATION = (msg.IterationDone, msg.Losses, msg.CheckpointWritten)
"""The records of one iteration (every rank's end, the last stage's losses, each stage's
checkpoint): `Mail.forget` drops them once the iteration is over for good."""

ON_STORE = (msg.Stepped,)
"""The per-iteration records workers exchange on the coordinator's store itself
(`relay.DIRECT`): `Mail.forget` deletes their keys there."""
_ON_STORE_KEYS = tuple(kind.KEY.split("{")[0] for kind in ON_STORE)


def _old_generations(gen: int, decided: list[int]) -> tuple[list[int], tuple[str, ...]]:
    """Of the generations `decided`, those older than the one before `gen`, and their keys'
    prefixes (every record of a generation is under `gen{n}/`, its process groups too)."""
    old = [g for g in decided if g < gen - 1]
    return old, tuple(f"gen{g}/" for g in old)


class StoreMail:
    """Every record under its key in the launcher's store."""

    def __init__(self, store: Any):
        self.store = store
        self.decided: list[int] = []

    def refresh(self) -> None:
        pass

    def get(self, kind: type[M], **ids: Any) -> M | None:
        return msg.get(self.store, kind, **ids)

    def present(self, kind: type[msg.Message], ids: list[Mapping[str, Any]]) -> bool:
        return msg.present(self.store, kind, ids)

    def get_many(self, kind: type[M], ids: list[Mapping[str, Any]]) -> list[M | None]:
        """Two round trips when every record is there (the usual case: every rank's end of
        an iteration), else one or two per record."""
        if ids and msg.present(self.store, kind, ids):
            return [kind.from_json(text) for text in
                    self.store.multi_get([kind.key_for(**i) for i in ids])]
        return [msg.get(self.store, kind, **i) for i in ids]

    def count(self, kind: type[msg.Message], **ids: Any) -> int:
        return msg.count(self.store, kind, **ids)

    def beat(self, rank: int, incarnation: int) -> Any:
        return msg.get(self.store, msg.Heartbeat, rank=rank, incarnation=incarnation)

    def arrivals(self, kind: type[msg.Message]) -> int | None:
        return None  # workers write the store directly: nothing passes through here

    def take_new(self, kind: type[M]) -> list[M] | None:
        return None

    def put(self, message: msg.Message) -> None:
        msg.put(self.store, message)

    def post_decision(self, decision: Decision) -> None:
        """The decision under its key; the keys of generations older than the one before it
        (its records, its process groups' rendezvous, its decision) leave the store."""
        self.store.set(decision_key(decision.gen), decision.to_json())
        self.decided.append(decision.gen)
        old, prefixes = _old_generations(decision.gen, self.decided)
        delete_prefixed(self.store, prefixes)
        self.decided = [g for g in self.decided if g not in old]

    def flush(self) -> None:
        pass

    def forget(self, iteration: int, keys: Sequence[str]) -> None:
        for key in keys:
            self.store.delete_key(key)


class RelayMail:
    """The coordinator's side of the host agents' relays (see the module), over `transport`
    (`transport.py`). `nnodes` hosts of `per_host` consecutive ranks; `beat_every`: the
    longest time between two publications (the coordinator's own beat, by which hosts know
    it is alive: a quarter of the lease)."""

    def __init__(self, transport: CoordinatorTransport, nnodes: int, per_host: int,
                 beat_every: float):
        self.transport = transport
        self.by = uuid.uuid4().hex[:12]          # names its bulletins (`Bulletin.by`)
        self.nnodes, self.per_host = nnodes, per_host
        self.beat_every = beat_every
        self.records: dict[str, msg.Message] = {}  # key -> record, reported and posted
        self.counts: dict[str, int] = {}
        self.arrived: dict[type, int] = {}       # record kind -> how many were taken in
        # kinds read as they come (`take_new`): those of `AS_THEY_COME` from the start
        self.new: dict[type, list[msg.Message]] = {kind: [] for kind in AS_THEY_COME}
        self.host_seq: dict[int, int] = {}       # node -> its latest report's number
        self.version = 0
        self.published_at = 0.0
        self.everyone: dict[str, tuple[int, str]] = {}   # key -> (gen, JSON)
        self.by_host: dict[int, dict[str, str]] = {n: {} for n in range(nnodes)}
        self.dirty: set[int | None] = set()               # None: the global bulletin
        self.decided: list[int] = []
        self.floor = 0                                    # iterations before it: forgotten
        # empty bulletins from the start: a host reads them before the first notice
        transport.start(Bulletin(by=self.by).to_json(), nnodes)

    def node_of(self, rank: int) -> int:
        return rank // self.per_host

    # reading
    def refresh(self) -> None:
        for text in self.transport.take():
            report = HostReport.from_json(text)
            self.host_seq[report.node] = report.seq
            for message in report.messages():
                self._take(message)

    def _take(self, message: msg.Message) -> None:
        if isinstance(message, PER_ITERATION) and message.iteration < self.floor:
            return  # a late report of a forgotten iteration (a stale worker's)
        self.arrived[type(message)] = self.arrived.get(type(message), 0) + 1
        new = self.new.get(type(message))
        if new is not None:
            new.append(message)
        key = message.key()
        if message.RULE == msg.COUNT:
            self.counts[key] = self.counts.get(key, 0) + 1
        elif message.RULE != msg.FIRST or key not in self.records:
            self.records[key] = message

    def get(self, kind: type[M], **ids: Any) -> M | None:
        """The record as taken in (records are frozen: decoding it again for every read
        cost the coordinator 8,128 decodes of `Ready` per recovery at 8,192 ranks)."""
        return self.records.get(kind.key_for(**ids))

    def present(self, kind: type[msg.Message], ids: list[Mapping[str, Any]]) -> bool:
        return all(kind.key_for(**i) in self.records for i in ids)

    def get_many(self, kind: type[M], ids: list[Mapping[str, Any]]) -> list[M | None]:
        return [self.get(kind, **i) for i in ids]

    def count(self, kind: type[msg.Message], **ids: Any) -> int:
        return self.counts.get(kind.key_for(**ids), 0)

    def beat(self, rank: int, incarnation: int) -> Any:
        return self.host_seq.get(rank // self.per_host)  # `node_of`, inlined: once per rank

    def arrivals(self, kind: type[msg.Message]) -> int | None:
        return self.arrived.get(kind, 0)

    def take_new(self, kind: type[M]) -> list[M] | None:
        new, self.new[kind] = self.new.get(kind), []
        return new

    # posting
    def put(self, message: msg.Message) -> None:
        assert isinstance(message, DOWN), f"{type(message).__name__} is not for the hosts"
        key, text = message.key(), message.to_json()
        self.records[key] = message
        if isinstance(message, PER_HOST):
            node = self.node_of(message.rank)
            if isinstance(message, msg.Welcome):  # one welcome per rank: its latest process
                prefix = msg.Welcome.key_for(rank=message.rank, incarnation="")
                self.by_host[node] = {k: v for k, v in self.by_host[node].items()
                                      if not k.startswith(prefix)}
            self.by_host[node][key] = text
            self.dirty.add(node)
        else:
            self.everyone[key] = (getattr(message, "gen", -1), text)
            if not isinstance(message, msg.Progress):  # rides on the next publication
                self.dirty.add(None)

    def post_decision(self, decision: Decision) -> None:
        """The decision under its key, its mark in the global bulletin; the records of
        generations older than the one before it leave the bulletin, and their keys (the
        decisions, the process groups' rendezvous) the store."""
        gen = decision.gen
        self.transport.post(decision_key(gen), decision.to_json())
        self.everyone[decision_key(gen)] = (gen, "")
        self.everyone = {k: (g, v) for k, (g, v) in self.everyone.items()
                         if g < 0 or g >= gen - 1}
        self.dirty.add(None)
        self.decided.append(gen)
        old, prefixes = _old_generations(gen, self.decided)
        if old:
            self.transport.delete_prefixed(prefixes)
            for held in (self.records, self.counts):  # their reports (ready, done, errors)
                for key in [k for k in held if k.startswith(prefixes)]:
                    del held[key]
            self.decided = [g for g in self.decided if g not in old]

    def flush(self) -> None:
        """Publish the bulletins that changed and wake the hosts (also every `beat_every`
        seconds when nothing changed: the coordinator's beat)."""
        now = time.monotonic()
        if not self.dirty and now - self.published_at < self.beat_every:
            return
        self.version += 1
        bulletins = [(host_bulletin(node),
                      Bulletin(self.version, self.by_host[node], self.by).to_json())
                     for node in sorted(n for n in self.dirty if n is not None)]
        bulletins.append((GLOBAL_BULLETIN, Bulletin(
            self.version, {k: v for k, (_, v) in self.everyone.items()}, self.by).to_json()))
        self.transport.publish(self.version, bulletins)
        self.dirty.clear()
        self.published_at = now

    def forget(self, iteration: int, keys: Sequence[str]) -> None:
        self.transport.delete([key for key in keys if key.startswith(_ON_STORE_KEYS)])
        for key in keys:
            self.records.pop(key, None)
        self.floor = max(self.floor, iteration + 1)
