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
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import multiprocessing as mp
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
from recycle_planner.executor.control.link import HostLink, StoreLink  # noqa: E402
from recycle_planner.executor.control.mail import StoreMail  # noqa: E402
from recycle_planner.executor.control.pool import HostPool  # noqa: E402
from recycle_planner.executor.control.protocol import Decision  # noqa: E402
from recycle_planner.executor.control.relay import Relay  # noqa: E402
from recycle_planner.executor.control.runfolder import claim  # noqa: E402

PER_HOST = 8
STAGES = 8
MICROBATCHES = 16
RESULTS = Path(__file__).resolve().parent / "results" / "relay.json"
MEMORY_RESULTS = Path(__file__).resolve().parent / "results" / "relay-memory.json"


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


class _Lib:
    def __init__(self, spec: _Spec):
        self.spec = spec


class _StorePool(HostPool):
    """Issue 22's coordinator: the same pool, every record read under its own key."""

    def mail(self, store):
        return StoreMail(store)


def _coordinator(ranks: int, mode: str, run_dir: str, counter: Counter, lease: float,
                 linger: float) -> Agent:
    config = LaunchConfig(nproc=ranks, run_dir=run_dir, checkpoint_every=0, lease=lease)
    folder = claim(run_dir, False, False)
    pool = _StorePool if mode == "store" else HostPool
    agent = Agent(config, None, folder, pool, ranks // PER_HOST)
    agent.store = Counting(agent.store, counter.counts["coordinator"])
    agent.mail.store = agent.store
    agent._start()
    pipelines = ranks // STAGES
    agent.lib, agent.stages = _Lib(_Spec(pipelines, STAGES, MICROBATCHES)), STAGES
    agent.gen, agent.phase = 1, Phase.RUNNING
    agent.decision = Decision(gen=1, action="run", members=tuple(range(ranks)), dead=(),
                              restart=0, incarnations={r: 0 for r in range(ranks)})
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
        def _connect(self, host, p, timeout):
            return _client(p, timeout, counter.counts["workers"])

    with ThreadPoolExecutor(32) as pool:
        return list(pool.map(lambda _: CountedStoreLink("127.0.0.1", port, 60.0, lease, 0.2,
                                                        0.002), ranks))


def _relays(port: int, nodes: list[int], counter: Counter, folder: str,
            lease: float) -> list[Relay]:
    def relay(node: int) -> Relay:
        relay = Relay(_client(port, 60.0, counter.counts["hosts"]),
                      _client(port, lease, counter.counts["hosts"]), node,
                      f"{folder}/r{node}.sock", lease, 0.2)
        relay.report(msg.HostUp(node, f"host{node}", 0, tuple(
            range(node * PER_HOST, (node + 1) * PER_HOST))))
        return relay

    with ThreadPoolExecutor(32) as pool:
        return list(pool.map(relay, nodes))


def _stand_ins(mode: str, port: int, nodes: list[int], folder: str, iteration: float,
               lease: float, conn) -> None:
    """A process of stand-in hosts `nodes` (8 ranks each): their workers' links (and in
    relay mode their host agents' relays); answers "read" with its counts until "stop"."""
    counter = Counter()
    stop = threading.Event()
    ranks = [n * PER_HOST + i for n in nodes for i in range(PER_HOST)]
    relays = []
    if mode == "store":
        links = _store_links(port, ranks, counter, lease)
    else:
        relays = _relays(port, nodes, counter, folder, lease)
        by_node = {r.node: r for r in relays}

        def step_relays():
            while not stop.is_set():
                for relay in relays:
                    relay.step()
                time.sleep(0.02)  # the host agent's poll

        stepper = threading.Thread(target=step_relays, daemon=True)
        stepper.start()
        links = [HostLink(by_node[rank // PER_HOST].path, rank, 0, ("127.0.0.1", port), 60.0,
                          0.2, lease) for rank in ranks]
    for rank, link in zip(ranks, links):
        link.watch(lambda r=rank: msg.Heartbeat(r, 0, time.time()), lambda: 1,
                   lambda gen, reason: None)
        link.send(msg.Hello(rank, 0, 0, "stand-in", "lib", 0))

    def train():
        i = 0
        while not stop.is_set():
            for rank, link in zip(ranks, links):
                link.send(msg.IterationDone(i, rank, 1, time.time()))
                if rank % STAGES == STAGES - 1:  # its own pipeline's (a worker sends all D*M)
                    link.send(msg.Losses(i, rank, 1, tuple(
                        (rank // STAGES, m, 0.5) for m in range(MICROBATCHES))))
            i += 1
            stop.wait(iteration)

    threading.Thread(target=train, daemon=True).start()
    conn.send("ready")
    while conn.recv() == "read":
        conn.send(counter.read())
    stop.set()
    for link in links:
        link.close()
    if relays:
        stepper.join(30)  # a relay closed under a step would raise in it
    for relay in relays:
        relay.close()
    conn.send("stopped")


def measure(ranks: int, mode: str, seconds: float, iteration: float, warmup: float,
            procs: int, lease: float, linger: float | None = None) -> dict:
    counter = Counter()
    folder = tempfile.mkdtemp(prefix="bench-relay-")
    linger = lease if linger is None else linger
    agent = _coordinator(ranks, mode, f"{folder}/run", counter, lease, linger)
    context = mp.get_context("spawn")  # a forked child could inherit a lock held by c10d
    hosts = list(range(ranks // PER_HOST))
    children = []
    for k in range(procs):
        ours, theirs = context.Pipe()
        proc = context.Process(target=_stand_ins, args=(mode, agent.port, hosts[k::procs],
                                                        folder, iteration, lease, theirs),
                               daemon=True)
        proc.start()
        children.append((proc, ours))
    for _, conn in children:  # the coordinator's passes go on meanwhile (hellos, reports)
        while not conn.poll(0.02):
            agent._pass(time.time())
        conn.recv()

    def read() -> dict[str, int]:
        total = counter.read()
        for _, conn in children:
            conn.send("read")
            for side, n in conn.recv().items():
                total[side] += n
        return total

    passes: list[float] = []
    t_end = time.time() + warmup + seconds
    start = None
    while time.time() < t_end:
        now = time.time()
        if start is None and now >= t_end - seconds:
            start, counts0, passes = now, read(), []
            memory0 = (_held(agent), _rss_mb(), agent.iterations.next_loss)
        t0 = time.perf_counter()
        agent._pass(now)
        passes.append(time.perf_counter() - t0)
        time.sleep(agent.config.idle_poll)
    counts1 = read()
    elapsed = time.time() - start
    memory1 = (_held(agent), _rss_mb(), agent.iterations.next_loss)
    for proc, conn in children:
        conn.send("stop")
        conn.recv()
        proc.join(30)
    hellos = sum(1 for p in agent.procs.values() if p.hello is not None)
    # each read counts one on every counter of the coordinator and of each process
    rates = {side: (counts1[side] - counts0[side] - 1 - procs) / elapsed for side in counts1}
    return {"mode": mode, "ranks": ranks, "hosts": ranks // PER_HOST, "processes": procs,
            "lease": lease,
            "seconds": elapsed, "ops_per_s": rates, "total_ops_per_s": sum(rates.values()),
            "coordinator_pass_ms": {"median": 1e3 * statistics.median(passes),
                                    "max": 1e3 * max(passes)},
            "passes_per_s": len(passes) / elapsed, "hellos_seen": hellos,
            "deaths": len(agent.deaths), "linger": linger if linger < float("inf") else None,
            "memory": {"records_start": memory0[0], "records_end": memory1[0],
                       "rss_mb_start": memory0[1], "rss_mb_end": memory1[1],
                       "iterations_saved_start": memory0[2],
                       "iterations_saved_end": memory1[2],
                       "iterations_held_end": memory1[2] - agent.iterations.retired}}


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
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for ranks in args.ranks:
        for mode in (["store", "relay"] if args.mode == "both" else [args.mode]):
            for linger in ([float("inf"), args.lease] if args.memory else [args.lease]):
                row = measure(ranks, mode, args.seconds, args.iteration, args.warmup,
                              args.procs, args.lease, linger)
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = MEMORY_RESULTS if args.memory else RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = _merged(out, rows, args.memory)
    out.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))


def _merged(out: Path, rows: list[dict], memory: bool) -> list[dict]:
    """The rows already in `out` that this run did not measure again (another size or
    mode; in the memory file also another linger), then this run's: a run at 1,024 ranks
    keeps the table's 256-rank rows."""
    def key(row):
        return row["mode"], row["ranks"], row.get("linger") if memory else None

    new = {key(row) for row in rows}
    old = json.loads(out.read_text())["rows"] if out.is_file() else []
    return [row for row in old if key(row) not in new] + rows


if __name__ == "__main__":
    main()
