"""Re-routing with the plan library (ReCycle): a failure costs a detection, a plan switch and
the iteration in progress; the job then runs at the library plan's period for the new per-stage
dead counts. Beyond the library's threshold (or with a stage left without a live worker) it
falls back to a checkpoint restart and waits until the situation is back within the library."""

from __future__ import annotations

from typing import Hashable

from recycle_planner.errors import RecycleError
from recycle_planner.whatif.deadset import DeadState
from recycle_planner.whatif.durations import format_duration
from recycle_planner.whatif.strategy import Context, Speed, Strategy


class Reroute(Strategy):
    name = "reroute"
    title = "re-routing (ReCycle)"

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        if ctx.library is None:
            raise RecycleError("re-routing needs a plan library (--library)")
        self.library = ctx.library

    def config(self, state: DeadState) -> Hashable | None:
        if state.count > self.library.max_failures or state.stage_lost:
            return None
        if self.library.entry(state.per_stage) is None:
            return None
        return state.per_stage

    def _speed(self, key: Hashable) -> Speed:
        entry = self.library.entry(key)
        return self.ctx.speed(float(entry["metrics"]["period"]))

    def assumptions(self) -> list[str]:
        c = self.ctx.costs
        lib = self.library
        return [
            f"no spare workers; the micro-batches of a dead worker run on its stage peers with "
            f"the library's plan for the dead count of every stage (policy {lib.policy.label}, "
            f"up to {lib.max_failures} dead workers)",
            f"a failure costs detection + plan switch ({format_duration(c.detect)} + "
            f"{format_duration(c.switch)}) and the iteration in progress; a repair costs a plan "
            f"switch ({format_duration(c.switch)}; the worker copies its stage's state from a "
            f"peer meanwhile)",
            f"beyond {lib.max_failures} dead workers, or with a stage left without a live "
            f"worker: fall back to a checkpoint restart (lose the work since the last "
            f"checkpoint), wait until the dead workers are back within the library, restart "
            f"({format_duration(c.restart)})",
        ]
