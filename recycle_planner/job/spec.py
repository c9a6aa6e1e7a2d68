"""The job spec: a hybrid-parallel training job described in a small TOML file.

Every per-stage figure is stored as a tuple with one value per stage, so that the rest of the
code never has to ask whether the user wrote a number or a list. `JobSpec.to_dict` writes the
spec back with the same keys as the TOML file (a number where all stages agree).

A job may give each worker several model chunks (`chunks` = v, virtual stages; `layout`
"interleaved": worker s holds virtual stages s, s + S, ..., as Megatron-LM and torch's
ScheduleInterleaved1F1B place them; "v": two chunks, worker s holds s and 2S - 1 - s, as
ScheduleZBVZeroBubble does). The compute and p2p costs are then stored per virtual stage
(S x v values, virtual stage order): a number or a list of S values is a worker's cost for all
its chunks, split evenly among them (the same model cut finer, so that v = 1, 2, 4 compare), a
list of S x v values gives every virtual stage's own; p2p is a message's latency and is not
split. All-reduce and optimizer stay per worker (one per worker and iteration).
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
TOP_KEYS = ("name", "stages", "pipelines", "microbatches", "microbatch_size", "chunks", "layout",
            "time", "memory")
LAYOUTS = ("interleaved", "v")
# Costs stored per virtual stage when a worker holds several chunks (the rest stay per worker),
# and those of them split evenly among a worker's chunks when given per worker.
VIRTUAL_KEYS = ("forward", "backward_input", "backward_weight", "p2p")
SPLIT_KEYS = ("forward", "backward_input", "backward_weight")
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

    def caps(self, stages: int, chunks: int = 1) -> tuple[int | None, ...]:
        """In-flight micro-batch limit per stage implied by this model (None: no limit). With
        `chunks` per worker the unit is one micro-batch on one chunk, which holds
        1/chunks of `activation[s]`: the limit is then in those units (`max_inflight`
        micro-batches are `max_inflight * chunks` of them)."""
        out: list[int | None] = []
        for s in range(stages):
            cap = None if self.max_inflight is None else self.max_inflight * chunks
            if self.budget is not None and self.activation is not None:
                static = self.static[s] if self.static else 0.0
                room = (self.budget - static) / (self.activation[s] / chunks)
                by_bytes = int(math.floor(min(room, 2.0**62) + 1e-9))  # room may overflow
                cap = by_bytes if cap is None else min(cap, by_bytes)
            out.append(cap)
        return tuple(out)


@dataclass(frozen=True)
class JobSpec:
    """S stages, D pipelines, M micro-batches per pipeline per iteration, and per-stage costs in
    milliseconds. `p2p[s]` is the latency of a message sent by a stage-s worker (activations
    downstream, gradients upstream). With `chunks` > 1 the costs of `VIRTUAL_KEYS` have one
    value per virtual stage (see the module docstring)."""

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
    chunks: int = 1
    layout: str = "interleaved"

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    def holder(self, vstage: int) -> int:
        """The stage whose workers hold virtual stage `vstage`."""
        return holder_of(self.stages, self.chunks, self.layout, vstage)

    def virtual(self, stage: int, chunk: int) -> int:
        """The virtual stage of chunk `chunk` on a stage-`stage` worker."""
        return virtual_of(self.stages, self.chunks, self.layout, stage, chunk)

    def one_chunk(self) -> "JobSpec":
        """The same job with each worker's chunks as one stage (costs summed, a message's
        latency the largest of its chunks'): what systems that place one chunk per worker
        (Oobleck, Bamboo) run. This spec itself when it has one chunk."""
        if self.chunks == 1:
            return self
        from dataclasses import replace

        def per_worker(values: tuple[float, ...], combine) -> tuple[float, ...]:
            return tuple(combine(values[self.virtual(s, c)] for c in range(self.chunks))
                         for s in range(self.stages))

        return replace(self, chunks=1, layout="interleaved",
                       **{key: per_worker(getattr(self, key), sum) for key in SPLIT_KEYS},
                       p2p=per_worker(self.p2p, max))

    @property
    def backward(self) -> tuple[float, ...]:
        """Full backward (B = I + W) per stage."""
        return tuple(i + w for i, w in zip(self.backward_input, self.backward_weight))

    @property
    def workers(self) -> int:
        return self.stages * self.pipelines

    def caps(self) -> tuple[int | None, ...]:
        """In-flight limit per stage (micro-batches; micro-batch chunks with chunks > 1)."""
        return (self.memory.caps(self.stages, self.chunks) if self.memory
                else (None,) * self.stages)

    def to_dict(self) -> dict[str, Any]:
        """The spec with the TOML file's keys; a number where every stage has the same value."""
        out: dict[str, Any] = {}
        if self.name is not None:
            out["name"] = self.name
        out.update(stages=self.stages, pipelines=self.pipelines, microbatches=self.microbatches)
        if self.microbatch_size is not None:
            out["microbatch_size"] = self.microbatch_size
        if self.chunks > 1:
            out.update(chunks=self.chunks, layout=self.layout)
        out["time"] = {k: _compact(getattr(self, k)) for k in TIME_KEYS}
        if self.chunks > 1:  # a per-worker number is split among the chunks on reading
            for key in SPLIT_KEYS:
                per_chunk = getattr(self, key)[0]
                if not isinstance(out["time"][key], list):  # a number: every chunk alike
                    whole = per_chunk * self.chunks
                    out["time"][key] = (_plain(whole) if whole / self.chunks == per_chunk
                                        else [_plain(v) for v in getattr(self, key)])
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


def holder_of(stages: int, chunks: int, layout: str, vstage: int) -> int:
    """The stage holding virtual stage `vstage` (interleaved: vstage mod S; V: chunk 0 on
    stage s is s, chunk 1 is 2S - 1 - s)."""
    chunk, pos = divmod(vstage, stages)
    return stages - 1 - pos if layout == "v" and chunk % 2 else pos


def virtual_of(stages: int, chunks: int, layout: str, stage: int, chunk: int) -> int:
    """The virtual stage of `chunk` on a stage-`stage` worker (inverse of `holder_of`)."""
    pos = stages - 1 - stage if layout == "v" and chunk % 2 else stage
    return chunk * stages + pos


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
    chunks, layout = _chunks(data, where)
    if cells * chunks > MAX_CELLS:
        raise SpecError(f"{where}: stages x chunks x pipelines x microbatches = "
                        f"{cells * chunks:,} is more than the planner handles ({MAX_CELLS:,})")

    costs = {}
    for key in TIME_KEYS:
        positive = key in ("forward", "backward_input")
        value = time.get(key, TIME_DEFAULTS.get(key))
        if key in VIRTUAL_KEYS and chunks > 1:
            costs[key] = _per_virtual_stage(value, stages, chunks, layout, where,
                                            f"time.{key}", positive, split=key in SPLIT_KEYS)
        else:
            costs[key] = _per_stage(value, stages, where, f"time.{key}", positive=positive,
                                    maximum=MAX_MS)

    memory = None
    if "memory" in data:
        memory = _parse_memory(data["memory"], stages, where)

    spec = JobSpec(stages=stages, pipelines=pipelines, microbatches=microbatches,
                   memory=memory, microbatch_size=mbs, name=name, chunks=chunks, layout=layout,
                   **costs)
    for s, cap in enumerate(spec.caps()):
        if cap is not None and cap < chunks:  # every chunk of one micro-batch
            raise SpecError(f"{where}: 'memory.budget' leaves stage {s} no room for a single "
                            f"micro-batch's activations")
    return spec


def _chunks(data: Mapping[str, Any], where: str) -> tuple[int, str]:
    """`chunks` (default 1) and `layout` (default interleaved; V needs exactly two chunks)."""
    chunks = _count(data, "chunks", where) if "chunks" in data else 1
    layout = data.get("layout", "interleaved")
    if layout not in LAYOUTS:
        raise SpecError(f"{where}: 'layout' must be one of: {', '.join(LAYOUTS)}, got {layout!r}")
    if layout == "v" and chunks != 2:
        raise SpecError(f"{where}: layout 'v' places exactly 2 chunks per worker, but "
                        f"'chunks' is {chunks}")
    if "layout" in data and chunks == 1:
        raise SpecError(f"{where}: 'layout' places several chunks per worker: set 'chunks' "
                        f"to 2 or more, or drop 'layout'")
    return chunks, layout


def _per_virtual_stage(value: Any, stages: int, chunks: int, layout: str, where: str,
                       key: str, positive: bool, split: bool) -> tuple[float, ...]:
    """One value per virtual stage: a list of S x v values as given, a number or a list of S
    values per worker (divided among its chunks when `split`; the list is by stage, and
    chunk c of stage s takes stage s's value)."""
    virtual = stages * chunks
    if isinstance(value, list) and len(value) == virtual:
        return _per_stage(value, virtual, where, key, positive=positive, maximum=MAX_MS)
    if isinstance(value, list) and len(value) != stages:
        raise SpecError(f"{where}: '{key}' lists {len(value)} values but there are {stages} "
                        f"stages ({virtual} virtual stages)")
    per_stage = _per_stage(value, stages, where, key, positive=positive, maximum=MAX_MS)
    share = chunks if split else 1
    return tuple(per_stage[holder_of(stages, chunks, layout, v)] / share
                 for v in range(virtual))


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
