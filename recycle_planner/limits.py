"""The range of every number a user gives: one home, read by the command line's option types
(`cli/options.py`) and by the records those options fill (`SolverSettings`), so that NaN,
infinity and absurd values are refused the same way everywhere and before any work.

A bound says what the tool can honour, not what is wise: a week of solver time per situation
is allowed, a budget of 1e300 seconds (which would print "expect about inf h") is not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from recycle_planner.errors import RecycleError

DAY = 86400.0
WEEK = 7 * DAY
YEAR = 365.25 * DAY
MAX_DURATION = 100 * YEAR  # a duration option or trace time: seconds
MAX_COUNT = 1_000_000      # processes, rows, restarts, repeats: far beyond any real run
MAX_MS = 1e9               # one op's cost in a spec or an option: 11.6 days
MAX_TRACE_FAILURES = 100_000  # per sampled what-if trace: 50 s of CPU for the GPT example


@dataclass(frozen=True)
class Range:
    """Accepted values: finite, from `low` to `high` (`low` excluded when `low_open`), whole
    numbers when `integer`; `unit` is said in messages."""

    low: float
    high: float
    integer: bool = False
    low_open: bool = False
    unit: str = ""

    def describe(self) -> str:
        kind = "a whole number" if self.integer else "a number"
        low = f"above {_plain(self.low)}" if self.low_open else f"from {_plain(self.low)}"
        unit = f" {self.unit}" if self.unit else ""
        return f"{kind} {low} to {_plain(self.high)}{unit}"

    def problem(self, value: Any) -> str | None:
        """Why `value` is refused (None if it is accepted)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{value!r} is not a number"
        if self.integer and not isinstance(value, int):
            return f"{value!r} is not a whole number"
        if not math.isfinite(value):
            return f"{value} is not finite"
        below = value <= self.low if self.low_open else value < self.low
        if below or value > self.high:
            return f"{_plain(value)} is out of range"
        return None

    def check(self, value: Any, name: str) -> Any:
        """`value`, or a RecycleError naming `name` and the range."""
        problem = self.problem(value)
        if problem is not None:
            raise RecycleError(f"{name}: {problem}: give {self.describe()}")
        return value


def seconds(low: float, high: float = WEEK, low_open: bool = False) -> Range:
    return Range(low, high, low_open=low_open, unit="seconds")


def count(low: int = 0, high: int = MAX_COUNT) -> Range:
    return Range(low, high, integer=True)


LIMITS: dict[str, Range] = {
    # solvers (SolverSettings) and the library (Settings, plan-all)
    "time_limit": seconds(0.1),
    "work_limit": seconds(0.01),
    "prove_work": seconds(0.01),
    "node_limit": count(1, 2**31 - 1),  # HiGHS reads a 32-bit int
    "max_failures": count(0),
    "jobs": count(1, 1024),
    "max_placements": count(1, 1000),
    # pictures and text
    "width": count(20, 1000),
    "max_workers": count(1),
    "pipeline": count(0),
    # what-if
    "seed": count(0, 2**63 - 1),
    "shape": Range(0.05, 20.0),  # Weibull: below 0.05 its mean overflows
    "spares": count(0),
    "workers_per_host": count(1),
    # the executor's launch and coordinator
    "nproc": count(1, 65536),
    "nnodes": count(1, 65536),
    "node_rank": count(0, 65535),
    "master_port": count(0, 65535),
    "port": count(1, 65535),
    "restart_delay": seconds(0.0, DAY),
    "max_restarts": count(0),
    "plan_budget": seconds(0.0, DAY),
    "refine_budget": seconds(0.0, DAY),
    "refine_margin": Range(0.0, 1.0),
    "lease": seconds(0.1, DAY),
    "heartbeat": seconds(0.01, 3600.0),
    "pg_timeout": seconds(1.0, DAY),
    "rdzv_timeout": seconds(0.1, DAY),
    "grace": seconds(1.0, 3600.0),
    "bucket_mb": Range(0.0, 1e6, low_open=True, unit="MiB"),
    "checkpoint_every": count(0, 10**9),
    # the profiler
    "pipelines": count(1, 65536),
    "microbatches": count(1, 65536),
    "repeats": count(1, 100_000),
    "warmup": count(0, 100_000),
    "p2p": Range(0.0, MAX_MS, unit="ms"),
    "allreduce": Range(0.0, MAX_MS, unit="ms"),
}


def limit(name: str) -> Range:
    return LIMITS[name]


def _plain(value: float) -> str:
    """1, 0.1, 604800, 3.15576e+09: whole numbers without a point, others short."""
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:g}"
