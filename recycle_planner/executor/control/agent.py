"""The launcher: start the workers, watch them, decide membership, collect results.

`launch()` (and `recycle-planner launch`) runs in a process that never trains, so it survives
every worker failure; it hosts the TCP store all workers meet in. It starts one process per
worker with torchrun's environment variables, then loops:

- a worker process that exits is dead (the launcher is its parent, so it knows within
  milliseconds); a worker whose heartbeats stop for `lease` seconds is hung and gets
  SIGKILL, which makes it dead;
- on a death (or a communication error a worker reports) it posts the generation's abort
  notice, gathers the survivors' step counts, and posts the next generation's decision
  (`protocol.decide`): the plan for the new dead set. A dead set the library lacks (beyond
  its threshold, or no library at all) is planned on the spot with the fast solver under a
  time budget (`library/ondemand.py`) and added to the library; training stops (with a
  checkpoint) only when a stage has no live worker left. A background process then refines
  such a plan; when it is better by a margin, the survivors switch to it at an iteration
  boundary (nothing in training waits for it). A worker that does not report within the
  group timeout plus `lease` of the abort is stuck and gets killed; a failure during
  recovery is just one more death;
- with `restart_delay` set, a dead worker is started again after that many seconds; when it
  says hello the live workers stop at an iteration boundary, it copies its stage's state from
  a peer, and the plan switches back;
- when every member has finished, it marks the final checkpoint complete, lets the workers
  exit, and returns the losses, the events and the timings.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import logging
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch.distributed as dist

from recycle_planner.errors import RecycleError
from recycle_planner.executor.control import messages as msg
from recycle_planner.executor.control import protocol as P
from recycle_planner.executor.control.iterations import IterationLog
from recycle_planner.executor.control.mail import Mail
from recycle_planner.executor.control.pause import PauseClock
from recycle_planner.executor.control.pool import LocalPool, Proc, WorkerPool, last_line
from recycle_planner.executor.control.result import (Death, Event, EventKind, GenerationRecord,
                                                     LaunchResult, Recovery, Status)
from recycle_planner.executor.control.runfolder import RunFolder, claim
from recycle_planner.executor.control.takeover import Adoption, Waiting
from recycle_planner.executor.faults import Fault, step_reports
from recycle_planner.executor.job import Job, load_job
from recycle_planner.executor.data.state import latest_checkpoint, write_manifest
from recycle_planner.executor.config import (BACKEND, BUCKET_MB, CHECKPOINT_EVERY,
                                             CONFIG_ERROR, GRACE, HEARTBEAT, LEASE,
                                             MAX_RESTARTS, PG_TIMEOUT, RDZV_TIMEOUT,
                                             RUN_DIR, STARTUP_TIMEOUT, UNDO_COPY, UNDO_PLACES,
                                             WorkerConfig)
from recycle_planner.files.planfile import read_plan
from recycle_planner.job.spec import load_spec
from recycle_planner.job.workers import dead_per_stage, format_workers
from recycle_planner.library import PlanLibrary, library_lock
from recycle_planner.library.entries import ON_DEMAND, REFINED
from recycle_planner.library.lookup import MissingPlan
from recycle_planner.library.ondemand import (ON_DEMAND_BUDGET, REFINE_BUDGET, REFINE_MARGIN,
                                              REFINE_WHICH, plan_on_demand, refine_command,
                                              refine_settings_hash, wants_refinement)
from recycle_planner.io import write_json
from recycle_planner.timing.replay import measured_spec, replay_period, stage_costs

log = logging.getLogger(__name__)

class Phase(enum.Enum):
    """Where the launcher (or coordinator) is, like torch elastic's `WorkerState`:
    STARTING (waiting for every hello, then the first decision), RUNNING (a generation
    trains), GATHERING (it was abandoned or is leaving at a boundary: collecting the members'
    step counts for the next decision), EXITING (the last iteration is done everywhere: the
    workers leave), STOPPING (a stop decision: the members write their checkpoint), ADOPTING
    (a coordinator taking over from a lost one: waiting for the host agents to re-attach,
    then continuing the generation their workers run, `takeover.py`)."""

    ADOPTING = "adopting"
    STARTING = "starting"
    RUNNING = "running"
    GATHERING = "gathering"
    EXITING = "exiting"
    STOPPING = "stopping"


OVER = (Phase.EXITING, Phase.STOPPING)
"""Training is over: every worker exit is expected."""


class TrainingStopped(RecycleError):
    """Training ended before its last iteration: failures beyond the library's threshold, a
    stage with no live worker, or a worker that cannot run the job."""

    def __init__(self, message: str, result: "LaunchResult"):
        super().__init__(message)
        self.result = result


@dataclass
class LaunchConfig:
    """How to run the workers. Times in seconds."""

    nproc: int
    run_dir: str = RUN_DIR
    backend: str = BACKEND
    master_addr: str = "127.0.0.1"
    master_port: int = 0                  # 0: any free port
    heartbeat: float = HEARTBEAT
    lease: float = LEASE                  # no heartbeat (or no progress) this long: dead
    pg_timeout: float = PG_TIMEOUT        # process-group timeout of every generation
    startup_timeout: float = STARTUP_TIMEOUT
    restart_delay: float | None = None    # restart a dead worker after this long (re-join)
    max_restarts: int = MAX_RESTARTS      # restarts per rank
    checkpoint_every: int = CHECKPOINT_EVERY  # iterations between checkpoints (0: final only)
    resume: bool = False                  # start from the run folder's latest checkpoint
    take_over: bool = False               # adopt a lost coordinator's running workers
    rdzv_timeout: float = RDZV_TIMEOUT    # taking over: the longest wait for a live host
                                          # (its agent gives up on a coordinator after it)
    start_over: bool = False              # discard the run folder's earlier run (runfolder.py)
    grace: float = GRACE                  # SIGTERM: a consistent checkpoint within this long
    library: str | None = None            # overrides the job's plan library
    spec: str | None = None               # job spec file: with no library, plan on demand
                                          # into RUN_DIR/plans (see `prepare_library`)
    on_demand: bool = True                # plan a dead set the library lacks (False: stop)
    plan_budget: float = ON_DEMAND_BUDGET  # seconds for such a plan
    refine: str = "on-demand"             # which plans to improve in the background
    refine_budget: float = REFINE_BUDGET  # solver seconds of one refinement
    refine_margin: float = REFINE_MARGIN  # switch only if shorter by this fraction
    faults: Sequence[Fault] = ()
    threads: int = 1
    bucket_mb: float = BUCKET_MB          # gradient all-reduce bucket size (MiB)
    undo_copy: str = UNDO_COPY            # where the step-undo copy lives: host or device
    poll: float = 0.002                   # between checks while something is happening
    idle_poll: float = 0.02               # while training runs (a death wakes the launcher)

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise RecycleError(f"need at least one worker, got {self.nproc}")
        for f in self.faults:
            for rank in (f.rank, *f.after_step):
                if not 0 <= rank < self.nproc:
                    raise RecycleError(f"fault {f}: rank {rank} is outside "
                                       f"0..{self.nproc - 1}")
        if not self.bucket_mb > 0:
            raise RecycleError(f"bucket_mb must be positive, got {self.bucket_mb}")
        if self.undo_copy not in UNDO_PLACES:
            raise RecycleError(f"undo_copy {self.undo_copy!r} is not one of "
                               f"{', '.join(UNDO_PLACES)}")
        if self.refine not in REFINE_WHICH:
            raise RecycleError(f"refine {self.refine!r} is not one of {', '.join(REFINE_WHICH)}")

    def worker_config(self, log_dir: Path | None = None) -> WorkerConfig:
        return WorkerConfig(run_dir=str(Path(self.run_dir).resolve()), backend=self.backend,
                            log_dir=str(log_dir.resolve()) if log_dir is not None else None,
                            heartbeat=self.heartbeat, lease=self.lease,
                            pg_timeout=self.pg_timeout,
                            poll=self.poll, checkpoint_every=self.checkpoint_every,
                            # host agents that come back fresh to a coordinator taking over
                            # start from the checkpoint their stopped workers wrote
                            resume=self.resume or self.take_over and latest_checkpoint(
                                self.run_dir) is not None,
                            library=self.library,
                            threads=self.threads, bucket_mb=self.bucket_mb,
                            undo_copy=self.undo_copy, grace=self.grace,
                            faults=[f.to_dict() for f in self.faults])


def _on_disk(run_dir: Path) -> int:
    """The iteration of the run folder's latest complete checkpoint (-1: none)."""
    found = latest_checkpoint(run_dir)
    return found[0] if found else -1


def _median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


def worker_command(target: str, args: Sequence[str] = ()) -> list[str]:
    """The command every worker runs: a training script (like torchrun's), or a job factory
    `FILE.py:FUNCTION` / `MODULE:FUNCTION` run by the executor's own entry point."""
    if target.endswith(".py") and ":" not in target:
        return [sys.executable, target, *args]
    return [sys.executable, "-m", "recycle_planner.executor", target, *args]


def check_target(target: str) -> None:
    """Fail before starting any process if a job file or script does not exist."""
    path = target.rpartition(":")[0] if ":" in target else target
    if (path.endswith(".py") or "/" in path) and not Path(path).is_file():
        raise RecycleError(f"job file {path} does not exist")


def launch(target: str | Sequence[str], config: LaunchConfig, args: Sequence[str] = (),
           on_event: Callable[[Event], None] | None = None) -> LaunchResult:
    """Run a job on `config.nproc` local worker processes and return what happened.

    `target` is a training script, a job factory (`FILE.py:FUNCTION`), or a full command list.
    Raises `TrainingStopped` if training could not finish (the result is attached)."""
    if isinstance(target, str):
        check_target(target)
        command = worker_command(target, args)
        config = preflight(config, (lambda: load_job(target, args)) if _is_factory(target)
                           else None)
    else:
        command = list(target)
        config = preflight(config, None)
    return run_agent(config, on_event, LocalPool, command)


def run_agent(config: LaunchConfig, on_event, pool: type, *pool_args: Any) -> LaunchResult:
    """Claim the run folder, prepare the library and hold its lock for the run's life (the
    run adds the plans it makes on demand), then run an `Agent` over the workers of `pool`
    (`LocalPool`, or `HostPool` for a coordinator)."""
    # taking over: the deposed coordinator may hold the folder until it finds out (its
    # watchdog kills it once its lease is found lost, a lease or so)
    folder = claim(config.run_dir, config.resume, config.start_over, config.take_over,
                   wait=3 * config.lease if config.take_over else 0.0)
    try:
        config = prepare_library(config)
        with contextlib.ExitStack() as stack:
            if config.library is not None and config.on_demand:
                stack.enter_context(library_lock(config.library, f"a run in {config.run_dir}"))
            result = Agent(config, on_event, folder, pool, *pool_args).run()
    finally:
        folder.release()
    if result.status != Status.COMPLETED:
        raise TrainingStopped(result.message, result)
    return result


def _is_factory(target: str) -> bool:
    return not (target.endswith(".py") and ":" not in target)


def preflight(config: LaunchConfig, job_of: Callable[[], Job] | None) -> LaunchConfig:
    """What can be checked before any process starts, so that a wrong worker count, a job
    that names no library, a missing library or a job file that fails to load is one line at
    once rather than after every worker's start-up, and `--resume` with nothing to resume
    before even the job is loaded. A training script (not a job factory) names its
    library only in its workers, which check it. Returns `config` naming the job's library,
    whose lock the run then holds. `job_of` loads the job (a job factory), once the checks
    that need no job have passed."""
    if config.resume and latest_checkpoint(config.run_dir) is None:  # before the job loads
        raise RecycleError(f"--resume: no complete checkpoint in "
                           f"{Path(config.run_dir) / 'checkpoints'} to resume from")
    job = job_of() if job_of is not None else None
    if config.library is not None:
        spec = PlanLibrary.open(config.library).spec
    elif config.spec is not None:
        spec = load_spec(config.spec)
    elif job is not None:
        if job.library is None:
            raise RecycleError("the job names no plan library: set Job.library or pass "
                               "--library (or --spec, to plan on demand) to the launcher")
        spec = PlanLibrary.open(job.library).spec
        config = replace(config, library=str(Path(job.library).resolve()))
    else:
        return config
    where = config.library or config.spec or job.library
    _check_size(spec, config.nproc, where)
    if job is not None and len(job.stages) != spec.stages:
        raise RecycleError(f"the job has {len(job.stages)} stages but the plan library "
                           f"{where} has {spec.stages}")
    return config


def prepare_library(config: LaunchConfig) -> LaunchConfig:
    """Check the library against the job's size; with no library but a job spec, create an
    empty one in RUN_DIR/plans (kept by a resumed run), where every situation is planned when
    first met, the fault-free one at start."""
    if config.library is None and config.spec is not None:
        folder = Path(config.run_dir) / "plans"
        PlanLibrary.create(folder, load_spec(config.spec))
        config = replace(config, library=str(folder.resolve()))
    if config.library is not None:
        spec = PlanLibrary.open(config.library, load_spec(config.spec) if config.spec
                                else None).spec
        _check_size(spec, config.nproc, config.library)
    return config


def _check_size(spec, nproc: int, where) -> None:
    if spec.chunks > 1:  # the runtime runs one chunk per worker; virtual stages come later
        raise RecycleError(f"the plan library {where} gives each worker {spec.chunks} model "
                           "chunks; launch runs one chunk per worker")
    if spec.workers != nproc:
        raise RecycleError(f"the plan library {where} is for {spec.pipelines} pipelines x "
                           f"{spec.stages} stages = {spec.workers} workers, not {nproc}")


@dataclass
class _Round:
    """What the launcher gathers during one generation; a fresh one with every decision, so
    that nothing is reset by hand (what the generation *is* stays in its frozen
    `protocol.Decision`: members and their incarnations, dead set, restart, plan)."""

    ready: dict[int, int | None] = field(default_factory=dict)  # members' step counts
    pending: dict[int, int] = field(default_factory=dict)  # members' unchecked steps
    known: dict[int, dict[int, tuple[float, ...]]] = field(default_factory=dict)  # their sums
    aborted_at: float | None = None      # when its abort was posted
    join_posted: bool = False            # a re-join or plan switch was asked for
    readys_scanned: bool = False         # every member's `Ready` looked up once (`_readys`)
    done_seen: tuple | None = None       # what the last look at `Done` saw (`_check_done`)


@dataclass
class _Refinement:
    """A background process improving the plan of one situation (`library/ondemand.py`)."""

    counts: tuple[int, ...]
    popen: subprocess.Popen
    out: Path
    started: float


def host_store(addr: str, port: int, timeout: float, option: str) -> dist.TCPStore:
    """The store this process hosts for its workers (or host agents); a port that is taken
    (or an address this machine does not have) is one line naming `option`, not c10d's
    traceback."""
    try:
        return dist.TCPStore(addr, port, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout))
    except (RuntimeError, dist.DistError) as exc:
        text = str(exc)
        why = ("the port is in use (by another job, or a coordinator or launcher still "
               "running)" if "EADDRINUSE" in text or "in use" in text
               else text.splitlines()[0] if text else type(exc).__name__)
        raise RecycleError(f"cannot host the store on {addr}:{port}: {why}; choose another "
                           f"{option}" + (" (0: any free port)" if option == "--master-port"
                                          else "")) from None


class Agent:
    """The launcher's (or coordinator's) membership logic over a `WorkerPool`: leases,
    generations and decisions, checkpoints, losses, the result."""

    def __init__(self, config: LaunchConfig, on_event: Callable[[Event], None] | None,
                 folder: RunFolder, pool: type, *pool_args: Any):
        self.config = config
        self.on_event = on_event
        self.folder = folder
        self.run_dir = Path(config.run_dir)
        self.log_dir = folder.log_dir
        self.iterations: IterationLog | None = None   # from the first decision
        self.checkpointed = _on_disk(self.run_dir)   # the latest complete checkpoint (-1:
                                                     # none), kept as this process marks them
        self.store = host_store(config.master_addr, config.master_port,
                                config.startup_timeout, pool.PORT_OPTION)
        self.port = self.store.port
        self.pool: WorkerPool = pool(self, *pool_args)
        self.mail: Mail = self.pool.mail(self.store)  # what workers report, what they are told
        self.t0 = time.time()
        self.procs: dict[int, Proc] = {}          # live processes by rank
        self.restarts: dict[int, int] = {}
        self.restart_at: dict[int, float] = {}
        self.events: list[Event] = []
        self.deaths: list[Death] = []
        self.lib: PlanLibrary | None = None
        self.stages = 0
        self.phase = Phase.ADOPTING if config.take_over else Phase.STARTING
        self.gen = -1
        self.decision: P.Decision | None = None
        self.round = _Round()                      # what this generation gathered so far
        self.next_beat_check = 0.0
        self.pause = PauseClock()                  # looked at each pass (`_awake`)
        self.next_checkpoint = config.checkpoint_every
        self.idle_reconfigurations = 0
        self.final_iterations = 0
        self.exit_started = 0.0
        self.first_death_log: Path | None = None
        self.outcome: tuple[str, str] | None = None
        self.bug: msg.Bug | None = None
        self.refinements: dict[tuple[int, ...], _Refinement] = {}
        self.refined: set[tuple[int, ...]] = set()   # situations refined (or tried) once
        self.plan_switch = False                     # a switch to a refined plan is under way
        self.preempted: float | None = None          # when SIGTERM came
        self.preempt_said = False
        self.progress: msg.Progress | None = None    # what the host agents were told
        self.progress_at = 0.0
        self.awaited_said = 0.0                      # taking over: when the wait was logged

    # -- main loop ---------------------------------------------------------------------------

    def run(self) -> LaunchResult:
        # A child's death wakes the loop at once, so that the launcher can poll slowly while
        # training runs and leave the CPU to the workers. The wake-up goes through a socket
        # that the interpreter writes to on SIGCHLD (no lock may be taken in a handler).
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        previous = old_fd = None
        if threading.current_thread() is threading.main_thread():
            old_fd = signal.set_wakeup_fd(wake_w.fileno())
            previous = signal.signal(signal.SIGCHLD, lambda *_: None)
            previous_term = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self._start()
            while self.outcome is None:
                self._pass(time.time())
                if self.outcome is not None:
                    break
                select.select([wake_r], [], [], self.config.idle_poll if self.phase is
                              Phase.RUNNING and previous is not None else self.config.poll)
                try:
                    while wake_r.recv(512):
                        pass
                except BlockingIOError:
                    pass
            return self._result()
        finally:
            if previous is not None:
                signal.signal(signal.SIGCHLD, previous)
                signal.signal(signal.SIGTERM, previous_term)
                signal.set_wakeup_fd(old_fd)
            wake_r.close()
            wake_w.close()
            self._stop_refinements()
            self.pool.close(self.procs, self.outcome)

    def _pass(self, now: float) -> None:
        """One pass of the loop: take in what the workers reported, act on it, post what
        the workers are told (`benchmarks/bench_relay.py` times it)."""
        self.mail.refresh()
        self._reap()
        self._awake(now)
        self._heartbeats(now)
        self._restart_due(now)
        self._hellos()
        self._checkpoints()
        if self.iterations is not None:
            self.iterations.save(now)
            self.iterations.retire(now)
        self._publish_progress(now)
        self._refinements_done(now)
        self._preemption(now)
        if self.outcome is None:
            PHASES[self.phase](self, now)
        self.mail.flush()

    def _on_sigterm(self, signum, frame) -> None:
        if self.preempted is None:
            self.preempted = time.time()

    def _preemption(self, now: float) -> None:
        """SIGTERM (preemption): abandon the generation, so that every member undoes a
        half-finished iteration, and decide a stop (`_phase_gathering`), whose members write a
        consistent checkpoint that `--resume` continues; all within the grace period, after
        which whatever is left is killed."""
        if self.preempted is None:
            return
        grace = self.config.grace
        if not self.preempt_said:
            self.preempt_said = True
            self._event(EventKind.PREEMPTED, f"SIGTERM: stopping with a checkpoint within the "
                                             f"{grace:g} s grace period")
            if self.phase is Phase.STARTING:
                self._finish_with(Status.STOPPED, "SIGTERM before training started: nothing to "
                                             "checkpoint")
            elif self.phase is Phase.RUNNING:
                self._abort("SIGTERM (preemption)")
            return
        if now - self.preempted > 0.9 * grace and self.phase is not Phase.EXITING:
            found = latest_checkpoint(self.run_dir) if self.stages else None
            self._finish_with(Status.STOPPED, f"SIGTERM: the workers did not stop within the "
                                         f"{grace:g} s grace period; "
                              + (f"latest complete checkpoint: iteration {found[0]} in "
                                 f"{found[1]}" if found else "no complete checkpoint"))

    def _start(self) -> None:
        procs = self.pool.start()
        if self.phase is not Phase.ADOPTING:  # taking over: the host agents name them
            for proc in procs:
                self.procs[proc.rank] = proc
        self._event(EventKind.START, self.pool.describe())
        # What the imports and the start made lives as long as the process: out of the cyclic
        # collector's full passes, which scanned it all (250,000 objects, torch's most of
        # them): 0.25 s of a new leader's intake of the journals at 8,192 ranks
        gc.freeze()

    # -- watching processes --------------------------------------------------------------------

    def _reap(self) -> None:
        if self.phase is Phase.ADOPTING:
            return  # the re-attaching hosts' reports name the processes (`_adopt`)
        for proc in self.pool.started():
            self.procs[proc.rank] = proc
        for ended in self.pool.exits(self.procs):
            proc = ended.proc
            del self.procs[proc.rank]
            if self.phase in OVER:
                continue  # training is over: every exit is expected
            if ended.code == CONFIG_ERROR:
                self._finish_with(Status.FAILED, f"worker {self._name(proc.rank)} cannot run "
                                                 f"the job: {ended.last_line}")
                return
            self._death(proc, ended.how)

    def _awake(self, now: float) -> None:
        """This process, paused since its last pass (`pause.PauseClock`: stopped or starved,
        not a long busy pass of a large job), could not hear the workers meanwhile: their
        silence counts from now (as a host agent's relay counts theirs, `Relay._awake`), not
        from before the pause. Looked at after the pass refreshed its mail and before it
        judges the heartbeats."""
        if self.pause.look().paused:
            for proc in self.procs.values():
                proc.last_beat = max(proc.last_beat, now)

    def _heartbeats(self, now: float) -> None:
        """A worker's lease: its heartbeat value must change at least every `lease`
        seconds of this process's clock (never compared with the worker's clock). Checked
        every heartbeat, and as the oldest lease runs out if that is sooner: a host's loss
        is then declared within a pass of its lease's end, not up to a heartbeat later."""
        if now < self.next_beat_check or self.phase in OVER:
            return
        lease, beat_of = self.config.lease, self.mail.beat
        oldest = now
        for rank, proc in list(self.procs.items()):
            if proc.hello is None or proc.killed:
                continue
            beat = beat_of(rank, proc.incarnation)
            if beat is not None and beat != proc.beat:
                proc.beat, proc.last_beat = beat, now
            if now - proc.last_beat > lease:
                self._lease_expired(proc, now - proc.last_beat)
            elif proc.last_beat < oldest:
                oldest = proc.last_beat
        self.next_beat_check = min(now + self.config.heartbeat,
                                   oldest + lease + self.config.poll)

    def _lease_expired(self, proc: Proc, silent: float) -> None:
        self._event(EventKind.HANG, f"worker {self._name(proc.rank)} sent no heartbeat for "
                                    f"{silent:.1f} s (host gone, processes stopped, or training "
                                    f"thread stalled): killing it", rank=proc.rank)
        self._kill(proc, f"lost its lease: no heartbeat for {silent:.1f} s")

    def _kill(self, proc: Proc, how: str) -> None:
        """Kill `proc` once; it is dead when its exit is reaped, or at once if the pool
        cannot see it exit (a worker on a host that may be gone)."""
        if proc.killed:
            return
        proc.killed = True
        if self.pool.kill(proc) and self.procs.get(proc.rank) is proc:
            del self.procs[proc.rank]
            if self.phase not in OVER:
                self._death(proc, how)

    def _death(self, proc: Proc, how: str) -> None:
        rank = proc.rank
        if self.first_death_log is None:
            self.first_death_log = proc.log_path
        death = Death(rank, self._name(rank), how, time.time() - self.t0, self.gen)
        fault = self.mail.get(msg.FaultFired, rank=rank, incarnation=proc.incarnation)
        if fault is not None:
            death = replace(death, t=fault.t - self.t0, fault=fault.fault)
        self.deaths.append(death)
        self._event(EventKind.DEATH, f"worker {death.worker} {how}"
                    + (f" (injected fault {death.fault})" if death.fault else ""),
                    rank=rank, how=how, t=death.t, gen=death.gen,
                    **({"fault": death.fault} if death.fault else {}))
        if self.pool.restarts and self.config.restart_delay is not None and \
                self.restarts.get(rank, 0) < self.config.max_restarts:
            self.restart_at[rank] = time.time() + self.config.restart_delay
        member = self._member_inc().get(rank) == proc.incarnation
        if self.phase in (Phase.RUNNING, Phase.GATHERING) and member:
            self._abort(f"worker {self._name(rank)} {how}")

    def _restart_due(self, now: float) -> None:
        if self.phase in OVER:
            return
        for rank, when in list(self.restart_at.items()):
            if now >= when:
                del self.restart_at[rank]
                self.restarts[rank] = self.restarts.get(rank, 0) + 1
                self.procs[rank] = self.pool.restart(rank, self.restarts[rank])
                self._event(EventKind.RESTART, f"worker {self._name(rank)} restarted (incarnation "
                                               f"{self.restarts[rank]})", rank=rank)

    def _hellos(self) -> None:
        for rank, proc in self.procs.items():
            if proc.hello is None:
                proc.hello = self.mail.get(msg.Hello, rank=rank,
                                     incarnation=proc.incarnation)
                if proc.hello is not None:
                    proc.last_beat = time.time()
                    if self.lib is None:
                        self._open_library(proc.hello.library)

    def _open_library(self, path: str) -> None:
        self.lib = PlanLibrary.open(path)
        self.stages = self.lib.spec.stages

    # -- phases ------------------------------------------------------------------------------

    def _phase_adopting(self, now: float) -> None:
        """Taking over from a lost coordinator: wait until every host agent re-attached (or
        came back fresh, its workers stopped with a checkpoint) but those etcd knows are lost,
        however slowly a live one re-attaches (`takeover.Waiting`: up to the rendezvous
        timeout); then adopt the generation the workers run, or, when no host runs one,
        start again from the latest checkpoint as --resume does."""
        nodes = range(self.pool.nnodes)
        attaches = {n: a for n in nodes if (a := self.mail.get(msg.Attach, node=n)) is not None}
        fresh = [n for n in nodes if n not in attaches
                 and self.mail.get(msg.HostUp, node=n) is not None]
        waiting = Waiting.of(nodes, [*attaches, *fresh], self.pool.held(now), now - self.t0,
                             self.config.lease, self.config.rdzv_timeout)
        if waiting.awaited:
            if now - self.awaited_said >= self.config.lease:
                self.awaited_said = now
                log.warning("taking over: %.0f s on, still waiting for hosts %s to re-attach "
                            "(waited for up to %g s)", now - self.t0, list(waiting.awaited),
                            waiting.limit)
            return
        adoption = Adoption.of(attaches.values())
        if adoption is None:
            found = latest_checkpoint(self.run_dir)
            self._event(EventKind.TAKE_OVER, "no host agent runs a generation: starting "
                        "again from " + (f"the checkpoint of iteration {found[0]}" if found
                                         else "scratch"))
            self.config = replace(self.config, resume=found is not None)
            for proc in self.pool.start():
                self.procs[proc.rank] = proc
            self.phase = Phase.STARTING
            return
        if adoption.workers and not any(self.mail.get(msg.Hello, rank=r, incarnation=i)
                                        is not None for r, i in adoption.workers.items()):
            return  # the hellos come in the same reports: not there yet (with no live
            # worker, none will: adopted at once, its members are deaths)
        self._adopt(adoption, sorted(attaches), now, waiting)

    def _adopt(self, adoption: Adoption, attached: list[int], now: float,
               waiting: Waiting) -> None:
        """Continue generation `adoption.decision` with the workers the hosts run: its
        decision posted again (a host may not have fetched it), the losses saved from the
        first the lost coordinator had not saved, the next checkpoint after the latest
        complete one; members that are gone (died meanwhile, or their host did not
        re-attach) are deaths of this generation, as any other."""
        d = adoption.decision
        for rank, inc in adoption.workers.items():
            self.procs[rank] = Proc(rank, inc, None, self.log_dir, time.time())
        self.pool.adopt(list(self.procs.values()), d)
        self._hellos()
        self.mail.post_decision(d)
        self.gen, self.decision, self.round = d.gen, d, _Round()
        spec = self.lib.spec
        self.iterations = IterationLog(self.mail, self.folder, spec.pipelines, spec.stages,
                                       spec.microbatches,
                                       adoption.saving_from(self.folder.saved_rows(),
                                                            self.folder.record.taken_over()),
                                       self.config.lease, step_reports(self.config.faults))
        self.checkpointed = _on_disk(self.run_dir)  # stopped workers may have written one
        every = self.config.checkpoint_every
        if every:
            self.next_checkpoint = (max(d.restart, self.checkpointed) // every + 1) * every
        self._event(EventKind.TAKE_OVER, f"took over generation {d.gen} from the lost "
                    f"coordinator: {len(adoption.workers)} workers kept running on hosts "
                    f"{attached}" + waiting.said(),
                    gen=d.gen, hosts=attached)
        if d.action == "stop":
            self.phase, self.exit_started = Phase.STOPPING, time.time()
            return
        self.phase = Phase.RUNNING
        for rank in adoption.lost_members():
            inc = d.incarnations.get(rank, 0)
            self.mail.put(msg.Kill(rank, inc))  # should its host come back
            self._death(Proc(rank, inc, None, self.log_dir, time.time()),
                        "was lost while the coordinators changed")
        abort = adoption.abort_reason()
        if abort is not None:
            self._abort(abort)
        elif self.phase is Phase.RUNNING and adoption.join:
            self.mail.put(msg.JoinRequest(d.gen))
            self.round.join_posted = True
            self.phase = Phase.GATHERING

    def _phase_starting(self, now: float) -> None:
        if now - self.t0 > self.config.startup_timeout:
            waiting = sorted(r for r, p in self.procs.items() if p.hello is None)
            self._finish_with(Status.FAILED, f"workers {waiting} did not start within "
                                        f"{self.config.startup_timeout:.0f} s (see their logs)")
            return
        if any(p.hello is None for p in self.procs.values()) or self.lib is None:
            if not self.procs and self.lib is None and not self.restart_at:
                last = last_line(self.first_death_log) if self.first_death_log else ""
                self._finish_with(Status.FAILED, f"every worker died before starting: {last} (see "
                                            f"the logs in {self.log_dir})")
            return
        if self.restart_at:
            return
        steps = {r: p.hello.steps for r, p in self.procs.items()}
        self._decide(steps, initial=not self.config.resume)

    def _phase_running(self, now: float) -> None:
        gen = self.gen
        if self.mail.count(msg.CommError, gen=gen) > 0:
            self._abort("a worker reported a communication error")
            return
        if (self._joiners() and not self._starting(now) or self.plan_switch) \
                and not self.round.join_posted:
            self.mail.put(msg.JoinRequest(gen))
            self.round.join_posted = True
            self.phase = Phase.GATHERING
            if self._joiners():
                self._event(EventKind.JOIN, "restarted workers " + ", ".join(
                    self._name(r) for r in self._joiners()) + " asked to join: switching at "
                    "an iteration boundary")
            else:
                self._event(EventKind.SWITCH, f"generation {gen}: switching to the refined "
                                              f"plan at an iteration boundary", gen=gen)
            return
        self._check_done()

    def _phase_gathering(self, now: float) -> None:
        gen = self.gen
        if self.round.aborted_at is None:
            if self.mail.count(msg.CommError, gen=gen) > 0:
                self._abort("a worker reported a communication error")
                return
            if self._check_done():
                return
        members = self._live_members()
        for ready in self._readys(gen, members):
            if ready.rank not in self.round.ready:
                self.round.ready[ready.rank] = ready.steps
                if ready.pending is not None:
                    self.round.pending[ready.rank] = ready.pending
                self.round.known[ready.rank] = ready.known()
        missing = [r for r in members if r not in self.round.ready]
        if missing:
            # A live worker blocked on a stuck peer notices within the group timeout; one that
            # has not reported by then (plus the hang timeout) is itself stuck.
            limit = self.config.pg_timeout + self.config.lease
            if self.round.aborted_at is not None and now - self.round.aborted_at > limit:
                for rank in missing:
                    self._event(EventKind.HANG, f"worker {self._name(rank)} did not leave "
                                                f"generation {gen} within {limit:.1f} s: "
                                                f"killing it", rank=rank)
                    self._kill(self.procs[rank], f"did not leave generation {gen}")
                self.round.aborted_at = now
            return
        steps = {r: self.round.ready[r] for r in members}
        for rank in self._joiners():
            steps[rank] = None
        dead_before = set(self.decision.dead)
        switched, self.plan_switch = self.plan_switch, False
        self._decide(steps, bug=self._bug() or ("preempted (SIGTERM)" if self.preempted
                                                 else None),
                     pending=self.round.pending, known=self.round.known)
        if self.decision is not None and set(self.decision.dead) == dead_before \
                and not any(v is None for v in steps.values()) and not switched:
            self.idle_reconfigurations += 1
            if self.idle_reconfigurations > 3:
                self._finish_with(Status.FAILED, "workers keep reporting communication errors "
                                            "although none died (see the logs)")
        else:
            self.idle_reconfigurations = 0

    def _phase_exiting(self, now: float) -> None:
        if not self.procs or now - self.exit_started > 60:
            self.outcome = (Status.COMPLETED, f"trained {self.final_iterations} iterations")

    def _phase_stopping(self, now: float) -> None:
        members = self._live_members()
        waiting = [r for r in members
                   if self.mail.get(msg.Stopped, gen=self.gen, rank=r) is None]
        if waiting and now - self.exit_started < 60:
            return
        restart = self.decision.restart
        folder = self._mark_checkpoint(restart, {"reason": self.decision.reason})
        if folder is not None:
            where = f"checkpoint of iteration {restart} (every stage) in {folder}"
        else:
            found = latest_checkpoint(self.run_dir)
            where = (f"latest complete checkpoint: iteration {found[0]} in {found[1]}"
                     if found else "no complete checkpoint (a stage's parameters died with "
                                   "its last worker; set checkpoint_every to keep some)")
        self.final_iterations = restart
        self.outcome = (Status.FAILED if self.bug else Status.STOPPED,
                        f"training stopped at iteration {restart}: {self.decision.reason}\n"
                        f"{where}" if self.bug else
                        f"training stopped at iteration {restart}: {self.decision.reason}; "
                        f"{where}")

    # -- decisions ---------------------------------------------------------------------------

    def _bug(self) -> str | None:
        """The first exception in user code a member reported in this generation, as the
        stop reason (its traceback is shown once, in the launcher's output)."""
        bug = self.mail.get(msg.Bug, gen=self.gen)
        if bug is None:
            return None
        self.bug = bug
        return (f"worker {self._name(bug.rank)} raised an exception in user code at "
                f"iteration {bug.iteration} (a bug, not a hardware failure: not re-routed)"
                f":\n{bug.traceback.rstrip()}")

    def _decide(self, steps: dict[int, int | None], initial: bool = False,
                bug: str | None = None, pending: dict[int, int] | None = None,
                known: dict[int, dict] | None = None) -> None:
        assert self.lib is not None
        lib = self.lib

        def lookup(dead):
            try:
                hit = lib.lookup(dead)
            except MissingPlan:
                if not self.config.on_demand:
                    raise
                return None
            return hit.file.name, hit.entry.metrics.degradation

        gen = self.gen + 1
        incs = {r: self.procs[r].incarnation for r in steps if r in self.procs}
        decision = P.decide(gen, lib.spec.pipelines, lib.spec.stages, steps, lookup, initial,
                            bug, incs, pending, known)
        if decision.action == "plan":
            try:
                self._plan_on_demand(decision.dead)
            except RecycleError as exc:  # e.g. no schedule fits the memory: a clean stop
                failed = f"planning dead workers {format_workers(decision.dead)} failed: {exc}"

                def lookup(dead):
                    raise RecycleError(failed)
            decision = P.decide(gen, lib.spec.pipelines, lib.spec.stages, steps, lookup,
                                initial, bug, incs, pending, known)
            assert decision.action != "plan"
        self.mail.post_decision(decision)
        if self.iterations is None:  # this attempt's first iteration
            self.iterations = IterationLog(self.mail, self.folder, lib.spec.pipelines,
                                           lib.spec.stages, lib.spec.microbatches,
                                           decision.restart, self.config.lease,
                                           step_reports(self.config.faults))
        self.gen, self.decision = gen, decision
        if self.config.checkpoint_every:  # the next one the workers will write
            every = self.config.checkpoint_every
            self.next_checkpoint = (decision.restart // every + 1) * every
        self.round = _Round()
        for rank in steps:
            proc = self.procs.get(rank)
            if proc is not None and self.mail.get(msg.Welcome, rank=rank,
                                                  incarnation=proc.incarnation) is None:
                welcome = gen if decision.action == "run" or steps[rank] is not None else -1
                self.mail.put(msg.Welcome(rank, proc.incarnation, welcome))
        if decision.action == "stop":
            self._event(EventKind.STOP, f"generation {gen}: {decision.reason.splitlines()[0]}",
                        gen=gen, restart=decision.restart)
            self.phase, self.exit_started = Phase.STOPPING, time.time()
            self._dismiss_newcomers()
            return
        joined = [r for r, k in steps.items() if k is None]
        period = lib.lookup(decision.dead, decision.plan).entry.period
        self._event(EventKind.GENERATION,
                    f"generation {gen}: {len(decision.members)} live workers, dead "
                    f"{format_workers(decision.dead)}, plan {decision.plan} (predicted "
                    f"degradation {round(decision.degradation, 4) + 0.0:+.1%}), from "
                    f"iteration {decision.restart}"
                    + (f"; {', '.join(self._name(r) for r in joined)} joined" if joined and
                       not initial else ""),
                    gen=gen, dead=[list(w) for w in decision.dead], plan=decision.plan,
                    degradation=decision.degradation, period=period, restart=decision.restart,
                    joined=joined if not initial else [],
                    steps={str(r): k for r, k in sorted(steps.items())},
                    pending={str(r): i for r, i in sorted((pending or {}).items())},
                    validated=sorted(decision.sums))
        self.phase = Phase.RUNNING
        self._maybe_refine(dead_per_stage(lib.spec, decision.dead))

    # -- plans made at run time ----------------------------------------------------------------

    def _plan_on_demand(self, dead) -> None:
        """Plan the dead set the library lacks, now, and add it (the training path waits for
        this one: it is the fast solver under `plan_budget`)."""
        lib = self.lib
        counts = dead_per_stage(lib.spec, dead)
        t0 = time.perf_counter()
        plan, placement = plan_on_demand(lib.spec, lib.policy, counts, lib.reference_period,
                                         self.config.plan_budget)
        entry = lib.add(plan, placement, ON_DEMAND)
        seconds = time.perf_counter() - t0
        what = f"dead {format_workers(dead)}" if dead else "the fault-free situation"
        self._event(EventKind.PLANNED,
                    f"the library has no plan for {what}: planned on demand in {seconds:.3f} s "
                    f"({entry.file}, period {entry.period:.4g} ms)",
                    counts=list(counts),
                    plan=entry.file, seconds=seconds, period=entry.period)

    def _maybe_refine(self, counts: tuple[int, ...]) -> None:
        """Start a background refinement of the plan now in use, if it asks for one."""
        entry = self.lib.entry(counts)
        if (entry is None or counts in self.refined or counts in self.refinements
                or not wants_refinement(entry, self.config.refine)
                or self.config.refine_budget <= 0):
            return
        self.refined.add(counts)
        out = self.run_dir / "refine" / f"k{'-'.join(map(str, counts))}.json.gz"
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"refine-{out.name[:-8]}.log", "wb") as log_file:
            popen = subprocess.Popen(
                refine_command(self.lib.folder, counts, self.config.refine_budget, out),
                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        self.refinements[counts] = _Refinement(counts, popen, out, time.time())
        self._event(EventKind.REFINE, f"refining the plan for per-stage dead {list(counts)} in the "
                                      f"background (budget {self.config.refine_budget:g} s)",
                    counts=list(counts))

    def _refinements_done(self, now: float) -> None:
        """Take in finished refinements: a plan better by the margin replaces the entry, and
        the survivors switch to it at the next iteration boundary if they run that situation."""
        for counts, job in list(self.refinements.items()):
            code = job.popen.poll()
            if code is None:
                continue
            del self.refinements[counts]
            if code != 0 or not job.out.is_file():
                self._event(EventKind.WARNING, f"the refinement of {list(counts)} failed (exit "
                                               f"status {code}; see logs/refine-*.log)")
                continue
            try:
                plan = read_plan(job.out)
            except RecycleError as exc:
                self._event(EventKind.WARNING, f"the refinement of {list(counts)} wrote no usable "
                                               f"plan: {exc}")
                continue
            current = self.lib.entry(counts)
            period = plan.metrics.period
            better = period < current.period * (1 - self.config.refine_margin)
            self._event(EventKind.REFINED,
                        f"refined plan for {list(counts)} after {now - job.started:.1f} s: "
                        f"period {period:.4g} ms against {current.period:.4g} ms"
                        + ("" if better else " (kept the current plan)"),
                        counts=list(counts), period=period, previous=current.period,
                        better=better)
            if not better:
                continue
            placement = tuple(tuple(g) for g in plan.mapping["placement"])
            self.lib.add(plan, placement, REFINED, refine_settings_hash(
                self.config.refine_budget))
            if self.phase is Phase.RUNNING and self.decision is not None and \
                    dead_per_stage(self.lib.spec, self.decision.dead) == counts:
                self.plan_switch = True

    def _stop_refinements(self) -> None:
        for job in self.refinements.values():
            if job.popen.poll() is None:
                job.popen.kill()
            job.popen.wait()
        self.refinements.clear()

    def _abort(self, reason: str) -> None:
        if self.phase is Phase.GATHERING and self.round.aborted_at is not None:
            return
        self.mail.put(msg.Abort(self.gen, reason))
        self.round.aborted_at = time.time()
        self.phase = Phase.GATHERING
        self._event(EventKind.ABORT, f"generation {self.gen} abandoned: {reason}", gen=self.gen)

    def _member_inc(self) -> Mapping[int, int]:
        """The incarnation of each member the current decision counts on."""
        return self.decision.incarnations if self.decision is not None else {}

    def _live_members(self) -> list[int]:
        """Members of the current generation whose process (that incarnation) still runs."""
        procs, incs = self.procs, self._member_inc()
        return [r for r in self.decision.members
                if r in procs and procs[r].incarnation == incs.get(r)]

    def _starting(self, now: float) -> list[int]:
        """Restarted processes that have not said hello yet, within the start-up timeout of
        their start. A join waits for them: a rebooted host's workers, started together but
        slow to start on a loaded machine, then join at one boundary, not one generation
        change each (the slow one counted dead in the first)."""
        return [r for r, p in self.procs.items() if p.hello is None and not p.killed
                and now - p.started < self.config.startup_timeout]

    def _joiners(self) -> list[int]:
        """Processes that said hello but are not (this incarnation) members: restarted
        workers waiting to join."""
        incs = self._member_inc()
        return sorted(r for r, p in self.procs.items()
                      if p.hello is not None and incs.get(r) != p.incarnation)

    def _readys(self, gen: int, members: list[int]) -> list[msg.Ready]:
        """The live members' `Ready`s of generation `gen` to take in: the round's first look
        reads every member's record; later ones only those taken in since the last look
        (`Mail.take_new`), where the mail can say (else every missing member's again).
        Looking up each missing member on every pass of a recovery cost the coordinator
        about 10 ms a pass at 8,192 ranks."""
        new = self.mail.take_new(msg.Ready)  # always taken: the next look starts here
        if new is None or not self.round.readys_scanned:
            self.round.readys_scanned = True
            return [ready for r in members if r not in self.round.ready
                    and (ready := self.mail.get(msg.Ready, gen=gen, rank=r)) is not None]
        incs = self._member_inc()
        return [ready for ready in new if ready.gen == gen and ready.rank in self.procs
                and self.procs[ready.rank].incarnation == incs.get(ready.rank)]

    def _check_done(self) -> bool:
        """Whether every live member is done. Not looked again while no `Done` arrived and
        no member died since the last look (`round.done_seen`; a mail that cannot count
        arrivals, `Mail.arrivals` None, is always looked at): scanning every member's
        record each pass took milliseconds at 8,192 ranks."""
        seen = (self.mail.arrivals(msg.Done), len(self.deaths))
        if seen[0] is not None and self.round.done_seen == seen:
            return False
        self.round.done_seen = seen
        members = self._live_members()  # Store.check is true when every key is there
        if not members or not self.mail.present(msg.Done,
                                          [{"gen": self.gen, "rank": r} for r in members]):
            return False
        done = self.mail.get(msg.Done, gen=self.gen, rank=members[0])
        self.final_iterations = done.steps
        self._mark_checkpoint(self.final_iterations)
        self.mail.put(msg.Finish(self.gen))
        self.phase, self.exit_started = Phase.EXITING, time.time()
        self._dismiss_newcomers()
        return True

    def _dismiss_newcomers(self) -> None:
        """Training is over: restarted workers that have not joined have nothing to do."""
        self.restart_at.clear()
        members = set(self._live_members())
        for rank, proc in list(self.procs.items()):
            if rank not in members:
                self._event(EventKind.DISMISS, f"restarted worker {self._name(rank)} arrived "
                                               f"after the end: stopping it", rank=rank)
                self._kill(proc, "arrived after the end")

    def _publish_progress(self, now: float) -> None:
        """Tell the host agents what is durable (`msg.Progress`: losses saved, the latest
        complete checkpoint, both known in memory), at most every quarter lease: they keep
        what they relayed from there on, for a coordinator that takes over
        (`relay.Journal`). It rides on the bulletin's next publication (at the latest the
        coordinator's beat): no control traffic of its own."""
        if self.iterations is None or now < self.progress_at:
            return
        progress = msg.Progress(self.iterations.next_loss, self.checkpointed)
        if progress != self.progress:
            self.mail.put(progress)
            self.progress, self.progress_at = progress, now + self.config.lease / 4

    def _checkpoints(self) -> None:
        every = self.config.checkpoint_every
        if not every or self.stages == 0:
            return
        k = self.next_checkpoint
        if self.mail.present(msg.CheckpointWritten,
                       [{"iteration": k, "stage": s} for s in range(self.stages)]):
            if self._mark_checkpoint(k) is not None:
                self._event(EventKind.CHECKPOINT, f"checkpoint of iteration {k} complete",
                            iteration=k)
            self.next_checkpoint += every

    def _mark_checkpoint(self, iteration: int, extra: dict | None = None) -> Path | None:
        """Mark the checkpoint of `iteration` complete if every stage wrote it (its folder,
        else None), and remember it as the latest if it is."""
        folder = write_manifest(self.run_dir, iteration, self.stages, extra)
        if folder is not None:
            self.checkpointed = max(self.checkpointed, iteration)
        return folder

    # -- the end -----------------------------------------------------------------------------

    def _finish_with(self, status: Status, message: str) -> None:
        self.outcome = (status, message)

    def _result(self) -> LaunchResult:
        status, message = self.outcome
        self.mail.refresh()  # the reports of the last pass
        n = self.final_iterations
        world = self.config.nproc
        spec = self.lib.spec if self.lib else None
        ends: list[float | None] = [None] * n
        gens: list[int] = [-1] * n
        if self.iterations is not None:
            self.iterations.save(time.time(), upto=n)
            ends, gens = self.iterations.ends_upto(n)
            ends = [e - self.t0 if e is not None else None for e in ends]
        saved = self.folder.saved_losses()  # this attempt's and the earlier ones'
        losses = [saved.get(i) for i in range(n)]
        recoveries = []
        for death in self.deaths:
            after = [(i, e) for i, (e, g) in enumerate(zip(ends, gens))
                     if e is not None and g > death.gen]
            if after:
                i, e = after[0]
                formed = [ev.t for ev in self._events_of(EventKind.GENERATION)
                          if ev.data["gen"] > death.gen]
                recoveries.append(Recovery(death.worker, death.t, i, e - death.t,
                                           formed[0] - death.t if formed else None))
        for fault in self.config.faults:
            if fault.point != "hold" and self.mail.get(msg.FaultFired, rank=fault.rank,
                                                 incarnation=0) is None:
                self._event(EventKind.WARNING, f"fault {fault} never fired (no such point in the "
                                               f"plan, or training ended first)")
        op_times = {}
        for rank in range(world):
            times = self.mail.get(msg.OpTimes, rank=rank)
            if times is not None:
                op_times[self._name(rank)] = times.times
        self._event(EventKind.END, message, status=status)
        found = latest_checkpoint(self.run_dir) if self.stages else None
        record = self.folder.record
        generations = self._generation_records(ends, gens, op_times)
        result = LaunchResult(status, message, n, losses, ends, self.events, recoveries,
                              str(found[1]) if found else None, str(self.run_dir),
                              spec.to_dict() if spec is not None else None, op_times,
                              record.run_id, record.attempt,
                              [g if g >= 0 else None for g in gens],
                              self.lib.reference_period if self.lib else None, generations)
        write_json(self.run_dir / "result.json", result.to_dict())
        return result

    def _generation_records(self, ends: list, gens: list[int], op_times: dict
                            ) -> list[GenerationRecord]:
        steps: dict[int, list[float]] = {}
        for i in range(1, len(ends)):
            if gens[i] >= 0 and gens[i] == gens[i - 1] and None not in (ends[i], ends[i - 1]):
                steps.setdefault(gens[i], []).append(1e3 * (ends[i] - ends[i - 1]))
        records = []
        for event in self._events_of(EventKind.GENERATION):
            data = event.data
            gen, dead = data["gen"], tuple(tuple(w) for w in data["dead"])
            records.append(GenerationRecord(
                gen, dead, data["plan"], data["period"], data["degradation"],
                sum(1 for g in gens if g == gen), _median(steps.get(gen, [])),
                self._replayed(gen, dead, data["plan"], op_times)))
        return records

    def _replayed(self, gen: int, dead, plan: str, op_times: dict) -> float | None:
        """The generation's plan re-timed with the op costs its workers measured."""
        spec = self.lib.spec
        costs = stage_costs(op_times, gen, spec.stages)
        if not op_times or any(not c.ms for c in costs):
            return None
        try:
            return replay_period(self.lib.lookup(dead, plan).plan(), measured_spec(spec, costs))
        except RecycleError as exc:
            log.warning("cannot replay generation %d's plan: %s", gen, exc)
            return None

    # -- helpers -----------------------------------------------------------------------------

    def _name(self, rank: int) -> str:
        if not self.stages:
            return f"rank {rank}"
        d, s = P.worker_of(rank, self.stages)
        return f"{d}:{s}"

    def _event(self, kind: EventKind, message: str, **data: Any) -> None:
        event = Event(round(time.time() - self.t0, 4), kind, message, data)
        self.events.append(event)
        log.info("%s", message)
        if self.on_event is not None:
            self.on_event(event)

    def _events_of(self, kind: EventKind) -> list[Event]:
        return [e for e in self.events if e.kind is kind]


PHASES: dict[Phase, Callable[[Agent, float], None]] = {
    Phase.ADOPTING: Agent._phase_adopting,
    Phase.STARTING: Agent._phase_starting,
    Phase.RUNNING: Agent._phase_running,
    Phase.GATHERING: Agent._phase_gathering,
    Phase.EXITING: Agent._phase_exiting,
    Phase.STOPPING: Agent._phase_stopping,
}
"""What the launcher does in each phase, on every pass of its loop (the same for the
coordinator, which differs only in how it learns of its workers)."""
