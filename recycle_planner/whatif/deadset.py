"""Who is dead after each event of a trace, in the forms the strategies key their
configurations by (per stage, per pipeline). Computed once per trace and shared by every
strategy, so that no strategy walks the trace's worker sets itself."""

from __future__ import annotations

from dataclasses import dataclass

from recycle_planner.schedules.ops import Worker
from recycle_planner.whatif.trace import FAIL, Trace


@dataclass(frozen=True)
class DeadState:
    """The dead workers at one moment. `per_pipeline` lists only pipelines with a dead worker,
    as (pipeline, sorted dead stages), sorted by pipeline."""

    dead: frozenset[Worker]
    per_stage: tuple[int, ...]
    per_pipeline: tuple[tuple[int, tuple[int, ...]], ...]
    pipelines: int

    @property
    def count(self) -> int:
        return len(self.dead)

    @property
    def broken(self) -> frozenset[int]:
        """The pipelines with a dead worker."""
        return frozenset(d for d, _ in self.per_pipeline)

    @property
    def stage_lost(self) -> bool:
        """Some stage has no live worker: its parameters exist nowhere in memory."""
        return any(k >= self.pipelines for k in self.per_stage)


def healthy(stages: int, pipelines: int) -> DeadState:
    return DeadState(frozenset(), (0,) * stages, (), pipelines)


def dead_states(trace: Trace) -> list[DeadState]:
    """The state after each step of `trace` (`Trace.steps`: events of one time and kind
    together), in order."""
    S, D = trace.stages, trace.pipelines
    per_stage = [0] * S
    by_pipe: dict[int, set[int]] = {}
    dead: set[Worker] = set()
    out: list[DeadState] = []
    for step in trace.steps():
        for worker in step.workers:
            d, s = worker
            if step.kind == FAIL:
                dead.add(worker)
                per_stage[s] += 1
                by_pipe.setdefault(d, set()).add(s)
            else:
                dead.discard(worker)
                per_stage[s] -= 1
                by_pipe[d].discard(s)
                if not by_pipe[d]:
                    del by_pipe[d]
        pipes = tuple((p, tuple(sorted(st))) for p, st in sorted(by_pipe.items()))
        out.append(DeadState(frozenset(dead), tuple(per_stage), pipes, D))
    return out
