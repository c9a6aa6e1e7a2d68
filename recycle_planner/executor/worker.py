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
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from recycle_planner.errors import RecycleError
from recycle_planner.executor import protocol as P
from recycle_planner.executor.boundary import Layout, call, layout_of
from recycle_planner.executor.comm import Comm, PeerFailure, prepare, short_error
from recycle_planner.executor.config import (CONFIG_ERROR, COORDINATOR_LOST, STALLED,
                                             WorkerConfig)
from recycle_planner.executor.faults import Fault, FaultInjector
from recycle_planner.executor.job import Job, load_job
from recycle_planner.executor.runtime import StageRuntime, bind, new_op_times
from recycle_planner.executor.shapes import input_layout, output_layout
from recycle_planner.executor.state import (StageState, latest_checkpoint,
                                            load_stage_checkpoint, write_manifest,
                                            write_stage_checkpoint)
from recycle_planner.job.workers import format_workers
from recycle_planner.library import PlanLibrary
from recycle_planner.programs import compile_program

log = logging.getLogger(__name__)

def run(job: Job) -> None:
    """Train `job` as the worker this process was started as; returns when training is over
    (complete, or stopped by the launcher). Call it from the training script that
    `recycle-planner launch` starts, or let the launcher call it for a `FILE.py:FUNCTION` job."""
    Worker(job, WorkerConfig.from_env()).run()


class Worker:
    def __init__(self, job: Job, config: WorkerConfig):
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
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.store = dist.TCPStore(host, port, is_master=False, timeout=self.timeout)
        # The heartbeat thread's own connection fails within the lease when the coordinator
        # is gone, so that the worker can stop with a checkpoint while it still can.
        self._watch_store = dist.TCPStore(host, port, is_master=False,
                                          timeout=timedelta(seconds=config.lease))
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
        self.abort = threading.Event()
        self._lock = threading.Lock()
        self._watch_gen = -1
        self._stopped = False
        self._plans: dict[str, Any] = {}
        self.runtime: StageRuntime | None = None
        self.decision: P.Decision | None = None
        self.coordinator_lost: str | None = None

    # -- life ---------------------------------------------------------------------------------

    def run(self) -> None:
        threading.Thread(target=self._watchdog, name="recycle-heartbeat", daemon=True).start()
        try:
            self._live()
        except (dist.DistError, RuntimeError) as exc:
            if self.coordinator_lost is None and not isinstance(exc, dist.DistNetworkError):
                raise
            self._coordinator_lost(self.coordinator_lost or short_error(exc))

    def _live(self) -> None:
        in_layout, out_layout = self._layouts()
        self.op_times: dict[int, dict[str, list[float]]] = {}
        """Per generation: the runtime's op times (`StageRuntime.op_times`) in it."""
        self.runtime = StageRuntime(self.state, self.job.loss_fn, self.job.data, self.s, self.S,
                                    self.D, self.M, self.device, in_layout, out_layout,
                                    self.job.step_hook, self.job.autocast_dtype(),
                                    self.job.dynamic, self.config.bucket_mb)
        # Everything built so far lives until the end: keep the collector off it, so that
        # the collection that closes a broken generation's groups takes microseconds.
        gc.freeze()
        self.store.set(P.hello_key(self.rank, self.incarnation), P.dumps({
            "pid": os.getpid(), "host": socket.gethostname(), "library": self.library_path,
            "steps": self.state.steps if self.has_state else None}))
        gen = int(self._wait_for(P.welcome_key(self.rank, self.incarnation)))
        if gen < 0:
            log.info("training ended before this worker could join")
            return self._quit()
        decision = P.Decision.from_json(self._wait_for(P.gen_key(gen, "decision")))
        while True:
            self.decision = decision
            if decision.action == "stop":
                return self._stop(decision)
            outcome = self._generation(decision)
            if outcome == "done" and self._finished(decision.gen):
                return self._quit()
            self.store.set(P.gen_key(decision.gen, f"ready/{self.rank}"), P.dumps({
                "steps": self.state.steps if self.has_state else None, "reason": outcome}))
            decision = P.Decision.from_json(self._wait_for(P.gen_key(decision.gen + 1,
                                                                     "decision")))

    def _generation(self, decision: P.Decision) -> str:
        """Run one generation; returns 'done', 'switch' (membership changes at an iteration
        boundary) or 'failure'."""
        gen = decision.gen
        with self._lock:
            self._watch_gen = gen
            self.abort.clear()
        if self.has_state:
            self.state.rollback_to(decision.restart)
        runtime = self.runtime
        runtime.reset()
        runtime.op_times = self.op_times.setdefault(gen, new_op_times())
        runtime.on_step = lambda it, losses: self._record_losses(gen, it, losses)
        comm = None
        iteration = decision.restart
        switch_at = None
        failure, t_fail = "", 0.0
        t0 = time.perf_counter()
        try:
            self._rendezvous(gen, len(decision.members))
            t1 = time.perf_counter()
            comm = Comm(self.config.backend, self.store, gen, list(decision.members), self.rank,
                        [r for r in decision.members if r % self.S == self.s], self.s,
                        self.timeout)
            runtime.comm = comm
            t2 = time.perf_counter()
            self._copy_state(decision, comm)
            program = self._program(decision)
            log.info("generation %d: %d live workers, dead %s, plan %s, logical pipeline %d, "
                     "from iteration %d (members met in %.0f ms, groups %.0f ms, state and "
                     "plan %.0f ms)", gen, len(decision.members),
                     format_workers(decision.dead), decision.plan,
                     program.logical, iteration, 1e3 * (t1 - t0), 1e3 * (t2 - t1),
                     1e3 * (time.perf_counter() - t2))
            while iteration < self.job.iterations:
                if self.faults.active and decision.dead and self.faults.at(iteration, "hold"):
                    self._wait_for(P.gen_key(gen, "join"), check_abort=True)
                if switch_at is None and self.store.check([P.gen_key(gen, "join")]):
                    switch_at = int(self.store.compare_set(P.gen_key(gen, "switch_at"), "",
                                                           str(iteration + 2)))
                    log.info("a worker asks to join: switching at iteration %d", switch_at)
                if switch_at is not None and iteration >= switch_at:
                    comm.flush_sends()
                    return "switch"
                if self.faults.active:
                    self.faults.trigger(iteration, "start")
                runtime.run_iteration(program, iteration, self.abort, self.faults)
                if not program.stagger:
                    comm.barrier()
                iteration += 1
                self.store.set(P.iteration_key(iteration - 1, self.rank),
                               P.dumps({"gen": gen, "t": time.time()}))
                self._checkpoint(decision, iteration)
            comm.flush_sends()
            self._checkpoint(decision, iteration, final=True)
            self.store.set(P.op_times_key(self.rank), P.dumps(self.op_times))
            return "done"
        except PeerFailure as exc:
            failure = str(exc)
            t_fail = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - user code (model, loss, data): a bug
            # bad input the executor diagnosed (a shape beyond its maximum): its one line
            failure = str(exc) if isinstance(exc, RecycleError) else traceback.format_exc()
            t_fail = time.perf_counter()
            log.error("user code raised at iteration %d: stopping the whole job\n%s",
                      iteration, failure.rstrip())
            # The first report wins; the launcher stops the job instead of re-routing.
            self.store.compare_set(P.gen_key(gen, "bug"), "", P.dumps(
                {"rank": self.rank, "iteration": iteration, "traceback": failure}))
        finally:
            # Drop every reference to the groups (pending receives included) and close them:
            # that is what tells the peers blocked on this worker. This runs after the except
            # clause, whose traceback still holds frames that reference pending work.
            runtime.reset()
            runtime.comm = None
            if comm is not None:
                comm.close(failed=bool(failure))
        log.warning("generation %d abandoned at iteration %d (groups closed in %.0f ms): %s",
                    gen, iteration, 1e3 * (time.perf_counter() - t_fail), failure)
        self.store.add(P.gen_key(gen, "errors"), 1)
        self.faults.on_recovery(iteration)
        return "failure"

    def _finished(self, gen: int) -> bool:
        """Report done and wait for everyone: True when the launcher says the job is complete,
        False when a failure elsewhere means the last iterations must be redone."""
        self.store.set(P.gen_key(gen, f"done/{self.rank}"), P.dumps({"steps": self.state.steps}))
        key = P.gen_key(gen, "finish")
        while not self.store.check([key]):
            if self.abort.is_set():
                return False
            time.sleep(self.config.poll)
        return True

    def _stop(self, decision: P.Decision) -> None:
        if self.has_state and self.rank in decision.members:
            self.state.rollback_to(decision.restart)
            if self.rank == min(r for r in decision.members if r % self.S == self.s):
                write_stage_checkpoint(self.config.run_dir, decision.restart, self.s, self.state)
                self.store.set(P.checkpoint_key(decision.restart, self.s), "1")
        log.warning("training stopped: %s", decision.reason)
        self.store.set(P.gen_key(decision.gen, f"stopped/{self.rank}"), "1")
        self._quit()

    def _quit(self) -> None:
        log.info("worker leaves")
        self._stopped = True

    # -- pieces of a generation ----------------------------------------------------------------

    def _rendezvous(self, gen: int, size: int) -> None:
        """Wait until every member has arrived before creating the groups: a member that dies
        before this point is caught by the launcher instead of by a group timeout."""
        key = P.gen_key(gen, "joined")
        arrived = self.store.add(key, 1)
        while arrived < size:
            if self.abort.is_set():
                raise PeerFailure("a member died before the generation formed")
            time.sleep(self.config.poll)
            arrived = self.store.add(key, 0)

    def _copy_state(self, decision: P.Decision, comm: Comm) -> None:
        payload = None
        for dst, src in sorted(decision.sources.items()):
            if src == self.rank:
                if payload is None:
                    payload = self.state.to_bytes()
                comm.send_bytes(payload, decision.group_rank(dst), self.device)
            elif dst == self.rank:
                self.state.load_bytes(comm.recv_bytes(decision.group_rank(src), self.device))
                self.has_state = True
                log.info("copied stage %d's state (step %d) from rank %d", self.s,
                         self.state.steps, src)
        if self.state.steps != decision.restart:
            raise RecycleError(f"stage {self.s} is at step {self.state.steps}, the generation "
                               f"starts at {decision.restart}")

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
            self.store.set(P.loss_key(iteration, self.rank), P.dumps(
                {"gen": gen, "losses": [[p, m, v] for (p, m), v in sorted(losses.items())]}))

    def _checkpoint(self, decision: P.Decision, steps: int, final: bool = False) -> None:
        every = self.config.checkpoint_every
        if not final and not (every and steps % every == 0):
            return
        if self.rank == self._stage_writer(decision):
            write_stage_checkpoint(self.config.run_dir, steps, self.s, self.state)
            self.store.set(P.checkpoint_key(steps, self.s), "1")

    def _stage_writer(self, decision: P.Decision) -> int:
        """The member that writes its stage's checkpoint: the stage's first."""
        return min(r for r in decision.members if r % self.S == self.s)

    def _coordinator_lost(self, reason: str) -> None:
        """The store is gone, so no decision can come: write this stage's state after its
        current step count n and, when the latest step can be undone, after n - 1. Stages
        differ by at most one step, so every stage writes the least count among them and
        that checkpoint completes (whoever writes last adds the manifest); `--resume`
        continues from the newest complete one."""
        log.error("lost the coordinator (%s): stopping with a checkpoint", reason)
        self._stopped = True
        if self.runtime is not None:
            self.runtime.reset()
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
        log.error("stage %d's state written for iteration(s) %s in %s", self.s,
                  written or "none (not this stage's writer)", self.config.run_dir)
        _exit(COORDINATOR_LOST)

    def _resume(self) -> None:
        found = latest_checkpoint(self.config.run_dir)
        if found is None:
            raise RecycleError(f"--resume: no complete checkpoint in "
                               f"{Path(self.config.run_dir) / 'checkpoints'}")
        iteration, folder = found
        self.state.load(load_stage_checkpoint(folder, self.s))
        log.info("resumed stage %d from %s (iteration %d)", self.s, folder, iteration)

    # -- shapes, waiting, heartbeats -------------------------------------------------------------

    def _layouts(self):
        """What this stage receives and sends (`boundary.Layout`), through the store: stage
        s-1 publishes its output's; stage 0 reads one sample. None at the pipeline's ends."""
        in_layout = None
        if self.s > 0:
            in_layout = Layout.from_json(self._wait_for(P.shape_key(self.s - 1)))
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
            self.store.set(P.shape_key(self.s), out_layout.to_json())
        return in_layout, out_layout

    def _wait_for(self, key: str, check_abort: bool = False) -> str:
        while not self.store.check([key]):
            if check_abort and self.abort.is_set():
                raise PeerFailure("the launcher abandoned this generation")
            time.sleep(self.config.poll)
        return self.store.get(key).decode()

    def _watchdog(self) -> None:
        """Heartbeats; the launcher's abort notice for the current generation, which aborts
        the groups so that a training thread blocked on a vanished host is released; and the
        training thread's own progress: busy outside communication for longer than the lease
        is a stall, and the worker leaves (the launcher then sees a dead worker)."""
        store = self._watch_store
        hb = P.heartbeat_key(self.rank, self.incarnation)
        lease = self.config.lease
        next_beat = 0.0
        while not self._stopped:
            now = time.time()
            try:
                if now >= next_beat:
                    store.set(hb, repr(now))
                    next_beat = now + self.config.heartbeat
                gen = self._watch_gen
                if gen >= 0 and not self.abort.is_set() and \
                        store.check([P.gen_key(gen, "abort")]):
                    with self._lock:
                        if gen == self._watch_gen:
                            self._abort_generation()
            except (dist.DistError, RuntimeError) as exc:
                if self._stopped:
                    return
                self.coordinator_lost = f"store at {os.environ['MASTER_ADDR']}:" \
                                        f"{os.environ['MASTER_PORT']}: {short_error(exc)}"
                with self._lock:
                    self._abort_generation()
                return
            runtime = self.runtime
            comm = runtime.comm if runtime is not None else None
            started = runtime.op_started if runtime is not None else None
            if started is not None and comm is not None and not comm.waiting:
                busy = time.monotonic() - max(started, comm.waited)
                if busy > lease and runtime.op_started == started:
                    log.error("the training thread made no progress for %.1f s outside "
                              "communication (lease %.1f s): a stall; leaving", busy, lease)
                    for handler in logging.getLogger().handlers:
                        handler.flush()
                    os._exit(STALLED)
            time.sleep(min(0.02, self.config.heartbeat))

    def _abort_generation(self) -> None:
        self.abort.set()
        comm = self.runtime.comm if self.runtime is not None else None
        if comm is not None:
            comm.abort()

    def _announce_fault(self, fault: Fault) -> None:
        self.store.set(P.fault_key(self.rank, self.incarnation), P.dumps(
            {"t": time.time(), "fault": str(fault)}))

    def _stepped(self, iteration: int) -> None:
        self.store.set(P.stepped_key(iteration, self.rank), "1")

    def _have_stepped(self, iteration: int, ranks: tuple[int, ...]) -> bool:
        return self.store.check([P.stepped_key(iteration, r) for r in ranks])


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


