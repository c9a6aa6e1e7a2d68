"""One worker process: build its stage, then train generation after generation until done.

The launcher (`agent.py`) starts one process per physical worker (pipeline d, stage s) with
torchrun's environment variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and
its own settings in RECYCLE_CONFIG. Ranks are pipeline-major: rank = d * S + s.

A worker's life (see `protocol.py` for the launcher's side):

1. Build stage s and its optimizer; learn the shape of the activations it receives (stage s-1
   publishes its output shape in the store, stage 0 reads one sample); say hello.
2. Wait to be welcomed into a generation; read its decision (members, dead workers, restart
   iteration, who copies state to whom).
3. Run the generation: undo the latest optimizer step if the stage is one step ahead of the
   restart iteration, form the generation's groups, copy state to or from a peer, look up the
   plan for the dead set in the library, and run iterations. At each iteration start it
   checks whether a restarted worker asked to join (then the members agree on an iteration
   boundary two iterations ahead and leave the generation there).
4. On any communication error (a dead peer, the launcher's abort) leave the generation at
   once (closing the groups tells every peer), report the step count, and wait for the next
   decision; on `stop` write the stage's checkpoint and exit.

A heartbeat thread keeps the launcher informed that the process is alive and watches for the
launcher's abort notice.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import os
import resource
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map

from recycle_planner.errors import RecycleError
from recycle_planner.executor.control import messages as msg
from recycle_planner.executor.control import protocol as P
from recycle_planner.executor.control.link import LOST, ControlLost, Link, link_from_env
from recycle_planner.executor.control.runfolder import append_losses
from recycle_planner.executor.config import (CONFIG_ERROR, COORDINATOR_LOST, EXECUTOR_ERROR,
                                             FENCED, HOST_AGENT_LOST, STALLED, WorkerConfig)
from recycle_planner.executor.data.boundary import Layout, call, layout_of
from recycle_planner.executor.data.comm import PeerFailure, prepare, short_error
from recycle_planner.executor.data.generation import Generation
from recycle_planner.executor.data.runtime import StageRuntime, bind, new_op_times
from recycle_planner.executor.data.shapes import input_layout, output_layout
from recycle_planner.executor.data.state import (StageState, latest_checkpoint,
                                                 load_stage_checkpoint, write_manifest,
                                                 write_stage_checkpoint)
from recycle_planner.executor.faults import Fault, FaultInjector
from recycle_planner.executor.job import Job, load_job
from recycle_planner.library import PlanLibrary
from recycle_planner.programs import compile_program

log = logging.getLogger(__name__)


def run(job: Job) -> None:
    """Train `job` as the worker this process was started as; returns when training is over
    (complete, or stopped by the launcher). Call it from the training script that
    `recycle-planner launch` starts, or let the launcher call it for a `FILE.py:FUNCTION` job."""
    Worker(job, WorkerConfig.from_env()).run()


class Worker:
    """Where the control plane (`self.link`: membership, generations, leases, stop) and the
    data plane (`Generation`: groups, ops, step, abort) meet."""

    def __init__(self, job: Job, config: WorkerConfig, link: Link | None = None):
        self.job = job
        self.config = config
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        _setup_logging(self.rank, self.incarnation)
        torch.set_num_threads(config.threads)
        library = config.library or job.library
        if library is None:
            raise RecycleError("the job names no plan library: set Job.library or pass "
                               "--library (or --spec, to plan on demand) to the launcher")
        self.library_path = str(library)
        self.lib = PlanLibrary.open(library)
        spec = self.lib.spec
        self.S, self.D, self.M = spec.stages, spec.pipelines, spec.microbatches
        if self.world != self.D * self.S:
            raise RecycleError(f"{self.world} workers were started but the plan library is for "
                               f"{self.D} pipelines x {self.S} stages = {self.D * self.S}")
        if len(job.stages) != self.S:
            raise RecycleError(f"the job has {len(job.stages)} stages but the plan library "
                               f"has {self.S}")
        self.d, self.s = P.worker_of(self.rank, self.S)
        self.device = prepare(config.backend, os.environ)
        self.timeout = timedelta(seconds=config.pg_timeout)
        self.link = _Tracked(link or link_from_env(config))
        self._link_asked = time.monotonic()   # when the link's watch thread last asked
        self._lost_once = threading.Lock()    # one thread stops the worker on a lost control
        self._recent_losses: dict[int, dict] = {}
        module = job.build_stage(self.s).to(self.device)
        optimizer, scheduler = job.build_state(module)
        self.state = StageState(module, optimizer, scheduler=scheduler,
                                undo_copy=config.undo_copy)
        self.has_state = self.incarnation == 0
        if config.resume and self.has_state:
            self._resume()
        self.faults = FaultInjector([Fault.from_dict(f) for f in config.faults], self.rank,
                                    self.incarnation, self._announce_fault, self._stepped,
                                    self._have_stepped, config.lease / 2)
        self._lock = threading.Lock()
        self._aborts: dict[int, threading.Event] = {}
        """Per generation: set once the control plane abandoned it (`_abort`)."""
        self._lost = False
        self._stopped = False
        self._plans: dict[str, Any] = {}
        self.runtime: StageRuntime | None = None
        self.generation: Generation | None = None
        self.decision: P.Decision | None = None

    # -- life ---------------------------------------------------------------------------------

    def run(self) -> None:
        self.link.watch(self._beat, self._watched_by_link, self._on_abort)
        threading.Thread(target=self._stall_watch, name="recycle-stall", daemon=True).start()
        threading.Thread(target=self._control_watch, name="recycle-control-watch",
                         daemon=True).start()
        _on_sigterm(self.config.grace)
        try:
            self._live()
        except ControlLost as exc:
            self._coordinator_lost(str(exc))
        except ExecutorError as exc:
            log.error("%s", exc)
            self.link.close()
            _exit(EXECUTOR_ERROR)
        finally:
            self.link.close()

    def _live(self) -> None:
        in_layout, out_layout = self._layouts()
        self.op_times: dict[int, dict[str, list[float]]] = {}
        """Per generation: the runtime's op times (`StageRuntime.op_times`) in it."""
        self.runtime = StageRuntime(self.state, self.job.loss_fn, self.job.data, self.s, self.S,
                                    self.D, self.M, self.device, in_layout, out_layout,
                                    self.job.step_hook, self.job.autocast_dtype(),
                                    self.job.dynamic, self.config.bucket_mb)
        self.runtime.on_counted = self.faults.counted
        # Everything built so far lives until the end: keep the collector off it, so that
        # the collection that closes a broken generation's groups takes microseconds.
        gc.freeze()
        self.link.send(msg.Hello(self.rank, self.incarnation, os.getpid(), socket.gethostname(),
                                 self.library_path,
                                 self.state.steps if self.has_state else None))
        gen = self.link.wait(msg.Welcome, rank=self.rank, incarnation=self.incarnation).gen
        if gen < 0:
            log.info("training ended before this worker could join")
            return self._quit()
        decision = self.link.decision(gen)
        while True:
            if decision.excludes(self.rank, self.incarnation):
                return self._fenced(decision)
            self.decision = decision
            self._settle(decision)
            if decision.action == "stop":
                return self._stop(decision)
            outcome = self._generation(decision)
            if outcome == "done" and self._finished(decision.gen):
                return self._quit()
            self.link.send(self._ready(decision.gen, outcome))
            decision = self.link.decision(decision.gen + 1)

    def _ready(self, gen: int, outcome: str) -> msg.Ready:
        """What this worker reports when it leaves generation `gen`: its counted steps, its
        pending step and the all-stage sums it knows (`validation.py`)."""
        if not self.has_state:
            return msg.Ready(gen, self.rank, None, outcome)
        validation = self.runtime.validation
        known = validation.known() if validation is not None else {}
        return msg.Ready(gen, self.rank, self.state.steps, outcome,
                         self.runtime.pending_step(), tuple(sorted(known.items())))

    def _settle(self, decision: P.Decision) -> None:
        """Settle a step taken before its all-stage sum was known, as the decision says:
        validated with the sum it carries (redone if the guess was wrong), or reverted."""
        runtime = self.runtime
        iteration = runtime.pending_step()
        if iteration is None:
            return
        runtime.op_times = self.op_times.setdefault(decision.gen, new_op_times())
        t0 = time.monotonic()
        settled = runtime.validation.settle_with(decision.sums)
        seconds = time.monotonic() - t0
        runtime.count_settled(settled, seconds, seconds)
        log.info("generation %d: the pending step of iteration %d is %s", decision.gen,
                 iteration, "reverted (no survivor knows its sum)" if not settled.counted
                 else "validated and redone" if settled.redone else "validated")

    def _generation(self, decision: P.Decision) -> str:
        """Run one generation; returns 'done', 'switch' (membership changes at an iteration
        boundary) or 'failure'."""
        gen = decision.gen
        if self.has_state:
            self.state.rollback_to(decision.restart)
        runtime = self.runtime
        runtime.reset()
        runtime.op_times = self.op_times.setdefault(gen, new_op_times())
        runtime.on_step = lambda it, losses: self._record_losses(gen, it, losses)
        generation = Generation(decision, runtime, self.link.group_store(decision),
                                self.config.backend, self.rank, self.s, self.S, self.timeout,
                                self.config.poll, self._program, self._abort_event(gen))
        with self._lock:
            self.generation = generation
        self._iteration = decision.restart
        failure, t_fail = "", 0.0
        try:
            self.has_state = generation.open(self.has_state)
            if self._iterations(generation, decision) is None:
                return "switch"
            self._checkpoint(decision, self.job.iterations, final=True)
            self.link.send(msg.OpTimes(self.rank, self.op_times))
            self._log_buffers(generation)
            if self.device.type == "cuda":  # benchmarks/gpu_check.py reads it
                free, total = torch.cuda.mem_get_info(self.device)
                log.info("peak device memory %d bytes; in use on the device %d bytes, "
                         "reserved by torch %d bytes",
                         torch.cuda.max_memory_allocated(self.device), total - free,
                         torch.cuda.memory_reserved(self.device))
            return "done"
        except PeerFailure as exc:
            failure = str(exc)
            t_fail = time.perf_counter()
        except ControlLost:
            raise
        except Exception as exc:  # noqa: BLE001 - user code (model, loss, data): a bug
            if not isinstance(exc, RecycleError) and not raised_in_user_code(exc):
                failure = "executor error"
                raise ExecutorError(f"the executor (not user code) raised at iteration "
                                    f"{self._iteration}: this worker leaves as failed\n"
                                    f"{traceback.format_exc().rstrip()}") from None
            # bad input the executor diagnosed (a shape beyond its maximum): its one line
            failure = str(exc) if isinstance(exc, RecycleError) else traceback.format_exc()
            t_fail = time.perf_counter()
            if generation.explains(exc):  # fed a failed operation's garbage, not a bug
                failure = f"user code raised after an operation failed: {short_error(exc)}"
            else:
                log.error("user code raised at iteration %d: stopping the whole job\n%s",
                          self._iteration, failure.rstrip())
                # The first report wins; the launcher stops the job instead of re-routing.
                self.link.send(msg.Bug(gen, self.rank, self._iteration, failure))
        finally:
            # Drop every reference to the groups (pending receives included) and close them:
            # that is what tells the peers blocked on this worker. This runs after the except
            # clause, whose traceback still holds frames that reference pending work.
            with self._lock:
                self.generation = None
            generation.close(failed=bool(failure))
        log.warning("generation %d abandoned at iteration %d (groups closed in %.0f ms): %s",
                    gen, self._iteration, 1e3 * (time.perf_counter() - t_fail), failure)
        self.link.send(msg.CommError(gen, self.rank))
        self.faults.on_recovery(self._iteration)
        return "failure"

    def _iterations(self, generation: Generation, decision: P.Decision) -> int | None:
        """Run iterations until the job's last (returns it) or until the members leave the
        generation at an agreed boundary for a re-join or a plan switch (returns None)."""
        gen = decision.gen
        iteration = self._iteration = decision.restart
        switch_at = None
        while iteration < self.job.iterations:
            if self.faults.active and decision.dead and self.faults.at(iteration, "hold"):
                if self.link.wait(msg.JoinRequest, generation.aborted, gen=gen) is None:
                    raise PeerFailure("the launcher abandoned this generation")
            if switch_at is None and self.link.peek(msg.JoinRequest, gen=gen) is not None:
                switch_at = self.link.send(msg.SwitchAt(gen, iteration + 2)).iteration
                log.info("a worker asks to join: switching at iteration %d", switch_at)
            if switch_at is not None and iteration >= switch_at:
                self.runtime.validate()
                generation.end(self.config.pg_timeout)
                return None
            if self.faults.active:
                self.faults.trigger(iteration, "start")
            generation.run_iteration(iteration, self.faults)
            iteration = self._iteration = iteration + 1
            self.link.send(msg.IterationDone(iteration - 1, self.rank, gen, time.time()))
            self._checkpoint(decision, iteration)
        self.runtime.validate()
        generation.end(self.config.pg_timeout)
        return iteration

    def _finished(self, gen: int) -> bool:
        """Report done and wait for everyone: True when the launcher says the job is complete,
        False when a failure elsewhere means the last iterations must be redone."""
        self.link.send(msg.Done(gen, self.rank, self.state.steps))
        return self.link.wait(msg.Finish, self._abort_event(gen), gen=gen) is not None

    def _stop(self, decision: P.Decision) -> None:
        if self.has_state and self.rank in decision.members:
            self.state.rollback_to(decision.restart)
            if self.rank == min(r for r in decision.members if r % self.S == self.s):
                write_stage_checkpoint(self.config.run_dir, decision.restart, self.s, self.state)
                self.link.send(msg.CheckpointWritten(decision.restart, self.s))
        log.warning("training stopped: %s", decision.reason)
        self.link.send(msg.Stopped(decision.gen, self.rank))
        self._quit()

    def _fenced(self, decision: P.Decision) -> None:
        """A decision that excludes this process: the control plane declared it dead (its lease
        expired while it was cut off or stopped) or a newer incarnation replaced it. It must
        not act on the decision (it would run a plan that counts on other ranks): it leaves."""
        log.warning("generation %d excludes this worker (rank %d, incarnation %d): declared dead "
                    "while it could not be reached; leaving without acting on it", decision.gen,
                    self.rank, self.incarnation)
        self._stopped = True
        self.link.close()
        _exit(FENCED)

    def _quit(self) -> None:
        log.info("worker leaves")
        self._stopped = True

    # -- pieces of a generation ----------------------------------------------------------------

    def _program(self, decision: P.Decision):
        hit = self.lib.lookup(decision.dead, decision.plan)  # the decided one, even if replaced
        key = str(hit.file)
        if key not in self._plans:
            self._plans[key] = hit.plan()
        # Only this worker's program; the library checked the plan's order on NCCL once.
        return bind(compile_program(self._plans[key], self.rank, hit.mapping),
                    list(decision.members))

    def _record_losses(self, gen: int, iteration: int, losses: dict) -> None:
        if losses:
            # kept for a lost control plane: the iterations trained since it was last heard
            # of, within the lease it takes to notice (a few at most; 16 bounds it)
            self._recent_losses[iteration] = losses
            self._recent_losses.pop(iteration - 16, None)
            self.link.send(msg.Losses(iteration, self.rank, gen, tuple(
                (p, m, v) for (p, m), v in sorted(losses.items()))))

    def _checkpoint(self, decision: P.Decision, steps: int, final: bool = False) -> None:
        every = self.config.checkpoint_every
        if not final and not (every and steps % every == 0):
            return
        self.runtime.validate()  # the checkpoint holds counted steps only
        if self.rank == self._stage_writer(decision):
            write_stage_checkpoint(self.config.run_dir, steps, self.s, self.state)
            self.link.send(msg.CheckpointWritten(steps, self.s))

    def _stage_writer(self, decision: P.Decision) -> int:
        """The member that writes its stage's checkpoint: the stage's first."""
        return min(r for r in decision.members if r % self.S == self.s)

    def _coordinator_lost(self, reason: str) -> None:
        """The control plane is gone, so no decision can come: write this stage's state after
        its current step count n and, when the latest step can be undone, after n - 1. Stages
        differ by at most one step, so every stage writes the least count among them and
        that checkpoint completes (whoever writes last adds the manifest); `--resume`
        continues from the newest complete one. A worker that lost its own host agent
        (`orphaned`) writes nothing: the coordinator re-routes around its host, and a stale
        state or loss from it must not mix with what the survivors write."""
        if not self._lost_once.acquire(blocking=False):
            while True:  # the other thread stops the worker (and exits the process)
                time.sleep(3600)
        if self.link.orphaned:
            log.error("lost its host agent (%s): the job goes on without this host; leaving "
                      "without writing anything", reason)
            self._stopped = True
            _exit(HOST_AGENT_LOST)
        log.error("lost the coordinator (%s): stopping with a checkpoint", reason)
        self._stopped = True
        if self.runtime is not None:
            self.runtime.reset()
            if self.runtime.pending_step() is not None:  # no decision can settle it
                self.runtime.validation.settle_alone()
        decision = self.decision
        written = []
        if self.has_state and decision is not None and decision.action == "run" and \
                self.rank == self._stage_writer(decision):
            steps = self.state.steps
            write_stage_checkpoint(self.config.run_dir, steps, self.s, self.state)
            written.append(steps)
            if steps > 0 and self.state.can_undo:
                self.state.rollback_to(steps - 1)
                write_stage_checkpoint(self.config.run_dir, steps - 1, self.s, self.state)
                written.append(steps - 1)
            for k in written:
                if write_manifest(self.config.run_dir, k, self.S, {"reason": reason}):
                    log.info("checkpoint of iteration %d complete", k)
        self._save_recent_losses()
        log.error("stage %d's state written for iteration(s) %s in %s", self.s,
                  written or "none (not this stage's writer)", self.config.run_dir)
        _exit(COORDINATOR_LOST)

    def _save_recent_losses(self) -> None:
        """The losses of the last iterations, which may not have reached the lost control
        plane, into the run folder's losses.jsonl (every last-stage worker holds all D*M of
        them), so that the resumed run's result has every iteration's loss."""
        rows = [{"iteration": i, "loss": sum(v.values()) / len(v), "gen": None,
                 "attempt": None}
                for i, v in sorted(self._recent_losses.items()) if len(v) == self.D * self.M]
        try:
            append_losses(self.config.run_dir, rows)
        except OSError as exc:
            log.error("could not save the last losses: %s", exc)

    def _resume(self) -> None:
        found = latest_checkpoint(self.config.run_dir)
        if found is None:
            raise RecycleError(f"--resume: no complete checkpoint in "
                               f"{Path(self.config.run_dir) / 'checkpoints'}")
        iteration, folder = found
        self.state.load(load_stage_checkpoint(folder, self.s))
        log.info("resumed stage %d from %s (iteration %d)", self.s, folder, iteration)

    # -- shapes, heartbeats, aborts, stalls ------------------------------------------------------

    def _layouts(self):
        """What this stage receives and sends (`boundary.Layout`), through the control plane:
        stage s-1 publishes its output's; stage 0 reads one sample. None at the pipeline's
        ends."""
        in_layout = None
        if self.s > 0:
            in_layout = Layout.from_json(self.link.wait(msg.Shape, stage=self.s - 1).layout)
        out_layout = None
        if self.s < self.S - 1:
            def trace(value: Any) -> Layout:
                return _output_layout(self.state.module, value, self.device,
                                      self.job.autocast_dtype())

            dims = self.job.dynamic
            if dims is None:
                out_layout = trace(self.job.data(0, 0, 0)[0] if self.s == 0
                                   else in_layout.meta())
            else:
                inp = in_layout if self.s > 0 else input_layout(dims, self.job.data, self.D,
                                                                self.M)
                out_layout = output_layout(inp, dims, trace, f"stage {self.s}'s output")
            self.link.send(msg.Shape(self.s, out_layout.to_json()))
        return in_layout, out_layout

    def _beat(self) -> msg.Heartbeat:
        return msg.Heartbeat(self.rank, self.incarnation, time.time())

    def _watched_by_link(self) -> int:
        """`_watched`, asked by the link's watch thread before each of its store reads: when
        it stops asking, a read is stuck (`_control_watch`)."""
        self._link_asked = time.monotonic()
        return self._watched()

    def _watched(self) -> int:
        """The generation whose abort the link watches (-1: none)."""
        generation = self.generation
        if generation is not None:
            return generation.decision.gen
        decision = self.decision
        return decision.gen if decision is not None and decision.action == "run" else -1

    def _on_abort(self, gen: int, reason: str) -> None:
        """The control plane abandoned generation `gen` (or is lost): abort its groups on a
        thread of their own, so that the link's threads never wait for an abort."""
        threading.Thread(target=self._abort, args=(gen, reason == LOST), name="recycle-abort",
                         daemon=True).start()

    def _abort_event(self, gen: int) -> threading.Event:
        """Generation `gen`'s abandon flag (already set once the control plane is lost)."""
        with self._lock:
            event = self._aborts.setdefault(gen, threading.Event())
            if self._lost:
                event.set()
            return event

    def _abort(self, gen: int, lost: bool) -> None:
        with self._lock:
            self._lost = self._lost or lost
            events = list(self._aborts.values()) if lost else []
            generation = self.generation
        for event in [*events, self._abort_event(gen)]:
            event.set()
        if generation is not None and (lost or generation.decision.gen == gen):
            generation.abort()

    def _stall_watch(self) -> None:
        """The worker's own progress, judged by the device: an op that runs for longer than
        the lease while nothing it waits for is pending is a stall, and the worker leaves
        (the launcher then sees a dead worker). While the device waits for a work not yet
        complete (`Comm.waiting_on_peer`), the worker waits on a peer, whichever call the
        host blocks in (on NCCL: a `.tolist()`, a `.to(device)`, a pinned allocation, the
        step gate; `Comm.wait` returns at once there), and the clock restarts."""
        lease = self.config.lease
        peer_seen = checked = time.monotonic()
        while not self._stopped:
            now = time.monotonic()
            if now - checked > 1.0:  # this process was stopped (SIGSTOP): no time of its own
                peer_seen = now
            checked = now
            runtime = self.runtime
            comm = runtime.comm if runtime is not None else None
            started = runtime.op_started if runtime is not None else None
            if comm is not None and comm.waiting_on_peer():
                peer_seen = time.monotonic()
            elif started is not None and comm is not None:
                busy = time.monotonic() - max(started, comm.waited, peer_seen)
                if busy > lease and runtime.op_started == started:
                    log.error("the training thread made no progress for %.1f s outside "
                              "communication (lease %.1f s): a stall; leaving", busy, lease)
                    for handler in logging.getLogger().handlers:
                        handler.flush()
                    os._exit(STALLED)
            time.sleep(min(0.02, self.config.heartbeat))

    def _control_watch(self) -> None:
        """A control plane that cannot be reached without closing a socket (its link cut, its
        host gone): the store's reads then block until TCP gives up (about 15 minutes), and
        its writes go into the socket's buffer unanswered, so the link never says so. The
        link's watch thread asks which generation to watch before each read (every 20 ms);
        not asked for a lease, a read is stuck: the control plane is lost. Abort the
        generation (a training thread blocked on a peer is released and then blocks on the
        store too), wait up to a lease for the
        training thread to be in a control call (its state is then at a step boundary) and
        stop with a checkpoint from here, as the training thread would on `ControlLost`."""
        lease, beat = self.config.lease, self.config.heartbeat
        checked = time.monotonic()
        while not self._stopped:
            time.sleep(min(0.05, beat))
            now = time.monotonic()
            if now - checked > 1.0:  # this process was stopped: give the link its chance
                self._link_asked = max(self._link_asked, now)
            checked = now
            silent = now - self._link_asked
            if silent <= lease + beat or self._stopped:
                continue
            log.error("no answer from the control plane for %.1f s: it is lost", silent)
            self._on_abort(self._watched(), LOST)
            deadline = time.monotonic() + lease
            while self.link.in_call is None and time.monotonic() < deadline:
                time.sleep(0.01)
            if self.link.in_call is None:  # the training thread is stuck elsewhere
                log.error("the training thread is not at a step boundary: no checkpoint")
                _exit(HOST_AGENT_LOST if self.link.orphaned else COORDINATOR_LOST)
            self._coordinator_lost(f"no answer for {silent:.1f} s (link cut or its host "
                                   f"gone)")

    def _announce_fault(self, fault: Fault) -> None:
        self.link.send(msg.FaultFired(self.rank, self.incarnation, time.time(), str(fault)))

    def _log_buffers(self, generation: Generation) -> None:
        """The message buffers the last generation held at most, against one per sending op
        (what the send side kept before its pool), and the process's peak resident memory
        (benchmarks/bench_memory.py reads it)."""
        rt = self.runtime
        sends = sum(1 for kind, _ in generation.program.issues if kind == "send")
        log.info("message buffers: receive pool %d (%d bytes), send pool %d (%d bytes), "
                 "sends per iteration %d; max RSS %d bytes", rt.recv_pool.peak,
                 rt.recv_pool.nbytes, rt.send_pool.peak, rt.send_pool.nbytes, sends,
                 resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

    def _stepped(self, iteration: int) -> None:
        self.link.send(msg.Stepped(iteration, self.rank))

    def _have_stepped(self, iteration: int, ranks: tuple[int, ...]) -> bool:
        return all(self.link.peek(msg.Stepped, iteration=iteration, rank=r) is not None
                   for r in ranks)


def _output_layout(module: torch.nn.Module, sample: Any, device: torch.device,
                   autocast: torch.dtype | None) -> Layout:
    """The layout of the stage's output, from a copy of the module on the meta device (no
    compute, no side effects); modules that cannot run on meta, and mixed precision, run a
    copy on zeros."""
    def run(on: torch.device, value: Any):
        context = torch.autocast(device.type, dtype=autocast) if autocast is not None \
            else contextlib.nullcontext()
        with torch.no_grad(), context:
            return call(copy.deepcopy(module).to(on), value)

    try:
        if autocast is not None:  # autocast does not act on meta tensors: run for real
            raise NotImplementedError
        out = run(torch.device("meta"), tree_map(lambda t: t.to("meta"), sample))
    except Exception:  # noqa: BLE001 - any failure on meta: fall back to real compute
        out = run(device, tree_map(lambda t: torch.zeros_like(t, device=device), sample))
    return layout_of(out)


class _Tracked:
    """The worker's link, noting when the training thread is inside a control call (where
    its state is at a step boundary, so that a lost control plane can be checkpointed from
    another thread while it blocks there)."""

    def __init__(self, link: Link):
        self._link = link
        self.in_call: float | None = None

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._link, name)
        if name not in ("send", "wait", "peek", "decision") or \
                threading.current_thread() is not threading.main_thread():
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.in_call = time.monotonic()
            try:
                return attr(*args, **kwargs)
            finally:
                self.in_call = None
        return call


class ExecutorError(RecycleError):
    """An error raised inside the executor's own code during a generation: this worker fails
    (a death, re-routed like any other), the job does not stop as for a user's bug."""


_PACKAGE = str(Path(__file__).resolve().parents[1])
_STDLIB = os.path.dirname(os.__file__)


def raised_in_user_code(exc: BaseException) -> bool:
    """Whether user code (the model, loss, data, optimizer: the job's files, and torch or
    any library they call) was running when `exc` was raised: some frame of its traceback is
    outside this package and the standard library. An error whose every frame is the
    executor's own (say a `list.index` in comm.py) is not the user's bug."""
    frames = traceback.extract_tb(exc.__traceback__)
    return any(not f.filename.startswith((_PACKAGE, _STDLIB)) for f in frames)


def _on_sigterm(grace: float) -> None:
    """SIGTERM (preemption: SLURM and Kubernetes signal every process of the job) does not
    kill a worker at once: its launcher (or coordinator), signalled too, aborts the
    generation and decides a stop, so every worker undoes a half-finished iteration and the
    stage's first live worker writes a consistent checkpoint. Should no stop come (only this
    process was signalled), the worker leaves after `grace` seconds like a killed one."""
    if threading.current_thread() is not threading.main_thread():
        return

    def leave_later(signum, frame) -> None:
        log.warning("SIGTERM: waiting up to %.0f s for the launcher's stop", grace)
        timer = threading.Timer(grace, lambda: (log.error("no stop within the grace period: "
                                                          "leaving"), _exit(128 + signum)))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, leave_later)


def _setup_logging(rank: int, incarnation: int) -> None:
    level = os.environ.get("RECYCLE_LOG_LEVEL", "INFO")
    logging.basicConfig(level=level, format=f"%(asctime)s rank {rank}.{incarnation} "
                                            f"%(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> None:
    """`python -m recycle_planner.executor FILE.py:FUNCTION [ARGS...]`: what the launcher starts
    for a job given as a factory."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        raise SystemExit("usage: python -m recycle_planner.executor FILE.py:FUNCTION [ARGS...]")
    try:
        run(load_job(args[0], args[1:]))
    except RecycleError as exc:
        logging.getLogger("recycle_planner").error("%s", exc)
        raise SystemExit(CONFIG_ERROR) from None
    # Training is over and every file is written: skip the interpreter's teardown, which
    # takes seconds with torch loaded and would delay the launcher's end of the job.
    _exit(0)


def _exit(status: int) -> None:
    """Leave without the interpreter's teardown (and without destroying groups whose peers
    may be gone, which would block or abort)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


