"""The stage's gradient all-reduce in buckets, each started as soon as its gradients are final.

A worker's parameter gradients are final once its last gradient-producing op of the iteration
(its program's `launch`: its last W, or B when fused) has accumulated them. The stage's
parameters are cut into buckets of about `bucket_mb` (`plan_buckets`, in reverse order of
`module.parameters()`, the order a backward pass tends to finish them, as DDP does); during
that op each bucket's asynchronous SUM all-reduce is started on the stage group as soon as it
and every earlier bucket are complete, so the reduction overlaps the rest of the backward and
whatever the plan runs before ALLREDUCE, where the worker then only waits.

What tells a bucket is complete: torch's post-accumulate-grad hooks for a backward through
autograd (B, and stage 0's W, which runs the whole backward), and for a split W the end of each
of torch's parameter groups (`stage_backward_weight` accumulates by hand, which fires no hook);
parameters without a gradient are completed (as zeros) at the end of the op.

NCCL matches collectives by the order in which each rank issues them: every worker of a stage
has the same buckets and starts them in bucket order, and the last stage's loss all-reduce is
issued after the last bucket, so the order is the same on every rank. A launch that fails is
kept and raised as `PeerFailure` at the wait (never from inside an autograd hook).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.distributed.pipelining._backward import (_get_grad_fn_or_grad_acc,
                                                     stage_backward_weight)

from recycle_planner.executor.data.comm import Comm, PeerFailure


def plan_buckets(params: Sequence[torch.Tensor], bucket_bytes: int) -> tuple[tuple[int, ...], ...]:
    """Indices of `params` per bucket: reverse order, one dtype and device per bucket, a new
    bucket when the next parameter would take it past `bucket_bytes` (a larger parameter gets
    a bucket of its own). The same on every worker of a stage (same modules)."""
    out: list[list[int]] = []
    size, kind = 0, None
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        if not out or (p.dtype, p.device) != kind or size + nbytes > bucket_bytes:
            out.append([])
            size, kind = 0, (p.dtype, p.device)
        out[-1].append(i)
        size += nbytes
    return tuple(tuple(b) for b in out)


class GradBuckets:
    """The buckets of one stage's parameters and the all-reduces of the running iteration.

    `arm` before the last gradient op, `ready` as parameters become final, `finish` after it
    (and at ALLREDUCE: nothing left to start then), `wait` at ALLREDUCE: afterwards every
    parameter's `.grad` is a view of its bucket's reduced buffer. Buffers are allocated at
    their first use and reused every iteration of a generation; `reset` drops them with any
    pending work (a broken group's operations must not write into the next one's)."""

    def __init__(self, params: Sequence[torch.Tensor], bucket_mb: float):
        self.params = list(params)
        self.buckets = plan_buckets(self.params, int(bucket_mb * 2 ** 20))
        self._bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._hook(i))
        self.comm: Comm | None = None
        self.reset()

    def reset(self) -> None:
        self.flats: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._clear()

    def _clear(self) -> None:
        self.armed = False
        self.missing = [set(b) for b in self.buckets]
        self.next = 0
        self.works: list[Any] = []
        self.error: PeerFailure | None = None

    def _hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            if self.armed:
                self.ready((i,))
        return hook

    def arm(self, comm: Comm) -> None:
        """The next op is the worker's last gradient op: start buckets as they complete."""
        self.comm = comm
        self.armed = True

    def ready(self, indices) -> None:
        """Parameters `indices` have their final gradient: start every bucket now complete
        whose predecessors are started."""
        for i in indices:
            self.missing[self._bucket_of[i]].discard(i)
        while self.next < len(self.buckets) and not self.missing[self.next]:
            self._launch(self.next)
            self.next += 1

    def backward_weight(self, weights, saved: list[dict]) -> None:
        """torch's `stage_backward_weight` (a split W) one of its parameter groups at a time,
        starting the buckets each group completes."""
        index = {_get_grad_fn_or_grad_acc(p): i for i, p in enumerate(self.params)}
        weights = list(weights)
        for group in saved:
            stage_backward_weight(iter(weights), [group])
            self.ready([index[node] for node in group["params"] if node in index])

    def finish(self, comm: Comm) -> None:
        """Every gradient is final: start what is left."""
        self.comm = comm
        self.armed = False
        self.ready(range(len(self.params)))

    def _segments(self, b: int):
        """Each parameter of bucket `b` with its segment of the bucket's buffer."""
        flat, offset = self.flats[b], 0
        for i in self.buckets[b]:
            p = self.params[i]
            n = p.numel()
            yield p, flat[offset:offset + n]
            offset += n

    def _launch(self, b: int) -> None:
        flat = self.flats[b]
        if flat is None:
            members = self.buckets[b]
            p0 = self.params[members[0]]
            numel = sum(self.params[i].numel() for i in members)
            flat = self.flats[b] = torch.empty(numel, dtype=p0.dtype, device=p0.device)
        for p, segment in self._segments(b):
            if p.grad is None:
                segment.zero_()
            else:
                segment.copy_(p.grad.reshape(-1))
        if self.error is None:
            try:
                self.works.append(self.comm.allreduce_start(flat, "gradient all-reduce"))
            except PeerFailure as exc:  # raised at the wait, never inside an autograd hook
                self.error = exc

    def wait(self) -> None:
        """Wait for every bucket (all started) and point each `.grad` into its bucket (the
        step gate confirms them: on NCCL a wait says nothing of success)."""
        works, error = self.works, self.error
        self._clear()
        if error is not None:
            raise error
        for work in works:
            self.comm.wait(work, "gradient all-reduce")
        for b in range(len(self.buckets)):
            for p, segment in self._segments(b):
                p.grad = segment.view_as(p)
