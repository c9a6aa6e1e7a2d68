"""What a run did, as typed records: the launcher's (or coordinator's) `LaunchResult`, and the
events, deaths, recoveries and generations inside it.

One home for the result's shape: the launcher fills it, the CLI prints it, `result.json` holds
`to_dict()` and `LaunchResult.from_dict` reads it back (refusing another layout in one line),
so that a tool reading a run folder sees the records the launcher made, not dicts by key.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

from recycle_planner.errors import RecycleError

RESULT_VERSION = 3
"""result.json's layout: 2 added the run id, the attempt, the generation of every iteration
and the plans' predicted periods; 3 dropped the per-micro-batch losses (iterations x D x M
values, which the coordinator no longer keeps: `losses.jsonl` has each iteration's mean)."""


class Status(str, enum.Enum):
    """How a run ended: COMPLETED (every iteration trained), STOPPED (a clean stop with a
    checkpoint: no live worker for a stage, beyond the threshold, SIGTERM), FAILED (the job
    cannot run, or a bug in user code). A `str`, so that result.json keeps the words."""

    COMPLETED = "completed"
    STOPPED = "stopped"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


class EventKind(str, enum.Enum):
    """What an event says happened. A `str`, so that result.json keeps the words."""

    START = "start"            # the workers (or host agents) were started
    HOST = "host"              # a host agent joined (cluster jobs)
    PREEMPTED = "preempted"    # SIGTERM: stopping with a checkpoint
    HANG = "hang"              # a worker lost its lease, or did not leave a generation
    DEATH = "death"            # a worker process ended
    RESTART = "restart"        # a dead worker was started again
    JOIN = "join"              # restarted workers asked to join at an iteration boundary
    SWITCH = "switch"          # the survivors switch to a refined plan at a boundary
    ABORT = "abort"            # a generation was abandoned
    GENERATION = "generation"  # a generation was decided and formed
    STOP = "stop"              # a stop decision: the members write their checkpoint
    PLANNED = "planned"        # a plan the library lacked was made on demand
    REFINE = "refine"          # a background refinement started
    REFINED = "refined"        # a background refinement ended
    DISMISS = "dismiss"        # a restarted worker arrived after the end
    CHECKPOINT = "checkpoint"  # every stage's checkpoint of an iteration is complete
    WARNING = "warning"        # something the user should know that changes nothing
    END = "end"                # the run ended (its status in `data`)
    TAKE_OVER = "take-over"    # a coordinator took over from a lost one (`takeover.py`)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Event:
    """One thing that happened, `t` seconds after launch, in words (`message`) and as data
    (`data`: the fields of its kind, e.g. a generation's `gen`, `dead`, `plan`, `restart`).
    In JSON, flat: {"t", "kind", "message", **data}."""

    t: float
    kind: EventKind
    message: str
    data: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"t": self.t, "kind": self.kind.value, "message": self.message, **self.data}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Event":
        rest = {k: v for k, v in d.items() if k not in ("t", "kind", "message")}
        return cls(float(d["t"]), EventKind(d["kind"]), str(d["message"]), rest)


@dataclass(frozen=True)
class Death:
    """A worker process that ended while it counted: its rank and name ("pipeline:stage"),
    how, when (seconds from launch; an injected fault's own time when one fired), the
    generation it died in, and the fault that killed it, if one did."""

    rank: int
    worker: str
    how: str
    t: float
    gen: int
    fault: str | None = None


@dataclass(frozen=True)
class Recovery:
    """One death and what it cost (seconds from launch): the worker ("pipeline:stage"),
    when it died, the first iteration completed after it, how long after the death that
    iteration ended (`seconds`) and the next generation was formed (`replanned_after`)."""

    worker: str
    t_death: float
    first_iteration: int
    seconds: float
    replanned_after: float | None

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class GenerationRecord:
    """What one generation predicted and what it measured (times in ms). `measured_ms`: the
    median time between consecutive iterations it completed; `replayed_ms`: its plan
    re-timed with the per-stage op costs its workers measured (`timing/replay.py`): what the
    plan predicts on the ops as they ran here, so that predicted vs replayed is the machine
    (op times unlike the profile's) and replayed vs measured is what the model misses."""

    gen: int
    dead: tuple[tuple[int, int], ...]
    plan: str
    predicted_ms: float
    predicted_degradation: float
    iterations: int
    measured_ms: float | None
    replayed_ms: float | None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "GenerationRecord":
        return cls(**{**d, "dead": tuple(tuple(w) for w in d["dead"])})


@dataclass
class LaunchResult:
    """What a run did. `losses[i]`: mean loss of iteration i over all D*M micro-batches;
    `iteration_end[i]`: seconds from this attempt's launch to the end of iteration i
    everywhere (negative for an iteration an earlier attempt or a lost coordinator finished:
    every iteration's loss and end are in losses.jsonl, `runfolder.LossRow`);
    `recoveries`: per death, the seconds until the next generation was formed
    (`replanned_after`) and until the first iteration it completed (`seconds`);
    `events`: what happened, in order."""

    status: Status
    message: str
    iterations: int
    losses: list[float | None]
    iteration_end: list[float | None]
    events: list[Event]
    recoveries: list[Recovery]
    checkpoint: str | None
    run_dir: str
    spec: dict | None = None             # the plan library's job spec
    op_times: dict[str, dict] = field(default_factory=dict)
    """Per worker that finished ("pipeline:stage"), per generation, per op kind: [count,
    seconds, seconds from the op's last wait for a peer to its end (its own work)]."""
    run_id: str = ""                     # the run this result belongs to (run.json)
    attempt: int = 1                     # which start of that run (1 + resumes)
    iteration_gen: list[int | None] = field(default_factory=list)
    """The generation that completed iteration i (None: an earlier attempt did)."""
    reference_period: float | None = None  # the library's fault-free period (ms)
    generations: list[GenerationRecord] = field(default_factory=list)
    """Per generation that ran: its plan's predicted period beside the step measured and the
    plan re-timed with the ops' measured costs."""
    version: int = RESULT_VERSION

    def to_dict(self) -> dict:
        """result.json's content."""
        records = {"events": [e.to_json() for e in self.events],
                   "recoveries": [r.to_json() for r in self.recoveries],
                   "generations": [g.to_json() for g in self.generations]}
        return {f.name: records.get(f.name, getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LaunchResult":
        """A result read back from result.json; another layout is refused in one line."""
        if d.get("version") != RESULT_VERSION:
            raise RecycleError(f"result.json has layout version {d.get('version')!r}; this "
                               f"recycle-planner reads version {RESULT_VERSION}")
        return cls(**{**d, "status": Status(d["status"]),
                      "events": [Event.from_json(e) for e in d["events"]],
                      "recoveries": [Recovery(**r) for r in d["recoveries"]],
                      "generations": [GenerationRecord.from_json(g)
                                      for g in d["generations"]]})
