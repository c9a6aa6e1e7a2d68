"""A plan's period with the op costs a run measured instead of the profiled ones.

When a measured step time differs from the plan's prediction, either the ops took other times
than the profile said (the machine, the quota, caches, the runtime's per-op work), or the
plan's model of the run is wrong (communication, the order the runtime really follows, time
spent between ops). Re-timing the same schedule with the run's own per-stage op costs
separates the two: what the replay still misses is the model's.

The costs come from the executor's op times (`LaunchResult.op_times`): per worker, per
generation, per op kind [count, seconds, seconds of own work], own work being the time from
the op's last wait for a peer to its end. Communication (p2p, all-reduce) keeps the profiled
costs: the executor's all-reduce time includes waiting for the slowest peer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from recycle_planner.errors import RecycleError
from recycle_planner.job.profiler import MIN_MS
from recycle_planner.job.spec import JobSpec
from recycle_planner.timing.plan import Plan
from recycle_planner.timing.simulate import simulate

COST_OF_KIND = {"F": "forward", "I": "backward_input", "W": "backward_weight",
                "OPTIMIZER": "optimizer"}
"""Op kind the executor records -> the spec's cost it measures (B is split below)."""


@dataclass(frozen=True)
class StageCosts:
    """Mean own work (ms) per op kind of one stage, over its workers (count-weighted)."""

    stage: int
    ms: dict[str, float]
    count: dict[str, int]


def stage_costs(op_times: dict[str, dict], generation: int, stages: int) -> list[StageCosts]:
    """Per stage, the mean own work of each op kind in `generation` over the workers that
    reported it (workers are named "pipeline:stage")."""
    sums: list[dict[str, list[float]]] = [{} for _ in range(stages)]
    for name, by_gen in op_times.items():
        table = by_gen.get(str(generation), by_gen.get(generation))
        if table is None:
            continue
        s = int(name.split(":")[1])
        for kind, (count, _, own) in table.items():
            if count:
                acc = sums[s].setdefault(kind, [0, 0.0])
                acc[0] += count
                acc[1] += own
    return [StageCosts(s, {k: 1e3 * v[1] / v[0] for k, v in acc.items()},
                       {k: int(v[0]) for k, v in acc.items()}) for s, acc in enumerate(sums)]


def measured_spec(spec: JobSpec, costs: list[StageCosts]) -> JobSpec:
    """`spec` with each stage's compute and optimizer costs replaced by the measured ones.
    A fused backward (B) measured alone scales the profiled I and W by the same factor."""
    if len(costs) != spec.stages:
        raise RecycleError(f"measured costs for {len(costs)} stages, the spec has "
                           f"{spec.stages}")
    values = {key: list(getattr(spec, key)) for key in COST_OF_KIND.values()}
    for c in costs:
        for kind, key in COST_OF_KIND.items():
            if kind in c.ms:
                values[key][c.stage] = max(MIN_MS, c.ms[kind])
        if "B" in c.ms and not {"I", "W"} & c.ms.keys():
            s = c.stage
            scale = c.ms["B"] / (spec.backward_input[s] + spec.backward_weight[s])
            values["backward_input"][s] = max(MIN_MS, spec.backward_input[s] * scale)
            values["backward_weight"][s] = max(MIN_MS, spec.backward_weight[s] * scale)
    return replace(spec, **{k: tuple(v) for k, v in values.items()})


def replay_period(plan: Plan, spec: JobSpec) -> float:
    """The period (ms) of `plan`'s schedule timed with `spec`'s costs."""
    return simulate(replace(plan.schedule, spec=spec)).period
