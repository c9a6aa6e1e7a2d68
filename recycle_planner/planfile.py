"""Plan files: JSON with a format name and version, written atomically, read strictly.

A file whose name ends in `.gz` is gzip-compressed (large plans compress about tenfold).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from recycle_planner import __version__
from recycle_planner.errors import (FailureSetError, OutputError, PlanFileError, RecycleError,
                                    SpecError)
from recycle_planner.failures import check_failed
from recycle_planner.ops import KIND_CODES, OpSpace
from recycle_planner.plan import Plan, worker_stats
from recycle_planner.policy import Policy
from recycle_planner.schedule import Schedule
from recycle_planner.simulate import Timing
from recycle_planner.spec import JobSpec

PLAN_FORMAT = "recycle-plan"
PLAN_VERSION = 1


STDOUT = "-"  # an output named '-' is standard output, as usual on the command line


def is_stdout(path: str | Path | None) -> bool:
    return path is not None and str(path) == STDOUT


def output_folder(path: Path) -> Path:
    """The folder a file will be written to; a clear error if it does not exist."""
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise OutputError(f"{path}: folder {folder} does not exist")
    return folder


def check_writable(path: str | Path, folder: bool = False) -> None:
    """Fail before any work when `path` (a file, or with `folder` a folder that may not exist
    yet) cannot be written: no such folder, a read-only file system, no permission. Probes by
    creating and removing an empty file, which also works for root and for mounts."""
    path = Path(path)
    if is_stdout(path):
        return
    if folder:
        where = path
        while not where.exists() and where != where.parent:
            where = where.parent
        if not where.is_dir():
            raise OutputError(f"{path}: {where} is not a folder")
    else:
        if path.is_dir():
            raise OutputError(f"{path}: is a folder, not a file name")
        where = output_folder(path)
    try:
        fd, probe = tempfile.mkstemp(prefix=".recycle-probe.", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write to {where}: {exc.strerror or exc}") from None


def atomic_write(path: str | Path, write: Callable[[Any], None], binary: bool = False) -> None:
    """Write through a temporary file in the same folder and rename it into place, so that a
    reader never sees half a file and a failure (a full disk, a read-only file system) leaves
    nothing behind and is an `OutputError` naming the file. '-' is standard output."""
    if is_stdout(path):
        stream = sys.stdout.buffer if binary else sys.stdout
        write(stream)
        stream.flush()
        return
    path = Path(path)
    folder = output_folder(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
        text_mode = {} if binary else {"encoding": "utf-8"}
        with os.fdopen(fd, "wb" if binary else "w", **text_mode) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        if isinstance(exc, OSError):
            raise OutputError(f"{path}: cannot write: {exc.strerror or exc}") from None
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: str | Path, data: dict[str, Any]) -> bytes:
    """Atomically write `data` as JSON, gzip-compressed when the name ends in .gz; returns the
    bytes written (to checksum them without reading the file back)."""
    path = Path(path)
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    if path.suffix == ".gz":
        blob = gzip.compress(text.encode(), compresslevel=3, mtime=0)
    else:
        blob = (text + "\n").encode()
    atomic_write(path, lambda fh: fh.write(blob), binary=True)
    return blob


def read_json(path: str | Path, what: str = "plan") -> Any:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PlanFileError(f"{path}: cannot read {what} file: {exc.strerror or exc}") from None
    try:
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        return json.loads(raw.decode("utf-8"))
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanFileError(f"{path}: not a {what} file (truncated or not JSON: {exc})") from None


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    sched, timing = plan.schedule, plan.timing
    spec = sched.spec
    S = spec.stages
    stats = worker_stats(sched, timing, plan.metrics["period"])
    workers = []
    for d, s in sched.live_workers():
        w = d * S + s
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
        "metrics": dict(plan.metrics),
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
        w = d * S + s
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
    metrics = data["metrics"]
    if not isinstance(metrics, dict):
        raise PlanFileError(f"{where}: 'metrics' must be an object")
    for key in ("iteration_time", "period", "fault_free_period", "degradation", "lower_bound"):
        value = metrics.get(key)
        if not _is_number(value):
            raise PlanFileError(f"{where}: metrics.{key} must be a number")
    schedule = Schedule(spec=spec, policy=policy, failed=failed, orders=tuple(orders))
    solver = data.get("solver") if isinstance(data.get("solver"), dict) else {}
    mapping = data.get("mapping") if isinstance(data.get("mapping"), dict) else None
    return Plan(schedule=schedule, timing=Timing(start, end), metrics=dict(metrics),
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
    code = KIND_CODES[kind]
    if code >= 4:
        if op.get("microbatch") is not None:
            raise PlanFileError(f"{at}: {kind} has no micro-batch")
        return space.allreduce(d, s) if kind == "ALLREDUCE" else space.optimizer(d, s)
    m = _index(op, "microbatch", spec.microbatches, at)
    return space.compute(code, d, s, m)


def _is_number(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value))


def _time(op: dict, key: str, at: str) -> float:
    value = op.get(key)
    if not _is_number(value):
        raise PlanFileError(f"{at}: '{key}' must be a number of milliseconds, got {value!r}")
    return float(value)
