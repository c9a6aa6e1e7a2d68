"""Where the workers run: one interface, two implementations (like torch elastic's agent over
its `WorkerGroup`).

The launcher's membership logic (`agent.Agent`: leases, generations, decisions, results) is the
same whether the workers are its own child processes or run on other hosts under host agents;
only how a process is started, seen to exit, killed and told the job is over differs:

- `LocalPool`: the launcher starts every worker itself (torchrun's environment), reaps its
  exit within milliseconds (it is the parent), kills it with SIGKILL and restarts it after
  `--restart-delay`;
- `HostPool`: the coordinator of a cluster job starts nothing; each host agent
  (`hostagent.py`) reports its host, the incarnations it started and every exit in its
  per-host reports (`mail.RelayMail`); a worker whose lease expired (its host's) is declared
  dead at once (its host may be gone) and a kill notice is posted for its host agent, should
  the host come back; the job's outcome is posted for the agents at the end.

Each pool names the `mail.Mail` its workers' records travel by (`mail`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from recycle_planner.executor.config import CONFIG_ENV, CONFIG_KEY, STALLED
from recycle_planner.executor.control import messages as msg
from recycle_planner.executor.control.election import Deposed
from recycle_planner.executor.control.failover import HostLeases
from recycle_planner.executor.control.mail import Mail, RelayMail, StoreMail
from recycle_planner.executor.control.result import EventKind
from recycle_planner.executor.control.store import StoreRefused, StoreUnavailable
from recycle_planner.executor.control.transport import C10dCoordinator, CoordinatorTransport

if TYPE_CHECKING:
    from recycle_planner.executor.control.agent import Agent
    from recycle_planner.executor.control.protocol import Decision

log = logging.getLogger(__name__)


@dataclass
class Proc:
    """One worker process (one incarnation of a rank) as the launcher sees it."""

    rank: int
    incarnation: int
    popen: subprocess.Popen | None       # None: it runs on another host
    log_path: Path
    started: float
    hello: msg.Hello | None = None
    last_beat: float = 0.0               # when `beat` last changed (this process's clock)
    beat: Any = None                     # the lease's latest value (`Mail.beat`)
    killed: bool = False                 # killed for a lost lease, exit not yet reaped


@dataclass(frozen=True)
class Exit:
    """A worker process that ended: its exit status and its log's last error line."""

    proc: Proc
    code: int
    how: str
    last_line: str


class WorkerPool(Protocol):
    PORT_OPTION: str                     # the CLI option naming the store's port
    restarts: bool                       # whether the launcher restarts dead workers itself

    def mail(self, store: Any) -> Mail:
        """How the workers' records travel, over the launcher's `store`."""

    def start(self) -> list[Proc]:
        """Start (or await) every worker; the processes the launcher knows of now."""

    def started(self) -> list[Proc]:
        """Processes started since the last call by someone else (a host agent)."""

    def exits(self, procs: dict[int, Proc]) -> list[Exit]:
        """Which of `procs` ended since the last call."""

    def kill(self, proc: Proc) -> bool:
        """Kill `proc`; True when it is dead now (nothing will report its exit)."""

    def restart(self, rank: int, incarnation: int) -> Proc:
        """Start `rank` again (only when `restarts`)."""

    def adopt(self, procs: list[Proc], decision: Decision) -> None:
        """A coordinator taking over found `procs` running `decision`'s generation (only
        `HostPool`)."""

    def held(self, now: float) -> set[int] | None:
        """The hosts whose lease the control store holds now (None: not known), for a
        coordinator taking over (only `HostPool`, with etcd)."""

    def close(self, procs: dict[int, Proc], outcome: tuple[str, str] | None) -> None:
        """Training is over (`outcome`: status and message, None if the launcher failed):
        end or release every worker."""

    def describe(self) -> str:
        """The start event's words."""


class LocalPool:
    """The launcher's own child processes, one per worker."""

    PORT_OPTION = "--master-port"
    restarts = True

    def __init__(self, agent: "Agent", command: list[str]):
        self.agent = agent
        self.command = command

    def mail(self, store: Any) -> Mail:
        return StoreMail(store)

    def start(self) -> list[Proc]:
        return [self._spawn(rank, 0) for rank in range(self.agent.config.nproc)]

    def started(self) -> list[Proc]:
        return []

    def restart(self, rank: int, incarnation: int) -> Proc:
        return self._spawn(rank, incarnation)

    def adopt(self, procs: list[Proc], decision: Decision) -> None:
        raise NotImplementedError("the launcher's own workers die with it: nothing to adopt")

    def held(self, now: float) -> set[int] | None:
        return None  # one machine: no host leases

    def _spawn(self, rank: int, incarnation: int) -> Proc:
        a, c = self.agent, self.agent.config
        env = dict(os.environ)
        env.update({
            "RANK": str(rank), "WORLD_SIZE": str(c.nproc), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(c.nproc), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(c.nproc), "MASTER_ADDR": c.master_addr,
            "MASTER_PORT": str(a.port), "TORCHELASTIC_RESTART_COUNT": str(incarnation),
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "recycle",
            "OMP_NUM_THREADS": str(c.threads),
            CONFIG_ENV: c.worker_config(a.log_dir).to_json(),
        })
        path = a.log_dir / f"rank{rank}.{incarnation}.log"
        with open(path, "wb") as out:
            popen = subprocess.Popen(self.command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return Proc(rank, incarnation, popen, path, time.time())

    def exits(self, procs: dict[int, Proc]) -> list[Exit]:
        ended = []
        for proc in procs.values():
            code = proc.popen.poll()
            if code is not None:
                ended.append(Exit(proc, code, exit_how(code, self.agent.config.lease),
                                  last_line(proc.log_path)))
        return ended

    def kill(self, proc: Proc) -> bool:
        try:
            os.kill(proc.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return False  # its exit is reaped like any other

    def close(self, procs: dict[int, Proc], outcome) -> None:
        for proc in procs.values():
            if proc.popen.poll() is None:
                self.kill(proc)
        for proc in procs.values():
            try:
                proc.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def describe(self) -> str:
        return (f"{self.agent.config.nproc} workers started, store on port {self.agent.port}, "
                f"logs in {self.agent.log_dir}")


class _Arrivals:
    """The records of one kind per (rank, incarnation) the coordinator waits for: exits and
    restarts. Where the mail hands what arrived (`Mail.take_new`), a pass looks only at that,
    and keeps what no process waits for yet (a restart reported before the previous
    incarnation's exit was reaped) until one does (`wants`) or it never can (`stale`);
    on a mail that cannot say, every pass looks up every process `wanted` names. Scanning
    every rank for both kinds took a third of the coordinator's pass at 8,192 ranks. Of the
    records a rank's process is wanted by, the newest incarnation's is handed, once."""

    def __init__(self, kind: type[msg.Message]):
        self.kind = kind
        self.held: dict[tuple[int, int], Any] = {}

    def found(self, mail: Mail, wanted: Callable[[], list[tuple[int, int]]],
              wants: Callable[[int, int], bool], stale: Callable[[int, int], bool]
              ) -> list[Any]:
        new = mail.take_new(self.kind)
        if new is None:
            return [record for rank, incarnation in wanted() if (record := mail.get(
                self.kind, rank=rank, incarnation=incarnation)) is not None]
        for record in new:
            self.held[(record.rank, record.incarnation)] = record
        found, ranks = [], set()
        for key in sorted(self.held, key=lambda k: -k[1]):  # a rank's newest process, once
            if key[0] not in ranks and wants(*key):
                ranks.add(key[0])
                found.append(self.held.pop(key))
            elif stale(*key):
                del self.held[key]
        return found


class HostPool:
    """Workers on `nnodes` hosts, each started by its host agent, seen through the store."""

    PORT_OPTION = "--port"
    restarts = False  # host agents restart their own workers

    def __init__(self, agent: "Agent", nnodes: int,
                 transport: Callable[[Any], CoordinatorTransport] | None = None):
        self.agent = agent
        self.nnodes = nnodes
        self.transport_for = transport  # the mail's, from the c10d store (None: `mail`)
        self.hosts: dict[int, msg.HostUp] = {}
        self.incarnation: dict[int, int] = {}
        self.leases = HostLeases.from_env()  # the hosts' leases on etcd (`failover.py`)
        self.transport: CoordinatorTransport | None = None  # the mail's (`mail`)
        self._held: tuple[float, set[int] | None] = (float("-inf"), None)
        self._spawned, self._exited = _Arrivals(msg.Spawned), _Arrivals(msg.WorkerExit)

    def mail(self, store: Any) -> Mail:
        """The relay's mail: on etcd where the coordinators fail over on it (`HostLeases`,
        `--rdzv-backend etcd`: its keys outlive a leader), else on `store`; or on the
        transport the pool was given."""
        c = self.agent.config
        if self.transport_for is not None:
            self.transport = self.transport_for(store)
        elif self.leases is None:
            self.transport = C10dCoordinator(store)
        else:
            self.transport = self.leases.relay(store, fresh=not c.take_over)
        return RelayMail(self.transport, self.nnodes, c.nproc // self.nnodes, c.lease / 4)

    def start(self) -> list[Proc]:
        a = self.agent
        a.store.set(CONFIG_KEY, a.config.worker_config(a.log_dir).to_json())
        # a placeholder per rank until its host agent reports
        return [Proc(rank, 0, None, a.log_dir, time.time()) for rank in range(a.config.nproc)]

    def started(self) -> list[Proc]:
        a = self.agent
        for node in range(self.nnodes):
            host = None if node in self.hosts else a.mail.get(msg.HostUp, node=node)
            if host is not None:
                self.hosts[node] = host
                a._event(EventKind.HOST, f"host {node} ({host.hostname}) runs ranks "
                                         f"{list(host.ranks)}", node=node)
        new = []

        def wanted() -> list[tuple[int, int]]:  # the next incarnation of every rank not running
            return [(rank, self.incarnation.get(rank, 0) + 1)
                    for rank in range(a.config.nproc) if rank not in a.procs]

        def wants(rank: int, incarnation: int) -> bool:  # any newer one: a host that died
            # between counting a spawn and reporting it comes back past the next
            return rank not in a.procs and incarnation > self.incarnation.get(rank, 0)

        def stale(rank: int, incarnation: int) -> bool:
            return incarnation <= self.incarnation.get(rank, 0)
        for spawned in self._spawned.found(a.mail, wanted, wants, stale):
            rank, inc = spawned.rank, spawned.incarnation
            self.incarnation[rank] = inc
            new.append(Proc(rank, inc, None, a.log_dir, time.time()))
            a._event(EventKind.RESTART, f"worker {a._name(rank)} started again by its "
                                        f"host agent (incarnation {inc})", rank=rank)
        return new

    def exits(self, procs: dict[int, Proc]) -> list[Exit]:
        def wants(rank: int, incarnation: int) -> bool:
            return rank in procs and procs[rank].incarnation == incarnation

        def stale(rank: int, incarnation: int) -> bool:  # an incarnation before the latest
            return incarnation < self.incarnation.get(rank, 0)
        return [Exit(procs[report.rank], report.code, report.how, report.last_line)
                for report in self._exited.found(
                    self.agent.mail, lambda: [(r, p.incarnation) for r, p in procs.items()],
                    wants, stale)]

    def kill(self, proc: Proc) -> bool:
        """The coordinator cannot wait for a process it does not own: the worker is dead now,
        and its host agent kills it should the host come back."""
        self.agent.mail.put(msg.Kill(proc.rank, proc.incarnation))
        return True

    def restart(self, rank: int, incarnation: int) -> Proc:
        raise NotImplementedError("host agents restart their own workers")

    def adopt(self, procs: list[Proc], decision: Decision) -> None:
        """The incarnations the run is at: those the host agents run now, else the one the
        decision counts on (a member lost meanwhile), else 0; a later `Spawned` counts from
        there. The new store is told to count on from there for the ranks no host runs (the
        hosts raise it for theirs): a host that comes back rebooted then starts its workers
        as the next incarnation, not as the killed one."""
        running = {p.rank: p.incarnation for p in procs}
        for rank in range(self.agent.config.nproc):
            self.incarnation[rank] = running.get(rank, decision.incarnations.get(rank, 0))
            if rank not in running:
                self.transport.raise_incarnations(rank, self.incarnation[rank] + 1)

    def held(self, now: float) -> set[int] | None:
        """Read from etcd at most every quarter lease; None without etcd or when it never
        answered (the coordinator then waits as if it knew nothing); when a read fails, what
        it said last (one failed read must not turn live hosts into unknown ones)."""
        if self.leases is None:
            return None
        at, held = self._held
        if now - at >= self.agent.config.lease / 4:
            try:
                held = self.leases.held()
            except StoreUnavailable:
                pass
            self._held = (now, held)
        return held

    def close(self, procs: dict[int, Proc], outcome) -> None:
        """Tell the host agents the job is over and give them a moment to read it."""
        mail = self.agent.mail
        status, message = outcome if outcome is not None else ("failed",
                                                               "the coordinator failed")
        deadline = time.time() + 10
        try:
            mail.put(msg.Outcome(str(status), message))
            while time.time() < deadline:
                mail.flush()
                mail.refresh()
                if all(mail.get(msg.Bye, node=n) is not None for n in self.hosts):
                    self.transport.end()  # not before: a host yet to read the outcome needs it
                    return
                time.sleep(0.05)
        except (RuntimeError, OSError, Deposed, StoreUnavailable, StoreRefused) as exc:
            log.warning("the host agents' traffic was not cleared at the end: %s", exc)

    def describe(self) -> str:
        c = self.agent.config
        return (f"coordinator for {self.nnodes} hosts x {c.nproc // self.nnodes} workers, store "
                f"on port {self.agent.port}; waiting for the host agents")


PoolFactory = Callable[..., WorkerPool]


def exit_how(code: int, lease: float) -> str:
    """How a worker process ended, from its exit status, in words for the events."""
    from recycle_planner.executor.config import EXECUTOR_ERROR, FENCED, HOST_AGENT_LOST

    if code == 0:
        return "exited with status 0 before the end"
    if code == STALLED:
        return f"stalled (its training thread made no progress for the {lease:g} s lease)"
    if code == FENCED:
        return "was fenced (it read a decision that excludes it, and left)"
    if code == EXECUTOR_ERROR:
        return "failed inside the executor (not in user code; see its log)"
    if code == HOST_AGENT_LOST:
        return "lost its host agent (silent for the lease, or gone) and left"
    return f"killed by {_signal_name(-code)}" if code < 0 else f"exited with status {code}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def last_line(path: Path) -> str:
    """The last error line of a worker's log (or its last line), for one-line reports."""
    try:
        lines = [l.strip() for l in path.read_text(errors="replace").splitlines() if l.strip()]
    except OSError:
        return "(no log)"
    for line in reversed(lines):
        if "ERROR" in line or "Error" in line:
            return line.split(": ", 1)[-1] if "ERROR" in line else line
    return lines[-1] if lines else "(empty log)"
