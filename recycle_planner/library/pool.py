"""The process pool that plans situations in parallel, and never outlives its build."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator


@contextmanager
def planning_pool(jobs: int) -> Iterator[Callable[[Callable, list], Iterable]]:
    """`run(fn, tasks)` yields results in task order, over `jobs` processes. However the
    build ends (an error, Ctrl-C, SIGTERM to the parent), no worker outlives it: the pool is
    terminated on the way out, and on Linux a worker also gets SIGTERM when its parent dies."""
    if jobs <= 1:
        yield lambda fn, tasks: map(fn, tasks)
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    pool = multiprocessing.get_context(method).Pool(jobs, initializer=_worker_setup,
                                                   initargs=(os.getpid(),))
    try:
        yield lambda fn, tasks: pool.imap(fn, tasks, chunksize=1)
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()


def _worker_setup(parent: int) -> None:
    """In a planning worker: die with the parent, and let SIGTERM unwind (so that a plan file
    being written is removed, not left half-written)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, _exit_on_signal)
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
