"""The cluster runtime's recovery times: from a fault to the next completed iteration.

Usage: python benchmarks/bench_cluster.py [--lease SECONDS] [--repeat N] [--only CASE ...]
(root: hosts are network namespaces joined by veth pairs, as in tests/test_cluster.py).

A coordinator in its own namespace and 2 hosts x 2 workers (2 stages x 2 pipelines, host h
holds pipeline h), the tiny MLP of examples/tiny_mlp.py with 2 ms of emulated device time per
pass, 30 iterations, default settings (lease 4 s, heartbeat 0.2 s). At iteration 10 a worker's
injected fault takes away: its host's link (`host-down`), every process of its host
(`host-stop`: SIGSTOP), host 0, the first started (`host-kill`: SIGKILL of agent and workers),
one worker process (`kill`), or its training thread only (`stall`, heartbeats go on). The
figure is the coordinator's: from the fault (the time the worker wrote just before it) to the
end of the first iteration completed after it everywhere. `coordinator` kills the coordinator
at iteration 10 and measures until every host agent has exited with a complete checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import machine

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers.netns import COORD_ADDR, Hosts, unavailable  # noqa: E402

from recycle_planner.executor.data.state import latest_checkpoint  # noqa: E402
from recycle_planner.library import Settings, build_library  # noqa: E402
from recycle_planner.job.policy import Policy  # noqa: E402
from recycle_planner.job.spec import JobSpec  # noqa: E402

TINY = f"{ROOT / 'examples' / 'tiny_mlp.py'}:make_job"
CLI = [sys.executable, "-m", "recycle_planner.cli"]
JOB = ["--device-ms", "2,2,2", "--dtype", "float32", "--iterations", "30"]
CASES = {
    "host-down": "2:10:F1:host-down",
    "host-stop": "2:10:F1:host-stop",
    "host-kill": "0:10:F1:host-kill",
    "kill": "2:10:F1:kill",
    "stall": "2:10:F1:stall",
    "coordinator": None,
}


def library(folder: Path) -> Path:
    spec = JobSpec.from_dict({"stages": 2, "pipelines": 2, "microbatches": 4,
                              "time": {"forward": 2, "backward_input": 2, "backward_weight": 2,
                                       "p2p": 0.05, "allreduce": 0.4, "optimizer": 0.2}})
    build_library(spec, Policy(), 2, folder, Settings(solver="heuristic"), jobs=1)
    return folder


def run_case(case: str, lib: Path, work: Path, lease: float) -> dict:
    run = work / "run"
    log_path = work / "out.log"
    extra = ["--inject-fault", CASES[case]] if CASES[case] else ["--checkpoint-every", "5"]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0")
    with open(log_path, "wb") as log, Hosts(2) as net:
        coord = net.popen(net.coord, [*CLI, "coordinator", "--nnodes", "2", "--nproc-per-node",
                                      "2", "--run-dir", str(run), "--lease", str(lease),
                                      *extra], log)
        agents = [net.popen(ns, [*CLI, "launch", "--nnodes", "2", "--nproc-per-node", "2",
                                 "--node-rank", str(i), "--rdzv-endpoint",
                                 f"{COORD_ADDR}:29400", TINY, "--", "--library", str(lib),
                                 *JOB], log, env=env)
                  for i, ns in enumerate(net.hosts)]
        if case == "coordinator":
            deadline = time.time() + 300
            while not (run / "checkpoints" / "iter-000010" / "manifest.json").is_file():
                if time.time() > deadline or coord.poll() is not None:
                    raise SystemExit(log_path.read_text()[-3000:])
                time.sleep(0.01)
            t0 = time.time()
            coord.kill()
            codes = [a.wait(timeout=120) for a in agents]
            found = latest_checkpoint(run)
            return {"seconds": time.time() - t0, "codes": codes,
                    "checkpoint": found[0] if found else None}
        code = coord.wait(timeout=600)
    if code != 0:
        raise SystemExit(f"{case}: coordinator exited with {code}:\n"
                         + log_path.read_text()[-3000:])
    result = json.loads((run / "result.json").read_text())
    first = result["recoveries"][0]
    return {"seconds": first["seconds"], "replanned_after": first["replanned_after"],
            "dead": [e["dead"] for e in result["events"] if e["kind"] == "generation"][-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lease", type=float, default=4.0)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--only", nargs="*", choices=sorted(CASES), default=list(CASES))
    opts = parser.parse_args()
    why = unavailable()
    if why:
        raise SystemExit(f"cannot make hosts here: {why}")
    with tempfile.TemporaryDirectory() as tmp:
        lib = library(Path(tmp) / "lib")
        print(f"machine: {machine()}; lease {opts.lease} s", flush=True)
        print("| case | fault | fault to next completed iteration (s) | fault to new plan (s) "
              "| dead after |")
        print("| --- | --- | ---: | ---: | --- |")
        for case in opts.only:
            runs = []
            for r in range(opts.repeat):
                work = Path(tmp) / f"{case}-{r}"
                work.mkdir()
                runs.append(run_case(case, lib, work, opts.lease))
            seconds = statistics.median(x["seconds"] for x in runs)
            if case == "coordinator":
                print(f"| coordinator | SIGKILL of the coordinator at iteration 10 | "
                      f"{seconds:.2f} (until both host agents exited, status "
                      f"{runs[0]['codes']}, checkpoint of iteration {runs[0]['checkpoint']}) "
                      f"| | |", flush=True)
                continue
            replanned = statistics.median(x["replanned_after"] for x in runs)
            print(f"| {case} | {CASES[case]} | {seconds:.3f} | {replanned:.3f} | "
                  f"{runs[0]['dead']} |", flush=True)


if __name__ == "__main__":
    main()
