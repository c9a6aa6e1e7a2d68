"""Forward-backward improvement of a list schedule (double justification, from project
scheduling: Li and Willis 1992, Valls et al. 2005).

The list scheduler decides left to right: a worker starts whatever ready op ranks first, so
the order of the work that gates the period (a loaded worker's last input gradients, which
must still travel up to stage 0 before its optimizer step) is an accident of the early
decisions. A backward pass list-schedules the mirrored job instead: time runs backwards, every
dependency is flipped, a weight gradient takes a micro-batch's memory and its forward gives it
back, and each worker starts, among its ready ops, the one that ends latest in the current
schedule. Its orders reversed are a valid plan packed against the end of the iteration. A
forward pass then list-schedules the job again (patiently, `heuristic.list_schedule`) with the
backward plan's start times as priorities. Rounds of the two passes keep the shortest plan
met, never one longer than the start. The peer assignment stays the start plan's.

A worker runs its ops one after the other, so its peak in-flight memory is a property of its
order alone: the backward pass keeps the cap by letting a weight gradient start only while
fewer than `cap` micro-batches are held in mirrored time, and every plan it returns keeps it.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace

import numpy as np

from recycle_planner.job.policy import Policy, budget_caps
from recycle_planner.job.spec import JobSpec
from recycle_planner.schedules.ops import B, COMPUTE_KINDS, F, W, worker_at
from recycle_planner.schedules.schedule import Schedule, with_collectives
from recycle_planner.solvers.heuristic import Candidate, ListSettings, list_schedule, template_keys
from recycle_planner.timing.simulate import Simulation, cost_table, data_edges, simulate

ROUNDS = 1
"""Backward and forward passes per start. On the 8x8x16 library a second round from the same
start gained less than a first round from more starts (the passes settle into a cycle of two
plans): the heuristic's three best and the DP's plan, one round each, 2.22% mean gap; its best
and the DP's, two rounds each, 2.40%; the same CPU."""
STARTS = 3
"""How many of the heuristic's candidates (the shortest) the passes start from; starting from
every one gave 2.14% for 1.8 times the CPU."""
RETRY_ABOVE_GAP = 0.01
"""Where the improved plan is still more than this share above its situation's proven lower
bound, more starting points are improved: the heuristic's other candidates
(portfolio.with_more_starts) and, in a library, the other placements of the holes
(library/placement.py). On the 8x8x16 library 86 of 165 plans pay for them. Any gap (1e-6)
instead: 8x8x16 1.043% -> 1.031% for 2.4 s more CPU, GPT 0.29% -> 0.26%, but its library
then took 59.3 s wall (55.0 s at 1%), too close to its 60 s target."""
UP_TO_OPS = 50_000
"""Plans with more ops than this are not improved: two rounds from one start took 8 s of CPU
at 1,024 workers (200k ops; nothing shorter on a sample), which the 1,024-worker library's
10-minute target cannot pay for 153 situations. Up to it a round costs about 0.03 s at
8x8x16 (3,200 ops); two rounds 0.7 s at 16x16x32 (25k)."""


@dataclass(frozen=True, eq=False)
class OpGraph:
    """The compute ops of a schedule as a graph: op ids, the worker index running each, its
    duration, its change of the worker's in-flight micro-batches (F +1, W or B -1), and the
    data dependencies (source, destination, p2p latency) as positions in `ids`."""

    ids: np.ndarray
    workers: np.ndarray
    duration: np.ndarray
    holds: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    latency: np.ndarray


def op_graph(schedule: Schedule) -> OpGraph:
    ids, workers = schedule.flat
    space = schedule.space
    compute = space.decode(ids)[0] < COMPUTE_KINDS
    ids, workers = ids[compute], workers[compute]
    loc = np.full(space.size, -1, dtype=np.int64)
    loc[ids] = np.arange(len(ids))
    kind, pipe, stage, mb = space.decode(ids)
    src, dst, latency = data_edges(schedule, ids, loc, kind, pipe, stage, mb)
    return OpGraph(ids, workers, cost_table(schedule.spec)[kind, stage], in_flight_change(kind),
                   src, dst, latency)


def in_flight_change(kind: np.ndarray) -> np.ndarray:
    """Each op's change of its worker's in-flight micro-batches, by its kind: a forward takes
    one (+1), a weight gradient or fused backward frees one (-1), the rest 0."""
    return np.select([kind == F, (kind == W) | (kind == B)], [1, -1], 0)


def list_orders(graph: OpGraph, caps: list[int], key: np.ndarray,
                mirrored: bool) -> tuple[list[list[int]], np.ndarray]:
    """Non-delay list scheduling of the graph (mirrored: dependencies flipped, holds negated):
    whenever a worker is free it starts its ready op of least `key` (ties: the lower
    position), one that takes memory only below its cap. Every worker's order as positions
    in `graph.ids`, and every op's start, both in the pass's own time direction."""
    src, dst = (graph.dst, graph.src) if mirrored else (graph.src, graph.dst)
    n = len(graph.ids)
    succ: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    waiting = [0] * n
    for a, b, lat in zip(src.tolist(), dst.tolist(), graph.latency.tolist()):
        succ[a].append((b, lat))
        waiting[b] += 1
    workers, duration, keys = graph.workers.tolist(), graph.duration.tolist(), key.tolist()
    holds = (-graph.holds if mirrored else graph.holds).tolist()
    n_workers = len(caps)
    ready_at = [0.0] * n
    future: list[list] = [[] for _ in range(n_workers)]  # (ready time, key, op)
    taking: list[list] = [[] for _ in range(n_workers)]  # ready ops that take memory
    other: list[list] = [[] for _ in range(n_workers)]   # every other ready op
    free_at = [0.0] * n_workers
    wake = [math.inf] * n_workers
    inflight = [0] * n_workers
    left = np.bincount(graph.workers, minlength=n_workers).tolist()
    orders: list[list[int]] = [[] for _ in range(n_workers)]
    start = np.zeros(n)
    events: list[tuple[float, int]] = []
    heappush, heappop = heapq.heappush, heapq.heappop

    def release(op: int, t: float) -> None:
        w = workers[op]
        heappush(future[w], (t, keys[op], op))
        if t < wake[w] and free_at[w] <= t:
            wake[w] = t
            heappush(events, (t, w))

    for op in range(n):
        if waiting[op] == 0:
            release(op, 0.0)
    while events:
        t, w = heappop(events)
        if t != wake[w] or free_at[w] > t or left[w] == 0:
            continue  # superseded, busy, or done
        wake[w] = math.inf
        fut = future[w]
        while fut and fut[0][0] <= t:
            _, k, op = heappop(fut)
            heappush(taking[w] if holds[op] > 0 else other[w], (k, op))
        qt = taking[w] if inflight[w] < caps[w] else None
        qo = other[w]
        q = qt if qt and (not qo or qt[0] < qo[0]) else qo
        if not q:
            if fut:
                wake[w] = fut[0][0]
                heappush(events, (wake[w], w))
            continue
        op = heappop(q)[1]
        end = t + duration[op]
        inflight[w] += holds[op]
        free_at[w] = wake[w] = end
        heappush(events, (end, w))
        orders[w].append(op)
        start[op] = t
        left[w] -= 1
        for b, lat in succ[op]:
            waiting[b] -= 1
            ready_at[b] = max(ready_at[b], end + lat)
            if waiting[b] == 0:
                release(b, ready_at[b])
    if any(left):  # a bug, not bad input: with every cap >= 1 the first stage always drains
        raise RuntimeError("backward list scheduling stalled")
    return orders, start


def _with_orders(schedule: Schedule, graph: OpGraph, orders: list[list[int]]) -> Schedule:
    """`schedule` with every live worker's compute ops in `orders` (positions in graph.ids)."""
    S = schedule.spec.stages
    out = [with_collectives(schedule.space, *worker_at(S, w), graph.ids[order])
           if len(schedule.orders[w]) else schedule.orders[w] for w, order in enumerate(orders)]
    return Schedule(spec=schedule.spec, policy=schedule.policy, failed=schedule.failed,
                    orders=tuple(out))


def assignment_of(schedule: Schedule) -> np.ndarray:
    """assignment[d, s, m]: the pipeline whose stage-s worker runs micro-batch m of pipeline d
    in `schedule` (heuristic.ListSettings' form)."""
    spec = schedule.spec
    ids, workers = schedule.flat
    kind, pipe, stage, mb = schedule.space.decode(ids)
    f = kind == F
    assign = np.zeros((spec.pipelines, spec.virtual_stages, spec.microbatches), dtype=np.int64)
    assign[pipe[f], stage[f], mb[f]] = worker_at(spec.stages, workers[f])[0]
    return assign


def worker_caps(spec: JobSpec, policy: Policy) -> list[int]:
    """The memory cap of every worker index (budget_caps is per stage)."""
    caps = budget_caps(spec, policy)
    return [caps[worker_at(spec.stages, w)[1]] for w in range(spec.workers)]


def backward_pass(sim: Simulation, graph: OpGraph, caps: list[int]) -> tuple[Simulation, dict]:
    """The mirrored list schedule of `sim`'s ops, latest-ending first: the plan of its orders
    reversed, and each op's start in it, packed against the end (the next forward pass's
    priorities, keyed like `ListSettings.op_keys`)."""
    orders, mirrored_start = list_orders(graph, caps, -sim.timing.end[graph.ids], mirrored=True)
    schedule = _with_orders(sim.schedule, graph, [order[::-1] for order in orders])
    mirrored_end = mirrored_start + graph.duration
    kind, pipe, stage, mb = schedule.space.decode(graph.ids)
    op_keys = dict(zip(zip(kind.tolist(), pipe.tolist(), stage.tolist(), mb.tolist()),
                       (mirrored_end.max() - mirrored_end).tolist()))
    return simulate(schedule), op_keys


def improve(spec: JobSpec, policy: Policy, start: Candidate, rounds: int = ROUNDS) -> Candidate:
    """The shortest of `start` and the plans of `rounds` backward and forward passes from it
    (see the module docstring); `start` itself when none is shorter."""
    schedule = start.simulation.schedule
    forward = ListSettings(assignment_of(schedule), budget_caps(spec, policy),
                           template_keys(spec, policy), patient=True)
    caps = worker_caps(spec, policy)
    graph = op_graph(schedule)
    best, current = start, start.simulation
    for _ in range(rounds):
        mirrored, op_keys = backward_pass(current, graph, caps)
        current = simulate(list_schedule(spec, policy, schedule.failed,
                                         replace(forward, op_keys=op_keys)))
        for sim in (mirrored, current):
            if sim.period < best.simulation.period - 1e-9:
                best = Candidate(f"{start.name}, justified", sim)
    return best


def justified(spec: JobSpec, policy: Policy, found: list[Candidate]) -> list[Candidate]:
    """`found` and the improvement of each of its plans that the improvement shortens (every
    one, not only the shortest: from the heuristic's and the DP's plans the passes reach
    different plans, so `auto` is never longer than the heuristic solver); `found` alone above
    UP_TO_OPS, and for workers with several chunks (the mirrored pass's memory gate has no
    per-chunk reserve, heuristic._forward_queue's, and can stall there)."""
    if spec.chunks > 1 or max(c.simulation.schedule.n_ops for c in found) > UP_TO_OPS:
        return found
    better = [improve(spec, policy, c) for c in found]
    return [*found, *(b for b, c in zip(better, found) if b is not c)]
