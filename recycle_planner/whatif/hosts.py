"""Which workers share a host: on a cluster the unit that fails and is repaired is usually a
whole host of several workers (a kernel panic, a power or NIC fault), not one worker.

Workers are numbered by rank and a host holds `workers_per_host` consecutive ranks. The
placement says how ranks map to workers:

- `pipeline` (default): rank d*S + s is worker (d, s), so a host holds consecutive stages of one
  pipeline (how torchrun and Megatron lay out pipeline ranks when pipeline parallelism is the
  innermost dimension across hosts);
- `stage`: rank s*D + d is worker (d, s), so a host holds one stage of consecutive pipelines
  (its peers: a host failure takes several workers of the same stage).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from recycle_planner.errors import RecycleError
from recycle_planner.schedules.ops import Worker, worker_at, worker_index

PLACEMENTS = ("pipeline", "stage")


class HostError(RecycleError):
    """A host layout that does not fit the job."""


@dataclass(frozen=True)
class Hosts:
    """`workers_per_host` consecutive ranks per host, ranks placed by `placement`."""

    stages: int
    pipelines: int
    workers_per_host: int = 1
    placement: str = "pipeline"

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise HostError(f"unknown host placement {self.placement!r} (expected one of: "
                            f"{', '.join(PLACEMENTS)})")
        n, total = self.workers_per_host, self.stages * self.pipelines
        if n < 1:
            raise HostError(f"--workers-per-host must be 1 or more, got {n}")
        if total % n:
            raise HostError(f"--workers-per-host {n} does not divide the job's {total} workers "
                            f"({self.pipelines} pipelines x {self.stages} stages)")

    @property
    def count(self) -> int:
        return self.stages * self.pipelines // self.workers_per_host

    def worker(self, rank: int) -> Worker:
        if self.placement == "pipeline":
            return worker_at(self.stages, rank)
        s, d = worker_at(self.pipelines, rank)  # stage-major: the roles of d and s swap
        return d, s

    def rank(self, worker: Worker) -> int:
        d, s = worker
        if self.placement == "pipeline":
            return worker_index(self.stages, d, s)
        return worker_index(self.pipelines, s, d)

    def workers(self, host: int) -> tuple[Worker, ...]:
        """The host's workers, in rank order."""
        if not 0 <= host < self.count:
            raise HostError(f"unknown host {host} (the job has {self.count} hosts of "
                            f"{self.workers_per_host} workers)")
        n = self.workers_per_host
        return tuple(self.worker(r) for r in range(host * n, (host + 1) * n))

    def host_of(self, worker: Worker) -> int:
        return self.rank(worker) // self.workers_per_host

    def describe(self) -> str:
        where = ("consecutive stages of one pipeline" if self.placement == "pipeline"
                 else "one stage of consecutive pipelines")
        return (f"{self.count} hosts of {self.workers_per_host} workers ({self.placement} "
                f"placement: a host holds {where})")

    def to_dict(self) -> dict[str, Any]:
        return {"workers_per_host": self.workers_per_host, "placement": self.placement,
                "hosts": self.count}
