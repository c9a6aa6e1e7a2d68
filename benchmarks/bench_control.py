"""The cluster control plane at 1,024 and 8,192 ranks, by simulation on this machine.

A real 3-member etcd (on loopback), two real coordinators (`failover.stand_by_or_lead`: the
election, `plane.Leader` and `protocol.decide`) and one stand-in host agent per 8 ranks: a real
`plane.HostMember` (its lease, its host key, its watch, its answers to aborts) whose workers are
replaced by a step count. The stand-ins run as threads in a few processes. Measured, per size:

- control operations per second in steady state (every request the stand-ins and the
  coordinators send to etcd, counted by etcd itself: its gRPC messages received); in steady
  state that is lease renewals only, one per host and coordinator per third of the lease;
- a host lost (its agent stops renewing, as when it vanishes): the time from the loss to every
  surviving host holding the next decision;
- the leading coordinator SIGKILLed together with a host: from then to every survivor holding
  the next decision (made by the coordinator that took over).

The plan lookup is a stand-in that names the dead set (a library lookup is one index read: see
bench_ondemand.py); everything else is the product's code.

    python bench_control.py                  # 1,024 and 8,192 ranks, lease 4 s
    python bench_control.py --ranks 1024 --lease 2
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import machine  # noqa: E402

from recycle_planner.executor.config import WorkerConfig  # noqa: E402
from recycle_planner.executor.control.election import Election  # noqa: E402
from recycle_planner.executor.control.etcd_local import EtcdCluster  # noqa: E402
from recycle_planner.executor.control.failover import stand_by_or_lead  # noqa: E402
from recycle_planner.executor.control.plane import HostMember, HostRecord, Keys  # noqa: E402
from recycle_planner.executor.control.store import (EtcdStore, StoreRefused,  # noqa: E402
                                                    StoreUnavailable)

PER_HOST = 8          # ranks per host: one whole pipeline of 8 stages
STAGES = 8
RESULTS = Path(__file__).resolve().parent / "results" / "control.json"


class LeanEtcdStore(EtcdStore):
    """`EtcdStore` whose requests go over one kept-open `http.client` connection per thread
    instead of `requests` (etcd3gw's transport): the same JSON gateway calls, about 0.35 ms of
    client CPU each instead of 1.5 ms. Used for the stand-in hosts only, so that 2 cores can
    carry the client side of 1,024 hosts; a real host agent has a host's CPU to itself."""

    def __init__(self, endpoints: str, timeout: float):
        super().__init__(endpoints, timeout)
        self._conns = threading.local()

    def _post(self, path: str, body: dict) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            host, port = self.endpoints[self._current % len(self.endpoints)]
            conn = getattr(self._conns, "conn", None)
            if conn is None or (conn.host, conn.port) != (host, port):
                conn = http.client.HTTPConnection(host, port, timeout=self.timeout / 2)
                self._conns.conn = conn
            try:
                conn.request("POST", "/v3" + path, json.dumps(body),
                             {"Content-Type": "application/json"})
                response = conn.getresponse()
                data = json.loads(response.read() or b"{}")
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                self._conns.conn = None
                self._rotate()
                if time.monotonic() > deadline:
                    raise StoreUnavailable(f"etcd: {exc}") from None
                continue
            if response.status == 200:
                return data
            message = data.get("error") or data.get("message") or response.reason
            if response.status >= 500 and time.monotonic() < deadline:
                self._rotate()
                continue
            raise (StoreUnavailable if response.status >= 500 else StoreRefused)(
                f"etcd: {message}")


def lookup(dead):
    """Stand-in for the plan library: names the dead set."""
    return f"plan-{len(dead)}-dead", 0.0


# -- a coordinator process ---------------------------------------------------------------------

def coordinator(args) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    store = EtcdStore(args.etcd, timeout=max(2.0, args.lease))
    stand_by_or_lead(store, Keys(args.job), args.name, args.lease, args.pipelines, STAGES,
                     lookup, stop,
                     on_lead=lambda rev: print(f"leading {time.time()}", flush=True),
                     on_decision=lambda d: print(f"decision {d.gen} {time.time()}",
                                                 flush=True))


# -- a process of stand-in host agents ---------------------------------------------------------

def hosts_process(conn, endpoints: str, job: str, nodes: list[int], lease: float) -> None:
    keys = Keys(job)
    held: dict[int, dict[int, float]] = {}          # node -> gen -> when it held it
    step = [100]  # every rank's step count (the restart iteration of every decision)
    members: dict[int, HostMember] = {}

    def start(node):
        store = LeanEtcdStore(endpoints, timeout=max(5.0, lease))
        ranks = tuple(range(node * PER_HOST, (node + 1) * PER_HOST))
        held[node] = {}
        for attempt in range(3):  # a loaded etcd may time a first request out
            try:
                members[node] = HostMember(
                    store, keys, HostRecord(node, f"host{node}", ranks), lease,
                    lambda: {r: step[0] for r in ranks},
                    on_decision=lambda d, node=node: held[node].setdefault(d.gen, time.time()))
                return
            except (StoreUnavailable, StoreRefused):  # refused: its lease ran out meanwhile
                if attempt == 2:
                    raise

    with ThreadPoolExecutor(2) as pool:  # a host's first lease must not expire while others start
        list(pool.map(start, nodes))
    conn.send("up")
    while True:
        try:
            command, arg = conn.recv()
        except EOFError:  # the benchmark is gone: so are we
            command, arg = "stop", None
        if command == "held":   # who of the live members holds generation `arg`, and when
            conn.send({n: held[n].get(arg) for n, m in members.items()
                       if not m._closed.is_set()})
        elif command == "false losses":  # live hosts whose lease ran out under the load
            conn.send(sum(m.lost is not None for m in members.values()
                          if not m._closed.is_set()))
        elif command == "lose":
            t = time.time()
            members[arg].close(leave=False)
            conn.send(t)
        elif command == "stop":
            for m in members.values():
                if not m._closed.is_set():
                    m.close()
            try:
                conn.send("stopped")
            except OSError:
                pass
            return


# -- the run -----------------------------------------------------------------------------------

def etcd_messages(cluster: EtcdCluster) -> float:
    """Every gRPC message etcd's members received (the gateway's requests included)."""
    total = 0.0
    for port in cluster.client_ports:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        except OSError:
            continue
        for line in text.decode().splitlines():
            if line.startswith("grpc_server_msg_received_total"):
                total += float(line.rsplit(" ", 1)[1])
    return total


class Run:
    def __init__(self, ranks: int, lease: float, procs: int, logs: Path | None = None):
        self.logs = logs
        self.ranks, self.lease = ranks, lease
        self.hosts = ranks // PER_HOST
        self.job = f"bench{ranks}"
        self.keys = Keys(self.job)
        self.coords: dict[str, subprocess.Popen] = {}
        self.lines: dict[str, list[str]] = {}
        self.conns, self.procs = [], []
        self.cluster = EtcdCluster(3, fast=False, quiet=logs is None,
                                   folder=logs / "etcd" if logs else None).__enter__()
        self.store = EtcdStore(self.cluster.endpoints, timeout=max(5.0, lease))
        try:
            self._start(procs)
        except BaseException:
            self.close()
            raise

    def _start(self, procs: int) -> None:
        lease = self.lease
        for name in ("c0", "c1"):
            self._coordinator(name)
        ctx = mp.get_context("fork")
        chunks = [list(range(self.hosts))[i::procs] for i in range(procs)]
        for chunk in chunks:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=hosts_process, args=(child, self.cluster.endpoints,
                                                           self.job, chunk, lease),
                               daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.owner = {n: i for i, chunk in enumerate(chunks) for n in chunk}
        deadline = time.time() + 600
        for conn, proc in zip(self.conns, self.procs):
            while not conn.poll(1):
                if not proc.is_alive() or time.time() > deadline:
                    raise RuntimeError("a process of stand-in hosts failed to start")
            assert conn.recv() == "up"

    def _coordinator(self, name: str) -> None:
        proc = subprocess.Popen([sys.executable, __file__, "coordinator", "--etcd",
                                 self.cluster.endpoints, "--job", self.job, "--name", name,
                                 "--pipelines", str(self.hosts), "--lease", str(self.lease)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=open(self.logs / f"{name}.log", "w") if self.logs
                                else subprocess.DEVNULL, text=True)  # stdin: ends with us
        self.coords[name] = proc
        self.lines[name] = []
        threading.Thread(target=lambda: [self.lines[name].append(x.strip())
                                         for x in proc.stdout], daemon=True).start()

    def held(self, gen: int) -> dict[int, float | None]:
        out: dict[int, float | None] = {}
        for conn in self.conns:
            conn.send(("held", gen))
        for conn in self.conns:
            out.update(conn.recv())
        return out

    def wait_held(self, gen: int, timeout: float) -> dict[int, float]:
        deadline = time.time() + timeout
        while True:
            got = self.held(gen)
            if all(t is not None for t in got.values()):
                return got
            if time.time() > deadline:
                missing = sum(t is None for t in got.values())
                raise RuntimeError(f"{missing} of {len(got)} hosts lack generation {gen}")
            time.sleep(0.2)

    def false_losses(self) -> int:
        for conn in self.conns:
            conn.send(("false losses", None))
        return sum(conn.recv() for conn in self.conns)

    def lose(self, node: int) -> float:
        conn = self.conns[self.owner[node]]
        conn.send(("lose", node))
        return conn.recv()

    def leader(self) -> str:
        entry = Election(self.store, self.keys.election, "bench", self.lease).leader()
        return entry.value

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            try:
                conn.send(("stop", None))
                conn.recv()
            except (EOFError, OSError):
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        for proc in self.coords.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)
        self.store.close()
        self.cluster.__exit__(None, None, None)


def expiry(watch, timeout: float) -> float:
    """When the lost host's key was deleted by etcd (its lease ran out), as this process saw
    it."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        event = watch.get(deadline - time.time())
        if event is not None and event.kind == "delete":
            watch.cancel()
            return time.time()
    raise RuntimeError("the lost host's lease did not expire")


def measure(ranks: int, lease: float, window: float, procs: int,
            logs: Path | None) -> dict:
    t0 = time.time()
    run = Run(ranks, lease, procs, logs)
    try:
        started = time.time() - t0
        first = run.wait_held(1, 120)
        print(f"{ranks} ranks: {run.hosts} hosts up and holding generation 1 "
              f"{max(first.values()) - t0:.1f} s after the start", flush=True)
        time.sleep(lease)                       # steady state: no aborts in flight
        m0, w0 = etcd_messages(run.cluster), time.time()
        time.sleep(window)
        ops = (etcd_messages(run.cluster) - m0) / (time.time() - w0)

        lost = run.hosts - 1
        watch = run.store.watch(run.keys.host(lost), run.store.revision() + 1)
        t_loss = run.lose(lost)
        t_expired = expiry(watch, 3 * lease)
        got = run.wait_held(2, 10 * lease + 60)
        host_loss = max(got.values()) - t_loss
        after_expiry = max(got.values()) - t_expired
        spread = max(got.values()) - min(got.values())

        time.sleep(lease)
        old = run.leader()
        t_kill = time.time()
        run.coords[old].kill()
        run.lose(lost - 1)
        got = run.wait_held(3, 10 * lease + 60)
        leader_loss = max(got.values()) - t_kill
        new = run.leader()
        assert new != old
        return {"ranks": ranks, "hosts": run.hosts, "lease_s": lease,
                "start_s": round(started, 1), "ops_per_s": round(ops),
                "ops_per_host_s": round(ops / run.hosts, 2),
                "host_loss_to_all_hold_s": round(host_loss, 2),
                "lease_expiry_to_all_hold_s": round(after_expiry, 2),
                "decision_spread_s": round(spread, 2),
                "leader_loss_to_all_hold_s": round(leader_loss, 2),
                "false_losses": run.false_losses(),
                "decisions": {n: [x for x in lines if x.startswith("decision")]
                              for n, lines in run.lines.items()}}
    finally:
        run.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    c = sub.add_parser("coordinator")
    for flag in ("--etcd", "--job", "--name"):
        c.add_argument(flag, required=True)
    c.add_argument("--pipelines", type=int, required=True)
    c.add_argument("--lease", type=float, required=True)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--lease", type=float, default=WorkerConfig.lease,
                        help="seconds (default: the executor's lease, %(default)s)")
    parser.add_argument("--window", type=float, default=10.0,
                        help="seconds of steady state measured")
    parser.add_argument("--procs", type=int, default=4, help="processes of stand-in hosts")
    parser.add_argument("--logs", type=Path, help="keep etcd's and the coordinators' logs here")
    args = parser.parse_args()
    if args.command == "coordinator":
        return coordinator(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop etcd and the stand-ins too
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
        logging.basicConfig(level=logging.INFO)
    rows = [measure(r, args.lease, args.window, args.procs, args.logs)
            for r in args.ranks]
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k != "decisions"}), flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    kept = json.loads(RESULTS.read_text())["rows"] if RESULTS.exists() else []
    ran = {(r["ranks"], r["lease_s"]) for r in rows}
    rows = [r for r in kept if (r["ranks"], r["lease_s"]) not in ran] + rows
    RESULTS.write_text(json.dumps({"machine": machine(), "load": os.getloadavg(),
                                   "rows": rows}, indent=1))
    print(f"median ops/host/s: {statistics.median(r['ops_per_host_s'] for r in rows)}; "
          f"written to {RESULTS}")


if __name__ == "__main__":
    main()
