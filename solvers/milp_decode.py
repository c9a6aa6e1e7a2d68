"""The MILP's decoder: a solution's column values back into a schedule."""

from __future__ import annotations

import numpy as np

from recycle_planner.schedules.ops import worker_at
from recycle_planner.schedules.schedule import Schedule, with_collectives
from recycle_planner.solvers.milp_model import ReroutingModel


def decode(model: ReroutingModel, values: list[float]) -> Schedule:
    """The schedule of a solution: each worker's ops sorted by start time."""
    S = model.spec.stages
    per_worker: dict[int, list[tuple[float, int, int, int]]] = {w: [] for w in model.live}
    for u, un in enumerate(model.units):
        if un.rerouted:
            p = max(un.candidates, key=lambda p: values[model.x[u, p]])
        else:
            p = un.candidates[0]
        for rank, k in enumerate(model.kinds):
            t = values[model.T[u, k]]
            per_worker[p].append((round(t, 6), rank, un.m, model.op_id((u, k))))
    orders = []
    for w in range(model.spec.workers):
        if w not in per_worker:
            orders.append(np.zeros(0, dtype=np.int64))
            continue
        ops = [op for *_, op in sorted(per_worker[w])]
        d, s = worker_at(S, w)
        orders.append(with_collectives(model.space, d, s, ops))
    return Schedule(model.spec, model.policy, model.failed, tuple(orders))
