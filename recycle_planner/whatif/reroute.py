"""Re-routing (ReCycle): a failure costs a detection, a plan switch and the iteration in
progress; the job then runs at the plan's period for the new per-stage dead counts, with the
library's policy.

`reroute` treats the library as a cache: a situation it lacks is planned on demand as the
launcher plans it (`library.ondemand.plan_on_demand`: the packed placement of the holes, one
list-scheduling pass, the whole heuristic where it fits the launcher's budget), and the first
time a run meets it the planning time is added to the pause (measured on this job once per
situation, or fixed by `Costs.plan`); later meetings find it in the library. The launcher's
background refinement is not modelled: the on-demand plan's period is charged until a repair
(an upper bound on the cost). `reroute-library-
only` is the launcher with only the library: beyond its threshold it falls back to a checkpoint
restart and waits until the situation is back within the library. Both fall back when a stage
has no live worker left (its parameters exist nowhere in memory)."""

from __future__ import annotations

import logging
import time
from typing import Any, Hashable

from recycle_planner.errors import RecycleError
from recycle_planner.job.policy import Policy
from recycle_planner.library.ondemand import plan_on_demand
from recycle_planner.whatif.deadset import DeadState
from recycle_planner.whatif.durations import format_duration
from recycle_planner.whatif.strategy import Context, Speed, Strategy

log = logging.getLogger(__name__)


class Reroute(Strategy):
    name = "reroute"
    title = "re-routing (ReCycle)"
    on_demand = True

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        if ctx.library is None:
            raise RecycleError("re-routing needs a plan library (--library)")
        self.library = ctx.library
        self.measured: dict[Hashable, float] = {}   # seconds to plan each on-demand situation

    @property
    def policy(self) -> Policy:
        return self.library.policy

    def config(self, state: DeadState) -> Hashable | None:
        if state.stage_lost:
            return None
        if self.library.entry(state.per_stage) is None and not self.on_demand:
            return None
        return state.per_stage

    def _speed(self, key: Hashable) -> Speed:
        entry = self.library.entry(key)
        if entry is not None:
            return self.ctx.speed(entry.period)
        t0 = time.perf_counter()
        plan, _ = plan_on_demand(self.library.spec, self.library.policy, tuple(key),
                                 self.library.fault_free_period)
        self.measured[key] = time.perf_counter() - t0
        log.info("%s: planned %s on demand in %.2f s", self.name, list(key), self.measured[key])
        return self.ctx.speed(plan.metrics.period)

    def planning(self, key: Hashable) -> float | None:
        if self.library.entry(key) is not None:
            return None
        charge = self.ctx.costs.plan
        return self.measured[key] if charge is None else charge

    def assumptions(self) -> list[str]:
        c = self.ctx.costs
        lib = self.library
        lines = [
            f"no spare workers; the micro-batches of a dead worker run on its stage peers with "
            f"the plan for the dead count of every stage (library up to {lib.max_failures} "
            f"dead workers)",
            f"a failure costs detection + plan switch ({format_duration(c.detect)} + "
            f"{format_duration(c.switch)}) and the iteration in progress; a repair costs a plan "
            f"switch ({format_duration(c.switch)}; the worker copies its stage's state from a "
            f"peer meanwhile)",
        ]
        if self.on_demand:
            charge = ("the on-demand planner's time measured on this job for that situation"
                      if c.plan is None else f"{format_duration(c.plan)} (--plan-time)")
            lines += [
                f"a situation the library lacks is planned on demand as the launcher does "
                f"(packed placement, within the launcher's budget; background refinement not "
                f"modelled); the first time a run meets it, planning adds {charge} to the "
                f"pause, then it is in the library",
                f"a stage left without a live worker: fall back to a checkpoint restart (lose "
                f"the work since the last checkpoint), wait until one is repaired, restart "
                f"({format_duration(c.restart)})",
            ]
        else:
            lines.append(
                f"the library only: beyond {lib.max_failures} dead workers, or with a stage "
                f"left without a live worker, fall back to a checkpoint restart (lose the work "
                f"since the last checkpoint), wait until the dead workers are back within the "
                f"library, restart ({format_duration(c.restart)})")
        return lines

    def record(self) -> dict[str, Any]:
        """Adds what planning each on-demand situation took and is charged (seconds), by
        per-stage dead counts."""
        out = super().record()
        if self.on_demand:
            plan = self.ctx.costs.plan
            out["on_demand"] = {"-".join(map(str, k)): {"measured_s": v,
                                                        "charged_s": v if plan is None else plan}
                                for k, v in sorted(self.measured.items())}
        return out


class RerouteLibraryOnly(Reroute):
    name = "reroute-library-only"
    title = "re-routing, library only"
    on_demand = False
