"""Compile one rank's program from a plan: in time proportional to the rank's own ops.

The plan names logical workers (pipeline, stage); a library's `Lookup.mapping` says which
physical worker plays which (a plan made for physical dead workers, `plan --fail`, needs none).
A rank's ops are its logical worker's ops in the plan. For each of them the peer is whoever runs
the neighbouring stage of the same micro-batch: the forward of micro-batch m of pipeline p
receives from the worker that runs F(p, s-1, m) in this plan and sends to the one that runs
F(p, s+1, m), whether or not that is the rank's own pipeline (a re-routed micro-batch).

Who runs what is a table over every micro-batch of every stage (`PlanIndex`), built once per
plan with numpy and kept with the plan (a weak reference: it goes when the plan goes); after
that a rank's compile reads only its own ops and two rows of the mapping.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from recycle_planner.errors import RecycleError
from recycle_planner.job.situations import Mapping
from recycle_planner.programs.actions import (ACTIVATION, BACKWARD, FORWARD, GRADIENT, AllReduce,
                                              Compute, Optimizer, Program, Recv, Send,
                                              message_tag)
from recycle_planner.programs.order import issue_order
from recycle_planner.schedules.ops import AR, B, F, I, KIND_NAMES, OPT, worker_at, worker_index
from recycle_planner.timing.plan import Plan


@dataclass(frozen=True, eq=False)
class PlanIndex:
    """`runner[unit]`: the logical worker index that runs F of each micro-batch unit
    ((pipeline * S + stage) * M + microbatch; -1: nobody); `dead`: the plan's dead logical
    workers."""

    runner: np.ndarray
    dead: frozenset[tuple[int, int]]


_INDEXES: "weakref.WeakKeyDictionary[Plan, PlanIndex]" = weakref.WeakKeyDictionary()


def plan_index(plan: Plan) -> PlanIndex:
    """The plan's index, built at the first call and kept with the plan."""
    index = _INDEXES.get(plan)
    if index is None:
        space = plan.schedule.space
        ids, workers = plan.schedule.flat
        forward = ids < space.per_kind  # F's ids are the units themselves (kind 0)
        runner = np.full(space.per_kind, -1, dtype=np.int64)
        runner[ids[forward]] = workers[forward]
        index = _INDEXES[plan] = PlanIndex(runner, frozenset(plan.failed))
    return index


def identity(plan: Plan) -> Mapping:
    """The mapping of a plan whose workers are physical (every worker plays its own pipeline)."""
    return Mapping(tuple(tuple(range(plan.spec.pipelines)) for _ in range(plan.spec.stages)))


def compile_program(plan: Plan, rank: int, mapping: Mapping | None = None) -> Program:
    """The program of physical `rank` (pipeline-major: pipeline * stages + stage) in `plan`.
    `mapping` (a library lookup's) says which logical worker each physical one plays; without
    it the plan's workers are the physical ones. A dead rank has no program."""
    spec = plan.spec
    S, D, M = spec.stages, spec.pipelines, spec.microbatches
    if not 0 <= rank < S * D:
        raise RecycleError(f"rank {rank} is outside the job's {S * D} ranks")
    mapping = mapping or identity(plan)
    d, s = worker_at(S, rank)
    logical = mapping.logical_of_physical[s][d]
    index = plan_index(plan)
    if (logical, s) in index.dead:
        raise RecycleError(f"rank {rank} (worker {d}:{s}) is dead in this plan: it has no "
                           f"program")
    space, end = plan.schedule.space, plan.timing.end
    physical = {t: _inverse(mapping.logical_of_physical[t]) for t in (s - 1, s + 1)
                if 0 <= t < S}

    def peer(stage: int, p: int, m: int) -> int:
        w = int(index.runner[(p * S + stage) * M + m])
        q = worker_at(S, w)[0]
        if w < 0 or (q, stage) in index.dead:  # a valid plan never does this
            raise RecycleError(f"the plan runs no live worker for micro-batch {m} of pipeline "
                               f"{p} at stage {stage}")
        return worker_index(S, physical[stage][q], stage)

    def sent_at(kinds: Iterable[int], stage: int, p: int, m: int) -> float:
        """When the plan sends the output of the op of `kinds` that it schedules."""
        times = [float(end[space.compute(kind, p, stage, m)]) for kind in kinds]
        return min(t for t in times if t == t)

    def message(kind, what, direction, sender: int, p: int, m: int, other: int, kinds):
        return kind(what, p, m, peer(other, p, m), sent_at(kinds, sender, p, m),
                    message_tag(direction, sender, p, m, S, D, M))

    ranks = tuple(worker_index(S, q, s) for q in range(D)
                  if (mapping.logical_of_physical[s][q], s) not in index.dead)
    ids = plan.schedule.orders[worker_index(S, logical, s)]
    kinds, pipes, _, mbs = space.decode(ids)
    ops = []
    for kind, p, m in zip(kinds.tolist(), pipes.tolist(), mbs.tolist()):
        recv = send = None
        if kind == AR:
            ops.append((AllReduce(ranks), None, None))
            continue
        if kind == OPT:
            ops.append((Optimizer(), None, None))
            continue
        if kind == F:
            if s > 0:
                recv = message(Recv, ACTIVATION, FORWARD, s - 1, p, m, s - 1, (F,))
            if s < S - 1:
                send = message(Send, ACTIVATION, FORWARD, s, p, m, s + 1, (F,))
        elif kind in (I, B):
            if s < S - 1:
                recv = message(Recv, GRADIENT, BACKWARD, s + 1, p, m, s + 1, (I, B))
            if s > 0:
                send = message(Send, GRADIENT, BACKWARD, s, p, m, s - 1, (kind,))
        ops.append((Compute(KIND_NAMES[kind], s, p, m), recv, send))
    return Program(rank, d, s, logical, S, D, M, not plan.policy.stagger, issue_order(ops))


def compile_all(plan: Plan, mapping: Mapping | None = None) -> dict[int, Program]:
    """The program of every live rank of `plan`, by rank."""
    mapping = mapping or identity(plan)
    S, dead = plan.spec.stages, plan_index(plan).dead
    return {worker_index(S, d, s): compile_program(plan, worker_index(S, d, s), mapping)
            for s, row in enumerate(mapping.logical_of_physical)
            for d, logical in enumerate(row) if (logical, s) not in dead}


def _inverse(row: tuple[int, ...]) -> list[int]:
    out = [0] * len(row)
    for d, logical in enumerate(row):
        out[logical] = d
    return out
