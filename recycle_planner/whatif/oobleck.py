"""Oobleck-style recovery: re-instantiate pipelines of other lengths from the surviving workers
and redistribute the global batch over them.

A pipeline of l stages holds the same layers as the job's S stages, cut into l contiguous equal
slices: worker j of it covers stages [j S/l, (j+1) S/l) of the original, and its forward,
backward, all-reduce, optimizer and memory figures are those stages' figures summed over the
covered fraction (l = S gives back the job's own stages). Each shape is costed as one pipeline
by the planner, with the baseline policy; the iteration takes as long as the slowest pipeline.

A reconfiguration costs a fixed part (`Costs.reconfigure`: new communicators, re-instantiation)
plus moving layers: a worker of a re-instantiated pipeline keeps the original stage it held (the
one of its slice it overlaps most, at best) and receives the rest of its slice's state (the
spec's static memory, or `Costs.parameter_bytes` spread equally) at `Costs.bandwidth`; workers
receive in parallel, so the largest share sets the time. A repair also loads one stage's state
onto the returning worker.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Hashable, Sequence

from recycle_planner.errors import SpecError
from recycle_planner.job.spec import JobSpec
from recycle_planner.whatif.deadset import DeadState
from recycle_planner.whatif.durations import format_duration
from recycle_planner.whatif.strategy import (Context, Speed, Strategy, derived_memory,
                                             min_max_split)


def overlaps(S: int, length: int, j: int) -> list[tuple[int, float]]:
    """(original stage, fraction of it) for every stage that slice j of `length` covers."""
    lo, hi = Fraction(j * S, length), Fraction((j + 1) * S, length)
    out = []
    for s in range(math.floor(lo), min(S, math.ceil(hi))):
        overlap = min(hi, s + 1) - max(lo, Fraction(s))
        if overlap > 0:
            out.append((s, float(overlap)))
    return out


def window(values: Sequence[float], length: int) -> list[float]:
    """Per-stage `values` re-cut into `length` equal contiguous slices, each the sum over the
    fraction of every original stage it covers."""
    S = len(values)
    return [sum(values[s] * f for s, f in overlaps(S, length, j)) for j in range(length)]


def received(state: Sequence[float], length: int) -> float:
    """Bytes the busiest worker of a pipeline re-cut into `length` slices receives: its slice's
    state less the part of the one original stage it already held (the largest it overlaps)."""
    S = len(state)
    return max((sum(state[s] * f for s, f in cover) - max(state[s] * f for s, f in cover)
                for cover in (overlaps(S, length, j) for j in range(length))), default=0.0)


def pipeline_spec(spec: JobSpec, length: int, microbatches: int) -> JobSpec:
    """One pipeline of `length` stages running `microbatches` micro-batches (see the module
    docstring); a slice's p2p latency is the largest of the stages it touches."""
    spec = spec.one_chunk()  # Oobleck places one chunk per worker
    S = spec.stages
    time = {key: window(getattr(spec, key), length)
            for key in ("forward", "backward_input", "backward_weight", "allreduce", "optimizer")}
    time["p2p"] = [max(spec.p2p[s] for s, _ in overlaps(S, length, j)) for j in range(length)]
    data: dict[str, Any] = {"name": f"{spec.name or 'job'} as {length} stages",
                            "stages": length, "pipelines": 1, "microbatches": microbatches,
                            "time": time}
    memory = derived_memory(spec.memory, lambda values: window(values, length))
    if memory is not None:
        data["memory"] = memory
    return JobSpec.from_dict(data, f"{spec.name or 'job'} re-cut into {length} stages")


def fits(spec: JobSpec, length: int) -> bool:
    """Can every worker of an l-stage pipeline hold its slice's static state plus the
    activations of the micro-batches 1F1B keeps in flight there (l - j on slice j)? The job's
    own shape (l = S) always counts as fitting."""
    mem = spec.memory
    if length == spec.stages or mem is None or mem.activation is None:
        return True
    act = window(mem.activation, length)
    static = window(mem.static, length) if mem.static is not None else [0.0] * length
    need = [static[j] + min(length - j, spec.microbatches) * act[j] for j in range(length)]
    return max(need) <= mem.budget * (1 + 1e-12)


class Oobleck(Strategy):
    name = "oobleck"
    title = "Oobleck-style"

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        spec = ctx.spec
        self.shortest = next(n for n in range(1, spec.stages + 1) if fits(spec, n))
        self._periods: dict[tuple[int, int], float] = {}
        mem, total = spec.memory, ctx.costs.parameter_bytes
        self.state: tuple[float, ...] | None = None   # bytes per stage that move with layers
        if mem is not None and mem.static is not None:
            self.state, self.state_source = mem.static, "the spec's static memory"
        elif total is not None:
            self.state = (total / spec.stages,) * spec.stages
            self.state_source = "--parameter-bytes"

    def config(self, state: DeadState) -> Hashable | None:
        """(whole pipelines, lengths of the re-instantiated ones, idle survivors): the
        survivors of the broken pipelines form as many pipelines as possible (no more than
        broke), of lengths as equal as possible between the shortest that fits and S."""
        if state.stage_lost:
            return None
        S, D = self.ctx.spec.stages, self.ctx.spec.pipelines
        broken = len(state.per_pipeline)
        survivors = sum(S - len(st) for _, st in state.per_pipeline)
        n = min(broken, survivors // self.shortest)
        lengths: tuple[int, ...] = ()
        if n:
            base, extra = divmod(min(survivors, n * S), n)
            lengths = (base + 1,) * extra + (base,) * (n - extra)
        return D - broken, lengths, survivors - sum(lengths)

    def moved(self, key: Hashable | None) -> float:
        """Bytes the busiest worker receives to reach configuration `key`."""
        if self.state is None or key is None:
            return 0.0
        return max((received(self.state, n) for n in set(key[1])), default=0.0)

    def fail_pause(self, key: Hashable) -> float:
        c = self.ctx.costs
        return c.reconfigure + self.moved(key) / c.bandwidth

    def repair_pause(self, key: Hashable) -> float:
        c = self.ctx.costs
        returning = max(self.state) if self.state is not None else 0.0
        return c.reconfigure + max(self.moved(key), returning) / c.bandwidth

    def period(self, length: int, microbatches: int) -> float:
        """ms per iteration of one pipeline of `length` stages with that many micro-batches."""
        if microbatches == 0:
            return 0.0
        key = (length, microbatches)
        if key not in self._periods:
            try:
                self._periods[key] = self.ctx.model.period(
                    pipeline_spec(self.ctx.spec, length, microbatches))
            except SpecError:  # the policy's schedule cannot run it within the budget (GPipe)
                self._periods[key] = math.inf
        return self._periods[key]

    def _speed(self, key: Hashable) -> Speed:
        whole, lengths, _ = key
        spec = self.ctx.spec
        if whole == spec.pipelines:
            return self.ctx.fault_free
        shapes = [spec.stages] * whole + list(lengths)
        if not shapes:
            return self.ctx.speed(math.inf)
        M = spec.microbatches
        period, _ = min_max_split(shapes, spec.pipelines * M, self.period,
                                  lambda n: M / self.period(n, M))
        return self.ctx.speed(period)

    def assumptions(self) -> list[str]:
        c = self.ctx.costs
        S = self.ctx.spec.stages
        return [
            f"the survivors of the broken pipelines are re-instantiated as pipelines of "
            f"{self.shortest} to {S} stages (as many as possible, no more than broke, lengths "
            f"as equal as possible); survivors left over stay idle"
            + ("" if self.shortest == 1 else
               "; shorter pipelines do not fit the memory budget (each worker must hold its "
               "layers' static state plus the 1F1B in-flight activations)"),
            "a pipeline of l stages cuts the same layers into l equal contiguous slices (per-"
            "stage costs and memory summed over the covered fraction of each original stage); "
            "each shape is costed by the planner with the baseline policy",
            "the global batch (every micro-batch) is redistributed so that the slowest pipeline "
            "is as fast as possible; the iteration takes the slowest pipeline's period",
            f"every failure and repair costs a reconfiguration ({format_duration(c.reconfigure)}"
            f" + moving layers, after {format_duration(c.detect)} detection on a failure) and "
            f"a failure loses the iteration in progress; a stage with no live worker forces a "
            f"checkpoint restart ({format_duration(c.restart)}) once one is repaired",
            self._moving(),
        ]

    def _moving(self) -> str:
        c = self.ctx.costs
        if self.state is None:
            return ("moving layers is not costed: the spec has no [memory] static sizes (give "
                    "--parameter-bytes)")
        S = self.ctx.spec.stages
        worst = received(self.state, S - 1) if S > 1 else 0.0
        return (f"moving layers: a worker keeps the stage it held and receives the rest of its "
                f"slice's state ({self.state_source}, {sum(self.state) / 2**30:.3g} GiB in all) at "
                f"{c.bandwidth / 1e9:g} GB/s, in parallel; e.g. re-cut into {S - 1} stages the "
                f"busiest receives {worst / 2**30:.3g} GiB ({format_duration(worst / c.bandwidth)})"
                f"; a repair loads one stage's state ({max(self.state) / 2**30:.3g} GiB) onto the "
                f"returning worker")
