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
    return [e.to_json() for e in result.events if e.kind == kind]


BACKENDS = ["gloo", "nccl-sim"]
"""The three-member group cases run on gloo (whose abort had the hole) and on gloo with NCCL's
host semantics (`data/nccl_sim.py`); the cases that only NCCL's semantics can fail (a wait
that returns on a dead peer, a send that completes only when received) run in nccl-sim."""


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_silent_member_of_a_three_member_group_is_released_within_the_lease(tmp_path,
                                                                              backend):
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
                          lease=1.5, heartbeat=0.1, pg_timeout=30.0, backend=backend)
    result = launch(TINY, config, args)
    assert result.status == "completed" and result.iterations == 6
    assert [g["dead"] for g in _events(result, "generation")] == [
        [], [[2, 1]], [[2, 0], [2, 1]]]
    assert [r.worker for r in result.recoveries] == ["2:1", "2:0"]
    assert all(r.seconds < 6 for r in result.recoveries), result.recoveries
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


@pytest.mark.parametrize("backend", ["nccl-sim"])
def test_a_death_in_the_cool_down_never_leaves_a_step_on_partial_gradients(tmp_path, backend):
    """2 stages x 2 pipelines: worker 1:1 dies just before its last weight gradient of
    iteration 2, its stage peer 0:1 waiting in the gradient all-reduce. On NCCL (and here in
    `nccl-sim`) that wait returns without an error: before the step gate, 0:1 stepped on its
    own half of the gradients and counted it, stage 0 (which had its gradients) stepped too,
    and the restart at iteration 3 kept the bad step. The gate refuses the step; iteration 2
    is redone. Then worker 0:0 dies in its last weight gradient of iteration 4."""
    lib = library(tmp_path / "lib", stages=2, pipelines=2, microbatches=4, max_failures=2)
    args = ["--library", str(lib), "--iterations", "6"]
    faults = [parse_fault(f) for f in ("3:2:W3", "0:4:W3")]
    config = LaunchConfig(nproc=4, run_dir=str(tmp_path / "run"), faults=faults,
                          backend=backend, pg_timeout=30.0)
    result = launch(TINY, config, args)
    assert result.status == "completed" and result.iterations == 6
    gens = _events(result, "generation")
    assert [g["dead"] for g in gens] == [[], [[1, 1]], [[0, 0], [1, 1]]]
    assert gens[1]["restart"] == 2  # stage 1's step of iteration 2 was never counted
    ref = reference(args[2:], 2, 4)
    _, params = checkpoint_params(tmp_path / "run", 2)
    assert_params_equal(params, ref.params)
    assert_losses_equal(result.losses, ref.losses)


@pytest.mark.parametrize("backend", ["nccl-sim"])
def test_a_death_during_a_plan_switch_never_hangs_the_survivors(tmp_path, backend):
    """2 stages x 3 pipelines. Worker 1:0 dies in iteration 1 and is restarted; worker 0:0
    holds at iteration 2 until it asks to join, so the members switch plans at iteration 4.
    In iteration 3 worker 2:0 stops (SIGSTOP) before its last two input gradients (after its
    last forward), so it never takes the gradients that stage 1 sent
    it; stage 1 finishes the iteration and ends the generation. On NCCL (and in `nccl-sim`)
    a send completes only when received: the clean end used to wait for those sends in a
    shutdown with no limit, out of reach of the abort, until the group timeout (30 s). The
    end now waits for them while watching the abort flag, and aborts."""
    lib = library(tmp_path / "lib", stages=2, pipelines=3, microbatches=4, max_failures=2)
    args = ["--library", str(lib), "--iterations", "7"]
    faults = [parse_fault(f) for f in ("2:1:F1", "0:2:hold", "4:3:I4:hang")]
    config = LaunchConfig(nproc=6, run_dir=str(tmp_path / "run"), faults=faults,
                          backend=backend, restart_delay=0.0, lease=1.5,
                          heartbeat=0.1, pg_timeout=30.0)
    result = launch(TINY, config, args)
    assert result.status == "completed" and result.iterations == 7
    assert [r.worker for r in result.recoveries] == ["1:0", "2:0"]
    assert any(e.kind == "join" for e in result.events)
    assert all(r.seconds < 8 for r in result.recoveries), result.recoveries
    ref = reference(args[2:], 3, 4)
    _, params = checkpoint_params(tmp_path / "run", 2)
    assert_params_equal(params, ref.params)
    assert_losses_equal(result.losses, ref.losses)


class _Work:
    """A work as the data plane sees one: complete or not, with an error or not; `wait`
    never raises (NCCL's)."""

    def __init__(self, done=True, error=None):
        self.done, self.error = done, error

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return self.done

    def exception(self):
        return self.error


def _comm(aborted=None):
    import threading
    from datetime import timedelta

    from recycle_planner.executor.data.comm import BACKENDS, Comm

    comm = Comm.__new__(Comm)  # no process group: the gate and the stall view only
    comm.backend, comm.device = BACKENDS["nccl-sim"], torch.device("cpu")
    comm.aborted = aborted or threading.Event()
    comm._timeout = timedelta(seconds=5)
    comm.received, comm.awaited, comm.error, comm.sends = [], [], None, []
    comm._awaiting = threading.Lock()
    comm.waited = 0.0
    return comm


def test_the_step_gate_refuses_a_failed_or_abandoned_iteration_whatever_wait_said():
    import threading

    from recycle_planner.executor.data.comm import PeerFailure

    comm = _comm()
    for work in (_Work(), _Work()):
        comm.wait(work, "receive")
    comm.confirm_received("the iteration")  # both complete, no error: the step counts
    comm.wait(_Work(error=RuntimeError("Connection closed by peer")), "gradient all-reduce")
    with pytest.raises(PeerFailure, match="Connection closed by peer"):
        comm.confirm_received("the iteration")
    aborted = threading.Event()
    comm = _comm(aborted)
    pending = _Work(done=False)
    comm.wait(pending, "gradient all-reduce")
    threading.Timer(0.05, aborted.set).start()
    with pytest.raises(PeerFailure, match="abandoned"):  # released by the abort flag
        comm.confirm_received("the iteration")


def test_a_worker_waits_on_a_peer_while_the_device_waits_for_an_incomplete_work():
    comm = _comm()
    work = _Work(done=False)
    comm.wait(work, "receive")  # NCCL: returns at once, the device waits
    assert comm.waiting_on_peer()
    work.done = True
    assert not comm.waiting_on_peer() and not comm.failed()
    comm.wait(_Work(error=RuntimeError("boom")), "receive")
    assert comm.failed()  # what makes a user-code exception after it a failure, not a bug


class _OldTorchWork(_Work):
    """A work as torch 2.11 gives one to Python (seen on an H200): `exception()` raises a
    TypeError (its C++ `exception_ptr` has no conversion), success or not."""

    def exception(self):
        raise TypeError("Unable to convert function return value to a Python type!")


def test_a_torch_that_cannot_report_a_works_error_is_refused_in_one_line():
    from recycle_planner.errors import RecycleError

    comm = _comm()
    with pytest.raises(RecycleError, match=r"needs torch 2\.13\.0"):
        comm.wait(_OldTorchWork(), "receive")  # never a step on an unknown outcome
    with pytest.raises(RecycleError, match="cannot tell the executor"):
        comm.sent(_OldTorchWork())
