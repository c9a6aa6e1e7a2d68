"""The time grid the exact engines and the bounds' searches work on: costs scaled by the
smallest power of ten that makes them whole (one home for it, so that a bound found on the grid
and the CP engine's times agree)."""

from __future__ import annotations

from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec

MAX_SCALE_DIGITS = 4


def time_scale(values: list[float]) -> tuple[int, bool]:
    """The smallest power of ten that makes every value whole, and whether one exists (else
    10^MAX_SCALE_DIGITS, with values rounded down)."""
    for digits in range(MAX_SCALE_DIGITS + 1):
        scale = 10 ** digits
        if all(abs(v * scale - round(v * scale)) <= 1e-6 * max(1.0, abs(v * scale))
               for v in values):
            return scale, True
    return 10 ** MAX_SCALE_DIGITS, False


def model_scale(spec: JobSpec, policy: Policy) -> tuple[int, bool]:
    """The time scale for this job's costs, and whether it is exact (time_scale)."""
    kinds = (spec.forward, spec.backward_input, spec.backward_weight) if policy.decouple \
        else (spec.forward, spec.backward)
    return time_scale([c for costs in kinds for c in costs] + list(spec.p2p)
                      + list(spec.allreduce) + list(spec.optimizer))
