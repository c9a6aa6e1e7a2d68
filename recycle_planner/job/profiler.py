"""The job spec from a profile: what the plan's time and memory model counts, without torch.

The measuring is the executor's (`executor/profile.py`: the runtime's own handlers, the
communication between local gloo processes); this module turns its per-stage records
(`StageProfile`) into the `JobSpec` the planner reads (`job_spec`) and writes it as TOML:

- times: forward (F), input-gradient (I) and weight-gradient (W) backward, the optimizer
  step, each the median of several repeats, with point-to-point and all-reduce times;
- activation memory, per micro-batch in flight: what autograd saves in its forward, its input
  and output (the received input is a view of its receive buffer: receive buffers are pooled
  by what is in flight, `executor/data/pool.py`), and its two send buffers (the output sent
  downstream, the input gradient sent upstream), which are pooled the same way;
- static memory: parameters, gradients, the gradient all-reduce's bucket buffers, the optimizer
  state, the step-undo copy when it lives on the device (`--undo-copy device`), and on a CUDA
  job NCCL's own buffers, *estimated* from NCCL's documented defaults (`nccl_estimate`: no
  CPU can measure them; `benchmarks/gpu_check.py` measures a worker's device memory on a GPU);
- the spread of every figure's repeats ((p90 - p10) / median), written into the spec's header
  and warned about above 50% (a busy machine).

`recycle-planner profile JOB --pipelines D --microbatches M -o job.toml` writes the result as
a TOML spec (`load_spec` reads it back); then `recycle-planner plan-all job.toml` builds the
plan library the executor uses.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

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
    static: int             # bytes held for the whole run: params, grads, buckets, state
    output_bytes: int       # one micro-batch's output (the activation sent downstream)
    grad_bytes: int         # the stage's gradients (what the all-reduce moves)
    undo_bytes: int = 0     # the step-undo copy: parameters and optimizer state
    input_bytes: int = 0    # one micro-batch's input (the activation received)
    spread: dict[str, float] = field(default_factory=dict)
    """Per figure (F, I, W, optimizer, p2p, allreduce): the spread of its repeats, (90th
    percentile - 10th) / median; a large one says the machine was busy (`SPREAD_WARNING`)."""


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


@dataclass(frozen=True)
class Measured:
    """A communication figure: the median (ms) of its repeats and their spread."""

    ms: float
    spread: float

    @classmethod
    def of(cls, samples: list[float]) -> "Measured":
        return cls(statistics.median(samples) * 1e3, spread(samples))


# -- NCCL's own memory -------------------------------------------------------------------------

NCCL_BUFFSIZE = 4 * 2**20
"""NCCL's default buffer per connection and channel (`NCCL_BUFFSIZE`, 4 MiB: the Simple
protocol's; the LL and LL128 protocols' buffers come on top and are not counted)."""
NCCL_P2P_CHANNELS = 2
"""Channels per peer of a point-to-point communicator (NCCL's log: "2 p2p channels per
peer"; `NCCL_NCHANNELS_PER_NET_PEER` defaults to 2)."""
NCCL_COLL_CHANNELS = 2
"""Channels of a collective ring: NCCL's fewest (one ring each way per NIC); NVLink machines
use more (up to 32 on H100), so this is a floor."""


@dataclass(frozen=True)
class NcclEstimate:
    """NCCL's device buffers on one worker of stage `stage`, from NCCL's documented defaults.

    torch's `ProcessGroupNCCL` runs each single send or receive on a two-rank communicator of
    the pair (its `getKeySendRecv`), so a worker holds one per peer it exchanges messages
    with: a plan for some failure situation may re-route to any worker of the neighbouring
    stages, so every one of them counts (`pipelines` upstream, `pipelines` downstream). Each
    carries both directions, `NCCL_P2P_CHANNELS` channels each. Besides, the executor's
    collective communicators (`Comm`): the generation's group of all members, the stage's
    group (with peers) and the scalar group (with a step hook), each a ring: a connection in
    and one out per channel. Every connection and channel holds `NCCL_BUFFSIZE`. A floor:
    LL/LL128 buffers, more channels on NVLink and NCCL's own bookkeeping add to it (NCCL
    issues #864, #964 report 0.5-1.6 GiB per communicator on 4-8 GPU NVLink machines)."""

    pair_communicators: int
    collective_communicators: int

    @property
    def total(self) -> int:
        return (self.pair_communicators * 2 * NCCL_P2P_CHANNELS
                + self.collective_communicators * 2 * NCCL_COLL_CHANNELS) * NCCL_BUFFSIZE


def nccl_estimate(stage: int, stages: int, pipelines: int, scalars: bool) -> NcclEstimate:
    """`NcclEstimate` of a worker of `stage` (`scalars`: the job has a step hook)."""
    peers = pipelines * ((stage > 0) + (stage < stages - 1))
    return NcclEstimate(peers, 1 + (pipelines > 1) + bool(scalars))


# -- the spec ----------------------------------------------------------------------------------

def job_spec(stages: list[StageProfile], pipelines: int, microbatches: int,
             p2p: list[float], allreduce: list[float], p2p_measured: list[Measured],
             allreduce_measured: list[Measured], budget: float, microbatch_size: int,
             name: str | None = None, undo_on_device: bool = False,
             nccl: list[int] | None = None) -> tuple[JobSpec, list[StageProfile]]:
    """The spec of a profile (the module's docstring says what each figure counts), and the
    stages with the communication spreads added. `p2p` / `allreduce` (ms per stage) are used
    where nothing was measured; `nccl`: NCCL's bytes per stage (none on gloo)."""
    S = len(stages)
    if p2p_measured:
        p2p = [m.ms for m in p2p_measured]
        stages = [replace(st, spread={**st.spread, "p2p": m.spread})
                  for st, m in zip(stages, p2p_measured)]
    if allreduce_measured:
        allreduce = [m.ms for m in allreduce_measured]
        stages = [replace(st, spread={**st.spread, "allreduce": m.spread})
                  for st, m in zip(stages, allreduce_measured)]
    nccl = nccl or [0] * S
    activation = [st.activation + st.output_bytes + st.input_bytes for st in stages]
    static = [st.static + undo_on_device * st.undo_bytes + nccl[s]
              for s, st in enumerate(stages)]
    data = {
        "stages": S, "pipelines": pipelines, "microbatches": microbatches,
        "microbatch_size": microbatch_size,
        "time": {"forward": [st.forward for st in stages],
                 "backward_input": [st.backward_input for st in stages],
                 "backward_weight": [st.backward_weight for st in stages],
                 "p2p": list(p2p), "allreduce": list(allreduce),
                 "optimizer": [st.optimizer for st in stages]},
        "memory": {"activation": [float(max(1, a)) for a in activation],
                   "static": [float(x) for x in static], "budget": float(budget)},
    }
    if name:
        data["name"] = name
    return JobSpec.from_dict(data, "profile"), stages


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
