"""Fault-free schedule generators: compute-only op orders per stage, no times.

Every pipeline runs the same order, so a generator returns one list per stage of
(kind, micro-batch) pairs; `fault_free` turns that into a full `Schedule` for all D pipelines.

- GPipe: every forward, then every backward.
- 1F1B: stage s runs w_s warm-up forwards, then alternates one forward and one backward, then
  drains the backwards. w_s = S - s - 1 unless the memory cap is lower (and never more than
  the stage before it, or the pipeline deadlocks).
- ZB-H1 (Qi et al., ICLR 2024): backward split into I and W; stage s runs n_s = S - s forwards,
  then I_k, W_{k - s} (once k >= s), F_{k + n_s}; W is delayed by s micro-batches so that it
  fills the cool-down bubble, and every stage keeps at most S micro-batches in flight, 1F1B's
  peak. Uniform costs give m(F + I + W) + (p - 1)(F + I - W).
With the I/W split and 1F1B or GPipe, each B becomes I immediately followed by W.

Workers with several chunks (schedules/interleaved.py): with the interleaved layout, 1F1B is
interleaved 1F1B and ZB-H1 interleaved zero bubble; with the V layout, ZB-H1 is ZB-V and 1F1B
is ZB-V's order with the backward fused (or, split, each B as I then W). GPipe runs one chunk
per worker.
"""

from __future__ import annotations

import numpy as np

from recycle_planner.errors import SpecError
from recycle_planner.job.policy import Policy, natural_caps
from recycle_planner.job.spec import JobSpec
from recycle_planner.schedules.interleaved import (ChunkOrder, fused, interleaved, peak_inflight,
                                                  zb_v)
from recycle_planner.schedules.ops import B, F, I, W, OpSpace
from recycle_planner.schedules.schedule import Schedule, with_collectives

StageOrder = list[tuple[int, int]]  # (kind, microbatch)


def gpipe(stages: int, microbatches: int, split: bool) -> list[StageOrder]:
    order: StageOrder = [(F, m) for m in range(microbatches)]
    for m in range(microbatches):
        order += [(I, m), (W, m)] if split else [(B, m)]
    return [list(order) for _ in range(stages)]


def one_f_one_b(stages: int, microbatches: int, split: bool,
                caps: tuple[int, ...] | None = None) -> list[StageOrder]:
    M = microbatches
    out = []
    warm_prev = M
    for s in range(stages):
        warm = min(stages - s - 1, M, warm_prev)
        if caps is not None:
            warm = min(warm, caps[s] - 1)
        warm_prev = warm
        back = [(I, None), (W, None)] if split else [(B, None)]
        order: StageOrder = [(F, m) for m in range(warm)]
        for k in range(M):
            if k + warm < M:
                order.append((F, k + warm))
            order += [(kind, k) for kind, _ in back]
        out.append(order)
    return out


def zb_h1(stages: int, microbatches: int, caps: tuple[int, ...] | None = None) -> list[StageOrder]:
    M = microbatches
    out = []
    n_prev = M
    for s in range(stages):
        n = min(stages - s, M, n_prev)
        cap = caps[s] if caps is not None else stages
        n = min(n, cap)
        n_prev = n
        lag = max(0, min(s, cap - n))
        order: StageOrder = [(F, m) for m in range(n)]
        next_f, next_w = n, 0
        for k in range(M):
            order.append((I, k))
            if k >= lag:
                order.append((W, next_w))
                next_w += 1
            if next_f < M:
                order.append((F, next_f))
                next_f += 1
        order += [(W, m) for m in range(next_w, M)]
        out.append(order)
    return out


def stage_orders(spec: JobSpec, policy: Policy) -> list[ChunkOrder]:
    """The compute-only order of each stage under `policy`, within the memory caps, as
    (kind, virtual stage, micro-batch) triples (the virtual stage is the stage itself when a
    worker holds one chunk)."""
    if spec.chunks > 1:
        return chunk_orders(spec, policy)
    return [[(kind, s, m) for kind, m in order]
            for s, order in enumerate(_single_chunk_orders(spec, policy))]


def chunk_orders(spec: JobSpec, policy: Policy) -> list[ChunkOrder]:
    """The orders of a job whose workers hold several chunks (see the module docstring); an
    error where the memory budget is below what the schedule keeps in flight."""
    S, v, M = spec.stages, spec.chunks, spec.microbatches
    if policy.schedule == "gpipe":
        raise SpecError(f"gpipe runs one chunk per worker, but the job has {v}: use 1f1b or "
                        f"zb-h1")
    if spec.layout == "v":
        orders = zb_v(S, M)
        if policy.schedule == "1f1b":
            orders = [fused(o) for o in orders]
            if policy.decouple:
                orders = [_split(o) for o in orders]
    else:
        orders = interleaved(S, v, M, policy.decouple, zero_bubble=policy.schedule == "zb-h1")
    for s, (order, cap) in enumerate(zip(orders, spec.caps())):
        need = peak_inflight(order)
        if cap is not None and need > cap:
            raise SpecError(f"{policy.schedule} with {v} chunks keeps {need} micro-batch chunks "
                            f"in flight on stage {s}, but the memory budget allows {cap}")
    return orders


def _split(order: ChunkOrder) -> ChunkOrder:
    """Each fused B as I immediately followed by W."""
    out: ChunkOrder = []
    for kind, vstage, m in order:
        out += [(I, vstage, m), (W, vstage, m)] if kind == B else [(kind, vstage, m)]
    return out


def _single_chunk_orders(spec: JobSpec, policy: Policy) -> list[StageOrder]:
    S, M = spec.stages, spec.microbatches
    caps = natural_caps(spec, policy)
    if policy.schedule == "gpipe":
        for s, cap in enumerate(caps):
            if cap < M:
                raise SpecError(f"gpipe keeps all {M} micro-batches in flight, but the memory "
                                f"budget allows {cap} on stage {s}: use 1f1b or zb-h1")
        return gpipe(S, M, policy.decouple)
    if policy.schedule == "zb-h1":
        return zb_h1(S, M, caps)
    return one_f_one_b(S, M, policy.decouple, caps)


def fault_free(spec: JobSpec, policy: Policy) -> Schedule:
    """The fault-free schedule: every pipeline runs `stage_orders`, then all-reduce and step."""
    space = OpSpace.of(spec)
    per_stage = [np.array(order, dtype=np.int64).reshape(-1, 3)
                 for order in stage_orders(spec, policy)]
    orders = []
    for d in range(spec.pipelines):
        for s, order in enumerate(per_stage):
            ids = space.compute(order[:, 0], d, order[:, 1], order[:, 2])
            orders.append(with_collectives(space, d, s, ids))
    return Schedule(spec=spec, policy=policy, failed=(), orders=tuple(orders))
