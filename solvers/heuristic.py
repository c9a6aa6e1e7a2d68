"""List scheduling guided by the fault-free schedule: the fast heuristic for failure plans.

The dead workers' micro-batches are dealt round-robin to the live peers of their stage. Then
every worker, whenever it is idle, starts the ready op that comes first in the fault-free
schedule (by its start time there; a re-routed op takes the time its dead owner would have run
it), a forward only if the worker's memory cap allows one more in-flight micro-batch. Ties go
to the input-gradient backward, then the forward, then the weight gradient, then the worker's
own pipeline, then the lower pipeline: every worker derives the same plan from the same inputs.

With the I/W split the heuristic also tries: deferring every W until nothing else is ready (W
fills idle time, or runs because memory is full); the same "patiently" (a worker waits for an op
of higher priority that arrives before the one it could start would finish, which keeps the
template's order where data comes in time); the template's order with W deferred only once the
worker has started its last forward, patiently (where memory is short, deferring every W
starves the forwards, yet at the end the input backwards should go first: on memory-bound
8x8x16 situations up to 3% shorter); ZB-H1's order as the template, patiently (it fits
the same memory as 1F1B's peak; not for GPipe jobs, which keep their forward-first shape); and
the fused plan with each B cut into I and W. It keeps the candidate with the shortest period.
The last candidate is never slower than plain re-routing: the split only lets upstream stages
start earlier, and dropping the barrier only lets stages start earlier.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from recycle_planner.job.policy import Policy, budget_caps, compute_ops
from recycle_planner.job.spec import JobSpec
from recycle_planner.schedules.generators import fault_free
from recycle_planner.schedules.ops import (B, COMPUTE_KINDS, F, I, W, OpSpace, Worker, worker_at,
                                          worker_index)
from recycle_planner.schedules.schedule import Schedule, with_collectives
from recycle_planner.timing.simulate import Simulation, simulate

KIND_TIEBREAK = {I: 0, B: 0, F: 1, W: 2}


def default_assignment(spec: JobSpec, failed: tuple[Worker, ...]) -> np.ndarray:
    """Which pipeline's worker runs each (pipeline, virtual stage, micro-batch): the dead
    workers' micro-batches go round-robin to the live peers of their stage, continuing the
    rotation from one dead worker to the next so that every peer gets floor or ceil of the
    extra; a micro-batch's chunks on a dead worker all go to one peer (the one that holds the
    same chunks, as every peer of the stage does)."""
    D, S, M = spec.pipelines, spec.stages, spec.microbatches
    V = spec.virtual_stages
    assign = np.repeat(np.arange(D)[:, None, None], V, axis=1).repeat(M, axis=2)
    dead = set(failed)
    for s in range(S):
        peers = [d for d in range(D) if (d, s) not in dead]
        held = [spec.virtual(s, c) for c in range(spec.chunks)]
        turn = 0
        for d in range(D):
            if (d, s) not in dead:
                continue
            for m in range(M):
                assign[d, held, m] = peers[turn % len(peers)]
                turn += 1
    return assign


@lru_cache(maxsize=8)
def fault_free_simulation(spec: JobSpec, policy: Policy) -> Simulation:
    """The generator's fault-free schedule, timed (cached: every failure plan of a job starts
    from it)."""
    return simulate(fault_free(spec, policy))


@lru_cache(maxsize=8)
def template_keys(spec: JobSpec, policy: Policy) -> np.ndarray:
    """keys[kind, v, m]: start time of (kind, pipeline 0, virtual stage v, m) in the
    fault-free schedule (cached and read-only)."""
    sim = fault_free_simulation(spec, policy)
    space = OpSpace.of(spec)
    S, M = spec.virtual_stages, spec.microbatches
    keys = np.full((4, S, M), np.inf)
    for kind in (F, I, W, B):
        ids = space.compute(kind, 0, np.arange(S)[:, None], np.arange(M)[None, :])
        keys[kind] = np.nan_to_num(sim.timing.start[ids], nan=np.inf)
    keys.flags.writeable = False
    return keys


@dataclass(frozen=True, eq=False)
class ListSettings:
    """How one list schedule chooses (see the module docstring); None takes the job's own.

    `assignment[d, v, m]`: the pipeline whose worker holding virtual stage v runs micro-batch
    m of pipeline d there (default_assignment); `caps[s]`: in-flight micro-batches a stage-s
    worker may hold (the memory budget, budget_caps); `keys[kind, v, m]`: priorities
    (template_keys); `defer_w`: W
    only when nothing else is ready; `op_keys[(kind, d, s, m)]`: one op's priority, overriding
    `keys`; `patient`: rather than start an op, wait for one of higher priority that arrives
    before it would finish (the template's order is then kept wherever the data comes in
    time); `drain_first`: once a worker has started its last forward, its input backwards go
    before its weight gradients (its last gradients travel up sooner; the Ws then fill the
    time before the all-reduce)."""

    assignment: np.ndarray | None = None
    caps: tuple[int, ...] | None = None
    keys: np.ndarray | None = None
    defer_w: bool = False
    op_keys: dict[tuple[int, int, int, int], float] | None = None
    patient: bool = False
    drain_first: bool = False


def list_schedule(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...],
                  settings: ListSettings = ListSettings()) -> Schedule:
    """One list schedule (see the module docstring), in passes: the priorities, which worker
    runs each unit, how many inputs each op waits for, the event loop, and the schedule."""
    space = OpSpace.of(spec)
    assignment = default_assignment(spec, failed) if settings.assignment is None \
        else settings.assignment
    caps = budget_caps(spec, policy) if settings.caps is None else settings.caps
    keys = template_keys(spec, policy) if settings.keys is None else settings.keys
    bwd = I if policy.decouple else B
    exe, remaining = _executors(spec, failed, assignment, ops_per_microbatch=3 if bwd == I else 2)
    orders = _event_loop(spec, policy, space, _priorities(keys, settings.defer_w),
                         settings.op_keys, settings.patient, exe, remaining,
                         _inputs_needed(space, bwd), caps, settings.drain_first)
    return _schedule(spec, policy, failed, space, orders)


def _priorities(keys: np.ndarray, defer_w: bool) -> list:
    """key_of[kind][s][m] as nested lists (fast to index); with `defer_w`, every W after
    every other op."""
    key_of = keys.tolist()
    if defer_w:
        big = float(np.nanmax(np.where(np.isfinite(keys), keys, 0))) + 1.0
        key_of[W] = [[big + k for k in row] for row in key_of[W]]
    return key_of


def _executors(spec: JobSpec, failed: tuple[Worker, ...], assignment: np.ndarray,
               ops_per_microbatch: int) -> tuple[list[int], list[int]]:
    """exe[unit]: the worker index that runs each unit (OpSpace's order is the assignment's
    [d, v, m]), and how many ops each worker must run; an error if the assignment gives work to
    a dead worker."""
    S = spec.stages
    holder = OpSpace.of(spec).holder
    exe = worker_index(S, assignment, holder[None, :, None]).ravel().tolist()
    remaining = (np.bincount(exe, minlength=spec.workers) * ops_per_microbatch).tolist()
    for d, s in failed:
        if remaining[worker_index(S, d, s)]:
            raise ValueError(f"assignment gives work to dead worker {d}:{s}")
    return exe, remaining


def _inputs_needed(space: OpSpace, bwd: int) -> list[int]:
    """Per compute op id, how many inputs it waits for: F its previous stage's (none at stage
    0), the backward its forward and the next stage's gradient (the last stage only its
    forward), W its I."""
    _, _, stage, _ = space.decode(np.arange(space.per_kind))  # of every unit
    n = space.per_kind
    deps = np.zeros(COMPUTE_KINDS * n, dtype=np.int64)
    deps[F * n:(F + 1) * n] = stage > 0
    deps[bwd * n:(bwd + 1) * n] = np.where(stage < space.V - 1, 2, 1)
    deps[W * n:(W + 1) * n] = 1
    return deps.tolist()


def _event_loop(spec: JobSpec, policy: Policy, space: OpSpace, key_of: list,
                op_keys: dict[tuple[int, int, int, int], float] | None, patient: bool,
                exe: list[int], remaining: list[int], deps_left: list[int],
                caps: tuple[int, ...], drain_first: bool = False) -> list[list[int]]:
    """Every worker's op order: whenever a worker is free it starts its best ready op (see
    the module docstring); an op becomes ready when the last of its inputs arrives. Stages
    here are virtual stages (S x chunks of them), workers are indexed by their own stage."""
    S, M, D, V = space.S, space.M, space.D, space.V
    n, step = space.per_kind, space.stage_step
    _, unit_d, unit_s, unit_m = (a.tolist() for a in space.decode(np.arange(n)))
    bwd = I if policy.decouple else B
    cost = [spec.forward, spec.backward_input, spec.backward_weight, spec.backward]  # by kind
    holds = [1, 0, -1, -1]  # by kind: the in-flight micro-batches it takes or releases
    p2p = spec.p2p
    n_workers = spec.workers
    pipeline_of = [worker_at(S, w)[0] for w in range(n_workers)]
    ready_at = [0.0] * (COMPUTE_KINDS * n)  # when the last input of each op arrived
    cap = [caps[worker_at(S, w)[1]] for w in range(n_workers)]
    inflight = [0] * n_workers
    free_at = [0.0] * n_workers
    wake = [math.inf] * n_workers       # time of the worker's next decision event
    future: list[list] = [[] for _ in range(n_workers)]   # (ready time, key, tie, op)
    # Forwards, gated by memory, one queue per chunk (see _forward_queue).
    ready_f: list[list] = [[[] for _ in range(space.C)] for _ in range(n_workers)]
    reserve = (space.C - 1 - space.chunk_of[unit_s]).tolist()  # per unit
    ready_o: list[list] = [[] for _ in range(n_workers)]  # everything else
    # With drain_first the weight gradients wait apart, and each worker counts the forwards
    # it has still to start.
    ready_w: list[list] = [[] for _ in range(n_workers)] if drain_first else ready_o
    forwards_left = [0] * n_workers
    for runs_it in exe:
        forwards_left[runs_it] += 1
    orders: list[list[int]] = [[] for _ in range(n_workers)]
    events: list[tuple[float, int]] = []
    heappush, heappop = heapq.heappush, heapq.heappop
    tie_kind = [KIND_TIEBREAK[k] for k in range(COMPUTE_KINDS)]

    def release(op: int, t: float) -> None:
        """Op `op` has all its inputs at time t: queue it on its worker."""
        kind, u = divmod(op, n)
        d, s, m = unit_d[u], unit_s[u], unit_m[u]
        w = exe[u]
        key = key_of[kind][s][m] if op_keys is None else \
            op_keys.get((kind, d, s, m), key_of[kind][s][m])
        tie = ((tie_kind[kind] * 2 + (d != pipeline_of[w])) * D + d) * M + m
        heappush(future[w], (t, key, tie, op))
        if t < wake[w] and free_at[w] <= t:  # a busy worker decides when it is free anyway
            wake[w] = t
            heappush(events, (t, w))

    def deliver(op: int, t: float) -> None:
        """One input of `op` arrives at time t."""
        deps_left[op] -= 1
        if t > ready_at[op]:
            ready_at[op] = t
        if deps_left[op] == 0:
            release(op, ready_at[op])

    for d in range(D):
        for m in range(M):
            release(space.compute(F, d, 0, m), 0.0)

    while events:
        t, w = heappop(events)
        if t != wake[w] or free_at[w] > t or remaining[w] == 0:
            continue  # superseded, busy, or done
        wake[w] = math.inf
        fut = future[w]
        while fut and fut[0][0] <= t:
            item = heappop(fut)
            op = item[3]
            heappush(ready_f[w][space.C - 1 - reserve[op]] if op < n else ready_w[w]
                     if W * n <= op < (W + 1) * n else ready_o[w], item[1:])
        qf = _forward_queue(ready_f[w], cap[w] - inflight[w])
        qo = ready_o[w]
        if drain_first:
            qw = ready_w[w]
            if forwards_left[w] == 0:
                qo = qo or qw  # a weight gradient only when no input backward is ready
            elif qw and (not qo or qw[0] < qo[0]):
                qo = qw
        if qf and (not qo or qf[0] < qo[0]):
            q = qf
        elif qo:
            q = qo
        else:
            if fut:
                wake[w] = fut[0][0]
                heappush(events, (wake[w], w))
            continue
        if patient and fut:
            best = q[0]
            kind0, u0 = divmod(best[2], n)
            finish = t + cost[kind0][unit_s[u0]]
            # The earliest-arriving op that outranks the candidate and comes before it is done.
            soon = [item for item in fut if item[0] < finish and item[1:3] < best[:2]
                    and (item[3] >= n or inflight[w] + reserve[item[3]] < cap[w])]
            if soon:
                wake[w] = min(item[0] for item in soon)
                heappush(events, (wake[w], w))
                continue
        op = heappop(q)[2]
        kind, u = divmod(op, n)
        s = unit_s[u]
        end = t + cost[kind][s]
        inflight[w] += holds[kind]
        forwards_left[w] -= kind == F
        free_at[w] = end
        orders[w].append(op)
        remaining[w] -= 1
        wake[w] = end
        heappush(events, (end, w))
        # Inputs this op produces: the next stage's forward, this micro-batch's backward,
        # the previous stage's backward, this micro-batch's W.
        if kind == F:
            if s < V - 1:
                deliver(op + step, end + p2p[s])
            deliver(bwd * n + u, end)
        else:
            if kind == I:
                deliver(W * n + u, end)
            if kind != W and s > 0:
                deliver(op - step, end + p2p[s])
    if any(remaining):  # a bug, not bad input: with every cap >= 1 the last stage always drains
        raise RuntimeError("list scheduling stalled")
    return orders


def _forward_queue(by_chunk: list[list], free: int) -> list | None:
    """The queue of ready forwards (one per chunk) whose head a worker with `free` in-flight
    slots starts first: the best head among the chunks it has room for. A forward of chunk c
    leaves one slot for each later chunk of the worker (v - 1 - c of them), so that a worker
    full of early chunks can still run the later chunks that let them drain: without the
    reserve, a worker whose slots all hold chunk-0 micro-batches waits forever for its own
    chunk-1 forwards. With one chunk per worker this is the plain cap."""
    chunks = len(by_chunk)
    best = None
    for c, queue in enumerate(by_chunk):
        if queue and free > chunks - 1 - c and (best is None or queue[0] < best[0]):
            best = queue
    return best


def _schedule(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...], space: OpSpace,
              orders: list[list[int]]) -> Schedule:
    """The schedule of the computed orders, each live worker's ending with its collectives."""
    dead = set(failed)
    out = []
    for w, order in enumerate(orders):
        d, s = worker_at(spec.stages, w)
        if (d, s) in dead:
            out.append(np.zeros(0, dtype=np.int64))
        else:
            out.append(with_collectives(space, d, s, order))  # ids equal OpSpace's
    return Schedule(spec=spec, policy=policy, failed=tuple(failed), orders=tuple(out))


def split_backwards(schedule: Schedule, policy: Policy) -> Schedule:
    """The same orders with every fused B replaced by I immediately followed by W."""
    space = schedule.space
    orders = []
    for order in schedule.orders:
        kind, pipe, stage, mb = space.decode(order)
        is_b = kind == B
        reps = np.where(is_b, 2, 1)
        out = np.repeat(order, reps)
        pos = np.cumsum(reps) - reps
        bpos = pos[is_b]
        out[bpos] = space.compute(I, pipe[is_b], stage[is_b], mb[is_b])
        out[bpos + 1] = space.compute(W, pipe[is_b], stage[is_b], mb[is_b])
        orders.append(out)
    return Schedule(spec=schedule.spec, policy=policy, failed=schedule.failed,
                    orders=tuple(orders))


@dataclass(frozen=True, eq=False)
class Candidate:
    name: str
    simulation: Simulation


def heuristic(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...]) -> Candidate:
    """The best of the list-scheduling candidates (see the module docstring); without failures
    the schedule's own generator competes too."""
    return heuristic_candidates(spec, policy, failed)[0]


def heuristic_candidates(spec: JobSpec, policy: Policy,
                         failed: tuple[Worker, ...]) -> list[Candidate]:
    """Every distinct candidate (see `heuristic`), shortest first."""
    cached = compute_ops(spec, policy) <= CACHED_UP_TO_OPS
    build = _candidates if cached else _candidates.__wrapped__
    return list(build(spec, policy, tuple(failed)))


CACHED_UP_TO_OPS = 50_000
"""Jobs up to this many compute ops keep their last candidates (a few MB each); above it, at
1,024 workers (200k ops), each entry would hold tens of MB, and the improvement does not run
there (improve.UP_TO_OPS), so nothing asks for them twice."""


@lru_cache(maxsize=4)
def _candidates(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...]) -> tuple[Candidate, ...]:
    """heuristic_candidates, cached: `auto` improves the first few, and the rest only where a
    gap is left; a library's placement screening builds them for every placement first."""
    base = ListSettings(default_assignment(spec, failed), budget_caps(spec, policy),
                        template_keys(spec, policy))
    # With the I/W split, ZB-H1's order is 1F1B's with W deferred into the bubbles: it fits
    # the same memory (every worker holds at most S micro-batches, 1F1B's peak), so a 1F1B job
    # may run it. A GPipe job keeps its forward-first shape (its template orders only).
    zb = Policy("zb-h1", True, policy.stagger)
    zb_orders = policy.decouple and policy.schedule != "gpipe"
    candidates = []
    if not failed:
        candidates.append((f"{policy.schedule} generator", lambda: fault_free(spec, policy)))
        if zb_orders and policy.schedule != "zb-h1":
            # the plan keeps the job's policy: only its order is ZB-H1's
            candidates.append(("zb-h1 generator", lambda: replace(fault_free(spec, zb),
                                                                  policy=policy)))
    candidates.append(("template order", lambda: list_schedule(spec, policy, failed, base)))
    if policy.decouple:
        candidates.append(("W deferred", lambda: list_schedule(
            spec, policy, failed, replace(base, defer_w=True))))
        candidates.append(("W deferred, patient", lambda: list_schedule(
            spec, policy, failed, replace(base, defer_w=True, patient=True))))
        candidates.append(("drain first, patient", lambda: list_schedule(
            spec, policy, failed, replace(base, drain_first=True, patient=True))))
        if zb_orders:
            candidates.append(("zb-h1 order, patient", lambda: list_schedule(
                spec, policy, failed, replace(base, keys=template_keys(spec, zb), patient=True))))
        if policy.schedule != "zb-h1":
            fused = Policy(policy.schedule, decouple=False, stagger=policy.stagger)
            candidates.append(("fused order, split", lambda: split_backwards(list_schedule(
                spec, fused, failed, replace(base, keys=template_keys(spec, fused))), policy)))
    found: list[Candidate] = []
    seen: set[tuple[bytes, ...]] = set()
    for name, build in candidates:
        schedule = build()
        orders = tuple(o.tobytes() for o in schedule.orders)
        if orders in seen:  # candidates often agree; the same orders time the same
            continue
        seen.add(orders)
        found.append(Candidate(name, simulate(schedule)))
    return tuple(_shortest_first(found))


def _shortest_first(found: list[Candidate]) -> list[Candidate]:
    """`found` by period; a candidate goes before an earlier one only when shorter by more than
    1e-9 (the same plan timed along another path differs in the last bits)."""
    rest, ordered = list(found), []
    while rest:
        best = rest[0]
        for c in rest[1:]:
            if c.simulation.period < best.simulation.period - 1e-9:
                best = c
        ordered.append(best)
        rest.remove(best)
    return ordered
