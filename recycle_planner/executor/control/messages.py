"""Every message between the processes of a job, as a frozen record bound to its key.

A worker talks to the control plane (its launcher or host agent, and through it the
coordinator) only with these records; the control plane answers with them. Each record type
names its key as a format string over its own fields (`KEY`), so that a sender writes
`message.key()` and a receiver that knows the identifying fields asks for
`Kind.key_for(rank=..., gen=...)`: the key and the payload's reader live in one place.
`to_json`/`from_json` turn a record into the JSON text stored under that key.

Some keys have a rule of their own (`RULE`): `first` keeps the first writer's record (the
first bug report, the first proposed switch iteration); `count` adds one per message (the
communication errors of a generation); `set` (the default) replaces the value.

`protocol.Decision` is the one message that predates this module; it keeps its own codec.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, TypeVar

SET, FIRST, COUNT = "set", "first", "count"

M = TypeVar("M", bound="Message")


class Message:
    """Base of every record: `KEY` (a format string over the record's fields), `RULE`."""

    KEY: ClassVar[str] = ""
    RULE: ClassVar[str] = SET

    def key(self) -> str:
        return self.KEY.format_map(self.__dict__)  # the fields (a record has no other state)

    @classmethod
    def key_for(cls, **ids: Any) -> str:
        return cls.KEY.format(**ids)

    def to_json(self) -> str:
        """The record's fields as a JSON object (tuples as lists). Not `dataclasses.asdict`:
        its deep copy was most of the 20 to 30 us an encode took, which a host's relay paid
        for every record its workers sent (8,128 `Ready`s in a recovery at 8,192 ranks)."""
        return json.dumps({name: getattr(self, name) for name in _fields(type(self))[0]},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls: type[M], text: str | bytes) -> M:
        return cls.from_fields(json.loads(text))

    @classmethod
    def from_fields(cls: type[M], data: Mapping[str, Any]) -> M:
        """The record from its decoded JSON object (a host's report carries its records as
        objects inside its own JSON: one decode for all of them, `relay.HostReport`)."""
        names, tuples = _fields(cls)
        fields = {name: data[name] for name in names if name in data}
        for name in tuples:
            if name in fields:
                fields[name] = _tuples(fields[name])
        return cls(**fields)


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A record type's field names, and those of them that hold tuples (which JSON gives back
    as lists), resolved once per type (resolving the types took 0.2 ms, which every record
    read paid: the coordinator reads thousands a second)."""
    hints = typing.get_type_hints(cls)
    names = tuple(f.name for f in dataclasses.fields(cls))
    return names, tuple(n for n in names if typing.get_origin(hints[n]) is tuple)


def _tuples(value: Any) -> Any:
    """JSON lists back into the tuples a frozen record holds (one level down too)."""
    if isinstance(value, list):
        return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    return value


# -- from a worker ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Hello(Message):
    """A worker process is up, has built its stage and waits to be welcomed. `steps`: the
    optimizer steps its state has taken, None for a restarted worker that holds none."""

    KEY: ClassVar[str] = "hello/{rank}/{incarnation}"
    rank: int
    incarnation: int
    pid: int
    host: str
    library: str
    steps: int | None


@dataclass(frozen=True)
class Heartbeat(Message):
    """A worker is alive; the value must change within the lease (judged on the reader's
    clock, never compared with `t`)."""

    KEY: ClassVar[str] = "hb/{rank}/{incarnation}"
    rank: int
    incarnation: int
    t: float


@dataclass(frozen=True)
class Ready(Message):
    """A member left generation `gen` (`reason`: failure or switch) with its stage's step
    count (None: it holds no state). `pending`: the iteration of a step it took before the
    all-stage sum that checks it was known (post-validated clipping, `data/validation.py`),
    None if none; `sums`: (iteration, the sum's values) for each all-stage sum it knows,
    which may settle another member's pending step (`protocol.settle`)."""

    KEY: ClassVar[str] = "gen{gen}/ready/{rank}"
    gen: int
    rank: int
    steps: int | None
    reason: str
    pending: int | None = None
    sums: tuple[tuple[int, tuple[float, ...]], ...] = ()

    def __post_init__(self) -> None:  # JSON gives lists
        object.__setattr__(self, "sums", tuple((int(i), tuple(float(x) for x in v))
                                               for i, v in self.sums))

    def known(self) -> dict[int, tuple[float, ...]]:
        return dict(self.sums)


@dataclass(frozen=True)
class Done(Message):
    """A member ran the last iteration of the job in generation `gen`."""

    KEY: ClassVar[str] = "gen{gen}/done/{rank}"
    gen: int
    rank: int
    steps: int


@dataclass(frozen=True)
class Stopped(Message):
    """A member carried out a `stop` decision (its stage's checkpoint is written)."""

    KEY: ClassVar[str] = "gen{gen}/stopped/{rank}"
    gen: int
    rank: int


@dataclass(frozen=True)
class Bug(Message):
    """An exception in user code: the job stops instead of re-routing (first report wins)."""

    KEY: ClassVar[str] = "gen{gen}/bug"
    RULE: ClassVar[str] = FIRST
    gen: int
    rank: int
    iteration: int
    traceback: str


@dataclass(frozen=True)
class CommError(Message):
    """A member's communication failed (a peer died, or the generation was abandoned)."""

    KEY: ClassVar[str] = "gen{gen}/errors"
    RULE: ClassVar[str] = COUNT
    gen: int
    rank: int


@dataclass(frozen=True)
class SwitchAt(Message):
    """The iteration boundary where the members of `gen` leave it for a re-join or a plan
    switch: the first member to propose one decides it for all."""

    KEY: ClassVar[str] = "gen{gen}/switch_at"
    RULE: ClassVar[str] = FIRST
    gen: int
    iteration: int


@dataclass(frozen=True)
class IterationDone(Message):
    """When `rank` finished `iteration` (its latest attempt), and in which generation."""

    KEY: ClassVar[str] = "it/{iteration}/{rank}"
    iteration: int
    rank: int
    gen: int
    t: float


@dataclass(frozen=True)
class Losses(Message):
    """All micro-batch losses of `iteration` as last-stage worker `rank` knows them:
    (pipeline, micro-batch, loss) triples."""

    KEY: ClassVar[str] = "loss/{iteration}/{rank}"
    iteration: int
    rank: int
    gen: int
    losses: tuple[tuple[int, int, float], ...]


@dataclass(frozen=True)
class CheckpointWritten(Message):
    """Stage `stage`'s checkpoint of `iteration` is on disk."""

    KEY: ClassVar[str] = "ckpt/{iteration}/{stage}"
    iteration: int
    stage: int


@dataclass(frozen=True)
class OpTimes(Message):
    """Per generation, per op kind: [count, seconds, seconds of own work] (its whole life)."""

    KEY: ClassVar[str] = "optimes/{rank}"
    rank: int
    times: Mapping[str, Mapping[str, list[float]]]


@dataclass(frozen=True)
class FaultFired(Message):
    """An injected fault is about to act (for reporting the time from a fault to recovery)."""

    KEY: ClassVar[str] = "fault/{rank}/{incarnation}"
    rank: int
    incarnation: int
    t: float
    fault: str


@dataclass(frozen=True)
class Stepped(Message):
    """`rank` took its stage's step of `iteration`: sent only where an injected fault waits
    for it (`after-step`)."""

    KEY: ClassVar[str] = "stepped/{iteration}/{rank}"
    iteration: int
    rank: int


@dataclass(frozen=True)
class Shape(Message):
    """What stage `stage` sends downstream (`boundary.Layout` JSON), published once."""

    KEY: ClassVar[str] = "shape/{stage}"
    stage: int
    layout: str


# -- to a worker -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Welcome(Message):
    """Which generation the worker joins (-1: training ended before it could)."""

    KEY: ClassVar[str] = "welcome/{rank}/{incarnation}"
    rank: int
    incarnation: int
    gen: int


@dataclass(frozen=True)
class Abort(Message):
    """Generation `gen` is abandoned: leave it at once."""

    KEY: ClassVar[str] = "gen{gen}/abort"
    gen: int
    reason: str


@dataclass(frozen=True)
class JoinRequest(Message):
    """A restarted worker waits to join, or a better plan is ready: the members of `gen`
    leave it at an agreed iteration boundary (`SwitchAt`)."""

    KEY: ClassVar[str] = "gen{gen}/join"
    gen: int


@dataclass(frozen=True)
class Finish(Message):
    """Every member of `gen` is done: the job is complete."""

    KEY: ClassVar[str] = "gen{gen}/finish"
    gen: int


# -- between the coordinator and the host agents ------------------------------------------------

@dataclass(frozen=True)
class HostUp(Message):
    """Host agent `node` runs `ranks`."""

    KEY: ClassVar[str] = "host/{node}"
    node: int
    hostname: str
    pid: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class WorkerExit(Message):
    """A worker's exit, reported by its host agent."""

    KEY: ClassVar[str] = "exit/{rank}/{incarnation}"
    rank: int
    incarnation: int
    code: int
    how: str
    last_line: str


@dataclass(frozen=True)
class Kill(Message):
    """The coordinator declared this worker dead: its host agent kills it if it still runs."""

    KEY: ClassVar[str] = "kill/{rank}/{incarnation}"
    rank: int
    incarnation: int


@dataclass(frozen=True)
class Spawned(Message):
    """A host agent restarted a worker: the coordinator expects this incarnation's hello."""

    KEY: ClassVar[str] = "spawn/{rank}/{incarnation}"
    rank: int
    incarnation: int


@dataclass(frozen=True)
class Bye(Message):
    """Host agent `node` saw the outcome and leaves."""

    KEY: ClassVar[str] = "bye/{node}"
    node: int


@dataclass(frozen=True)
class Attach(Message):
    """Host agent `node` re-attached to a coordinator that took over from a lost one, its
    workers still running: `decision` is the newest decision JSON it holds (generation
    `gen`, -1 and "" if none), and what the lost coordinator had told about that generation
    (`abort`: its abort's reason, `join`: a join or plan switch was asked, `switch_at`: the
    iteration its members agreed to leave it at, if one of this host's workers heard it).
    Sent after the records it relayed that the lost one may not have processed
    (`relay.Journal`). `workers`: (rank, incarnation) of its live workers."""

    KEY: ClassVar[str] = "attach/{node}"
    node: int
    gen: int
    decision: str
    workers: tuple[tuple[int, int], ...] = ()
    abort: str | None = None
    join: bool = False
    saved: int = -1                    # the latest `Progress.losses` it was told (-1: none)
    switch_at: int = -1                # the agreed `SwitchAt` its workers heard (-1: none)


@dataclass(frozen=True)
class Progress(Message):
    """What the coordinator has made durable: every iteration before `losses` has its loss in
    losses.jsonl, and `checkpoint` is the newest complete checkpoint (-1: none). Host agents
    keep the records they relayed from there on, for a coordinator that takes over."""

    KEY: ClassVar[str] = "progress"
    losses: int
    checkpoint: int


@dataclass(frozen=True)
class Outcome(Message):
    """The job is over (the coordinator's last word; host agents exit)."""

    KEY: ClassVar[str] = "outcome"
    status: str
    message: str


# -- on a c10d-compatible store (TCPStore, PrefixStore) ----------------------------------------

def put(store: Any, message: Message) -> Any:
    """Write `message` under its key by its rule; returns what the store holds now for
    `first` (the winning record) and `count` (the count)."""
    key = message.key()
    if message.RULE == COUNT:
        return store.add(key, 1)
    if message.RULE == FIRST:
        return type(message).from_json(store.compare_set(key, "", message.to_json()))
    store.set(key, message.to_json())
    return None


INCARNATIONS = "incarnation/{rank}"  # each rank's spawns, counted on the coordinator's store


def next_incarnation(store: Any, rank: int) -> int:
    """The incarnation of `rank` to spawn next: the coordinator's store counts them, not the
    host agent, so that a rebooted host's workers continue the run's count (the coordinator
    admits them at an iteration boundary) instead of meeting the kill of an incarnation it
    had before."""
    return store.add(INCARNATIONS.format(rank=rank), 1) - 1


def count_incarnations_from(store: Any, rank: int, first: int) -> None:
    """Make `first` at least the next incarnation of `rank` the store gives out. A store the
    coordinator started when it took over counts from zero: the host agents that re-attach
    raise it for their workers, the new coordinator for the ranks no host runs."""
    raise_counter(store, INCARNATIONS.format(rank=rank), first)


def raise_counter(store: Any, key: str, least: int) -> None:
    """Make the counter `key` (one `store.add` counts on) at least `least`: by
    compare-and-set, never lowered, whoever comes first, and safe to repeat after a call
    whose answer was lost (an `add` repeated would count twice)."""
    held = store.compare_set(key, "", str(least))
    for _ in range(16):  # raced only by adds to the same key, which raise it too
        if int(held) >= least:
            return
        held = store.compare_set(key, held, str(least))
    raise RuntimeError(f"the counter {key!r} kept changing")


def get(store: Any, kind: type[M], **ids: Any) -> M | None:
    """The record of `kind` under the key `ids` name, or None when it is not there yet."""
    key = kind.key_for(**ids)
    if not store.check([key]):
        return None
    return kind.from_json(store.get(key))


def count(store: Any, kind: type[Message], **ids: Any) -> int:
    """How many `count` messages of `kind` arrived under the key `ids` name."""
    return store.add(kind.key_for(**ids), 0)


def present(store: Any, kind: type[Message], ids: list[Mapping[str, Any]]) -> bool:
    """Whether a record of `kind` is there for every set of `ids`."""
    return store.check([kind.key_for(**i) for i in ids])
