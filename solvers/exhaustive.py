"""Exhaustive search over every plan of a tiny instance: the ground truth the MILP is checked
against.

Every peer assignment of the re-routed micro-batches, and for every live worker every order of
its ops that keeps each micro-batch's own chain (F before I/B before W), is timed by the
simulator (ASAP from the orders, which is optimal for fixed orders); orders that deadlock are
skipped; assignments that only swap interchangeable peers are tried once. Nothing is assumed
about index order or W placement, so this is exact, and exponential: it refuses instances with
more than `limit` combinations.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from recycle_planner.errors import RecycleError, ScheduleError
from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.schedules.ops import B, F, I, W, OpSpace, Worker, worker_index
from recycle_planner.schedules.schedule import Schedule, with_collectives
from recycle_planner.timing.simulate import Simulation, simulate
from recycle_planner.timing.validate import _memory


@dataclass(frozen=True)
class ExhaustiveResult:
    best: Simulation | None
    plans_tried: int
    combinations: int


def _linear_extensions(chains: list[list[int]]) -> list[list[int]]:
    """Every interleaving of the chains (each chain's order kept)."""
    out: list[list[int]] = []
    pos = [0] * len(chains)
    total = sum(len(c) for c in chains)
    order: list[int] = []

    def rec() -> None:
        if len(order) == total:
            out.append(list(order))
            return
        for i, c in enumerate(chains):
            if pos[i] < len(c):
                order.append(c[pos[i]])
                pos[i] += 1
                rec()
                pos[i] -= 1
                order.pop()

    rec()
    return out


def _count_extensions(lengths: list[int]) -> int:
    n = sum(lengths)
    out = math.factorial(n)
    for k in lengths:
        out //= math.factorial(k)
    return out


def exhaustive(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...],
               limit: int = 200_000) -> ExhaustiveResult:
    S, D, M = spec.stages, spec.pipelines, spec.microbatches
    space = OpSpace.of(spec)
    kinds = (F, I, W) if policy.decouple else (F, B)
    dead = set(failed)
    # Units (pipeline, virtual stage, micro-batch); a worker holds its stage's chunks.
    held = {s: [spec.virtual(s, c) for c in range(spec.chunks)] for s in range(S)}
    rerouted = [(d, u, m) for (d, s) in sorted(dead) for u in held[s] for m in range(M)]
    peers = {s: [p for p in range(D) if (p, s) not in dead] for s in range(S)}
    holes = {d: tuple(sorted(s for dd, s in failed if dd == d)) for d in range(D)}
    choices = [peers[spec.holder(u)] for _, u, _ in rerouted]
    raw = math.prod(len(c) for c in choices)
    if raw > limit:  # refuse before enumerating anything
        raise RecycleError(f"exhaustive search would try {raw} peer assignments (limit {limit})")
    assignments = []
    seen = set()
    for combo in itertools.product(*choices):
        # Canonical under swapping interchangeable peers: relabel peers by first use.
        key = []
        first_use: dict[tuple, dict[int, int]] = {}
        for (d, u, m), p in zip(rerouted, combo):
            cls = first_use.setdefault((spec.holder(u), holes[p]), {})
            key.append((u, holes[p], cls.setdefault(p, len(cls))))
        key = tuple(key)
        if key in seen:
            continue
        seen.add(key)
        assignments.append(combo)
    total = 0
    per_assignment = []
    for combo in assignments:
        units: dict[int, list[tuple[int, int, int]]] = {}
        for d in range(D):
            for s in range(S):
                if (d, s) not in dead:
                    units.setdefault(worker_index(S, d, s), []).extend(
                        (d, u, m) for u in held[s] for m in range(M))
        for (d, u, m), p in zip(rerouted, combo):
            units[worker_index(S, p, spec.holder(u))].append((d, u, m))
        count = 1
        for us in units.values():
            count *= _count_extensions([len(kinds)] * len(us))
        total += count
        per_assignment.append(units)
    if total > limit:
        raise RecycleError(f"exhaustive search would try {total} plans (limit {limit})")
    best: Simulation | None = None
    tried = 0
    for units in per_assignment:
        options = {}
        for w, us in units.items():
            chains = [[space.compute(k, d, s, m) for k in kinds] for d, s, m in us]
            options[w] = _linear_extensions(chains)
        workers = sorted(options)
        for picks in itertools.product(*(options[w] for w in workers)):
            orders = [np.zeros(0, dtype=np.int64)] * spec.workers
            for w, order in zip(workers, picks):
                d, s = divmod(w, S)
                orders[w] = with_collectives(space, d, s, order)
            sched = Schedule(spec, policy, tuple(sorted(dead)), tuple(orders))
            try:
                sim = simulate(sched)
            except ScheduleError:
                continue
            tried += 1
            if best is not None and sim.period >= best.period - 1e-9:
                continue
            if _memory_ok(sim):
                best = sim
    return ExhaustiveResult(best, tried, total)


def _memory_ok(sim: Simulation) -> bool:
    from recycle_planner.timing.plan import Plan

    return not _memory(Plan(sim.schedule, sim.timing, {}, {}))
