"""Settings the launcher hands every worker, kept apart from the worker's torch-heavy code so
that the launcher starts quickly."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from recycle_planner.errors import RecycleError

RUN_DIR = "recycle-run"
"""Where a run's checkpoints, logs and result go by default."""
BACKENDS = ("gloo", "nccl", "nccl-sim")
"""The data plane's backends (`data/comm.py`'s `BACKENDS`): gloo on CPU, NCCL on GPUs, and
gloo with NCCL's host semantics for tests on CPU (`data/nccl_sim.py`)."""
BACKEND = "gloo"
HEARTBEAT = 0.2
"""Seconds between a worker's heartbeats."""
LEASE = 4.0
"""Seconds without a heartbeat (or without progress of the training thread) after which a
worker is dead: the one name for it everywhere (`--lease`, `LaunchConfig.lease`,
`WorkerConfig.lease`)."""
PG_TIMEOUT = 60.0
"""Seconds: the timeout of every process group (a backstop; never torch's 30 min)."""
CHECKPOINT_EVERY = 100
"""Iterations between periodic checkpoints (0: only the final one)."""
STARTUP_TIMEOUT = 300.0
"""Seconds the launcher waits for every worker's hello."""
MAX_RESTARTS = 3
"""Restarts per worker (with a restart delay)."""

CONFIG_ENV = "RECYCLE_CONFIG"
CONFIG_KEY = "config"
"""Where a coordinator posts the workers' settings (`WorkerConfig` JSON) for its host agents."""
BUCKET_MB = 25.0
"""Size (MiB) of a bucket of the stage's gradient all-reduce (`buckets.py`), DDP's default:
large enough that a launch costs little against its transfer, small enough that the first
buckets start while the backward still runs."""
UNDO_PLACES = ("host", "device")
UNDO_COPY = "host"
"""Where the copy that undoes a stage's latest step lives (one of UNDO_PLACES, each a buffer
maker in `undo.BUFFERS`): GPU memory is the scarce one."""
CONFIG_ERROR = 3
"""Exit status of a worker that refuses to run (bad job or library): the launcher stops."""
STALLED = 4
"""Exit status of a worker whose training thread stalled for longer than the lease."""
FENCED = 6
"""Exit status of a worker that read a decision excluding it (its lease had expired, or a
newer incarnation took its place): it left without acting on it."""
EXECUTOR_ERROR = 7
"""Exit status of a worker whose error was raised by the executor, not by user code: a failed
worker (its micro-batches are re-routed), never a bug that stops the job."""
GRACE = 30.0
"""Seconds from a SIGTERM (preemption) to a consistent checkpoint and every process gone:
SLURM's and Kubernetes' defaults are 30 s or less."""
RDZV_TIMEOUT = 300.0
"""Seconds a host agent waits for its coordinator's store before it gives up."""
RDZV_BACKENDS = ("c10d", "etcd")
"""Where a cluster job's coordinator is found (torchrun's `--rdzv-backend`): `c10d`, the one
coordinator's own store at `--rdzv-endpoint`; `etcd`, the leader among coordinators that
campaign on the etcd at `--rdzv-endpoint` (docs/runtime-engines.md)."""
RDZV_BACKEND = "c10d"
RDZV_ID = "recycle"
"""The job's name: its host agents' key prefix at the coordinator, and its keys' prefix on
etcd (torchrun's `--rdzv-id`)."""
COORDINATOR_LOST = 5
"""Exit status of a worker (and host agent) that lost the coordinator and stopped with a
checkpoint; `--resume` continues from it."""
HOST_AGENT_LOST = 8
"""Exit status of a worker whose own host agent went silent for a lease (stopped, hung) or
away: the coordinator declares that host lost and re-routes, so the worker leaves without
writing anything (its stage's state lives in its peers)."""


@dataclass
class WorkerConfig:
    """Settings the launcher passes to every worker (as JSON in RECYCLE_CONFIG)."""

    run_dir: str = RUN_DIR
    backend: str = BACKEND
    heartbeat: float = HEARTBEAT    # seconds between heartbeats
    lease: float = LEASE            # seconds: no heartbeat or no progress for this long: dead
    pg_timeout: float = PG_TIMEOUT  # seconds: process group timeout
    poll: float = 0.002             # seconds between store polls while waiting
    checkpoint_every: int = CHECKPOINT_EVERY  # iterations; 0: only the final checkpoint
    resume: bool = False
    library: str | None = None      # overrides the job's library
    threads: int = 1                # torch intra-op threads per worker
    bucket_mb: float = BUCKET_MB    # gradient all-reduce bucket size
    undo_copy: str = UNDO_COPY      # where the step-undo copy lives: host or device
    faults: list[dict] = field(default_factory=list)
    log_dir: str | None = None      # this attempt's log folder (host agents write there)
    grace: float = GRACE            # seconds a worker waits after SIGTERM for the stop

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str | bytes) -> "WorkerConfig":
        return cls(**json.loads(text))

    @classmethod
    def from_env(cls) -> "WorkerConfig":
        raw = os.environ.get(CONFIG_ENV)
        if raw is None:
            raise RecycleError("this process was not started by 'recycle-planner launch' (no "
                               f"{CONFIG_ENV} in the environment): start the job with "
                               f"'recycle-planner launch' or recycle_planner.executor.launch")
        return cls.from_json(raw)
