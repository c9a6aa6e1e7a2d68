"""Data-plane failure cases on real worker processes: stage groups of three members, a silent
(SIGSTOPped) member, and (in the `nccl-sim` mode, gloo with NCCL's host semantics) the deaths
that gloo's blocking waits hide. Every run ends with the parameters and losses of the
single-process (fault-free) reference."""

import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

from recycle_planner.executor import LaunchConfig, launch, parse_fault  # noqa: E402
from helpers.executor_checks import (TINY, assert_losses_equal,  # noqa: E402
                                     assert_params_equal, checkpoint_params, library, reference)


def _events(result, kind):
    return [e for e in result.events if e["kind"] == kind]


def test_a_silent_member_of_a_three_member_group_is_released_within_the_lease(tmp_path):
    """2 stages x 3 pipelines: every stage group has three members. Worker 2:1 stops
    (SIGSTOP: its sockets stay open, nothing arrives) before its last weight gradient of
    iteration 2, so its two stage peers block in the gradient all-reduce on it; later worker
    2:0 stops the same way in iteration 4, with stage 0's three members. Each time the lease
    (1.5 s) expires, the launcher posts the abort, and both blocked peers are released at
    once, not at the 30 s group timeout (gloo's abort used to release only the member that
    aborted first in about half the runs)."""
    lib = library(tmp_path / "lib", stages=2, pipelines=3, microbatches=4, max_failures=2)
    args = ["--library", str(lib), "--iterations", "6"]
    faults = [parse_fault(f) for f in ("5:2:W3:hang", "4:4:W3:hang")]
    config = LaunchConfig(nproc=6, run_dir=str(tmp_path / "run"), faults=faults,
                          lease=1.5, heartbeat=0.1, pg_timeout=30.0)
    result = launch(TINY, config, args)
    assert result.status == "completed" and result.iterations == 6
    assert [g["dead"] for g in _events(result, "generation")] == [
        [], [[2, 1]], [[2, 0], [2, 1]]]
    assert [r["worker"] for r in result.recoveries] == ["2:1", "2:0"]
    assert all(r["seconds"] < 6 for r in result.recoveries), result.recoveries
    ref = reference(args[2:], 3, 4)
    _, params = checkpoint_params(tmp_path / "run", 2)
    assert_params_equal(params, ref.params)
    assert_losses_equal(result.losses, ref.losses)


def _blocked_member(rank: int, port: int, delay: float, out) -> None:
    """One member of a three-member gloo group whose member 2 stops: members 0 and 1 block
    in an all-reduce on it; each aborts after `delay` (as its abort notice arrives)."""
    import os
    import signal
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from recycle_planner.executor.data import comm

    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=timedelta(seconds=20))
    group = dist.ProcessGroupGloo(store, rank, 3, timedelta(seconds=20))
    group.barrier().wait()
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    work = group.allreduce([torch.ones(1000)])
    threading.Timer(delay, comm.BACKENDS["gloo"].abort, args=(group,)).start()
    t0 = time.monotonic()
    try:
        work.wait()
    except RuntimeError:
        pass
    out.put((rank, time.monotonic() - t0))
    out.close()
    out.join_thread()  # os._exit would drop what the queue's thread has not written yet
    os._exit(0)


def test_a_gloo_abort_releases_every_blocked_member_of_a_three_member_group():
    """Member 0 aborts first; member 1 aborts 0.3 s later, when its connection to member 0 is
    already closed (its first abort receive fails at once): it must still be released within
    milliseconds of its abort, not at the 20 s group timeout."""
    import multiprocessing
    import os
    import signal
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_blocked_member, args=(r, port, 0.2 + 0.3 * r, out))
             for r in range(3)]
    for p in procs:
        p.start()
    try:
        released = dict(out.get(timeout=60) for _ in range(2))
    finally:
        os.kill(procs[2].pid, signal.SIGKILL)
        for p in procs:
            p.join(timeout=30)
    assert released[0] < 1.0 and released[1] < 1.5, released
