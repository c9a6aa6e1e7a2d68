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

from typing import Mapping

import numpy as np

from recycle_planner.errors import RecycleError
from recycle_planner.programs.compile import RankOrder, rank_orders
from recycle_planner.programs.order import RECV, RUN, SEND
from recycle_planner.schedules.ops import AR, B, OPT, W
from recycle_planner.timing.plan import Plan

COLL = 3
STAGE, SCALARS, BARRIER = -1, -2, -3  # a collective event's host position code
NAMES = {STAGE: "the stage all-reduce", SCALARS: "the clipping sum", BARRIER: "the barrier"}


def check_plan(plan: Plan) -> None:
    """Raise a `RecycleError` (one line) if the programs of `plan` can deadlock or mix up
    messages on NCCL (the `serial` model, with the clipping sum)."""
    require_safe(rank_orders(plan))


def require_safe(orders: Mapping[int, RankOrder]) -> None:
    bad = check_orders(orders)
    if bad:
        raise RecycleError(f"the plan cannot run on NCCL: {bad[0]}")


def check_orders(orders: Mapping[int, RankOrder], iterations: int = 2,
                 scalars: bool = True) -> list[str]:
    """Problems of `orders` (every live rank's, by rank) over `iterations` consecutive
    iterations; empty: safe."""
    ranks = sorted(orders)
    events = [_events(orders[r], iterations, scalars) for r in ranks]
    rank = np.repeat(np.arange(len(ranks)), [len(e[0]) for e in events])
    kind, where, it, peer, tag = (np.concatenate([e[i] for e in events]) for i in range(5))
    name = _Names(orders, ranks, rank, where, it)
    problems = [f"rank {r}'s ALLREDUCE is over ranks {list(orders[r].ranks)}, without it"
                for r in ranks if r not in orders[r].ranks]
    event = np.full(len(kind), -1, dtype=np.int64)
    count = _match(ranks, rank, kind, peer, tag, it, event, name, problems)
    if problems:
        return problems
    participants = [2] * count + _collectives(orders, ranks, rank, kind, where, event, count)
    return _rounds(rank, event, np.asarray(participants), name)


def _events(order: RankOrder, iterations: int, scalars: bool):
    """One rank's events over `iterations`, in issue order: kind (SEND, RECV or COLL), host
    position (or a collective's code), iteration, and a message's peer and tag."""
    run = order.step == RUN
    grads = np.flatnonzero(run & ((order.kind == W) | (order.kind == B)))
    allreduce = np.flatnonzero(run & (order.kind == AR))
    position = [np.flatnonzero(~run).astype(float)]
    code = [np.flatnonzero(~run)]
    if len(order.ranks) > 1 and len(allreduce):  # started after the last gradient op
        position.append(np.array([(grads[-1] if len(grads) else allreduce[0]) + 0.5]))
        code.append(np.array([STAGE]))
    if scalars:  # summed and read by the host before the step
        position.append(np.flatnonzero(run & (order.kind == OPT)) - 0.5)
        code.append(np.full(len(position[-1]), SCALARS))
    if order.barrier:
        position.append(np.array([len(run) + 0.5]))
        code.append(np.array([BARRIER]))
    by = np.argsort(np.concatenate(position), kind="stable")
    where = np.concatenate(code)[by]
    at = np.maximum(where, 0)
    kind = np.where(where < 0, COLL, order.step[at])
    peer = np.where(where < 0, -1, order.peer[at])
    tag = np.where(where < 0, -1, order.tag[at])
    return (*(np.tile(column, iterations) for column in (kind, where)),
            np.repeat(np.arange(iterations), len(where)),
            *(np.tile(column, iterations) for column in (peer, tag)))


def _match(ranks, rank, kind, peer, tag, it, event, name, problems) -> int:
    """Number the messages: the n-th send from a to b and the n-th receive at b from a are one
    event (the events are in issue order within each rank, so a stable sort keeps n)."""
    me = np.asarray(ranks)[rank]
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


def _collectives(orders, ranks, rank, kind, where, event, first: int) -> list[int]:
    """Number the collectives: the n-th of each communicator on every member is one event;
    its participants."""
    everyone = tuple(ranks)
    keys: dict[tuple, int] = {}
    participants: list[int] = []
    seen: dict[tuple, int] = {}
    for i in np.flatnonzero(kind == COLL).tolist():
        r = ranks[rank[i]]
        code = int(where[i])
        members = orders[r].ranks if code == STAGE else everyone
        n = seen[r, code] = seen.get((r, code), -1) + 1
        key = (code, members, n)
        if key not in keys:
            keys[key] = first + len(participants)
            participants.append(len(members))
        event[i] = keys[key]
    return participants


def _rounds(rank, event, participants, name) -> list[str]:
    """Move every rank past its next event while all the event's participants are there."""
    ranks = int(rank.max()) + 1 if len(rank) else 0
    ends = np.cumsum(np.bincount(rank, minlength=ranks))
    heads = ends - np.bincount(rank, minlength=ranks)
    while True:
        live = np.flatnonzero(heads < ends)
        if not len(live):
            return []
        at = event[heads[live]]
        found, inverse, counts = np.unique(at, return_inverse=True, return_counts=True)
        ready = counts[inverse] == participants[at]
        if not ready.any():
            stuck = [name(int(heads[r]), rank_too=True) for r in live[:6]]
            return [f"deadlock under the 'serial' model ({len(live)} ranks blocked): "
                    + "; ".join(stuck)]
        heads[live[ready]] += 1


class _Names:
    """Readable names of events, for the one line that reports a problem."""

    def __init__(self, orders, ranks, rank, where, it):
        self.orders, self.ranks, self.rank, self.where, self.it = orders, ranks, rank, where, it
        self.programs: dict[int, object] = {}

    def __call__(self, i: int, rank_too: bool = False) -> str:
        r = self.ranks[self.rank[i]]
        k = int(self.where[i])
        if k < 0:
            label = NAMES[k]
        else:
            if r not in self.programs:
                self.programs[r] = self.orders[r].program()
            label = str(self.programs[r].actions[k])
        text = f"{label} of iteration {self.it[i]}"
        return f"rank {r} waits at {text}" if rank_too else text
