"""List scheduling guided by the fault-free schedule: the fast heuristic for failure plans.

The dead workers' micro-batches are dealt round-robin to the live peers of their stage. Then
every worker, whenever it is idle, starts the ready op that comes first in the fault-free
schedule (by its start time there; a re-routed op takes the time its dead owner would have run
it), a forward only if the worker's memory cap allows one more in-flight micro-batch. Ties go
to the input-gradient backward, then the forward, then the weight gradient, then the worker's
own pipeline, then the lower pipeline: every worker derives the same plan from the same inputs.

With the I/W split the heuristic also tries deferring every W until nothing else is ready (W
fills idle time, or runs because memory is full), and the fused plan with each B cut into I and
W; it keeps the candidate with the shortest period. The last candidate is never slower than
plain re-routing: the split only lets upstream stages start earlier, and dropping the barrier
only lets stages start earlier.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from recycle_planner.generators import fault_free
from recycle_planner.ops import B, F, I, W, OpSpace, Worker
from recycle_planner.policy import Policy, budget_caps
from recycle_planner.schedule import Schedule
from recycle_planner.simulate import Simulation, simulate
from recycle_planner.spec import JobSpec

KIND_TIEBREAK = {I: 0, B: 0, F: 1, W: 2}


def default_assignment(spec: JobSpec, failed: tuple[Worker, ...]) -> np.ndarray:
    """Which pipeline's worker runs each (pipeline, stage, micro-batch): the dead workers'
    micro-batches go round-robin to the live peers of their stage, continuing the rotation
    from one dead worker to the next so that every peer gets floor or ceil of the extra."""
    D, S, M = spec.pipelines, spec.stages, spec.microbatches
    assign = np.repeat(np.arange(D)[:, None, None], S, axis=1).repeat(M, axis=2)
    dead = set(failed)
    for s in range(S):
        peers = [d for d in range(D) if (d, s) not in dead]
        turn = 0
        for d in range(D):
            if (d, s) not in dead:
                continue
            for m in range(M):
                assign[d, s, m] = peers[turn % len(peers)]
                turn += 1
    return assign


def template_keys(spec: JobSpec, policy: Policy) -> np.ndarray:
    """keys[kind, s, m]: start time of (kind, pipeline 0, s, m) in the fault-free schedule."""
    sim = simulate(fault_free(spec, policy))
    space = OpSpace(spec.stages, spec.pipelines, spec.microbatches)
    S, M = spec.stages, spec.microbatches
    keys = np.full((4, S, M), np.inf)
    for kind in (F, I, W, B):
        ids = space.compute(kind, 0, np.arange(S)[:, None], np.arange(M)[None, :])
        keys[kind] = np.nan_to_num(sim.timing.start[ids], nan=np.inf)
    return keys


def list_schedule(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...],
                  assignment: np.ndarray | None = None, caps: tuple[int, ...] | None = None,
                  keys: np.ndarray | None = None, defer_w: bool = False,
                  op_keys: dict[tuple[int, int, int, int], float] | None = None) -> Schedule:
    """One list schedule (see the module docstring).

    `assignment[d, s, m]`: the pipeline whose stage-s worker runs micro-batch m of pipeline d;
    `caps[s]`: in-flight micro-batch limit of a stage-s worker (default: the memory budget);
    `keys`: priorities from `template_keys`; `defer_w`: W only when nothing else is ready;
    `op_keys[(kind, d, s, m)]`: a priority for one op that overrides `keys`."""
    D, S, M = spec.pipelines, spec.stages, spec.microbatches
    if assignment is None:
        assignment = default_assignment(spec, failed)
    if caps is None:
        caps = budget_caps(spec, policy)
    if keys is None:
        keys = template_keys(spec, policy)
    space = OpSpace(S, D, M)
    split = policy.decouple
    bwd = I if split else B
    fwd_cost, p2p, w_cost = spec.forward, spec.p2p, spec.backward_weight
    bwd_cost = spec.backward_input if split else spec.backward
    key_of = keys.tolist()
    if defer_w:
        big = float(np.nanmax(np.where(np.isfinite(keys), keys, 0))) + 1.0
        key_of[W] = [[big + k for k in row] for row in key_of[W]]

    dead = set(failed)
    n_workers = D * S
    exe = (assignment * S + np.arange(S)[None, :, None]).tolist()  # exe[d][s][m] -> worker
    remaining = [0] * n_workers
    per_mb = 3 if split else 2
    for d in range(D):
        for s in range(S):
            for m in range(M):
                remaining[exe[d][s][m]] += per_mb
    for d, s in dead:
        if remaining[d * S + s]:
            raise ValueError(f"assignment gives work to dead worker {d}:{s}")

    cap = [caps[w % S] for w in range(n_workers)]
    inflight = [0] * n_workers
    free_at = [0.0] * n_workers
    future: list[list] = [[] for _ in range(n_workers)]   # (ready time, entry)
    ready_f: list[list] = [[] for _ in range(n_workers)]  # forwards, gated by memory
    ready_o: list[list] = [[] for _ in range(n_workers)]  # everything else
    orders: list[list[int]] = [[] for _ in range(n_workers)]
    pending: dict[tuple[int, int, int, int], list] = {}   # op -> [deps left, ready time]
    events: list[tuple[float, int]] = []

    def release(kind: int, d: int, s: int, m: int, t: float) -> None:
        w = exe[d][s][m]
        key = key_of[kind][s][m] if op_keys is None else \
            op_keys.get((kind, d, s, m), key_of[kind][s][m])
        entry = (key, KIND_TIEBREAK[kind], d != w // S, d, m, kind)
        heapq.heappush(future[w], (t, entry))
        heapq.heappush(events, (t, w))

    def arrive(kind: int, d: int, s: int, m: int, t: float, deps: int) -> None:
        """One dependency of op (kind, d, s, m) is met at time t."""
        if deps == 1:
            release(kind, d, s, m, t)
            return
        op = (kind, d, s, m)
        entry = pending.get(op)
        if entry is None:
            pending[op] = [deps - 1, t]
            return
        entry[0] -= 1
        if t > entry[1]:
            entry[1] = t
        if entry[0] == 0:
            del pending[op]
            release(kind, d, s, m, entry[1])

    for d in range(D):
        for m in range(M):
            release(F, d, 0, m, 0.0)

    while events:
        t, w = heapq.heappop(events)
        if free_at[w] > t or remaining[w] == 0:
            continue
        fut = future[w]
        while fut and fut[0][0] <= t:
            entry = heapq.heappop(fut)[1]
            heapq.heappush(ready_f[w] if entry[5] == F else ready_o[w], entry)
        qf = ready_f[w] if inflight[w] < cap[w] else None
        qo = ready_o[w]
        if qf and (not qo or qf[0] < qo[0]):
            chosen = heapq.heappop(qf)
        elif qo:
            chosen = heapq.heappop(qo)
        else:
            continue
        d, m, kind = chosen[3], chosen[4], chosen[5]
        s = w % S
        if kind == F:
            end = t + fwd_cost[s]
            inflight[w] += 1
        elif kind == W:
            end = t + w_cost[s]
            inflight[w] -= 1
        else:
            end = t + bwd_cost[s]
        free_at[w] = end
        orders[w].append(space.compute(kind, d, s, m))
        remaining[w] -= 1
        heapq.heappush(events, (end, w))
        if kind == F:
            if s < S - 1:
                arrive(F, d, s + 1, m, end + p2p[s], 1)
            arrive(bwd, d, s, m, end, 2 if s < S - 1 else 1)
        elif kind == I:
            release(W, d, s, m, end)
            if s > 0:
                arrive(I, d, s - 1, m, end + p2p[s], 2)
        elif kind == B:
            inflight[w] -= 1
            if s > 0:
                arrive(B, d, s - 1, m, end + p2p[s], 2)
    if any(remaining):  # a bug, not bad input: with every cap >= 1 the last stage always drains
        raise RuntimeError("list scheduling stalled")
    out = []
    for w in range(n_workers):
        d, s = divmod(w, S)
        if (d, s) in dead:
            out.append(np.zeros(0, dtype=np.int64))
        else:
            out.append(np.array(orders[w] + [space.allreduce(d, s), space.optimizer(d, s)],
                                dtype=np.int64))
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


def heuristic(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...],
              assignment: np.ndarray | None = None) -> Candidate:
    """The best of the list-scheduling candidates (see the module docstring); without failures
    the schedule's own generator competes too."""
    if assignment is None:
        assignment = default_assignment(spec, failed)
    caps = budget_caps(spec, policy)
    keys = template_keys(spec, policy)
    candidates = []
    if not failed:
        candidates.append((f"{policy.schedule} generator", lambda: fault_free(spec, policy)))
    candidates.append(("template order", lambda: list_schedule(
        spec, policy, failed, assignment, caps, keys)))
    if policy.decouple:
        candidates.append(("W deferred", lambda: list_schedule(
            spec, policy, failed, assignment, caps, keys, defer_w=True)))
        if policy.schedule != "zb-h1":
            fused = Policy(policy.schedule, decouple=False, stagger=policy.stagger)
            candidates.append(("fused order, split", lambda: split_backwards(list_schedule(
                spec, fused, failed, assignment, caps, template_keys(spec, fused)), policy)))
    best: Candidate | None = None
    for name, build in candidates:
        sim = simulate(build())
        if best is None or sim.period < best.simulation.period - 1e-9:
            best = Candidate(name, sim)
    assert best is not None
    return best
