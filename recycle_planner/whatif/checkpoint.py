"""Checkpoint-restart, today's default: every failure rolls the job back to its last checkpoint
and relaunches it at full speed, on spare workers if there are any, else once every dead worker
is repaired."""

from __future__ import annotations

from typing import Hashable

from recycle_planner.whatif.deadset import DeadState
from recycle_planner.whatif.durations import format_duration
from recycle_planner.whatif.strategy import Speed, Strategy
from recycle_planner.whatif.trace import FAIL

FULL = "full"


class _Checkpoint(Strategy):
    on_failure = "restart"

    def _speed(self, key: Hashable) -> Speed:
        return self.ctx.fault_free

    def disrupts(self, before: DeadState, after: DeadState, kind: str) -> bool:
        return kind == FAIL  # a repaired machine joins the pool; the job does not stop

    def repair_pause(self, key: Hashable) -> float:
        return 0.0

    def _common(self) -> str:
        c = self.ctx.costs
        return (f"checkpoints every {format_duration(c.checkpoint_interval)} of wall-clock time "
                f"(asynchronous, no stall); a failure loses the work since the last checkpoint "
                f"and costs detection + restart ({format_duration(c.detect)} + "
                f"{format_duration(c.restart)}); a failure during a restart starts it again")


class CheckpointSpares(_Checkpoint):
    name = "checkpoint-spares"
    title = "checkpoint-restart, spares"

    def config(self, state: DeadState) -> Hashable | None:
        return FULL if state.count <= self.ctx.costs.spares else None

    def assumptions(self) -> list[str]:
        n = self.ctx.costs.spares
        return [
            self._common(),
            f"{n} idle spare worker{'' if n == 1 else 's'} (not counted in the job's "
            f"throughput): the job restarts at full speed as long as no more than {n} workers "
            f"are dead, a repaired machine becomes a spare; with more dead it waits for repairs",
        ]


class CheckpointWait(_Checkpoint):
    name = "checkpoint-wait"
    title = "checkpoint-restart, no spares"

    def config(self, state: DeadState) -> Hashable | None:
        return FULL if state.count == 0 else None

    def assumptions(self) -> list[str]:
        return [self._common(),
                "no spare workers: the job waits until every dead worker is repaired, then "
                "restarts at full speed"]
