"""The leader's loss at scale on the relay path: from the leading coordinator's SIGKILL to the
standby leading, every host re-attached, the new leader adopting the running generation, and
(with `--with-host`, a host lost at the same instant) the next decision held by every survivor.

What runs, all on this machine:

- a real 3-member etcd (`etcd_local.EtcdCluster`, etcd's default timings);
- two coordinators, each the real failover wrapper (`python -m
  recycle_planner.executor.control.failover coordinate`: the etcd election, the publication
  of its store, the hot standby told `lead` or `take-over`) around this file's `--coordinator`
  mode, which is `recycle-planner coordinator`'s own path (`standby_word`, `claim`, an
  `agent.Agent` over `pool.HostPool` run by `Agent.run`, `--take-over` when it follows a lost
  leader) with the plan library replaced by bench_relay's stand-in (its size only: no plan
  is read). The leader's wrapper is SIGKILLed; its coordinator dies with it (PDEATHSIG), as
  in bench_takeover.py;
- stand-in hosts: the real `hostagent.HostAgent` (its loop, its relay, the successor search
  on etcd, the re-attach with the journal re-sent, the incarnations raised on the new store
  when a worker is restarted there), each holding its host lease on etcd
  (`failover.HostLeases.hold`, what `launch --rdzv-backend etcd` does), in `--procs`
  processes. What differs: its workers are not
  processes but bench_relay's stand-ins (`_Workers`: a real `HostLink` per `--per-link`
  ranks that says hello, waits to be welcomed and for the decision, reports each
  iteration's end and the last stage its pipeline's losses, and answers an abort as a worker
  does); the processes the agent watches are one `sleep` per host (its workers' "process":
  all its ranks look dead if it is killed); the agent's loop runs on a thread (no signal
  handlers: `_watch` is only their plumbing), and its backstop thread, which would exit the
  process on a loop stalled for two leases (`_watch_loop`), only records such a stall, since
  one process here holds many hosts.

Measured on one clock (every process stamps with `time.time()`): the kill; each host's
notice of the loss; the standby's publication (its wrapper's log line); each host's
successor found on etcd and its re-attach; the new leader's adoption (its first pass with
every host: its `take-over` event); with `--with-host`, the lost host's deaths, the abort and
the next generation's decision, and when every surviving link's stand-ins hold it. Whether
training went on: the stand-ins' iterations between the kill and the adoption, and the losses
the new leader saved (losses.jsonl: no iteration missing or saved twice). Before the kill,
over the `--seconds` of steady state: the requests etcd served, by gRPC method, from its own
counters (`steady_etcd`).

    cd benchmarks && python bench_relay_takeover.py --ranks 1024 --per-host 8 --repeat 3
    python bench_relay_takeover.py --ranks 8192 --per-host 64 --iteration 4 --repeat 3
    python bench_relay_takeover.py --ranks 1024 --per-host 8 --with-host
    python bench_relay_takeover.py --ranks 512 --per-host 8 --pin   # control on a core apart

The benchmark sets `RES_OPTIONS=timeout:1 attempts:1` for itself and every process it starts
(as tests/conftest.py does): c10d's store server looks each new client's address up in DNS
(`getnameinfo`) on its one thread, and this sandbox's resolver drops a query now and then,
which glibc retries after 5 s: the whole coordinator's store stopped answering every host for
longer than the lease. One attempt with a 1 s timeout bounds that stall at 1 s; nothing here
needs a name resolved.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")  # see the module's docstring
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_relay import (MICROBATCHES, STAGES, _Lib, _Spec, _Workers,  # noqa: E402
                         etcd_rates, etcd_requests)
from common import machine, read_stamped  # noqa: E402

from recycle_planner.executor.control import messages as msg  # noqa: E402
from recycle_planner.executor.control.etcd_local import EtcdCluster, etcd_missing  # noqa: E402
from recycle_planner.executor.control.failover import (TAKE_OVER, HostLeases,  # noqa: E402
                                                       Successor, published_coordinator,
                                                       standby_word)
from recycle_planner.executor.control.hostagent import HostAgent, HostConfig  # noqa: E402
from recycle_planner.executor.control.link import ControlLost, HostLink  # noqa: E402
from recycle_planner.executor.control.plane import HostRecord, Keys  # noqa: E402

log = logging.getLogger("bench_relay_takeover")
ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results" / "relay-takeover-etcd.json"
"""The etcd transport's rows (relay-takeover.json holds the c10d relay's, measured before the
relay's traffic moved to etcd)."""
VERSION = 1
JOB = "bench"
MARK = "BENCH "  # the coordinator's lines for the harness


# -- the coordinator (run by the failover wrapper) ---------------------------------------------

def coordinator_main(args) -> int:
    """`recycle-planner coordinator`'s path (cli/executor.py `coordinator`, then
    `coordinator.coordinate` and `agent.run_agent`) with the stand-in library: wait to lead,
    claim the run folder (as the next attempt when taking over), run the `Agent` over a
    `HostPool`. Its events and its progress go to stdout as stamped lines."""
    from recycle_planner.executor.control.agent import Agent, LaunchConfig
    from recycle_planner.executor.control.pool import HostPool
    from recycle_planner.executor.control.runfolder import claim

    word = standby_word()
    if word == "":
        return 0  # never led
    _say(ev="led", word=word)
    take_over = word == TAKE_OVER
    config = LaunchConfig(nproc=args.ranks, run_dir=args.run_dir, checkpoint_every=0,
                          lease=args.lease, master_port=args.port, take_over=take_over)
    folder = claim(config.run_dir, False, False, take_over, wait=3 * config.lease)
    agent = Agent(config, lambda e: _say(ev="event", kind=e.kind.value,
                                         message=e.message[:160], gen=e.data.get("gen")),
                  folder, HostPool, args.ranks // args.per_host)
    agent.lib, agent.stages = _Lib(_Spec(args.ranks // STAGES, STAGES, MICROBATCHES)), STAGES
    _say(ev="store", port=agent.port)
    threading.Thread(target=_progress, args=(agent,), daemon=True).start()
    agent.run()
    return 0


_SAYING = threading.Lock()


def _say(**fields) -> None:
    """One stamped line (whole: the agent's and the progress thread's lines never mix)."""
    line = MARK + json.dumps({"t": time.time(), **fields}) + "\n"
    with _SAYING:
        sys.stdout.write(line)
        sys.stdout.flush()


def _progress(agent) -> None:
    """The coordinator's progress, said when it changes: its phase, and the next iteration
    whose losses it will save (read from another thread: plain attributes)."""
    said = None
    while True:
        log_ = agent.iterations
        now = (agent.phase.value, agent.gen, log_.next_loss if log_ is not None else None)
        if now != said:
            said = now
            _say(ev="progress", phase=now[0], gen=now[1], next_loss=now[2])
        time.sleep(0.05)


# -- stand-in hosts -----------------------------------------------------------------------------

class _Members(_Workers):
    """bench_relay's stand-ins, started as a worker starts: hello, then wait to be welcomed
    and for that generation's decision (what fills the relay's decisions: a host that holds
    none would stop its workers when a new leader takes over); each iteration's end time is
    kept."""

    def __init__(self, link, ranks: list[int], period: float):
        super().__init__(link, ranks, period)
        self.gen = -1
        self.ends: list[float] = []
        self.lost: str | None = None  # why its link was lost before it held a decision

    def start(self) -> None:
        super().start()
        threading.Thread(target=self._join, daemon=True).start()

    def _join(self) -> None:
        try:
            welcome = self.link.wait(msg.Welcome, rank=self.ranks[0], incarnation=0)
            decision = self.link.decision(welcome.gen)
        except ControlLost as exc:
            self.lost = str(exc)  # it will never hold one: the harness stops waiting
            return
        with self.lock:
            self.held[decision.gen] = time.time()
            self.gen, self.steps = decision.gen, decision.restart

    def iterate(self, now: float) -> None:
        before = self.steps
        super().iterate(now)
        if self.steps != before:
            self.ends.append(now)


@dataclass(frozen=True)
class _TimedSuccessor(Successor):
    """The real successor search, its answers' times kept in `found` (the same list after
    `after`, which copies the record)."""

    found: Any = None

    def find(self, timeout: float) -> tuple[str, int]:
        answer = super().find(timeout)
        self.found.append(time.time())
        return answer


class _StandInAgent(HostAgent):
    """The real host agent (see the module) with stand-in workers."""

    def __init__(self, config: HostConfig, per_link: int, iteration: float, lease: float,
                 events: list):
        self.per_link, self.iteration = per_link, iteration
        self.groups: list[_Members] = []
        self.process = subprocess.Popen(["sleep", "3600"])
        self.stalled: float | None = None
        super().__init__([], config, lambda m: events.append((time.time(), m)))
        self._early = HostAgent._client(self, lease)  # see `_client`

    def _client(self, timeout: float):
        """The relay's second connection, made with the first before any host agent's loop
        runs (as bench_relay.py does): a new connection can hold the coordinator's whole
        store for 5 s here (its server looks the client's address up in DNS, and this
        sandbox's DNS drops a query now and then), longer than the lease, and hosts
        already running would take their coordinator for lost at start-up."""
        early, self._early = getattr(self, "_early", None), None
        return early if early is not None else super()._client(timeout)

    def _spawn(self, rank: int, local_rank: int, incarnation: int) -> None:
        from recycle_planner.executor.control.hostagent import _Local

        self.workers[rank] = _Local(rank, local_rank, incarnation, self.process,
                                    Path(os.devnull))
        self.incarnations[rank] = incarnation
        if rank % self.per_link == 0:
            link = HostLink(self.relay.path, rank, incarnation, self.config.address, 60.0,
                            0.2, self.lease)
            group = _Members(link, list(range(rank, rank + self.per_link)), self.iteration)
            self.groups.append(group)
            group.start()

    def _watch(self) -> int:
        import socket

        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        self._wake_w = wake_w  # kept open: the loop selects on its other end
        return self._loop(wake_r)

    def _watch_loop(self) -> None:
        """The backstop (see the module): a loop stalled for two leases is recorded."""
        while self.stalled is None:
            time.sleep(0.1)
            if time.monotonic() - self.loop_at > 2 * self.lease:
                self.stalled = time.time()

    def vanish(self) -> None:
        """The host is gone: its loop stops (inside `relay.step`), its stand-ins fall silent,
        nothing is closed; its etcd lease is left to expire."""
        hang = threading.Event()
        relay = self.relay
        relay.step = lambda: hang.wait()
        relay._closed = True
        for group in self.groups:
            group.vanish()


def _hosts_main(nodes: list[int], nnodes: int, per_host: int, per_link: int, etcd: str,
                lease: float, iteration: float, poll: float, nice: int, cpu: int | None,
                conn) -> None:
    """A process of stand-in hosts `nodes`: answers the harness's commands until "stop";
    at the scheduling priority `nice` (`--hosts-nice`), on CPU `cpu` alone if given
    (`--pin`)."""
    from recycle_planner.executor.control.store import EtcdStore

    import faulthandler

    os.setsid()  # its sleeps die with it (the harness kills the group)
    os.nice(nice)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it is, when asked
    logging.basicConfig(level=logging.WARNING)
    keys = Keys(JOB)
    endpoint, revision = published_coordinator(EtcdStore(etcd, timeout=max(2.0, lease)), keys,
                                               120.0)
    events: dict[int, list] = {n: [] for n in nodes}
    found: dict[int, list] = {n: [] for n in nodes}

    def host(node: int) -> tuple:
        ranks = tuple(range(node * per_host, (node + 1) * per_host))
        store = EtcdStore(etcd, timeout=max(2.0, lease))  # each host its own, as `follow`
        keeper = HostLeases.hold(store, keys, HostRecord(node, f"host{node}", ranks), lease)
        config = HostConfig(nnodes, per_host, endpoint, node_rank=node, rdzv_timeout=120.0,
                            poll=poll,
                            successor=_TimedSuccessor(etcd, JOB, revision, lease, found[node]))
        return _StandInAgent(config, per_link, iteration, lease, events[node]), keeper

    with ThreadPoolExecutor(16) as pool:
        made = dict(zip(nodes, pool.map(host, nodes)))
    agents = {n: a for n, (a, _) in made.items()}
    conn.send("connected")
    for agent in agents.values():  # a few at a time: 2 cores start them all
        threading.Thread(target=agent.run, daemon=True).start()
        time.sleep(0.2)
    stop = threading.Event()

    def train() -> None:
        while not stop.is_set():
            for agent in agents.values():
                for group in agent.groups:
                    group.iterate(time.time())
            stop.wait(min(0.05, iteration / 4))

    while True:
        command, arg = conn.recv()
        if command == "held":  # when each live link's stand-ins held generation `arg`
            conn.send({g.ranks[0]: g.held.get(arg) for a in agents.values()
                       for g in a.groups if not g.vanished})
        elif command == "lost":  # the stand-ins whose link was lost at start-up
            conn.send({g.ranks[0]: g.lost for a in agents.values() for g in a.groups
                       if g.lost is not None})
        elif command == "go":  # every stand-in holds the first decision: train from `arg`
            for agent in agents.values():
                for group in agent.groups:
                    group.due = arg
            threading.Thread(target=train, daemon=True).start()
            conn.send("going")
        elif command == "vanish":
            agents[arg].vanish()
            made[arg][1].close(revoke=False)
            conn.send(time.time())
        elif command == "report":
            conn.send({n: {"events": events[n], "found": found[n],
                           "stalled": agents[n].stalled,
                           "ends": [g.ends for g in agents[n].groups]} for n in nodes})
        else:
            stop.set()
            conn.send("stopped")
            return


# -- the harness --------------------------------------------------------------------------------

class _Wrapper:
    """A coordinator's failover wrapper and its coordinator; every line stamped on arrival."""

    def __init__(self, name: str, etcd: str, port: int, args, run_dir: Path, log: Path):
        command = [sys.executable, "-m", "recycle_planner.executor.control.failover",
                   "coordinate", "--etcd", etcd, "--job", JOB, "--lease", str(args.lease),
                   "--name", name, "--endpoint", f"127.0.0.1:{port}", "--",
                   sys.executable, str(Path(__file__).resolve()), "--coordinator",
                   "--ranks", str(args.ranks), "--per-host", str(args.per_host),
                   "--lease", str(args.lease), "--port", str(port), "--run-dir", str(run_dir)]
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([*_pinned(args, CONTROL_CPU), *command],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.marks: list[dict] = []
        self.log = open(log, "w")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        read_stamped(self.proc.stdout, self.lines, self.log, self._mark)

    def _mark(self, line: str) -> None:
        if line.startswith(MARK):
            try:
                self.marks.append(json.loads(line[len(MARK):]))
            except ValueError:  # a line cut short as the process was killed
                pass

    def first(self, text: str) -> float | None:
        return next((t for t, line in list(self.lines) if text in line), None)

    def mark(self, ev: str, **match) -> dict | None:
        return next((m for m in list(self.marks) if m["ev"] == ev
                     and all(m.get(k) == v for k, v in match.items())), None)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def run_once(args, work: Path, with_host: bool) -> dict:
    """One takeover (see the module); the row, or an exception saying what did not happen."""
    from recycle_planner.executor.control.etcd_local import free_ports

    nnodes = args.ranks // args.per_host
    run_dir = work / "run"
    context = mp.get_context("spawn")
    children: list = []
    with EtcdCluster(3, folder=work / "etcd", fast=False,
                     wrap=_pinned(args, CONTROL_CPU)) as etcd:
        ports = free_ports(2)
        wrappers = [_Wrapper(f"c{i}", etcd.endpoints, ports[i], args, run_dir,
                             work / f"c{i}.log") for i in range(2)]
        try:
            _until(lambda: any(w.mark("store") for w in wrappers), 120, "no coordinator led")
            hosts = list(range(nnodes))
            for k in range(args.procs):
                ours, theirs = context.Pipe()
                proc = context.Process(target=_hosts_main, args=(
                    hosts[k::args.procs], nnodes, args.per_host, args.per_link,
                    etcd.endpoints, args.lease, args.iteration, args.host_poll,
                    args.hosts_nice, HOSTS_CPU if args.pin else None, theirs),
                    daemon=True)
                proc.start()
                children.append((proc, ours))
            for _, conn in children:
                if not conn.poll(600):
                    raise RuntimeError("stand-in hosts did not connect")
                conn.recv()
            _until(lambda: _all_held(children, 0) or _starved(wrappers)
                   or _lost_links(children), 600, "generation 0 not held by every stand-in")
            if _starved(wrappers):
                raise RuntimeError("stand-ins lost their lease at start-up: nothing to "
                                   "measure; the leader's first deaths: " + _deaths(wrappers))
            lost = _lost_links(children)
            if lost:
                raise RuntimeError(f"{len(lost)} stand-in links lost their host agent at "
                                   f"start-up (the first: {next(iter(lost.values()))})")
            for _, conn in children:
                conn.send(("go", time.time() + args.iteration))
                conn.recv()
            before = (time.time(), etcd_requests(etcd.endpoints))
            time.sleep(args.seconds)
            steady = etcd_rates(before, (time.time(), etcd_requests(etcd.endpoints)), nnodes)
            leader = next(w for w in wrappers if w.mark("store"))
            standby = next(w for w in wrappers if w is not leader)
            lost = nnodes - 1 if with_host else None
            load = os.getloadavg()
            killed = time.time()
            os.kill(leader.proc.pid, signal.SIGKILL)
            if lost is not None:
                owner = children[lost % args.procs][1]
                owner.send(("vanish", lost))
                owner.recv()
            try:
                row = _follow(args, standby, children, killed, lost, nnodes)
            except RuntimeError:
                _keep_reports(children, work / "hosts.json")
                raise
            row["load_at_kill"] = load
            row["steady_etcd"] = steady
            row["leader_progress_at_kill"] = next(
                (m for m in reversed(leader.marks) if m["ev"] == "progress"), None)
            row["losses"] = _losses(run_dir)
            return row
        finally:
            for proc, conn in children:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.join(10)
            for w in wrappers:
                w.stop()


CONTROL_CPU, HOSTS_CPU = 0, 1
"""With `--pin`: the CPUs of the control side (etcd, the coordinators) and of the hosts."""


def _pinned(args, cpu: int) -> tuple[str, ...]:
    """The command prefix that keeps a process and its children on `cpu` (`--pin`)."""
    return ("taskset", "-c", str(cpu)) if args.pin else ()


def _until(ready, seconds: float, what: str) -> None:
    deadline = time.time() + seconds
    while not ready():
        if time.time() > deadline:
            raise RuntimeError(f"{what} within {seconds:g} s")
        time.sleep(0.1)


def _starved(wrappers: list) -> bool:
    """The first leader declared a worker dead before any fault."""
    return any(w.mark("event", kind="death") for w in wrappers)


def _deaths(wrappers: list) -> str:
    """The first deaths the leader declared, seconds after it started (what starved)."""
    leader = next(w for w in wrappers if w.mark("store"))
    t0 = leader.mark("store")["t"]
    return "; ".join(f"{m['t'] - t0:.1f} s: {m['message']}" for m in leader.marks
                     if m["ev"] == "event" and m["kind"] == "death")[:600]


def _keep_reports(children: list, path: Path) -> None:
    """Every host's events (and what else `report` gives) into `path`, for a run that failed
    after the kill: which host did not re-attach, and what it said."""
    reports = {n: r for part in _ask(children, "report") for n, r in part.items()}
    path.write_text(json.dumps(reports))


def _ask(children: list, command: str, arg=None) -> list:
    for _, conn in children:
        conn.send((command, arg))
    return [conn.recv() for _, conn in children]


def _lost_links(children: list) -> dict:
    return {k: why for part in _ask(children, "lost") for k, why in part.items()}


def _all_held(children: list, gen: int) -> bool:
    held = {k: t for part in _ask(children, "held", gen) for k, t in part.items()}
    return all(t is not None for t in held.values())


def _follow(args, standby: _Wrapper, children: list, killed: float, lost: int | None,
            nnodes: int) -> dict:
    """Wait for the takeover to complete (and, with a host lost, the next decision to be held
    everywhere), a lease more, then gather every time."""
    deadline = killed + 3 * args.lease + args.timeout

    def adopted() -> bool:
        return standby.mark("event", kind="take-over") is not None

    _until(adopted, deadline - time.time(), "the standby did not adopt the generation")
    took = standby.mark("event", kind="take-over")
    next_gen = None
    if lost is not None:
        next_gen = took["gen"] + 1
        _until(lambda: _all_held(children, next_gen), deadline - time.time(),
               f"generation {next_gen} not held by every survivor")
    held_at = time.time()
    time.sleep(args.lease)  # a lease more: the stand-ins train on, nothing else happens
    reports = {n: r for part in _ask(children, "report") for n, r in part.items()}
    held = {k: t for part in _ask(children, "held", next_gen) for k, t in part.items()} \
        if next_gen is not None else {}
    return _row(args, standby, reports, killed, lost, took, next_gen, held, held_at, nnodes)


def _row(args, standby, reports: dict, killed: float, lost, took: dict, next_gen,
         held: dict, held_at: float, nnodes: int) -> dict:
    def since(t):
        return None if t is None else round(t - killed, 3)

    def first(node: int, text: str) -> float | None:  # after the kill (a host may have
        return next((t for t, m in reports[node]["events"]  # re-attached at start-up)
                     if text in m and t >= killed), None)

    survivors = [n for n in range(nnodes) if n != lost]
    noticed = [first(n, "lost the coordinator") for n in survivors]
    found = [next((t for t in reports[n]["found"] if t >= killed), None) for n in survivors]
    attached = [first(n, "re-attached to the coordinator") for n in survivors]
    published = standby.first("leads; its store is at")
    store_up = standby.mark("store")
    adopted = took["t"]
    decided = standby.mark("event", kind="generation", gen=next_gen) if next_gen else None
    ends = [e for n in survivors for group in reports[n]["ends"] for e in group]
    per_link = [[e for e in group] for n in survivors for group in reports[n]["ends"]]
    steps_kill = [sum(1 for e in g if e < killed) for g in per_link]
    steps_adopt = [sum(1 for e in g if e < adopted) for g in per_link]
    gaps = [b - a for g in per_link for a, b in zip(g, g[1:]) if b >= killed and a <= adopted]
    return {
        "ranks": args.ranks, "hosts": nnodes, "per_host": args.per_host,
        "per_link": args.per_link, "processes": args.procs, "lease": args.lease,
        "iteration": args.iteration, "host_poll": args.host_poll,
        "hosts_nice": args.hosts_nice, "pinned": args.pin, "with_host_lost": lost is not None,
        "noticed_s": _spread([since(t) for t in noticed]),
        "published_s": since(published),
        "store_up_s": since(store_up["t"]) if store_up else None,
        "successor_found_s": _spread([since(t) for t in found]),
        "reattached_s": _spread([since(t) for t in attached]),
        "reattach_after_found_s": _spread([round(a - f, 3) for a, f in zip(attached, found)
                                           if a is not None and f is not None]),
        "adopted_s": since(adopted),
        "decided_s": since(decided["t"]) if decided else None,
        "all_hold_next_s": since(max(held.values())) if held and all(
            t is not None for t in held.values()) else None,
        "iterations_during": {"min": min(b - a for a, b in zip(steps_kill, steps_adopt)),
                              "max": max(b - a for a, b in zip(steps_kill, steps_adopt))},
        "longest_gap_s": round(max(gaps), 3) if gaps else None,
        "stand_in_iterations": len(ends),
        "hosts_stalled": sum(1 for n in survivors if reports[n]["stalled"] is not None),
        "take_over_event": took["message"],
        "slow_hosts": _slow(reports, survivors, attached, killed),
        "events_after_kill": [(since(m["t"]), m["kind"], m["message"][:100])
                              for m in standby.marks if m["ev"] == "event"][:8],
        "progress_after": [m for m in standby.marks if m["ev"] == "progress"][-1:],
        "settled_s": round(time.time() - held_at, 3),
        "load": os.getloadavg(),
    }


def _slow(reports: dict, survivors: list[int], attached: list, killed: float) -> dict:
    """What the hosts that re-attached over 4 s after the median said after the kill (their
    agent's events, seconds from the kill): where a slow re-attach spent its time."""
    times = [a for a in attached if a is not None]
    if not times:
        return {}
    median = statistics.median(times)
    return {n: [(round(t - killed, 3), m[:140]) for t, m in reports[n]["events"]
                if t >= killed][:8]
            for n, a in zip(survivors, attached) if a is None or a > median + 4.0}


def _spread(values: list) -> dict | None:
    """Median and last (and first) of per-host times; None if any host never got there."""
    if not values or any(v is None for v in values):
        return {"missing": sum(1 for v in values if v is None), "of": len(values)}
    values = sorted(values)
    return {"first": values[0], "median": round(statistics.median(values), 3),
            "last": values[-1], "over_5s_after_median": sum(
                1 for v in values if v > statistics.median(values) + 4.0)}


def _losses(run_dir: Path) -> dict:
    """The iterations saved in losses.jsonl: none missing, none saved twice."""
    path = run_dir / "losses.jsonl"
    its = [json.loads(line)["iteration"] for line in path.read_text().splitlines()
           if line.strip()] if path.is_file() else []
    return {"saved": len(its), "first": min(its, default=None), "last": max(its, default=None),
            "twice": len(its) - len(set(its)),
            "missing": (max(its) - min(its) + 1 - len(set(its))) if its else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--per-host", type=int, default=8)
    parser.add_argument("--per-link", type=int, default=None,
                        help="ranks whose records share one stand-in link (default: a host's)")
    parser.add_argument("--procs", type=int, default=4,
                        help="processes the stand-in hosts run in")
    parser.add_argument("--host-poll", type=float, default=0.1,
                        help="the host agents' idle poll (s; theirs is 0.02): a frame from a "
                             "worker, a store answer or a notice still wakes the loop at once; "
                             "128 loops at 50 passes a second do not fit 2 cores")
    parser.add_argument("--hosts-nice", type=int, default=0,
                        help="run the stand-in hosts at this nice value (10: the coordinators "
                             "and etcd get the CPU first, as on machines of their own, which "
                             "the control plane has on a cluster; the hosts' share is what "
                             "is left of the 2 cores)")
    parser.add_argument("--pin", action="store_true",
                        help="etcd and the coordinators on CPU 0, the stand-in hosts on CPU 1: "
                             "each side on a machine of its own, as on a cluster (needs 2 "
                             "CPUs and taskset)")
    parser.add_argument("--lease", type=float, default=4.0)
    parser.add_argument("--iteration", type=float, default=1.0,
                        help="seconds between two iterations of the stand-ins")
    parser.add_argument("--seconds", type=float, default=8.0,
                        help="steady state before the leader is killed")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds past three leases to wait for the takeover")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--with-host", action="store_true",
                        help="a host is lost at the same instant as the leader")
    parser.add_argument("--logs", type=Path, default=None, help="keep the logs here")
    parser.add_argument("--coordinator", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.coordinator:
        logging.basicConfig(level=logging.WARNING)
        sys.exit(coordinator_main(args))
    args.per_link = args.per_link or args.per_host
    if args.ranks % args.per_host or args.per_host % args.per_link:
        sys.exit("--per-host must divide --ranks, and --per-link --per-host")
    if args.pin and (shutil.which("taskset") is None
                     or not {CONTROL_CPU, HOSTS_CPU} <= os.sched_getaffinity(0)):
        sys.exit(f"--pin needs taskset and CPUs {CONTROL_CPU} and {HOSTS_CPU}")
    why = etcd_missing()
    if why:
        sys.exit(f"cannot run: {why}")
    logging.basicConfig(level=logging.WARNING)
    rows, failed = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.repeat):
            work = (args.logs or Path(tmp)) / f"run{n}"
            work.mkdir(parents=True, exist_ok=True)
            try:
                row = run_once(args, work, args.with_host)
            except RuntimeError as exc:
                failed += 1
                print(f"run {n}: not recorded: {exc} (logs in {work})", flush=True)
                continue
            rows.append(row)
            print(json.dumps(row), flush=True)
    _write(rows, args)
    if failed:
        sys.exit(f"{failed} of {args.repeat} runs not recorded")


def _code() -> str:
    """The code measured: its commit, and whether the tree had changes (before one)."""
    def git(*words: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *words], capture_output=True,
                              text=True).stdout.strip()
    return git("rev-parse", "--short", "HEAD") + (" with changes" if git(
        "status", "--porcelain", "--untracked-files=no", "--", ".",
        ":!benchmarks/results") else "")  # the results it writes are not the code


def _write(rows: list[dict], args) -> None:
    """Replace this case's rows (size, host lost or not, code measured) in the results,
    keeping other code's (before and after a change); atomic."""
    if not rows:
        return
    code = _code()
    for row in rows:
        row.update(code=code, command="python " + " ".join(
            [Path(sys.argv[0]).name, *sys.argv[1:]]))
    key = (args.ranks, args.per_host, args.lease, args.with_host, args.hosts_nice, args.pin,
           code)
    old = json.loads(RESULTS.read_text())["rows"] if RESULTS.is_file() else []
    kept = [r for r in old if (r["ranks"], r["per_host"], r["lease"], r["with_host_lost"],
                               r.get("hosts_nice", 0), r.get("pinned", False),
                               r.get("code")) != key]
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": VERSION, "machine": machine(),
                               "rows": kept + rows}, indent=1) + "\n")
    os.replace(tmp, RESULTS)


if __name__ == "__main__":
    main()
