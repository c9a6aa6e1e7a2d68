"""Dynamic programs that decide which peer takes which re-routed micro-batch, and into which
idle window of the fault-free schedule.

The model. In the fault-free plan every live worker of stage s has idle windows between its
first forward and its all-reduce (waiting for inputs or gradients), and its iteration can grow
up to the fault-free period before the all-reduce (the extension window). A re-routed
micro-batch j of a dead stage-s worker has a natural time t_j: when its forward would have
started on the dead worker. Running its forward and input backward (c_s = F_s + I_s, or F_s + B_s
with a fused backward; W is deferred into idle time anyway) in a window slot that starts at
time u costs |u - t_j|: early or late, it moves the micro-batch away from where the rest of its
pipeline expects it. A window of length L on peer p holds floor(L / c_s) back-to-back slots;
the extension window of each peer holds as many as needed, at the times after the peer's last
op.

A micro-batch cannot start before its input exists (u >= t_j); placed in slot u it is late by
u - t_j. Instead of waiting for an idle window it can also be inserted at any time u >= t_j on
a peer that is busy then, which pushes that peer's own work back by c_s: cost u - t_j + c_s.

What is exact. `match` finds the assignment of every re-routed micro-batch of a stage to a
window slot (all peers' windows pooled) or an insertion that minimises the total cost, exactly:
the cost is a convex function of u - t_j plus a constant per slot, so some optimal matching
never crosses (micro-batches and slots both sorted by time) and f(j, q) = min(f(j, q - 1),
f(j - 1, q - 1) + cost(j, q)) finds it. It is exact for that model: every other worker keeps
its fault-free times, windows do not move, insertions on one peer do not interact, and a
micro-batch's input backward follows its forward by the fault-free turnaround. Insertions are
then dealt to the peers that have the fewest, in time order.

From the matching to a plan. The matched slot fixes each re-routed micro-batch's peer and its
priority (its forward's key is the slot time, its input backward keeps the turnaround); the
list scheduler then orders every worker's ops with those priorities within the memory caps,
and the simulator measures the true period. Several holes at one stage are matched together;
stages are matched independently (their windows come from the fault-free plan).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from recycle_planner.job.policy import Policy, budget_caps
from recycle_planner.job.spec import JobSpec
from recycle_planner.schedules.ops import B, F, I, OpSpace, Worker, is_collective, worker_index
from recycle_planner.solvers.heuristic import (Candidate, ListSettings, fault_free_simulation,
                                               list_schedule, template_keys)
from recycle_planner.timing.simulate import Simulation, simulate


@dataclass(frozen=True)
class Slot:
    time: float
    peer: int          # pipeline of the peer (-1: an insertion, host chosen afterwards)
    extra: float = 0.0  # cost of using the slot beyond lateness (an insertion's push-back)


def match(times: list[float], slots: list[Slot]) -> tuple[float, list[int]]:
    """Minimum total cost over one-to-one assignments of every time t to a slot u >= t, where
    the cost is (u - t) + slot.extra, and the chosen slot index for each t (inf if none fits).
    Exact: with both sorted by time an optimal matching never crosses, so
    f(j, q) = min(f(j, q-1), f(j-1, q-1) + cost(j, q)), a running minimum that numpy computes
    one micro-batch at a time."""
    order_t = sorted(range(len(times)), key=lambda j: (times[j], j))
    order_s = sorted(range(len(slots)), key=lambda q: (slots[q].time, slots[q].peer, q))
    J, Q = len(times), len(slots)
    if J > Q:
        raise ValueError("more micro-batches than slots")
    st = np.array([slots[q].time for q in order_s])
    extra = np.array([slots[q].extra for q in order_s])
    f = np.zeros(Q + 1)            # f[q]: best cost of the first j micro-batches in q slots
    take = np.zeros((J + 1, Q + 1), dtype=bool)
    for j in range(1, J + 1):
        use = np.full(Q + 1, np.inf)
        late = st[j - 1:] - times[order_t[j - 1]]
        use[j:] = f[j - 1:-1] + np.where(late >= -1e-9, np.maximum(late, 0.0) + extra[j - 1:],
                                          np.inf)
        new = np.minimum.accumulate(use)
        take[j, j:] = use[j:] <= new[j:] + 1e-12
        take[j, j + 1:] &= use[j + 1:] < new[j:-1] - 1e-12
        f = new
    if not np.isfinite(f[Q]):
        raise ValueError("some micro-batch has no slot at or after its time")
    chosen = [0] * J
    q = Q
    for j in range(J, 0, -1):
        while not take[j, q]:
            q -= 1
        chosen[order_t[j - 1]] = order_s[q - 1]
        q -= 1
    return float(f[Q]), chosen


def idle_windows(sim: Simulation, space: OpSpace, worker: int, until: float
                 ) -> list[tuple[float, float]]:
    """Gaps between consecutive compute ops of one worker in the fault-free plan's first
    iteration, and the extension window from its last compute op to `until`."""
    order = sim.schedule.orders[worker]
    kind = space.decode(order)[0]
    comp = order[~is_collective(kind)]
    starts, ends = sim.timing.start[comp], sim.timing.end[comp]
    gaps = [(float(e), float(s)) for e, s in zip(ends[:-1], starts[1:]) if s - e > 1e-9]
    gaps.append((float(ends[-1]), max(float(ends[-1]), until)))
    return gaps


def dp_assignment(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...]
                  ) -> tuple[np.ndarray, dict[tuple[int, int, int, int], float], float]:
    """Peer and priorities for every re-routed micro-batch, from the matching of each stage's
    re-routed micro-batches to its peers' idle slots; also the total displacement."""
    S, D, M = spec.stages, spec.pipelines, spec.microbatches
    space = OpSpace(S, D, M)
    ff = fault_free_simulation(spec, policy)
    bwd = I if policy.decouple else B
    cost_fi = [spec.forward[s] + (spec.backward_input[s] if policy.decouple else spec.backward[s])
               for s in range(S)]
    assign = np.repeat(np.arange(D)[:, None, None], S, axis=1).repeat(M, axis=2)
    op_keys: dict[tuple[int, int, int, int], float] = {}
    dead = set(failed)
    total = 0.0
    for s in sorted({s for _, s in failed}):
        holes = sorted(d for d, t in failed if t == s)
        peers = [p for p in range(D) if (p, s) not in dead]
        items = [(d, m) for d in holes for m in range(M)]
        times = [float(ff.timing.start[space.compute(F, d, s, m)]) for d, m in items]
        turn = {(d, m): float(ff.timing.start[space.compute(bwd, d, s, m)]
                             - ff.timing.start[space.compute(F, d, s, m)]) for d, m in items}
        c = cost_fi[s]
        slots: list[Slot] = []
        for p in peers:
            w = worker_index(S, p, s)
            ar = float(ff.timing.start[space.allreduce(p, s)])
            for a, b in idle_windows(ff, space, w, ar):
                n = int((b - a) // c + 1e-9)
                slots.extend(Slot(a + i * c, p) for i in range(n))
            # Beyond the fault-free iteration: enough slots for an even share, and a few more.
            end = max(ar, float(ff.timing.end[ff.schedule.orders[w][-3]]))
            extra = -(-len(items) // len(peers)) + 2
            slots.extend(Slot(end + i * c, p) for i in range(extra))
        # Insertions: at every natural time, as many as there are micro-batches.
        slots.extend(Slot(t, -1, extra=c) for t in times)
        cost, chosen = match(times, slots)
        total += cost
        inserted = [0] * D
        for (d, m), q in sorted(zip(items, chosen), key=lambda x: (slots[x[1]].time, x[0])):
            slot = slots[q]
            host = slot.peer
            if host < 0:
                host = min(peers, key=lambda p: (inserted[p], p))
                inserted[host] += 1
            assign[d, s, m] = host
            op_keys[(F, d, s, m)] = slot.time
            op_keys[(bwd, d, s, m)] = slot.time + turn[(d, m)]
    return assign, op_keys, total


def dp_plan(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...]) -> Candidate:
    """The DP's assignment and priorities, list-scheduled (W in its template place, and with
    the I/W split also deferred into idle time); the shorter period wins."""
    assign, op_keys, _ = dp_assignment(spec, policy, failed)
    base = ListSettings(assign, budget_caps(spec, policy), template_keys(spec, policy),
                        op_keys=op_keys)
    variants = [("slots", False)] + ([("slots, W deferred", True)] if policy.decouple else [])
    best: Candidate | None = None
    for name, defer in variants:
        sim = simulate(list_schedule(spec, policy, failed, replace(base, defer_w=defer)))
        if best is None or sim.period < best.simulation.period - 1e-9:
            best = Candidate(f"dp: {name}", sim)
    assert best is not None
    return best

