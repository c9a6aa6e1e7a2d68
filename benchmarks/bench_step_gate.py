"""The cost of the step gate per iteration (issue 23): `Comm.confirm_received` on a real group.

Usage: python benchmarks/bench_step_gate.py [--iterations N] [--receives K] [--mb X]
                                            [--backend gloo nccl-sim]

Two local processes form one generation's groups (`data/comm.py`'s `Comm`, as a worker does)
and run, per iteration, what a worker's gate confirms: K point-to-point messages each way (a
stage's activations or gradients, 64 KiB each) and one SUM all-reduce of a gradient bucket of
X MiB, each waited for as the runtime does. The gate itself is timed apart: everything it
confirms has already been waited for, so what it costs is asking each work whether it ended
well, synchronising the device (nothing on CPU) and reading the abort flag. On gloo the works
are complete when their wait returns; in nccl-sim a send's completion is its receiver's
acknowledgement (one store read per send). Printed: the median and 90th percentile of the
gate per iteration, and of the iteration without the gate, on rank 0.
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import time
from datetime import timedelta


def _worker(rank: int, port: int, backend: str, iterations: int, receives: int, mb: float,
            out) -> None:
    import torch
    import torch.distributed as dist

    from recycle_planner.executor.data.comm import Comm

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    comm = Comm(backend, store, 0, [0, 1], rank, [0, 1], 0, timedelta(seconds=60))
    peer = 1 - rank
    bucket = torch.ones(int(mb * 2 ** 20) // 4)
    sends = [torch.ones(16384) for _ in range(receives)]
    recvs = [torch.empty(16384) for _ in range(receives)]
    gate, rest = [], []
    for it in range(iterations):
        t0 = time.perf_counter()
        posted = [comm.irecv(recvs[k], peer, 2 * k + it % 2) for k in range(receives)]
        for k in range(receives):
            comm.isend(sends[k], peer, 2 * k + it % 2)
        for work in posted:
            comm.wait(work, "receive")
        work = comm.allreduce_start(bucket, "bucket")
        comm.wait(work, "bucket")
        t1 = time.perf_counter()
        comm.confirm_received("the iteration")
        t2 = time.perf_counter()
        comm.drain(60.0)  # the sends, so that the next iteration reuses nothing in flight
        gate.append(t2 - t1)
        rest.append(t1 - t0)
    if rank == 0:
        out.put((gate, rest))
    out.close()
    out.join_thread()
    comm.close()


def run(backend: str, iterations: int, receives: int, mb: float) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, backend, iterations, receives, mb, out))
             for r in range(2)]
    for p in procs:
        p.start()
    gate, rest = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    gate, rest = gate[5:], rest[5:]

    def q90(xs):
        return sorted(xs)[int(0.9 * (len(xs) - 1))]
    return {"backend": backend, "gate_us": 1e6 * statistics.median(gate),
            "gate_p90_us": 1e6 * q90(gate), "iteration_ms": 1e3 * statistics.median(rest)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--receives", type=int, default=8)
    parser.add_argument("--mb", type=float, default=4.0)
    parser.add_argument("--backend", nargs="+", default=["gloo", "nccl-sim"])
    args = parser.parse_args()
    print(f"{'backend':<10} {'gate median':>12} {'gate p90':>10} {'iteration w/o gate':>19}")
    for backend in args.backend:
        r = run(backend, args.iterations, args.receives, args.mb)
        print(f"{r['backend']:<10} {r['gate_us']:>9.1f} us {r['gate_p90_us']:>7.1f} us "
              f"{r['iteration_ms']:>16.2f} ms")


if __name__ == "__main__":
    main()
