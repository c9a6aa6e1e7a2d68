"""Bamboo-style redundancy: every worker also holds its successor stage's layers (the last
stage holds stage 0's) and runs the successor's forward redundantly in its bubbles, all the
time; when a worker dies, its predecessor takes its stage over.

Costed with the same per-stage figures through the planner: each worker's redundant forward is
work that may wait for idle time, so it is added to the worker's weight-gradient op (W), which
the planner already defers into bubbles; it needs the worker's own backward first, a little
later than Bamboo needs it. Without the I/W split (a fused policy) it lengthens every backward.
Memory: a worker holds its successor's static state and keeps the redundant forward's
activations too. A pipeline with dead workers runs as a shorter pipeline whose merged workers
run both stages (and no redundant forward); the iteration takes the slowest pipeline's period.
"""

from __future__ import annotations

from typing import Any, Hashable

from recycle_planner.errors import SpecError
from recycle_planner.job.spec import JobSpec
from recycle_planner.whatif.deadset import DeadState
from recycle_planner.whatif.durations import format_duration
from recycle_planner.whatif.strategy import Context, Speed, Strategy, derived_memory


def groups_of(stages: int, dead: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The workers of a pipeline with the `dead` stages taken over by their predecessors: a
    tuple of the stages each live worker runs, in pipeline order (a dead stage 0 goes to the
    last worker, which runs it after its own)."""
    groups = [[s] for s in range(stages) if s not in dead]
    for s in dead:
        owner = (s - 1) % stages
        next(g for g in groups if g[0] == owner).append(s)
    return [tuple(g) for g in groups]


def recoverable(stages: int, dead: tuple[int, ...]) -> bool:
    """Every dead stage's predecessor (in the ring) is alive."""
    gone = set(dead)
    return stages >= 2 and all((s - 1) % stages not in gone for s in dead)


def bamboo_spec(spec: JobSpec, dead: tuple[int, ...] = ()) -> JobSpec:
    """One Bamboo pipeline with `dead` stages taken over (see the module docstring)."""
    spec = spec.one_chunk()  # Bamboo places one chunk per worker
    S = spec.stages
    groups = groups_of(S, dead)

    def total(values, group) -> float:
        return sum(values[s] for s in group)

    time: dict[str, list[float]] = {k: [] for k in ("forward", "backward_input",
                                                    "backward_weight", "p2p", "allreduce",
                                                    "optimizer")}
    held: list[tuple[int, ...]] = []  # stages whose state and activations a worker keeps
    for g in groups:
        replica = (g[0] + 1) % S if len(g) == 1 else None
        redundant = spec.forward[replica] if replica is not None else 0.0
        time["forward"].append(total(spec.forward, g))
        time["backward_input"].append(total(spec.backward_input, g))
        time["backward_weight"].append(total(spec.backward_weight, g) + redundant)
        time["p2p"].append(spec.p2p[g[-1]])
        time["allreduce"].append(total(spec.allreduce, g))
        time["optimizer"].append(total(spec.optimizer, g))
        held.append(g + ((replica,) if replica is not None else ()))
    data: dict[str, Any] = {"name": f"{spec.name or 'job'} with Bamboo redundancy",
                            "stages": len(groups), "pipelines": 1,
                            "microbatches": spec.microbatches, "time": time}
    memory = derived_memory(spec.memory, lambda values: [total(values, h) for h in held])
    if memory is not None:
        data["memory"] = memory
    return JobSpec.from_dict(data, "Bamboo")


def _span(values: list[float]) -> str:
    low, high = f"{min(values):.3g}", f"{max(values):.3g}"
    return low if low == high else f"{low}-{high}"


class Bamboo(Strategy):
    name = "bamboo"
    title = "Bamboo-style"
    loses_iteration = False  # the redundant forward lets the iteration in progress go on

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self._why_not: str | None = None
        self.normal: JobSpec | None = None
        if ctx.spec.stages < 2:
            self._why_not = "Bamboo needs at least 2 stages (a worker backs up its successor)"
            return
        try:
            self.normal = bamboo_spec(ctx.spec)
            ctx.model.period(self.normal)  # the schedule may not run within the budget either
        except SpecError as exc:
            self.normal = None
            self._why_not = (f"the successor's redundant layers do not fit the memory budget "
                             f"({exc})")

    def infeasible(self) -> str | None:
        return self._why_not

    def config(self, state: DeadState) -> Hashable | None:
        S = self.ctx.spec.stages
        patterns = frozenset(st for _, st in state.per_pipeline)
        if not all(recoverable(S, p) for p in patterns):
            return None
        return len(state.per_pipeline) < self.ctx.spec.pipelines, patterns

    def _speed(self, key: Hashable) -> Speed:
        any_whole, patterns = key
        model = self.ctx.model
        periods = [model.period(bamboo_spec(self.ctx.spec, p)) for p in sorted(patterns)]
        if any_whole:
            periods.append(model.period(self.normal))
        return self.ctx.speed(max(periods))

    def _overhead(self) -> str:
        """The redundancy's per-worker cost, from the spec's figures."""
        spec = self.ctx.spec.one_chunk()
        S = spec.stages
        extra = [spec.forward[(s + 1) % S] for s in range(S)]
        line = (f"from the spec: a worker runs {_span(extra)} ms of redundant forward per "
                f"micro-batch")
        mem = spec.memory
        if mem is not None and mem.static is not None:
            held = [mem.static[(s + 1) % S] / 2**30 for s in range(S)]
            line += f" and holds {_span(held)} GiB more static state"
        if mem is not None and mem.activation is not None:
            act = [mem.activation[(s + 1) % S] / 2**30 for s in range(S)]
            line += f", plus {_span(act)} GiB per in-flight micro-batch"
        return line

    def assumptions(self) -> list[str]:
        c = self.ctx.costs
        caps = list(self.normal.caps()) if self.normal is not None else []
        memory = ""
        if self.normal is not None and self.normal.memory is not None and any(
                cap is not None for cap in caps):
            memory = (f"; with the budget a worker of stage s keeps at most {caps} in-flight "
                      f"micro-batches (1F1B wants S - s)")
        return [
            "every worker also holds its successor stage (the last holds stage 0) and runs its "
            "forward redundantly, always: costed as extra weight-gradient work the planner "
            "defers into bubbles (on the critical path when the policy fuses the backward)",
            "memory: a worker also keeps its successor's static state and the redundant "
            "forward's activations" + memory,
            self._overhead(),
            f"when a worker dies its predecessor runs both stages (a shorter pipeline, no "
            f"redundancy there); the iteration takes the slowest pipeline's period; fail-over "
            f"and fail-back cost {format_duration(c.switch)} (after {format_duration(c.detect)}"
            f" detection on a failure) and keep the iteration in progress",
            f"two dead neighbours in one pipeline (ring order) cannot be taken over: checkpoint "
            f"restart ({format_duration(c.restart)}) once repairs allow",
        ]
