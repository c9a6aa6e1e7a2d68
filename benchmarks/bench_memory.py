"""A worker's memory against the plan's: message buffers and peak resident memory (issue 23).

Usage: python benchmarks/bench_memory.py [--out DIR] [--microbatches M] [--iterations N]
                                         [--label NAME] [--reuse LABEL] [JOB ARGS...]

Trains the small GPT of examples/gpt_small.py (default: 2 stages x 2 pipelines, 16
micro-batches, a 2 MiB boundary message: --dim 256 --seq 256 --microbatch-size 8 --layers 1)
on local gloo processes, fault-free and with worker 1:0 killed in iteration 2 (its micro-batches
re-routed to worker 0:0 for the rest of the run), and reports per worker:

- the message buffers its last generation held at most (the worker's log: receive and send
  pools) against one buffer per sending op (what the send side kept before its pool);
- its peak resident memory (VmHWM, polled from /proc by this script, so that the same
  command measures any version of the executor: run it with PYTHONPATH set to an older
  checkout for the "before");
- the plan's memory for the worker's stage: static + the plan's most micro-batches in flight
  x activation, from the spec `recycle-planner profile` wrote (both bounds the plans keep to).

`--alone`: instead, each stage alone in this process (the runtime's handlers with the
profiler's loopback for the groups, one torch thread, M forwards then M input and weight
gradients, two iterations): resident memory over the process's baseline with all M
micro-batches in flight, against M x the profiled activation, which tells what the
profile misses from what several processes add.

Writes OUT/memory-LABEL.json. Compare two versions with the same plans (`--reuse`): the
plans' in-flight counts follow the profile's times, which vary from run to run.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from common import machine

from recycle_planner.job.spec import load_spec
from recycle_planner.library import PlanLibrary

ROOT = Path(__file__).resolve().parents[1]
JOB = "examples/gpt_small.py:make_job"
DEFAULT_JOB_ARGS = ["--dim", "256", "--seq", "256", "--microbatch-size", "8", "--layers", "1",
                    "--clip", "0", "--warmup", "0"]
KILL = "2:2:F0"  # rank 2 = worker 1:0 (2 stages), in iteration 2


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr.strip()[-2000:]}")


def _workers(root: int) -> dict[int, int]:
    """pid -> RANK of the worker processes below `root`."""
    out = {}
    for status in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmd = status.read_bytes().split(b"\0")
            if b"recycle_planner.executor" not in cmd:
                continue
            environ = (status.parent / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next((e[5:] for e in environ if e.startswith(b"RANK=")), None)
        if rank is not None and _descends(int(status.parent.name), root):
            out[int(status.parent.name)] = int(rank)
    return out


def _descends(pid: int, root: int) -> bool:
    for _ in range(16):
        if pid == root:
            return True
        try:
            pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def _hwm(pid: int) -> int | None:
    try:
        text = (Path("/proc") / str(pid) / "status").read_text()
    except OSError:
        return None
    m = re.search(r"VmHWM:\s+(\d+) kB", text)
    return int(m.group(1)) * 1024 if m else None


def launch(run_dir: Path, plans: Path, job_args: list[str], iterations: int,
           faults: list[str]) -> dict[int, int]:
    """Train; return each rank's peak resident memory (the largest over its incarnations)."""
    rp = str(Path(sys.executable).with_name("recycle-planner"))
    cmd = [rp, "launch", "-n", "4", "--backend", "gloo", "--lease", "60", "--run-dir", str(run_dir),
           *[x for f in faults for x in ("--inject-fault", f)], JOB, "--",
           "--library", str(plans), "--iterations", str(iterations), *job_args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    peaks: dict[int, int] = {}
    known: dict[int, int] = {}
    while proc.poll() is None:
        known.update(_workers(proc.pid))
        for pid, rank in known.items():
            hwm = _hwm(pid)
            if hwm is not None:
                peaks[rank] = max(peaks.get(rank, 0), hwm)
        time.sleep(0.2)
    if proc.returncode != 0:
        sys.exit(f"launch failed ({proc.returncode}): {proc.stderr.read().strip()[-2000:]}")
    return peaks


def buffers(run_dir: Path) -> dict[int, dict]:
    """Per rank, its last incarnation's buffer line (absent on an executor without pools)."""
    out = {}
    pattern = re.compile(r"message buffers: receive pool (\d+) \((\d+) bytes\), send pool "
                         r"(\d+) \((\d+) bytes\), sends per iteration (\d+)")
    for log in sorted(run_dir.glob("logs/**/rank*.log")):
        rank = int(log.name.split(".")[0][4:])
        found = pattern.findall(log.read_text())
        if found:
            r, rb, s, sb, n = map(int, found[-1])
            out[rank] = {"receive_pool": r, "receive_bytes": rb, "send_pool": s,
                         "send_bytes": sb, "sends_per_iteration": n}
    return out


def _rss(field: str = "VmRSS") -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) * 1024


def alone(job_args: list[str], microbatches: int) -> list[dict]:
    """Per stage, run alone (the module's docstring): resident memory over the baseline once
    every micro-batch is in flight (after the last forward) and at its high-water mark."""
    import threading

    import torch

    from recycle_planner.executor.data.runtime import (POST, RUN, SEND, Instr, Issue,
                                                       Program, StageRuntime)
    from recycle_planner.executor.data.state import StageState
    from recycle_planner.executor.faults import FaultInjector
    from recycle_planner.executor.job import load_job
    from recycle_planner.executor.profile import (ACT, GRAD, LoopbackComm, gradient_of_ones,
                                                  sent_layout, profile_stages)

    torch.set_num_threads(1)
    job = load_job(JOB, job_args)
    profiles = profile_stages(job, repeats=1, warmup=0, pipelines=2,
                              microbatches=microbatches)
    dev, S, out, sent, in_layout = torch.device("cpu"), len(job.stages), [], None, None
    for s in range(S):
        first, last = s == 0, s == S - 1
        module = job.build_stage(s)
        optimizer, scheduler = job.build_state(module)
        state = StageState(module, optimizer, scheduler=scheduler)
        comm = LoopbackComm(2 * S, True, dev)
        out_layout = None if last else sent_layout(job, module, (0, 0, 0), in_layout, sent,
                                                      dev, None)
        comm.inbox[ACT] = sent
        if not last:
            comm.inbox[GRAD] = gradient_of_ones(out_layout.grads(), dev)
        runtime = StageRuntime(state, job.loss_fn, job.data, s, S, 2, microbatches, dev,
                               in_layout, out_layout, None, job.autocast_dtype())
        runtime.comm = comm
        up, down = (None if first else 0), (None if last else 0)
        instrs = [Instr("F", 0, m, up, (ACT, ACT), down, (ACT, ACT), f"F{m}")
                  for m in range(microbatches)]
        for m in range(microbatches):
            instrs += [Instr("I", 0, m, down, (GRAD, GRAD), up, (GRAD, GRAD), f"I{m}"),
                       Instr("W", 0, m, None, (0, 0), None, (0, 0), f"W{m}")]
        instrs += [Instr(k, 0, None, None, (0, 0), None, (0, 0), k.lower())
                   for k in ("ALLREDUCE", "OPTIMIZER")]
        issues = []
        for k, ins in enumerate(instrs):
            issues += [Issue(POST, k)] * (ins.src is not None) + [Issue(RUN, k)] + \
                [Issue(SEND, k)] * (ins.dst is not None)
        program = Program(tuple(instrs), tuple(issues), 0, True, 3 * microbatches - 1)
        base, after_forwards = _fresh(), []
        forward = runtime.handlers["F"]

        def counted(k, ins, it, forward=forward):
            forward(k, ins, it)
            if k == microbatches - 1:
                after_forwards.append(_rss() - base)
        runtime.handlers["F"] = counted
        for it in range(2):
            runtime.run_iteration(program, it, threading.Event(),
                                  FaultInjector([], 0, 0, print))
        out.append({"stage": s, "profiled_activation_bytes": profiles[s].activation,
                    "all_in_flight_bytes": max(after_forwards),
                    "high_water_bytes": _rss("VmHWM") - base,
                    "planned_bytes": microbatches * profiles[s].activation})
        sent, in_layout = comm.outbox.get(ACT), out_layout
        del runtime, state, module, optimizer, scheduler, counted, forward
    return out


def _fresh() -> int:
    """The resident memory once freed memory went back to the system (glibc keeps it: the
    previous stage's would be reused unseen) and the high-water mark reset to it."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return _rss()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/bench-memory")
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--label", default="after")
    parser.add_argument("--alone", action="store_true", help="each stage alone in this "
                        "process (the module's docstring)")
    parser.add_argument("--reuse", metavar="LABEL", help="train with the spec and plans an "
                        "earlier run with this label wrote in OUT (the same plans for both "
                        "versions: a new profile can plan other in-flight counts)")
    args, job_args = parser.parse_known_args()
    job_args = job_args or DEFAULT_JOB_ARGS
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.alone:
        stages = alone(job_args, args.microbatches)
        path = out / f"alone-{args.label}.json"
        path.write_text(json.dumps({"machine": machine(), "job_args": job_args,
                                    "microbatches": args.microbatches, "stages": stages},
                                   indent=2) + "\n")
        for st in stages:
            print(f"stage {st['stage']}: {args.microbatches} in flight "
                  f"{st['all_in_flight_bytes'] / 2**20:.0f} MiB over the baseline (high water "
                  f"{st['high_water_bytes'] / 2**20:.0f} MiB), planned "
                  f"{st['planned_bytes'] / 2**20:.0f} MiB")
        print(f"written {path}")
        return
    rp = str(Path(sys.executable).with_name("recycle-planner"))
    spec = out / f"gpt-{args.reuse or args.label}.toml"
    plans = out / f"plans-{args.reuse or args.label}"
    if not args.reuse:
        _run([rp, "profile", JOB, "-d", "2", "-m", str(args.microbatches), "-o", str(spec),
              "--repeats", "3", "--p2p", "0.1", "--allreduce", "0.1", "--", *job_args])
        _run([rp, "plan-all", str(spec), "-f", "1", "--force", "-o", str(plans)])
    static, activation = load_spec(spec).memory.static, load_spec(spec).memory.activation
    report = {"machine": machine(), "job_args": job_args, "microbatches": args.microbatches,
              "runs": {}}
    for name, faults, dead in (("fault-free", [], []), ("worker 1:0 killed", [KILL], [(1, 0)])):
        run_dir = out / f"run-{args.label}-{name.split()[0]}"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        peaks = launch(run_dir, plans, job_args, args.iterations, faults)
        bufs = buffers(run_dir)
        inflight = PlanLibrary.open(plans).lookup(dead).plan().metrics.peak_inflight
        report["runs"][name] = {
            str(rank): {"stage": rank % 2, "max_rss_bytes": peaks.get(rank),
                        "plan_bytes": static[rank % 2] + inflight * activation[rank % 2],
                        **bufs.get(rank, {})}
            for rank in range(4)}
    path = out / f"memory-{args.label}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    for name, ranks in report["runs"].items():
        for rank, r in ranks.items():
            pools = (f"send pool {r['send_pool']} for {r['sends_per_iteration']} sends, "
                     f"receive pool {r['receive_pool']}") if "send_pool" in r else "no pools"
            rss = r["max_rss_bytes"]
            print(f"{name:18} rank {rank}: {pools}; max RSS "
                  f"{'?' if rss is None else f'{rss / 2**20:.0f} MiB'}, plan "
                  f"{r['plan_bytes'] / 2**20:.1f} MiB")
    print(f"written {path}")


if __name__ == "__main__":
    main()
