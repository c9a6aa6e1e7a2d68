"""Coordinators that fail over: every coordinator campaigns; the leader acts, the others stand
by; a deposed leader stops acting at once.

Two ways to lead, one election (`election.py`), as subcommands of
`python -m recycle_planner.executor.control.failover`:

- `decide`: the decisions themselves live on etcd (`stand_by_or_lead` runs `plane.Leader`); a
  deposed leader campaigns again. The tests and the benchmark start several and kill the leader.
- `coordinate -- recycle-planner coordinator ...`: today's coordinator, whose decisions live in
  its own c10d store, acts only while this process leads (`coordinate`, on `lead_then`): it
  starts at once as a hot standby and is told when to act (`STANDBY_ENV`), this process
  publishes where its store listens, a later leader tells it to take over (it adopts the
  generation the lost one's workers still run, `takeover.py`), and a deposed leader's
  coordinator is killed at once (its own store is not fenced by etcd). `follow --
  recycle-planner launch ... --rdzv-endpoint {coordinator} ...` runs a host agent against the
  leader's store, telling it where to find the next leader (`Successor`, in `FOLLOW_ENV`): it
  re-attaches there with its workers running; a host agent that stopped its workers anyway
  (no leader in time) is run again against the next leader.

Exit status: that of the command (`coordinate`, `follow`); 0 when stopped (SIGTERM, SIGINT); 3
when the control store is unavailable (every endpoint down, or etcd lost its quorum): no
decision can be made, so the job stops and its workers write a consistent checkpoint
(`--resume` continues); 4 for a leader deposed while coordinating."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from functools import cache, cached_property
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from recycle_planner.errors import RecycleError
from recycle_planner.executor.config import RDZV_ID, WorkerConfig
from recycle_planner.executor.control.election import Deposed, Election
from recycle_planner.executor.control.plane import HostRecord, Keys, Leader, Lookup
from recycle_planner.executor.control.protocol import Decision
from recycle_planner.executor.control.store import (ControlStore, LeaseKeeper, StoreRefused,
                                                    StoreUnavailable)

log = logging.getLogger(__name__)

STORE_UNAVAILABLE = 3
"""Exit status of a coordinator whose control store cannot answer."""

DEPOSED = 4
"""Exit status of a coordinator that lost its leadership while coordinating (`lead_then`)."""

T = TypeVar("T")


def lead_then(store: ControlStore, keys: Keys, identity: str, ttl: float, endpoint: str,
              run: Callable[[str | None], T], stop: threading.Event | None = None,
              on_deposed: Callable[[int], None] = os._exit,
              ended: Callable[[T], "Outcome | None"] = lambda result: None,
              since: int | None = None) -> T | None:
    """Stand by until this coordinator leads (None if `stop` is set first), publish `endpoint`
    (HOST:PORT of the store it is about to host) under the fence and its lease, then return
    `run(previous)`, `previous` being the endpoint a former leader published (None for the
    job's first leader: the others continue its run). `ended(result)`: how the job ended, if
    it did (`Outcome`, published for the standbys); `since`: a revision, from which on an
    `Outcome` published by another leader means there is nothing left to lead. When the
    leadership is lost meanwhile, `on_deposed(DEPOSED)` is called from a watchdog thread (by
    default the process exits at once: the next leader takes over)."""
    election = _candidate(store, keys, identity, ttl, stop)
    if election is None:
        return None
    if since is not None and ended_since(store, keys, since) is not None:
        election.resign()  # won as the finished job's leader resigned
        return None
    before = store.get(keys.led)
    if not election.write([(keys.coordinator, endpoint, election.lease),
                           (keys.led, endpoint, 0)]):
        raise Deposed(f"{identity} lost the election before publishing its endpoint")
    log.info("%s leads; its store is at %s", identity, endpoint)
    done = threading.Event()

    def watchdog() -> None:
        while not done.wait(0.05):
            if election.deposed.is_set() or election.overdue():
                log.error("%s lost its leadership (%s): stopping at once", identity,
                          election.reason or f"no renewal of its lease confirmed for {ttl:g} "
                                             f"s: its link to etcd is cut, or etcd is gone")
                return on_deposed(DEPOSED)

    threading.Thread(target=watchdog, name="leadership-watchdog", daemon=True).start()
    try:
        result = run(before.value if before is not None else None)
        outcome = ended(result)
        if outcome is not None:
            _publish(election, keys, outcome)
        return result
    finally:
        done.set()
        election.resign()


@dataclass(frozen=True)
class Outcome:
    """How a job ended under its leader (`Keys.outcome`): `code`, the exit status of the
    leader's coordinator, which ended by itself (completed, failed, or stopped with a
    checkpoint); `by`, the leader. Its standbys leave with the same status instead of taking
    over a finished run."""

    code: int
    by: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Outcome":
        d = json.loads(text)
        return cls(int(d["code"]), str(d["by"]))


def _publish(election: Election, keys: Keys, outcome: Outcome) -> None:
    """The job's end, for its standbys; with it goes `Keys.led` (nothing is left to take over:
    a later run under the same name starts afresh, not as a takeover of this one)."""
    try:
        election.write([(keys.outcome, outcome.to_json(), 0)], deletes=[keys.led])
    except (Deposed, StoreUnavailable) as exc:  # the standbys then take over, and stop
        log.warning("the job's end was not published (%s)", exc)


def ended_since(store: ControlStore, keys: Keys, since: int) -> Outcome | None:
    """The job's `Outcome` if a leader published one after revision `since`."""
    entry = store.get(keys.outcome)
    if entry is None or entry.mod_revision <= since:
        return None
    return Outcome.from_json(entry.value)


def _watch_outcome(store: ControlStore, keys: Keys, since: int,
                   stop: threading.Event) -> None:
    """A standby's thread: an `Outcome` published after revision `since` (the job ended under
    another leader) sets `stop`."""
    try:
        watch = store.watch(keys.outcome, since + 1)
    except StoreUnavailable:
        return  # the campaign says so
    try:
        while not stop.is_set():
            event = watch.get(0.5)
            if event is not None and event.kind == "put" and event.key == keys.outcome:
                stop.set()
    except StoreUnavailable:
        return
    finally:
        watch.cancel()


def _candidate(store: ControlStore, keys: Keys, identity: str, ttl: float,
               stop: threading.Event | None) -> Election | None:
    """Campaign until this candidate leads (its election), or `stop` (None). A candidate
    whose lease ended while it stood by (its process was stopped) campaigns again; one that
    cannot reach the store raises `StoreUnavailable` (etcd lost its quorum: nobody leads)."""
    while True:
        election = Election(store, keys.election, identity, ttl)
        try:
            return election if election.campaign(stop) is not None else None
        except Deposed as exc:
            if exc.unreachable:
                raise StoreUnavailable(str(exc)) from None
            log.warning("%s lost its candidacy (%s); campaigning again", identity, exc)


def _publication(store: ControlStore, keys: Keys) -> tuple[Any, int]:
    """The coordinator's publication (None if there is none) and the revision read at."""
    entries, read_at = store.get_prefix(keys.coordinator)
    return next((e for e in entries if e.key == keys.coordinator), None), read_at


def published_coordinator(store: ControlStore, keys: Keys, timeout: float, after: int = 0,
                          same_after: float | None = None) -> tuple[str, int]:
    """HOST:PORT of the leading coordinator's store and the revision it was published at,
    waiting up to `timeout` seconds for one published after revision `after` (a host agent's
    first question, and its question after losing a coordinator). With `same_after`: or the
    one published at `after` itself, if it still stands `same_after` seconds on. Its key
    lives under the leader's election lease, so a lost leader's is gone by then: this one
    still leads, it was only slow, or this host was cut off from it for a while."""
    # one read: a publication between two reads (a get, then the revision to watch from)
    # was in neither, and a host agent waited for it in vain
    entry, read_at = _publication(store, keys)
    if entry is not None and entry.mod_revision > after:
        return entry.value, entry.mod_revision
    watch = store.watch(keys.coordinator, read_at + 1)
    deadline = time.monotonic() + timeout
    recheck = float("inf") if same_after is None else time.monotonic() + same_after
    try:
        while time.monotonic() < deadline:
            event = watch.get(max(0.0, min(deadline, recheck) - time.monotonic()))
            if event is not None and event.kind == "put" and event.revision > after:
                return event.value, event.revision
            if time.monotonic() >= recheck:
                recheck = float("inf")
                entry, _ = _publication(store, keys)
                if entry is not None and entry.mod_revision == after:
                    return entry.value, after
    finally:
        watch.cancel()
    raise RecycleError(f"no coordinator published its store under {keys.coordinator} within "
                       f"{timeout:g} s")


COORDINATOR = "{coordinator}"
"""In a host agent's command (`follow`), replaced by the leader's HOST:PORT."""

FOLLOW_ENV = "RECYCLE_FOLLOW"
"""The environment variable by which `follow` tells its host agent where the next leader is
published (a `Successor` as JSON)."""


@dataclass(frozen=True)
class Successor:
    """Where a host agent finds the coordinator that takes over from its own: the etcd
    endpoints, the job, the revision at which its current coordinator was published (the
    next one is published after it), and the lease (etcd's client timeout)."""

    etcd: str
    job: str
    revision: int
    lease: float

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> "Successor | None":
        raw = os.environ.get(FOLLOW_ENV)
        if not raw:
            return None
        d = json.loads(raw)
        return cls(str(d["etcd"]), str(d["job"]), int(d["revision"]), float(d["lease"]))

    def after(self, revision: int) -> "Successor":
        return replace(self, revision=revision)

    def find(self, timeout: float) -> tuple[str, int]:
        """HOST:PORT of the next leader's store and its revision (waits up to `timeout`), or
        the same leader's (this revision) if it still leads a lease on."""
        return published_coordinator(_etcd(self.etcd, self.lease), Keys(self.job), timeout,
                                     self.revision, same_after=self.lease)

    def relay(self, node: int, groups: Callable[[], Any],
              counted: Mapping[int, int] | None = None) -> Any:
        """Host `node`'s side of the control traffic on this job's etcd (`transport.EtcdHost`:
        under `--rdzv-backend etcd`, the relay's transport, whoever leads), addressed to the
        coordinator published at `revision`; `groups` gives that leader's c10d store,
        `counted` the incarnations this host spawned before it (raised there when needed)."""
        from recycle_planner.executor.control.transport import EtcdHost

        return EtcdHost(_etcd(self.etcd, self.lease), Keys(self.job).relay, node, groups,
                        to=self.revision, counted=counted)


HOSTS_ENV = "RECYCLE_HOSTS"
"""The environment variable by which `coordinate` tells its coordinator where the job's host
leases are (a `HostLeases` as JSON)."""


@dataclass(frozen=True)
class HostLeases:
    """The job's host leases on etcd (`Keys.host`): each host's `follow` wrapper holds one for
    its node (`hold`), deleted by etcd when the host is lost (nothing renews it); a
    coordinator that takes over asks which are held (`held`), so that it waits for the hosts
    that are alive only, not three leases for one etcd knows is gone."""

    etcd: str
    job: str
    lease: float
    publication: int = 0   # the revision of its leader's publication (`standby_word`)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> "HostLeases | None":
        raw = os.environ.get(HOSTS_ENV)
        if not raw:
            return None
        d = json.loads(raw)
        return cls(str(d["etcd"]), str(d["job"]), float(d["lease"]),
                   int(d.get("publication", 0)))

    @cached_property
    def _store(self) -> ControlStore:
        return _leases_store(self.etcd, self.lease)

    def held(self) -> set[int]:
        """The nodes whose host lease is held now; `StoreUnavailable` if etcd cannot say."""
        entries, _ = self._store.get_prefix(Keys(self.job).hosts)
        return {HostRecord.from_json(e.value).node for e in entries}

    def relay(self, groups: Any, fresh: bool) -> Any:
        """The leading coordinator's side of the control traffic on this job's etcd
        (`transport.EtcdCoordinator`; `fresh`: it starts the job, taking over from none),
        every write fenced by its leader's publication (the
        key the leader wrote under its election fence just before telling this coordinator
        to lead, at revision `publication`, gone with its lease: a deposed coordinator's
        writes are refused). The revision is the one its leader wrote, never read here: read
        later, it could be a next leader's, which would let a deposed coordinator write.
        `groups`: its c10d store, where the process groups form."""
        from recycle_planner.executor.control.store import Compare
        from recycle_planner.executor.control.transport import EtcdCoordinator

        if self.publication <= 0:
            raise Deposed("this coordinator was not told a leader's publication: it does not "
                          "lead")
        keys = Keys(self.job)
        return EtcdCoordinator(self._store, keys.relay,
                               Compare(keys.coordinator, "mod", self.publication), groups,
                               to=self.publication, fresh=fresh)

    @staticmethod
    def hold(store: ControlStore, keys: Keys, record: HostRecord, ttl: float) -> "HostHold":
        """Hold `record`'s host key under a lease of its own (close the holder to leave)."""
        return HostHold(store, keys.host(record.node), record, ttl)


class HostHold:
    """A live host's key on etcd, under a lease taken again whenever it is lost (etcd did not
    answer for a lease, or a renewal found it expired): a coordinator that takes over does
    not wait for a host whose key is gone (`takeover.Waiting`), so one lapse must not make a
    live host look lost for the rest of the job. Raises `StoreUnavailable` when etcd cannot
    answer at the start."""

    def __init__(self, store: ControlStore, key: str, record: HostRecord, ttl: float):
        self.store, self.key, self.record, self.ttl = store, key, record, ttl
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self.keeper = self._take()

    def _take(self) -> LeaseKeeper:
        keeper = LeaseKeeper(self.store, self.ttl, self._lost)
        try:
            self.store.put(self.key, self.record.to_json(), lease=keeper.lease)
        except StoreUnavailable:
            keeper.close(revoke=False)  # the lease expires by itself
            raise
        return keeper

    def _lost(self, reason: str) -> None:
        log.warning("host %d's lease on etcd was lost (%s): taking it again",
                    self.record.node, reason)
        threading.Thread(target=self._retake, name="host-lease", daemon=True).start()

    def _retake(self) -> None:
        """Every third of the TTL until etcd answers or the host leaves."""
        while not self._closed.wait(self.ttl / 3):
            try:
                keeper = self._take()
            except StoreUnavailable:
                continue
            with self._lock:
                if not self._closed.is_set():
                    self.keeper = keeper
                    log.info("host %d holds its lease on etcd again", self.record.node)
                    return
            keeper.close()
            return

    def close(self, revoke: bool = True) -> None:
        """Leave: with `revoke`, the key goes at once; without, it goes a lease later."""
        with self._lock:
            self._closed.set()
            keeper = self.keeper
        keeper.close(revoke=revoke)


STANDBY_ENV = "RECYCLE_STANDBY"
"""Set by `coordinate` for its command, which it starts before campaigning (a hot standby:
Python and torch load in seconds, which a takeover should not wait for): the command loads,
then reads one line on stdin (`standby_word`): `LEAD` (the job's first leader), `TAKE_OVER`
(it follows a lost leader), or nothing (this process never led: it leaves), with the revision
of its leader's publication (the fence of its writes)."""
LEAD, TAKE_OVER = "lead", "take-over"


def standby_word() -> str | None:
    """In a command `coordinate` started: block until it leads; its word (`LEAD`,
    `TAKE_OVER`), "" if it never will. None when not started as a standby. The word comes
    with the revision of its leader's publication, which this process's host leases
    (`HOSTS_ENV`) take as the fence of its writes."""
    if not os.environ.pop(STANDBY_ENV, None):
        return None
    hosts = HostLeases.from_env()
    if hosts is not None:  # its etcd client made and connected now, not once it leads
        _warm(hosts)
    word, _, publication = sys.stdin.readline().strip().partition(" ")
    if hosts is not None and publication.lstrip("-").isdigit():
        os.environ[HOSTS_ENV] = replace(hosts, publication=int(publication)).to_json()
    return word if word in (LEAD, TAKE_OVER) else ""


def coordinate(store: ControlStore, keys: Keys, identity: str, ttl: float, endpoint: str,
               command: list[str], stop: threading.Event | None = None,
               hosts: HostLeases | None = None) -> int | None:
    """Run `command` (`recycle-planner coordinator ...`, hosting its store at `endpoint`)
    while this process leads. It starts at once, as a hot standby (`STANDBY_ENV`), and is
    told when this process leads: `LEAD`, or `TAKE_OVER` for a leader that follows another,
    so that it adopts the generation its predecessor's workers still run (`--take-over`).
    Deposed: the command's processes are killed at once and this process exits with
    `DEPOSED`. `hosts`: where it reads the host leases (`HOSTS_ENV`). Returns the command's
    exit status, or the leader's when the job ended under another (`Outcome`; None: stopped
    before leading)."""
    stop, since = stop or threading.Event(), store.revision()
    threading.Thread(target=_watch_outcome, args=(store, keys, since, stop),
                     name="job-outcome", daemon=True).start()
    env = {**os.environ, STANDBY_ENV: "1"}
    if hosts is not None:
        env[HOSTS_ENV] = hosts.to_json()
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, start_new_session=True,
                            preexec_fn=_die_with_parent, env=env)

    def run(previous: str | None) -> int:
        # the fence its command writes under: this leader's publication, as written (-1 if
        # another one's stands there already: deposed meanwhile, every write is refused)
        published = store.get(keys.coordinator)
        publication = published.mod_revision \
            if published is not None and published.value == endpoint else -1
        try:
            proc.stdin.write(f"{LEAD if previous is None else TAKE_OVER} "
                             f"{publication}\n".encode())
            proc.stdin.close()
        except OSError:  # it ended while standing by (its own error is in its output)
            pass
        return _wait(proc, stop)

    def deposed(code: int) -> None:
        ended = proc.poll()  # it had ended by itself (its run is decided): its own status
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # nothing of it is left
            pass
        os._exit(code if ended is None or ended < 0 else ended)

    try:
        code = lead_then(store, keys, identity, ttl, endpoint, run, stop, on_deposed=deposed,
                         ended=lambda code: Outcome(code, identity) if code >= 0 else None,
                         since=since)
        if code is None and (outcome := ended_since(store, keys, since)) is not None:
            log.info("the job ended under %s (exit status %d): standing down", outcome.by,
                     outcome.code)
            return outcome.code
        return code
    finally:
        if not proc.stdin.closed:  # never led: the standby leaves
            proc.stdin.close()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _wait(proc: subprocess.Popen, stop: threading.Event | None) -> int:
    """`proc`'s exit status; `stop` (SIGTERM or SIGINT to this process) is passed on to it as
    SIGTERM, which the executor's commands answer by stopping with a checkpoint."""
    if stop is not None:
        threading.Thread(target=lambda: stop.wait() and proc.poll() is None
                         and proc.terminate(), daemon=True).start()
    return proc.wait()


def _die_with_parent() -> None:
    """In the coordinator's child: be SIGKILLed when this process dies, however it dies, so
    that a coordinator never outlives the leadership it ran under (Linux's PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def follow(store: ControlStore, keys: Keys, command: list[str], timeout: float,
           stop: threading.Event | None = None,
           successor: Callable[[int], Successor] | None = None,
           host: HostRecord | None = None, ttl: float = WorkerConfig.lease) -> int:
    """Run a host agent's `command` (`recycle-planner launch --nnodes ... --rdzv-endpoint
    {coordinator} ...`) against the leading coordinator, and again against the next leader
    each time it stops because it lost its coordinator (`COORDINATOR_LOST`: its workers wrote
    a checkpoint). `successor(revision)`: what the host agent is told (`FOLLOW_ENV`) to find
    the next leader itself, its workers running. `host`: this host's record, held under a
    lease of `ttl` seconds meanwhile (`HostLeases`). Returns the host agent's last exit
    status."""
    from recycle_planner.executor.config import COORDINATOR_LOST

    keeper = None if host is None else HostLeases.hold(store, keys, host, ttl)
    after = 0
    try:
        while True:
            endpoint, after = published_coordinator(store, keys, timeout, after)
            log.info("host agent follows the coordinator at %s", endpoint)
            env = None if successor is None else \
                {**os.environ, FOLLOW_ENV: successor(after).to_json()}
            code = _wait(subprocess.Popen([a.replace(COORDINATOR, endpoint) for a in command],
                                          env=env), stop)
            if code != COORDINATOR_LOST or (stop is not None and stop.is_set()):
                return code
    finally:
        if keeper is not None:
            keeper.close()  # left: its key goes at once


def stand_by_or_lead(store: ControlStore, keys: Keys, identity: str, ttl: float,
                     pipelines: int, stages: int, lookup: Lookup, stop: threading.Event,
                     on_decision: Callable[[Decision], None] = lambda d: None,
                     on_lead: Callable[[int], None] = lambda revision: None) -> None:
    """Campaign, lead while leading, campaign again when deposed, until `stop` is set.
    Raises `StoreUnavailable` when the store cannot answer."""
    while not stop.is_set():
        election = Election(store, keys.election, identity, ttl)
        try:
            won = election.campaign(stop)
            if won is None:
                break
            on_lead(won.revision)
            Leader(election, keys, pipelines, stages, lookup, on_decision).run(stop)
            if election.deposed.is_set():
                raise election._deposed()
        except Deposed as exc:
            if exc.unreachable:
                raise StoreUnavailable(str(exc)) from None
            log.warning("%s was deposed (%s); campaigning again", identity, exc)
        finally:
            if not election.deposed.is_set():
                election.resign()


def library_lookup(folder: Path) -> tuple[Lookup, int, int]:
    """The plan library's lookup (the plan file and its degradation for a dead set), and the
    job's pipelines and stages."""
    from recycle_planner.library.lookup import PlanLibrary

    lib = PlanLibrary.open(folder)

    def lookup(dead):
        hit = lib.lookup(dead)
        return hit.file.name, hit.entry.metrics.degradation

    return lookup, lib.spec.pipelines, lib.spec.stages


def campaign_and_coordinate(endpoints: str, job: str, lease: float, endpoint: str,
                            command: list[str], name: str | None = None) -> int:
    """`recycle-planner coordinator --rdzv-backend etcd`: campaign on the etcd at `endpoints`
    and run `command` (the same coordinator on the job's own c10d store, which listens at
    `endpoint`) while leading; SIGTERM and SIGINT are passed on. Returns the exit status."""
    stop = _stop_on_signals()
    store = _etcd(endpoints, lease)
    code = coordinate(store, Keys(job), name or f"{socket.gethostname()}:{os.getpid()}",
                      lease, endpoint, command, stop, HostLeases(endpoints, job, lease))
    return 0 if code is None else code


def follow_leader(endpoints: str, job: str, lease: float, command: list[str],
                  timeout: float, host: HostRecord | None = None) -> int:
    """`recycle-planner launch --rdzv-backend etcd`: run this host's agent (`command`, with
    `COORDINATOR` for the coordinator's HOST:PORT) against the leading coordinator; it
    re-attaches to the next leader itself, and is run again if it stopped. `host` (known
    when the node rank is given): held on etcd under the lease meanwhile. Returns the host
    agent's last exit status."""
    return follow(_etcd(endpoints, lease), Keys(job), command, timeout, _stop_on_signals(),
                  lambda revision: Successor(endpoints, job, revision, lease), host, lease)


@cache
def _leases_store(endpoints: str, lease: float) -> ControlStore:
    """One etcd client per process for the host leases and the leading coordinator's traffic
    (`HostLeases`), so that a hot standby makes it before it leads (`_warm`)."""
    return _etcd(endpoints, lease)


def _warm(hosts: HostLeases) -> None:
    """Make the standby's etcd client and its first connection while standing by: at 1,024
    ranks on 2 loaded cores, importing the client and connecting took 0.9 s of a takeover
    after the word to lead. Nothing lost if etcd does not answer now."""
    try:
        hosts.held()
    except (StoreUnavailable, StoreRefused):  # said again, and acted on, once it leads
        pass


def _etcd(endpoints: str, lease: float) -> ControlStore:
    from recycle_planner.executor.control.store import EtcdStore

    return EtcdStore(endpoints, timeout=max(2.0, lease))


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recycle_planner.executor.control.failover",
        description="Coordinators that fail over on etcd: every coordinator campaigns, one "
                    "leads, the others stand by.")
    sub = parser.add_subparsers(dest="mode", required=True)
    decide = sub.add_parser("decide", help="make the job's membership decisions on etcd "
                                           "while leading (plane.Leader)")
    lead = sub.add_parser("coordinate", help="run COMMAND (recycle-planner coordinator ...) "
                                             "as a hot standby: it reads 'lead' or "
                                             "'take-over' on stdin when this process leads")
    host = sub.add_parser("follow", help="run a host agent's COMMAND against the leader's "
                                         "store ({coordinator} in it), again after a failover")
    for p in (decide, lead, host):
        p.add_argument("--etcd", required=True, help="etcd endpoints, HOST:PORT[,HOST:PORT]")
        p.add_argument("--job", default=RDZV_ID, help="the job's name (its key prefix)")
        p.add_argument("--lease", type=float, default=WorkerConfig.lease,
                       help="seconds without renewal after which a leader (or a host) is "
                            "replaced: the executor's one lease (default %(default)s)")
    for p in (decide, lead):
        p.add_argument("--name", default=f"{socket.gethostname()}:{os.getpid()}",
                       help="this coordinator's name in the election")
    decide.add_argument("--library", required=True, type=Path, help="the plan library folder")
    lead.add_argument("--endpoint", required=True,
                      help="HOST:PORT where COMMAND's store listens (what host agents dial)")
    host.add_argument("--timeout", type=float, default=300.0,
                      help="seconds to wait for a leader to publish its store")
    for p in (lead, host):
        p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        if args.mode != "decide":
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not command:
                raise RecycleError(f"{args.mode}: no command after --")
            if args.mode == "follow":
                return follow_leader(args.etcd, args.job, args.lease, command, args.timeout)
            return campaign_and_coordinate(args.etcd, args.job, args.lease, args.endpoint,
                                           command, args.name)
        stop = _stop_on_signals()
        store, keys = _etcd(args.etcd, args.lease), Keys(args.job)
        lookup, pipelines, stages = library_lookup(args.library)
        stand_by_or_lead(store, keys, args.name, args.lease, pipelines, stages, lookup, stop,
                         on_decision=lambda d: print(f"decision {d.gen} {d.action} "
                                                     f"{len(d.members)}", flush=True),
                         on_lead=lambda rev: print(f"leading {rev}", flush=True))
    except StoreUnavailable as exc:
        print(f"error: the control store is unavailable: {exc}", file=sys.stderr)
        return STORE_UNAVAILABLE
    except RecycleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
