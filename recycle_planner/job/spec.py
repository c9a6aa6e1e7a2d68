"""The job spec: a hybrid-parallel training job described in a small TOML file.

Every per-stage figure is stored as a tuple with one value per stage, so that the rest of the
code never has to ask whether the user wrote a number or a list. `JobSpec.to_dict` writes the
spec back with the same keys as the TOML file (a number where all stages agree).
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from recycle_planner.errors import SpecError

TIME_KEYS = ("forward", "backward_input", "backward_weight", "p2p", "allreduce", "optimizer")
TOP_KEYS = ("name", "stages", "pipelines", "microbatches", "microbatch_size", "time", "memory")
MEMORY_KEYS = ("activation", "budget", "static", "max_inflight")
# Costs a job may leave out: zero is a valid value for each (no p2p latency, ...).
TIME_DEFAULTS = {"backward_weight": 0.0, "p2p": 0.0, "allreduce": 0.0, "optimizer": 0.0}
REQUIRED_KEYS = ("stages", "pipelines", "microbatches")
# Limits that keep the arithmetic exact and the arrays in memory: an op of at most 10^9 ms
# (11 days) and at most 4M (stage, pipeline, micro-batch) cells, 12M ops, per iteration.
MAX_MS = 1e9
MAX_CELLS = 4_000_000

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


@dataclass(frozen=True)
class MemorySpec:
    """Per-worker memory model. Each in-flight micro-batch (forward started, weight gradient
    not yet done) holds `activation[s]` bytes on a stage-s worker, which also holds `static[s]`
    bytes of parameters and optimizer state; a worker has `budget` bytes. `max_inflight`
    caps the number of in-flight micro-batches directly. Either or both may be given."""

    activation: tuple[float, ...] | None = None
    budget: float | None = None
    static: tuple[float, ...] | None = None
    max_inflight: int | None = None

    def caps(self, stages: int) -> tuple[int | None, ...]:
        """In-flight micro-batch limit per stage implied by this model (None: no limit)."""
        out: list[int | None] = []
        for s in range(stages):
            cap = self.max_inflight
            if self.budget is not None and self.activation is not None:
                static = self.static[s] if self.static else 0.0
                room = (self.budget - static) / self.activation[s]
                by_bytes = int(math.floor(min(room, 2.0**62) + 1e-9))  # room may overflow
                cap = by_bytes if cap is None else min(cap, by_bytes)
            out.append(cap)
        return tuple(out)


@dataclass(frozen=True)
class JobSpec:
    """S stages, D pipelines, M micro-batches per pipeline per iteration, and per-stage costs in
    milliseconds. `p2p[s]` is the latency of a message sent by a stage-s worker (activations
    downstream, gradients upstream)."""

    stages: int
    pipelines: int
    microbatches: int
    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    p2p: tuple[float, ...]
    allreduce: tuple[float, ...]
    optimizer: tuple[float, ...]
    memory: MemorySpec | None = None
    microbatch_size: int | None = None
    name: str | None = None

    @property
    def backward(self) -> tuple[float, ...]:
        """Full backward (B = I + W) per stage."""
        return tuple(i + w for i, w in zip(self.backward_input, self.backward_weight))

    @property
    def workers(self) -> int:
        return self.stages * self.pipelines

    def caps(self) -> tuple[int | None, ...]:
        return self.memory.caps(self.stages) if self.memory else (None,) * self.stages

    def to_dict(self) -> dict[str, Any]:
        """The spec with the TOML file's keys; a number where every stage has the same value."""
        out: dict[str, Any] = {}
        if self.name is not None:
            out["name"] = self.name
        out.update(stages=self.stages, pipelines=self.pipelines, microbatches=self.microbatches)
        if self.microbatch_size is not None:
            out["microbatch_size"] = self.microbatch_size
        out["time"] = {k: _compact(getattr(self, k)) for k in TIME_KEYS}
        if self.memory is not None:
            mem: dict[str, Any] = {}
            for key in MEMORY_KEYS:
                value = getattr(self.memory, key)
                if value is not None:
                    mem[key] = _compact(value) if isinstance(value, tuple) else value
            out["memory"] = mem
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "spec") -> "JobSpec":
        return _parse(data, where)


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a job spec, TOML or JSON (a `.json` name, or text that starts with
    '{'), with the same keys; every error, hostile content included (deep nesting, huge
    numbers), names the file and the key."""
    from recycle_planner.io import check_depth, parse_json

    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read spec: {exc.strerror or exc}") from None
    if path.suffix.lower() == ".json" or raw.lstrip()[:1] == b"{":
        data = parse_json(raw, str(path), "JSON spec", error=SpecError)
        if not isinstance(data, dict):
            raise SpecError(f"{path}: a JSON spec is an object of the TOML keys, got "
                            f"{type(data).__name__}")
        return _parse(data, str(path))
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise SpecError(f"{path}: not a text file") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: invalid TOML: {exc}") from None
    except RecursionError:
        raise SpecError(f"{path}: invalid TOML: nested too deeply") from None
    except ValueError:  # a whole number of thousands of digits
        raise SpecError(f"{path}: invalid TOML: a number is too large") from None
    check_depth(data, str(path), SpecError)
    return _parse(data, str(path))


def _compact(values: tuple[float, ...]) -> float | list[float]:
    first = values[0]
    if all(v == first for v in values):
        return _plain(first)
    return [_plain(v) for v in values]


def _plain(v: float) -> float | int:
    return int(v) if float(v).is_integer() and abs(v) < 2**53 else float(v)


def _parse(data: Mapping[str, Any], where: str) -> JobSpec:
    if not isinstance(data, Mapping):
        raise SpecError(f"{where}: expected a table of keys, got {type(data).__name__}")
    _no_unknown(data, TOP_KEYS, where, "")
    time = data.get("time")
    if time is not None and not isinstance(time, Mapping):
        raise SpecError(f"{where}: 'time' must be a table")
    _no_unknown(time or {}, TIME_KEYS, where, "time.")
    _no_missing(data, time, where)
    stages = _count(data, "stages", where)
    pipelines = _count(data, "pipelines", where)
    microbatches = _count(data, "microbatches", where)
    mbs = _count(data, "microbatch_size", where) if "microbatch_size" in data else None
    cells = stages * pipelines * microbatches
    if cells > MAX_CELLS:
        raise SpecError(f"{where}: stages x pipelines x microbatches = {cells:,} is more than "
                        f"the planner handles ({MAX_CELLS:,}, about {3 * MAX_CELLS // 10**6}M "
                        f"ops per iteration)")
    name = data.get("name")
    if name is not None and not isinstance(name, str):
        raise SpecError(f"{where}: 'name' must be a string")

    costs = {}
    for key in TIME_KEYS:
        positive = key in ("forward", "backward_input")
        costs[key] = _per_stage(time.get(key, TIME_DEFAULTS.get(key)), stages, where,
                                f"time.{key}", positive=positive, maximum=MAX_MS)

    memory = None
    if "memory" in data:
        memory = _parse_memory(data["memory"], stages, where)

    spec = JobSpec(stages=stages, pipelines=pipelines, microbatches=microbatches,
                   memory=memory, microbatch_size=mbs, name=name, **costs)
    for s, cap in enumerate(spec.caps()):
        if cap is not None and cap < 1:
            raise SpecError(f"{where}: 'memory.budget' leaves stage {s} no room for a single "
                            f"micro-batch's activations")
    return spec


def _parse_memory(mem: Any, stages: int, where: str) -> MemorySpec:
    if not isinstance(mem, Mapping):
        raise SpecError(f"{where}: 'memory' must be a table")
    _no_unknown(mem, MEMORY_KEYS, where, "memory.")
    if not mem:
        raise SpecError(f"{where}: [memory] needs 'activation' and 'budget', or 'max_inflight'")
    has_bytes = "activation" in mem or "budget" in mem
    if has_bytes and not ("activation" in mem and "budget" in mem):
        missing = "budget" if "activation" in mem else "activation"
        raise SpecError(f"{where}: 'memory.{missing}' is needed with "
                        f"'memory.{'activation' if missing == 'budget' else 'budget'}'")
    if "static" in mem and not has_bytes:
        raise SpecError(f"{where}: 'memory.static' needs 'memory.activation' and 'memory.budget'")
    activation = budget = static = None
    if has_bytes:
        activation = _per_stage(mem["activation"], stages, where, "memory.activation",
                                positive=True, units=True)
        budget = _bytes(mem["budget"], where, "memory.budget")
        if budget <= 0:
            raise SpecError(f"{where}: 'memory.budget' must be positive")
        if "static" in mem:
            static = _per_stage(mem["static"], stages, where, "memory.static", units=True)
    max_inflight = (_count(mem, "max_inflight", where, prefix="memory.")
                    if "max_inflight" in mem else None)
    return MemorySpec(activation=activation, budget=budget, static=static,
                      max_inflight=max_inflight)


def _no_missing(data: Mapping[str, Any], time: Mapping[str, Any] | None, where: str) -> None:
    """Every missing required key in one message, not one per run."""
    missing = [f"'{key}'" for key in REQUIRED_KEYS if key not in data]
    if time is None:
        missing.append("table [time]")
    else:
        missing += [f"'time.{key}'" for key in TIME_KEYS
                    if key not in TIME_DEFAULTS and key not in time]
    if missing:
        raise SpecError(f"{where}: missing {'key' if len(missing) == 1 else 'keys'} "
                        f"{', '.join(missing)}")


def _no_unknown(table: Mapping[str, Any], allowed: tuple[str, ...], where: str,
                prefix: str) -> None:
    for key in table:
        if key not in allowed:
            raise SpecError(f"{where}: unknown key '{prefix}{key}' "
                            f"(expected one of: {', '.join(allowed)})")


def _count(table: Mapping[str, Any], key: str, where: str, prefix: str = "") -> int:
    if key not in table:
        raise SpecError(f"{where}: missing key '{prefix}{key}'")
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where}: '{prefix}{key}' must be a whole number, got {value!r}")
    if value < 1:
        raise SpecError(f"{where}: '{prefix}{key}' must be at least 1, got {value}")
    return value


def _number(value: Any, where: str, key: str, units: bool = False) -> float:
    if units and isinstance(value, str):
        return _bytes(value, where, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{where}: '{key}' must be a number, got {value!r}")
    if not math.isfinite(value):
        raise SpecError(f"{where}: '{key}' must be finite, got {value!r}")
    return float(value)


def _bytes(value: Any, where: str, key: str) -> float:
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]i?B|B)?\s*",
                             value, flags=re.IGNORECASE)
        if not match:
            raise SpecError(f"{where}: '{key}' must be a number of bytes or a size like "
                            f"'12GiB', got {value!r}")
        value = float(match.group(1)) * _UNITS[(match.group(2) or "").upper()]
        if not math.isfinite(value):
            raise SpecError(f"{where}: '{key}' must be finite, got {match.group(0).strip()!r}")
        return value
    return _number(value, where, key)


def _per_stage(value: Any, stages: int, where: str, key: str, positive: bool = False,
               units: bool = False, maximum: float = math.inf) -> tuple[float, ...]:
    if isinstance(value, list):
        if len(value) != stages:
            raise SpecError(f"{where}: '{key}' lists {len(value)} values but there are "
                            f"{stages} stages")
        values = tuple(_number(v, where, f"{key}[{i}]", units) for i, v in enumerate(value))
    else:
        values = (_number(value, where, key, units),) * stages
    for i, v in enumerate(values):
        at = f"{key}[{i}]" if isinstance(value, list) else key
        if v < 0 or (positive and v == 0):
            bound = "positive" if positive else "zero or more"
            raise SpecError(f"{where}: '{at}' must be {bound}, got {_plain(v)}")
        if v > maximum:
            raise SpecError(f"{where}: '{at}' must be at most {_plain(maximum)}, got {_plain(v)}")
    return values
