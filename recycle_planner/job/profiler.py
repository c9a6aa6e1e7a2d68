"""Measure a job's stages on this machine and write the job spec the planner reads.

The planner is only as good as its costs. `profile_job` runs each of the user's stage modules
on one sample micro-batch and measures, per stage:

- forward (F), input-gradient backward (I) and weight-gradient backward (W) time, with the
  same torch helpers the executor runs (`stage_backward_input` / `stage_backward_weight`;
  stage 0 has no input gradient, so its I is nearly free and its W is the whole backward,
  exactly as the executor runs it), median of several repeats after a warm-up;
- activation memory: the bytes one in-flight micro-batch holds from its forward to its W
  (tensors autograd saves, found with saved-tensor hooks, plus the stage's input and output);
- static memory on the device: parameters, gradients, the gradient all-reduce's bucket
  buffers (one more copy of the gradients), the optimizer state, and the send buffers (one
  per sending op for the generation: M*(input + output bytes); receive buffers are pooled by
  what is in flight and counted with the activations); the copy
  the executor keeps to undo a step lives on the host (`--undo-copy host`, the default) and is
  not counted;
- the spread of every figure's repeats ((p90 - p10) / median), written into the spec's header
  and warned about above 50% (a busy machine);
- the optimizer step (with that copy), and on CPU the point-to-point time of the stage's
  output and the all-reduce of its gradients, measured between local gloo processes.

`recycle-planner profile JOB --pipelines D --microbatches M -o job.toml` writes the result as
a TOML spec (`load_spec` reads it back); then `recycle-planner plan-all job.toml` builds the
plan library the executor uses.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from recycle_planner.errors import RecycleError
from recycle_planner.io import atomic_write
from recycle_planner.job.spec import JobSpec

log = logging.getLogger(__name__)

MIN_MS = 1e-4
"""Floor of a measured time (the spec needs positive forward and input-backward times)."""


@dataclass(frozen=True)
class StageProfile:
    forward: float          # ms
    backward_input: float   # ms
    backward_weight: float  # ms
    optimizer: float        # ms
    activation: int         # bytes held per in-flight micro-batch
    static: int             # bytes held for the whole run
    output_bytes: int       # one micro-batch's output (the activation sent downstream)
    grad_bytes: int         # the stage's gradients (what the all-reduce moves)
    undo_bytes: int = 0     # the step-undo copy: parameters and optimizer state
    spread: dict[str, float] = field(default_factory=dict)
    """Per figure (F, I, W, optimizer, p2p, allreduce): the spread of its repeats, (90th
    percentile - 10th) / median; a large one says the machine was busy (`SPREAD_WARNING`)."""


def usable_device(device: str):
    """`torch.device(device)`, or a one-line error if this torch cannot use it."""
    import torch

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


def profile_stages(job, device: str = "cpu", repeats: int = 10,
                   warmup: int = 2) -> list[StageProfile]:
    """Profile every stage of `job` on one micro-batch (iteration 0, pipeline 0, micro-batch
    0; with `Job.dynamic`, the largest of the first micro-batches) on `device`. A stage may
    take and return a tensor or a tuple, list or dict of tensors, as in the executor
    (`executor/boundary.py`): its floating-point leaves get gradients."""
    import torch
    from torch.distributed.pipelining._backward import (stage_backward, stage_backward_input,
                                                         stage_backward_weight)
    from torch.utils import _pytree as pytree

    from recycle_planner.executor.data.boundary import call, flat, layout_of
    from recycle_planner.executor.data.shapes import largest
    from recycle_planner.executor.data.state import StageState

    dev = usable_device(device)

    def to_dev(v):
        return v.to(dev) if isinstance(v, torch.Tensor) else v

    x, target = job.data(*largest(job.dynamic))
    value = pytree.tree_map(to_dev, x)
    target = pytree.tree_map(to_dev, target)
    S = len(job.stages)
    out = []
    for s in range(S):
        module = job.build_stage(s).to(dev)
        params = [p for p in module.parameters() if p.requires_grad]
        first, last = s == 0, s == S - 1
        leaves, tree = pytree.tree_flatten(value)
        if not first:  # a received value: fresh leaves, the float ones differentiable
            leaves = [t.detach().requires_grad_(t.dtype.is_floating_point) for t in leaves]
        inp = pytree.tree_unflatten(leaves, tree)
        inputs = [] if first else [t for t in leaves if t.requires_grad]

        def forward():
            y = call(module, inp)
            return job.loss_fn(y, target) if last else y

        def differentiated(y) -> list:
            return [y] if last else [t for t in flat(y) if t.dtype.is_floating_point]

        times: dict[str, list[float]] = {"F": [], "I": [], "W": []}
        for r in range(warmup + repeats):
            keep = r >= warmup
            t0 = _now(dev)
            y = forward()
            t1 = _now(dev)
            outs = differentiated(y)
            grads = None if last else [torch.ones_like(t) for t in outs]
            if first:
                t2 = _now(dev)
                stage_backward(outs[0] if last else outs, grads, inputs)
                t3 = _now(dev)
            else:
                _, groups = stage_backward_input(outs, grads, inputs, module.parameters())
                t2 = _now(dev)
                stage_backward_weight(module.parameters(), groups)
                t3 = _now(dev)
            if keep:
                times["F"].append(t1 - t0)
                times["I"].append(t2 - t1)
                times["W"].append(t3 - t2)
            for p in params:
                p.grad = None
            for t in inputs:
                t.grad = None
        activation = _activation_bytes(forward, inputs, params)
        with torch.no_grad():
            y = call(module, inp)
        output_bytes = 0 if last else layout_of(y).nbytes
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        state = StageState(copy.deepcopy(module), None)
        state.optimizer = job.optimizer(state.module.parameters())
        step_times = []
        for r in range(warmup + repeats):
            for p in state.params:
                p.grad = torch.full_like(p, 1e-3)
            t0 = _now(dev)
            state.step()
            if r >= warmup:
                step_times.append(_now(dev) - t0)
        opt_bytes = sum(v.numel() * v.element_size()
                        for st in state.optimizer.state.values() for v in st.values()
                        if isinstance(v, torch.Tensor))
        out.append(StageProfile(
            forward=_ms(times["F"]), backward_input=_ms(times["I"]),
            backward_weight=_ms(times["W"]), optimizer=_ms(step_times),
            activation=activation,
            static=3 * param_bytes + opt_bytes,  # params, grads, buckets; the state
            output_bytes=output_bytes, grad_bytes=param_bytes, undo_bytes=param_bytes + opt_bytes,
            spread={"F": spread(times["F"]), "I": spread(times["I"]),
                    "W": spread(times["W"]), "optimizer": spread(step_times)}))
        value = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, y)
        log.info("stage %d: F %.4f ms, I %.4f ms, W %.4f ms, activation %d B", s,
                 out[-1].forward, out[-1].backward_input, out[-1].backward_weight, activation)
    return out


def _now(dev) -> float:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


def _ms(samples: list[float]) -> float:
    return max(MIN_MS, statistics.median(samples) * 1e3)


SPREAD_WARNING = 0.5
"""A figure whose repeats spread by more than this fraction of their median is reported with
a warning: two profiles of the tiny MLP minutes apart on a busy machine differed 40-100x in
p2p and all-reduce time, which moved a plan's predicted cost of one dead worker from +3.5%
to +73%."""


def spread(samples: list[float]) -> float:
    """(90th percentile - 10th percentile) / median of `samples` (0 for fewer than 2)."""
    if len(samples) < 2:
        return 0.0
    xs = sorted(samples)
    mid = statistics.median(xs)
    q = lambda f: xs[round(f * (len(xs) - 1))]  # noqa: E731 - nearest rank
    return (q(0.9) - q(0.1)) / mid if mid > 0 else 0.0


def spread_note(stages: list[StageProfile]) -> str:
    """The spreads as lines for the spec's header, and a warning logged for each large one."""
    lines = []
    for s, st in enumerate(stages):
        lines.append(f"stage {s} spread (p90-p10)/median: " + ", ".join(
            f"{k} {v:.0%}" for k, v in st.spread.items()))
        for k, v in st.spread.items():
            if v > SPREAD_WARNING:
                log.warning("stage %d's %s varied by %.0f%% of its median across repeats: the "
                            "machine is busy; profile again when it is quiet", s, k, 100 * v)
    return "\n".join(lines)


def _activation_bytes(forward: Callable, inputs: list, params: list) -> int:
    """Bytes of distinct storages autograd saves in one forward (parameters excluded: they are
    static memory), plus the output's leaves and (after stage 0) the received input's, which
    the executor keeps until the weight gradient."""
    import torch

    from recycle_planner.executor.data.boundary import flat

    seen: dict[Any, int] = {}
    static = {(p.untyped_storage().data_ptr(), p.device) for p in params}

    def pack(t):
        try:
            key = (t.untyped_storage().data_ptr(), t.device)
            if key not in static:
                seen[key] = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage
            seen[id(t)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forward()
    for t in flat(y) + list(inputs):
        seen.setdefault((t.untyped_storage().data_ptr(), t.device), t.untyped_storage().nbytes())
    return int(sum(seen.values()))


# -- communication -----------------------------------------------------------------------------

def measure_comm(p2p_bytes: list[int], allreduce_bytes: list[int], ranks: int,
                 repeats: int = 20, timeout: float = 120.0,
                 wrap: Callable[[list[str]], list[str]] | None = None,
                 ) -> tuple[list["Measured"], list["Measured"]]:
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


@dataclass(frozen=True)
class Measured:
    """A communication figure: the median (ms) of its repeats and their spread."""

    ms: float
    spread: float

    @classmethod
    def of(cls, samples: list[float]) -> "Measured":
        return cls(statistics.median(samples) * 1e3, spread(samples))


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
                undo_copy: str = "host",
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
    from recycle_planner.executor.data.boundary import flat

    stages = profile_stages(job, device, repeats, warmup)
    S = len(stages)
    p2p_ms = [float(p2p)] * S if p2p is not None else [0.0] * S
    ar_ms = [float(allreduce)] * S if allreduce is not None else [0.0] * S
    if measure_communication and (p2p is None or allreduce is None) and \
            not device.startswith("cuda"):
        # A stage sends its output downstream and its input gradient upstream.
        sizes = [max(st.output_bytes, stages[s - 1].output_bytes if s else 0)
                 for s, st in enumerate(stages)]
        got_p2p, got_ar = measure_comm(sizes if p2p is None and S > 1 else [],
                                       [st.grad_bytes for st in stages]
                                       if allreduce is None and pipelines > 1 else [],
                                       ranks=min(pipelines, 8), repeats=max(repeats, 10),
                                       wrap=wrap)
        if got_p2p:
            p2p_ms = [m.ms for m in got_p2p]
            stages = [replace(st, spread={**st.spread, "p2p": m.spread})
                      for st, m in zip(stages, got_p2p)]
        if got_ar:
            ar_ms = [m.ms for m in got_ar]
            stages = [replace(st, spread={**st.spread, "allreduce": m.spread})
                      for st, m in zip(stages, got_ar)]
    # Send buffers: the runtime keeps one per sending op for the whole generation (an
    # activation down and a gradient up per micro-batch), which the plan's memory cap must
    # hold beside the parameters, gradients, buckets and state. Receive buffers are pooled by
    # what is in flight (`executor/data/pool.py`): a received activation is the stage's input,
    # already in `activation`.
    inputs = [0] + [st.output_bytes for st in stages[:-1]]
    undo = 1 if undo_copy == "device" else 0
    stages = [replace(st, static=st.static + microbatches * (inputs[s] + st.output_bytes)
                      + undo * st.undo_bytes)
              for s, st in enumerate(stages)]
    budget = memory_budget if memory_budget is not None else _device_memory(device,
                                                                            pipelines * S)
    x = flat(job.data(0, 0, 0)[0])[0]
    data = {
        "stages": S, "pipelines": pipelines, "microbatches": microbatches,
        "microbatch_size": int(x.shape[0]) if x.ndim else 1,
        "time": {"forward": [st.forward for st in stages],
                 "backward_input": [st.backward_input for st in stages],
                 "backward_weight": [st.backward_weight for st in stages],
                 "p2p": p2p_ms, "allreduce": ar_ms,
                 "optimizer": [st.optimizer for st in stages]},
        "memory": {"activation": [float(max(1, st.activation)) for st in stages],
                   "static": [float(st.static) for st in stages], "budget": float(budget)},
    }
    if name:
        data["name"] = name
    return JobSpec.from_dict(data, "profile"), stages


def _device_memory(device: str, workers: int) -> float:
    if device.startswith("cuda"):
        import torch

        return float(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 * 2**30
    return float(total // max(1, workers))


def spec_to_toml(spec: JobSpec, header: str = "") -> str:
    """The spec as TOML with the keys `load_spec` reads."""
    data = spec.to_dict()
    lines = [f"# {line}" for line in header.splitlines()] if header else []
    for key in ("name", "stages", "pipelines", "microbatches", "microbatch_size"):
        if key in data:
            lines.append(f"{key} = {_toml_value(data[key])}")
    for table in ("time", "memory"):
        if table in data:
            lines.append("")
            lines.append(f"[{table}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in data[table].items()]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, float):
        if not math.isfinite(value):
            raise RecycleError(f"cannot write {value} to a spec")
        if value.is_integer():  # bytes: exact
            return str(int(value))
        return repr(float(f"{value:.6g}"))  # times: 6 significant digits
    return str(value)


def write_spec(spec: JobSpec, path: str | Path, header: str = "") -> None:
    text = spec_to_toml(spec, header)
    atomic_write(path, lambda fh: fh.write(text))
