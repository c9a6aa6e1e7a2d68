"""Dropping the data-parallel pipelines that lost a worker until they are whole again: the
surviving pipelines keep training at the fault-free period, each on its own share of the batch
(the global batch shrinks with them)."""

from __future__ import annotations

from typing import Hashable

from recycle_planner.whatif.deadset import DeadState
from recycle_planner.whatif.durations import format_duration
from recycle_planner.whatif.strategy import Speed, Strategy


class DropPipelines(Strategy):
    name = "drop-pipelines"
    title = "drop pipelines"

    def config(self, state: DeadState) -> Hashable | None:
        if state.stage_lost:
            return None
        return self.ctx.spec.pipelines - len(state.per_pipeline)  # whole pipelines

    def _speed(self, key: Hashable) -> Speed:
        return self.ctx.speed(self.ctx.fault_free_period, key / self.ctx.spec.pipelines)

    def disrupts(self, before: DeadState, after: DeadState, kind: str) -> bool:
        """Only a pipeline that breaks or becomes whole changes the job; a second failure in
        a dropped pipeline, or a repair that leaves it broken, does not."""
        return before.broken != after.broken

    def assumptions(self) -> list[str]:
        c = self.ctx.costs
        return [
            "a pipeline with a dead worker is dropped until all its workers are back; the "
            "others train at the fault-free period, so throughput scales with the whole "
            "pipelines (the global batch shrinks; the all-reduce over fewer peers is not "
            "made faster)",
            f"dropping or re-admitting a pipeline costs a regrouping "
            f"({format_duration(c.switch)}, after {format_duration(c.detect)} detection on a "
            f"failure) and a failure loses the iteration in progress",
            "with every pipeline broken nothing trains (the state stays in memory); a stage "
            f"with no live worker forces a checkpoint restart ({format_duration(c.restart)}) "
            "once one is repaired",
        ]
