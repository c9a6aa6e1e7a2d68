"""Operations as small values, and the integer id space the fast paths use.

An `Op` is what a plan file and a person read: (kind, pipeline, stage, micro-batch), where the
pipeline is the micro-batch's own pipeline (a re-routed op runs on another pipeline's worker).
Arrays index ops by an integer id computed from those four fields, so that dependencies are
arithmetic (the forward that feeds F(d, s, m) is F(d, s-1, m)) rather than dictionary lookups.

With several chunks per worker (virtual stages, see job/spec.py) an op also carries its chunk:
`stage` stays the stage of the workers that hold it, and the id space runs over virtual stages,
so that the dependency chain (virtual stage v feeds v + 1) stays arithmetic.

An op has one text form, `str(op)` = `F(p0 s1 mb2)` (`F(p0 s1 c1 mb2)` for chunk 1,
`ALLREDUCE(p0 s1)` for a collective), that `Op.parse` reads back; logs, error messages and
`show` use it. torch's `_Action` form `1F2` (stage, kind, micro-batch) has no pipeline and
numbers virtual stages: `torch_action` and `from_torch_action` are its projection, for the CSV
torch reads.

Workers are numbered pipeline-major: worker (d, s) is `worker_index(S, d, s)` = d * S + s,
and `worker_at(S, w)` is its inverse (both work on numpy arrays too).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from recycle_planner.job.spec import holder_of

F, I, W, B, AR, OPT = range(6)
KIND_NAMES = ("F", "I", "W", "B", "ALLREDUCE", "OPTIMIZER")
# What each kind is, for legends.
KIND_TITLES = ("forward", "input gradient", "weight gradient", "full backward (I+W)",
               "gradient all-reduce", "optimizer step")
KIND_CODES = {name: code for code, name in enumerate(KIND_NAMES)}
COMPUTE_KINDS = 4  # kind codes below this are compute ops (F, I, W, B)
COLLECTIVE_KINDS = frozenset({AR, OPT})  # one per worker and iteration, no micro-batch
COLLECTIVE_NAMES = frozenset(KIND_NAMES[k] for k in COLLECTIVE_KINDS)


def is_collective(kind):
    """Whether kind code(s) `kind` (an int or a numpy array) are collectives."""
    return kind >= COMPUTE_KINDS


_OP_TEXT = re.compile(
    r"(?P<kind>[A-Z]+)\(p(?P<p>\d+) s(?P<s>\d+)(?: c(?P<c>\d+))?(?: mb(?P<m>\d+))?\)")
_TORCH_ACTION = re.compile(r"(?P<s>\d+)(?P<kind>[FIWB])(?P<m>\d+)")


class Op(NamedTuple):
    """One operation of one iteration. `microbatch` is None for ALLREDUCE and OPTIMIZER, whose
    `pipeline` is the worker's own; `chunk` is which of the stage's model chunks it runs (0
    for collectives, which cover all of a worker's chunks)."""

    kind: str
    pipeline: int
    stage: int
    microbatch: int | None
    chunk: int = 0

    def __str__(self) -> str:
        if self.microbatch is None:
            return f"{self.kind}(p{self.pipeline} s{self.stage})"
        chunk = f" c{self.chunk}" if self.chunk else ""
        return f"{self.kind}(p{self.pipeline} s{self.stage}{chunk} mb{self.microbatch})"

    @classmethod
    def parse(cls, text: str) -> "Op":
        """The op `str(op)` wrote; ValueError for anything else."""
        m = _OP_TEXT.fullmatch(text.strip())
        if m is None or m["kind"] not in KIND_CODES or (m["m"] is None) != (
                m["kind"] in COLLECTIVE_NAMES) or (m["c"] is not None and m["m"] is None):
            raise ValueError(f"not an op: {text!r} (expected e.g. F(p0 s1 mb2), "
                             f"F(p0 s1 c1 mb2) or ALLREDUCE(p0 s1))")
        return cls(m["kind"], int(m["p"]), int(m["s"]), None if m["m"] is None else int(m["m"]),
                   int(m["c"] or 0))

    def torch_action(self, vstage: int | None = None) -> str:
        """torch.distributed.pipelining's `_Action` text (`1F2`); compute ops only. torch
        numbers stages by virtual stage: pass it (`OpSpace.vstage_of`) for a chunked job."""
        if self.microbatch is None:
            raise ValueError(f"{self} has no torch action (torch's CSV lists compute ops only)")
        return f"{self.stage if vstage is None else vstage}{self.kind}{self.microbatch}"

    @classmethod
    def from_torch_action(cls, text: str, pipeline: int,
                          space: "OpSpace | None" = None) -> "Op":
        """The op of `pipeline` that torch's action text names (its stage is a virtual stage of
        `space`'s job when given)."""
        m = _TORCH_ACTION.fullmatch(text.strip())
        if m is None:
            raise ValueError(f"not a torch compute action: {text!r} (expected e.g. 1F2)")
        vstage = int(m["s"])
        if space is None:
            return cls(m["kind"], pipeline, vstage, int(m["m"]))
        if vstage >= space.V:
            raise ValueError(f"torch action {text!r}: stage {vstage} is outside the job "
                             f"({space.V} virtual stages)")
        return cls(m["kind"], pipeline, int(space.holder[vstage]), int(m["m"]),
                   int(space.chunk_of[vstage]))


Worker = tuple[int, int]
"""(pipeline, stage): the unit that fails."""


def worker_index(stages: int, pipeline, stage):
    """The index of worker (pipeline, stage) in pipeline-major order (ints or arrays)."""
    return pipeline * stages + stage


def worker_at(stages: int, index):
    """(pipeline, stage) of worker `index` in pipeline-major order (ints or arrays)."""
    return index // stages, index % stages


def worker_name(stages: int, index: int) -> str:
    """`PIPELINE:STAGE` of worker `index`, as the CLI and error messages write a worker."""
    d, s = worker_at(stages, int(index))
    return f"{d}:{s}"


class OpSpace:
    """Integer ids for every op a job of this shape can have in one iteration.

    Compute ops: id = ((kind * D + d) * V + v) * M + m for kind in F, I, W, B, where v is the
    virtual stage (V = S x chunks; v = s when a worker holds one chunk), that is
    kind * `per_kind` + the *unit* (d * V + v) * M + m (one micro-batch of one pipeline at one
    virtual stage); the same micro-batch one virtual stage on is `stage_step` further.
    Collectives: ALLREDUCE of worker (d, s) is 4DVM + d*S + s, OPTIMIZER is
    4DVM + DS + d*S + s. `holder[v]` and `chunk_of[v]` map a virtual stage to the stage whose
    workers run it and its chunk there; `decode` gives virtual stages.
    """

    def __init__(self, stages: int, pipelines: int, microbatches: int, chunks: int = 1,
                 layout: str = "interleaved"):
        self.S, self.D, self.M = stages, pipelines, microbatches
        self.C, self.V, self.layout = chunks, stages * chunks, layout
        self.per_kind = pipelines * self.V * microbatches  # units, = compute ids of one kind
        self.stage_step = microbatches
        self.n_compute = COMPUTE_KINDS * self.per_kind
        self.size = self.n_compute + 2 * pipelines * stages
        self.holder = np.array([holder_of(stages, chunks, layout, v) for v in range(self.V)],
                               dtype=np.int64)
        self.chunk_of = np.arange(self.V, dtype=np.int64) // stages
        self.vstage_of = np.zeros((stages, chunks), dtype=np.int64)  # [stage, chunk]
        self.vstage_of[self.holder, self.chunk_of] = np.arange(self.V)

    @classmethod
    def of(cls, spec) -> "OpSpace":
        """The id space of job `spec` (a JobSpec)."""
        return cls(spec.stages, spec.pipelines, spec.microbatches, spec.chunks, spec.layout)

    def compute(self, kind, d, v, m):
        """The id of compute op `kind` of micro-batch m of pipeline d at virtual stage v."""
        return ((kind * self.D + d) * self.V + v) * self.M + m

    def allreduce(self, d, s):
        return self.n_compute + worker_index(self.S, d, s)

    def optimizer(self, d, s):
        return self.n_compute + self.D * self.S + worker_index(self.S, d, s)

    def decode(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(kind, pipeline, stage, microbatch) arrays for an array of ids; microbatch -1 for
        collectives; the stage of a compute op is its virtual stage (`holder` maps it to the
        stage that runs it), that of a collective its worker's stage."""
        ids = np.asarray(ids, dtype=np.int64)
        kind = np.empty_like(ids)
        pipe = np.empty_like(ids)
        stage = np.empty_like(ids)
        mb = np.full_like(ids, -1)
        comp = ids < self.n_compute
        c = ids[comp]
        mb[comp] = c % self.M
        c = c // self.M
        stage[comp] = c % self.V
        c = c // self.V
        pipe[comp] = c % self.D
        kind[comp] = c // self.D
        coll = ~comp
        k = ids[coll] - self.n_compute
        kind[coll] = np.where(k < self.D * self.S, AR, OPT)
        k = k % (self.D * self.S)
        pipe[coll] = k // self.S
        stage[coll] = k % self.S
        return kind, pipe, stage, mb

    def worker_stage(self, kind: np.ndarray, stage: np.ndarray) -> np.ndarray:
        """The stage of the workers that run ops of `decode`'s (kind, stage)."""
        return np.where(is_collective(kind), stage, self.holder[np.where(
            is_collective(kind), 0, stage)])

    def to_op(self, op_id: int) -> Op:
        return self.to_ops(np.array([op_id]))[0]

    def to_ops(self, ids: np.ndarray) -> list[Op]:
        kind, pipe, stage, mb = self.decode(ids)
        coll = is_collective(kind)
        chunk = np.where(coll, 0, self.chunk_of[np.where(coll, 0, stage)])
        stage = self.worker_stage(kind, stage)
        names = KIND_NAMES
        return [Op(names[k], p, s, None if m < 0 else m, c)
                for k, p, s, m, c in zip(kind.tolist(), pipe.tolist(), stage.tolist(),
                                         mb.tolist(), chunk.tolist())]

    def id_of(self, op: Op) -> int:
        """The id of `op` (fields already checked against the job's shape)."""
        code = KIND_CODES[op.kind]
        if code == AR:
            return self.allreduce(op.pipeline, op.stage)
        if code == OPT:
            return self.optimizer(op.pipeline, op.stage)
        return self.compute(code, op.pipeline, int(self.vstage_of[op.stage, op.chunk]),
                            op.microbatch)
