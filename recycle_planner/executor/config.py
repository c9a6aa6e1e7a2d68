"""Settings the launcher hands every worker, kept apart from the worker's torch-heavy code so
that the launcher starts quickly."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from recycle_planner.errors import RecycleError

CONFIG_ENV = "RECYCLE_CONFIG"
CONFIG_ERROR = 3
"""Exit status of a worker that refuses to run (bad job or library): the launcher stops."""
STALLED = 4
"""Exit status of a worker whose training thread stalled for longer than the lease."""
COORDINATOR_LOST = 5
"""Exit status of a worker (and host agent) that lost the coordinator and stopped with a
checkpoint; `--resume` continues from it."""


@dataclass
class WorkerConfig:
    """Settings the launcher passes to every worker (as JSON in RECYCLE_CONFIG)."""

    run_dir: str = "recycle-run"
    backend: str = "gloo"
    heartbeat: float = 0.2          # seconds between heartbeats
    lease: float = 4.0              # seconds: no heartbeat or no progress for this long: dead
    pg_timeout: float = 60.0        # seconds: process group timeout (never torch's 30 min)
    poll: float = 0.002             # seconds between store polls while waiting
    checkpoint_every: int = 100     # iterations; 0: only the final checkpoint
    resume: bool = False
    library: str | None = None      # overrides the job's library
    threads: int = 1                # torch intra-op threads per worker
    faults: list[dict] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_env(cls) -> "WorkerConfig":
        raw = os.environ.get(CONFIG_ENV)
        if raw is None:
            raise RecycleError("this process was not started by 'recycle-planner launch' (no "
                               f"{CONFIG_ENV} in the environment): start the job with "
                               f"'recycle-planner launch' or recycle_planner.executor.launch")
        return cls(**json.loads(raw))
