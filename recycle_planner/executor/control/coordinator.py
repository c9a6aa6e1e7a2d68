"""The coordinator of a multi-host job: the store and the membership decisions, on a machine
that does not train.

`recycle-planner coordinator` runs `Coordinator`: the same decisions as the single-machine
launcher (`agent.Agent`: generations, `protocol.decide`, checkpoints, results), but it starts
no process. One host agent per training host (`hostagent.HostAgent`, `recycle-planner launch
--nnodes ...`) starts that host's workers and reports their exits here. What the coordinator
knows of a worker:

- its hello, heartbeats and step reports, in the store it hosts (torch's c10d `TCPStore`, the
  store torchrun's c10d rendezvous uses);
- its lease: a heartbeat value that has not changed for `hang_timeout` seconds of the
  coordinator's own clock means the worker is gone, whether its host vanished (link down,
  power, kernel panic: no socket is ever closed), its processes were stopped, or its
  training thread stalled (the worker then stops beating itself). The coordinator declares it
  dead at once (it cannot wait for a process it does not own) and asks its host agent to
  kill it, should the host come back;
- its exit, reported by its host agent within milliseconds.

A dead set the library lacks is planned here, on demand, and added to the library (which must
be on the shared filesystem, like the run folder), and refined in a background process of this
machine: the coordinator is the library's only writer (`agent.Agent._plan_on_demand`).

Losing the coordinator is the one failure that stops training: the workers notice within
the lease, write a consistent checkpoint and exit; a coordinator started again with
`--resume`, and the host agents, continue from it.
"""

from __future__ import annotations

import time

from recycle_planner.errors import RecycleError
from recycle_planner.executor.control import messages as msg
from recycle_planner.executor.control.agent import (Agent, LaunchConfig, LaunchResult, _Proc,
                                                    preflight, run_agent)
from recycle_planner.executor.control.runfolder import RunFolder
from recycle_planner.executor.config import CONFIG_ERROR, CONFIG_KEY

class Coordinator(Agent):
    """`Agent` for workers on other hosts: exits come from host agents, hangs are leases."""

    PORT_OPTION = "--port"

    def __init__(self, command: list[str], config: LaunchConfig, on_event, folder: RunFolder,
                 nnodes: int):
        super().__init__(command, config, on_event, folder)
        self.nnodes = nnodes
        self.hosts: dict[int, dict] = {}
        self.incarnation: dict[int, int] = {}

    def _start(self) -> None:
        self.store.set(CONFIG_KEY, self.config.worker_config(self.log_dir).to_json())
        for rank in range(self.config.nproc):  # a placeholder until its host agent reports
            self.procs[rank] = _Proc(rank, 0, None, self.log_dir, time.time())
        self._event("start", f"coordinator for {self.nnodes} hosts x "
                             f"{self.config.nproc // self.nnodes} workers, store on port "
                             f"{self.port}; waiting for the host agents")

    def _reap(self) -> None:
        for node in range(self.nnodes):
            host = None if node in self.hosts else msg.get(self.store, msg.HostUp, node=node)
            if host is not None:
                self.hosts[node] = host
                self._event("host", f"host {node} ({host.hostname}) runs ranks "
                                    f"{list(host.ranks)}", node=node)
        for rank in range(self.config.nproc):
            inc = self.incarnation.get(rank, 0) + 1
            if rank not in self.procs and msg.get(self.store, msg.Spawned, rank=rank,
                                                  incarnation=inc) is not None:
                self.incarnation[rank] = inc
                self.procs[rank] = _Proc(rank, inc, None, self.log_dir, time.time())
                self._event("restart", f"worker {self._name(rank)} restarted by its host agent "
                                       f"(incarnation {inc})", rank=rank)
        for rank, proc in list(self.procs.items()):
            report = msg.get(self.store, msg.WorkerExit, rank=rank, incarnation=proc.incarnation)
            if report is None:
                continue
            del self.procs[rank]
            if self.phase in ("exiting", "stopping"):
                continue
            if report.code == CONFIG_ERROR:
                self._finish_with("failed", f"worker {self._name(rank)} cannot run the job: "
                                            f"{report.last_line}")
                return
            self._death(proc, report.how)

    def _lease_expired(self, proc: _Proc, silent: float) -> None:
        del self.procs[proc.rank]
        msg.put(self.store, msg.Kill(proc.rank, proc.incarnation))
        if self.phase not in ("exiting", "stopping"):
            self._death(proc, f"lost its lease: no heartbeat for {silent:.1f} s (host gone, "
                              f"processes stopped, or training thread stalled)")

    def _kill(self, proc: _Proc) -> None:
        self._lease_expired(proc, time.time() - proc.last_beat)

    def _restart_due(self, now: float) -> None:
        self.restart_at.clear()  # host agents restart their own workers (see HostAgent)

    def _kill_all(self) -> None:
        """Tell the host agents the job is over and give them a moment to read it."""
        deadline = time.time() + 10
        while time.time() < deadline and not all(
                msg.get(self.store, msg.Bye, node=n) is not None for n in self.hosts):
            time.sleep(0.05)

    def _result(self) -> LaunchResult:
        result = super()._result()
        msg.put(self.store, msg.Outcome(result.status, result.message))
        return result


def coordinate(config: LaunchConfig, nnodes: int, on_event=None) -> LaunchResult:
    """Coordinate a job whose `config.nproc` workers run on `nnodes` hosts, each started by a
    host agent; returns when training is over. Raises `TrainingStopped` like `launch`."""
    if nnodes < 1 or config.nproc % nnodes:
        raise RecycleError(f"{config.nproc} workers cannot be spread evenly over {nnodes} "
                           f"hosts")
    config = preflight(config, None)  # the job itself is loaded by the host agents' workers
    # plans made on demand go to the library (with --spec, in the shared run folder)
    return run_agent(Coordinator, config, [], on_event, nnodes)
