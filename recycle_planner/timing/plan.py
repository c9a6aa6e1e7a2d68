"""A plan: one failure situation's schedule with times, metrics and provenance."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.schedules.ops import B, F, W, Worker
from recycle_planner.schedules.schedule import Schedule
from recycle_planner.timing.metrics import Metrics
from recycle_planner.timing.simulate import Timing, cost_table


@dataclass(frozen=True, eq=False)
class WorkerStats:
    busy: np.ndarray            # per worker index, ms of work in one iteration
    bubble_rate: np.ndarray     # idle share of the period
    peak_inflight: np.ndarray   # most micro-batches holding activations at once


@dataclass(frozen=True, eq=False)
class Plan:
    schedule: Schedule
    timing: Timing
    metrics: Metrics
    solver: dict[str, Any] = field(default_factory=dict)
    mapping: dict[str, Any] | None = None

    @property
    def spec(self) -> JobSpec:
        return self.schedule.spec

    @property
    def policy(self) -> Policy:
        return self.schedule.policy

    @property
    def failed(self) -> tuple[Worker, ...]:
        return self.schedule.failed


def worker_stats(schedule: Schedule, timing: Timing, period: float) -> WorkerStats:
    """Busy time, bubble rate and peak in-flight micro-batches of every worker (dead: zeros)."""
    ids, workers = schedule.flat
    n_workers = len(schedule.orders)
    kind, _, stage, _ = schedule.space.decode(ids)
    dur = cost_table(schedule.spec)[kind, stage] if len(ids) else np.zeros(0)
    busy = np.bincount(workers, weights=dur, minlength=n_workers)
    alive = np.array([len(o) > 0 for o in schedule.orders])
    bubble = np.where(alive, 1.0 - busy / period, 0.0) if period > 0 else np.zeros(n_workers)
    return WorkerStats(busy, np.clip(bubble, 0.0, 1.0),
                       peak_inflight(schedule, timing, workers, ids, kind))


def peak_inflight(schedule: Schedule, timing: Timing, workers: np.ndarray, ids: np.ndarray,
                  kind: np.ndarray) -> np.ndarray:
    """A micro-batch is in flight on its worker from its forward's start to the end of its
    weight-gradient (or fused) backward; a release at time t happens before an acquire at t."""
    n_workers = len(schedule.orders)
    acq = kind == F
    rel = (kind == W) | (kind == B)
    t = np.concatenate([timing.start[ids[acq]], timing.end[ids[rel]]])
    delta = np.concatenate([np.ones(acq.sum()), -np.ones(rel.sum())])
    who = np.concatenate([workers[acq], workers[rel]])
    if not len(t):
        return np.zeros(n_workers, dtype=np.int64)
    order = np.lexsort((delta, t, who))
    who, delta = who[order], delta[order]
    run = np.cumsum(delta)
    # Subtract each worker's running total before its first event.
    first = np.flatnonzero(np.r_[True, who[1:] != who[:-1]])
    base = np.r_[0, run][first]
    counts = np.diff(np.r_[first, len(who)])
    level = run - np.repeat(base, counts)
    peaks = np.zeros(n_workers, dtype=np.int64)
    np.maximum.at(peaks, who, level.astype(np.int64))
    return peaks
