"""What every recovery strategy declares, and the shared context it is costed in.

A strategy maps the dead workers at a moment to a *configuration* key (None: it cannot run and
must wait for repairs, after a checkpoint restart), and a configuration to a `Speed`. It also
says what a failure or a repair costs it, what reaching a configuration for the first time
costs (planning it on demand), and which schedule policy it runs. The replay engine
(`engine.py`) does the rest, the same way for every strategy: pauses, lost iterations, rollbacks
to the last checkpoint, waiting.

Configurations are computed for every key a trace needs *before* the replay (`speeds`), so the
event loop never plans anything.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, ClassVar, Hashable, Iterable, Sequence

from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec, MemorySpec
from recycle_planner.library import PlanLibrary
from recycle_planner.planner import plan_situation
from recycle_planner.whatif.deadset import DeadState
from recycle_planner.whatif.durations import format_duration

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Costs:
    """What recovering costs, in seconds (defaults in docs/whatif.md).

    detect: until the job knows a worker is gone (crash: milliseconds; hang: a heartbeat).
    switch: re-forming communicators and loading another precomputed plan (re-routing), the
        data-parallel groups (dropping pipelines) or Bamboo's fail-over and fail-back.
    reconfigure: Oobleck's re-instantiation of pipelines, which moves layers between workers.
    checkpoint_interval: wall-clock time between checkpoints (taken asynchronously, at an
        iteration boundary, without stopping training).
    restart: relaunching the job from a checkpoint (scheduling, loading, warm-up).
    spares: spare workers kept idle for checkpoint-restart with spares.
    plan: planning a situation the plan library lacks, on demand (None: the heuristic's time
        measured on this job, once per situation).
    bandwidth: bytes per second a worker receives layers at when Oobleck moves them.
    parameter_bytes: the model's state (weights and optimizer state) that Oobleck moves with
        layers, when the spec has no [memory] static sizes (spread equally over the stages)."""

    detect: float = 10.0
    switch: float = 5.0
    reconfigure: float = 60.0
    checkpoint_interval: float = 1800.0
    restart: float = 600.0
    spares: int = 2
    plan: float | None = None
    bandwidth: float = 12.5e9
    parameter_bytes: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (f"detection {format_duration(self.detect)}, plan switch "
                f"{format_duration(self.switch)}, on-demand planning "
                + ("as measured" if self.plan is None else format_duration(self.plan))
                + f", Oobleck reconfiguration {format_duration(self.reconfigure)} + layers "
                f"moved at {self.bandwidth / 1e9:g} GB/s, checkpoint every "
                f"{format_duration(self.checkpoint_interval)}, restart "
                f"{format_duration(self.restart)}, {self.spares} spare worker"
                f"{'' if self.spares == 1 else 's'}")


class PeriodModel:
    """Steady-state period (ms) of derived job specs through the planner, cached by spec, so
    that every strategy is costed with the same simulator and each shape is planned once."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self._cache: dict[str, float] = {}
        self.evaluations = 0
        self.seconds = 0.0

    def period(self, spec: JobSpec) -> float:
        key = json.dumps(spec.to_dict(), sort_keys=True)
        found = self._cache.get(key)
        if found is None:
            t0 = time.perf_counter()
            found = plan_situation(spec, self.policy).metrics.period
            self.seconds += time.perf_counter() - t0
            self.evaluations += 1
            self._cache[key] = found
        return found


@dataclass(frozen=True)
class Context:
    """The job, its plan library, the costs, and the baseline that every strategy but
    re-routing runs: its policy, and its fault-free period, the reference of every result.
    Re-routing runs the library's policy."""

    spec: JobSpec
    policy: Policy
    costs: Costs
    fault_free_period: float          # ms, the baseline policy's fault-free plan
    library: PlanLibrary | None = None
    model: PeriodModel | None = None

    @classmethod
    def from_library(cls, library: PlanLibrary, costs: Costs,
                     policy: Policy | None = None) -> "Context":
        """`policy`: the baseline's (default: the library's, so that every strategy runs the
        same schedule)."""
        policy = library.policy if policy is None else policy
        model = PeriodModel(policy)
        period = (library.fault_free_period if policy == library.policy
                  else model.period(library.spec))
        return cls(library.spec, policy, costs, period, library, model)

    @property
    def samples_per_iteration(self) -> int:
        """Samples (or micro-batches, without a micro-batch size) in one iteration."""
        s = self.spec
        return s.pipelines * s.microbatches * (s.microbatch_size or 1)

    @property
    def unit(self) -> str:
        return "samples" if self.spec.microbatch_size is not None else "micro-batches"

    def speed(self, period_ms: float, share: float = 1.0) -> "Speed":
        """Training at `period_ms` per iteration on `share` of the global batch."""
        if share <= 0 or not math.isfinite(period_ms):
            return STOPPED
        per_iteration = self.samples_per_iteration * share
        return Speed(per_iteration / (period_ms / 1000.0), period_ms / 1000.0, per_iteration)

    @property
    def fault_free(self) -> "Speed":
        return self.speed(self.fault_free_period)


@dataclass(frozen=True)
class Speed:
    """A configuration's training speed: samples per second, and the iteration (period in
    seconds, samples) that a failure in the middle of it loses."""

    rate: float
    period: float
    samples_per_iteration: float


STOPPED = Speed(0.0, math.inf, 0.0)


class Strategy:
    """Base class; see the module docstring. Subclasses set the class attributes and implement
    `config` and `_speed`."""

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""
    #: "reconfigure": keep the in-memory state, pause, lose the iteration in progress (if
    #: `loses_iteration`); "restart": every failure rolls back to the last checkpoint.
    on_failure: ClassVar[str] = "reconfigure"
    loses_iteration: ClassVar[bool] = True

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self._speeds: dict[Hashable, Speed] = {}

    # -- what a subclass says ------------------------------------------------------------
    def config(self, state: DeadState) -> Hashable | None:
        raise NotImplementedError

    def _speed(self, key: Hashable) -> Speed:
        raise NotImplementedError

    @property
    def policy(self) -> Policy:
        """The schedule policy this strategy runs (the baseline's unless it says otherwise)."""
        return self.ctx.policy

    def disrupts(self, before: DeadState, after: DeadState, kind: str) -> bool:
        """Does this step (failures or repairs, `kind`) change what the running job does (and
        so cost a pause)?"""
        return True

    def fail_pause(self, key: Hashable) -> float:
        """Pause after detection when a failure into configuration `key` is absorbed without
        a restart."""
        return self.ctx.costs.switch

    def repair_pause(self, key: Hashable) -> float:
        return self.ctx.costs.switch

    def planning(self, key: Hashable) -> float | None:
        """Extra pause the first time a run reaches configuration `key` (planning it), None
        when there is nothing to plan."""
        return None

    def record(self) -> dict[str, Any]:
        """What the JSON output says about this strategy beyond its assumptions."""
        return {"policy": self.policy.to_dict(), "policy_label": self.policy.label}

    def infeasible(self) -> str | None:
        """Why this strategy cannot run this job at all (None: it can)."""
        return None

    def assumptions(self) -> list[str]:
        raise NotImplementedError

    # -- used by the engine ---------------------------------------------------------------
    def speeds(self, keys: Iterable[Hashable]) -> dict[Hashable, Speed]:
        """The speed of every configuration in `keys` (computed once, then cached)."""
        todo = [k for k in dict.fromkeys(keys) if k is not None and k not in self._speeds]
        if todo:
            log.info("%s: costing %d configuration(s)", self.name, len(todo))
        for key in todo:
            self._speeds[key] = self._speed(key)
        return self._speeds


def derived_memory(mem: MemorySpec | None,
                   recut: Callable[[tuple[float, ...]], list[float]]) -> dict[str, Any] | None:
    """The [memory] table of a derived spec (another pipeline shape) whose per-worker byte
    figures are `recut` from the job's per-stage ones; budget and in-flight cap unchanged."""
    if mem is None:
        return None
    memory: dict[str, Any] = {}
    if mem.activation is not None:
        memory["activation"] = recut(mem.activation)
        memory["budget"] = mem.budget
        if mem.static is not None:
            memory["static"] = recut(mem.static)
    if mem.max_inflight is not None:
        memory["max_inflight"] = mem.max_inflight
    return memory


def min_max_split(groups: Sequence[Hashable], total: int,
                  period: Callable[[Hashable, int], float],
                  weight: Callable[[Hashable], float]) -> tuple[float, list[int]]:
    """Give `total` micro-batches to pipelines (pipeline i of shape `groups[i]`) so that the
    slowest pipeline's period, `period(shape, m)`, is as short as possible.

    For periods that grow with m, the best maximum is the total-th smallest of all the values
    period(g_i, k), k >= 1, and the greedy that always gives the next micro-batch to the
    pipeline whose period grows least finds it. It starts from a share below the proportional
    one (by `weight`) so that only a few periods near the answer are evaluated, and checks the
    start was low enough (every start value no more than the greedy's last pick), else starts
    lower."""
    if total <= 0 or not groups:
        return 0.0, [0] * len(groups)
    w = [max(weight(g), 0.0) for g in groups]
    if not sum(w):
        w = [1.0] * len(groups)
    w_sum = sum(w)
    margin = 2
    while True:
        start = [max(0, int(total * wi / w_sum) - margin) for wi in w]
        alloc = list(start)
        heap = [(period(g, m + 1), i) for i, (g, m) in enumerate(zip(groups, alloc))]
        heapq.heapify(heap)
        last = 0.0
        for _ in range(total - sum(alloc)):
            value, i = heapq.heappop(heap)
            alloc[i] += 1
            last = max(last, value)
            heapq.heappush(heap, (period(groups[i], alloc[i] + 1), i))
        low = max((period(g, m) for g, m in zip(groups, start) if m > 0), default=0.0)
        if low <= last or not any(start):
            return max(last, low), alloc
        margin *= 4
