"""The NCCL check every plan passes once, when it is made or stored: fast, on arrays.

It replays the strictest model of `nccl.py` (`serial`: each rank completes one operation at a
time, in issue order) with the clipping sum and the barrier. Under that model a rank's compute
never waits (its receive completed before it), so only its *events* matter: its messages, its
stage's all-reduce after its last gradient op, the clipping sum at its optimizer step, the
barrier. A message is one event for its two ends (the n-th send from a to b is the n-th receive
at b from a, NCCL's rule), a collective one event for its members. Every round, each rank whose
next event has every participant waiting at it moves past it; the programs are safe when every
rank reaches its end. In numpy per round over the ranks: 0.1 s for a 100,000-op plan, where the
item-by-item replay of `nccl.py` takes seconds. tests/test_programs.py checks that the two agree
on every plan of the example libraries and on every hand-made order of tests/test_nccl_rules.py.
"""

from __future__ import annotations

import numpy as np

from recycle_planner.errors import RecycleError
from recycle_planner.programs.actions import Program
from recycle_planner.programs.compile import Orders, rank_orders
from recycle_planner.programs.order import RECV, RUN, SEND
from recycle_planner.schedules.ops import AR, B, OPT, W
from recycle_planner.timing.plan import Plan

COLL = 3
STAGE, SCALARS, BARRIER = -1, -2, -3  # a collective event's host position code
NAMES = {STAGE: "the stage all-reduce", SCALARS: "the clipping sum", BARRIER: "the barrier"}


def check_plan(plan: Plan) -> None:
    """Raise a `RecycleError` (one line) if the programs of `plan` can deadlock or mix up
    messages on NCCL (the `serial` model, with the clipping sum). A plan whose workers hold
    several chunks has no programs yet (compile_orders refuses it): nothing runs it on NCCL."""
    if plan.spec.chunks == 1:
        require_safe(rank_orders(plan))


def require_safe(orders: Orders) -> None:
    bad = check_orders(orders)
    if bad:
        raise RecycleError(f"the plan cannot run on NCCL: {bad[0]}")


def check_orders(orders: Orders, iterations: int = 2, scalars: bool = True) -> list[str]:
    """Problems of `orders` (every live rank's) over `iterations` consecutive iterations;
    empty: safe."""
    rank, kind, where, it = _events(orders, iterations, scalars)
    ranks = np.asarray(orders.ranks)
    me = ranks[rank]
    name = _Names(orders, me, where, it)
    problems = [f"rank {r}'s ALLREDUCE is over ranks {list(group)}, without it"
                for r, group in zip(orders.ranks, orders.groups) if r not in group]
    at = np.maximum(where, 0)
    peer = np.where(where < 0, -1, orders.peer[at] if len(orders.peer) else -1)
    tag = np.where(where < 0, -1, orders.tag[at] if len(orders.tag) else -1)
    event = np.full(len(kind), -1, dtype=np.int64)
    count = _match(me, kind, peer, tag, it, event, name, problems)
    if problems:
        return problems
    participants = np.concatenate([np.full(count, 2), _collectives(
        orders, rank, kind, where, event, count)])
    return _rounds(rank, len(ranks), event, participants, name)


def _events(orders: Orders, iterations: int, scalars: bool):
    """Every rank's events over `iterations`, rank by rank in issue order: its index in
    `orders.ranks`, kind (SEND, RECV or COLL), flat position of its step (or a collective's
    code), iteration."""
    n = len(orders.step)
    owner = np.repeat(np.arange(len(orders.ranks)), np.diff(orders.start))
    run = orders.step == RUN
    position = [np.flatnonzero(~run).astype(float)]
    code = [np.flatnonzero(~run)]
    owners = [owner[code[0]]]
    multi = np.array([len(g) > 1 for g in orders.groups], dtype=bool)
    last = np.full(len(orders.ranks), -1)  # per rank: its last W or B, else its ALLREDUCE
    np.maximum.at(last, owner[run & (orders.kind == AR)],
                  np.flatnonzero(run & (orders.kind == AR)))
    grads = np.full(len(orders.ranks), -1)
    np.maximum.at(grads, owner[run & ((orders.kind == W) | (orders.kind == B))],
                  np.flatnonzero(run & ((orders.kind == W) | (orders.kind == B))))
    launch = np.where(grads >= 0, grads, last)
    started = np.flatnonzero(multi & (launch >= 0))  # after the last gradient op
    collectives = [(launch[started] + 0.5, STAGE, started)]
    if scalars:  # summed and read by the host before the step
        steps = np.flatnonzero(run & (orders.kind == OPT))
        collectives.append((steps - 0.5, SCALARS, owner[steps]))
    if orders.barrier:
        collectives.append((orders.start[1:] - 0.5, BARRIER, np.arange(len(orders.ranks))))
    for at, which, who in collectives:
        position.append(np.asarray(at, dtype=float))
        code.append(np.full(len(at), which))
        owners.append(who)
    owner, position, code = (np.concatenate(c) for c in (owners, position, code))
    once = np.lexsort((position, owner))
    owner, code = owner[once], code[once]
    events = len(owner)
    rank = np.tile(owner, iterations)
    it = np.repeat(np.arange(iterations), events)
    by = np.lexsort((np.arange(len(rank)), it, rank))  # each rank's iterations in turn
    where = np.tile(code, iterations)[by]
    kind = np.where(where < 0, COLL, orders.step[np.maximum(where, 0)] if n else COLL)
    return rank[by], kind, where, it[by]


def _match(me, kind, peer, tag, it, event, name, problems) -> int:
    """Number the messages: the n-th send from a to b and the n-th receive at b from a are one
    event (the events are in issue order within each rank, so a stable sort keeps n)."""
    out = np.flatnonzero(kind == SEND)
    into = np.flatnonzero(kind == RECV)
    out = out[np.lexsort((out, peer[out], me[out]))]
    into = into[np.lexsort((into, me[into], peer[into]))]
    pairs_out = np.stack([me[out], peer[out]], axis=1)
    pairs_in = np.stack([peer[into], me[into]], axis=1)
    n = min(len(out), len(into))
    differ = np.flatnonzero((pairs_out[:n] != pairs_in[:n]).any(axis=1))
    if len(differ) or len(out) != len(into):
        i = int(differ[0]) if len(differ) else n
        send_first = i < len(out) and (i >= len(into) or tuple(pairs_out[i]) < tuple(
            pairs_in[i]))
        if send_first:
            problems.append(f"rank {me[out[i]]} sends {name(out[i])}, which rank {peer[out[i]]} "
                            f"never receives")
        else:
            problems.append(f"rank {me[into[i]]} waits for {name(into[i])}, which rank "
                            f"{peer[into[i]]} never sends")
        return 0
    wrong = np.flatnonzero((tag[out] != tag[into]) | (it[out] != it[into]))
    if len(wrong):
        a, b = out[wrong[0]], into[wrong[0]]
        problems.append(f"mismatch: rank {me[b]} receives {name(b)}, but rank {me[a]} sends "
                        f"{name(a)} first")
    event[out] = event[into] = np.arange(len(out))
    return len(out)


def _collectives(orders: Orders, rank, kind, where, event, first: int) -> np.ndarray:
    """Number the collectives: the n-th of each communicator on every member is one event;
    its participants."""
    coll = np.flatnonzero(kind == COLL)
    groups = {group: i for i, group in enumerate(dict.fromkeys(orders.groups))}
    everyone = len(groups)
    code = where[coll]
    members = np.where(code == STAGE, np.array([groups[g] for g in orders.groups])[rank[coll]]
                       if len(coll) else 0, everyone)
    # n: how many collectives of this communicator the rank had before (events are in order)
    by = np.lexsort((coll, code, rank[coll]))
    same = np.r_[False, (rank[coll][by][1:] == rank[coll][by][:-1])
                 & (code[by][1:] == code[by][:-1])]
    run_start = np.flatnonzero(~same)
    n = np.arange(len(by)) - np.repeat(run_start, np.diff(np.r_[run_start, len(by)]))
    nth = np.empty(len(by), dtype=np.int64)
    nth[by] = n
    keys, event[coll] = np.unique(np.stack([code, members, nth], axis=1), axis=0,
                                  return_inverse=True)
    event[coll] += first
    sizes = {i: len(g) for g, i in groups.items()}
    return np.array([sizes[k[1]] if k[0] == STAGE else len(orders.ranks) for k in keys.tolist()],
                    dtype=np.int64)


def _rounds(rank, ranks: int, event, participants, name) -> list[str]:
    """Move every rank past its next event while all the event's participants are there."""
    ends = np.cumsum(np.bincount(rank, minlength=ranks))
    heads = ends - np.bincount(rank, minlength=ranks)
    while True:
        live = np.flatnonzero(heads < ends)
        if not len(live):
            return []
        at = event[heads[live]]
        _, inverse, counts = np.unique(at, return_inverse=True, return_counts=True)
        ready = counts[inverse] == participants[at]
        if not ready.any():
            stuck = [name(int(heads[r]), rank_too=True) for r in live[:6]]
            return [f"deadlock under the 'serial' model ({len(live)} ranks blocked): "
                    + "; ".join(stuck)]
        heads[live[ready]] += 1


class _Names:
    """Readable names of events, for the one line that reports a problem."""

    def __init__(self, orders: Orders, me, where, it):
        self.orders, self.me, self.where, self.it = orders, me, where, it
        self.programs: dict[int, Program] = {}

    def __call__(self, i: int, rank_too: bool = False) -> str:
        r = int(self.me[i])
        k = int(self.where[i])
        if k < 0:
            label = NAMES[k]
        else:
            if r not in self.programs:
                self.programs[r] = self.orders.program(r)
            first = int(self.orders.start[self.orders.ranks.index(r)])
            label = str(self.programs[r].actions[k - first])
        text = f"{label} of iteration {self.it[i]}"
        return f"rank {r} waits at {text}" if rank_too else text
