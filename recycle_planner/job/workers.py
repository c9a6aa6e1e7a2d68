"""Failure sets: which (pipeline, stage) workers are dead, checked against the job's grid."""

from __future__ import annotations

import re
from typing import Iterable

from recycle_planner.errors import FailureSetError
from recycle_planner.job.spec import JobSpec
from recycle_planner.schedules.ops import Worker
from recycle_planner.words import plural


def parse_worker(text: str) -> Worker:
    """'PIPELINE:STAGE' -> (pipeline, stage)."""
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not match:
        raise FailureSetError(f"worker {text!r} is not PIPELINE:STAGE (for example 1:0)")
    return int(match.group(1)), int(match.group(2))


def check_failed(spec: JobSpec, failed: Iterable[Iterable[int]]) -> tuple[Worker, ...]:
    """The dead workers, sorted; an error if one is outside the grid, repeated, or if a stage
    would be left with no live worker."""
    out: list[Worker] = []
    seen: set[Worker] = set()
    for item in failed:
        try:
            d, s = (int(x) for x in item)
        except (TypeError, ValueError):
            raise FailureSetError(f"failed worker {item!r} is not a [pipeline, stage] "
                                  f"pair") from None
        if not (0 <= d < spec.pipelines and 0 <= s < spec.stages):
            raise FailureSetError(f"failed worker {d}:{s} is outside the grid of "
                                  f"{plural(spec.pipelines, 'pipeline')} x "
                                  f"{plural(spec.stages, 'stage')}")
        if (d, s) in seen:
            raise FailureSetError(f"failed worker {d}:{s} is listed twice")
        seen.add((d, s))
        out.append((d, s))
    for s, k in enumerate(dead_per_stage(spec, out)):
        if k >= spec.pipelines:
            raise FailureSetError(f"every worker of stage {s} is dead: the job cannot continue "
                                  f"without a checkpoint restart")
    return tuple(sorted(out))


def dead_per_stage(spec: JobSpec, failed: Iterable[Worker]) -> tuple[int, ...]:
    counts = [0] * spec.stages
    for _, s in failed:
        counts[s] += 1
    return tuple(counts)


def format_workers(workers: Iterable[Worker]) -> str:
    items = [f"{d}:{s}" for d, s in workers]
    return " ".join(items) if items else "none"
