"""The MILP's warm start: a simulated schedule as values of the model's columns.

HiGHS and CBC take a full assignment; one that breaks a row is refused, so a schedule that is
not in the model's shape (each worker runs one pipeline's micro-batches of a kind in index
order) gives None rather than a wrong start.
"""

from __future__ import annotations

from recycle_planner.schedules.ops import F, worker_at
from recycle_planner.solvers.linear_model import INF
from recycle_planner.solvers.milp_model import ReroutingModel
from recycle_planner.timing.simulate import Simulation


def warm_values(model: ReroutingModel, sim: Simulation) -> list[float] | None:
    """Column values of a simulated schedule, or None if it is not in the model's shape."""
    sched = sim.schedule
    timing = sim.steady if model.policy.stagger else sim.timing
    S = model.spec.stages
    values = [0.0] * len(model.model.lb)
    where = {}
    for w, order in enumerate(sched.orders):
        for pos, op in enumerate(order.tolist()):
            where[op] = (w, pos)
    for (u, k), col in model.T.items():
        op = model.op_id((u, k))
        if op not in where:
            return None
        values[col] = float(timing.start[op])
    for (u, p), col in model.x.items():
        values[col] = 1.0 if where[model.op_id((u, F))][0] == p else 0.0
    for (p, a, b), col in model.y.items():
        oa, ob = model.op_id(a), model.op_id(b)
        wa, wb = where[oa], where[ob]
        if wa[0] == p and wb[0] == p:
            values[col] = 1.0 if wa[1] < wb[1] else 0.0
        else:
            values[col] = 1.0 if values[model.T[a]] <= values[model.T[b]] else 0.0
    for s, col in model.t_ar.items():
        d = worker_at(S, next(w for w in model.live if worker_at(S, w)[1] == s))[0]
        values[col] = float(timing.start[model.space.allreduce(d, s)])
    for w, col in model.start.items():
        values[col] = min(values[model.T[u, F]] for u in model.on[w]
                          if not model.units[u].rerouted or values[model.x[u, w]] > 0.5)
    # Memory helper columns (continuous, after the binaries): the smallest feasible value.
    values = _fill_helpers(model, values)
    z = 0.0
    for w in model.live:
        s = worker_at(S, w)[1]
        end = values[model.t_ar[s]] + model.spec.allreduce[s] + model.spec.optimizer[s]
        z = max(z, end - (values[model.start[w]] if model.policy.stagger else 0.0))
    values[model.z] = max(z, model.model.lb[model.z])
    if model.model.violation(values) > 1e-6:
        return None
    return values


def _fill_helpers(model: ReroutingModel, values: list[float]) -> list[float]:
    """Set each continuous helper column to the least value its rows allow."""
    known = set(model.T.values()) | set(model.x.values()) | {c for c in model.y.values()} \
        | set(model.t_ar.values()) | set(model.start.values()) | {model.z}
    helpers = [i for i in range(len(values)) if i not in known]
    if not helpers:
        return values
    hset = set(helpers)
    for idx, coef, lb, _ in model.model.rows:
        h = [i for i in idx if i in hset]
        if len(h) == 1 and lb > -INF:
            i = h[0]
            a = sum(c * values[j] for j, c in zip(idx, coef) if j != i)
            ci = coef[idx.index(i)]
            if ci > 0:
                values[i] = max(values[i], (lb - a) / ci)
    return values
