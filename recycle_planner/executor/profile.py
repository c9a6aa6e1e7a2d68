"""Measure a job's stages with the executor's own handlers and write the spec the planner reads.

The planner is only as good as its costs, and a cost measured on other code than the code that
runs is a guess: `profile_stages` builds each stage as a worker does (`Job.build_stage`,
`Job.build_state`: the optimizer and the LR scheduler, `StageState` with the undo copy where
the run keeps it) and runs one micro-batch through `StageRuntime`'s handlers, F, I, W,
ALLREDUCE and OPTIMIZER, exactly as `run_iteration` issues them: the job's `autocast` and
`step_hook`, the gradient buckets, the undo copy and the scheduler are measured as they run.
The only stand-in is the process groups (`LoopbackComm`): stage s receives the bytes stage s-1
sent, and a gradient of ones from downstream; collectives complete at once. Communication is
measured on its own, between local gloo processes (`measure_comm`), as the workers talk.

Per stage: the median of several repeats (after a warm-up) of F, I, W and the optimizer step,
and their spread; activation memory (what autograd saves in one forward, found with
saved-tensor hooks, plus the stage's input and output); the static memory's parts
(`job.profiler.StageProfile`); on a CUDA device, NCCL's own memory (`nccl_memory`). The spec
itself is assembled, without torch, by `job.profiler.job_spec`.

`recycle-planner profile JOB --pipelines D --microbatches M -o job.toml` writes the result.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from recycle_planner.errors import RecycleError
from recycle_planner.executor.config import BUCKET_MB, UNDO_COPY
from recycle_planner.executor.data.boundary import Layout, call, flat, layout_of, pack, unpack
from recycle_planner.executor.data.runtime import POST, RUN, SEND, Instr, Issue, Program, \
    StageRuntime
from recycle_planner.executor.data.shapes import largest
from recycle_planner.executor.data.state import StageState
from recycle_planner.executor.faults import FaultInjector
from recycle_planner.job.profiler import (MIN_MS, Measured, StageProfile, job_spec,
                                          nccl_estimate, spread)
from recycle_planner.job.spec import JobSpec

log = logging.getLogger(__name__)

ACT, GRAD = 1, 2
"""The loopback's tags: an activation from upstream, a gradient from downstream."""


def usable_device(device: str) -> torch.device:
    """`torch.device(device)`, or a one-line error if this torch cannot use it."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise RecycleError(f"unknown device {device!r} (expected cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RecycleError(f"device {device!r}: this torch has no usable CUDA device "
                               f"(torch {torch.__version__}); profile on cpu or on a GPU machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RecycleError(f"device {device!r}: only {torch.cuda.device_count()} CUDA "
                               f"device(s) here")
    elif dev.type != "cpu":
        raise RecycleError(f"device {device!r}: the profiler measures cpu or cuda devices")
    return dev


class _Done:
    """A work that completed at once, without an error."""

    def is_completed(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def wait(self, timeout: Any = None) -> bool:
        return True


class LoopbackComm:
    """`Comm` for one stage measured alone: a receive reads what `inbox` holds for its tag, a
    send leaves its bytes in `outbox`, every collective completes at once (`stage_group` and
    `size` as the run's, so that the buckets are armed and the undo copy taken as in it);
    the all-stage sum of a step hook is this stage's own value."""

    def __init__(self, size: int, peers: bool, device: torch.device):
        self.size = size
        self.stage_group = object() if peers else None
        self.device = device
        self.inbox: dict[int, torch.Tensor] = {}
        self.outbox: dict[int, torch.Tensor] = {}
        self.waited = 0.0

    def irecv(self, buf: torch.Tensor, src: int, tag: int) -> _Done:
        data = self.inbox[tag]
        buf[:data.numel()].copy_(data)
        return _Done()

    def isend(self, buf: torch.Tensor, dst: int, tag: int) -> _Done:
        self.outbox[tag] = buf.clone()
        return _Done()

    def sent(self, work: Any) -> bool:
        return True

    def wait(self, work: Any, what: str = "operation", gated: bool = True) -> None:
        pass

    def confirm(self, works: Any, what: str, synchronize: bool = True) -> None:
        pass

    def confirm_received(self, what: str) -> None:
        pass

    def allreduce_start(self, flat_: torch.Tensor, what: str) -> _Done:
        return _Done()

    def all_stages_start(self, value: torch.Tensor):
        return _Done(), value.detach().to(self.device).clone()

    def all_stages_sum(self, value: torch.Tensor) -> torch.Tensor:
        return self.all_stages_start(value)[1]


def one_microbatch(first: bool, last: bool, key: tuple[int, int, int]) -> Program:
    """A program of one micro-batch, as the planner's programs issue it: F (its input
    received first, its output sent after), I (the gradient received, the input gradient
    sent), W (which starts the stage's all-reduce), ALLREDUCE, OPTIMIZER."""
    _, pipeline, microbatch = key
    src = None if first else 0
    dst = None if last else 0
    instrs = (Instr("F", pipeline, microbatch, src, (ACT, ACT), dst, (ACT, ACT), "F0"),
              Instr("I", pipeline, microbatch, dst, (GRAD, GRAD), src, (GRAD, GRAD), "I0"),
              Instr("W", pipeline, microbatch, None, (0, 0), None, (0, 0), "W0"),
              Instr("ALLREDUCE", pipeline, None, None, (0, 0), None, (0, 0), "allreduce"),
              Instr("OPTIMIZER", pipeline, None, None, (0, 0), None, (0, 0), "optimizer"))
    issues = ([] if first else [Issue(POST, 0)]) + [Issue(RUN, 0)] + \
        ([] if last else [Issue(SEND, 0), Issue(POST, 1)]) + [Issue(RUN, 1)] + \
        ([] if first else [Issue(SEND, 1)]) + [Issue(RUN, 2), Issue(RUN, 3), Issue(RUN, 4)]
    return Program(instrs, tuple(issues), pipeline, True, 2)


def profile_stages(job, device: str = "cpu", repeats: int = 10, warmup: int = 2,
                   pipelines: int = 2, microbatches: int = 1, undo_copy: str = UNDO_COPY,
                   bucket_mb: float = BUCKET_MB) -> list[StageProfile]:
    """Profile every stage of `job` on one micro-batch (iteration 0, pipeline 0, micro-batch
    0; with `Job.dynamic`, the largest of the first micro-batches) on `device`, through the
    runtime's handlers (the module's docstring); `pipelines`, `microbatches`: the run's D and
    M (the loss scale, whether the stage has peers)."""
    dev = usable_device(device)
    key = largest(job.dynamic)
    S = len(job.stages)
    autocast = job.autocast_dtype()
    sent: torch.Tensor | None = None  # what the previous stage sent: this one's input
    in_layout: Layout | None = None
    out = []
    for s in range(S):
        first, last = s == 0, s == S - 1
        module = job.build_stage(s).to(dev)
        optimizer, scheduler = job.build_state(module)
        state = StageState(module, optimizer, scheduler=scheduler, undo_copy=undo_copy)
        comm = LoopbackComm(pipelines * S, pipelines > 1, dev)
        out_layout = None if last else sent_layout(job, module, key, in_layout, sent, dev,
                                                      autocast)
        if not first:
            comm.inbox[ACT] = sent
        if not last:
            comm.inbox[GRAD] = gradient_of_ones(out_layout.grads(), dev)
        runtime = StageRuntime(state, job.loss_fn, job.data, s, S, pipelines, microbatches,
                               dev, in_layout, out_layout, job.step_hook, autocast,
                               bucket_mb=bucket_mb)
        runtime.comm = comm
        times = _timed(runtime, dev)
        program = one_microbatch(first, last, key)
        faults = FaultInjector([], 0, 0, log.info)
        for r in range(warmup + repeats):
            if r == warmup:
                for samples in times.values():
                    samples.clear()
            runtime.run_iteration(program, key[0], threading.Event(), faults)
        activation = _activation_bytes(runtime, program, key[0], faults)
        params = state.params
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        opt_bytes = sum(v.numel() * v.element_size()
                        for st in state.optimizer.state.values() for v in st.values()
                        if isinstance(v, torch.Tensor))
        bucket_bytes = sum(f.numel() * f.element_size() for f in runtime.buckets.flats
                           if f is not None)
        out.append(StageProfile(
            forward=_ms(times["F"]), backward_input=_ms(times["I"]),
            backward_weight=_ms(times["W"]), optimizer=_ms(times["OPTIMIZER"]),
            activation=activation,
            static=2 * param_bytes + bucket_bytes + opt_bytes,  # params, grads; buckets; state
            output_bytes=0 if last else out_layout.nbytes, grad_bytes=param_bytes,
            undo_bytes=param_bytes + opt_bytes,
            input_bytes=0 if first else in_layout.nbytes,
            spread={k: spread(times[kind]) for k, kind in
                    (("F", "F"), ("I", "I"), ("W", "W"), ("optimizer", "OPTIMIZER"))}))
        sent, in_layout = comm.outbox.get(ACT), out_layout
        log.info("stage %d: F %.4f ms, I %.4f ms, W %.4f ms, activation %d B", s,
                 out[-1].forward, out[-1].backward_input, out[-1].backward_weight, activation)
    return out


def sent_layout(job, module: torch.nn.Module, key: tuple[int, int, int],
                   in_layout: Layout | None, received: torch.Tensor | None, dev: torch.device,
                   autocast: torch.dtype | None) -> Layout:
    """What the stage sends for the profiled micro-batch (one forward without gradients, in
    the run's precision)."""
    if in_layout is None:
        value = pytree.tree_map(lambda v: v.to(dev) if isinstance(v, torch.Tensor) else v,
                                job.data(*key)[0])
    else:
        value = pytree.tree_unflatten(unpack(received, in_layout), in_layout.spec)
    context = torch.autocast(dev.type, dtype=autocast) if autocast is not None \
        else contextlib.nullcontext()
    with torch.no_grad(), context:
        return layout_of(call(module, value))


def gradient_of_ones(layout: Layout, dev: torch.device) -> torch.Tensor:
    """A message of `layout` whose every leaf is ones (the gradient from downstream)."""
    buf = torch.empty(max(layout.nbytes, 1), dtype=torch.uint8, device=dev)
    return pack([torch.ones(x.shape, dtype=x.dtype, device=dev) for x in layout.leaves],
                layout, buf)


def _timed(runtime: StageRuntime, dev: torch.device) -> dict[str, list[float]]:
    """Wrap each handler of `runtime` to record its seconds per call (the device
    synchronised before and after), by op kind."""
    times: dict[str, list[float]] = {kind: [] for kind in runtime.handlers}
    for kind, handler in list(runtime.handlers.items()):
        def timed(k: int, ins: Instr, iteration: int, handler=handler, kind=kind) -> None:
            t0 = _now(dev)
            handler(k, ins, iteration)
            times[kind].append(_now(dev) - t0)
        runtime.handlers[kind] = timed
    return times


def _activation_bytes(runtime: StageRuntime, program: Program, iteration: int,
                      faults: FaultInjector) -> int:
    """Bytes of distinct storages autograd saves in one forward of the stage (parameters
    excluded: they are static memory), plus its output's leaves and (after stage 0) its
    received input's, which the runtime keeps until the micro-batch's weight gradient. One
    more iteration, with the F handler run under saved-tensor hooks."""
    seen: dict[Any, int] = {}
    static = {(p.untyped_storage().data_ptr(), p.device) for p in runtime.state.params}

    def keep(t: torch.Tensor) -> torch.Tensor:
        try:
            key = (t.untyped_storage().data_ptr(), t.device)
            if key not in static:
                seen[key] = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage
            seen[id(t)] = t.numel() * t.element_size()
        return t

    forward = runtime.handlers["F"]

    def hooked(k: int, ins: Instr, it: int) -> None:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            forward(k, ins, it)
        inputs, outputs = runtime.cache[(ins.pipeline, ins.microbatch)]
        for t in list(outputs) + list(inputs):
            seen.setdefault((t.untyped_storage().data_ptr(), t.device),
                            t.untyped_storage().nbytes())

    runtime.handlers["F"] = hooked
    try:
        runtime.run_iteration(program, iteration, threading.Event(), faults)
    finally:
        runtime.handlers["F"] = forward
    return int(sum(seen.values()))


def _now(dev: torch.device) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


def _ms(samples: list[float]) -> float:
    return max(MIN_MS, statistics.median(samples) * 1e3)


# -- NCCL's own memory -------------------------------------------------------------------------

def nccl_memory(device: str, stages: int, pipelines: int, scalars: bool) -> list[int]:
    """NCCL's own device bytes per stage's worker: on a CUDA job the documented estimate
    (`job.profiler.nccl_estimate`; one process on one GPU cannot make the communicators of a
    run, and the device's used memory mixes in the CUDA context: `benchmarks/gpu_check.py`
    records a worker's whole device memory instead); nothing on CPU (gloo keeps no device
    buffers)."""
    if not device.startswith("cuda"):
        return [0] * stages
    return [nccl_estimate(s, stages, pipelines, scalars).total for s in range(stages)]


# -- communication -----------------------------------------------------------------------------

def measure_comm(p2p_bytes: list[int], allreduce_bytes: list[int], ranks: int,
                 repeats: int = 20, timeout: float = 120.0,
                 wrap: Callable[[list[str]], list[str]] | None = None,
                 ) -> tuple[list[Measured], list[Measured]]:
    """One-way time (ms) of a message of each size in `p2p_bytes`, and time of an all-reduce
    of each size in `allreduce_bytes` among `ranks` processes, each with its spread, on local
    gloo processes (as the executor's workers on this machine talk). `wrap` rewrites each
    process's command (to start it under the same CPU quota as the workers, for example)."""
    import torch.distributed as dist

    ranks = max(2, ranks)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    job = json.dumps({"p2p": p2p_bytes, "allreduce": allreduce_bytes, "repeats": repeats,
                      "ranks": ranks, "port": store.port})
    env = dict(os.environ, OMP_NUM_THREADS="1")
    wrap = wrap or list
    procs = [subprocess.Popen(wrap([sys.executable, "-c", _COMM_CHILD, str(r), job]), env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for r in range(ranks)]
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise RecycleError(f"measuring communication failed: "
                                   f"{err.decode(errors='replace').strip()[-300:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    result = json.loads(store.get("result"))
    return ([Measured.of(x) for x in result["p2p"]],
            [Measured.of(x) for x in result["allreduce"]])


_COMM_CHILD = r"""
import json, statistics, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
rank, job = int(sys.argv[1]), json.loads(sys.argv[2])
torch.set_num_threads(1)
store = dist.TCPStore("127.0.0.1", job["port"], is_master=False, timeout=timedelta(seconds=60))
pg = dist.ProcessGroupGloo(dist.PrefixStore("comm", store), rank, job["ranks"],
                           timedelta(seconds=60))
n = job["repeats"]
p2p, ar = [], []
for size in job["p2p"]:
    t = torch.zeros(max(1, size // 4))
    samples, sends = [], []
    for i in range(n + 3):
        pg.barrier().wait()
        if rank == 0:
            r = pg.recv([t], 1, 1)
            t0 = time.perf_counter()
            sends.append(pg.send([t], 1, 0))
            r.wait()
            samples.append((time.perf_counter() - t0) / 2)
        elif rank == 1:
            r = pg.recv([t], 0, 0)
            r.wait()
            sends.append(pg.send([t], 0, 1))
    for w in sends:
        w.wait()
    p2p.append(samples[3:] if rank == 0 else [0.0])
for size in job["allreduce"]:
    t = torch.zeros(max(1, size // 4))
    samples = []
    for i in range(n + 3):
        pg.barrier().wait()
        t0 = time.perf_counter()
        pg.allreduce([t]).wait()
        samples.append(time.perf_counter() - t0)
    ar.append(samples[3:])
if rank == 0:
    store.set("result", json.dumps({"p2p": p2p, "allreduce": ar}))
pg.barrier().wait()
import os
os._exit(0)  # skip the group's teardown, which races with the peers' exits
"""


# -- the spec ----------------------------------------------------------------------------------

def profile_job(job, pipelines: int, microbatches: int, name: str | None = None,
                device: str = "cpu", repeats: int = 10, warmup: int = 2,
                memory_budget: float | None = None, p2p: float | None = None,
                allreduce: float | None = None, measure_communication: bool = True,
                wrap: Callable[[list[str]], list[str]] | None = None,
                undo_copy: str = UNDO_COPY, bucket_mb: float = BUCKET_MB,
                ) -> tuple[JobSpec, list[StageProfile]]:
    """The job spec of `job` on this machine with D = `pipelines` and M = `microbatches`.

    Communication is measured on CPU unless `p2p` / `allreduce` (ms) are given or
    `measure_communication` is off (then it counts as 0). The memory budget is `memory_budget`
    bytes, else the GPU's memory, else this machine's memory shared by its D*S workers.
    `wrap` rewrites the command of each communication-measuring process (`measure_comm`).
    `undo_copy` is where the run keeps the step-undo copy (`executor/config.py`'s
    UNDO_PLACES): on the device, it is one more copy of the parameters and optimizer state in
    the static memory."""
    if pipelines < 1 or microbatches < 1:
        raise RecycleError("pipelines and microbatches must be at least 1")
    stages = profile_stages(job, device, repeats, warmup, pipelines, microbatches, undo_copy,
                            bucket_mb)
    S = len(stages)
    p2p_ms = [float(p2p)] * S if p2p is not None else [0.0] * S
    ar_ms = [float(allreduce)] * S if allreduce is not None else [0.0] * S
    p2p_got: list[Measured] = []
    ar_got: list[Measured] = []
    if measure_communication and (p2p is None or allreduce is None) and \
            not device.startswith("cuda"):
        # A stage sends its output downstream and its input gradient upstream.
        sizes = [max(st.output_bytes, st.input_bytes) for st in stages]
        p2p_got, ar_got = measure_comm(sizes if p2p is None and S > 1 else [],
                                       [st.grad_bytes for st in stages]
                                       if allreduce is None and pipelines > 1 else [],
                                       ranks=min(pipelines, 8), repeats=max(repeats, 10),
                                       wrap=wrap)
    budget = memory_budget if memory_budget is not None else _device_memory(device,
                                                                            pipelines * S)
    x = flat(job.data(0, 0, 0)[0])[0]
    return job_spec(stages, pipelines, microbatches, p2p_ms, ar_ms, p2p_got, ar_got, budget,
                    int(x.shape[0]) if x.ndim else 1, name, undo_copy == "device",
                    nccl_memory(device, S, pipelines, job.step_hook is not None))


def _device_memory(device: str, workers: int) -> float:
    if device.startswith("cuda"):
        return float(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 * 2**30
    return float(total // max(1, workers))
