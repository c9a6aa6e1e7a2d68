"""Fault-free generators for workers that hold several model chunks (virtual stages).

Each returns, per stage, the compute-only order of one worker as (kind, virtual stage,
micro-batch) triples; every pipeline runs the same orders (`generators.fault_free`).

- Interleaved 1F1B (Narayanan et al., SC 2021; torch's ScheduleInterleaved1F1B): worker r holds
  virtual stages r, r + S, ...; micro-batches go through the chunks in rounds of
  `per_round` = M / max(1, M // S); worker r runs (v - 1) * per_round + 2 (S - 1 - r) warm-up
  forwards, then alternates a forward and a backward (the forward's chunk advances every
  `per_round` ops, the backward's goes from the last chunk down), then drains the backwards.
  With uniform costs its bubble is (S - 1) / v of 1F1B's.
- Interleaved zero bubble (Qi et al., ICLR 2024, "ZB1P"; torch's
  ScheduleInterleavedZeroBubble): the same with one warm-up forward per hop instead of two, the
  backward split into I and W, and worker r's W delayed by r backwards, so that the Ws fill
  the cool-down.
- ZB-V (Qi et al., section 6; torch's ScheduleZBVZeroBubble): two chunks in a V (worker r
  holds r and 2S - 1 - r); warm-up forwards of chunk 0, then of both, then chunk 1's
  F, I, W; a steady phase of F I W on chunk 0 and on chunk 1; the cool-down's Ws last. With
  F = I = W it has no bubble at all beyond the fill.
The orders are ours, written from the papers and torch's classes; tests time torch's own
`pipeline_order` with our simulator and find the same period.
"""

from __future__ import annotations

from collections import defaultdict

from recycle_planner.errors import SpecError
from recycle_planner.schedules.ops import B, F, I, W

ChunkOrder = list[tuple[int, int, int]]  # (kind, virtual stage, micro-batch)


def rounds(stages: int, microbatches: int) -> int:
    """Micro-batches per round of the interleaved schedules (torch's rule): M / max(1, M // S),
    which must divide M."""
    n_rounds = max(1, microbatches // stages)
    if microbatches % n_rounds:
        raise SpecError(f"interleaved schedules take the micro-batches in rounds of about "
                        f"{stages} (one per stage): {microbatches} micro-batches do not split "
                        f"into {n_rounds} equal rounds; use a multiple of {n_rounds} or of "
                        f"{stages}")
    return microbatches // n_rounds


def interleaved(stages: int, chunks: int, microbatches: int, split: bool,
                zero_bubble: bool = False) -> list[ChunkOrder]:
    """Interleaved 1F1B (`zero_bubble` False; with `split` each B becomes I then W) or
    interleaved zero bubble (`zero_bubble`, always split)."""
    S, v, M = stages, chunks, microbatches
    per_round = rounds(S, M)
    return [_interleaved_rank(S, v, M, per_round, r, split or zero_bubble, zero_bubble)
            for r in range(S)]


def _interleaved_rank(S: int, v: int, M: int, per_round: int, r: int, split: bool,
                      zero_bubble: bool) -> ChunkOrder:
    total = v * M
    warm = min((v - 1) * per_round + (1 if zero_bubble else 2) * (S - 1 - r), total)
    nxt: dict[tuple[int, int], int] = defaultdict(int)  # (kind, vstage) -> next micro-batch

    def take(kind: int, vstage: int) -> tuple[int, int, int]:
        m = nxt[kind, vstage]
        nxt[kind, vstage] = m + 1
        return kind, vstage, m

    def forward_stage(k: int) -> int:
        return (k // per_round) % v * S + r

    def backward_stage(k: int) -> int:
        return (v - 1 - (k - warm) // per_round % v) * S + r

    order: ChunkOrder = [take(F, forward_stage(k)) for k in range(warm)]
    backs: list[int] = []  # virtual stage of each backward so far, for the delayed Ws
    w_done = 0
    for k in range(warm, total + warm):
        if k < total:
            order.append(take(F, forward_stage(k)))
        vstage = backward_stage(k)
        if not split:
            order.append(take(B, vstage))
            continue
        order.append(take(I, vstage))
        backs.append(vstage)
        if not zero_bubble:
            order.append(take(W, vstage))
        elif k - warm >= r:
            order.append(take(W, backs[w_done]))
            w_done += 1
    if zero_bubble:
        order += [take(W, vstage) for vstage in backs[w_done:]]
    return order


def zb_v(stages: int, microbatches: int) -> list[ChunkOrder]:
    """ZB-V's order for every worker (two chunks in a V, backward split)."""
    return [_zb_v_rank(stages, microbatches, r) for r in range(stages)]


def _zb_v_rank(S: int, M: int, r: int) -> ChunkOrder:
    n_micro = max(2 * S - 1, M)  # fills the V; the extra micro-batches are dropped at the end
    c0, c1 = r, 2 * S - 1 - r
    count: dict[tuple[int, int], int] = defaultdict(int)
    order: ChunkOrder = []

    def add(kind: int, vstage: int) -> None:
        order.append((kind, vstage, count[kind, vstage]))
        count[kind, vstage] += 1

    for _ in range(2 * (S - r) - 1):
        add(F, c0)
    for _ in range(r):
        add(F, c1)
        add(F, c0)
    for _ in range(S - r):
        add(F, c1)
        add(I, c1)
        add(W, c1)
    while count[F, c1] < count[F, c0] or count[F, c0] < n_micro:
        if count[F, c0] < n_micro:
            add(F, c0)
        add(I, c0)
        add(W, c0)
        add(F, c1)
        add(I, c1)
        add(W, c1)
    for _ in range(r):
        add(I, c0)
        add(I, c1)
    for _ in range(S - r):
        add(I, c0)
        add(W, c0)
    for vstage in (c1, c0):
        while count[W, vstage] < count[I, vstage]:
            add(W, vstage)
    return [op for op in order if op[2] < M]


def fused(order: ChunkOrder) -> ChunkOrder:
    """The order with the backward fused: each I becomes B, each W goes."""
    return [(B if kind == I else kind, vstage, m) for kind, vstage, m in order if kind != W]


def peak_inflight(order: ChunkOrder) -> int:
    """The most (micro-batch, chunk) pairs a worker running `order` holds at once (a forward
    takes one, its W or B releases it)."""
    held = peak = 0
    for kind, _, _ in order:
        held += 1 if kind == F else -1 if kind in (W, B) else 0
        peak = max(peak, held)
    return peak
