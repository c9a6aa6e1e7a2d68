"""Export a fault-free plan to torch.distributed.pipelining's CSVs.

One row per pipeline-stage rank, one cell per action in execution order (`0F1` = stage 0
forward of micro-batch 1; I, W and B as in torch). Where workers hold several chunks the
stage is the virtual stage, as torch numbers them (rank r's row of an interleaved job has
stages r, r + S, ...; of a V job, r and 2S - 1 - r). Two formats, as torch's
`_PipelineScheduleRuntime._load_csv(path, format=...)` reads them: `compute_only` (torch adds
the sends and receives itself) and `compute_comms` (`torch_comms_rows`: the programs' own
order, receives and sends included, `1RECV_F2`, `1SEND_B2`, with `1REDUCE_GRAD` where the
program waits for the stage's all-reduce). torch runs one pipeline, so one pipeline of the plan
is exported; torch's data-parallel wrapper (FSDP, replicate) does the gradient all-reduce at
REDUCE_GRAD, and the optimizer step stays the training loop's.

A plan with dead workers cannot be written in torch's format, whatever the columns: its
actions name a stage and a micro-batch but no pipeline, a stage lives on exactly one rank of
the pipeline group (`_validate_schedule` refuses a stage on two ranks), and every stage runs
exactly the schedule's micro-batch count. A re-routed micro-batch is another pipeline's,
computed on a peer that belongs to a different pipeline group and that runs more than M
micro-batches of its stage; its activation crosses from one pipeline's rank to another's. Those
plans run from recycle-planner's programs (`recycle_planner.programs`).
"""

from __future__ import annotations

import csv
from pathlib import Path

from recycle_planner.errors import RecycleError
from recycle_planner.io import atomic_write
from recycle_planner.job.workers import format_workers
from recycle_planner.schedules.ops import COLLECTIVE_NAMES
from recycle_planner.programs.actions import (ACTIVATION, AllReduce, Compute, Message, Program,
                                              Recv)
from recycle_planner.timing.plan import Plan


def torch_rows(plan: Plan, pipeline: int = 0) -> list[list[str]]:
    if plan.failed:
        raise RecycleError(f"export-torch needs a fault-free plan; this one has dead workers "
                           f"({format_workers(plan.failed)}) and re-routes micro-batches across "
                           f"pipelines, which torch's pipeline runtime cannot run")
    spec = plan.spec
    if not 0 <= pipeline < spec.pipelines:
        raise RecycleError(f"pipeline {pipeline} is outside 0..{spec.pipelines - 1}")
    # torch numbers a rank's chunks by virtual stage (several stages per rank).
    vstage = plan.schedule.space.vstage_of
    rows = []
    for s in range(spec.stages):
        rows.append([op.torch_action(int(vstage[op.stage, op.chunk]))
                     for op in plan.schedule.ops((pipeline, s))
                     if op.kind not in COLLECTIVE_NAMES])
    return rows


def export_torch_csv(plan: Plan, path: str | Path, pipeline: int = 0) -> None:
    rows = torch_rows(plan, pipeline)
    atomic_write(path, lambda fh: csv.writer(fh, lineterminator="\n").writerows(rows))


def torch_comms_rows(pipeline: list[Program]) -> list[list[str]]:
    """torch's compute_comms rows of one pipeline's programs (one per stage, in stage order):
    each program's actions in its own order."""
    ranks = {p.rank for p in pipeline}
    rows = []
    for program in pipeline:
        row, s = [], program.stage
        for a in program.actions:
            if isinstance(a, (Message, Compute)) and a.pipeline != program.pipeline:
                raise RecycleError(f"rank {program.rank} runs micro-batch {a.microbatch} of "
                                   f"pipeline {a.pipeline}, another pipeline's: torch's format "
                                   f"cannot express it")
            if isinstance(a, Message):
                if a.peer not in ranks:
                    raise RecycleError(f"rank {program.rank} exchanges micro-batch {a.microbatch} "
                                       f"with rank {a.peer}, outside its pipeline: torch's "
                                       f"format cannot express it")
                way = "RECV" if isinstance(a, Recv) else "SEND"
                row.append(f"{s}{way}_{'F' if a.what == ACTIVATION else 'B'}{a.microbatch}")
            elif isinstance(a, Compute):
                row.append(f"{s}{a.kind}{a.microbatch}")
            elif isinstance(a, AllReduce):
                row.append(f"{s}REDUCE_GRAD")
        rows.append(row)
    return rows


def export_torch_comms_csv(pipeline: list[Program], path: str | Path) -> None:
    rows = torch_comms_rows(pipeline)
    atomic_write(path, lambda fh: csv.writer(fh, lineterminator="\n").writerows(rows))
