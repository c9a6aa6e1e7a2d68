"""Plan files: JSON with a format name and version, written atomically, read strictly.

Two forms of one format. Version 3, *timed*: every op of every live worker with its start and
end (what `plan -o` writes and `validate` checks, a person can read and edit it). Version 4,
*compact*: each live worker's ops as one action string, `F0 F1p3 I0 W0 F0c1 ... A O` (kind and
micro-batch, `c<k>` when the op runs the worker's chunk k > 0, `p<d>` when the micro-batch is
another pipeline's, i.e. re-routed; `A` and `O` the worker's all-reduce and optimizer step;
the stage is the worker's), and no times: the simulator recomputes them on load (0.1 s for
200k ops) and the recorded period must come out again. The library stores the compact form: a
200k-op plan is 22 KB gzipped instead of 2.3 MB. A file whose name ends in `.gz` is
gzip-compressed.

Versions 1 (timed) and 2 (compact) are the same forms from before jobs had chunks: ops carry
no chunk; they are still read, for jobs with one chunk per worker.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from recycle_planner import __version__
from recycle_planner.errors import (FailureSetError, PlanFileError, RecycleError, ScheduleError,
                                    SpecError)
from recycle_planner.io import read_json, write_json
from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.job.workers import check_failed
from recycle_planner.schedules.ops import (AR, COLLECTIVE_NAMES, COMPUTE_KINDS, KIND_CODES,
                                          OPT, Op, OpSpace, worker_index)
from recycle_planner.schedules.schedule import Schedule
from recycle_planner.timing.metrics import Metrics
from recycle_planner.timing.plan import Plan, worker_stats
from recycle_planner.timing.simulate import Timing, simulate

PLAN_FORMAT = "recycle-plan"
PLAN_VERSION = 3       # timed: ops with their times (and chunks)
COMPACT_VERSION = 4    # compact: per-worker action strings, times recomputed on load
TIMED_VERSIONS = (1, PLAN_VERSION)
COMPACT_VERSIONS = (2, COMPACT_VERSION)
CHUNKLESS_VERSIONS = (1, 2)  # written before ops carried their chunk
PERIOD_TOLERANCE = 1e-6  # relative: a compact file's recorded period against its simulation

COLLECTIVE_ACTIONS = {AR: "A", OPT: "O"}
_ACTION = re.compile(r"([FIWB])([0-9]+)(?:c([0-9]+))?(?:p([0-9]+))?|([AO])")


def worker_actions(space: OpSpace, ids: np.ndarray, pipeline: int) -> str:
    """The action string of one worker's ops (`F0 F1p3 I0 F0c1 ... A O`)."""
    out = []
    for op in space.to_ops(ids):
        code = KIND_CODES[op.kind]
        if code >= COMPUTE_KINDS:
            out.append(COLLECTIVE_ACTIONS[code])
            continue
        chunk = f"c{op.chunk}" if op.chunk else ""
        where = "" if op.pipeline == pipeline else f"p{op.pipeline}"
        out.append(f"{op.kind}{op.microbatch}{chunk}{where}")
    return " ".join(out)


def parse_actions(text: str, space: OpSpace, pipeline: int, stage: int, at: str,
                  chunks: bool = True) -> np.ndarray:
    """The op ids of worker (pipeline, stage)'s action string; a PlanFileError naming the first
    token that is not an action of this job (a chunk where `chunks` is False: an old file)."""
    tokens = text.split()
    ids = np.empty(len(tokens), dtype=np.int64)
    for j, token in enumerate(tokens):
        m = _ACTION.fullmatch(token)
        if m is None or (m[3] is not None and not chunks):
            raise PlanFileError(f"{at}: action {j} {token!r} is not one (expected e.g. F3, "
                                f"I3p1 for pipeline 1's micro-batch 3, F3c1 for chunk 1, A "
                                f"or O)")
        if m[5] is not None:
            ids[j] = (space.allreduce if m[5] == "A" else space.optimizer)(pipeline, stage)
            continue
        mb, p = int(m[2]), pipeline if m[4] is None else int(m[4])
        chunk = int(m[3] or 0)
        if mb >= space.M or p >= space.D or chunk >= space.C:
            chunks_part = f", {space.C} chunks per worker" if space.C > 1 else ""
            raise PlanFileError(f"{at}: action {j} {token!r} is outside the job "
                                f"({space.D} pipelines, {space.M} micro-batches{chunks_part})")
        ids[j] = space.compute(KIND_CODES[m[1]], p, int(space.vstage_of[stage, chunk]), mb)
    return ids


def plan_to_dict(plan: Plan, compact: bool = False) -> dict[str, Any]:
    """The plan file's data: timed (every op with its times) or `compact` (action strings)."""
    sched, timing = plan.schedule, plan.timing
    spec = sched.spec
    S = spec.stages
    workers = []
    if compact:
        for d, s in sched.live_workers():
            workers.append({"pipeline": d, "stage": s, "actions": worker_actions(
                sched.space, sched.orders[worker_index(S, d, s)], d)})
    else:
        stats = worker_stats(sched, timing, plan.metrics.period)
        for d, s in sched.live_workers():
            w = worker_index(S, d, s)
            ids = sched.orders[w]
            ops = [{"kind": op.kind, "pipeline": op.pipeline, "stage": op.stage,
                    "chunk": op.chunk, "microbatch": op.microbatch, "start": a, "end": b}
                   for op, a, b in zip(sched.space.to_ops(ids), timing.start[ids].tolist(),
                                       timing.end[ids].tolist())]
            workers.append({"pipeline": d, "stage": s, "ops": ops,
                            "busy": float(stats.busy[w]),
                            "bubble_rate": float(stats.bubble_rate[w]),
                            "peak_inflight": int(stats.peak_inflight[w])})
    out: dict[str, Any] = {
        "format": PLAN_FORMAT,
        "version": COMPACT_VERSION if compact else PLAN_VERSION,
        "generator": f"recycle-planner {__version__}",
        "spec": spec.to_dict(),
        "policy": plan.policy.to_dict(),
        "failed": [list(w) for w in plan.failed],
        "solver": dict(plan.solver),
        "workers": workers,
        "metrics": plan.metrics.to_dict(),
    }
    if plan.mapping is not None:
        out["mapping"] = plan.mapping
    return out


def write_plan(plan: Plan, path: str | Path, compact: bool = False) -> bytes:
    """Write the plan file atomically; returns the bytes written (for a checksum)."""
    # Action strings are small and repetitive: the best gzip level costs milliseconds there.
    return write_json(path, plan_to_dict(plan, compact), level=9 if compact else 3)


def read_plan(path: str | Path) -> Plan:
    """Read a plan file; anything truncated, foreign or inconsistent is a `PlanFileError` that
    names the file and the place."""
    return plan_from_dict(read_json(path), str(path))


def plan_from_dict(data: Any, where: str = "plan") -> Plan:
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise PlanFileError(f"{where}: not a recycle-plan file (format is {found!r})")
    version = data.get("version")
    readable = TIMED_VERSIONS + COMPACT_VERSIONS
    if isinstance(version, bool) or version not in readable:
        raise PlanFileError(f"{where}: plan format version {version!r} is not supported "
                            f"(this recycle-planner reads versions "
                            f"{', '.join(map(str, sorted(readable)))})")
    compact = version in COMPACT_VERSIONS
    chunked = version not in CHUNKLESS_VERSIONS
    for key in ("spec", "failed", "workers", "metrics"):
        if key not in data:
            raise PlanFileError(f"{where}: missing key '{key}'")
    try:
        spec = JobSpec.from_dict(data["spec"], f"{where}: spec")  # the message names `where`
    except SpecError as exc:
        raise PlanFileError(str(exc)) from None
    if spec.chunks > 1 and not chunked:
        raise PlanFileError(f"{where}: a version-{version} plan file has one chunk per worker, "
                            f"but its spec has {spec.chunks}")
    policy = _policy(data.get("policy", Policy().to_dict()), where)
    if not isinstance(data["failed"], list):
        raise PlanFileError(f"{where}: 'failed' must be a list of [pipeline, stage] pairs")
    try:
        failed = check_failed(spec, data["failed"])
    except FailureSetError as exc:
        raise PlanFileError(f"{where}: {exc}") from None
    space = OpSpace.of(spec)
    S = spec.stages
    orders: list[np.ndarray] = [np.zeros(0, dtype=np.int64) for _ in range(spec.workers)]
    start = np.full(space.size, np.nan)
    end = np.full(space.size, np.nan)
    seen: set[int] = set()
    if not isinstance(data["workers"], list):
        raise PlanFileError(f"{where}: 'workers' must be a list")
    if not data["workers"]:
        raise PlanFileError(f"{where}: 'workers' is empty: a plan lists the ops of every live "
                            f"worker")
    for i, entry in enumerate(data["workers"]):
        at = f"{where}: workers[{i}]"
        if not isinstance(entry, dict):
            raise PlanFileError(f"{at}: expected an object")
        d = _index(entry, "pipeline", spec.pipelines, at)
        s = _index(entry, "stage", S, at)
        w = worker_index(S, d, s)
        if w in seen:
            raise PlanFileError(f"{at}: worker {d}:{s} appears twice")
        seen.add(w)
        if compact:
            if not isinstance(entry.get("actions"), str):
                raise PlanFileError(f"{at}: 'actions' must be a string of actions")
            orders[w] = parse_actions(entry["actions"], space, d, s, at, chunks=chunked)
            continue
        ops = entry.get("ops")
        if not isinstance(ops, list):
            raise PlanFileError(f"{at}: 'ops' must be a list")
        ids = np.empty(len(ops), dtype=np.int64)
        for j, op in enumerate(ops):
            ids[j] = _op_id(op, space, spec, f"{at}.ops[{j}]", chunked)
            a, b = _time(op, "start", f"{at}.ops[{j}]"), _time(op, "end", f"{at}.ops[{j}]")
            start[ids[j]], end[ids[j]] = a, b
        orders[w] = ids
    metrics = Metrics.from_dict(data["metrics"], where)
    schedule = Schedule(spec=spec, policy=policy, failed=failed, orders=tuple(orders))
    if compact:
        start, end = _simulated_times(schedule, metrics.period, where)
    solver = data.get("solver") if isinstance(data.get("solver"), dict) else {}
    mapping = data.get("mapping") if isinstance(data.get("mapping"), dict) else None
    return Plan(schedule=schedule, timing=Timing(start, end), metrics=metrics,
                solver=solver, mapping=mapping)


def _simulated_times(schedule: Schedule, period: float, where: str
                     ) -> tuple[np.ndarray, np.ndarray]:
    """A compact file's times, from the simulator; its recorded period must come out again
    (anything else is a damaged or edited file)."""
    try:
        sim = simulate(schedule)
    except ScheduleError as exc:
        raise PlanFileError(f"{where}: {exc}") from None
    if abs(sim.period - period) > PERIOD_TOLERANCE * max(1.0, abs(period)):
        raise PlanFileError(f"{where}: its actions repeat every {sim.period:.6g} ms but "
                            f"metrics.period is {period:.6g}: the file was edited or damaged")
    return sim.timing.start, sim.timing.end


def _policy(data: Any, where: str) -> Policy:
    try:
        return Policy.from_dict(data)
    except RecycleError as exc:
        raise PlanFileError(f"{where}: {exc}") from None


def _index(entry: dict, key: str, limit: int, at: str) -> int:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
        raise PlanFileError(f"{at}: '{key}' must be a whole number from 0 to {limit - 1}, "
                            f"got {value!r}")
    return value


def _op_id(op: Any, space: OpSpace, spec: JobSpec, at: str, chunked: bool) -> int:
    if not isinstance(op, dict):
        raise PlanFileError(f"{at}: expected an object")
    if "chunk" in op and not chunked:
        raise PlanFileError(f"{at}: 'chunk' is not a key of a version-1 plan file")
    kind = op.get("kind")
    if kind not in KIND_CODES:
        raise PlanFileError(f"{at}: unknown kind {kind!r} (expected one of: "
                            f"{', '.join(KIND_CODES)})")
    d = _index(op, "pipeline", spec.pipelines, at)
    s = _index(op, "stage", spec.stages, at)
    if kind in COLLECTIVE_NAMES:
        if op.get("microbatch") is not None:
            raise PlanFileError(f"{at}: {kind} has no micro-batch")
        return space.id_of(Op(kind, d, s, None))
    chunk = _index(op, "chunk", spec.chunks, at) if "chunk" in op else 0
    return space.id_of(Op(kind, d, s, _index(op, "microbatch", spec.microbatches, at), chunk))


def _is_number(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value))


def _time(op: dict, key: str, at: str) -> float:
    value = op.get(key)
    if not _is_number(value):
        raise PlanFileError(f"{at}: '{key}' must be a number of milliseconds, got {value!r}")
    return float(value)
