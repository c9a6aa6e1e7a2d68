"""Critical-path local search: swap adjacent ops where the chain that sets the period waits.

The list scheduler and the forward-backward improvement (improve.py) decide whole orders from
priorities; what they leave is often an op that waits on its worker behind another it need
not wait for. With the staggered optimizer the period is the mean of the slowest cycle of the
periodic schedule (max-plus algebra): in the steady iteration every op starts when its last
input arrives, when its worker's previous op ends or, for a worker's first op, when its
previous iteration's optimizer step ends; following those "tight" predecessors back from a
stage's step must close a cycle, and a cycle of tight edges is critical. With a barrier the
chain runs back from the op that ends last to the iteration's start. Only a change on such a
chain can shorten the plan. The neighbourhood is the job-shop one of Nowicki and Smutnicki
(1996): on a chain, a block is a run of ops on one worker each waiting for the one before;
swapping inside a block keeps where the block starts and ends, so only its first two and its
last two ops are swapped. A swap is kept if it keeps the memory cap and makes the plan shorter
or, at the same period, shortens the sum of the workers' spans (symmetric peers run twin
critical cycles: one swap shortens one of them, and only the sum sees it); the search moves to
the first such swap, in chain order, and stops at a local optimum or after `MAX_EVALUATIONS`
simulations. Every plan it returns is one the simulator timed and the cap check passed; swaps
that deadlock are skipped. Deterministic: no randomness, ties in chain order.

On the 8x8x16 library this took the mean gap from 1.04% to 0.92% (benchmarks/README.md).
Tried and not kept: every adjacent pair on a chain (N1) instead of the block ends, and the walk
into the cycle as well as the cycle: 0.934% instead of 0.938% on the same plans for 10 times
the CPU (30 s against 2.7-4.0 s).
"""

from __future__ import annotations

import numpy as np

from recycle_planner.errors import ScheduleError
from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.schedules.ops import COMPUTE_KINDS, OPT
from recycle_planner.schedules.schedule import Schedule
from recycle_planner.solvers.heuristic import Candidate
from recycle_planner.solvers.improve import in_flight_change, worker_caps
from recycle_planner.timing.simulate import DependencyGraph, Simulation, simulate

MAX_EVALUATIONS = 200
"""Swaps tried per search (a simulation each, about 3 ms at 8x8x16). Only a pathological case
reaches it: on the 8x8x16 library's plans a search took 0.03-0.04 s on average."""

_TIE = 1e-9


def key(sim: Simulation) -> tuple[float, float]:
    """What a swap must shorten: the period, then the sum over live workers of the span from
    their first op's start to their last compute op's end (in one steady iteration)."""
    g = sim.graph
    start, end = _node_times(sim)
    n = g.n
    compute = g.kind[:n] < COMPUTE_KINDS
    last = np.full(g.n_workers, -np.inf)
    np.maximum.at(last, g.workers[:n][compute], end[:n][compute])
    busy = np.isfinite(last)  # the live workers (each runs compute ops)
    return sim.period, float(np.sum(last[busy] - start[g.first_of_worker[busy]]))


def _shorter(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """a < b, with ties within rounding."""
    scale = max(1.0, abs(b[0]))
    if a[0] < b[0] - _TIE * scale:
        return True
    return abs(a[0] - b[0]) <= _TIE * scale and a[1] < b[1] - _TIE * max(1.0, abs(b[1]))


def _node_times(sim: Simulation) -> tuple[np.ndarray, np.ndarray]:
    """Start and end of every node of the dependency graph (ops, then the all-reduces' virtual
    nodes) in the iteration the period is read from: the steady one with the staggered
    optimizer, else the first."""
    g = sim.graph
    if sim.steady_start is None:
        return g.run()
    start = np.full(g.n_nodes, -np.inf)
    start[:g.n] = sim.steady_start
    end = start + g.dur
    virtual = g.dst >= g.n
    np.maximum.at(start, g.dst[virtual], end[g.src[virtual]] + g.lat[virtual])
    end[g.n:] = start[g.n:]
    return start, end


def critical_chains(sim: Simulation) -> list[list[tuple[int, bool]]]:
    """The critical chains, each in time order as (node, whether it waits for its worker's
    previous op): walking back along tight predecessors from each stage's optimizer step to the
    cycle the walk closes (staggered; the cycle starts at an op that does not wait for its
    worker), or from the op that ends last to the iteration's start (barrier)."""
    g = sim.graph
    start, end = _node_times(sim)
    period = sim.period
    tol = 1e-7 * max(1.0, period)
    tight = np.abs(end[g.src] + g.lat - start[g.dst]) <= tol
    worker_edge = (g.dst < g.n) & (g.wpred[np.minimum(g.dst, g.n - 1)] == g.src)
    # Each node's tight predecessor: a data (or all-reduce) edge before the worker's own.
    data_pred = np.full(g.n_nodes, -1, dtype=np.int64)
    for e in np.flatnonzero(tight & ~worker_edge)[::-1].tolist():
        data_pred[g.dst[e]] = g.src[e]
    worker_tight = np.zeros(g.n_nodes, dtype=bool)
    worker_tight[g.dst[tight & worker_edge]] = True
    # A worker's first op <- its previous iteration's last (the step). Exact where every
    # iteration is the one before shifted by the period; where the simulation settled into a
    # longer pattern or did not settle, the link may not be found and the walk ends there
    # (a shorter chain, fewer swaps; each swap is still judged by the simulator).
    previous = {}
    if sim.steady_start is not None:
        for f, last in zip(g.first_of_worker.tolist(), g.last_of_worker.tolist()):
            if f >= 0 and abs(end[last] - period - start[f]) <= tol:
                previous[f] = last

    def pred(x: int) -> tuple[int, bool]:
        if data_pred[x] >= 0:
            return int(data_pred[x]), False
        if x < g.n and worker_tight[x]:
            return int(g.wpred[x]), True
        return previous.get(x, -1), False

    if sim.steady_start is None:
        roots = [int(np.argmax(end[:g.n]))]
    else:
        steps = np.flatnonzero(g.kind == OPT)
        roots = [int(steps[g.stage[steps] == s][0]) for s in np.unique(g.stage[steps]).tolist()]
    chains, seen = [], set()
    for x in roots:
        walk: dict[int, bool] = {}  # node -> whether it waits for its worker's previous op
        while x >= 0 and x not in walk:
            x_pred, walk[x] = pred(x)
            x = x_pred
        nodes = list(walk)
        if x >= 0:  # staggered: only the cycle is critical (the way into it has slack)
            nodes = nodes[nodes.index(x):]
            # Start the chain (in time order) at an op that does not wait for its worker, so
            # that no block is split between the chain's two ends.
            cut = next((i for i, y in enumerate(nodes) if not walk[y]), len(nodes) - 1)
            nodes = nodes[cut + 1:] + nodes[:cut + 1]
        chain = [(y, walk[y]) for y in reversed(nodes)]
        if not seen.issuperset(y for y, _ in chain):
            chains.append(chain)
            seen.update(y for y, _ in chain)
    return chains


def swaps(sim: Simulation) -> list[tuple[int, int]]:
    """(worker, position) of the second and of the last op of every block of a critical chain
    (ops that run back to back on one worker, each waiting for the one before): moving it one
    place earlier is a swap. Only a block's ends can shorten the chain (Nowicki and Smutnicki
    1996): swapping inside a block keeps where it starts and ends. Both ops must be compute
    ops of different micro-batches."""
    g = sim.graph
    offsets = np.concatenate([[0], np.cumsum([len(o) for o in sim.schedule.orders])])
    out: dict[tuple[int, int], None] = {}
    for chain in critical_chains(sim):
        blocks: list[list[int]] = []
        for y, waits in chain:
            if waits and blocks:
                blocks[-1].append(y)
            else:
                blocks.append([y])
        for block in blocks:
            for x in (dict.fromkeys((block[1], block[-1])) if len(block) > 1 else ()):
                y = int(g.wpred[x])
                if x < g.n and g.kind[x] < COMPUTE_KINDS and g.kind[y] < COMPUTE_KINDS \
                        and _unit(g, x) != _unit(g, y):
                    w = int(g.workers[x])
                    out.setdefault((w, int(x - offsets[w])), None)
    return list(out)


def _unit(g: DependencyGraph, x: int) -> tuple[int, int, int]:
    """The micro-batch and stage (pipeline, stage, micro-batch) that node x works on."""
    return int(g.pipe[x]), int(g.stage[x]), int(g.mb[x])


def swapped(schedule: Schedule, worker: int, position: int) -> Schedule:
    """`schedule` with the ops at `position` - 1 and `position` of `worker` exchanged."""
    order = np.array(schedule.orders[worker])
    order[position - 1], order[position] = order[position], order[position - 1]
    orders = list(schedule.orders)
    orders[worker] = order
    return Schedule(spec=schedule.spec, policy=schedule.policy, failed=schedule.failed,
                    orders=tuple(orders))


def local_search(spec: JobSpec, policy: Policy, start: Candidate,
                 max_evaluations: int = MAX_EVALUATIONS) -> Candidate:
    """The plan the search reaches from `start` (see the module docstring); `start` itself when
    no swap shortens it."""
    caps = worker_caps(spec, policy)
    holds = _holds(start.simulation.schedule)
    current, best_key, evaluations = start.simulation, key(start.simulation), 0
    while evaluations < max_evaluations:
        for w, i in swaps(current):
            order = current.schedule.orders[w]
            if not _fits(order, i, holds, caps[w]):
                continue
            evaluations += 1
            try:
                sim = simulate(swapped(current.schedule, w, i))
            except ScheduleError:  # a cycle of waits (a safety net: with positive op costs a
                continue           # swap of two ops that were tight in time makes none)
            k = key(sim)
            if _shorter(k, best_key):
                current, best_key = sim, k
                break
            if evaluations >= max_evaluations:
                break
        else:
            break  # a local optimum
    if current.period < start.simulation.period - _TIE * max(1.0, start.simulation.period):
        return Candidate(f"{start.name}, swapped", current)
    return start


def _holds(schedule: Schedule) -> np.ndarray:
    """Change of a worker's in-flight micro-batches per op id (F +1, W or fused B -1)."""
    return in_flight_change(schedule.space.decode(np.arange(schedule.space.size))[0])


def _fits(order: np.ndarray, i: int, holds: np.ndarray, cap: int) -> bool:
    """Whether swapping positions i - 1 and i keeps the worker within its cap: only an op that
    takes memory moved before one that frees it raises the count, there by one."""
    a, b = int(order[i - 1]), int(order[i])
    if holds[b] <= 0 or holds[a] >= 0:
        return True
    return int(np.sum(holds[np.asarray(order[: i - 1])])) + holds[b] <= cap
