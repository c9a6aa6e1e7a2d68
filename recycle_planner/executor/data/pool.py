"""Message buffers pooled by what is in flight, not one per op.

A received activation is unpacked as views of its buffer, and those views are the stage's
input, which autograd keeps until the micro-batch's W: a buffer is busy from its receive's post
until the last view of it is gone, whatever op that is. `BufferPool` hands out a buffer that
nothing references any more (its storage's use count is the pool's own), else a new one, so
the pool grows to the most receives ever in flight at once, where one buffer per receiving op
grew with M (a 64 MiB boundary with 32 micro-batches: about 4 GiB of receive buffers on one
worker). Nothing is ever reused while referenced: a pending receive's work holds its tensor,
and so does any view a model keeps.

A send buffer is busy until its send completed (`SendPool`), which is asked without waiting
(`Comm.sent`: the work's `is_completed()`; on gloo, which marks a send complete only once some
thread waited for it, a `comm.SendReaper` thread per destination does that wait), never by a
wait on a recent send, which could block on a receiver not there yet. So the send pool, too,
grows to the most sends ever in flight at once, where one buffer per sending op grew with M.
"""

from __future__ import annotations

import torch

from typing import Any, Callable

from recycle_planner.executor.data.boundary import fit

_FREE = 2
"""A buffer's storage use count when only the pool holds it (the pool's tensor and the
temporary storage object that asks)."""


def _free(buf: torch.Tensor) -> bool:
    return torch._C._storage_Use_Count(buf.untyped_storage()._cdata) <= _FREE


class _Buffers:
    """Byte buffers on `device`; `peak` is how many were ever held at once."""

    def __init__(self, device: torch.device):
        self.device = device
        self.bufs: list[torch.Tensor] = []

    def _index(self, nbytes: int, free: Callable[[int], bool]) -> int:
        """The index of a free buffer of at least `nbytes` (a free one too small is replaced),
        else of a new one."""
        small = None
        for i, buf in enumerate(self.bufs):
            if free(i):
                if buf.numel() >= nbytes:
                    return i
                small = i if small is None else small
        new = fit(None, nbytes, self.device)
        if small is not None:
            self.bufs[small] = new
            return small
        self.bufs.append(new)
        return len(self.bufs) - 1

    @property
    def peak(self) -> int:
        return len(self.bufs)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.bufs)


class BufferPool(_Buffers):
    """Receive buffers, reused once nothing references them."""

    def take(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of a free buffer, else of a new one. Always a view of its own, whose
        holders (the receive's work, the unpacked leaves) are what keeps the buffer busy: the
        pool's tensor itself is shared by nobody."""
        return self.bufs[self._index(nbytes, lambda i: _free(self.bufs[i]))][:max(nbytes, 1)]

    def clear(self) -> None:
        self.bufs = []


class SendPool(_Buffers):
    """Send buffers, each with its latest send: reused once that send is known complete
    (`done(work)`, which must not block), else a new one."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.works: list[Any] = []

    def take(self, nbytes: int, done: Callable[[Any], bool]) -> int:
        """The index of a buffer of at least `nbytes` whose send is over, else of a new one;
        `bufs[i]` is it, `busy(i, work)` marks it."""
        i = self._index(nbytes, lambda i: self.works[i] is None or done(self.works[i]))
        self.works[i:i + 1] = [None]
        return i

    def busy(self, i: int, work: Any) -> None:
        self.works[i] = work

    def clear(self) -> None:
        self.bufs, self.works = [], []
