"""Check every rule a plan must keep, and say which one each broken plan breaks.

Structure: each op exactly once, on a live worker of its stage; a micro-batch's F, I/B and W on
one worker; every live worker ends with its own stage's all-reduce and optimizer step; the
backward matches the policy (fused B, or I and W). Timing: each op lasts its cost; no two ops of
a worker overlap and a worker runs them in its listed order; every dependency waits for its
source plus the p2p latency; the all-reduce of a stage starts at the same time on all its
workers. Memory: no worker holds more in-flight micro-batches than its cap. Orders: the orders
alone must not deadlock. Metrics: the iteration time is the one the times give, the period
the one re-simulating the orders gives, and degradation, gap and counts follow from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recycle_planner.errors import ScheduleError
from recycle_planner.job.policy import budget_caps
from recycle_planner.schedules.ops import (AR, B, F, I, W, is_collective, worker_at, worker_index,
                                          worker_name)
from recycle_planner.timing.plan import Plan, peak_inflight
from recycle_planner.timing.simulate import DependencyGraph, cost_table, data_edges
from recycle_planner.words import plural


@dataclass(frozen=True)
class Violation:
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.message}"


def validate(plan: Plan) -> list[Violation]:
    """Every broken rule (empty when the plan is valid). Structural errors stop the check
    before timing, since times of a malformed plan mean nothing."""
    out = _structure(plan)
    if out:
        return out
    out += _timing(plan)
    out += _memory(plan)
    try:
        DependencyGraph(plan.schedule)
    except ScheduleError as exc:
        return out + [Violation("deadlock", str(exc))]  # orders that deadlock have no period
    return out + _metrics(plan)


def _tol(x: np.ndarray | float) -> np.ndarray | float:
    return 1e-6 * np.maximum(1.0, np.abs(x))


def _structure(plan: Plan) -> list[Violation]:
    sched = plan.schedule
    spec, space = sched.spec, sched.space
    S, D, M = spec.stages, spec.pipelines, spec.microbatches
    out: list[Violation] = []
    dead = set(sched.failed)
    for d, s in sorted(dead):
        if len(sched.orders[worker_index(S, d, s)]):
            out.append(Violation("dead-worker", f"dead worker {d}:{s} is given "
                                 f"{len(sched.orders[worker_index(S, d, s)])} ops"))
    ids, workers = sched.flat
    if not len(ids):
        return out + [Violation("missing-op", "the plan has no ops")]
    kind, pipe, stage, mb = space.decode(ids)
    held = worker_at(S, workers)[1]
    wrong = np.flatnonzero(space.worker_stage(kind, stage) != held)
    if wrong.size:
        i = int(wrong[0])
        out.append(Violation("wrong-stage", f"{space.to_op(int(ids[i]))} runs on worker "
                             f"{worker_name(S, workers[i])}, which holds stage "
                             f"{held[i]} ({plural(wrong.size, 'such op')})"))
    counts = np.bincount(ids, minlength=space.size)
    dup = np.flatnonzero(counts > 1)
    if dup.size:
        out.append(Violation("duplicate-op", f"{space.to_op(int(dup[0]))} is scheduled "
                             f"{counts[dup[0]]} times ({plural(dup.size, 'such op')})"))
    present = counts > 0
    grid = space.compute(np.arange(4)[:, None, None, None], np.arange(D)[None, :, None, None],
                         np.arange(space.V)[None, None, :, None],
                         np.arange(M)[None, None, None, :])
    has = present[grid]  # [kind, d, virtual stage, m]
    split = has[I] | has[W]
    if not plan.policy.decouple and split.any():
        d, s, m = (int(x[0]) for x in np.nonzero(split))
        out.append(Violation("policy", f"micro-batch {m} of pipeline {d} at stage {s} uses the "
                             f"I/W split, but the plan's policy fuses the backward"))
    missing = []
    for name, bad in (("F", ~has[F]),
                      ("I", split & ~has[I]), ("W", split & ~has[W]),
                      ("B or I/W", ~has[B] & ~split)):
        if bad.any():
            d, s, m = (int(x[0]) for x in np.nonzero(bad))
            missing.append(f"{name} of micro-batch {m} of pipeline {d} at stage {s} "
                           f"({plural(int(bad.sum()), 'such case')})")
    both = has[B] & split
    if both.any():
        d, s, m = (int(x[0]) for x in np.nonzero(both))
        out.append(Violation("duplicate-op", f"micro-batch {m} of pipeline {d} at stage {s} has "
                             f"both a fused B and an I/W backward"))
    for text in missing:
        out.append(Violation("missing-op", f"no live worker runs {text}"))
    # F, I/B and W of a micro-batch on one worker.
    where = np.full(space.size, -1, dtype=np.int64)
    where[ids] = workers
    comp = np.flatnonzero(~is_collective(kind) & (kind != F))
    fw = where[space.compute(F, pipe[comp], stage[comp], mb[comp])]
    apart = comp[(fw >= 0) & (fw != workers[comp])]
    if apart.size:
        i = int(apart[0])
        d = worker_at(S, workers[i])[0]
        out.append(Violation("split-microbatch", f"{space.to_op(int(ids[i]))} runs on worker "
                             f"{d}:{space.holder[stage[i]]} but its forward on another worker "
                             f"({plural(apart.size, 'such op')})"))
    # Collectives: each live worker's own all-reduce then optimizer step, last.
    for w, order in enumerate(sched.orders):
        d, s = worker_at(S, w)
        if not len(order) or (d, s) in dead:
            continue
        tail = order[-2:].tolist()
        expect = [space.allreduce(d, s), space.optimizer(d, s)]
        if tail != expect:
            out.append(Violation("collective", f"worker {d}:{s} must end with its stage's "
                                 f"ALLREDUCE then OPTIMIZER"))
            break
    coll = np.flatnonzero(is_collective(kind))
    own_d, own_s = worker_at(S, workers[coll])
    foreign = coll[(pipe[coll] != own_d) | (stage[coll] != own_s)]
    if foreign.size:
        i = int(foreign[0])
        out.append(Violation("collective", f"{space.to_op(int(ids[i]))} runs on worker "
                             f"{worker_name(S, workers[i])}"))
    return out


def _timing(plan: Plan) -> list[Violation]:
    sched, timing = plan.schedule, plan.timing
    spec, space = sched.spec, sched.space
    S = spec.stages
    ids, workers = sched.flat
    start, end = timing.start[ids], timing.end[ids]
    out: list[Violation] = []
    if not (np.isfinite(start).all() and np.isfinite(end).all()):
        return [Violation("timing", "some ops have no start or end time")]
    kind, pipe, stage, mb = space.decode(ids)
    cost = cost_table(spec)[kind, stage]
    bad = np.flatnonzero(np.abs((end - start) - cost) > _tol(cost))
    if bad.size:
        i = int(bad[0])
        out.append(Violation("duration", f"{space.to_op(int(ids[i]))} lasts "
                             f"{end[i] - start[i]:g} ms but costs {cost[i]:g} ms "
                             f"({plural(bad.size, 'such op')})"))
    same = np.flatnonzero(workers[1:] == workers[:-1])
    over = same[start[same + 1] < end[same] - _tol(end[same])]
    if over.size:
        i = int(over[0])
        w = int(workers[i])
        out.append(Violation("overlap", f"on worker {worker_name(S, w)}, "
                             f"{space.to_op(int(ids[i + 1]))} starts at {start[i + 1]:g} before "
                             f"{space.to_op(int(ids[i]))} ends at {end[i]:g} "
                             f"({plural(over.size, 'such pair')})"))
    loc = np.full(space.size, -1, dtype=np.int64)
    loc[ids] = np.arange(len(ids))
    src, dst, lat = data_edges(sched, ids, loc, kind, pipe, stage, mb)
    early = np.flatnonzero(start[dst] < end[src] + lat - _tol(end[src] + lat))
    if early.size:
        e = int(early[0])
        out.append(Violation("dependency", f"{space.to_op(int(ids[dst[e]]))} starts at "
                             f"{start[dst[e]]:g} but needs {space.to_op(int(ids[src[e]]))}, which "
                             f"ends at {end[src[e]]:g}, plus {lat[e]:g} ms of transfer "
                             f"({plural(early.size, 'such op')})"))
    ar = np.flatnonzero(kind == AR)
    for s in np.unique(stage[ar]).tolist():
        times = start[ar[stage[ar] == s]]
        if times.max() - times.min() > _tol(times.max()):
            out.append(Violation("collective", f"the all-reduce of stage {s} starts at "
                                 f"different times on its workers ({times.min():g} to "
                                 f"{times.max():g})"))
    return out


def _memory(plan: Plan) -> list[Violation]:
    sched = plan.schedule
    S = sched.spec.stages
    ids, workers = sched.flat
    kind = sched.space.decode(ids)[0]
    peaks = peak_inflight(sched, plan.timing, workers, ids, kind)
    caps = budget_caps(sched.spec, plan.policy)
    out = []
    cap = np.array([caps[worker_at(S, w)[1]] for w in range(len(peaks))])
    for w in np.flatnonzero(peaks > cap):
        out.append(Violation("memory", f"worker {worker_name(S, w)} holds {peaks[w]} in-flight "
                             f"micro-batches, more than its cap of {cap[w]}"))
        break
    return out


def _metrics(plan: Plan) -> list[Violation]:
    """The figures a plan claims are the ones its ops give: the iteration time is the span of
    the times, and re-simulating the orders gives the period; the rest follows from those."""
    from recycle_planner.timing.simulate import simulate

    ids, _ = plan.schedule.flat
    times = plan.timing
    m = plan.metrics
    actual = float(times.end[ids].max() - times.start[ids].min())
    claimed = m.iteration_time
    if abs(claimed - actual) > _tol(actual):
        return [Violation("metrics", f"metrics.iteration_time is {claimed} but the ops span "
                          f"{actual:g} ms")]
    period = simulate(plan.schedule).period
    ff = m.fault_free_period
    lb = m.lower_bound
    expected = {"period": period,
                "degradation": period / ff - 1.0 if ff > 0 else 0.0,
                "gap": max(0.0, period / lb - 1.0) if lb > 0 else 0.0,
                "ops": plan.schedule.n_ops, "rerouted_ops": plan.schedule.rerouted_count()}
    if m.samples_per_iteration is not None and period > 0:
        expected["throughput"] = m.samples_per_iteration / (period / 1000.0)
    out = []
    for key, value in expected.items():
        got = getattr(m, key)
        if got is not None and abs(got - value) > _tol(value):
            what = "the ops repeat every" if key == "period" else "the ops give"
            unit = " ms" if key == "period" else ""
            out.append(Violation("metrics", f"metrics.{key} is {got} but {what} {value:g}{unit}"))
    if lb > period + _tol(period):
        out.append(Violation("metrics", f"metrics.lower_bound {lb:g} is above the period "
                             f"{period:g} ms: no plan can beat its own lower bound"))
    return out
