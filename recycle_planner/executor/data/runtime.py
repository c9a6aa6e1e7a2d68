"""One worker's program, bound to a generation once, run through a dispatch table.

The planner compiles the worker's program (`recycle_planner.programs`: its ops, the physical
ranks it receives from and sends to, every message in an order NCCL cannot deadlock on, with
receives posted early so that data lands while the worker computes); `bind` only renames the
peers as ranks of the generation's group and gives every message its tags. Then
`StageRuntime.run_iteration` executes it: every op kind has one handler (`handlers`), sends
and receives are issued in the program's order; sends never block.

Backward passes reuse torch's pipelining helpers: `stage_backward_input` (I: the gradient of
the stage input, sent upstream at once, keeping what W needs), `stage_backward_weight` (W: the
weight gradient, later), `stage_backward` (B: both). Stage 0 has no input gradient, so its I
only keeps the incoming gradient and its W runs the whole backward, as torch's runtime does.
Every micro-batch loss is scaled by 1/(D*M) and the stage's gradients are all-reduced with SUM
among its live workers: the step is the same however the micro-batches are spread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
from torch.utils import _pytree as pytree
from torch.utils._pytree import tree_map
from torch.distributed.pipelining._backward import (stage_backward, stage_backward_input,
                                                     stage_backward_weight)

from recycle_planner.errors import RecycleError
from recycle_planner import programs
from recycle_planner.executor.config import BUCKET_MB
from recycle_planner.executor.data.boundary import (Layout, agreed_at_start, call, flat, pack,
                                                    prefix, unpack)
from recycle_planner.executor.data.buckets import GradBuckets
from recycle_planner.executor.data.comm import Comm, PeerFailure
from recycle_planner.executor.data.hooks import validates
from recycle_planner.executor.data.pool import BufferPool, SendPool
from recycle_planner.executor.data.shapes import DynamicDims
from recycle_planner.executor.data.state import StageState
from recycle_planner.executor.data.validation import PostValidation, Settled
from recycle_planner.executor.faults import FaultInjector

log = logging.getLogger(__name__)

KINDS = ("F", "I", "W", "B", "ALLREDUCE", "OPTIMIZER")
SETTLED = ("VALIDATE", "REDO", "LATE")
"""Steps of a post-validated hook (`validation.py`) validated, those of them redone because
the guess was wrong, and those taken only once the sum arrived (no guess): counted in
`op_times` with the seconds their validation took, waits for the sum included (inside the op
that validated them, usually the iteration's first F)."""


def new_op_times() -> dict[str, list[float]]:
    """Per op kind: [count, seconds, seconds of own work] (see `StageRuntime.op_times`)."""
    return {kind: [0, 0.0, 0.0] for kind in KINDS + SETTLED}


POINTS = {"ALLREDUCE": "allreduce", "OPTIMIZER": "optimizer"}
"""Fault-injection point names of the collectives (compute ops are named F0, I2, ...)."""


POST, RUN, SEND = "recv", "run", "send"


class Issue(NamedTuple):
    """One step of a worker's iteration: post the receive of instruction `instr`, run it, or
    send its output."""

    kind: str
    instr: int


class Instr(NamedTuple):
    kind: str
    pipeline: int
    microbatch: int | None
    src: int | None            # group rank to receive from
    recv_tags: tuple[int, int]  # by iteration parity
    dst: int | None            # group rank to send to
    send_tags: tuple[int, int]
    point: str                 # fault-injection point name, e.g. "F2"


@dataclass(frozen=True)
class Program:
    instrs: tuple[Instr, ...]
    issues: tuple[Issue, ...]   # one iteration's receives, ops and sends in issue order
    logical: int                # the logical pipeline this worker plays
    stagger: bool
    launch: int                 # the op during which the gradient all-reduce starts


COLLECTIVES = {programs.AllReduce: "ALLREDUCE", programs.Optimizer: "OPTIMIZER"}


def bind(program: programs.Program, members: list[int]) -> Program:
    """`program` (the planner's, in physical ranks) in the generation's terms: one instruction
    per op, peers as ranks of the generation's group (a global rank's index in `members`),
    tags that keep two consecutive iterations apart."""
    group_rank = {r: i for i, r in enumerate(members)}
    stride = program.tag_stride
    ops = [a for a in program.actions if not isinstance(a, programs.Message)]
    op_of = {(a.consumes, a.pipeline, a.microbatch, a.chunk): k for k, a in enumerate(ops)
             if isinstance(a, programs.Compute) and a.consumes}
    messages: dict[tuple[bool, int], programs.Message] = {}  # (received?, op) -> message
    issues, launch, k, launch_action = [], -1, 0, program.launch
    for j, action in enumerate(program.actions):
        if isinstance(action, programs.Message):
            op = op_of[(action.what, action.pipeline, action.microbatch, action.chunk)]
            received = isinstance(action, programs.Recv)
            messages[received, op] = action
            issues.append(Issue(POST if received else SEND, op))
            continue
        if j == launch_action:
            launch = k
        issues.append(Issue(RUN, k))
        k += 1

    def peer(message: programs.Message | None) -> int | None:
        if message is None:
            return None
        if message.peer not in group_rank:
            raise RecycleError(f"rank {program.rank}'s program exchanges {message.what}s with "
                               f"rank {message.peer}, which is not a member of the generation")
        return group_rank[message.peer]

    def tags(message: programs.Message | None) -> tuple[int, int]:
        return (0, 0) if message is None else (message.tag, message.tag + stride)

    instrs, counts = [], {}
    for k, op in enumerate(ops):
        kind = COLLECTIVES.get(type(op)) or op.kind
        recv, send = messages.get((True, k)), messages.get((False, k))
        index = counts.get(kind, 0)
        counts[kind] = index + 1
        compute = isinstance(op, programs.Compute)
        instrs.append(Instr(kind, op.pipeline if compute else program.plays,
                            op.microbatch if compute else None, peer(recv), tags(recv),
                            peer(send), tags(send), POINTS.get(kind) or f"{kind}{index}"))
    return Program(tuple(instrs), tuple(issues), program.plays, not program.barrier, launch)


class StageRuntime:
    """One worker's stage: its module and state, the per-iteration caches, the op handlers.

    `in_layout` / `out_layout` describe what the stage receives and sends (None at the ends);
    receive buffers come from a pool reused once nothing references them, send buffers from
    one reused once their send completed (`pool.py`: as many as are in flight). With `dims`
    (`shapes.DynamicDims`) the layouts are symbolic: each message's is resolved with the sizes
    of its micro-batch, on both ends alike, and a buffer grows to the largest message seen
    (fixed-shape jobs take none of this path). `hook` (a `StepHook`) runs between the
    gradient all-reduce and the optimizer step with the sum of every stage's `stats`
    (`all_stages_sum`), or, for a `hooks.Validated` one, is checked after a step taken
    without waiting (`validation`); `autocast` is the dtype of mixed-precision forwards;
    `bucket_mb` the size of the gradient all-reduce's buckets (`buckets.GradBuckets`)."""

    def __init__(self, state: StageState, loss_fn: Callable, data: Callable, stage: int,
                 stages: int, pipelines: int, microbatches: int, device: torch.device,
                 in_layout: Layout | None, out_layout: Layout | None,
                 hook: Any = None, autocast: torch.dtype | None = None,
                 dims: DynamicDims | None = None, bucket_mb: float = BUCKET_MB):
        self.state = state
        self.module = state.module
        self.loss_fn = loss_fn
        self.data = data
        self.stage = stage
        self.first = stage == 0
        self.last = stage == stages - 1
        self.scale = 1.0 / (pipelines * microbatches)
        self.microbatches = microbatches
        self.loss_count = pipelines * microbatches
        self.device = device
        self.in_layout = in_layout
        self.out_layout = out_layout
        self.hook = hook
        self.autocast = autocast
        self.dims = dims
        self.resolved: dict[tuple, Layout] = {}
        """Concrete layouts by role and dynamic sizes: messages repeat a few lengths."""
        self.in_grads = in_layout.grads() if in_layout is not None else None
        self.out_grads = out_layout.grads() if out_layout is not None else None
        self.recv_pool = BufferPool(device)
        """Receive buffers, reused once nothing references them (`pool.py`)."""
        self.send_pool = SendPool(device)
        """Send buffers, reused once their send is known complete (`Comm.sent`)."""
        self.comm: Comm | None = None
        self.op_started: float | None = None
        """time.monotonic() when the running op began (None between iterations): with
        `Comm.waited`, how the heartbeat thread tells a stalled training thread."""
        self.on_step: Callable[[int, dict[tuple[int, int], float]], None] | None = None
        self.losses: dict[tuple[int, int], torch.Tensor] = {}
        """The last stage's micro-batch losses of the running iteration, kept on the device."""
        self.all_losses: torch.Tensor | None = None
        """All D*M losses of the iteration once the stage's all-reduce is done (last stage)."""
        self.loss_work: Any = None
        """The pending all-reduce of `all_losses`."""
        self.buckets = GradBuckets(state.params, bucket_mb)
        self.on_counted: Callable[[int], None] = lambda iteration: None
        """Told the iteration of every step counted (the fault injector's after-step)."""
        self.validation = PostValidation(hook, stage, state, lambda i: self.on_counted(i)) \
            if validates(hook) else None
        """The step taken before its hook's sum was known, until validated."""
        self.launch_at = -1
        """The running program's `launch`: the op that starts the gradient all-reduce."""
        self.reset()
        self.op_times: dict[str, list[float]] = new_op_times()
        """Per op kind: how many ran, the seconds they took (waits for data included) and the
        seconds from their last wait for a peer to their end (their own work)."""
        self.handlers: dict[str, Callable[[int, Instr, int], None]] = {
            "F": self.forward, "I": self.backward_input, "W": self.backward_weight,
            "B": self.backward, "ALLREDUCE": self.allreduce, "OPTIMIZER": self.optimizer_step,
        }

    def reset(self) -> None:
        """Forget everything of an abandoned iteration (activations, saved graphs, gradients)."""
        self.cache: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.saved: dict[tuple[int, int], Any] = {}
        self.posted: dict[int, tuple[Any, torch.Tensor, Layout]] = {}
        self.outgoing: dict[int, list[torch.Tensor | None]] = {}
        self.send_pool.clear()  # a new generation: a broken group's pending operations
        self.recv_pool.clear()  # must not touch the next one's buffers
        self.losses = {}
        self.all_losses = None
        self.loss_work = None
        self.op_started = None
        self.buckets.reset()
        if self.validation is not None:
            self.validation.detach()
        if self.pending_step() is None:  # else its gradients stay until it is settled
            self.state.clear_grads()

    def pending_step(self) -> int | None:
        """The iteration of the step taken but not yet validated, if any."""
        pending = self.validation.pending if self.validation is not None else None
        return pending.iteration if pending is not None else None

    # -- the loop ----------------------------------------------------------------------------

    def run_iteration(self, program: Program, iteration: int, abort: threading.Event,
                      faults: FaultInjector) -> None:
        instrs = program.instrs
        handlers = self.handlers
        times = self.op_times
        clock = time.monotonic  # the clock of Comm.waited
        self.posted = {}
        self.outgoing = {}
        self.losses = {}
        self.all_losses = None
        self.launch_at = program.launch
        for kind, k in program.issues:
            ins = instrs[k]
            if kind == POST:
                self._post(ins, k, iteration)
                continue
            if kind == SEND:
                self._send(self.outgoing.pop(k), ins, k, iteration)
                continue
            if abort.is_set():
                raise PeerFailure("the launcher abandoned this generation")
            self.op_started = time.monotonic()
            if faults.active:
                faults.trigger(iteration, ins.point)
            t0 = clock()
            handlers[ins.kind](k, ins, iteration)
            t1 = clock()
            spent = times[ins.kind]
            spent[0] += 1
            spent[1] += t1 - t0
            spent[2] += t1 - max(t0, self.comm.waited)
        self.op_started = None
        if faults.active:
            faults.trigger(iteration, "step")

    def _layout(self, role: str, ins: Instr, iteration: int):
        """The concrete layout of one message of `ins` (`role`: the attribute holding its
        layout), and a function saying where it comes from (for errors)."""
        layout = getattr(self, role)
        if not layout.dynamic:
            return layout, agreed_at_start
        sizes = self.dims.of(iteration, ins.pipeline, ins.microbatch)
        key = (role, *sizes.values())
        concrete = self.resolved.get(key)
        if concrete is None:
            concrete = self.resolved[key] = layout.resolve(sizes)
        return concrete, lambda: (f"follows from the dynamic dims {sizes} of iteration "
                                  f"{iteration}, micro-batch {ins.microbatch} of pipeline "
                                  f"{ins.pipeline}")

    def _post(self, ins: Instr, k: int, iteration: int) -> None:
        layout, _ = self._layout("in_layout" if ins.kind == "F" else "out_grads", ins,
                                 iteration)
        buf = self.recv_pool.take(layout.nbytes)
        work = self.comm.irecv(buf, ins.src, ins.recv_tags[iteration % 2])
        self.posted[k] = (work, buf, layout)

    def _received(self, k: int, what: str) -> list[torch.Tensor]:
        work, buf, layout = self.posted.pop(k)
        self.comm.wait(work, what)
        return unpack(buf, layout)

    def _send(self, leaves: list[torch.Tensor | None], ins: Instr, k: int,
              iteration: int) -> None:
        layout, expected = self._layout("out_layout" if ins.kind == "F" else "in_grads", ins,
                                        iteration)
        i = self.send_pool.take(layout.nbytes, self.comm.sent)  # never waits on a send
        buf = self.send_pool.bufs[i]
        pack(leaves, layout, buf, expected)
        self.send_pool.busy(i, self.comm.isend(prefix(buf, layout.nbytes), ins.dst,
                                               ins.send_tags[iteration % 2]))

    def _forward_context(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    # -- handlers ----------------------------------------------------------------------------

    def forward(self, k: int, ins: Instr, iteration: int) -> None:
        self.validate()  # before the activation's wait: a redo overlaps it
        key = (ins.pipeline, ins.microbatch)
        sample = None
        if self.first:
            sample = self.data(iteration, *key)
            value = tree_map(lambda v: _to(v, self.device), sample[0])
            inputs: list[torch.Tensor] = []
        else:
            leaves = [x.detach().requires_grad_(x.dtype.is_floating_point)
                      for x in self._received(k, "receiving an activation")]
            value = pytree.tree_unflatten(leaves, self.in_layout.spec)
            inputs = [x for x in leaves if x.requires_grad]
        with self._forward_context():
            out = call(self.module, value)
        if self.last:
            target = (sample if sample is not None else self.data(iteration, *key))[1]
            loss = self.loss_fn(out, tree_map(lambda v: _to(v, self.device), target))
            self.losses[key] = loss.detach()
            outputs = [loss * self.scale]
        else:
            # torch's I detaches the outputs in place, which views forbid
            leaves = [x.clone() if x._is_view() else x for x in flat(out)]
            self.outgoing[k] = leaves
            outputs = [x for x in leaves if x.dtype.is_floating_point]
        self.cache[key] = (inputs, outputs)

    def _output_grads(self, k: int) -> list[torch.Tensor] | None:
        return None if self.last else self._received(k, "receiving a gradient")

    def backward_input(self, k: int, ins: Instr, iteration: int) -> None:
        key = (ins.pipeline, ins.microbatch)
        inputs, outputs = self.cache[key]
        grads = self._output_grads(k)
        if self.first:
            self.saved[key] = grads  # no input gradient to compute: W does the whole backward
            return
        dinputs, groups = stage_backward_input(outputs, grads, inputs, self.module.parameters())
        self.saved[key] = groups
        self.outgoing[k] = list(dinputs)

    def backward_weight(self, k: int, ins: Instr, iteration: int) -> None:
        key = (ins.pipeline, ins.microbatch)
        inputs, outputs = self.cache.pop(key)
        saved = self.saved.pop(key)
        armed = self._arm(k)
        if self.first:
            stage_backward(_graded(outputs, saved), saved, inputs)
        elif armed:
            self.buckets.backward_weight(self.module.parameters(), saved)
        else:
            stage_backward_weight(self.module.parameters(), saved)
        if k == self.launch_at:
            self._start_collectives()

    def backward(self, k: int, ins: Instr, iteration: int) -> None:
        key = (ins.pipeline, ins.microbatch)
        inputs, outputs = self.cache.pop(key)
        grads = self._output_grads(k)
        self._arm(k)
        grads = stage_backward(_graded(outputs, grads), grads, inputs)
        if k == self.launch_at:
            self._start_collectives()
        if not self.first:
            self.outgoing[k] = list(grads)

    def _arm(self, k: int) -> bool:
        """If op `k` makes the gradients final and the stage has peers: arm the buckets
        (each starts its all-reduce when complete) and say so."""
        if k != self.launch_at or self.comm.stage_group is None:
            return False
        self.buckets.arm(self.comm)
        return True

    def _start_collectives(self) -> None:
        """The gradients are final: start every bucket not started yet and, on the last
        stage, the loss all-reduce after them (so the order is the same on every rank)."""
        if self.comm.stage_group is not None:
            self.buckets.finish(self.comm)
        if self.last:
            self._gather_losses()

    def allreduce(self, k: int, ins: Instr, iteration: int) -> None:
        """Wait for the collectives started by the last gradient op (`buckets`), or start
        them here when the worker ran no W or B."""
        if k == self.launch_at:
            self._start_collectives()
        if self.loss_work is not None:
            work, self.loss_work = self.loss_work, None
            self.comm.wait(work, "loss all-reduce")
        if self.comm.stage_group is not None:
            self.buckets.wait()

    def _gather_losses(self) -> None:
        """Every last-stage worker learns all D*M losses of the iteration from the stage's
        all-reduce (each micro-batch's slot is filled by the one worker that ran it, zeros
        elsewhere, so the SUM is exact). A survivor can then report the losses of a peer
        that vanished after the all-reduce but before its own report reached the launcher:
        that iteration is never redone, so nobody else would."""
        values = torch.zeros(self.loss_count, dtype=torch.float64, device=self.device)
        if self.losses:
            keys = sorted(self.losses)
            index = torch.tensor([p * self.microbatches + m for p, m in keys],
                                 device=self.device)
            values[index] = torch.stack([self.losses[key] for key in keys]).to(torch.float64)
        self.all_losses = values  # summed in place by `loss_work`, waited for at ALLREDUCE
        if self.comm.stage_group is not None:
            self.loss_work = self.comm.allreduce_start(values, "loss all-reduce")

    def optimizer_step(self, k: int, ins: Instr, iteration: int) -> None:
        """The step gate first: the iteration's receives and the stage's all-reduces complete
        and error-free, the device
        done, the generation not abandoned (`Comm.confirm`); else `PeerFailure`, the step is
        neither taken nor counted and the iteration is redone. Every stage passes it before
        counting a step, so a stage's counted step i+1 implies the data of iteration i+1
        from its neighbours arrived, which they sent only after counting step i: no stage is
        ever more than one step ahead of another, what `decide` can undo."""
        self.validate()
        self.comm.confirm_received("the iteration's receives and all-reduces")
        if self.on_step is not None and self.all_losses is not None:
            values = self.all_losses.tolist()  # the iteration's one read of the losses
            M = self.microbatches
            self.on_step(iteration, {(i // M, i % M): v for i, v in enumerate(values)})
        if self.validation is not None and self.comm.size > 1:
            self.validation.begin(iteration, self.comm)  # counted when validated
            return
        apply = True
        if self.hook is not None:  # the barrier: wait for the sum
            params = self.state.params
            total = self.comm.all_stages_sum(self.hook.stats(self.stage, params))
            apply = self.hook.apply(self.stage, params, total) is not False
        self.state.step(apply, undoable=self.comm.size > 1)
        self.on_counted(iteration)

    def validate(self) -> None:
        """Validate the pending step, if any, before the parameters are read (the first F of
        the next iteration: every op of an iteration follows one of the worker's own F), or
        before the generation ends cleanly or a checkpoint is written."""
        if self.pending_step() is None:
            return
        t0 = time.monotonic()
        settled = self.validation.settle(self.comm)
        t1 = time.monotonic()
        self.count_settled(settled, t1 - t0, t1 - max(t0, self.comm.waited))

    def count_settled(self, settled: Settled, seconds: float, own: float) -> None:
        for kind, happened in zip(SETTLED, (settled.counted, settled.redone, settled.late)):
            if happened:
                spent = self.op_times[kind]
                spent[0] += 1
                spent[1] += seconds
                spent[2] += own


def _graded(outputs: list[torch.Tensor], grads: list | None):
    """What `stage_backward` differentiates: the loss itself at the last stage (no incoming
    gradient; torch skips a list whose gradients are None), else the list of outputs."""
    return outputs[0] if grads is None else outputs


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value
