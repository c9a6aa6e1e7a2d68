"""Control traffic on the coordinator's c10d store in steady state: workers on the store
(`StoreLink`, every rank polls) against workers behind their host agents' relays (`HostLink`,
`relay.Relay`: one report per host, notices read once per host).

Everything runs in this process, on loopback: the coordinator's store (a c10d `TCPStore`), the
real coordinator (`agent.Agent` over `pool.HostPool`: its pass, `Agent._pass`, run at its own
cadence, the 20 ms idle poll while a generation runs), and stand-in workers that only report:
real links (`StoreLink` with its heartbeat and abort-watch threads, or `HostLink` with its
heartbeat and reader threads) whose training is replaced by a driver that, once per
`--iteration` seconds, makes every rank report its iteration's end (and the last stage its
losses), as a worker does. In relay mode the stand-in host agents are real `relay.Relay`s, one
per 8 ranks, stepped every 20 ms (the host agent's poll). The coordinator is in generation 1
of a fault-free job whose members are every rank (its decision and library stand in: only
their sizes are read).

Counted: every call on a store client (the workers', the host agents' and the coordinator's),
by a counting wrapper, over `--seconds` after a warm-up; and the coordinator's pass time.

`--memory`: the coordinator's memory over a long run instead (`control/iterations.py`): the
records its mail holds (on the store: the store's keys) and its process's resident memory at
the start and the end of the window, the run's records kept to the end (before: `--linger`
infinite, nothing retired) against retired a lease after their iteration's losses are saved.

    python bench_relay.py                          # 1,024 ranks, both modes
    python bench_relay.py --ranks 256 1024 --mode relay
    python bench_relay.py --memory --ranks 128 --mode relay --iteration 0.05 --seconds 60
    python bench_relay.py --recovery --ranks 1024 2048 --lease 4 --per-link 8
    python bench_relay.py --recovery --ranks 8192 --per-host 64 --per-link 64 --iteration 4 \
        --seconds 12 --lease 4     # 1,024 stand-in hosts of 8 do not fit 2 cores
    python bench_relay.py --recovery --alone --ranks 1024 8192 --per-host 64  # coordinator only
    python bench_relay.py --adoption --ranks 1024 8192 --per-host 8   # a new leader, alone
    python bench_relay.py --adoption --transport etcd --ranks 1024 8192 --per-host 8
    python bench_relay.py --recovery --transport etcd --ranks 1024 --per-host 32 --per-link 8

`--adoption`: a new leader's own part of a takeover, with nothing else running (`adoption`).
`--transport etcd` (recovery mode): the relay's traffic on a real 3-member etcd started for each
run (`etcd_local.EtcdCluster`, etcd's default timings), as under `--rdzv-backend etcd`: the
coordinator's side an `EtcdCoordinator`, each stand-in host's an `EtcdHost` on an `EtcdStore` of
its own, every key under the job's `Keys.relay`; the coordinator's c10d store then carries only
the process groups' keys and the ranks' incarnations (`groups`). The requests etcd served over
the steady window are read from its own counters (results/relay-recovery-etcd.json).
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import machine  # noqa: E402

import torch.distributed as dist  # noqa: E402

from recycle_planner.executor.control import messages as msg  # noqa: E402
from recycle_planner.executor.control.agent import Agent, LaunchConfig, Phase  # noqa: E402
from recycle_planner.executor.control.iterations import IterationLog  # noqa: E402
from recycle_planner.executor.control.link import (LOST, ControlLost, HostLink,  # noqa: E402
                                                   StoreLink)
from recycle_planner.executor.control.etcd_local import EtcdCluster  # noqa: E402
from recycle_planner.executor.control.mail import RelayMail, StoreMail  # noqa: E402
from recycle_planner.executor.control.plane import Keys  # noqa: E402
from recycle_planner.executor.control.pool import HostPool  # noqa: E402
from recycle_planner.executor.control.protocol import Decision  # noqa: E402
from recycle_planner.executor.control.relay import HostReport, Journal, Relay  # noqa: E402
from recycle_planner.executor.control.store import EtcdStore  # noqa: E402
from recycle_planner.executor.control.transport import (UP_QUEUE, C10dHost,  # noqa: E402
                                                        EtcdCoordinator, EtcdHost)
from recycle_planner.executor.control.result import EventKind  # noqa: E402
from recycle_planner.executor.control.runfolder import claim  # noqa: E402

PER_HOST = 8
STAGES = 8
MICROBATCHES = 16
log = logging.getLogger("bench_relay")
RESULTS = Path(__file__).resolve().parent / "results" / "relay.json"
MEMORY_RESULTS = Path(__file__).resolve().parent / "results" / "relay-memory.json"
RECOVERY_RESULTS = Path(__file__).resolve().parent / "results" / "relay-recovery.json"
ALONE_RESULTS = Path(__file__).resolve().parent / "results" / "relay-recovery-alone.json"
ETCD_RESULTS = Path(__file__).resolve().parent / "results" / "relay-recovery-etcd.json"
ADOPTION_RESULTS = Path(__file__).resolve().parent / "results" / "relay-adoption-alone.json"
JOB = "bench"


class Counting:
    """A store client that counts its calls (thread-safe: `itertools.count`)."""

    def __init__(self, store, counter):
        self.store, self.counter = store, counter

    def __getattr__(self, name):
        attr = getattr(self.store, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            next(self.counter)
            return attr(*args, **kwargs)
        return call


class Counter:
    """Store calls by side; `read` itself counts one on each (subtracted by the caller)."""

    def __init__(self) -> None:
        self.counts = {side: itertools.count() for side in ("coordinator", "hosts", "workers")}

    def read(self) -> dict[str, int]:
        return {side: next(c) for side, c in self.counts.items()}


@dataclass
class _Spec:
    """The library's size, as the coordinator reads it."""

    pipelines: int
    stages: int
    microbatches: int


class _Hit:
    """What `Agent._decide` reads of a library hit: the plan's file name, its predicted
    degradation and period."""

    def __init__(self, dead):
        self.file = Path(f"plan-{len(dead)}-dead.json.gz")
        self.entry = self
        self.metrics = self
        self.degradation = 0.0
        self.period = 1.0


class _Lib:
    """The plan library's stand-in: its size, and a lookup that names the dead set (a real
    lookup is one index read: bench_ondemand.py); no plan is refined."""

    reference_period = None

    def __init__(self, spec: _Spec):
        self.spec = spec

    def lookup(self, dead, plan=None) -> _Hit:
        return _Hit(dead)

    def entry(self, counts):
        return None


class _StorePool(HostPool):
    """Issue 22's coordinator: the same pool, every record read under its own key."""

    def mail(self, store):
        return StoreMail(store)


def _coordinator(ranks: int, mode: str, run_dir: str, counter: Counter, lease: float,
                 linger: float, per_host: int, etcd: str | None = None) -> Agent:
    """The real coordinator in generation 1 (see the module); on etcd's relay transport where
    `etcd` names its endpoints. Every call on its stores is counted."""
    config = LaunchConfig(nproc=ranks, run_dir=run_dir, checkpoint_every=0, lease=lease)
    folder = claim(run_dir, False, False)
    nodes = ranks // per_host
    if mode == "store":
        agent = Agent(config, None, folder, _StorePool, nodes)
    elif etcd is None:
        agent = Agent(config, None, folder, HostPool, nodes)
    else:
        # the mail as under `--rdzv-backend etcd` (what `HostLeases.relay` makes), the c10d
        # store its `groups`; unfenced: no election runs here to publish a fence (in
        # production it adds one compare to each transaction)
        agent = Agent(config, None, folder, HostPool, nodes, lambda store: EtcdCoordinator(
            EtcdStore(etcd, timeout=max(2.0, lease)), Keys(JOB).relay, groups=store))
    agent.store = Counting(agent.store, counter.counts["coordinator"])
    if isinstance(agent.mail, StoreMail):
        agent.mail.store = agent.store
    elif etcd is None:
        agent.mail.transport.store = agent.store
    else:
        transport = agent.mail.transport
        transport.store = Counting(transport.store, counter.counts["coordinator"])
        transport.groups = agent.store
    agent._start()
    pipelines = ranks // STAGES
    agent.lib, agent.stages = _Lib(_Spec(pipelines, STAGES, MICROBATCHES)), STAGES
    agent.gen, agent.phase = 1, Phase.RUNNING
    agent.decision = Decision(gen=1, action="run", members=tuple(range(ranks)), dead=(),
                              restart=0, incarnations={r: 0 for r in range(ranks)})
    for rank in range(ranks):  # as the coordinator welcomed them into generation 1
        agent.mail.put(msg.Welcome(rank, 0, 1))
    agent.iterations = IterationLog(agent.mail, folder, pipelines, STAGES, MICROBATCHES, 0,
                                    linger)
    return agent


def _held(agent: Agent) -> int:
    """The records the coordinator's mail holds (on the store: the store's keys)."""
    mail = agent.mail
    if isinstance(mail, StoreMail):
        return mail.store.num_keys()
    return len(mail.records) + len(mail.counts)


def _rss_mb() -> float:
    """This process's resident memory (MiB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _client(port: int, timeout: float, counter):
    """A counted client; connecting may take a retry here (about one connection in 30 waited
    5 s on this machine), so it connects with a long timeout, then uses `timeout`."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    store.set_timeout(timedelta(seconds=timeout))
    return Counting(store, counter)


def _store_links(port: int, ranks: list[int], counter: Counter, lease: float) -> list:
    class CountedStoreLink(StoreLink):
        def _connect(self, host, p, timeout, then=None):
            return _client(p, timeout if then is None else then, counter.counts["workers"])

    with ThreadPoolExecutor(32) as pool:
        return list(pool.map(lambda _: CountedStoreLink("127.0.0.1", port, 60.0, lease, 0.2,
                                                        0.002), ranks))


def _relays(clients: dict, counter: Counter, folder: str, lease: float, per_host: int,
            etcd: str | None) -> list[Relay]:
    """A real relay per host, on its store clients (`clients[node]`), or where `etcd` names
    its endpoints on an `EtcdHost` with an `EtcdStore` of its own (as `Successor.relay`)."""
    hosts = counter.counts["hosts"]

    def transport(node: int):
        store, notices = clients[node]
        if etcd is None:
            return C10dHost(Counting(store, hosts), Counting(notices, hosts))
        return EtcdHost(Counting(EtcdStore(etcd, timeout=max(2.0, lease)), hosts),
                        Keys(JOB).relay, node, lambda: Counting(store, hosts))

    def relay(node: int) -> Relay:
        relay = Relay(transport(node), node, f"{folder}/r{node}.sock", lease, 0.2)
        relay.report(msg.HostUp(node, f"host{node}", 0, tuple(
            range(node * per_host, (node + 1) * per_host))))
        return relay

    return [relay(node) for node in clients]


def _connect(port: int, nodes: list[int], lease: float, etcd: bool) -> dict:
    """Each host agent's connections to the coordinator's store, made before any relay
    watches it: about one connection in 25 takes 5 s here (this sandbox's network stack),
    and the coordinator's store answered nobody meanwhile, so a relay already watching
    would take the coordinator for lost. On etcd one (the process groups'); else two, the
    second for the blocking waits on notices."""
    def pair(node: int) -> tuple:
        return (_client(port, 60.0, itertools.count()).store,
                None if etcd else _client(port, lease, itertools.count()).store)

    with ThreadPoolExecutor(32) as pool:
        return dict(zip(nodes, pool.map(pair, nodes)))


class _Workers:
    """Stand-in workers behind one link (one rank, or `--per-link` ranks of one host): they
    say hello, report each iteration's end (the last stage its pipeline's losses), and answer
    an abort as `executor/worker.py` does: the link hands the abort to a thread of the
    worker's own (`Worker._on_abort`), the generation is left, and the training thread
    reports `Ready` with the stage's step count and blocks on the next generation's decision
    (`Worker._live`); then they train on from its restart iteration. `held[gen]`: when they
    held generation `gen`'s decision."""

    def __init__(self, link, ranks: list[int], period: float):
        self.link, self.ranks = link, ranks
        self.gen, self.steps = 1, 0          # the generation they run, their stage's steps
        self.period, self.due = period, float("inf")  # when their next iteration ends
        self.leaving = False                 # from an abort to the next decision
        self.vanished = False
        self.held: dict[int, float] = {}
        self.lock = threading.Lock()

    def start(self) -> None:
        self.link.watch(lambda: msg.Heartbeat(self.ranks[0], 0, time.time()),
                        lambda: self.gen, self._on_abort)
        for rank in self.ranks:
            self.link.send(msg.Hello(rank, 0, 0, "stand-in", "lib", 0))

    def iterate(self, now: float) -> None:
        """End the next iteration if it is due: iteration i ends at the same time on every
        link of every process (`first` + i periods), so that no two stages' step counts
        differ by more than one, as in training, where a stage cannot step iteration i+1
        before every stage stepped i (`protocol.decide` checks it)."""
        with self.lock:
            if self.leaving or self.vanished or now < self.due:
                return
            i, gen = self.steps, self.gen
            for rank in self.ranks:
                self.link.send(msg.IterationDone(i, rank, gen, now))
                if rank % STAGES == STAGES - 1:  # its own pipeline's (a worker sends all D*M)
                    self.link.send(msg.Losses(i, rank, gen, tuple(
                        (rank // STAGES, m, 0.5) for m in range(MICROBATCHES))))
            self.steps, self.due = i + 1, self.due + self.period

    def _on_abort(self, gen: int, reason: str) -> None:
        with self.lock:  # called on the link's thread: must not block
            if reason == LOST or gen != self.gen or self.leaving or self.vanished:
                return
            self.leaving = True
        threading.Thread(target=self._leave, args=(gen,), daemon=True).start()

    def _leave(self, gen: int) -> None:
        try:
            for rank in self.ranks:
                self.link.send(msg.Ready(gen, rank, self.steps, "failure"))
            decision = self.link.decision(gen + 1)
        except ControlLost:
            return
        held = time.time()
        with self.lock:
            self.held[decision.gen] = held
            self.gen, self.steps, self.leaving = decision.gen, decision.restart, False
            self.due = held + self.period

    def vanish(self) -> None:
        """Its host is gone: nothing more from these workers, their link's heartbeat and
        silence-judging threads stop, its socket stays open (nothing is closed)."""
        with self.lock:
            self.vanished = True
            self.link._closed = True  # the threads' own flag; `close` would close the socket


def _stand_ins(mode: str, port: int, nodes: list[int], folder: str, iteration: float,
               lease: float, per_host: int, per_link: int, etcd: str | None, conn) -> None:
    """A process of stand-in hosts `nodes` (`per_host` ranks each): their workers' links (and
    in relay mode their host agents' relays, on etcd where `etcd` names it); answers ("read",
    _) with its counts, ("vanish", node) with when host `node` vanished, ("held", gen) with
    when each live link's workers held generation `gen`'s decision (None: not yet), until
    ("stop", _)."""
    counter = Counter()
    stop = threading.Event()
    ranks = [n * per_host + i for n in nodes for i in range(per_host)]
    relays: dict[int, Relay] = {}
    stepped: dict[int, Relay] = {}
    stepping = threading.Lock()
    links = _store_links(port, ranks, counter, lease) if mode == "store" else []
    clients = _connect(port, nodes, lease, etcd is not None) if mode == "relay" else {}
    conn.send("connected")
    conn.recv()  # every process connected: no connection is made from here on
    if mode == "store":
        groups = [_Workers(link, [rank], iteration) for rank, link in zip(ranks, links)]
    else:
        relays = {r.node: r for r in _relays(clients, counter, folder, lease, per_host, etcd)}
        stepped.update(relays)

        def step_relays():
            while not stop.is_set():
                with stepping:
                    for relay in stepped.values():
                        relay.step()
                time.sleep(0.02)  # the host agent's poll

        stepper = threading.Thread(target=step_relays, daemon=True)
        stepper.start()
        groups = [_Workers(HostLink(relays[rank // per_host].path, rank, 0, ("127.0.0.1", port),
                                    60.0, 0.2, lease), ranks[k:k + per_link], iteration)
                  for k, rank in enumerate(ranks) if k % per_link == 0]
    for group in groups:
        group.start()

    def train():
        while not stop.is_set():
            for group in groups:
                group.iterate(time.time())
            stop.wait(min(0.05, iteration / 4))

    def vanish(node: int) -> float:
        with stepping:  # its relay is no longer stepped: no report, no beat, no answer
            del stepped[node]
            t = time.time()
        relays[node]._closed = True  # its notice thread leaves at its next notice
        for group in groups:
            if group.ranks[0] // per_host == node:
                group.vanish()
        return t

    conn.send("ready")
    _, first = conn.recv()  # every process is up: the first iteration ends at `first`
    for group in groups:
        group.due = first
    threading.Thread(target=train, daemon=True).start()
    while True:
        command, arg = conn.recv()
        if command == "read":
            conn.send(counter.read())
        elif command == "vanish":
            conn.send(vanish(arg))
        elif command == "held":
            conn.send({g.ranks[0]: g.held.get(arg) for g in groups if not g.vanished})
        elif command == "cpu":
            conn.send(time.process_time())
        else:
            break
    stop.set()
    for group in groups:
        group.link.close()
    if relays:
        stepper.join(30)  # a relay closed under a step would raise in it
    with ThreadPoolExecutor(max(1, len(relays))) as pool:  # together: one coordinator beat
        list(pool.map(Relay.close, relays.values()))  # ends them all (one by one: a beat each)
    conn.send("stopped")


def _fit_select(ranks: int, per_host: int, per_link: int, procs: int) -> None:
    """A relay waits on its sockets with `select`, which takes descriptors below 1,024: a
    host agent's process holds one relay, a stand-in process many (each: two store clients,
    its listener, its wake pair, and both ends of each link's socket). Exit with one line
    if a process would hold more than fit."""
    per_relay = 5 + 2 * (per_host // per_link)
    fit = (1024 - 100) // per_relay  # 100: the interpreter's, torch's and c10d's own
    need = -(-(ranks // per_host) // fit)
    if procs < need:
        sys.exit(f"{ranks} ranks in relay mode need --procs {need} or more: a process holds "
                 f"at most {fit} relays (select() takes descriptors below 1,024)")


class _Run:
    """The harness of every measure: the coordinator in this process (its passes are the
    caller's), the stand-in hosts in `procs` others, started and stopped; the relay's traffic
    on etcd where `etcd` names its endpoints."""

    def __init__(self, ranks: int, mode: str, iteration: float, procs: int, lease: float,
                 linger: float, per_host: int = PER_HOST, per_link: int = 1,
                 etcd: str | None = None):
        if mode == "relay":
            _fit_select(ranks, per_host, per_link, procs)
        self.counter = Counter()
        self.procs = procs
        folder = tempfile.mkdtemp(prefix="bench-relay-")
        self.agent = _coordinator(ranks, mode, f"{folder}/run", self.counter, lease, linger,
                                  per_host, etcd)
        context = mp.get_context("spawn")  # a forked child could inherit a lock held by c10d
        hosts = list(range(ranks // per_host))
        self.children, self.owner = [], {}
        for k in range(procs):
            ours, theirs = context.Pipe()
            proc = context.Process(target=_stand_ins, args=(
                mode, self.agent.port, hosts[k::procs], folder, iteration, lease, per_host,
                per_link, etcd, theirs), daemon=True)
            proc.start()
            self.children.append((proc, ours))
            self.owner.update({node: ours for node in hosts[k::procs]})
        for phase in ("connected", "ready"):  # every connection made, then every host up
            for _, conn in self.children:  # the coordinator's passes go on (hellos, reports)
                while not conn.poll(0.02):
                    self.agent._pass(time.time())
                assert conn.recv() == phase
            for _, conn in self.children:  # then every relay and link; then training
                conn.send(("go", time.time() + iteration))

    def ask(self, command: str, arg=None) -> list:
        for _, conn in self.children:
            conn.send((command, arg))
        return [conn.recv() for _, conn in self.children]

    def read(self) -> dict[str, int]:
        """Every side's store calls so far (each read counts one on the coordinator's counter
        and on each process's)."""
        total = self.counter.read()
        for counts in self.ask("read"):
            for side, n in counts.items():
                total[side] += n
        return total

    def steady(self, warmup: float, seconds: float, on_start=lambda: None
               ) -> tuple[dict, list[float], float]:
        """The coordinator's passes at its idle poll over `warmup` then `seconds` (`on_start`
        called as the window starts): store calls per second by side over the window, the
        window's pass times, its length."""
        passes: list[float] = []
        t_end = time.time() + warmup + seconds
        start = None
        while time.time() < t_end:
            now = time.time()
            if start is None and now >= t_end - seconds:
                start, counts0, passes = now, self.read(), []
                on_start()
            t0 = time.perf_counter()
            self.agent._pass(now)
            passes.append(time.perf_counter() - t0)
            time.sleep(self.agent.config.idle_poll)
        counts1 = self.read()
        elapsed = time.time() - start
        rates = {side: (counts1[side] - counts0[side] - 1 - self.procs) / elapsed
                 for side in counts1}
        return rates, passes, elapsed

    def close(self) -> None:
        """Stop the stand-ins after the measure (nothing read from here on). The coordinator
        only beats meanwhile (`mail.flush`): its beat wakes the relays' notice threads, which
        each relay's `close` waits for; it no longer judges leases, since stopped stand-ins
        would lose theirs and make a generation of their own."""
        for _, conn in self.children:
            conn.send(("stop", None))
        for proc, conn in self.children:
            while not conn.poll(0.02):
                self.agent.mail.flush()
            conn.recv()
            proc.join(30)
        if isinstance(self.agent.mail, RelayMail) and \
                isinstance(self.agent.mail.transport, EtcdCoordinator):
            self.agent.mail.transport.close()  # its watch, before etcd stops


def _ms(passes: list[float]) -> dict:
    return {"median": 1e3 * statistics.median(passes), "max": 1e3 * max(passes)}


def measure(ranks: int, mode: str, seconds: float, iteration: float, warmup: float,
            procs: int, lease: float, linger: float | None = None) -> dict:
    linger = lease if linger is None else linger
    run = _Run(ranks, mode, iteration, procs, lease, linger)
    try:
        agent = run.agent
        memory0 = []
        rates, passes, elapsed = run.steady(warmup, seconds, lambda: memory0.extend(
            (_held(agent), _rss_mb(), agent.iterations.next_loss)))
        memory1 = (_held(agent), _rss_mb(), agent.iterations.next_loss)
        return _steady_row(agent, mode, ranks, procs, lease, linger, rates, passes, elapsed,
                           memory0, memory1)
    finally:
        run.close()


def _steady_row(agent: Agent, mode: str, ranks: int, procs: int, lease: float, linger: float,
                rates: dict, passes: list[float], elapsed: float, memory0: list,
                memory1: tuple) -> dict:
    hellos = sum(1 for p in agent.procs.values() if p.hello is not None)
    return {"mode": mode, "ranks": ranks, "hosts": ranks // PER_HOST, "processes": procs,
            "lease": lease,
            "seconds": elapsed, "ops_per_s": rates, "total_ops_per_s": sum(rates.values()),
            "coordinator_pass_ms": _ms(passes),
            "passes_per_s": len(passes) / elapsed, "hellos_seen": hellos,
            "deaths": len(agent.deaths), "linger": linger if linger < float("inf") else None,
            "memory": {"records_start": memory0[0], "records_end": memory1[0],
                       "rss_mb_start": memory0[1], "rss_mb_end": memory1[1],
                       "iterations_saved_start": memory0[2],
                       "iterations_saved_end": memory1[2],
                       "iterations_held_end": memory1[2] - agent.iterations.retired}}


class _Timeline:
    """When the coordinator's mail took in every survivor's `Ready` and published each
    bulletin (its `refresh` and `flush` wrapped, on this instance only), and how long each
    pass of the recovery took: the recovery's steps between the coordinator's events."""

    def __init__(self, agent: Agent):
        self.mail = agent.mail
        self.refreshes: list[tuple[float, int]] = []   # (end, Readys taken in so far)
        self.published: list[float] = []               # ends of flushes that published
        self.passes: list[tuple[float, float, float]] = []  # (start, seconds, CPU seconds)
        refresh, flush = self.mail.refresh, self.mail.flush

        def timed_refresh() -> None:
            refresh()
            self.refreshes.append((time.time(), self.mail.arrivals(msg.Ready) or 0))

        def timed_flush() -> None:
            version = self.mail.version
            flush()
            if self.mail.version != version:
                self.published.append(time.time())
        self.mail.refresh, self.mail.flush = timed_refresh, timed_flush

    def steps(self, readies: int, since: float, abort: float | None,
              decided: float | None) -> dict:
        """Times (absolute) of: the abort published, the last of `readies` `Ready`s taken in
        (counted from `since`), the decision published; and between the abort and the
        decision, the time the coordinator's passes took and the CPU time its thread used in
        them (what would stay serial on a cluster, where the hosts' side runs elsewhere)."""
        base = max((n for t, n in self.refreshes if t < since), default=0)
        readies_in = next((t for t, n in self.refreshes if n - base >= readies), None)

        def published_after(t0):
            return None if t0 is None else next((t for t in self.published if t >= t0), None)
        inside = ([] if abort is None or decided is None else
                  [(d, cpu) for t, d, cpu in self.passes if abort <= t <= decided])
        return {"abort_published": published_after(abort), "readies_in": readies_in,
                "decision_published": published_after(decided),
                "busy": sum(d for d, _ in inside) if inside else None,
                "cpu": sum(cpu for _, cpu in inside) if inside else None}


def etcd_requests(endpoints: str) -> dict[str, float]:
    """The requests etcd's members have served since they started, by gRPC method, summed
    over members (each request reaches one; the JSON gateway's go through gRPC too): a
    unary call counts one, a stream (a watch, a lease's keep-alives) each message in."""
    from urllib.request import urlopen

    counts: dict[str, float] = {}
    for endpoint in endpoints.split(","):
        with urlopen(f"http://{endpoint}/metrics", timeout=10) as answer:
            for line in answer.read().decode().splitlines():
                if line.startswith("grpc_server_msg_received_total{"):
                    method = line.split('grpc_method="', 1)[1].split('"', 1)[0]
                    counts[method] = counts.get(method, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def etcd_rates(before: tuple[float, dict], after: tuple[float, dict], hosts: int) -> dict:
    """Requests per second between two `(time, etcd_requests)`, by method, in all and per
    host."""
    seconds = after[0] - before[0]
    rates = {m: round((n - before[1].get(m, 0.0)) / seconds, 1) for m, n in after[1].items()
             if n > before[1].get(m, 0.0)}
    total = sum(rates.values())
    return {"seconds": round(seconds, 2), "requests_per_s": rates,
            "total_per_s": round(total, 1), "per_host_per_s": round(total / hosts, 2)}


def recover(ranks: int, per_host: int, per_link: int, seconds: float, iteration: float,
            warmup: float, procs: int, lease: float, profile: str | None = None,
            transport: str = "c10d") -> dict:
    """`_recover` on the relay's `transport`: on etcd, a real 3-member cluster of its own
    (etcd's default timings, as deployed), stopped after the measure."""
    if transport == "c10d":
        return _recover(ranks, per_host, per_link, seconds, iteration, warmup, procs, lease,
                        profile)
    with EtcdCluster(3, fast=False) as cluster:
        return _recover(ranks, per_host, per_link, seconds, iteration, warmup, procs, lease,
                        profile, cluster.endpoints)


def _recover(ranks: int, per_host: int, per_link: int, seconds: float, iteration: float,
             warmup: float, procs: int, lease: float, profile: str | None = None,
             etcd: str | None = None) -> dict:
    """Steady state over `seconds`, then the last host vanishes: from then to every surviving
    stand-in worker holding the next generation's decision, on the coordinator's own loop (its
    pass, then its poll: 2 ms while a generation is abandoned, 20 ms while one runs, as
    `Agent.run`). The measure goes on a lease after the last one held it (every survivor must
    still be alive then, and no other generation made), and the row is taken before the
    stand-ins are stopped. `profile`: a file for the cProfile statistics of the coordinator's
    passes from the loss to every survivor holding the decision."""
    run = _Run(ranks, "relay", iteration, procs, lease, lease, per_host, per_link, etcd)
    try:
        agent = run.agent
        served: list[tuple[float, dict]] = []
        rates, passes, elapsed = run.steady(warmup, seconds, lambda: served.append(
            (time.time(), etcd_requests(etcd))) if etcd else None)
        if etcd:
            served.append((time.time(), etcd_requests(etcd)))
        timeline = _Timeline(agent)
        before = list(agent.deaths)  # none, unless the machine starved a live host's lease
        if before:
            log.warning("%d live stand-ins lost their lease before the loss (the machine "
                        "starved them): try a longer --lease, or --per-link", len(before))
        whole = [n for n in range(ranks // per_host)
                 if all(r in agent.procs for r in range(n * per_host, (n + 1) * per_host))]
        if not whole or agent.phase is not Phase.RUNNING:
            raise SystemExit("no generation runs with every host: nothing to measure")
        lost = whole[-1]
        lost_ranks = set(range(lost * per_host, (lost + 1) * per_host))
        lost_procs = [agent.procs[r] for r in lost_ranks]
        gen = agent.gen + 1  # the generation the loss brings
        run.owner[lost].send(("vanish", lost))
        t_loss = run.owner[lost].recv()
        profiler = cProfile.Profile() if profile else None
        cpu: dict = {}
        recovery, held = _until_held(run, gen, t_loss + 3 * lease + 120, profiler,
                                     timeline.passes, cpu)
        if profiler is not None:
            profiler.dump_stats(profile)
        t_done = time.time()
        settle = t_done + lease  # a lease more: nothing else may happen
        while time.time() < settle:
            agent._pass(time.time())
            time.sleep(agent.config.idle_poll)
        lease_out = max(p.last_beat for p in lost_procs) + lease
        row = {"transport": "etcd" if etcd else "c10d",
               "ranks": ranks, "hosts": ranks // per_host, "per_host": per_host,
               "per_link": per_link, "links": ranks // per_link, "processes": procs,
               "lease": lease, "heartbeat": agent.config.heartbeat, "iteration": iteration,
               "steady": {"seconds": elapsed, "ops_per_s": rates,
                          "total_ops_per_s": sum(rates.values()),
                          "coordinator_pass_ms": _ms(passes)}}
        if etcd:
            row["steady"]["etcd"] = etcd_rates(served[0], served[1], ranks // per_host)
        row.update(_recovery(agent, gen, lost_ranks, lease_out, t_loss, t_done, held))
        row.update(_steps(agent, timeline, gen, ranks - per_host, t_loss))
        row["cpu_abort_to_all_hold_s"] = cpu  # CPU seconds; 2 cores give 2 per second
        row.update({"recovery_pass_ms": _ms(recovery), "deaths_before_loss": len(before),
                    "measured_until_s": time.time() - t_loss, "load": os.getloadavg()})
        return row
    finally:
        run.close()


def _recovery(agent: Agent, gen: int, lost_ranks: set[int], lease_out: float, t_loss: float,
              t_done: float, held: dict) -> dict:
    """The recovery's steps, from the coordinator's events (times from the loss), and what
    else happened until the measure's end: deaths of survivors, generations after `gen`."""
    times = [t for t in held.values() if t is not None]
    declared = min((e.t + agent.t0 for e in agent.events if e.kind is EventKind.DEATH
                    and e.data["rank"] in lost_ranks), default=None)
    decided = [e.t + agent.t0 for e in agent.events
               if e.kind is EventKind.GENERATION and e.data["gen"] == gen]
    last = max(times) if times and len(times) == len(held) else t_done
    first = min(times) if times else t_done

    def between(a, b):
        return None if a is None or b is None else b - a
    return {
        "survivor_links": len(held), "survivor_links_held": len(times),
        "loss_to_all_hold_s": last - t_loss,
        "loss_to_lease_out_s": lease_out - t_loss,
        "lease_out_to_declared_s": between(lease_out, declared),
        "declared_to_decided_s": between(declared, decided[0] if decided else None),
        "decided_to_all_hold_s": between(decided[0] if decided else None, last),
        "after_lease_out_s": last - lease_out,
        "first_to_last_s": last - first,
        "generation": gen, "decisions_of_it": len(decided), "generation_now": agent.gen,
        "deaths": len(agent.deaths),
        "deaths_not_of_lost_host": sum(1 for d in agent.deaths if d.rank not in lost_ranks),
        "events": [(round(e.t + agent.t0 - t_loss, 3), e.kind.value, e.message[:120])
                   for e in agent.events if e.t + agent.t0 >= t_loss
                   and e.kind not in (EventKind.DEATH, EventKind.HANG)][:12]}


def _steps(agent: Agent, timeline: _Timeline, gen: int, survivors: int, t_loss: float
           ) -> dict:
    """The recovery's inner steps (seconds): the abort's publication after the host was
    declared dead, every survivor's `Ready` taken in after that, the decision after the last
    `Ready`, its publication after the decision; and between the abort and the decision, the
    coordinator's share of the time spent in its passes (its one thread busy) and the CPU
    time of its thread."""
    def first(kind, pred=lambda e: True):
        return min((e.t + agent.t0 for e in agent.events if e.kind is kind and e.t + agent.t0
                    >= t_loss and pred(e)), default=None)
    declared = first(EventKind.DEATH)
    abort = first(EventKind.ABORT)
    decided = first(EventKind.GENERATION, lambda e: e.data["gen"] == gen)
    at = timeline.steps(survivors, t_loss, abort, decided)

    def between(a, b):
        return None if a is None or b is None else b - a
    return {"declared_to_abort_published_s": between(declared, at["abort_published"]),
            "abort_published_to_readies_in_s": between(at["abort_published"],
                                                       at["readies_in"]),
            "readies_in_to_decided_s": between(at["readies_in"], decided),
            "decided_to_published_s": between(decided, at["decision_published"]),
            "coordinator_busy_abort_to_decided": (
                None if at["busy"] is None or not decided or decided <= abort
                else at["busy"] / (decided - abort)),
            "coordinator_cpu_abort_to_decided_s": at["cpu"]}


def _until_held(run: _Run, gen: int, deadline: float, profiler: cProfile.Profile | None = None,
                timed: list[tuple[float, float, float]] | None = None,
                cpu: dict | None = None) -> tuple[list[float], dict]:
    """Pass the coordinator's loop until every live link's workers hold generation `gen` (asked
    every quarter second), or `deadline`; its pass times, and when each held it. `profiler`
    profiles the passes; `timed` gets each pass's start, length and CPU time; `cpu` the CPU
    seconds used from the abort (the first pass that left the generation) to the end, by
    the stand-in processes and by this process (the coordinator, its store's thread
    included), and the wall time between."""
    agent, passes, asked = run.agent, [], 0.0
    started = None
    while True:
        if started is None and agent.phase is not Phase.RUNNING:
            started = (time.time(), sum(run.ask("cpu")), time.process_time())
        now = time.time()
        t0, cpu0 = time.perf_counter(), time.thread_time()
        if profiler is not None:
            profiler.enable()
        agent._pass(now)
        if profiler is not None:
            profiler.disable()
        passes.append(time.perf_counter() - t0)
        if timed is not None:
            timed.append((now, passes[-1], time.thread_time() - cpu0))
        if now - asked > 0.25 or now > deadline:
            asked = now
            held = {k: t for part in run.ask("held", gen) for k, t in part.items()}
            if all(t is not None for t in held.values()) or now > deadline:
                if cpu is not None and started is not None:
                    cpu.update(wall=time.time() - started[0],
                               stand_ins=sum(run.ask("cpu")) - started[1],
                               coordinator=time.process_time() - started[2])
                return passes, held
        time.sleep(agent.config.idle_poll if agent.phase is Phase.RUNNING
                   else agent.config.poll)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024])
    parser.add_argument("--mode", choices=["store", "relay", "both"], default="both")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--iteration", type=float, default=1.0,
                        help="seconds between two iterations of the stand-ins")
    parser.add_argument("--lease", type=float, default=10.0,
                        help="the lease (s); heartbeats stay every 0.2 s, the coordinator "
                             "beats every quarter of the lease (4 s stood its start-up here "
                             "badly: 1,024 stand-ins on 2 shared cores)")
    parser.add_argument("--procs", type=int, default=4,
                        help="processes the stand-ins run in (the coordinator has its own)")
    parser.add_argument("--memory", action="store_true",
                        help="measure the coordinator's memory: each case twice, the run's "
                             "records kept (before) and retired a lease after their "
                             "iteration's losses are saved (results/relay-memory.json)")
    parser.add_argument("--recovery", action="store_true",
                        help="relay mode: steady state over --seconds, then a host vanishes "
                             "and the time to every survivor holding the next decision is "
                             "measured (results/relay-recovery.json)")
    parser.add_argument("--adoption", action="store_true",
                        help="a new leader's own CPU to take in every host's re-attach and "
                             "adopt the running generation, nothing else running")
    parser.add_argument("--unsaved", type=int, default=8,
                        help="with --adoption: iterations in the journals since the last "
                             "saved mark")
    parser.add_argument("--per-host", type=int, default=PER_HOST,
                        help="--recovery: ranks per stand-in host (%(default)s; 64 lets 2 "
                             "cores run 8,192 ranks as 128 hosts: 1,024 do not fit)")
    parser.add_argument("--alone", action="store_true",
                        help="--recovery: the coordinator's own part only (no stand-ins): CPU "
                             "time from the last host's lease running out to the decision, "
                             "with every other host's Readys queued at once "
                             "(results/relay-recovery-alone.json)")
    parser.add_argument("--profile", metavar="FILE",
                        help="--recovery: write the cProfile statistics of the coordinator's "
                             "passes from the loss to every survivor holding the decision "
                             "(read with `python -m pstats FILE`; one size only)")
    parser.add_argument("--per-link", type=int, default=1,
                        help="--recovery: ranks whose records share one stand-in link "
                             "(1: a link per rank, as workers have; --per-host: one per host, "
                             "the fewest threads; the coordinator sees the same records)")
    parser.add_argument("--transport", choices=["c10d", "etcd"], default="c10d",
                        help="--recovery, --adoption: the relay's traffic on the coordinator's "
                             "c10d store, or on a real 3-member etcd started for each run "
                             "(--recovery: results/relay-recovery-etcd.json)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="--recovery: runs of each size (a row each)")
    args = parser.parse_args()
    if args.transport == "etcd" and not (args.recovery and not args.alone or args.adoption):
        parser.error("--transport etcd measures a host's loss (--recovery, not --alone) or a "
                     "new leader's adoption (--adoption)")
    logging.basicConfig(level=logging.WARNING)
    if args.recovery:
        return _recoveries(args)
    if args.adoption:
        if args.unsaved < 0 or any(r % args.per_host for r in args.ranks):
            parser.error("--adoption: --unsaved is 0 or more, and --per-host divides every "
                         "--ranks")
        rows = [adoption(ranks, args.per_host, args.unsaved, transport=args.transport)
                for ranks in args.ranks]
        for row in rows:
            print(json.dumps(row), flush=True)
        return _write(ADOPTION_RESULTS, rows, lambda row: (
            row.get("transport", "c10d"), row["ranks"], row["per_host"],
            row["unsaved_iterations"]))
    rows = []
    for ranks in args.ranks:
        for mode in (["store", "relay"] if args.mode == "both" else [args.mode]):
            for linger in ([float("inf"), args.lease] if args.memory else [args.lease]):
                row = measure(ranks, mode, args.seconds, args.iteration, args.warmup,
                              args.procs, args.lease, linger)
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = MEMORY_RESULTS if args.memory else RESULTS
    _write(out, rows, lambda row: (row["mode"], row["ranks"],
                                   row.get("linger") if args.memory else None))


def alone(ranks: int, per_host: int, repeat: int = 3) -> dict:
    """The coordinator's own part of a recovery, with nothing else running (what stays serial
    on a cluster, where every host agent and worker has its own cores): the last host's
    workers lose their lease, the abort is posted, then every other host's report of its
    workers' `Ready`s is queued on the coordinator's store at once, and its passes run until
    it has decided. CPU seconds of its thread, the least of `repeat` runs (each on a fresh
    coordinator)."""
    runs = []
    for _ in range(repeat):
        folder = tempfile.mkdtemp(prefix="bench-relay-alone-")
        agent = _coordinator(ranks, "relay", f"{folder}/run", Counter(), 4.0, 4.0, per_host)
        agent._pass(time.time())
        for proc in agent.procs.values():
            proc.hello = msg.Hello(proc.rank, 0, 0, "stand-in", "lib", 0)
        t0 = time.thread_time()
        for rank in range(ranks - per_host, ranks):
            agent._lease_expired(agent.procs[rank], agent.config.lease)
        agent.mail.flush()
        declared = time.thread_time() - t0
        for node in range(ranks // per_host - 1):
            agent.store.queue_push(UP_QUEUE, HostReport(node, 1, tuple(
                ("Ready", msg.Ready(1, r, 5, "failure").to_json())
                for r in range(node * per_host, (node + 1) * per_host))).to_json())
        t0, passes = time.thread_time(), 0
        while agent.gen == 1:
            agent._pass(time.time())
            passes += 1
        runs.append((declared, time.thread_time() - t0, passes))
    best = min(runs, key=lambda r: r[1])
    return {"ranks": ranks, "per_host": per_host, "readys": ranks - per_host,
            "declare_and_abort_cpu_s": best[0], "readys_to_decided_cpu_s": best[1],
            "passes": best[2], "runs_cpu_s": [r[1] for r in runs]}


def adoption(ranks: int, per_host: int, unsaved: int, repeat: int = 3,
             transport: str = "c10d") -> dict:
    """A new leader's own part of a takeover, with nothing else running (what stays serial on
    a cluster, where each host agent has its own CPU): a coordinator started with
    `--take-over` on the lost one's run folder finds every host's re-attach report waiting
    (its journal, built by the real `relay.Journal`: each worker's hello, the `unsaved`
    iterations since the last saved mark, each with every rank's end and the last stages'
    losses, the host's `HostUp`; then its `Attach`), and its passes run until it has adopted
    the generation. On c10d the reports are queued on its store once it started, and timed
    from there; on etcd (a real 3-member cluster of its own) each host's `EtcdHost` put its
    report before the coordinator started, as when the hosts re-attach while its store
    starts (since they make no call on it), and the coordinator is timed from its
    construction (which reads them). CPU seconds of its thread and wall seconds, the least of
    `repeat` runs (each on a fresh coordinator): in all, and taking the reports in
    (`RelayMail.refresh`)."""
    if transport == "etcd":
        with EtcdCluster(3, fast=False) as cluster:
            return _adoption(ranks, per_host, unsaved, repeat, cluster.endpoints)
    return _adoption(ranks, per_host, unsaved, repeat)


def _adoption(ranks: int, per_host: int, unsaved: int, repeat: int,
              etcd: str | None = None) -> dict:
    runs = []
    for n in range(repeat):
        run_dir = f"{tempfile.mkdtemp(prefix='bench-relay-adoption-')}/run"
        lost = _coordinator(ranks, "relay", run_dir, Counter(), 4.0, 4.0, per_host)
        decision = lost.decision.to_json()
        lost.folder.release()
        reports = [_reattach(node, per_host, decision, unsaved).to_json()
                   for node in range(ranks // per_host)]
        pool = (ranks // per_host,)
        if etcd is not None:
            prefix = Keys(f"{JOB}-adoption-{n}").relay
            hosts = EtcdStore(etcd, timeout=30.0)
            for node, text in enumerate(reports):
                EtcdHost(hosts, prefix, node, groups=lambda: None).push(text)
            pool += (lambda store: EtcdCoordinator(EtcdStore(etcd, timeout=30.0), prefix,
                                                   groups=store),)
        config = LaunchConfig(nproc=ranks, run_dir=run_dir, checkpoint_every=0, lease=4.0,
                              take_over=True)
        t0, w0 = time.thread_time(), time.perf_counter()
        agent = Agent(config, None, claim(run_dir, False, False, True), HostPool, *pool)
        agent._start()
        agent.lib, agent.stages = lost.lib, STAGES
        if etcd is None:
            for text in reports:
                agent.store.queue_push(UP_QUEUE, text)
            t0, w0 = time.thread_time(), time.perf_counter()
        intake = _Timed(agent.mail.refresh)
        agent.mail.refresh = intake
        passes = 0
        while agent.phase is Phase.ADOPTING:
            agent._pass(time.time())
            passes += 1
        runs.append((time.thread_time() - t0, time.perf_counter() - w0, intake.cpu, passes))
        if etcd is not None:
            agent.mail.transport.close()  # its watch and reaper
    best = min(runs)
    return {"transport": "etcd" if etcd else "c10d", "ranks": ranks, "per_host": per_host,
            "unsaved_iterations": unsaved,
            "records": sum(len(HostReport.from_json(t).records) for t in reports),
            "report_bytes": sum(map(len, reports)), "adopted_cpu_s": best[0],
            "adopted_wall_s": best[1], "intake_cpu_s": best[2], "passes": best[3],
            "runs_cpu_s": [r[0] for r in runs], "runs_wall_s": [r[1] for r in runs],
            "command": " ".join(["python", *sys.argv])}


def _reattach(node: int, per_host: int, decision: str, unsaved: int) -> HostReport:
    """What host `node` sends a new leader: its journal, then its `Attach` (see `adoption`)."""
    ranks = range(node * per_host, (node + 1) * per_host)
    journal = Journal()
    journal.add(msg.HostUp(node, f"host{node}", 1000 + node, tuple(ranks)))
    for rank in ranks:
        journal.add(msg.Hello(rank, 0, 0, "stand-in", "lib", 0))
    for i, rank in itertools.product(range(unsaved), ranks):
        journal.add(msg.IterationDone(i, rank, 1, time.time()))
        if rank % STAGES == STAGES - 1:
            journal.add(msg.Losses(i, rank, 1, tuple(
                (rank // STAGES, m, 0.5) for m in range(MICROBATCHES))))
    attach = msg.Attach(node, 1, decision, tuple((rank, 0) for rank in ranks))
    return HostReport(node, 0, (*journal.records(), ("Attach", attach.to_json())))


class _Timed:
    """A call whose thread CPU seconds are added up (`cpu`)."""

    def __init__(self, call):
        self.call, self.cpu = call, 0.0

    def __call__(self, *args):
        t0 = time.thread_time()
        try:
            return self.call(*args)
        finally:
            self.cpu += time.thread_time() - t0


def _recoveries(args) -> None:
    if args.alone:
        rows = [alone(ranks, args.per_host) for ranks in args.ranks]
        for row in rows:
            print(json.dumps(row), flush=True)
        return _write(ALONE_RESULTS, rows, lambda row: (row["ranks"], row["per_host"]))
    if args.per_host % args.per_link or any(r % args.per_host for r in args.ranks):
        sys.exit("--per-link must divide --per-host, and --per-host every --ranks")
    rows, failed = [], []
    for ranks, repeat in itertools.product(args.ranks, range(args.repeat)):
        row = recover(ranks, args.per_host, args.per_link, args.seconds, args.iteration,
                      args.warmup, args.procs, args.lease, args.profile, args.transport)
        row.update(repeat=repeat, command=" ".join(["python", *sys.argv]))
        print(json.dumps(row), flush=True)
        if row["survivor_links_held"] < row["survivor_links"] or row["deaths_before_loss"] \
                or row["deaths_not_of_lost_host"] or row["decisions_of_it"] != 1:
            failed.append(ranks)  # the machine starved the stand-ins: nothing measured
        else:
            rows.append(row)
    _write(ETCD_RESULTS if args.transport == "etcd" else RECOVERY_RESULTS, rows,
           lambda row: (row.get("transport", "c10d"), row["ranks"], row["per_host"],
                        row["per_link"], row["lease"], row.get("repeat", 0)))
    if failed:
        sys.exit(f"not recorded: at {', '.join(map(str, failed))} ranks a survivor died or "
                 f"did not hold the next decision (the stand-ins starved: a longer --lease, "
                 f"a larger --per-host or fewer ranks)")


def _write(out: Path, rows: list[dict], key) -> None:
    """Write `rows` after the rows already in `out` that this run did not measure again
    (another `key`: size, mode, linger...): a run at 1,024 ranks keeps the 256-rank rows."""
    out.parent.mkdir(parents=True, exist_ok=True)
    new = {key(row) for row in rows}
    old = json.loads(out.read_text())["rows"] if out.is_file() else []
    rows = [row for row in old if key(row) not in new] + rows
    out.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
