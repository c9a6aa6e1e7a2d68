"""Plan files: JSON with a format name and version, written atomically, read strictly.

A file whose name ends in `.gz` is gzip-compressed (large plans compress about tenfold).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from recycle_planner import __version__
from recycle_planner.errors import FailureSetError, PlanFileError, RecycleError, SpecError
from recycle_planner.io import read_json, write_json
from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.job.workers import check_failed
from recycle_planner.schedules.ops import COLLECTIVE_NAMES, KIND_CODES, Op, OpSpace, worker_index
from recycle_planner.schedules.schedule import Schedule
from recycle_planner.timing.metrics import Metrics
from recycle_planner.timing.plan import Plan, worker_stats
from recycle_planner.timing.simulate import Timing

PLAN_FORMAT = "recycle-plan"
PLAN_VERSION = 1


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    sched, timing = plan.schedule, plan.timing
    spec = sched.spec
    S = spec.stages
    stats = worker_stats(sched, timing, plan.metrics.period)
    workers = []
    for d, s in sched.live_workers():
        w = worker_index(S, d, s)
        ids = sched.orders[w]
        ops = [{"kind": op.kind, "pipeline": op.pipeline, "stage": op.stage,
                "microbatch": op.microbatch, "start": a, "end": b}
               for op, a, b in zip(sched.space.to_ops(ids), timing.start[ids].tolist(),
                                   timing.end[ids].tolist())]
        workers.append({"pipeline": d, "stage": s, "ops": ops,
                        "busy": float(stats.busy[w]), "bubble_rate": float(stats.bubble_rate[w]),
                        "peak_inflight": int(stats.peak_inflight[w])})
    out: dict[str, Any] = {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
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


def write_plan(plan: Plan, path: str | Path) -> bytes:
    return write_json(path, plan_to_dict(plan))


def read_plan(path: str | Path) -> Plan:
    """Read a plan file; anything truncated, foreign or inconsistent is a `PlanFileError` that
    names the file and the place."""
    return plan_from_dict(read_json(path), str(path))


def plan_from_dict(data: Any, where: str = "plan") -> Plan:
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise PlanFileError(f"{where}: not a recycle-plan file (format is {found!r})")
    version = data.get("version")
    if version != PLAN_VERSION:
        raise PlanFileError(f"{where}: plan format version {version!r} is not supported "
                            f"(this recycle-planner reads version {PLAN_VERSION})")
    for key in ("spec", "failed", "workers", "metrics"):
        if key not in data:
            raise PlanFileError(f"{where}: missing key '{key}'")
    try:
        spec = JobSpec.from_dict(data["spec"], f"{where}: spec")  # the message names `where`
    except SpecError as exc:
        raise PlanFileError(str(exc)) from None
    policy = _policy(data.get("policy", Policy().to_dict()), where)
    if not isinstance(data["failed"], list):
        raise PlanFileError(f"{where}: 'failed' must be a list of [pipeline, stage] pairs")
    try:
        failed = check_failed(spec, data["failed"])
    except FailureSetError as exc:
        raise PlanFileError(f"{where}: {exc}") from None
    space = OpSpace(spec.stages, spec.pipelines, spec.microbatches)
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
        ops = entry.get("ops")
        if not isinstance(ops, list):
            raise PlanFileError(f"{at}: 'ops' must be a list")
        ids = np.empty(len(ops), dtype=np.int64)
        for j, op in enumerate(ops):
            ids[j] = _op_id(op, space, spec, f"{at}.ops[{j}]")
            a, b = _time(op, "start", f"{at}.ops[{j}]"), _time(op, "end", f"{at}.ops[{j}]")
            start[ids[j]], end[ids[j]] = a, b
        orders[w] = ids
    metrics = Metrics.from_dict(data["metrics"], where)
    schedule = Schedule(spec=spec, policy=policy, failed=failed, orders=tuple(orders))
    solver = data.get("solver") if isinstance(data.get("solver"), dict) else {}
    mapping = data.get("mapping") if isinstance(data.get("mapping"), dict) else None
    return Plan(schedule=schedule, timing=Timing(start, end), metrics=metrics,
                solver=solver, mapping=mapping)


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


def _op_id(op: Any, space: OpSpace, spec: JobSpec, at: str) -> int:
    if not isinstance(op, dict):
        raise PlanFileError(f"{at}: expected an object")
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
    return space.id_of(Op(kind, d, s, _index(op, "microbatch", spec.microbatches, at)))


def _is_number(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value))


def _time(op: dict, key: str, at: str) -> float:
    value = op.get(key)
    if not _is_number(value):
        raise PlanFileError(f"{at}: '{key}' must be a number of milliseconds, got {value!r}")
    return float(value)
