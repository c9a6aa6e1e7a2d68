"""Which mechanisms a plan may use, and the memory caps that follow from the schedule."""

from __future__ import annotations

from dataclasses import dataclass

from recycle_planner.errors import SpecError
from recycle_planner.job.spec import JobSpec

SCHEDULES = ("1f1b", "zb-h1", "gpipe")


@dataclass(frozen=True)
class Policy:
    """`schedule` is the fault-free pipeline schedule the job runs; `decouple` splits each
    backward into I and W and lets W fill idle time; `stagger` lets each stage all-reduce and
    step on its own instead of a global barrier at the end of the iteration. Plain re-routing
    (no split, barrier) is the baseline."""

    schedule: str = "1f1b"
    decouple: bool = True
    stagger: bool = True

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise SpecError(f"unknown schedule {self.schedule!r} (expected one of: "
                            f"{', '.join(SCHEDULES)})")
        if self.schedule == "zb-h1" and not self.decouple:
            raise SpecError("schedule 'zb-h1' needs the I/W split: drop --no-decouple")

    def to_dict(self) -> dict:
        return {"schedule": self.schedule, "decouple": self.decouple, "stagger": self.stagger}

    @classmethod
    def from_dict(cls, data: dict) -> "Policy":
        """The policy a plan or library file records; its fields must have their types (the
        string "false" is not a boolean)."""
        if not isinstance(data, dict):
            raise SpecError("'policy' must be an object with schedule, decouple and stagger")
        for key, kind in (("schedule", str), ("decouple", bool), ("stagger", bool)):
            if not isinstance(data.get(key), kind):
                raise SpecError(f"'policy.{key}' must be a {'string' if kind is str else 'boolean'}"
                                f", got {data.get(key)!r}")
        return cls(schedule=data["schedule"], decouple=data["decouple"], stagger=data["stagger"])

    @property
    def label(self) -> str:
        parts = [self.schedule, "split" if self.decouple else "fused",
                 "staggered" if self.stagger else "barrier"]
        return "/".join(parts)

    @classmethod
    def from_label(cls, text: str) -> "Policy":
        """The policy `label` writes: SCHEDULE/split|fused/staggered|barrier."""
        parts = [p.strip().lower() for p in str(text).split("/")]
        if (len(parts) != 3 or parts[1] not in ("split", "fused")
                or parts[2] not in ("staggered", "barrier")):
            raise SpecError(f"policy {text!r} is not SCHEDULE/split|fused/staggered|barrier "
                            f"(for example 1f1b/fused/barrier)")
        return cls(parts[0], decouple=parts[1] == "split", stagger=parts[2] == "staggered")


BASELINE = Policy(schedule="1f1b", decouple=False, stagger=False)


def natural_caps(spec: JobSpec, policy: Policy) -> tuple[int, ...]:
    """In-flight micro-batches per stage that the fault-free schedule itself uses: 1F1B keeps
    S - s on stage s, ZB-H1 allows every stage 1F1B's peak S, GPipe keeps all M; never more
    than the memory model allows."""
    limits = spec.caps()
    return tuple(c if lim is None else min(c, lim)
                 for c, lim in zip(_schedule_caps(spec, policy), limits))


def compute_ops(spec: JobSpec, policy: Policy) -> int:
    """A plan's compute ops per iteration (F, I and W with the split backward; F and B
    without): the size every size threshold of the planner is measured in."""
    return spec.workers * spec.microbatches * (3 if policy.decouple else 2)


def budget_caps(spec: JobSpec, policy: Policy) -> tuple[int, ...]:
    """In-flight micro-batches per stage that re-routed plans may use: the memory model's limit,
    or, without one, the fault-free schedule's peak on its busiest worker (memory is provisioned
    for the peak, so every worker has that much)."""
    if spec.memory is None:
        return (max(_schedule_caps(spec, policy)),) * spec.stages
    return tuple(int(c) for c in spec.caps())


def _schedule_caps(spec: JobSpec, policy: Policy) -> list[int]:
    S, M = spec.stages, spec.microbatches
    if spec.chunks > 1:  # in (micro-batch, chunk) pairs: what the generated orders hold
        from recycle_planner.schedules.generators import chunk_orders
        from recycle_planner.schedules.interleaved import peak_inflight

        return [peak_inflight(order) for order in chunk_orders(spec, policy)]
    if policy.schedule == "gpipe":
        return [M] * S
    if policy.schedule == "zb-h1":
        return [min(S, M)] * S
    return [min(S - s, M) for s in range(S)]
