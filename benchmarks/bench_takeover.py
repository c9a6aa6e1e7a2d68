"""A live takeover: from the leading coordinator's SIGKILL (or its link cut) to the next
leader's first pass with every host re-attached, and whether the workers paused meanwhile.

Usage: python benchmarks/bench_takeover.py [--lease SECONDS] [--repeat N] [--fault kill|cut]
[--logs DIR] (results in benchmarks/results/takeover-leaseL.json, -cut.json for --fault cut)
(root, etcd installed: hosts are network namespaces joined by veth pairs, a real 3-member etcd
and two `recycle-planner coordinator --rdzv-backend etcd` in the coordinator's namespace, as in
tests/test_control_failover_training.py).

2 hosts x 2 workers (2 stages x 2 pipelines), the tiny MLP of examples/tiny_mlp.py with 2 ms
of emulated device time per pass and a 25 ms data loader per micro-batch (about 0.1 s an
iteration), 150 iterations. At iteration 20 the leading coordinator's wrapper is SIGKILLed
(its coordinator dies with it), or with `--fault cut` (each coordinator then in a namespace of
its own) the leader's link is set down: nothing is closed, its calls hang, and it is deposed
once it finds its etcd lease lost. Every output line is stamped on arrival here, so the times
are on one clock: when each host agent noticed the loss, when the standby published its
store, when each host agent re-attached, and when the new coordinator adopted the generation
(its first pass with every host there). Whether the workers paused: the iterations they
completed between the kill and the adoption, and the longest gap between two iteration ends
around it against the run's median step (from the new coordinator's result.json).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import machine, read_stamped

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from bench_cluster import library  # noqa: E402
from helpers.netns import COORD_ADDR, IP, Hosts, unavailable  # noqa: E402

from recycle_planner.executor.control.etcd_local import EtcdCluster, etcd_missing  # noqa: E402
from recycle_planner.executor.control.runfolder import read_losses  # noqa: E402

TINY = f"{ROOT / 'examples' / 'tiny_mlp.py'}:make_job"
CLI = [sys.executable, "-m", "recycle_planner.cli"]
ITERATIONS = 150
KILL_AT = 20
JOB = ["--device-ms", "2,2,2", "--dtype", "float32", "--iterations", str(ITERATIONS),
       "--data-delay", "0.025"]


class Stamped:
    """A process's output, each line stamped with this process's clock on arrival (and
    copied to `log`)."""

    def __init__(self, net: Hosts, ns: str, cmd: list[str], log: Path, env: dict):
        self.lines: list[tuple[float, str]] = []
        self.proc = net.popen(ns, cmd, subprocess.PIPE, env=env)
        self.log = open(log, "w")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        read_stamped(self.proc.stdout, self.lines, self.log)

    def first(self, text: str) -> float | None:
        return next((t for t, line in list(self.lines) if text in line), None)


def run_once(lib: Path, work: Path, lease: float, fault: str = "kill") -> dict:
    run = work / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    cut = fault == "cut"
    with Hosts(4 if cut else 2) as net, EtcdCluster(
            3, host=COORD_ADDR, wrap=(IP, "netns", "exec", net.coord),
            folder=work / "etcd") as etcd:
        coords = {f"c{i}": Stamped(net, net.hosts[2 + i] if cut else net.coord, [
            *CLI, "coordinator", "--nnodes", "2", "--nproc-per-node", "2", "--port",
            str(29400 + i), "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints,
            "--rdzv-id", "bench", "--advertise", Hosts.address(2 + i) if cut else COORD_ADDR,
            "--run-dir", str(run), "--lease", str(lease), "--checkpoint-every", "50"],
            work / f"c{i}.log", env) for i in range(2)}
        hosts = [Stamped(net, ns, [
            *CLI, "launch", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(i),
            "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints, "--rdzv-id", "bench",
            "--rdzv-timeout", "120", TINY, "--", "--library", str(lib), *JOB],
            work / f"h{i}.log", dict(env, GLOO_SOCKET_IFNAME="eth0"))
            for i, ns in enumerate(net.hosts[:2])]
        deadline = time.time() + 300
        while KILL_AT not in read_losses(run):
            if time.time() > deadline:
                raise RuntimeError(f"training did not reach iteration {KILL_AT} (logs in {work})")
            time.sleep(0.01)
        leader = next(n for n, c in coords.items() if c.first("coordinator for") is not None)
        standby = coords["c1" if leader == "c0" else "c0"]
        killed = time.time()
        if cut:
            subprocess.run([IP, "-n", net.coord, "link", "set", f"vh{2 + int(leader[1])}",
                            "down"], check=True)
        else:
            os.kill(coords[leader].proc.pid, signal.SIGKILL)
        codes = [h.proc.wait(600) for h in hosts]
        standby.proc.wait(60)
    if codes != [0, 0]:
        raise RuntimeError(f"host agents exited {codes} (logs in {work})")
    result = json.loads((run / "result.json").read_text())
    adopted = standby.first("took over generation")
    event = next(e for e in result["events"] if e["kind"] == "take-over")
    t0 = adopted - event["t"]  # the new coordinator's clock zero on this clock
    ends = [t0 + e for e in result["iteration_end"] if e is not None]
    steps = [b - a for a, b in zip(ends, ends[1:])]
    around = [b - a for a, b in zip(ends, ends[1:]) if b >= killed - 1 and a <= adopted + 1]
    return {
        "noticed_s": [round(h.first("lost the coordinator") - killed, 3) for h in hosts],
        "published_s": round(standby.first("leads; its store is at") - killed, 3),
        "reattached_s": [round(h.first("re-attached") - killed, 3) for h in hosts],
        "adopted_s": round(adopted - killed, 3),
        "iterations_during": sum(1 for e in ends if killed <= e <= adopted),
        "longest_gap_around_s": round(max(around), 3) if around else None,
        "median_step_s": round(statistics.median(steps), 3),
        "generations": sum(1 for e in result["events"] if e["kind"] == "generation"),
        "completed": result["status"] == "completed" and result["iterations"] == ITERATIONS,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lease", type=float, default=4.0)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--fault", choices=("kill", "cut"), default="kill",
                        help="SIGKILL the leader's wrapper, or set its link down")
    parser.add_argument("--logs", type=Path, default=None, help="keep the logs here")
    opts = parser.parse_args()
    why = unavailable() or etcd_missing()
    if why:
        sys.exit(f"cannot run: {why}")
    print(f"machine: {machine()}; lease {opts.lease} s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = opts.logs or Path(tmp)
        lib = library(work / "lib")
        runs = []
        for n in range(opts.repeat):
            folder = work / f"run{n}"
            folder.mkdir(parents=True)
            runs.append(run_once(lib, folder, opts.lease, opts.fault))
            print(json.dumps(runs[-1]), flush=True)
    cut = "-cut" if opts.fault == "cut" else ""
    out = Path(__file__).parent / "results" / f"takeover-lease{opts.lease:g}{cut}.json"
    out.write_text(json.dumps({"machine": machine(), "lease": opts.lease,
                               "fault": opts.fault, "runs": runs}, indent=2) + "\n")
    print(f"written {out}")


if __name__ == "__main__":
    main()
