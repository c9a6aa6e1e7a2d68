"""Membership and decisions of a cluster job on the control store: the host's side and the
leading coordinator's side.

Control traffic grows with hosts, not ranks: one lease per host, one report per host per
generation change, one decision for everyone. Everything lives under `/recycle/{job}/`:

- `hosts/{node}` (`HostRecord`), by its host agent, under the host's lease: deleted by the
  store when the host is lost;
- `election/{lease}`, by each coordinator, under its lease (`election.py`);
- `to-hosts/abort` (`AbortNotice`), by the leader: generation `gen` is abandoned;
- `to-hosts/decision` (`protocol.Decision`, deflated: `encode_decision`), by the leader: the
  current generation;
- `to-hosts/coordinator`, by the leader, under its lease: where its c10d store listens
  (`failover.lead_then`); `led`, the same without a lease: a leader ran (the next takes over);
- `outcome` (`failover.Outcome`), by the leader whose coordinator ended the job: its
  standbys leave;
- `ready/{gen}/{node}` (`HostReady`), by a host agent, under its lease: deleted with the
  decision it led to;

In steady state nothing but lease renewals reaches etcd: per-iteration results (iterations done,
losses, checkpoints) are data, not membership, and stay on the coordinator's c10d store.

A host agent (`HostMember`) keeps its lease, watches `to-hosts/` and answers an abort with its
ranks' step counts. The leader (`Leader`) watches the whole job prefix: a host key deleted
(lease expired: host dead or cut off) aborts the generation; when every live host has reported,
`protocol.decide` makes the next decision, written in one fenced transaction with the deletion
of the reports it used, and only if the decision key is still the one the leader read. A
coordinator that takes over reads the same keys and goes on where its predecessor stopped:
an abort without a decision yet is collected again from the reports under their leases, so no
generation is decided twice and none is lost.
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import threading
import zlib
from dataclasses import asdict, dataclass, field
from typing import Callable

from recycle_planner.executor.control import protocol
from recycle_planner.executor.control.election import Election
from recycle_planner.executor.control.protocol import Decision
from recycle_planner.errors import RecycleError
from recycle_planner.executor.control.store import (DELETE, PUT, Compare, ControlStore,
                                                    LeaseKeeper, StoreUnavailable)

log = logging.getLogger(__name__)


def encode_decision(decision: Decision) -> str:
    """A decision as stored on etcd: its JSON (`Decision.to_json`: members and incarnations
    as runs), deflated and base64-encoded. Every host's watch receives it at once. At 8,192
    ranks the first decision's JSON (a source for every non-first worker of a stage, a run per
    pipeline) is 13 kB, 3 kB stored; a host's loss is 0.8 kB, 0.4 kB stored
    (`benchmarks/bench_decision.py`)."""
    return base64.b64encode(zlib.compress(decision.to_json().encode(), 9)).decode()


@functools.lru_cache(maxsize=4)
def decode_decision(text: str) -> Decision:
    """The decision `encode_decision` stored (at 8,192 ranks under 1 ms for a host's loss, 2 ms
    for the first decision; host members that share a process, as the benchmark's stand-ins
    do, decode each decision once)."""
    return Decision.from_json(zlib.decompress(base64.b64decode(text)))


def job_prefix(job: str) -> str:
    return f"/recycle/{job}/"


@dataclass(frozen=True)
class Keys:
    """Where a job's records live (see the module's table)."""

    job: str

    @property
    def root(self) -> str:
        return job_prefix(self.job)

    @property
    def hosts(self) -> str:
        return self.root + "hosts/"

    def host(self, node: int) -> str:
        return f"{self.hosts}{node}"

    @property
    def election(self) -> str:
        return self.root + "election/"

    @property
    def to_hosts(self) -> str:
        return self.root + "to-hosts/"

    @property
    def abort(self) -> str:
        return self.to_hosts + "abort"

    @property
    def decision(self) -> str:
        return self.to_hosts + "decision"

    @property
    def coordinator(self) -> str:
        """Where the leading coordinator's c10d store listens (HOST:PORT), under the leader's
        lease: gone with its leadership, so that a host agent never dials a lost one."""
        return self.to_hosts + "coordinator"

    @property
    def relay(self) -> str:
        """The control traffic between the coordinator and the host agents' relays
        (`transport.EtcdHost`, `EtcdCoordinator`): the same keys whoever leads."""
        return self.root + "relay/"

    @property
    def led(self) -> str:
        """The store a leader of this job last published (kept when its leadership ends:
        the next leader takes over from it; deleted when the job ends, with its outcome)."""
        return self.root + "led"

    @property
    def outcome(self) -> str:
        """How the job ended under its leader (`failover.Outcome`): its standbys leave."""
        return self.root + "outcome"

    def ready(self, gen: int) -> str:
        return f"{self.root}ready/{gen}/"


@dataclass(frozen=True)
class HostRecord:
    """Host agent `node` runs global ranks `ranks`."""

    node: int
    hostname: str
    ranks: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "HostRecord":
        d = json.loads(text)
        return cls(int(d["node"]), d["hostname"], tuple(d["ranks"]))


@dataclass(frozen=True)
class AbortNotice:
    """Generation `gen` is abandoned (`reason`): every live host reports its step counts."""

    gen: int
    reason: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "AbortNotice":
        d = json.loads(text)
        return cls(int(d["gen"]), d["reason"])


@dataclass(frozen=True)
class HostReady:
    """Host `node` left generation `gen`; `steps[rank]` per live local rank (None: no state)."""

    gen: int
    node: int
    steps: dict[int, int | None] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"gen": self.gen, "node": self.node,
                           "steps": {str(r): s for r, s in self.steps.items()}})

    @classmethod
    def from_json(cls, text: str) -> "HostReady":
        d = json.loads(text)
        return cls(int(d["gen"]), int(d["node"]), {int(r): s for r, s in d["steps"].items()})


# -- a host's side ---------------------------------------------------------------------------

class HostMember:
    """A host agent's membership: its lease and host key, its answers to aborts, and the
    decisions it holds. `steps()` gives the step counts of its live ranks when it leaves a
    generation; `on_decision(decision)` and `on_lost(reason)` (the store or the lease is gone:
    stop training with a checkpoint) are called from the watch thread."""

    def __init__(self, store: ControlStore, keys: Keys, record: HostRecord, ttl: float,
                 steps: Callable[[], dict[int, int | None]],
                 on_decision: Callable[[Decision], None] = lambda d: None,
                 on_lost: Callable[[str], None] = lambda r: None):
        self.store, self.keys, self.record = store, keys, record
        self.steps = steps
        self.on_decision = on_decision
        self.on_lost = on_lost
        self.decision: Decision | None = None
        self.lost: str | None = None
        self._answered: set[int] = set()
        self._closed = threading.Event()
        self.keeper = LeaseKeeper(store, ttl, self._lose)
        self._watch = None
        try:
            store.put(keys.host(record.node), record.to_json(), lease=self.keeper.lease)
            # what was posted before this host's watch starts counts too (an abort to answer)
            entries, read_at = store.get_prefix(keys.to_hosts)
            self._watch = store.watch(keys.to_hosts, read_at + 1)
            for e in sorted(entries, key=lambda e: e.key != keys.decision):
                self._handle(e.key, e.value)
        except BaseException:
            self.close(leave=True)
            raise
        self._thread = threading.Thread(target=self._run, name=f"host-{record.node}",
                                        daemon=True)
        self._thread.start()

    def _lose(self, reason: str) -> None:
        if self.lost is None and not self._closed.is_set():
            self.lost = reason
            self.on_lost(reason)

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                event = self._watch.get(5.0)  # cancelling the watch wakes this at once
            except StoreUnavailable as exc:
                return self._lose(str(exc))
            if event is None or event.kind != PUT:
                continue
            try:
                self._handle(event.key, event.value)
            except RecycleError as exc:  # unavailable, or refused: the lease ended under it
                return self._lose(str(exc))

    def _handle(self, key: str, value: str) -> None:
        if key == self.keys.decision:
            self.decision = decode_decision(value)
            self.on_decision(self.decision)
        elif key == self.keys.abort:
            self._answer(AbortNotice.from_json(value))

    def _answer(self, notice: AbortNotice) -> None:
        stale = self.decision is not None and notice.gen < self.decision.gen
        if notice.gen in self._answered or stale or self.lost is not None:
            return
        self._answered.add(notice.gen)
        report = HostReady(notice.gen, self.record.node, self.steps())
        self.store.put(self.keys.ready(notice.gen) + str(self.record.node), report.to_json(),
                       lease=self.keeper.lease)

    def close(self, leave: bool = True) -> None:
        """Stop; with `leave`, revoke the lease (the host's keys go at once), else let it
        expire as a lost host's does."""
        self._closed.set()
        if self._watch is not None:
            self._watch.cancel()
        self.keeper.close(revoke=leave)


# -- the leader's side -----------------------------------------------------------------------

Lookup = Callable[[list], "tuple[str, float] | None"]


class Leader:
    """The leading coordinator's decisions: it reacts to watch events only (no polling).
    `run()` returns when `stop` is set or leadership is lost (`election.deposed`)."""

    def __init__(self, election: Election, keys: Keys, pipelines: int, stages: int,
                 lookup: Lookup, on_decision: Callable[[Decision], None] = lambda d: None):
        self.election = election
        self.store = election.store
        self.keys = keys
        self.pipelines, self.stages = pipelines, stages
        self.lookup = lookup
        self.on_decision = on_decision
        self.hosts: dict[int, HostRecord] = {}
        self.decision: Decision | None = None
        self.decision_rev = 0
        self.aborted: AbortNotice | None = None
        self.reports: dict[int, HostReady] = {}

    # the state, from the store
    def _load(self) -> int:
        """The job's keys as a predecessor left them (the notices to hosts first, so that
        the reports of an open abort count)."""
        entries, read_at = self.store.get_prefix(self.keys.root)
        entries.sort(key=lambda e: not e.key.startswith(self.keys.to_hosts))
        for e in entries:
            self._apply(PUT, e.key, e.value, e.mod_revision, decide=False)
        return read_at

    def run(self, stop: threading.Event) -> None:
        read_at = self._load()
        watch = self.store.watch(self.keys.root, read_at + 1)
        try:
            self._settle()
            while not stop.is_set() and not self.election.deposed.is_set():
                event = watch.get(0.2)
                if event is not None:
                    self._apply(event.kind, event.key, event.value, event.revision)
        finally:
            watch.cancel()

    def _apply(self, kind: str, key: str, value: str, revision: int,
               decide: bool = True) -> None:
        k = self.keys
        if key.startswith(k.hosts):
            node = int(key[len(k.hosts):])
            if kind == PUT:
                self.hosts[node] = HostRecord.from_json(value)
            elif self.hosts.pop(node, None) is not None and decide:
                log.info("host %d lost (its lease ended)", node)
        elif key == k.decision and kind == PUT:
            self.decision, self.decision_rev = decode_decision(value), revision
        elif key == k.abort and kind == PUT:
            self.aborted = AbortNotice.from_json(value)
        elif key.startswith(k.root + "ready/") and kind == PUT:
            report = HostReady.from_json(value)
            if self.aborted is not None and report.gen == self.aborted.gen:
                self.reports[report.node] = report
        elif key.startswith(k.root + "ready/") and kind == DELETE:
            gen, node = key[len(k.root + "ready/"):].split("/")
            if self.aborted is not None and int(gen) == self.aborted.gen:
                self.reports.pop(int(node), None)
        if decide:
            self._settle()

    def _post_abort(self, gen: int, reason: str) -> None:
        """Abandon generation `gen`; reports already there (a predecessor's abort) count."""
        notice = AbortNotice(gen, reason)
        if self.election.write([(self.keys.abort, notice.to_json(), 0)]):
            self.aborted = notice
            self.reports = {}
            for e in self.store.get_prefix(self.keys.ready(gen))[0]:
                report = HostReady.from_json(e.value)
                self.reports[report.node] = report

    def _settle(self) -> None:
        """What the state asks for: start the job once every host is up; abandon the current
        generation when a member's host is gone (also one lost while nobody led); decide
        when every live host has answered the open abort."""
        current = self.decision.gen if self.decision is not None else 0
        collecting = self.aborted is not None and self.aborted.gen == current
        if not collecting:
            if self.decision is None:
                if len(self.hosts) * self._per_host() >= self.pipelines * self.stages:
                    self._post_abort(0, "start")  # everyone reports, then generation 1
                return
            live = {r for h in self.hosts.values() for r in h.ranks}
            lost = [r for r in self.decision.members if r not in live]
            if lost and self.decision.action == "run":
                self._post_abort(current, f"ranks {lost[:8]} lost with their host")
            return
        if set(self.hosts) <= set(self.reports):
            self._decide()

    def _per_host(self) -> int:
        return max((len(h.ranks) for h in self.hosts.values()), default=1)

    def _decide(self) -> None:
        gen = self.aborted.gen + 1
        steps = {r: s for rep in self.reports.values() if rep.node in self.hosts
                 for r, s in rep.steps.items()}
        decision = protocol.decide(gen, self.pipelines, self.stages, steps, self.lookup,
                                   initial=self.decision is None)
        if self.election.write([(self.keys.decision, encode_decision(decision), 0)],
                               compares=[Compare(self.keys.decision, "mod", self.decision_rev)],
                               delete_prefixes=[self.keys.ready(self.aborted.gen)]):
            log.info("generation %d decided: %s, %d members", gen, decision.action,
                     len(decision.members))
            self.on_decision(decision)
        self.reports = {}
