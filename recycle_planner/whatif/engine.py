"""Replay a failure trace against each strategy and account the samples it trains.

Event-driven: between two events every strategy's throughput is constant, so samples are a sum
of rate x time. A strategy is always in one of three modes: running its configuration's speed,
paused (detection, plan switch, reconfiguration or restart; nothing trains) until a known time,
or waiting (rolled back to its checkpoint; nothing can run until repairs allow a restart).

- Events at the same time and of the same kind (a host, a correlated failure) are one step.
- A failure the strategy absorbs (`on_failure == "reconfigure"`) costs detection + its pause and,
  if `loses_iteration`, the fraction of the iteration in progress (tracked as a phase that a
  checkpoint, taken at an iteration boundary, or a pause resets).
- A failure of a checkpoint-restart strategy, or one no strategy configuration covers, rolls the
  job back to its last checkpoint: the samples trained since are lost.
- Checkpoints are taken every `checkpoint_interval` of wall-clock time from the start and from
  the end of each restart (a restart loads one).
- Pauses overlap: a second event during a pause extends it to the later of the two ends.
- The first time a run reaches a configuration the strategy must plan (re-routing beyond its
  library), the planning time is added to that step's pause.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import numpy as np

from recycle_planner.errors import RecycleError
from recycle_planner.whatif.bamboo import Bamboo
from recycle_planner.whatif.checkpoint import CheckpointSpares, CheckpointWait
from recycle_planner.whatif.deadset import DeadState, dead_states, healthy
from recycle_planner.whatif.drop import DropPipelines
from recycle_planner.whatif.oobleck import Oobleck
from recycle_planner.whatif.reroute import Reroute, RerouteLibraryOnly
from recycle_planner.whatif.strategy import STOPPED, Context, Speed, Strategy
from recycle_planner.whatif.trace import FAIL, Trace

log = logging.getLogger(__name__)

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (
    Reroute, RerouteLibraryOnly, CheckpointSpares, CheckpointWait, DropPipelines, Oobleck,
    Bamboo)}
RUN, PAUSE, WAIT = "run", "pause", "wait"


@dataclass
class Outcome:
    """What one strategy trained over one trace, with the breakpoints of its progress:
    from `times[i]` on, the net samples grow from `samples[i]` at `rates[i]` per second (a
    rollback is two breakpoints at the same time)."""

    strategy: str
    title: str
    duration: float
    fault_free_rate: float
    samples: float = 0.0
    restarts: int = 0
    fallbacks: int = 0
    reconfigurations: int = 0
    lost_rollback: float = 0.0
    lost_iterations: float = 0.0
    paused: float = 0.0
    waiting: float = 0.0
    planned: int = 0
    planning: float = 0.0
    batch_min: float = 0.0
    batch_mean: float = 0.0
    times: np.ndarray = field(default_factory=lambda: np.zeros(0))
    progress: np.ndarray = field(default_factory=lambda: np.zeros(0))
    rates: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def mean_rate(self) -> float:
        return self.samples / self.duration if self.duration > 0 else 0.0

    @property
    def relative(self) -> float:
        return self.mean_rate / self.fault_free_rate if self.fault_free_rate > 0 else 0.0

    def cumulative(self, at: np.ndarray) -> np.ndarray:
        """Net samples trained by each time in `at`."""
        i = np.searchsorted(self.times, at, side="right") - 1
        i = np.clip(i, 0, len(self.times) - 1)
        return self.progress[i] + self.rates[i] * (at - self.times[i])

    def binned_rate(self, edges: np.ndarray) -> np.ndarray:
        """Mean training speed in each bin between `edges` (rollbacks not subtracted)."""
        seg = np.diff(np.append(self.times, self.duration))
        area = np.concatenate([[0.0], np.cumsum(self.rates * seg)])

        def integral(t: np.ndarray) -> np.ndarray:
            i = np.clip(np.searchsorted(self.times, t, side="right") - 1, 0, len(self.times) - 1)
            return area[i] + self.rates[i] * (t - self.times[i])

        return np.diff(integral(edges)) / np.diff(edges)

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "title": self.title, "feasible": True,
                "samples": self.samples, "mean_throughput": self.mean_rate,
                "relative": self.relative, "restarts": self.restarts,
                "fallbacks": self.fallbacks, "reconfigurations": self.reconfigurations,
                "lost_to_rollbacks": self.lost_rollback,
                "lost_iterations": self.lost_iterations, "paused_s": self.paused,
                "waiting_s": self.waiting, "planned_on_demand": self.planned,
                "planning_s": self.planning,
                "global_batch": {"min": self.batch_min, "mean": self.batch_mean}}


class _Replay:
    """One strategy's state while a trace is replayed (see the module docstring)."""

    def __init__(self, strategy: Strategy, speeds: dict[Hashable, Speed], start: Hashable,
                 duration: float):
        self.s = strategy
        self.costs = strategy.ctx.costs
        self.speeds = speeds
        self.out = Outcome(strategy.name, strategy.title, duration,
                           strategy.ctx.fault_free.rate)
        self.t = 0.0
        self.samples = 0.0
        self.mode = RUN
        self.resume_at = 0.0
        self.restarting = False
        self.not_before = 0.0
        self.speed = speeds[start]
        self.phase = 0.0
        self.anchor = 0.0
        self.ck_samples = 0.0
        self.seen: set[Hashable] = {start}
        self.batch_area = 0.0
        self.batch_time = 0.0
        self.batch_min = math.inf
        self._t: list[float] = []
        self._p: list[float] = []
        self._r: list[float] = []
        self._mark()

    # -- time passing ------------------------------------------------------------------------
    def advance(self, t: float) -> None:
        while self.t < t:
            if self.mode == PAUSE:
                end = min(t, self.resume_at)
                self._tick_idle(end)
                self.out.paused += end - self.t
                self.t = end
                if end >= self.resume_at:
                    self._resume()
            elif self.mode == WAIT:
                self._tick_idle(t)
                self.out.waiting += t - self.t
                self.t = t
            else:
                self._run(t)

    def _last_tick(self, end: float) -> float | None:
        """The last checkpoint time in (self.t, end], if any."""
        C = self.costs.checkpoint_interval
        if C <= 0 or not math.isfinite(C):
            return None
        k = math.floor((end - self.anchor) / C + 1e-12)
        tick = self.anchor + k * C
        return tick if k >= 1 and tick > self.t else None

    def _tick_idle(self, end: float) -> None:
        if self._last_tick(end) is not None:
            self.ck_samples = self.samples

    def _run(self, end: float) -> None:
        rate, period = self.speed.rate, self.speed.period
        tick = self._last_tick(end)
        if tick is not None:
            self.ck_samples = self.samples + rate * (tick - self.t)
            self.phase = _frac((end - tick) / period)
        else:
            self.phase = _frac(self.phase + (end - self.t) / period)
        if rate > 0 and end > self.t:
            batch = self.speed.samples_per_iteration
            self.batch_area += batch * (end - self.t)
            self.batch_time += end - self.t
            self.batch_min = min(self.batch_min, batch)
        self.samples += rate * (end - self.t)
        self.t = end

    # -- changes of mode ---------------------------------------------------------------------
    def _mark(self) -> None:
        rate = self.speed.rate if self.mode == RUN else 0.0
        if self._t and self._t[-1] == self.t and self._p[-1] == self.samples:
            self._r[-1] = rate
            return
        self._t.append(self.t)
        self._p.append(self.samples)
        self._r.append(rate)

    def _resume(self) -> None:
        self.mode = RUN
        if self.restarting:
            self.anchor = self.t
            self.ck_samples = self.samples
            self.restarting = False
        self.phase = 0.0
        self._mark()

    def _pause(self, length: float, restart: bool = False) -> None:
        end = self.t + length
        if self.mode == PAUSE:
            self.resume_at = max(self.resume_at, end)
            self.restarting = self.restarting or restart
        else:
            self.mode, self.resume_at, self.restarting = PAUSE, end, restart
        self.phase = 0.0
        if restart:
            self.out.restarts += 1
        self._mark()

    def _rollback(self) -> None:
        self.out.lost_rollback += self.samples - self.ck_samples
        self.samples = self.ck_samples
        self.phase = 0.0
        self._mark()

    def _leave_wait(self, extra: float) -> None:
        self.mode = RUN  # so that _pause starts a fresh pause
        self._pause(max(self.t, self.not_before) - self.t + self.costs.restart + extra,
                    restart=True)

    def _first(self, key: Hashable | None) -> float:
        """The planning time charged for reaching `key` (only the first time in this run)."""
        if key is None or key in self.seen:
            return 0.0
        self.seen.add(key)
        seconds = self.s.planning(key)
        if seconds is None:
            return 0.0
        self.out.planned += 1
        self.out.planning += seconds
        return seconds

    # -- events ------------------------------------------------------------------------------
    def fail(self, key: Hashable | None, disrupted: bool) -> None:
        c = self.costs
        plan = self._first(key)
        if key is None:
            if self.mode != WAIT:
                if self.s.on_failure == "reconfigure" and not self.restarting:
                    self.out.fallbacks += 1
                self._rollback()
                self.mode, self.restarting = WAIT, False
                self._mark()
            self.not_before = max(self.not_before, self.t + c.detect)
        elif self.mode == WAIT:
            self._leave_wait(plan)
        elif self.s.on_failure == "restart":
            self._rollback()
            self._pause(c.detect + c.restart + plan, restart=True)
        elif disrupted:
            if self.mode == RUN and self.s.loses_iteration:
                lost = self.phase * self.speed.samples_per_iteration
                self.samples -= lost
                self.out.lost_iterations += lost
            self._pause(c.detect + self.s.fail_pause(key) + plan)
            self.out.reconfigurations += 1
        self._switch(key)

    def repair(self, key: Hashable | None, disrupted: bool) -> None:
        plan = self._first(key)
        if self.mode == WAIT:
            if key is not None:
                self._leave_wait(plan)
        elif disrupted and self.s.repair_pause(key) + plan > 0:
            self._pause(self.s.repair_pause(key) + plan)
            self.out.reconfigurations += 1
        self._switch(key)

    def _switch(self, key: Hashable | None) -> None:
        self.speed = self.speeds[key] if key is not None else STOPPED
        if self.mode == RUN:
            self._mark()

    def finish(self) -> Outcome:
        self.advance(self.out.duration)
        self.out.samples = self.samples
        if self.batch_time > 0:
            self.out.batch_min = self.batch_min
            self.out.batch_mean = self.batch_area / self.batch_time
        self.out.times = np.array(self._t)
        self.out.progress = np.array(self._p)
        self.out.rates = np.array(self._r)
        return self.out


def _frac(x: float) -> float:
    return x - math.floor(x) if math.isfinite(x) else 0.0


def configurations(strategy: Strategy, states: Sequence[DeadState]) -> list[Hashable | None]:
    """The strategy's configuration after each step; every one of them, and the healthy one,
    is costed here, all at once (and cached), so that the replay only looks up."""
    spec = strategy.ctx.spec
    keys = [strategy.config(st) for st in states]
    strategy.speeds([strategy.config(healthy(spec.stages, spec.pipelines)), *keys])
    return keys


def replay(strategy: Strategy, trace: Trace, states: Sequence[DeadState] | None = None,
           keys: Sequence[Hashable | None] | None = None) -> Outcome:
    """Replay `trace` against `strategy`: `states` from `dead_states`, `keys` from
    `configurations` (both computed when not given)."""
    why = strategy.infeasible()
    if why is not None:
        raise RecycleError(f"{strategy.title} cannot run this job: {why}")
    if states is None:
        states = dead_states(trace)
    if keys is None:
        keys = configurations(strategy, states)
    start = healthy(trace.stages, trace.pipelines)
    first = strategy.config(start)
    speeds = strategy.speeds([first])
    run = _Replay(strategy, speeds, first, trace.duration)
    before = start
    for step, state, key in zip(trace.steps(), states, keys):
        run.advance(step.time)
        disrupted = strategy.disrupts(before, state, step.kind)
        if step.kind == FAIL:
            run.fail(key, disrupted)
        else:
            run.repair(key, disrupted)
        before = state
    return run.finish()


@dataclass
class Run:
    """Every strategy over one trace."""

    label: str
    trace: Trace
    outcomes: list[Outcome]
    infeasible: dict[str, str]


@dataclass
class Study:
    """The result of `simulate`: runs, the strategies (for their assumptions) and timings."""

    ctx: Context
    strategies: list[Strategy]
    runs: list[Run]
    seconds: dict[str, float]


def make_strategies(ctx: Context, names: Sequence[str]) -> list[Strategy]:
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise RecycleError(f"unknown strateg{'y' if len(unknown) == 1 else 'ies'} "
                           f"{', '.join(map(repr, unknown))} (expected some of: "
                           f"{', '.join(STRATEGIES)})")
    return [STRATEGIES[n](ctx) for n in dict.fromkeys(names)]


def simulate(ctx: Context, traces: Sequence[tuple[str, Trace]],
             names: Sequence[str] = tuple(STRATEGIES)) -> Study:
    """Replay every trace against every named strategy. Each strategy's configurations for all
    traces are costed before any replay (`seconds["costing"]`), the replays only look up."""
    for _, trace in traces:
        if (trace.stages, trace.pipelines) != (ctx.spec.stages, ctx.spec.pipelines):
            raise RecycleError(f"the trace is for {trace.pipelines} pipelines x {trace.stages} "
                               f"stages, the job has {ctx.spec.pipelines} x {ctx.spec.stages}")
    t0 = time.perf_counter()
    states = [dead_states(trace) for _, trace in traces]
    t1 = time.perf_counter()
    strategies = make_strategies(ctx, names)
    feasible = [s for s in strategies if s.infeasible() is None]
    keys = {}
    for n, s in enumerate(feasible):  # progress: the command shows the latest record
        log.info("costing the configurations of %s (strategy %d of %d)", s.name, n + 1,
                 len(feasible))
        keys.update({(s.name, i): configurations(s, sts) for i, sts in enumerate(states)})
    t2 = time.perf_counter()
    runs = []
    for i, ((label, trace), sts) in enumerate(zip(traces, states)):
        log.info("replaying trace %d of %d (%s, %d events)", i + 1, len(traces), label,
                 len(sts))
        outcomes = [replay(s, trace, sts, keys[s.name, i]) for s in feasible]
        infeasible = {s.name: s.infeasible() for s in strategies if s not in feasible}
        runs.append(Run(label, trace, outcomes, infeasible))
    t3 = time.perf_counter()
    seconds = {"setup": t1 - t0, "costing": t2 - t1, "replay": t3 - t2, "total": t3 - t0}
    log.info("simulated %d trace(s) x %d strategies in %.2f s (costing %.2f s)", len(traces),
             len(strategies), seconds["total"], seconds["costing"])
    return Study(ctx, strategies, runs, seconds)
