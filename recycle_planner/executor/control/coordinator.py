"""The coordinator of a multi-host job: the store and the membership decisions, on a machine
that does not train.

`recycle-planner coordinator` runs the same `agent.Agent` as the single-machine launcher
(generations, `protocol.decide`, checkpoints, results) over a `pool.HostPool`: it starts no
process. One host agent per training host (`hostagent.HostAgent`, `recycle-planner launch
--nnodes ...`) starts that host's workers and reports their exits here. What the coordinator
knows of a worker:

- its hello, heartbeats and step reports, in the store it hosts (torch's c10d `TCPStore`, the
  store torchrun's c10d rendezvous uses);
- its lease: a heartbeat value that has not changed for `lease` seconds of the
  coordinator's own clock means the worker is gone, whether its host vanished (link down,
  power, kernel panic: no socket is ever closed), its processes were stopped, or its
  training thread stalled (the worker then stops beating itself). The coordinator declares it
  dead at once (it cannot wait for a process it does not own) and asks its host agent to
  kill it, should the host come back;
- its exit, reported by its host agent within milliseconds.

A dead set the library lacks is planned here, on demand, and added to the library (which must
be on the shared filesystem, like the run folder), and refined in a background process of this
machine: the coordinator is the library's only writer (`agent.Agent._plan_on_demand`).

Losing the one coordinator of a `--rdzv-backend c10d` job stops training: the workers notice
within the lease, write a consistent checkpoint and exit; a coordinator started again with
`--resume`, and the host agents, continue from it. With coordinators that fail over
(`failover.py`), the next leader runs this with `--take-over` (`LaunchConfig.take_over`): the
host agents re-attach to it and it adopts the generation their workers run (`takeover.py`).
"""

from __future__ import annotations

from recycle_planner.errors import RecycleError
from recycle_planner.executor.control.agent import LaunchConfig, preflight, run_agent
from recycle_planner.executor.control.pool import HostPool
from recycle_planner.executor.control.result import LaunchResult


def coordinate(config: LaunchConfig, nnodes: int, on_event=None) -> LaunchResult:
    """Coordinate a job whose `config.nproc` workers run on `nnodes` hosts, each started by a
    host agent; returns when training is over. Raises `TrainingStopped` like `launch`."""
    if nnodes < 1 or config.nproc % nnodes:
        raise RecycleError(f"{config.nproc} workers cannot be spread evenly over {nnodes} "
                           f"hosts")
    config = preflight(config, None)  # the job itself is loaded by the host agents' workers
    # plans made on demand go to the library (with --spec, in the shared run folder)
    return run_agent(config, on_event, HostPool, nnodes)
