"""A schedule: every live worker's ordered list of ops for one iteration, without times.

Generators and solvers produce schedules; the simulator adds times; the validator checks them.
Orders are integer op ids (see `OpSpace`) so that large jobs stay cheap; `ops()` gives the
readable `Op` values.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.schedules.ops import (Op, OpSpace, Worker, is_collective, worker_at,
                                          worker_index)


@dataclass(frozen=True, eq=False)
class Schedule:
    """`orders[worker_index(S, d, s)]` is worker (d, s)'s op ids in execution order; a dead
    worker's is empty."""

    spec: JobSpec
    policy: Policy
    failed: tuple[Worker, ...]
    orders: tuple[np.ndarray, ...]

    @cached_property
    def space(self) -> OpSpace:
        return OpSpace.of(self.spec)

    def worker_index(self, worker: Worker) -> int:
        return worker_index(self.spec.stages, *worker)

    def workers(self) -> list[Worker]:
        """Every worker of the grid, pipeline-major."""
        return [(d, s) for d in range(self.spec.pipelines) for s in range(self.spec.stages)]

    def live_workers(self) -> list[Worker]:
        dead = set(self.failed)
        return [w for w in self.workers() if w not in dead]

    def ops(self, worker: Worker) -> list[Op]:
        return self.space.to_ops(self.orders[self.worker_index(worker)])

    @cached_property
    def flat(self) -> tuple[np.ndarray, np.ndarray]:
        """(op ids, executing worker index) of every scheduled op, worker by worker."""
        ids = np.concatenate([np.asarray(o, dtype=np.int64) for o in self.orders]) \
            if self.orders else np.zeros(0, np.int64)
        lengths = np.array([len(o) for o in self.orders], dtype=np.int64)
        workers = np.repeat(np.arange(len(self.orders), dtype=np.int64), lengths)
        return ids, workers

    def rerouted_count(self) -> int:
        """Compute ops run by a worker of another pipeline."""
        return int(np.count_nonzero(rerouted(self.space, *self.flat)))

    @property
    def n_ops(self) -> int:
        return int(sum(len(o) for o in self.orders))


def rerouted(space: OpSpace, ids: np.ndarray, workers: np.ndarray) -> np.ndarray:
    """Which of the ops `ids`, run by worker indices `workers`, are re-routed: compute ops of
    another pipeline's micro-batch."""
    kind, pipe, _, _ = space.decode(ids)
    return ~is_collective(kind) & (pipe != worker_at(space.S, np.asarray(workers))[0])


def with_collectives(space: OpSpace, d: int, s: int, compute: list[int] | np.ndarray) -> np.ndarray:
    """A worker's order: its compute ops, then its stage's gradient all-reduce and optimizer
    step."""
    tail = [space.allreduce(d, s), space.optimizer(d, s)]
    return np.asarray(list(compute) + tail, dtype=np.int64)
