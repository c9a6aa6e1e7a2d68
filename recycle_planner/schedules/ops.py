"""Operations as small values, and the integer id space the fast paths use.

An `Op` is what a plan file and a person read: (kind, pipeline, stage, micro-batch), where the
pipeline is the micro-batch's own pipeline (a re-routed op runs on another pipeline's worker).
Arrays index ops by an integer id computed from those four fields, so that dependencies are
arithmetic (the forward that feeds F(d, s, m) is F(d, s-1, m)) rather than dictionary lookups.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

F, I, W, B, AR, OPT = range(6)
KIND_NAMES = ("F", "I", "W", "B", "ALLREDUCE", "OPTIMIZER")
# What each kind is, for legends.
KIND_TITLES = ("forward", "input gradient", "weight gradient", "full backward (I+W)",
               "gradient all-reduce", "optimizer step")
KIND_CODES = {name: code for code, name in enumerate(KIND_NAMES)}
COMPUTE_KINDS = 4


class Op(NamedTuple):
    """One operation of one iteration. `microbatch` is None for ALLREDUCE and OPTIMIZER, whose
    `pipeline` is the worker's own."""

    kind: str
    pipeline: int
    stage: int
    microbatch: int | None

    def __str__(self) -> str:
        if self.microbatch is None:
            return f"{self.kind}(stage {self.stage}, pipeline {self.pipeline})"
        return f"{self.kind}(p{self.pipeline} s{self.stage} mb{self.microbatch})"


Worker = tuple[int, int]
"""(pipeline, stage): the unit that fails."""


class OpSpace:
    """Integer ids for every op a job of this shape can have in one iteration.

    Compute ops: id = ((kind * D + d) * S + s) * M + m for kind in F, I, W, B.
    Collectives: ALLREDUCE of worker (d, s) is 4DSM + d*S + s, OPTIMIZER is 4DSM + DS + d*S + s.
    """

    def __init__(self, stages: int, pipelines: int, microbatches: int):
        self.S, self.D, self.M = stages, pipelines, microbatches
        self.n_compute = COMPUTE_KINDS * pipelines * stages * microbatches
        self.size = self.n_compute + 2 * pipelines * stages

    def compute(self, kind, d, s, m):
        return ((kind * self.D + d) * self.S + s) * self.M + m

    def allreduce(self, d, s):
        return self.n_compute + d * self.S + s

    def optimizer(self, d, s):
        return self.n_compute + self.D * self.S + d * self.S + s

    def decode(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(kind, pipeline, stage, microbatch) arrays for an array of ids; microbatch -1 for
        collectives."""
        ids = np.asarray(ids, dtype=np.int64)
        kind = np.empty_like(ids)
        pipe = np.empty_like(ids)
        stage = np.empty_like(ids)
        mb = np.full_like(ids, -1)
        comp = ids < self.n_compute
        c = ids[comp]
        mb[comp] = c % self.M
        c = c // self.M
        stage[comp] = c % self.S
        c = c // self.S
        pipe[comp] = c % self.D
        kind[comp] = c // self.D
        coll = ~comp
        k = ids[coll] - self.n_compute
        kind[coll] = np.where(k < self.D * self.S, AR, OPT)
        k = k % (self.D * self.S)
        pipe[coll] = k // self.S
        stage[coll] = k % self.S
        return kind, pipe, stage, mb

    def to_op(self, op_id: int) -> Op:
        kind, pipe, stage, mb = (int(x[0]) for x in self.decode(np.array([op_id])))
        return Op(KIND_NAMES[kind], pipe, stage, None if mb < 0 else mb)

    def to_ops(self, ids: np.ndarray) -> list[Op]:
        kind, pipe, stage, mb = self.decode(ids)
        names = KIND_NAMES
        return [Op(names[k], p, s, None if m < 0 else m)
                for k, p, s, m in zip(kind.tolist(), pipe.tolist(), stage.tolist(), mb.tolist())]

    def id_of(self, op: Op) -> int:
        code = KIND_CODES[op.kind]
        if code == AR:
            return self.allreduce(op.pipeline, op.stage)
        if code == OPT:
            return self.optimizer(op.pipeline, op.stage)
        return self.compute(code, op.pipeline, op.stage, op.microbatch)
