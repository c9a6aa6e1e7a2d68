"""What one rank does in one iteration: typed actions, and the program that orders them.

A `Program` is the list a launcher runs, top to bottom, once per iteration:

- `Compute`: run the forward (F), input gradient (I), weight gradient (W) or fused backward (B)
  of micro-batch `microbatch` of pipeline `pipeline` at `stage` (`chunk`, a virtual stage on
  this rank, is always 0 until plans have several chunks per rank).
- `Recv`: post the receive of the activation (the input of that F) or the gradient (the input
  of that I or B) from physical rank `peer`; the compute that needs it waits for it.
- `Send`: send the output of that F (activation) or I/B (input gradient) to rank `peer`.
- `AllReduce`: wait for the SUM all-reduce of the stage's weight gradients over `ranks` (the
  stage's live ranks, this one included); it may start as soon as the program's `launch`
  action has run (the last W or B: the gradients are final).
- `Optimizer`: the stage's optimizer step.

Ranks are physical and pipeline-major (rank = pipeline * stages + stage, torchrun's order);
`pipeline` in an action is the micro-batch's pipeline in the plan, i.e. which share of the
global batch it is (micro-batch `pipeline * microbatches + microbatch` of D * M). Every
micro-batch loss is multiplied by `loss_scale` = 1 / (D * M) and the gradients are summed, so
the step is the same however the micro-batches are spread over the survivors.

Messages carry `key` = (time, tag): the plan's time at which the sender sends it and a tag that
names it within an iteration. Both ends issue their messages in key order, which is what makes
the order safe on NCCL (`order.py`); `tag` is what a tag-matching transport (gloo) matches on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Union

from recycle_planner.errors import PlanFileError

COMPUTE_KINDS = ("F", "I", "W", "B")
ACTIVATION, GRADIENT = "activation", "gradient"
WHAT = (ACTIVATION, GRADIENT)
FORWARD, BACKWARD = 0, 1  # a message's direction, part of its tag
RECV, SEND, ALLREDUCE, OPTIMIZER = "RECV", "SEND", "ALLREDUCE", "OPTIMIZER"
REDUCE = "sum"


def message_tag(direction: int, stage: int, pipeline: int, microbatch: int, stages: int,
                pipelines: int, microbatches: int) -> int:
    """The tag of the activation (FORWARD) or gradient (BACKWARD) that `stage` sends for
    micro-batch `microbatch` of `pipeline`: unique within an iteration, below `tag_stride`."""
    return ((direction * stages + stage) * pipelines + pipeline) * microbatches + microbatch


class Compute(NamedTuple):
    kind: str
    stage: int
    pipeline: int
    microbatch: int
    chunk: int = 0

    def to_json(self) -> dict[str, Any]:
        out = {"op": self.kind, "stage": self.stage, "pipeline": self.pipeline,
               "microbatch": self.microbatch}
        return dict(out, chunk=self.chunk) if self.chunk else out

    @property
    def consumes(self) -> str | None:
        """What this compute receives (the input it waits for), if a peer sends it."""
        return {"F": ACTIVATION, "I": GRADIENT, "B": GRADIENT}.get(self.kind)

    def __str__(self) -> str:
        chunk = f" c{self.chunk}" if self.chunk else ""
        return f"{self.kind}(p{self.pipeline} s{self.stage} mb{self.microbatch}{chunk})"


class Message(NamedTuple):
    """A receive or a send: the activation or gradient of micro-batch (pipeline, microbatch)
    of the local compute at `chunk`, from or to `peer`."""

    what: str
    pipeline: int
    microbatch: int
    peer: int
    time: float
    tag: int
    chunk: int = 0

    @property
    def key(self) -> tuple[float, int]:
        return self.time, self.tag

    @property
    def op(self) -> str:
        return RECV if isinstance(self, Recv) else SEND

    def to_json(self) -> dict[str, Any]:
        out = {"op": self.op, "what": self.what, "pipeline": self.pipeline,
               "microbatch": self.microbatch, "peer": self.peer, "time": self.time,
               "tag": self.tag}
        return dict(out, chunk=self.chunk) if self.chunk else out

    def __str__(self) -> str:
        way = "from" if self.op == RECV else "to"
        return (f"{self.op} {self.what} (p{self.pipeline} mb{self.microbatch}) {way} rank "
                f"{self.peer}")


class Recv(Message):
    __slots__ = ()


class Send(Message):
    __slots__ = ()


class AllReduce(NamedTuple):
    ranks: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"op": ALLREDUCE, "ranks": list(self.ranks)}

    def __str__(self) -> str:
        return f"ALLREDUCE over ranks {list(self.ranks)}"


class Optimizer(NamedTuple):
    def to_json(self) -> dict[str, Any]:
        return {"op": OPTIMIZER}

    def __str__(self) -> str:
        return OPTIMIZER


Action = Union[Compute, Recv, Send, AllReduce, Optimizer]


@dataclass(frozen=True)
class Program:
    """One rank's actions for one iteration, in the order it issues them (see the module
    docstring). `plays` is the plan's pipeline this rank stands in for at its stage;
    `barrier`: the plan has a global barrier after the optimizer step (no staggered
    optimizer); a tag-matching transport keeps two consecutive iterations apart with
    `tag + (iteration % 2) * tag_stride`."""

    rank: int
    pipeline: int
    stage: int
    plays: int
    stages: int
    pipelines: int
    microbatches: int
    barrier: bool
    actions: tuple[Action, ...]

    @property
    def loss_scale(self) -> float:
        return 1.0 / (self.pipelines * self.microbatches)

    @property
    def tag_stride(self) -> int:
        return 2 * self.stages * self.pipelines * self.microbatches

    @property
    def launch(self) -> int:
        """The index of the action after which the stage's gradients are final and its
        all-reduce may start: the last W or B before ALLREDUCE, or ALLREDUCE itself when the
        rank runs neither (its gradients are then zeros)."""
        last = None
        for k, action in enumerate(self.actions):
            if isinstance(action, Compute) and action.kind in ("W", "B"):
                last = k
            elif isinstance(action, AllReduce):
                return k if last is None else last
        raise PlanFileError(f"rank {self.rank}'s program has no ALLREDUCE")

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "pipeline": self.pipeline, "stage": self.stage,
                "plays": self.plays, "stages": self.stages, "pipelines": self.pipelines,
                "microbatches": self.microbatches, "loss_scale": self.loss_scale,
                "reduce": REDUCE, "barrier": self.barrier, "tag_stride": self.tag_stride,
                "actions": [a.to_json() for a in self.actions]}

    @classmethod
    def from_json(cls, data: Any, where: str = "program") -> "Program":
        """The program `to_json` wrote; a `PlanFileError` naming `where` and the place for
        anything else (a launcher must not run half a program)."""
        if not isinstance(data, dict):
            raise PlanFileError(f"{where}: expected an object")
        shape = {key: _int(data, key, where, 1) for key in ("stages", "pipelines",
                                                             "microbatches")}
        S, D, M = shape["stages"], shape["pipelines"], shape["microbatches"]
        rank = _int(data, "rank", where, 0, S * D)
        pipeline = _int(data, "pipeline", where, 0, D)
        stage = _int(data, "stage", where, 0, S)
        if pipeline * S + stage != rank:
            raise PlanFileError(f"{where}: rank {rank} is not worker {pipeline}:{stage} "
                                f"(ranks are pipeline * stages + stage)")
        if not isinstance(data.get("barrier"), bool):
            raise PlanFileError(f"{where}: 'barrier' must be true or false")
        if data.get("reduce") != REDUCE:
            raise PlanFileError(f"{where}: 'reduce' must be {REDUCE!r}")
        actions = data.get("actions")
        if not isinstance(actions, list):
            raise PlanFileError(f"{where}: 'actions' must be a list")
        program = cls(rank, pipeline, stage, _int(data, "plays", where, 0, D), S, D, M,
                      data["barrier"], tuple(_action(a, shape, f"{where}: actions[{i}]")
                                             for i, a in enumerate(actions)))
        for key in ("loss_scale", "tag_stride"):  # derived: a mismatch is an edited file
            if data.get(key) != getattr(program, key):
                raise PlanFileError(f"{where}: '{key}' must be {getattr(program, key)!r}, "
                                    f"got {data.get(key)!r}")
        if sum(isinstance(a, AllReduce) for a in program.actions) != 1:
            raise PlanFileError(f"{where}: a program has exactly one ALLREDUCE")
        return program


def _int(data: dict, key: str, where: str, low: int, high: int | None = None) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
            high is not None and value >= high):
        span = f"from {low} to {high - 1}" if high is not None else f"of {low} or more"
        raise PlanFileError(f"{where}: '{key}' must be a whole number {span}, got {value!r}")
    return value


def _action(data: Any, shape: dict[str, int], where: str) -> Action:
    if not isinstance(data, dict):
        raise PlanFileError(f"{where}: expected an object")
    op = data.get("op")
    S, D, M = shape["stages"], shape["pipelines"], shape["microbatches"]
    if op in COMPUTE_KINDS:
        return Compute(op, _int(data, "stage", where, 0, S), _int(data, "pipeline", where, 0, D),
                       _int(data, "microbatch", where, 0, M), _chunk(data, where))
    if op in (RECV, SEND):
        if data.get("what") not in WHAT:
            raise PlanFileError(f"{where}: 'what' must be one of {', '.join(WHAT)}")
        time = data.get("time")
        if isinstance(time, bool) or not isinstance(time, (int, float)):
            raise PlanFileError(f"{where}: 'time' must be a number of milliseconds")
        kind = Recv if op == RECV else Send
        return kind(data["what"], _int(data, "pipeline", where, 0, D),
                    _int(data, "microbatch", where, 0, M), _int(data, "peer", where, 0, S * D),
                    float(time), _int(data, "tag", where, 0, 2 * S * D * M), _chunk(data, where))
    if op == ALLREDUCE:
        ranks = data.get("ranks")
        if not isinstance(ranks, list) or not ranks or not all(
                isinstance(r, int) and not isinstance(r, bool) and 0 <= r < S * D for r in ranks):
            raise PlanFileError(f"{where}: 'ranks' must be a list of ranks below {S * D}")
        return AllReduce(tuple(ranks))
    if op == OPTIMIZER:
        return Optimizer()
    raise PlanFileError(f"{where}: unknown op {op!r} (expected one of "
                        f"{', '.join((*COMPUTE_KINDS, RECV, SEND, ALLREDUCE, OPTIMIZER))})")


def _chunk(data: dict, where: str) -> int:
    if "chunk" not in data:
        return 0
    return _int(data, "chunk", where, 0)
