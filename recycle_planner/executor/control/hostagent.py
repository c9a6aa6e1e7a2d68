"""One agent per training host, shaped like torchrun: start this host's workers, relay their
control traffic, report their exits to the coordinator, kill the ones it declared dead, restart
them if asked.

The workers talk to this agent only (`link.HostLink` over the Unix domain socket of its
`relay.Relay`): the agent holds one lease for the host, batches its workers' reports into one
per-host record, watches the coordinator's notices once for the host and pushes aborts and
decisions to its workers. What it watches itself: its workers' processes (it spawns them: an
exit is known within milliseconds) and their heartbeats over the socket (a worker silent for
the lease is killed, which makes it dead); the coordinator's notices (none for a lease, or
its store failing: the coordinator is lost). With coordinators that fail over (`successor`,
set by `failover.follow`), a lost coordinator is replaced live: the agent finds the next
leader's store on etcd and re-attaches its relay there while its workers keep training
(`_detach`, `_reattach_due`), or re-attaches to the same leader if etcd says it still leads
a lease on (it was slow, or this host was cut off from it); only when no leader publishes
within `rdzv_timeout` do they stop with a checkpoint (`COORDINATOR_LOST`), and workers that
joined no generation yet are stopped once a new leader is found (nothing to checkpoint: they
come back fresh).

Placement: host `node_rank` runs global ranks `node_rank * nproc_per_node + local_rank`
(consecutive ranks per host, as torchrun places them), and rank r plays worker
(pipeline, stage) = (r // S, r % S). With nproc_per_node = S a host holds one whole
pipeline; losing the host then loses one worker of every stage, which the plan library must
cover (`plan-all --max-failures` >= S per lost host). The coordinator's lookup receives the
physical dead set, whichever host it was.

Workers get torchrun's environment: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK (the node rank), ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (the
coordinator's store, where process groups form), TORCHELASTIC_RESTART_COUNT, and RECYCLE_RELAY
(the relay's socket); the settings come from the coordinator.
The agent passes its own environment on, so GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME set for
the agent reach the workers.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import threading
import time
from functools import cache
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from recycle_planner.errors import RecycleError
from recycle_planner.executor.control.pool import exit_how, last_line
from recycle_planner.executor.config import (CONFIG_ENV, CONFIG_ERROR, CONFIG_KEY,
                                             COORDINATOR_LOST, RDZV_ID, RDZV_TIMEOUT,
                                             WorkerConfig)
from recycle_planner.executor.control import messages as msg
from recycle_planner.executor.control.pause import PauseClock
from recycle_planner.executor.control.relay import RELAY_ENV, Relay, relay_path
from recycle_planner.executor.control.transport import C10dHost

log = logging.getLogger(__name__)

CONNECT_TRY = 2.0
"""Seconds of one connection attempt to the coordinator while waiting for it."""

EXIT_STATUS = {"completed": 0, "failed": 1, "stopped": 2}
"""The host agent's exit status by the job's outcome (COORDINATOR_LOST when it lost it)."""


@dataclass(frozen=True)
class HostConfig:
    """Where this host is in the job. Times in seconds."""

    nnodes: int
    nproc_per_node: int
    endpoint: str                      # HOST:PORT of the coordinator's store
    node_rank: int | None = None       # None: the next free one (rendezvous by arrival)
    rdzv_id: str = RDZV_ID
    max_restarts: int = 0              # restarts per local worker
    restart_delay: float = 0.0
    startup_timeout: float = 300.0
    rdzv_timeout: float = RDZV_TIMEOUT  # how long to wait for the coordinator to be there
    poll: float = 0.02
    successor: Any = None              # failover.Successor: coordinators that fail over

    def __post_init__(self) -> None:
        host, _, port = self.endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise RecycleError(f"--rdzv-endpoint {self.endpoint!r} is not HOST:PORT")
        if not self.rdzv_timeout > 0:
            raise RecycleError(f"--rdzv-timeout must be positive, got {self.rdzv_timeout}")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise RecycleError(f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1}")

    @property
    def address(self) -> tuple[str, int]:
        host, _, port = self.endpoint.rpartition(":")
        return host.strip("[]"), int(port)


def dial(host: str, port: int, connect: float, timeout: float) -> dist.TCPStore:
    """A client of the coordinator's store that may take up to `connect` seconds to connect,
    whose calls then time out after `timeout`. A connection is not a call: a store just
    published may not listen yet, and c10d's store server looks every new client up in DNS on
    its one thread (here a dropped query held it for 5 s, about one connection in 25).
    Connecting within the lease made such a connection fail the host's start, or its
    re-attach to the next leader, at 1,024 ranks (benchmarks/bench_relay_takeover.py)."""
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=connect))
    store.set_timeout(timedelta(seconds=timeout))
    return store


@dataclass
class _Local:
    rank: int
    local_rank: int
    incarnation: int
    popen: subprocess.Popen
    log_path: Path


class HostAgent:
    def __init__(self, command: list[str], config: HostConfig,
                 on_event: Callable[[str], None] | None = None):
        self.command = command
        self.config = config
        self.on_event = on_event or (lambda message: log.info("%s", message))
        self.store = self._connect()
        self.node_rank = config.node_rank
        self.workers: dict[int, _Local] = {}
        self.restarts: dict[int, int] = {}
        self.preempted: float | None = None
        self.relay: Relay | None = None
        self.why: dict[int, str] = {}          # rank -> why this agent killed it
        self.kills_seen: dict[tuple[int, int], float] = {}  # kill notices, when first seen
        self.incarnations: dict[int, int] = {}  # rank -> the newest incarnation spawned
        self.successor = config.successor
        self.finding: dict[str, Any] | None = None  # the search for the next coordinator

    def _connect(self) -> dist.TCPStore:
        """The coordinator's store, waiting for it up to `rdzv_timeout` (a host agent may
        start before its coordinator), saying so in the log; then one line."""
        c = self.config
        host, port = c.address
        deadline = time.monotonic() + c.rdzv_timeout
        said = 0.0
        while True:
            left = deadline - time.monotonic()
            try:  # a plain probe first: c10d logs every failed try on stderr
                socket.create_connection((host, port), max(0.1, min(CONNECT_TRY, left))).close()
                break
            except OSError as exc:
                why = str(exc) or type(exc).__name__
            if time.monotonic() >= deadline:
                raise RecycleError(f"no coordinator at {c.endpoint} after {c.rdzv_timeout:g} "
                                   f"s (start 'recycle-planner coordinator' there first, or "
                                   f"check --rdzv-endpoint): {why[:120]}")
            if time.monotonic() - said >= 10 or not said:
                said = time.monotonic()
                self.on_event(f"waiting for the coordinator at {c.endpoint} (giving up in "
                              f"{deadline - said:.0f} s)")
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        return self._client(c.startup_timeout)

    def _transport(self, store: Any, notices: Callable[[float], Any]) -> Any:
        """The relay's transport to the coordinator: on the job's etcd where coordinators
        fail over on it (`successor`: its keys outlive a leader), else on the coordinator's
        `store` (with `notices(lease)`, a second client for the blocking waits)."""
        if self.successor is not None:
            return self.successor.relay(self.node_rank, lambda: store)
        return C10dHost(store, notices(self.lease))

    def _client(self, timeout: float) -> dist.TCPStore:
        c = self.config
        host, port = c.address
        try:
            return dial(host, port, c.startup_timeout, timeout)
        except (RuntimeError, dist.DistError) as exc:
            raise RecycleError(f"cannot reach the coordinator at {c.endpoint}: "
                               f"{str(exc).splitlines()[0]}") from None

    def run(self) -> int:
        """Run this host's workers until the job ends; returns the exit status."""
        c = self.config
        code = 1
        try:
            if self.node_rank is None:
                self.node_rank = self.store.add(f"rdzv/{c.rdzv_id}/nodes", 1) - 1
                if self.node_rank >= c.nnodes:
                    raise RecycleError(f"{c.nnodes} hosts have joined already (--nnodes)")
            self.store.wait([CONFIG_KEY])
            worker_config = WorkerConfig.from_json(self.store.get(CONFIG_KEY))
            self.world = c.nnodes * c.nproc_per_node
            self.worker_env = worker_config.to_json()
            self.lease = worker_config.lease
            self.grace = worker_config.grace
            self.log_dir = Path(worker_config.log_dir or Path(worker_config.run_dir) / "logs")
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.relay = Relay(self._transport(self.store, self._client), self.node_rank,
                               relay_path(str(self.log_dir), self.node_rank), self.lease,
                               worker_config.heartbeat, endpoint=c.endpoint)
            ranks = [self.node_rank * c.nproc_per_node + i for i in range(c.nproc_per_node)]
            for i, rank in enumerate(ranks):  # counted on the store: a rebooted host re-joins
                self._spawn(rank, i, self.relay.transport.next_incarnation(rank))
            self.relay.report(msg.HostUp(self.node_rank, socket.gethostname(), os.getpid(),
                                         tuple(ranks)))
            self.on_event(f"host {self.node_rank}: workers {ranks} started (logs in "
                          f"{self.log_dir})")
            code = self._watch()
        except (RuntimeError, dist.DistError) as exc:
            code = self._coordinator_lost(str(exc).splitlines()[0] if str(exc) else "")
        finally:
            for w in self.workers.values():
                if w.popen.poll() is None:
                    os.kill(w.popen.pid, signal.SIGKILL)
            if self.relay is not None and not self.relay.close():
                # its notice thread is inside a store call on a cut link: leave without
                # waiting for it (c10d aborts a process whose thread returns while it exits)
                self.on_event(f"host {self.node_rank}: leaving (exit status {code})")
                logging.shutdown()
                os._exit(code)
        return code

    def _restart(self, rank: int, pending: dict[int, float]) -> None:
        """Spawn `rank` again once the coordinator's store counted its next incarnation,
        asked on the relay's store thread (`Relay.call`): this loop never waits on the store,
        whose link may be cut (a call then hangs for minutes). If that store is lost first,
        the restart waits in `pending` for the next coordinator, whose store counts on from
        this agent's incarnations (`_reattach_due`)."""
        def spawn(incarnation: int) -> None:
            if self.preempted is None:
                self._spawn(rank, self._local_rank[rank], incarnation)

        def later() -> None:
            self.restarts[rank] -= 1
            pending[rank] = 0.0

        self.relay.call(lambda transport: transport.next_incarnation(rank), spawn, later)

    def _spawn(self, rank: int, local_rank: int, incarnation: int) -> None:
        c = self.config
        host, _, port = self.relay.endpoint.rpartition(":")  # the current coordinator's
        host = host.strip("[]")
        env = dict(os.environ)
        env.update({
            "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(self.world),
            "LOCAL_WORLD_SIZE": str(c.nproc_per_node), "GROUP_RANK": str(self.node_rank),
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(self.world), "MASTER_ADDR": host,
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": str(incarnation),
            "TORCHELASTIC_RUN_ID": c.rdzv_id, CONFIG_ENV: self.worker_env,
            RELAY_ENV: self.relay.path,
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        })
        path = self.log_dir / f"rank{rank}.{incarnation}.log"
        with open(path, "wb") as out:
            popen = subprocess.Popen(self.command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.workers[rank] = _Local(rank, local_rank, incarnation, popen, path)
        self.incarnations[rank] = incarnation
        if incarnation > 0:  # the coordinator learns of it (a restart, or a rebooted host)
            self.relay.report(msg.Spawned(rank, incarnation))

    def _watch(self) -> int:
        """Poll the store every `poll` seconds; a worker's exit wakes the loop at once (through
        a socket the interpreter writes to on SIGCHLD), so that its peers' recovery does not
        wait for the next poll."""
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        old_fd = signal.set_wakeup_fd(wake_w.fileno())
        previous = signal.signal(signal.SIGCHLD, lambda *_: None)
        previous_term = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            return self._loop(wake_r)
        finally:
            signal.signal(signal.SIGCHLD, previous)
            signal.signal(signal.SIGTERM, previous_term)
            signal.set_wakeup_fd(old_fd)
            wake_r.close()
            wake_w.close()

    def _on_sigterm(self, signum, frame) -> None:
        """SIGTERM (preemption): keep the workers running, so that the coordinator's stop (if
        it was signalled too) finds them and they write their checkpoint; if no outcome comes
        within the grace period, kill them and leave (the coordinator then sees them dead)."""
        if self.preempted is None:
            self.preempted = time.time()
            self.on_event(f"host {self.node_rank}: SIGTERM: waiting up to {self.grace:g} s for "
                          f"the job's stop")

    def _watch_loop(self) -> None:
        """A backstop: the loop's calls on the coordinator's store go through the relay's
        store thread, but one that blocked would block until TCP gives up (about 15 minutes)
        on a cut link: a loop that made no pass for twice the lease means the coordinator is
        lost. The workers notice it too and stop with a checkpoint; wait for
        them, then leave with COORDINATOR_LOST. A pause of this process (`pause.PauseClock`)
        gives the loop its chance again; a loop busy for that long is no pause: it made no
        pass either, and its workers, which hear nothing from it meanwhile, leave too."""
        clock = PauseClock()
        while True:
            time.sleep(0.1)
            now, paused = clock.look()
            if paused:
                self.loop_at = max(self.loop_at, now)
            if now - self.loop_at > 2 * self.lease:
                break
        code = self._coordinator_lost(f"no answer from the store for {2 * self.lease:g} s")
        for w in self.workers.values():
            if w.popen.poll() is None:
                os.kill(w.popen.pid, signal.SIGKILL)
        logging.shutdown()
        os._exit(code)

    def _loop(self, wake) -> int:
        c = self.config
        relay = self.relay
        pending: dict[int, float] = {}      # rank -> when to restart it
        self.loop_at = time.monotonic()
        threading.Thread(target=self._watch_loop, name="recycle-agent-watch",
                         daemon=True).start()
        while True:
            self.loop_at = time.monotonic()
            if self.preempted is not None and time.time() - self.preempted > self.grace:
                self.on_event(f"host {self.node_rank}: no stop within the grace period: "
                              f"killing the workers")
                return 128 + signal.SIGTERM
            relay.step()
            if relay.lost is not None and not self._detach():
                return self._coordinator_lost(relay.lost)
            if not relay.attached and (why := self._reattach_due()) is not None:
                return self._coordinator_lost(why)
            outcome = relay.notice(msg.Outcome)
            if outcome is not None:
                self.loop_at = float("inf")  # the job is over: no more store calls to watch
                self._wait_for_workers(30.0)
                relay.report(msg.Bye(self.node_rank))
                relay.flush(wait=self.lease)
                relay.close()  # its notice thread leaves at the coordinator's next beat
                self.on_event(f"host {self.node_rank}: job {outcome.status}")
                return EXIT_STATUS.get(outcome.status, 1)
            now = time.time()
            self._kill_declared_dead()
            for rank, inc, silent in relay.silent():
                w = self.workers.get(rank)
                if w is not None and w.incarnation == inc and w.popen.poll() is None:
                    self.why[rank] = (f"lost its lease: no heartbeat for {silent:.1f} s (stopped, "
                                      f"or its control thread stalled)")
                    os.kill(w.popen.pid, signal.SIGKILL)
            for rank, w in list(self.workers.items()):
                code = w.popen.poll()
                if code is None:
                    continue
                del self.workers[rank]
                why = self.why.pop(rank, None)
                how = why if why is not None and code == -signal.SIGKILL else (
                    "left (exit status 0)" if code == 0 else exit_how(code, self.lease))
                relay.report(msg.WorkerExit(rank, w.incarnation, code, how,
                                            last_line(w.log_path)))
                if code != CONFIG_ERROR and self.restarts.get(rank, 0) < c.max_restarts:
                    pending[rank] = now + c.restart_delay
                self.on_event(f"host {self.node_rank}: worker rank {rank} {how}")
            for rank, when in list(pending.items()):
                if now >= when and self.preempted is None and relay.attached:
                    del pending[rank]
                    self.restarts[rank] = self.restarts.get(rank, 0) + 1
                    self._restart(rank, pending)
            relay.step()  # the exits go in this pass's report
            select.select([wake, *relay.fds()], [], [], min(c.poll, relay.timeout()))
            try:
                while wake.recv(512):
                    pass
            except BlockingIOError:
                pass

    def _detach(self) -> bool:
        """The coordinator is lost: with coordinators that fail over, keep the workers running
        and look on etcd for the next leader's store, or the same leader's if it still leads
        a lease on (it was slow, or this host was cut off from it), on a thread: this loop
        keeps relaying and judging the workers. False: stop them instead."""
        relay = self.relay
        if self.successor is None or relay.notice(msg.Outcome):
            return False
        reason = relay.detach()
        self.on_event(f"host {self.node_rank}: lost the coordinator ({reason}); the workers "
                      f"keep running while the next one takes over, or it comes back")
        self._look(time.monotonic())
        return True

    def _look(self, since: float, pause: float = 0.0) -> None:
        """Look for the next leader's store, or the same one's, on a thread, after `pause`;
        `since`: when the coordinator was lost (`rdzv_timeout` bounds the whole search from
        there)."""
        self.finding = {"since": since}
        threading.Thread(target=self._find_successor, args=(self.finding, pause),
                         name="recycle-successor", daemon=True).start()

    def _find_successor(self, finding: dict[str, Any], pause: float = 0.0) -> None:
        """On its own thread: the next leader's store (published on etcd after the one this
        agent used). The relay's traffic stays on etcd, and the store is needed only when a
        worker is restarted (to count its incarnation, `transport.EtcdHost`), so it is dialled
        then, not now: 128 hosts dialling a new store at once on its one accepting thread, and
        raising 8 counts each there, took most of a takeover's 1.8 s per host at 1,024 ranks.
        Only hosts ranked by arrival dial it now (within two leases, `dial`), to raise the
        count of hosts there. A successor that died after publishing is left like a lost
        coordinator: no bulletin from it for a lease, the host looks again (its key goes with
        its lease, then the one after it publishes). All within `rdzv_timeout`;
        `_reattach_due` gives up a lease after it (a call can hang past its own timeout)."""
        deadline = finding["since"] + self.config.rdzv_timeout
        time.sleep(pause)
        try:
            while True:
                endpoint, revision = self.successor.find(deadline - time.monotonic())
                try:
                    store = None if self.config.node_rank is not None else self._dial(endpoint)
                except (RuntimeError, dist.DistError):
                    if time.monotonic() < deadline:
                        time.sleep(self.lease / 4)
                        continue
                    raise
                finding["found"] = (endpoint, revision, store)
                return
        except Exception as exc:  # noqa: BLE001 - any failure: no successor, stop
            finding["failed"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__

    def _reattach_due(self) -> str | None:
        """While detached: re-attach once the next coordinator's store is found, or the same
        one's. Why to stop the workers instead: none was found (within `rdzv_timeout`), or
        the next leader took over before any generation ran here (they come back fresh, as
        `launch` runs this agent again: nothing to checkpoint)."""
        finding = self.finding
        if "failed" in finding:
            self.on_event(f"host {self.node_rank}: no coordinator took over: "
                          f"{finding['failed']}")
            return f"no coordinator took over within {self.config.rdzv_timeout:g} s"
        if "found" not in finding:
            waited = time.monotonic() - finding["since"]
            if waited <= self.config.rdzv_timeout + self.lease:
                return None
            # its store does not answer (a successor that died or stopped after publishing)
            self.on_event(f"host {self.node_rank}: no coordinator took over: none answered "
                          f"within {waited:.0f} s")
            return f"no coordinator took over within {self.config.rdzv_timeout:g} s"
        endpoint, revision, store = finding["found"]
        self.finding = None
        same = revision == self.successor.revision
        if not same and not self.relay.decisions:
            return f"the next leader, at {endpoint}, took over"
        c = self.config
        transport = self.successor.after(revision).relay(  # on etcd
            self.node_rank, self._groups(endpoint, store), counted=self.incarnations)
        try:  # a new store counts hosts that came by arrival from here on, raised to at
            # least this one's (by compare-and-set: a retry counts nothing twice)
            if store is not None:
                msg.raise_counter(store, f"rdzv/{c.rdzv_id}/nodes", self.node_rank + 1)
        except (RuntimeError, dist.DistError) as exc:
            # a store swamped by a takeover's connections can reset one: that is no reason to
            # stop the workers (16 of 128 live hosts did, at 8,192 ranks), look again a
            # quarter lease later, within the same rdzv timeout
            why = str(exc).splitlines()[0] if str(exc) else repr(exc)
            if time.monotonic() - finding["since"] > c.rdzv_timeout:
                self.on_event(f"host {self.node_rank}: no coordinator took over: the store "
                              f"at {endpoint} failed while re-attaching ({why})")
                return f"no coordinator took over within {c.rdzv_timeout:g} s"
            self.on_event(f"host {self.node_rank}: the store at {endpoint} failed while "
                          f"re-attaching ({why}): looking again")
            self._look(finding["since"], pause=self.lease / 4)
            return None
        if same:
            self.on_event(f"host {self.node_rank}: the coordinator at {endpoint} still leads "
                          f"(it was slow, or this host was cut off from it): re-attached to it")
        self.successor = self.successor.after(revision)
        self.relay.attach(transport, endpoint, another=not same, workers=tuple(
            (r, w.incarnation) for r, w in sorted(self.workers.items())
            if w.popen.poll() is None))
        self.on_event(f"host {self.node_rank}: re-attached to the coordinator at {endpoint} "
                      f"after {time.monotonic() - finding['since']:.2f} s; workers "
                      f"{sorted(self.workers)} kept running")
        return None

    def _dial(self, endpoint: str) -> dist.TCPStore:
        """The next leader's store at `endpoint` (HOST:PORT), given two leases to connect."""
        host, _, port = endpoint.rpartition(":")
        return dial(host.strip("[]"), int(port), 2 * self.lease, self.config.startup_timeout)

    def _groups(self, endpoint: str, store: Any) -> Callable[[], Any]:
        """`store` if already connected, else the store at `endpoint`, dialled the first
        time it is asked for."""
        return (lambda: store) if store is not None else cache(lambda: self._dial(endpoint))

    def _kill_declared_dead(self) -> None:
        """Kill the workers the coordinator declared dead (their lease had expired: the host
        was cut off or stopped) once a lease has passed since this agent read the notice:
        a worker blocked on its link reads the decision that excludes it first and leaves by
        itself (fenced); one blocked on a peer is killed."""
        now = time.monotonic()
        for rank, w in self.workers.items():
            if w.popen.poll() is not None or self.relay.notice(
                    msg.Kill, rank=rank, incarnation=w.incarnation) is None:
                continue
            seen = self.kills_seen.setdefault((rank, w.incarnation), now)
            if now - seen >= self.lease:
                self.why.setdefault(rank, "killed: the coordinator declared it dead")
                os.kill(w.popen.pid, signal.SIGKILL)

    @property
    def _local_rank(self) -> dict[int, int]:
        return {r: r - self.node_rank * self.config.nproc_per_node
                for r in range(self.world)}

    def _wait_for_workers(self, seconds: float) -> None:
        deadline = time.time() + seconds
        for w in self.workers.values():
            try:
                w.popen.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass

    def _coordinator_lost(self, reason: str) -> int:
        """Workers notice the lost store within their lease, checkpoint and exit: wait. If no
        generation ran here yet, they have nothing to checkpoint (a worker still loading
        would notice only once loaded): they are stopped at once."""
        self.loop_at = float("inf")  # said once, by whichever thread noticed first
        if self.relay is not None and not self.relay.decisions:
            self.on_event(f"host {self.node_rank}: lost the coordinator ({reason}) before any "
                          f"generation ran here: stopping the workers")
            for w in self.workers.values():
                if w.popen.poll() is None:
                    os.kill(w.popen.pid, signal.SIGKILL)
        else:
            self.on_event(f"host {self.node_rank}: lost the coordinator ({reason}); waiting "
                          f"for the workers to write their checkpoint")
        if self.relay is not None:
            self.relay.lose(reason)
        self._wait_for_workers(120.0)
        codes = {r: w.popen.poll() for r, w in self.workers.items()}
        self.on_event(f"host {self.node_rank}: workers stopped (exit status {codes}); start "
                      f"the coordinator again with --resume, then the host agents")
        return COORDINATOR_LOST
