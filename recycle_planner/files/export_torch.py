"""Export a fault-free plan to torch.distributed.pipelining's compute-only CSV.

One row per pipeline-stage rank, one cell per action in execution order (`0F1` = stage 0
forward of micro-batch 1; I, W and B as in torch). torch's
`_PipelineScheduleRuntime._load_csv(path, format="compute_only")` reads it and adds the sends
and receives itself. torch runs one pipeline, so one pipeline of the plan is exported; torch's
data-parallel wrapper handles the gradient all-reduce, so ALLREDUCE and OPTIMIZER are left out.
A plan with dead workers re-routes micro-batches across pipelines, which torch's runtime cannot
express: those plans need recycle-planner's own executor.
"""

from __future__ import annotations

import csv
from pathlib import Path

from recycle_planner.errors import RecycleError
from recycle_planner.io import atomic_write
from recycle_planner.job.workers import format_workers
from recycle_planner.schedules.ops import COLLECTIVE_NAMES
from recycle_planner.timing.plan import Plan


def torch_rows(plan: Plan, pipeline: int = 0) -> list[list[str]]:
    if plan.failed:
        raise RecycleError(f"export-torch needs a fault-free plan; this one has dead workers "
                           f"({format_workers(plan.failed)}) and re-routes micro-batches across "
                           f"pipelines, which torch's pipeline runtime cannot run")
    spec = plan.spec
    if not 0 <= pipeline < spec.pipelines:
        raise RecycleError(f"pipeline {pipeline} is outside 0..{spec.pipelines - 1}")
    rows = []
    for s in range(spec.stages):
        rows.append([op.torch_action() for op in plan.schedule.ops((pipeline, s))
                     if op.kind not in COLLECTIVE_NAMES])
    return rows


def export_torch_csv(plan: Plan, path: str | Path, pipeline: int = 0) -> None:
    rows = torch_rows(plan, pipeline)
    atomic_write(path, lambda fh: csv.writer(fh, lineterminator="\n").writerows(rows))
