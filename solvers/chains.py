"""The per-stage costs, chains and busiest loads every analytic bound is built from (bounds.py
and crowded_ends.py), in one place so that the two read latency, the fused backward and the
re-routed load the same way."""

from __future__ import annotations

from dataclasses import dataclass

import math

from recycle_planner.job.policy import Policy, budget_caps
from recycle_planner.job.spec import JobSpec
from recycle_planner.job.workers import dead_per_stage
from recycle_planner.schedules.ops import Worker


@dataclass(frozen=True)
class Chains:
    fwd: tuple[float, ...]
    inp: tuple[float, ...]    # input backward, or the fused backward
    wgt: tuple[float, ...]    # weight gradient, or 0 with the fused backward
    tail: list[float]         # all-reduce and optimizer step
    caps: tuple[int, ...]     # in-flight micro-batches per stage (budget_caps)
    head: list[float]         # from the start of stage 0's forward to stage s's
    up: list[float]           # from the end of stage s's input backward to the end of stage 0's
    # From the start of stage s's forward to the end of the last stage's forward, then
    # gradients back to the start of stage s's input backward.
    round_trip: list[float]


def chains(spec: JobSpec, policy: Policy) -> Chains:
    S, fwd, p2p = spec.stages, tuple(spec.forward), spec.p2p
    if policy.decouple:
        inp, wgt = tuple(spec.backward_input), tuple(spec.backward_weight)
    else:
        inp, wgt = tuple(spec.backward), (0.0,) * S
    return Chains(
        fwd, inp, wgt,
        tail=[spec.allreduce[s] + spec.optimizer[s] for s in range(S)],
        caps=budget_caps(spec, policy),
        head=[sum(fwd[j] + p2p[j] for j in range(s)) for s in range(S)],
        up=[sum(p2p[j + 1] + inp[j] for j in range(s)) for s in range(S)],
        round_trip=[sum(fwd[j] for j in range(s, S)) + sum(p2p[j] for j in range(s, S - 1))
                    + sum(inp[j] + p2p[j] for j in range(s + 1, S)) for s in range(S)])


def busiest_load(spec: JobSpec, failed: tuple[Worker, ...]) -> tuple[int, ...]:
    """n_s: micro-batches on the busiest live stage-s worker under the most even split."""
    D, M = spec.pipelines, spec.microbatches
    return tuple(math.ceil(D * M / (D - k)) for k in dead_per_stage(spec, failed))
