"""Compile one rank's program from a plan: in time proportional to the rank's own ops.

The plan names logical workers (pipeline, stage); a library's `Lookup.mapping` says which
physical worker plays which (a plan made for physical dead workers, `plan --fail`, needs none).
A rank's ops are its logical worker's ops in the plan. For each of them the peer is whoever runs
the neighbouring stage of the same micro-batch: the forward of micro-batch m of pipeline p
receives from the worker that runs F(p, s-1, m) in this plan and sends to the one that runs
F(p, s+1, m), whether or not that is the rank's own pipeline (a re-routed micro-batch).

Who runs what is a table over every micro-batch of every stage (`PlanIndex`), built once per
plan with numpy and kept with the plan (a weak reference: it goes when the plan goes). A rank's
compile then reads only its own ops and the mapping, as arrays (`Orders`, what the NCCL check
replays, for one rank or all at once); `Program` objects are made from them for whoever wants
them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from recycle_planner.errors import RecycleError
from recycle_planner.job.situations import Mapping
from recycle_planner.programs.actions import (ACTIVATION, BACKWARD, FORWARD, GRADIENT, Action,
                                              AllReduce, Compute, Optimizer, Program, Recv, Send,
                                              message_tag)
from recycle_planner.programs.order import RECV, RUN, SEND, issue_order
from recycle_planner.schedules.ops import (AR, B, F, I, KIND_CODES, KIND_NAMES, OPT)
from recycle_planner.timing.plan import Plan


@dataclass(frozen=True, eq=False)
class PlanIndex:
    """`runner[unit]`: the logical worker index that runs F of each micro-batch unit
    ((pipeline * S + stage) * M + microbatch; -1: nobody); `alive[w]`: whether logical worker
    index w is alive in the plan."""

    runner: np.ndarray
    alive: np.ndarray


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
        alive = np.array([len(order) > 0 for order in plan.schedule.orders])
        index = _INDEXES[plan] = PlanIndex(runner, alive)
    return index


def identity(plan: Plan) -> Mapping:
    """The mapping of a plan whose workers are physical (every worker plays its own pipeline)."""
    return Mapping(tuple(tuple(range(plan.spec.pipelines)) for _ in range(plan.spec.stages)))


@dataclass(frozen=True, eq=False)
class Orders:
    """Several ranks' programs as flat arrays, rank after rank (`ranks`, ascending), each in
    issue order from `start[i]` to `start[i + 1]`: per step, `step` (RUN, RECV, SEND), the op it
    runs or whose message it is (`kind` code, `op_pipeline`, `op_microbatch`; -1 for the
    collectives), and for a message its `peer` (physical rank), `time` and `tag`. `plays[i]`
    is rank i's logical pipeline, `groups[i]` its stage's live ranks. What the NCCL check reads;
    `program(rank)` is one rank's `Program`."""

    ranks: tuple[int, ...]
    start: np.ndarray
    shape: tuple[int, int, int]   # stages, pipelines, microbatches
    barrier: bool
    plays: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    step: np.ndarray
    kind: np.ndarray
    op_pipeline: np.ndarray
    op_microbatch: np.ndarray
    peer: np.ndarray
    time: np.ndarray
    tag: np.ndarray

    def program(self, rank: int) -> Program:
        i = self.ranks.index(rank)
        part = slice(int(self.start[i]), int(self.start[i + 1]))
        S = self.shape[0]
        actions: list[Action] = []
        columns = (self.step[part].tolist(), self.kind[part].tolist(),
                   self.op_pipeline[part].tolist(), self.op_microbatch[part].tolist(),
                   self.peer[part].tolist(), self.time[part].tolist(), self.tag[part].tolist())
        for step, kind, p, m, peer, time, tag in zip(*columns):
            if step == RUN:
                actions.append(AllReduce(self.groups[i]) if kind == AR else Optimizer()
                               if kind == OPT else Compute(KIND_NAMES[kind], rank % S, p, m))
            else:
                what = ACTIVATION if kind == F else GRADIENT
                actions.append((Recv if step == RECV else Send)(what, p, m, peer, time, tag))
        return Program(rank, rank // S, rank % S, self.plays[i], *self.shape, self.barrier,
                       tuple(actions))

    def programs(self) -> dict[int, Program]:
        return {rank: self.program(rank) for rank in self.ranks}

    @classmethod
    def of_programs(cls, programs: Iterable[Program]) -> "Orders":
        """The orders of programs made or edited by hand (the checks read arrays)."""
        programs = sorted(programs, key=lambda p: p.rank)
        rows = []
        for program in programs:
            for a in program.actions:
                if isinstance(a, Compute):
                    rows.append((RUN, KIND_CODES[a.kind], a.pipeline, a.microbatch, -1, 0.0, -1))
                elif isinstance(a, (AllReduce, Optimizer)):
                    code = AR if isinstance(a, AllReduce) else OPT
                    rows.append((RUN, code, -1, -1, -1, 0.0, -1))
                else:
                    rows.append((RECV if isinstance(a, Recv) else SEND,
                                 F if a.what == ACTIVATION else I, a.pipeline, a.microbatch,
                                 a.peer, a.time, a.tag))
        first = programs[0]
        return cls(tuple(p.rank for p in programs),
                   np.cumsum([0] + [len(p.actions) for p in programs]),
                   (first.stages, first.pipelines, first.microbatches), first.barrier,
                   tuple(p.plays for p in programs),
                   tuple(next((a.ranks for a in p.actions if isinstance(a, AllReduce)), ())
                         for p in programs),
                   *(np.array(column) for column in zip(*rows)))


def compile_orders(plan: Plan, ranks, mapping: Mapping | None = None) -> Orders:
    """The programs of physical `ranks` (pipeline-major: pipeline * stages + stage) in `plan`,
    as arrays, in time proportional to their own ops. `mapping` (a library lookup's) says which
    logical worker each physical one plays; without it the plan's workers are the physical
    ones. A dead rank has no program."""
    spec = plan.spec
    S, D, M = spec.stages, spec.pipelines, spec.microbatches
    if spec.chunks > 1:
        raise RecycleError(f"programs are compiled for one chunk per worker, but this plan's "
                           f"workers hold {spec.chunks}: running virtual stages is a later step")
    ranks = np.array(sorted(ranks), dtype=np.int64)
    outside = ranks[(ranks < 0) | (ranks >= S * D)]
    if len(outside):
        raise RecycleError(f"rank {outside[0]} is outside the job's {S * D} ranks")
    rows = np.asarray((mapping or identity(plan)).logical_of_physical, dtype=np.int64)
    index = plan_index(plan)
    d, s = ranks // S, ranks % S
    worker = rows[s, d] * S + s
    dead = ranks[~index.alive[worker]]
    if len(dead):
        r = int(dead[0])
        raise RecycleError(f"rank {r} (worker {r // S}:{r % S}) is dead in this plan: it has no "
                           f"program")
    own = [plan.schedule.orders[w] for w in worker.tolist()]
    lengths = np.array([len(o) for o in own], dtype=np.int64)
    op_rank = np.repeat(ranks, lengths)
    op = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    kind, p, _, m = plan.schedule.space.decode(np.concatenate(own) if own else
                                               np.zeros(0, np.int64))
    message, sends, time, tag, peer = _messages(plan, index, rows, op_rank % S, kind, p, m)
    order = issue_order(op_rank, op, op_rank[message], op[message], sends, time, tag)
    is_message = order >= len(kind)
    msg = np.where(is_message, order - len(kind), len(message))  # past the end: a RUN step
    at = np.where(is_message, np.append(message, 0)[msg], order)

    def column(values: np.ndarray, fill) -> np.ndarray:
        return np.append(values, fill)[msg]

    counts = np.bincount(np.searchsorted(ranks, op_rank[at]), minlength=len(ranks))
    groups = {t: tuple((np.flatnonzero(index.alive[rows[t] * S + t]) * S + t).tolist())
              for t in set(s.tolist())}  # each stage's live ranks
    return Orders(tuple(ranks.tolist()), np.concatenate([[0], np.cumsum(counts)]), (S, D, M),
                  not plan.policy.stagger, tuple(rows[s, d].tolist()),
                  tuple(groups[t] for t in s.tolist()), column(np.where(sends, SEND, RECV), RUN),
                  kind[at], p[at], m[at], column(peer, -1), column(time, 0.0), column(tag, -1))


def _messages(plan: Plan, index: PlanIndex, rows: np.ndarray, stage: np.ndarray,
              kind: np.ndarray, p: np.ndarray, m: np.ndarray):
    """The messages of ops (their `stage`, `kind`, pipeline `p`, micro-batch `m`): each op's
    receive (from stage s-1 for F, s+1 for I and B) and send (the other way). Per message: the
    index of its op, whether it is a send, its key (time, tag) and its peer's rank."""
    S, D, M = plan.spec.stages, plan.spec.pipelines, plan.spec.microbatches
    space, end = plan.schedule.space, plan.timing.end
    physical = np.empty((S, D), dtype=np.int64)  # the rank of each logical worker
    physical[np.arange(S)[:, None], rows] = np.arange(D)[None, :] * S + np.arange(S)[:, None]

    def peers(at: np.ndarray, pp: np.ndarray, mm: np.ndarray) -> np.ndarray:
        w = index.runner[(pp * S + at) * M + mm]
        if (w < 0).any() or not index.alive[w].all():  # a valid plan never does this
            raise RecycleError("the plan names no live worker for a neighbour of a rank")
        return physical[at, w // S]

    forward, backward = kind == F, (kind == I) | (kind == B)
    recv = np.flatnonzero((forward & (stage > 0)) | (backward & (stage < S - 1)))
    send = np.flatnonzero((forward & (stage < S - 1)) | (backward & (stage > 0)))
    fr, pr, mr = forward[recv], p[recv], m[recv]
    source = np.where(fr, stage[recv] - 1, stage[recv] + 1)
    made = np.where(fr, end[space.compute(F, pr, source, mr)],
                    np.fmin(end[space.compute(I, pr, source, mr)],
                            end[space.compute(B, pr, source, mr)]))
    fs, ss, ps, ms = forward[send], stage[send], p[send], m[send]
    time = np.concatenate([made, end[space.compute(kind[send], ps, ss, ms)]])
    tag = np.concatenate([message_tag(np.where(fr, FORWARD, BACKWARD), source, pr, mr, S, D, M),
                          message_tag(np.where(fs, FORWARD, BACKWARD), ss, ps, ms, S, D, M)])
    peer = np.concatenate([peers(source, pr, mr), peers(np.where(fs, ss + 1, ss - 1), ps, ms)])
    sends = np.arange(len(recv) + len(send)) >= len(recv)
    return np.concatenate([recv, send]), sends, time, tag, peer


def compile_program(plan: Plan, rank: int, mapping: Mapping | None = None) -> Program:
    """The `Program` of physical `rank` in `plan` (see `compile_orders`)."""
    return compile_orders(plan, [rank], mapping).program(rank)


def lookup_program(library, dead, rank: int) -> Program:
    """The program of physical `rank` when the physical workers `dead` are dead, from a
    `PlanLibrary` (its lookup: the plan and the mapping). A launcher with many ranks in one
    process reads the plan once and calls `compile_program` for each."""
    hit = library.lookup(dead)
    return compile_program(hit.plan(), rank, hit.mapping)


def rank_orders(plan: Plan, mapping: Mapping | None = None) -> Orders:
    """The orders of every live rank of `plan`."""
    S = plan.spec.stages
    rows = np.asarray((mapping or identity(plan)).logical_of_physical, dtype=np.int64)
    alive = plan_index(plan).alive[rows * S + np.arange(S)[:, None]]  # (stage, pipeline)
    stage, pipeline = np.nonzero(alive)
    return compile_orders(plan, pipeline * S + stage, mapping)


def compile_all(plan: Plan, mapping: Mapping | None = None) -> dict[int, Program]:
    """The program of every live rank of `plan`, by rank."""
    return rank_orders(plan, mapping).programs()
