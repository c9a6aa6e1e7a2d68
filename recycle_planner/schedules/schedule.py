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
from recycle_planner.schedules.ops import COMPUTE_KINDS, Op, OpSpace, Worker


@dataclass(frozen=True, eq=False)
class Schedule:
    """`orders[d * S + s]` is worker (d, s)'s op ids in execution order; a dead worker's is
    empty."""

    spec: JobSpec
    policy: Policy
    failed: tuple[Worker, ...]
    orders: tuple[np.ndarray, ...]

    @cached_property
    def space(self) -> OpSpace:
        return OpSpace(self.spec.stages, self.spec.pipelines, self.spec.microbatches)

    def worker_index(self, worker: Worker) -> int:
        return worker[0] * self.spec.stages + worker[1]

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
        ids, workers = self.flat
        kind, pipe, _, _ = self.space.decode(ids)
        comp = kind < COMPUTE_KINDS
        return int(np.count_nonzero(pipe[comp] != workers[comp] // self.spec.stages))

    @property
    def n_ops(self) -> int:
        return int(sum(len(o) for o in self.orders))


def with_collectives(space: OpSpace, d: int, s: int, compute: list[int] | np.ndarray) -> np.ndarray:
    """A worker's order: its compute ops, then its stage's gradient all-reduce and optimizer
    step."""
    tail = [space.allreduce(d, s), space.optimizer(d, s)]
    return np.asarray(list(compute) + tail, dtype=np.int64)
