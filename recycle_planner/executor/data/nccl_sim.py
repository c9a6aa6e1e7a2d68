"""gloo with NCCL's host semantics: the `nccl-sim` backend, so that CPU tests see what gloo hides.

gloo's `Work.wait()` blocks the calling thread until the operation is done and raises when it
failed; a gloo send completes once its bytes are in the kernel's socket buffer. NCCL differs
in four ways that decide whether a survivor keeps a bad step, hangs or is killed
(`ProcessGroupNCCL`, read for torch 2.13):

- `wait()`: gloo blocks the host and raises on a failure; NCCL makes the current stream wait
  and returns at once, never raising; here it never raises and returns when the CPU, which
  is the device here, may read the result (after a failure: at once, the buffer half-written).
- errors: gloo's at `wait()`; NCCL's at host synchronisation points (the work's
  `exception()` and `is_completed()`, the watchdog's abort); here `exception()` and the
  group's `error`, never `wait()`.
- a send completes: on gloo when written to the socket; on NCCL when the receiver's kernel
  has received it; here when the receiver has waited for its receive (it acknowledges
  through the store).
- `shutdown()`: nothing on gloo; NCCL waits for every pending operation, with no limit;
  here likewise (until the group timeout).

The host still blocks in `wait()` (a CPU cannot compute on bytes that have not arrived), but
it learns nothing there: a failed gradient all-reduce looks like a finished one until someone
asks the work or the group; a generation ended with a message its receiver never took does
not end. `Comm` treats this backend exactly as NCCL: it never relies on `wait()` raising.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class SimWork:
    """One operation of a `SimGroup`: `inner` the gloo work; for a send, `acked` says whether
    its receiver has taken it; for a receive, `reply` acknowledges it once it has been waited
    for (the receiving 'kernel' ran)."""

    def __init__(self, group: "SimGroup", inner: Any, acked=None, reply=None):
        self.group = group
        self.inner = inner
        self.acked = acked
        self.reply = reply
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._waited = False
        """gloo's work has been waited for (a gloo send waited twice blocks until the
        timeout: each wait consumes one completion; gloo marks a point-to-point work
        complete only once waited for)."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Returns when the result may be read (a send: its buffer may be reused); never
        raises: the error is kept for `exception()` and the group's `error`."""
        if not self._wait_inner():
            return True
        with self._lock:
            reply, self.reply = self.reply, None
        if reply is not None:
            reply()
        return True

    def _wait_inner(self) -> bool:
        with self._lock:
            first, self._waited = not self._waited, True
        if not first or self.inner is None:
            return self.error is None
        try:
            self.inner.wait()
        except RuntimeError as exc:
            self._fail(exc)
            return False
        return True

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            self.group.error = self.group.error or exc

    def is_completed(self) -> bool:
        if self.inner is None:
            return True
        if not self.inner.is_completed():
            return False
        error = self.inner.exception()
        if error is not None:
            self._fail(error)
            return True
        return self.acked is None or self.acked()

    def exception(self) -> BaseException | None:
        self.is_completed()
        return self.error

    def settle(self, deadline: float) -> None:
        """Wait for everything this operation involves (shutdown), swallowing errors; the
        acknowledgement until `deadline` (the group timeout)."""
        if not self._wait_inner() or self.acked is None:
            return
        while not self.acked() and time.monotonic() < deadline:
            time.sleep(0.005)


class SimGroup:
    """A `ProcessGroupGloo` with NCCL's host semantics (see the module's docstring). A
    receiver acknowledges each message through the group's store (the generation's own
    namespace): the n-th message from one rank to another with one tag is acknowledged as
    key `ack/SRC/DST/TAG/n`, which gloo's in-order matching makes the same message on both
    ends."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta):
        self.inner = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.store = store
        self.timeout = timeout
        self.error: BaseException | None = None
        """The group's error state: the first failure any of its operations met."""
        self.pending: list[SimWork] = []
        self._counts: dict[tuple, int] = {}

    def rank(self) -> int:
        return self.inner.rank()

    def size(self) -> int:
        return self.inner.size()

    def _key(self, src: int, dst: int, tag: int) -> str:
        n = self._counts.get((src, dst, tag), 0)
        self._counts[(src, dst, tag)] = n + 1
        return f"ack/{src}/{dst}/{tag}/{n}"

    def _post(self, start, **kwargs) -> SimWork:
        """Start an operation; posting never raises on NCCL (a broken connection is an error
        of the work, seen at a synchronisation point)."""
        try:
            work = SimWork(self, start(), **kwargs)
        except RuntimeError as exc:
            work = SimWork(self, None)
            work._waited = True
            work._fail(exc)
            return work
        if len(self.pending) >= 64:
            self.pending = [w for w in self.pending if not w.is_completed()]
        self.pending.append(work)
        return work

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> SimWork:
        key = self._key(self.rank(), dst, tag)
        done = []

        def acked() -> bool:
            if not done and self.store.check([key]):
                done.append(True)
            return bool(done)
        return self._post(lambda: self.inner.send(tensors, dst, tag), acked=acked)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> SimWork:
        key = self._key(src, self.rank(), tag)

        def reply() -> None:
            try:
                self.store.set(key, "1")
            except RuntimeError as exc:
                self.error = self.error or exc
        return self._post(lambda: self.inner.recv(tensors, src, tag), reply=reply)

    def allreduce(self, tensors: list[torch.Tensor], options: Any = None) -> SimWork:
        return self._post(lambda: self.inner.allreduce(tensors, options or
                                                       dist.AllreduceOptions()))

    def broadcast(self, tensors: list[torch.Tensor], options: Any = None) -> SimWork:
        return self._post(lambda: self.inner.broadcast(tensors, options or
                                                       dist.BroadcastOptions()))

    def barrier(self, options: Any = None) -> SimWork:
        return self._post(lambda: self.inner.barrier(options or dist.BarrierOptions()))

    def shutdown(self) -> None:
        """NCCL's `shutdown()`: wait for every pending operation, with no limit of its own
        (here the gloo group timeout ends a wait on a silent peer)."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        for work in self.pending:
            work.settle(deadline)
        self.pending = []
