"""Failure traces: worker failures and repairs over time, read from a CSV file or sampled.

A trace file has a header and one event per line, times in seconds (or durations like `2h`)
from the start of the job, sorted:

    time,event,worker
    3600,fail,1:3
    7200,repair,1:3
    8h,fail,host:2
    8h,fail,0:5 1:5

The worker field names one worker (`PIPELINE:STAGE`), several separated by spaces, or a whole
host (`host:H`, with a host layout: `hosts.py`). Events at the same time and of the same kind
happen together (a correlated failure): the job sees them as one. `#` starts a comment; blank
lines are skipped. Every mistake (an unknown worker or host, a repair of a live worker, a
failure of a dead one, an unsorted time...) is one error naming the line.

Sampled traces are seeded and deterministic. The mean time between failures (MTBF) is the
job's: with `sampling="worker"` each of the N units (workers, or hosts with a host layout) has its
own renewal process (up time with mean N x MTBF, then a repair), with `sampling="fleet"` one
renewal process with mean MTBF hits a uniformly chosen live unit. A host fails and is repaired
with all its workers at once. Up times are exponential or Weibull (same mean), repair times
exponential or fixed.
"""

from __future__ import annotations

import csv
import heapq
import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from recycle_planner.errors import FailureSetError, RecycleError
from recycle_planner.io import atomic_write
from recycle_planner.job.spec import JobSpec
from recycle_planner.job.workers import parse_worker
from recycle_planner.limits import MAX_TRACE_FAILURES
from recycle_planner.schedules.ops import Worker
from recycle_planner.whatif.durations import DurationError, format_duration, parse_duration
from recycle_planner.whatif.hosts import HostError, Hosts

FAIL, REPAIR = "fail", "repair"
HEADER = ("time", "event", "worker")
DISTRIBUTIONS = ("exponential", "weibull")
REPAIR_DISTRIBUTIONS = ("exponential", "fixed")
SAMPLINGS = ("worker", "fleet")


class TraceError(RecycleError):
    """A trace file or sampling request that cannot be used."""


@dataclass(frozen=True)
class Event:
    time: float          # seconds from the start of the job
    kind: str            # FAIL or REPAIR
    worker: Worker       # (pipeline, stage)
    host: int | None = None  # set when the event is part of a whole host's failure or repair


@dataclass(frozen=True)
class Step:
    """Events at the same time and of the same kind, which the job sees as one."""

    time: float
    kind: str
    workers: tuple[Worker, ...]


@dataclass(frozen=True)
class Trace:
    """Events sorted by time (a repair before a failure at the same instant), none after
    `duration`; `source` says where they came from (for the output); `hosts` the host layout
    (None: one worker per host)."""

    events: tuple[Event, ...]
    duration: float
    stages: int
    pipelines: int
    source: dict[str, Any] = field(default_factory=dict)
    hosts: Hosts | None = None

    def steps(self) -> list[Step]:
        """Consecutive events of the same time and kind, grouped."""
        out: list[Step] = []
        for e in self.events:
            if out and out[-1].time == e.time and out[-1].kind == e.kind:
                last = out[-1]
                out[-1] = Step(last.time, last.kind, last.workers + (e.worker,))
            else:
                out.append(Step(e.time, e.kind, (e.worker,)))
        return out

    @property
    def failures(self) -> int:
        """Failures as the job sees them: workers (or hosts) failing together count once."""
        return sum(s.kind == FAIL for s in self.steps())

    @property
    def worker_failures(self) -> int:
        return sum(e.kind == FAIL for e in self.events)

    def dead_counts(self) -> tuple[int, float]:
        """The most workers dead at once, and the time-weighted mean number dead."""
        dead = most = 0
        area, last = 0.0, 0.0
        for e in self.events:
            area += dead * (e.time - last)
            last = e.time
            dead += 1 if e.kind == FAIL else -1
            most = max(most, dead)
        area += dead * (self.duration - last)
        return most, area / self.duration if self.duration > 0 else 0.0

    def describe(self) -> str:
        most, mean = self.dead_counts()
        src = self.source
        if src.get("kind") == "sampled":
            level = src["sampling"]
            if level == "worker" and self.hosts is not None and self.hosts.workers_per_host > 1:
                level = "host"
            head = (f"sampled ({level} level): {src['distribution']} up times"
                    + (f" (shape {src['shape']:g})" if src["distribution"] == "weibull" else "")
                    + f", a failure every {format_duration(src['mtbf'])} in the job on average, "
                      f"{src['repair_distribution']} repairs of mean "
                      f"{format_duration(src['repair'])}, seed {src['seed']}")
        else:
            head = f"from {src.get('path', 'a file')}"
        if self.hosts is not None and self.hosts.workers_per_host > 1:
            head += f"; {self.hosts.describe()}"
        workers = self.worker_failures
        return (f"{head}; {format_duration(self.duration)}: {self.failures} failures"
                + (f" ({workers} workers)" if workers != self.failures else "")
                + f", up to {most} dead at once, {mean:.2f} dead on average")

    def to_dict(self) -> dict[str, Any]:
        most, mean = self.dead_counts()
        return {"source": dict(self.source), "duration_s": self.duration,
                "failures": self.failures, "worker_failures": self.worker_failures,
                "repairs": sum(s.kind == REPAIR for s in self.steps()),
                "hosts": self.hosts.to_dict() if self.hosts is not None else None,
                "max_dead": most, "mean_dead": mean}


def check_events(events: list[Event], spec: JobSpec, duration: float,
                 where: list[str] | None = None) -> None:
    """Every rule a trace keeps; `where[i]` names event i in messages (a file line)."""
    dead: dict[Worker, str] = {}
    last = 0.0
    for i, e in enumerate(events):
        at = where[i] if where else f"event {i}"
        d, s = e.worker
        if not (0 <= d < spec.pipelines and 0 <= s < spec.stages):
            raise TraceError(f"{at}: unknown worker {d}:{s} (the job has {spec.pipelines} "
                             f"pipelines x {spec.stages} stages)")
        if e.time < last:
            raise TraceError(f"{at}: time {e.time:g} s is earlier than the event before it "
                             f"({last:g} s): events must be sorted by time")
        if e.time > duration:
            raise TraceError(f"{at}: time {e.time:g} s is after the end of the trace "
                             f"({duration:g} s)")
        last = e.time
        if e.kind == FAIL:
            if e.worker in dead:
                raise TraceError(f"{at}: worker {d}:{s} fails but is already dead (it failed "
                                 f"at {dead[e.worker]})")
            dead[e.worker] = at
        elif e.kind == REPAIR:
            if e.worker not in dead:
                raise TraceError(f"{at}: worker {d}:{s} is repaired but is not dead")
            del dead[e.worker]
        else:
            raise TraceError(f"{at}: unknown event {e.kind!r} (expected fail or repair)")


def read_trace(path: str | Path, spec: JobSpec, duration: float | None = None,
               hosts: Hosts | None = None) -> Trace:
    """Read and check a trace file; without `duration` the trace ends at its last event;
    `hosts` lets lines name hosts (`host:H`)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read trace: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a text file") from None
    events: list[Event] = []
    where: list[str] = []
    header_seen = False
    for lineno, row in _rows(text):
        at = f"{path} line {lineno}"
        if not header_seen:
            if tuple(c.strip().lower() for c in row) != HEADER:
                raise TraceError(f"{at}: expected the header 'time,event,worker', got "
                                 f"{','.join(row)!r}")
            header_seen = True
            continue
        if len(row) != 3:
            raise TraceError(f"{at}: expected 3 fields (time,event,worker), got {len(row)}")
        try:
            t = parse_duration(row[0].strip(), "time")
        except DurationError as exc:
            raise TraceError(f"{at}: {exc}") from None
        kind = row[1].strip().lower()
        if kind not in (FAIL, REPAIR):
            raise TraceError(f"{at}: unknown event {row[1].strip()!r} (expected fail or "
                             f"repair)")
        for event in _parse_workers(row[2], t, kind, hosts, at):
            events.append(event)
            where.append(at)
        if len(events) > 2 * MAX_TRACE_FAILURES:  # a failure and its repair each
            raise TraceError(f"{at}: more than {2 * MAX_TRACE_FAILURES:,} events; a trace may "
                             f"have {MAX_TRACE_FAILURES:,} failures")
    if not header_seen:
        raise TraceError(f"{path}: empty trace (expected the header 'time,event,worker')")
    if duration is None:
        if not events:
            raise TraceError(f"{path}: no events: give the trace's duration")
        duration = max(e.time for e in events)
    if duration <= 0:
        raise TraceError(f"{path}: the trace must last more than zero seconds")
    check_events(events, spec, duration, where)
    return Trace(tuple(events), duration, spec.stages, spec.pipelines,
                 {"kind": "file", "path": str(path)}, hosts)


def _parse_workers(field_text: str, t: float, kind: str, hosts: Hosts | None,
                   at: str) -> list[Event]:
    """The events of one line: `host:H`, or one or more workers separated by spaces."""
    text = field_text.strip()
    if text.lower().startswith("host:"):
        if hosts is None:
            raise TraceError(f"{at}: {text!r} names a host: give --workers-per-host")
        number = text[5:].strip()
        if not number.isdigit():
            raise TraceError(f"{at}: {text!r} is not host:NUMBER (for example host:1)")
        try:
            return [Event(t, kind, w, int(number)) for w in hosts.workers(int(number))]
        except HostError as exc:
            raise TraceError(f"{at}: {exc}") from None
    if not text:
        raise TraceError(f"{at}: no worker (write PIPELINE:STAGE, several separated by "
                         f"spaces, or host:H)")
    try:
        return [Event(t, kind, parse_worker(w)) for w in text.split()]
    except FailureSetError as exc:
        raise TraceError(f"{at}: {exc}") from None


def _rows(text: str):
    """(line number, fields) of every line that is not blank or a comment."""
    for lineno, line in enumerate(text.splitlines(), start=1):
        body = line.split("#", 1)[0]
        if not body.strip():
            continue
        yield lineno, next(csv.reader(io.StringIO(body)))


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write a trace as CSV (atomically), readable by `read_trace`."""
    lines = [f"# {trace.describe()}"]
    if trace.hosts is not None and trace.hosts.workers_per_host > 1:
        lines.append(f"# read it with --workers-per-host {trace.hosts.workers_per_host} "
                     f"--host-placement {trace.hosts.placement}")
    lines.append(",".join(HEADER))
    last: tuple | None = None
    for e in trace.events:
        if e.host is None:
            lines.append(f"{e.time!r},{e.kind},{e.worker[0]}:{e.worker[1]}")
        elif last != (e.time, e.kind, e.host):
            lines.append(f"{e.time!r},{e.kind},host:{e.host}")
        last = (e.time, e.kind, e.host)
    atomic_write(path, lambda fh: fh.write("\n".join(lines) + "\n"))


def sample_trace(spec: JobSpec, mtbf: float, repair: float, duration: float, seed: int = 0,
                 distribution: str = "exponential", shape: float = 1.0,
                 sampling: str = "worker", repair_distribution: str = "exponential",
                 hosts: Hosts | None = None) -> Trace:
    """A seeded random trace (see the module docstring); `mtbf`, `repair`, `duration` in
    seconds; with `hosts` of several workers, whole hosts fail and are repaired."""
    if distribution not in DISTRIBUTIONS:
        raise TraceError(f"unknown distribution {distribution!r} (expected one of: "
                         f"{', '.join(DISTRIBUTIONS)})")
    if repair_distribution not in REPAIR_DISTRIBUTIONS:
        raise TraceError(f"unknown repair distribution {repair_distribution!r} (expected one "
                         f"of: {', '.join(REPAIR_DISTRIBUTIONS)})")
    if sampling not in SAMPLINGS:
        raise TraceError(f"unknown sampling {sampling!r} (expected one of: "
                         f"{', '.join(SAMPLINGS)})")
    if not (mtbf > 0 and duration > 0 and repair >= 0):
        raise TraceError("sampling needs an MTBF and a duration above zero and a repair time "
                         "of zero or more")
    if distribution == "weibull" and not shape > 0:
        raise TraceError(f"the Weibull shape must be above zero, got {shape:g}")
    if duration / mtbf > MAX_TRACE_FAILURES:
        raise TraceError(f"a {format_duration(duration)} trace with a failure every "
                         f"{format_duration(mtbf)} has about {duration / mtbf:,.0f} failures; "
                         f"a trace may have {MAX_TRACE_FAILURES:,}: shorten --duration or "
                         f"lengthen --mtbf")
    rng = np.random.default_rng(seed)
    up = _drawer(rng, distribution, shape)
    down = _drawer(rng, repair_distribution, 1.0)
    whole = hosts is not None and hosts.workers_per_host > 1
    layout = hosts if hosts is not None else Hosts(spec.stages, spec.pipelines)
    N = layout.count
    if sampling == "worker":
        raw = _per_worker(up, down, N, mtbf * N, repair, duration)
    else:
        raw = _fleet(rng, up, down, N, mtbf, repair, duration)
    raw.sort(key=lambda e: (e[0], e[1], e[2]))
    events = tuple(Event(t, REPAIR if k == 0 else FAIL, w, h if whole else None)
                   for t, k, h in raw for w in layout.workers(h))
    source = {"kind": "sampled", "sampling": sampling, "distribution": distribution,
              "shape": shape if distribution == "weibull" else 1.0, "mtbf": mtbf,
              "repair": repair, "repair_distribution": repair_distribution, "seed": seed}
    return Trace(events, duration, spec.stages, spec.pipelines, source, hosts)


def _drawer(rng: np.random.Generator, distribution: str, shape: float):
    """draw(mean, n) -> n samples of the distribution with that mean."""
    if distribution == "exponential":
        return lambda mean, n: rng.exponential(mean, n)
    if distribution == "weibull":
        factor = 1.0 / math.gamma(1.0 + 1.0 / shape)
        return lambda mean, n: mean * factor * rng.weibull(shape, n)
    return lambda mean, n: np.full(n, float(mean))


def _per_worker(up, down, n: int, worker_mtbf: float, repair: float,
                duration: float) -> list[tuple[float, int, int]]:
    """Each unit (worker or host) alternates up and down times; vectorized over the units still
    inside the trace. Returns (time, 0 = repair / 1 = failure, unit index)."""
    out: list[tuple[float, int, int]] = []
    t = up(worker_mtbf, n)
    active = np.arange(n)
    while active.size:
        times = t[active]
        keep = times < duration
        active, times = active[keep], times[keep]
        if not active.size:
            break
        fixed = times + down(repair, active.size)
        out += [(float(a), 1, int(w)) for a, w in zip(times, active)]
        back = fixed < duration
        out += [(float(a), 0, int(w)) for a, w in zip(fixed[back], active[back])]
        active = active[back]
        t[active] = fixed[back] + up(worker_mtbf, active.size)
    return out


def _fleet(rng: np.random.Generator, up, down, n: int, mtbf: float, repair: float,
           duration: float) -> list[tuple[float, int, int]]:
    """One renewal process for the job; each failure hits a uniformly chosen live unit."""
    out: list[tuple[float, int, int]] = []
    dead: set[int] = set()
    repairs: list[tuple[float, int]] = []
    t = 0.0
    while True:
        t += float(up(mtbf, 1)[0])
        if t >= duration:
            return out
        while repairs and repairs[0][0] <= t:
            dead.discard(heapq.heappop(repairs)[1])
        if len(dead) == n:
            continue
        live = [w for w in range(n) if w not in dead] if dead else None
        pick = int(rng.integers(n - len(dead)))
        w = live[pick] if live is not None else pick
        dead.add(w)
        out.append((t, 1, w))
        fixed = t + float(down(repair, 1)[0])
        if fixed < duration:
            out.append((fixed, 0, w))
            heapq.heappush(repairs, (fixed, w))
