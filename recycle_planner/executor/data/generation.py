"""One generation as a worker's data plane runs it: groups, state copy, program, iterations.

The control plane hands the worker a `Decision` (members, dead workers, restart iteration, who
copies state to whom, the plan) and a c10d store; `Generation.open` meets the other members
there, forms the generation's process groups (`comm.Comm`), copies the stage's state to or
from a peer and compiles the worker's program; `run_iteration` runs one iteration of it;
`close` ends the groups, cleanly or after a failure. `abort` may be called from any thread at
any time (the control plane said the generation is abandoned): every operation blocked in the
groups fails at once with `PeerFailure`.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable

from recycle_planner.errors import RecycleError
from recycle_planner.executor.control.protocol import Decision
from recycle_planner.executor.data.comm import Comm, PeerFailure
from recycle_planner.executor.data.runtime import Program, StageRuntime
from recycle_planner.executor.faults import FaultInjector
from recycle_planner.job.workers import format_workers

log = logging.getLogger(__name__)


class Generation:
    """This worker's part of generation `decision.gen`: `rank` is its global rank, `stage`
    its stage of `stages`; `program_for(decision)` compiles its program; `aborted` is set by
    whoever learns first that the generation is abandoned."""

    def __init__(self, decision: Decision, runtime: StageRuntime, store: Any, backend: str,
                 rank: int, stage: int, stages: int, timeout: timedelta, poll: float,
                 program_for: Callable[[Decision], Program], aborted: threading.Event):
        self.decision = decision
        self.runtime = runtime
        self.store = store
        self.backend = backend
        self.rank, self.stage, self.stages = rank, stage, stages
        self.timeout = timeout
        self.poll = poll
        self.program_for = program_for
        self.aborted = aborted
        """Set when the control plane abandoned the generation (possibly before it opened)."""
        self.comm: Comm | None = None
        self.program: Program | None = None
        self._lock = threading.Lock()

    def open(self, has_state: bool) -> bool:
        """Meet the members, form the groups, copy state, compile the program; returns
        whether the worker holds its stage's state now. Raises `PeerFailure` when a member
        dies first or the generation is aborted."""
        decision, runtime = self.decision, self.runtime
        t0 = time.perf_counter()
        self._rendezvous(len(decision.members))
        t1 = time.perf_counter()
        comm = Comm(self.backend, self.store, decision.gen, list(decision.members), self.rank,
                    [r for r in decision.members if r % self.stages == self.stage],
                    self.stage, self.timeout, runtime.device, self.aborted,
                    scalars=runtime.hook is not None)
        with self._lock:
            self.comm = runtime.comm = comm
            if self.aborted.is_set():
                comm.abort()
        t2 = time.perf_counter()
        has_state = self._copy_state(comm, has_state)
        self.program = self.program_for(decision)
        log.info("generation %d: %d live workers, dead %s, plan %s, logical pipeline %d, "
                 "from iteration %d (members met in %.0f ms, groups %.0f ms, state and plan "
                 "%.0f ms)", decision.gen, len(decision.members),
                 format_workers(decision.dead), decision.plan,
                 self.program.logical, decision.restart, 1e3 * (t1 - t0), 1e3 * (t2 - t1),
                 1e3 * (time.perf_counter() - t2))
        return has_state

    def run_iteration(self, iteration: int, faults: FaultInjector) -> None:
        self.runtime.run_iteration(self.program, iteration, self.aborted, faults)
        if not self.program.stagger:
            self.comm.barrier()

    def end(self, limit: float) -> None:
        """The generation ends cleanly at an iteration boundary once every send is received,
        waited for at most `limit` seconds (and not past an abort): else `PeerFailure`, and
        the groups are aborted instead of shut down (NCCL's shutdown would wait for a send
        to a vanished peer with no limit)."""
        self.comm.drain(limit)

    def explains(self, exc: BaseException) -> bool:
        """Whether an exception raised by user code may come from a failed operation rather
        than a bug: on NCCL a failed receive leaves its buffer half-written without a word
        (`wait` never raises), and a model fed garbage may raise. True when the generation
        was abandoned or an operation of it failed."""
        comm = self.comm
        return self.aborted.is_set() or (comm is not None and comm.failed())

    def abort(self) -> None:
        """Release every operation blocked in the groups (any thread)."""
        with self._lock:
            self.aborted.set()
            if self.comm is not None:
                self.comm.abort()

    def close(self, failed: bool) -> None:
        """Forget the iteration's state and drop the groups (aborted first after a failure):
        closing is what tells the peers blocked on this worker."""
        self.runtime.reset()
        comm = self.comm
        if comm is not None:  # still reachable by `abort` from another thread meanwhile
            comm.close(failed=failed)
        with self._lock:
            self.comm = None
        self.runtime.comm = None

    def _rendezvous(self, size: int) -> None:
        """Wait until every member has arrived before creating the groups: a member that dies
        before this point is caught by the control plane instead of by a group timeout."""
        key = f"gen{self.decision.gen}/joined"
        arrived = self.store.add(key, 1)
        while arrived < size:
            if self.aborted.is_set():
                raise PeerFailure("a member died before the generation formed")
            time.sleep(self.poll)
            arrived = self.store.add(key, 0)

    def _copy_state(self, comm: Comm, has_state: bool) -> bool:
        """Copy the stage's state as the decision says: by one broadcast in the stage's group
        when every other member takes it from the same source (the start of a run: one copy
        of the state on each worker's device, where D-1 sends kept up to D-1 copies on the
        source's), else by messages from source to destination (a re-join)."""
        decision, state = self.decision, self.runtime.state
        stage_members = [r for r in decision.members if r % self.stages == self.stage]
        mine = {d: s for d, s in decision.sources.items() if d in stage_members}
        srcs = set(mine.values())
        if comm.stage_group is not None and len(srcs) == 1 and \
                set(mine) == set(stage_members) - srcs:
            src = srcs.pop()
            payload = state.to_bytes() if src == self.rank else None
            got = comm.broadcast_bytes(payload, stage_members.index(src), self.runtime.device)
            if src != self.rank:
                state.load_bytes(got)
                has_state = True
                log.info("copied stage %d's state (step %d) from rank %d by broadcast",
                         self.stage, state.steps, src)
            return self._check_steps(has_state)
        payload = None
        for dst, src in sorted(decision.sources.items()):
            if src == self.rank:
                if payload is None:
                    payload = state.to_bytes()
                comm.send_bytes(payload, decision.group_rank(dst), self.runtime.device)
            elif dst == self.rank:
                state.load_bytes(comm.recv_bytes(decision.group_rank(src), self.runtime.device))
                has_state = True
                log.info("copied stage %d's state (step %d) from rank %d", self.stage,
                         state.steps, src)
        return self._check_steps(has_state)

    def _check_steps(self, has_state: bool) -> bool:
        steps, restart = self.runtime.state.steps, self.decision.restart
        if steps != restart:
            raise RecycleError(f"stage {self.stage} is at step {steps}, the generation "
                               f"starts at {restart}")
        return has_state
