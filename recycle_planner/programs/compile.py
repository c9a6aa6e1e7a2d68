"""Compile one rank's program from a plan: in time proportional to the rank's own ops.

The plan names logical workers (pipeline, stage); a library's `Lookup.mapping` says which
physical worker plays which (a plan made for physical dead workers, `plan --fail`, needs none).
A rank's ops are its logical worker's ops in the plan. For each of them the peer is whoever runs
the neighbouring stage of the same micro-batch: the forward of micro-batch m of pipeline p
receives from the worker that runs F(p, s-1, m) in this plan and sends to the one that runs
F(p, s+1, m), whether or not that is the rank's own pipeline (a re-routed micro-batch).

Who runs what is a table over every micro-batch of every stage (`PlanIndex`), built once per
plan with numpy and kept with the plan (a weak reference: it goes when the plan goes). A rank's
compile then reads only its own ops and two rows of the mapping, as arrays (`RankOrder`, what
the NCCL check replays); `Program` objects are made from them for whoever wants them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from recycle_planner.errors import RecycleError
from recycle_planner.job.situations import Mapping
from recycle_planner.programs.actions import (ACTIVATION, BACKWARD, FORWARD, GRADIENT, Action,
                                              AllReduce, Compute, Optimizer, Program, Recv, Send,
                                              message_tag)
from recycle_planner.programs.order import RECV, RUN, SEND, issue_order
from recycle_planner.schedules.ops import (AR, B, F, I, KIND_CODES, KIND_NAMES, OPT, worker_at,
                                          worker_index)
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


@dataclass(frozen=True, eq=False)
class RankOrder:
    """One rank's program as arrays, one entry per step in issue order: `step` (RUN, RECV,
    SEND), the op it runs or whose message it is (`kind` code, `pipeline`, `microbatch`; -1 for
    the collectives), and for a message its `peer` (physical rank), `time` and `tag`."""

    rank: int
    pipeline: int
    stage: int
    plays: int
    shape: tuple[int, int, int]   # stages, pipelines, microbatches
    barrier: bool
    ranks: tuple[int, ...]        # the stage's live ranks
    step: np.ndarray
    kind: np.ndarray
    op_pipeline: np.ndarray
    op_microbatch: np.ndarray
    peer: np.ndarray
    time: np.ndarray
    tag: np.ndarray

    def program(self) -> Program:
        actions: list[Action] = []
        columns = (self.step.tolist(), self.kind.tolist(), self.op_pipeline.tolist(),
                   self.op_microbatch.tolist(), self.peer.tolist(), self.time.tolist(),
                   self.tag.tolist())
        for step, kind, p, m, peer, time, tag in zip(*columns):
            if step == RUN:
                actions.append(AllReduce(self.ranks) if kind == AR else Optimizer()
                               if kind == OPT else Compute(KIND_NAMES[kind], self.stage, p, m))
            else:
                what = ACTIVATION if kind == F else GRADIENT
                actions.append((Recv if step == RECV else Send)(what, p, m, peer, time, tag))
        return Program(self.rank, self.pipeline, self.stage, self.plays, *self.shape,
                       self.barrier, tuple(actions))

    @classmethod
    def from_program(cls, program: Program) -> "RankOrder":
        """The arrays of a program made or edited by hand (the checks read arrays)."""
        rows = []
        for a in program.actions:
            if isinstance(a, Compute):
                rows.append((RUN, KIND_CODES[a.kind], a.pipeline, a.microbatch, -1, 0.0, -1))
            elif isinstance(a, (AllReduce, Optimizer)):
                rows.append((RUN, AR if isinstance(a, AllReduce) else OPT, -1, -1, -1, 0.0, -1))
            else:
                rows.append((RECV if isinstance(a, Recv) else SEND,
                             F if a.what == ACTIVATION else I, a.pipeline, a.microbatch, a.peer,
                             a.time, a.tag))
        ranks = next((a.ranks for a in program.actions if isinstance(a, AllReduce)), ())
        columns = [np.array(c) for c in zip(*rows)] if rows else [np.zeros(0, np.int64)] * 7
        return cls(program.rank, program.pipeline, program.stage, program.plays,
                   (program.stages, program.pipelines, program.microbatches), program.barrier,
                   ranks, *columns)


def rank_order(plan: Plan, rank: int, mapping: Mapping | None = None) -> RankOrder:
    """The program of physical `rank` (pipeline-major: pipeline * stages + stage) in `plan`, as
    arrays. `mapping` (a library lookup's) says which logical worker each physical one plays;
    without it the plan's workers are the physical ones. A dead rank has no program."""
    spec = plan.spec
    S, D, M = spec.stages, spec.pipelines, spec.microbatches
    if not 0 <= rank < S * D:
        raise RecycleError(f"rank {rank} is outside the job's {S * D} ranks")
    rows = (mapping or identity(plan)).logical_of_physical
    d, s = worker_at(S, rank)
    logical = rows[s][d]
    index = plan_index(plan)
    if (logical, s) in index.dead:
        raise RecycleError(f"rank {rank} (worker {d}:{s}) is dead in this plan: it has no "
                           f"program")
    space, end = plan.schedule.space, plan.timing.end
    kind, p, _, m = space.decode(plan.schedule.orders[worker_index(S, logical, s)])
    forward, backward = kind == F, (kind == I) | (kind == B)
    physical = np.full((S, D), -1, dtype=np.int64)  # rank of each logical worker, two stages
    for t in (s - 1, s + 1):
        if 0 <= t < S:
            physical[t, list(rows[t])] = np.arange(D) * S + t

    def peers(stage: np.ndarray, pp: np.ndarray, mm: np.ndarray) -> np.ndarray:
        w = index.runner[(pp * S + stage) * M + mm]
        out = physical[stage, w // S]
        if (w < 0).any() or (out < 0).any():  # a valid plan never does this
            raise RecycleError(f"rank {rank}'s plan names no live worker for a neighbour")
        return out

    # What each op receives (from stage s-1 for F, s+1 for I and B) and sends (the other way).
    recv = np.flatnonzero((forward & (s > 0)) | (backward & (s < S - 1)))
    send = np.flatnonzero((forward & (s < S - 1)) | (backward & (s > 0)))
    fr = forward[recv]
    source = np.where(fr, s - 1, s + 1)
    pr, mr = p[recv], m[recv]
    made = np.where(fr, end[space.compute(F, pr, source, mr)],
                    np.fmin(end[space.compute(I, pr, source, mr)],
                            end[space.compute(B, pr, source, mr)]))
    fs = forward[send]
    ps, ms = p[send], m[send]
    ids = space.compute(kind[send], ps, s, ms)
    op = np.concatenate([recv, send])
    time = np.concatenate([made, end[ids]])
    tag = np.concatenate([message_tag(np.where(fr, FORWARD, BACKWARD), source, pr, mr, S, D, M),
                          message_tag(np.where(fs, FORWARD, BACKWARD), s, ps, ms, S, D, M)])
    peer = np.concatenate([peers(source, pr, mr), peers(np.where(fs, s + 1, s - 1), ps, ms)])
    sends = np.arange(len(op)) >= len(recv)
    step, which = issue_order(len(kind), op, sends, time, tag)
    message = step != RUN
    mine = which[message]
    at = which.copy()
    at[message] = op[mine]
    ranks = tuple(worker_index(S, q, s) for q in range(D) if (rows[s][q], s) not in index.dead)
    return RankOrder(rank, d, s, logical, (S, D, M), not plan.policy.stagger, ranks, step,
                     kind[at], p[at], m[at], _scatter(message, peer[mine], -1),
                     _scatter(message, time[mine], 0.0), _scatter(message, tag[mine], -1))


def _scatter(where: np.ndarray, values: np.ndarray, fill) -> np.ndarray:
    out = np.full(len(where), fill, dtype=np.asarray(fill).dtype if not len(values)
                  else values.dtype)
    out[where] = values
    return out


def compile_program(plan: Plan, rank: int, mapping: Mapping | None = None) -> Program:
    """The `Program` of physical `rank` in `plan` (see `rank_order`)."""
    return rank_order(plan, rank, mapping).program()


def rank_orders(plan: Plan, mapping: Mapping | None = None) -> dict[int, RankOrder]:
    """The order of every live rank of `plan`, by rank."""
    rows = (mapping or identity(plan)).logical_of_physical
    S, dead = plan.spec.stages, plan_index(plan).dead
    return {r: rank_order(plan, r, mapping) for r in sorted(
        worker_index(S, d, s) for s, row in enumerate(rows) for d, logical in enumerate(row)
        if (logical, s) not in dead)}


def compile_all(plan: Plan, mapping: Mapping | None = None) -> dict[int, Program]:
    """The program of every live rank of `plan`, by rank."""
    return {r: order.program() for r, order in rank_orders(plan, mapping).items()}
