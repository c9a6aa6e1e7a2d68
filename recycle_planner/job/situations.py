"""Failure normalization: physical failure sets -> canonical situations, and back.

Every worker of stage s holds the same parameters, so the workers of a stage can be relabelled
freely: physical worker (d, s) may play any *logical* pipeline at stage s, independently for each
stage (a logical pipeline is just a chain of one worker per stage that passes activations along).
A failure situation is therefore characterised by how many workers each stage has lost,
k = (k_0 .. k_{S-1}), and a per-stage permutation maps physical workers to logical slots.

What the counts do not fix is how the holes line up across stages: two dead workers of
different stages can sit in one logical pipeline or in two. That *placement* can change a
plan's quality, so the planner may try each placement and keep the best. A placement is a list
of groups, one per logical pipeline with holes, each the stages of its holes; group g is logical
pipeline g. Placements are written canonically (largest groups first) so equal ones compare
equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from recycle_planner.errors import FailureSetError, RecycleError
from recycle_planner.job.spec import JobSpec
from recycle_planner.job.workers import check_failed, dead_per_stage
from recycle_planner.schedules.ops import Worker

Placement = tuple[tuple[int, ...], ...]


def canonical(groups: Iterable[Iterable[int]]) -> Placement:
    return tuple(sorted((tuple(sorted(g)) for g in groups), key=lambda g: (-len(g), g)))


def packed(counts: tuple[int, ...]) -> Placement:
    """Holes share logical pipelines as much as they can: the j-th hole of every stage goes to
    logical pipeline j."""
    depth = max(counts, default=0)
    return canonical(tuple(s for s, k in enumerate(counts) if k > j) for j in range(depth))


def placements(counts: tuple[int, ...], pipelines: int, limit: int = 16) -> list[Placement]:
    """Every way to line up the holes of `counts` in at most `pipelines` logical pipelines
    (no pipeline with two holes of one stage), up to relabelling; at most `limit` of them,
    always including the packed and, when it fits, the fully spread placement."""
    holes = [s for s, k in enumerate(counts) for _ in range(k)]
    found: dict[Placement, None] = {}

    def grow(i: int, groups: list[list[int]]) -> None:
        if len(found) >= limit:
            return
        if i == len(holes):
            found.setdefault(canonical(groups), None)
            return
        s = holes[i]
        for g in groups:
            if s not in g:
                g.append(s)
                grow(i + 1, groups)
                g.pop()
        if len(groups) < pipelines:
            groups.append([s])
            grow(i + 1, groups)
            groups.pop()

    first = [packed(counts)]
    if len(holes) <= pipelines:
        first.append(canonical((s,) for s in holes))
    grow(0, [])
    return list(dict.fromkeys(first + list(found)))[:max(limit, len(first))]


def logical_failed(placement: Placement) -> tuple[Worker, ...]:
    """The dead logical workers of a placement: group g's stages in logical pipeline g."""
    return tuple(sorted((g, s) for g, stages in enumerate(placement) for s in stages))


def counts_of(placement: Placement, stages: int) -> tuple[int, ...]:
    counts = [0] * stages
    for group in placement:
        for s in group:
            counts[s] += 1
    return tuple(counts)


def situations(spec: JobSpec, max_failures: int) -> list[tuple[int, ...]]:
    """Every per-stage dead-count vector with sum <= max_failures that leaves each stage a live
    worker, in order of the number of failures, then lexicographically."""
    check_threshold(spec, max_failures)
    cap = spec.pipelines - 1
    out: list[tuple[int, ...]] = []

    def rec(prefix: list[int], left: int) -> None:
        if len(prefix) == spec.stages:
            out.append(tuple(prefix))
            return
        for x in range(min(cap, left) + 1):
            prefix.append(x)
            rec(prefix, left - x)
            prefix.pop()

    rec([], max_failures)
    return sorted(out, key=lambda k: (sum(k), tuple(-x for x in k)))


def failure_sets(spec: JobSpec, counts: tuple[int, ...]) -> int:
    """How many physical failure sets have these per-stage counts."""
    return math.prod(math.comb(spec.pipelines, k) for k in counts)


def check_threshold(spec: JobSpec, max_failures: int) -> None:
    most = spec.stages * (spec.pipelines - 1)
    if max_failures < 0:
        raise RecycleError(f"the failure threshold must be 0 or more, got {max_failures}")
    if max_failures > most:
        if spec.pipelines == 1:
            raise RecycleError(f"with 1 pipeline every failure leaves a stage with no live "
                               f"worker: the job cannot survive {max_failures} failure(s)")
        raise RecycleError(f"the job cannot survive {max_failures} failures: with "
                           f"{spec.pipelines} pipelines x {spec.stages} stages at most {most} "
                           f"workers can die while every stage keeps a live one")


@dataclass(frozen=True)
class Mapping:
    """Which logical pipeline each physical worker plays, stage by stage.

    `logical_of_physical[s][d]` is the logical pipeline of physical worker (d, s); the plan's
    ops name logical pipelines."""

    logical_of_physical: tuple[tuple[int, ...], ...]

    @property
    def physical_of_logical(self) -> tuple[tuple[int, ...], ...]:
        out = []
        for row in self.logical_of_physical:
            inv = [0] * len(row)
            for d, l in enumerate(row):
                inv[l] = d
            out.append(tuple(inv))
        return tuple(out)

    def to_logical(self, worker: Worker) -> Worker:
        d, s = worker
        return self.logical_of_physical[s][d], s

    def to_physical(self, worker: Worker) -> Worker:
        l, s = worker
        return self.physical_of_logical[s][l], s

    def to_dict(self) -> dict:
        return {"logical_of_physical": [list(r) for r in self.logical_of_physical],
                "physical_of_logical": [list(r) for r in self.physical_of_logical]}


def map_failure(spec: JobSpec, physical: Iterable[Iterable[int]],
                placement: Placement) -> Mapping:
    """The mapping that puts the dead physical workers onto the holes of `placement`.

    Dead workers of one physical pipeline go to one logical pipeline where the placement allows
    it, and a live worker keeps its own pipeline number unless a dead one needs that slot, so
    that as few workers as possible change partners."""
    dead = check_failed(spec, physical)
    counts = dead_per_stage(spec, dead)
    if counts != counts_of(placement, spec.stages):
        raise FailureSetError(f"failure set has per-stage counts {list(counts)}, but the "
                              f"placement is for {list(counts_of(placement, spec.stages))}")
    D, S = spec.pipelines, spec.stages
    free = {(g, st) for g, stages in enumerate(placement) for st in stages}
    target: dict[Worker, int] = {}
    by_pipe: dict[int, list[int]] = {}
    for d, s in dead:
        by_pipe.setdefault(d, []).append(s)
    # A physical pipeline's dead workers go together to the group that can take most of them.
    for d in sorted(by_pipe, key=lambda d: (-len(by_pipe[d]), d)):
        g = max(range(len(placement)),
                key=lambda g: (sum((g, s) in free for s in by_pipe[d]), -g))
        for s in by_pipe[d]:
            if (g, s) in free:
                free.discard((g, s))
                target[(d, s)] = g
    for d, s in dead:  # the rest: the lowest free hole of their stage
        if (d, s) not in target:
            g = min(g for g, st in free if st == s)
            free.discard((g, s))
            target[(d, s)] = g
    rows = []
    for s in range(S):
        row = [-1] * D
        used = set()
        for (d, st), g in target.items():
            if st == s:
                row[d] = g
                used.add(g)
        holes = _holes_at(placement, s)
        for d in range(D):
            if row[d] < 0 and d not in used and d not in holes:
                row[d] = d
                used.add(d)
        spare = [l for l in range(D) if l not in used]
        for d in range(D):
            if row[d] < 0:
                row[d] = spare.pop(0)
        rows.append(tuple(row))
    return Mapping(tuple(rows))


def _holes_at(placement: Placement, stage: int) -> set[int]:
    return {g for g, stages in enumerate(placement) if stage in stages}
