"""The process pool that plans situations in parallel, and never outlives its build.

Not `multiprocessing.Pool`: its `terminate()` can wait for ever. It takes the task queue's
lock before it stops the workers, and a worker blocked reading that queue holds the lock
(CPython 3.11; our CI hung on it once). Here every worker has a pipe of its own, so no lock
is shared, and stopping is bounded: SIGTERM, a grace period, then SIGKILL."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterable, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACE = 5.0  # seconds a worker has to unwind after SIGTERM before it is killed


class WorkerDied(RuntimeError):
    """A planning worker ended without answering (killed, out of memory, a crash in C)."""


@contextmanager
def planning_pool(jobs: int) -> Iterator[Callable[[Callable, list], Iterable]]:
    """`run(fn, tasks)` yields results in task order, over `jobs` processes. However the
    build ends (an error, Ctrl-C, SIGTERM to the parent), no worker outlives it: the workers
    are stopped on the way out, and on Linux a worker also gets SIGTERM when its parent dies."""
    if jobs <= 1:
        yield lambda fn, tasks: map(fn, tasks)
        return
    workers = _start(jobs)
    try:
        yield lambda fn, tasks: _run(workers, fn, tasks)
    except BaseException:
        _stop(workers, gently=False)
        raise
    _stop(workers, gently=True)


class _Worker:
    def __init__(self, process: multiprocessing.process.BaseProcess, conn: Connection):
        self.process, self.conn = process, conn


def _start(jobs: int) -> list[_Worker]:
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    # A stop signal that lands during a fork has its handler run in an at-fork hook, which
    # drops the exception: while the workers start, signals are only noted, then raised
    # again. They are blocked too, so that a worker sees one only once its own handlers are
    # in place (it unblocks them in _worker_setup), not the inherited noting handler.
    noted: list[int] = []
    main = threading.current_thread() is threading.main_thread()  # handlers live there only
    previous = {sig: signal.signal(sig, lambda signum, frame: noted.append(signum))
                for sig in STOP_SIGNALS} if main else {}
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    workers: list[_Worker] = []
    try:
        for _ in range(jobs):
            ours, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(theirs, os.getpid()), daemon=True,
                                      name="recycle-planner-planning")
            process.start()
            theirs.close()
            workers.append(_Worker(process, ours))
    except BaseException:
        _stop(workers, gently=False)
        raise
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    try:
        for sig in noted[:1]:
            signal.raise_signal(sig)
    except BaseException:
        _stop(workers, gently=False)
        raise
    return workers


def _run(workers: list[_Worker], fn: Callable, tasks: Iterable) -> Iterator[Any]:
    """Hand each idle worker the next task; yield answers in task order."""
    todo = enumerate(tasks)
    busy: dict[Connection, tuple[_Worker, int]] = {}
    answers: dict[int, Any] = {}
    following = 0

    def hand(worker: _Worker) -> None:
        for index, task in todo:
            worker.conn.send((fn, task))
            busy[worker.conn] = (worker, index)
            return

    for worker in workers:
        hand(worker)
    while busy:
        sentinels = {w.process.sentinel: conn for conn, (w, _) in busy.items()}
        for ready in wait([*busy, *sentinels]):
            conn = sentinels.get(ready, ready)
            if conn not in busy:
                continue  # answered and ended together: the answer was read already
            worker, index = busy.pop(conn)
            try:
                ok, value = conn.recv()
            except (EOFError, OSError):
                worker.process.join(GRACE)
                raise WorkerDied(f"a planning worker (pid {worker.process.pid}) ended with "
                                 f"exit code {worker.process.exitcode} on task {index}") from None
            if not ok:
                raise value
            answers[index] = value
            hand(worker)
        while following in answers:
            yield answers.pop(following)
            following += 1


def _serve(conn: Connection, parent: int) -> None:
    """A worker: answer (fn, task) with (True, result) or (False, the exception raised)."""
    _worker_setup(parent)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the pool is gone
            return
        if message is None:  # the pool is done
            return
        fn, task = message
        try:
            answer = (True, fn(task))
        except Exception as error:  # noqa: BLE001 - re-raised in the parent
            answer = (False, _portable(error))
        conn.send(answer)


def _portable(error: Exception) -> Exception:
    """The exception itself if it survives pickling, else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any failure to pickle means: send its text instead
        return RuntimeError(f"{type(error).__name__}: {error}")


def _stop(workers: list[_Worker], *, gently: bool) -> None:
    """Say stop (an idle worker then returns; the pipes' ends are shared with later forks, so
    closing ours is not enough). Gently, a busy worker may finish its
    task for GRACE seconds; then, or at once if not gently, SIGTERM (it unwinds, removing a
    half-written file) and GRACE seconds more; then SIGKILL for whatever is left."""
    for worker in workers:
        try:
            worker.conn.send(None)
        except OSError:  # it is gone already
            pass
        worker.conn.close()
    if gently:
        _join(workers, GRACE)
    for worker in workers:
        if worker.process.exitcode is None:
            worker.process.terminate()
    _join(workers, GRACE)
    for worker in workers:
        if worker.process.exitcode is None:
            worker.process.kill()
    _join(workers, None)  # after SIGKILL this reaps at once


def _join(workers: list[_Worker], seconds: float | None) -> None:
    """Wait for every worker, `seconds` in all (None: without a limit)."""
    deadline = None if seconds is None else time.monotonic() + seconds
    for worker in workers:
        worker.process.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


def _worker_setup(parent: int) -> None:
    """In a planning worker: die with the parent, and let SIGTERM unwind (so that a plan file
    being written is removed, not left half-written)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked while it was forked
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent:  # the parent died before the line above
            raise SystemExit(1)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
