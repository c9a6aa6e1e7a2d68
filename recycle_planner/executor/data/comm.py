"""Process groups of one generation, point-to-point messages with tags, and failure detection.

What differs between gloo and NCCL (making, aborting and ending a group, the device, the
environment set before the first group) is one `Backend` record per name in `BACKENDS`.

Each generation builds its own groups from a fresh store namespace: one group of all members
(activations and gradients, state copies, the global barrier) and one per stage (the gradient
all-reduce among that stage's live workers). Groups are built directly (`ProcessGroupGloo`,
or `ProcessGroupNCCL` on GPUs by configuration) rather than through torch's global default
group, so that a broken generation can be dropped without touching torch's global state.

Failure detection rides on the transport: gloo reports a dead peer within milliseconds
("Connection closed by peer"). A worker blocked on a *live* peer that is itself stuck behind the
dead one learns of the failure because that peer, once it sees the error, closes its whole
group (`close`), which breaks its connections to everyone: the error cascades through the
wait-for chain in milliseconds. A hung peer keeps its connections open; the launcher's
heartbeat timeout kills it, which turns the hang into a death. The group timeout (never torch's
30-minute default) bounds anything else.

Tags identify a message completely (the program's tag, `programs.actions.message_tag`, plus
the iteration's parity), so that re-routed micro-batches of several pipelines can flow between
the same two workers in any order.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Mapping, MutableMapping

import torch
import torch.distributed as dist

from recycle_planner.errors import RecycleError

log = logging.getLogger(__name__)

STATE_TAG = 1 << 30
"""Tags at or above this carry stage state to a newcomer, never activations."""
ABORT_TAG = STATE_TAG - 1
"""The tag of the receive that aborts a gloo group (nothing is ever sent with it)."""


class PeerFailure(RuntimeError):
    """A collective or point-to-point operation failed: a peer died or the generation was
    abandoned. The worker leaves the generation and waits for the launcher's decision."""


def _gloo_group(store: Any, rank: int, size: int, timeout: timedelta, device: torch.device):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _sim_group(store: Any, rank: int, size: int, timeout: timedelta, device: torch.device):
    from recycle_planner.executor.data.nccl_sim import SimGroup

    return SimGroup(store, rank, size, timeout)


def _nccl_group(store: Any, rank: int, size: int, timeout: timedelta, device: torch.device):
    """A non-blocking communicator (`blocking = 0`: its setup returns at once and can be
    aborted, where a blocking one in setup cannot), connected eagerly, at generation start:
    a lazy setup inside the first operation would be a wait no stall watch can see and no
    abort can end."""
    if not hasattr(dist, "ProcessGroupNCCL"):
        raise RecycleError("backend 'nccl' needs a CUDA build of torch")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.config.blocking = 0
    group = dist.ProcessGroupNCCL(store, rank, size, options)
    group._set_sequence_number_for_group()  # as torch's own factory, before connecting
    group.eager_connect_single_device(device)
    return group


def _gloo_abort(group) -> None:
    """gloo's `abort()` does not release a waiting operation, but gloo closes every connection
    of a group when an application-side wait times out ("Application timeout caused pair
    closure"): a receive nobody will answer, waited for 1 ms, is that abort.

    A receive from a peer whose connection is already closed (it died, or aborted first)
    fails at once with "Connection closed by peer", which closes nothing else: the receive
    is tried from each peer in turn until one times out (then every connection is closed and
    the others fail at once). With one fixed peer, a member of a group of three or more that
    aborted second stayed blocked on a silent host until the group timeout."""
    for peer in range(group.size()):
        if peer == group.rank():
            continue
        try:
            group.recv([torch.zeros(1)], peer, ABORT_TAG).wait(timedelta(milliseconds=1))
        except RuntimeError as exc:
            log.debug("abort: receive from %d: %s", peer, short_error(exc))


def _sim_abort(group) -> None:
    _gloo_abort(group.inner)


def _sim_shutdown(group) -> None:
    group.shutdown()


def _nccl_abort(group) -> None:
    """`ncclCommAbort` on every communicator of the group: blocked kernels and waits return
    with an error instead of spinning on a peer that is gone."""
    group.abort()


def _nccl_shutdown(group) -> None:
    """A clean end: `ncclCommDestroy` after pending work, before the last reference goes."""
    group.shutdown()


def _nothing(group) -> None:
    """gloo frees a group with its last reference."""


def _cpu(environ: Mapping[str, str]) -> torch.device:
    return torch.device("cpu")


def _local_cuda(environ: Mapping[str, str]) -> torch.device:
    return torch.device("cuda", int(environ.get("LOCAL_RANK", "0")))


def _no_sync(device: torch.device) -> None:
    """The CPU is the host: nothing is queued behind it."""


def _cuda_sync(device: torch.device) -> None:
    torch.cuda.current_stream(device).synchronize()


@dataclass(frozen=True)
class Backend:
    """What differs between gloo and NCCL; everything else in the executor is shared."""

    name: str
    group: Callable[[Any, int, int, timedelta, torch.device], Any]
    abort: Callable[[Any], None]
    """Release every operation blocked in the group (after a failure was declared)."""
    shutdown: Callable[[Any], None]
    """End the group after a generation that ended cleanly."""
    device: Callable[[Mapping[str, str]], torch.device]
    """The worker's device, from its environment (torchrun's LOCAL_RANK)."""
    synchronize: Callable[[torch.device], None] = _no_sync
    """Block the host until the device has run everything queued (the step gate)."""
    environment: Mapping[str, str] = field(default_factory=dict)
    """Variables the worker sets before its first group (overriding other values)."""
    reap_sends: bool = False
    """The backend's sends report completion only once some thread waited for them (gloo,
    and so `nccl-sim`): `Comm` waits for them on threads of its own (`SendReaper`), so that
    `is_completed()` tells the training thread without blocking it. NCCL's need not: a
    send's work is complete once its kernel ran, i.e. the receiver took it."""


NCCL_ENVIRONMENT = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
"""ASYNC_ERROR_HANDLING 2 = CleanUpOnly: on an error or timeout torch's watchdog aborts the
communicator and fails its work, but leaves the process alive, so that the worker reports the
failure and joins the next generation. (1, torch's default, would kill a healthy survivor; 0
leaves it spinning on a dead peer; 3 kills it without an abort.) DUMP_ON_TIMEOUT 0: the
watchdog writes no debug dump and no `exception_dump` key into the store, where a restarted
worker would read a stale one."""

BACKENDS = {
    "gloo": Backend("gloo", _gloo_group, _gloo_abort, _nothing, _cpu, reap_sends=True),
    "nccl": Backend("nccl", _nccl_group, _nccl_abort, _nccl_shutdown, _local_cuda,
                    _cuda_sync, NCCL_ENVIRONMENT),
    "nccl-sim": Backend("nccl-sim", _sim_group, _sim_abort, _sim_shutdown, _cpu,
                        reap_sends=True),
}
"""`nccl-sim` is gloo with NCCL's host semantics (`nccl_sim.py`), for tests on CPU."""


def backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise RecycleError(f"unknown backend {name!r} (expected {' or '.join(BACKENDS)})")
    return BACKENDS[name]


def set_environment(name: str, environ: MutableMapping[str, str]) -> None:
    """Set backend `name`'s variables; a value the user set otherwise is replaced, with a
    warning (recovery needs it)."""
    for key, value in backend(name).environment.items():
        if environ.get(key, value) != value:
            log.warning("%s=%s replaced by %s: recovery needs the communicator aborted and "
                        "the process kept alive", key, environ[key], value)
        environ[key] = value


def prepare(name: str, environ: MutableMapping[str, str]) -> torch.device:
    """Set backend `name`'s environment (before any group exists) and return the worker's
    device, made current."""
    set_environment(name, environ)
    device = backend(name).device(environ)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


class Comm:
    """The groups of one generation as seen by one worker.

    `rank` is the worker's index in the generation (its position in `members`); `stage_group`
    is None when the worker is its stage's only live member; `scalar_group` (made with
    `scalars`, for a step hook's all-stage sum) is None otherwise. `aborted` is the
    generation's abandon flag. Every group is made here, at generation start: a group made
    lazily inside an operation is a wait nobody can abort.

    Nothing here relies on `wait()` blocking or raising, which only gloo does: `wait` puts a
    work in the device's queue (`awaited`, what the stall watch reads); whether a work ended
    well is known only at `confirm` (the step gate) and `drain` (a clean end), which ask the
    work itself, the device and the abort flag. On gloo `wait` also raises at once, which
    only makes a failure seen sooner.
    """

    def __init__(self, backend_name: str, store: Any, gen: int, members: list[int], me: int,
                 stage_members: list[int], stage: int, timeout: timedelta,
                 device: torch.device = torch.device("cpu"),
                 aborted: threading.Event | None = None, scalars: bool = False):
        self.backend = backend(backend_name)
        self.rank = members.index(me)
        self.size = len(members)
        self.device = device
        self.aborted = aborted if aborted is not None else threading.Event()
        self.sends: list[tuple[Any, torch.Tensor]] = []
        self.reapers: dict[int, SendReaper] = {}
        """Per destination, the thread that waits for the sends to it (`Backend.reap_sends`)."""
        self.error: BaseException | None = None
        """The first failure seen among the awaited works (`failed`)."""
        self.received: list[Any] = []
        """Receives and collectives waited for since the last step gate."""
        self.awaited: list[Any] = []
        self._awaiting = threading.Lock()
        """Works the device was told to wait for and not yet seen complete: while one is
        incomplete, the worker waits on a peer, whichever call the host blocks in."""
        self.waited = time.monotonic()
        """When the latest wait for a peer ended."""
        self._store, self._gen, self._timeout = store, gen, timeout
        self.stage_first = me == min(stage_members)
        self.group = self._group("all", self.rank, self.size)
        self.stage_group = None
        if len(stage_members) > 1:
            self.stage_group = self._group(f"stage{stage}", stage_members.index(me),
                                           len(stage_members))
        self.scalar_group = self._group("scalars", self.rank, self.size) if scalars else None

    def _group(self, name: str, rank: int, size: int):
        try:
            return self.backend.group(dist.PrefixStore(f"gen{self._gen}/{name}", self._store),
                                      rank, size, self._timeout, self.device)
        except RecycleError:
            raise
        except RuntimeError as exc:
            raise PeerFailure(f"cannot form the process group of generation {self._gen}: "
                              f"{short_error(exc)}") from None

    def isend(self, tensor: torch.Tensor, dst: int, tag: int):
        try:
            work = self.group.send([tensor], dst, tag)
        except RuntimeError as exc:
            raise PeerFailure(f"send to {dst} failed: {short_error(exc)}") from None
        self.sends.append((work, tensor))
        if self.backend.reap_sends:
            reaper = self.reapers.get(dst)
            if reaper is None:
                reaper = self.reapers[dst] = SendReaper(dst)
            reaper.add(work)
        if len(self.sends) > 64:
            self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]
        return work

    def sent(self, work) -> bool:
        """Whether a send is known complete, without waiting (its buffer may then be
        refilled): the work's own `is_completed()` (on NCCL: its kernel ran, the receiver has
        the bytes; on gloo once its `SendReaper` saw it end). Raises `PeerFailure` if it
        failed."""
        if not work.is_completed():
            return False
        error = _error_of(work)
        if error is not None:
            raise PeerFailure(f"send failed: {short_error(error)}")
        return True

    def irecv(self, buf: torch.Tensor, src: int, tag: int):
        try:
            return self.group.recv([buf], src, tag)
        except RuntimeError as exc:
            raise PeerFailure(f"receive from {src} failed: {short_error(exc)}") from None

    def wait(self, work, what: str = "operation", gated: bool = True) -> None:
        """Queue a wait for `work` on the device (gloo: block until done; raises on
        failure; NCCL: the stream waits, the host goes on). `gated`: the next step gate
        (`confirm_received`) confirms it (every receive and collective: a receive from a
        peer that died or aborted leaves garbage in its buffer on NCCL, silently)."""
        self._await(work)
        if gated:
            self.received.append(work)
        try:
            work.wait()
        except RuntimeError as exc:
            raise PeerFailure(f"{what} failed: {short_error(exc)}") from None
        finally:
            self.waited = time.monotonic()
        self._release()

    def _release(self) -> None:
        """Forget the works known complete (their first error kept for the gate): a work
        holds its tensors, and a receive buffer is reused only once nothing references it
        (`pool.py`), so works kept until the step gate held every receive buffer of the
        iteration (the pool grew with M). On NCCL a work usually completes after its wait
        returns: it stays until a later wait or the gate finds it complete."""
        self.received = self._pending(self.received)
        self.waiting_on_peer()

    def _await(self, work) -> None:
        with self._awaiting:
            self.awaited.append(work)
            grown = len(self.awaited) > 256
        if grown:  # no stall watch prunes it (a benchmark, a test): bounded all the same
            self.waiting_on_peer()

    def waiting_on_peer(self) -> bool:
        """Whether the device waits for a work not complete yet: a peer's progress, not this
        worker's (read by the stall watch, on its own thread)."""
        with self._awaiting:
            self.awaited = self._pending(self.awaited)
            return bool(self.awaited)

    def _pending(self, works: list) -> list:
        """The works of `works` not complete yet; the first error of those complete is kept
        for the step gate."""
        pending = []
        for work in works:
            if not work.is_completed():
                pending.append(work)
            elif self.error is None:
                self.error = _error_of(work)
        return pending

    def failed(self) -> bool:
        """Whether an operation the device waited for is known to have failed."""
        self.waiting_on_peer()
        return self.error is not None

    def confirm(self, works, what: str, synchronize: bool = True) -> None:
        """The step gate: return only when every one of `works` is complete and error-free,
        the device has run everything queued (unless `synchronize` is False: only `works`
        need be done, for a result the host reads next), and the generation is not
        abandoned; else raise `PeerFailure`. As torchft's Manager gates its commit: a step
        taken on a half-reduced gradient (NCCL's `wait` never raises) is never counted."""
        deadline = time.monotonic() + self._timeout.total_seconds()
        for work in works:
            self._await(work)
            while not work.is_completed():
                if self.aborted.is_set():
                    break
                if time.monotonic() > deadline:
                    raise PeerFailure(f"{what} did not complete within the group timeout")
                time.sleep(0.0002)
            error = None if self.aborted.is_set() else _error_of(work)
            if error is not None:
                raise PeerFailure(f"{what} failed: {short_error(error)}")
        if synchronize:
            self.backend.synchronize(self.device)
        if self.aborted.is_set():
            raise PeerFailure(f"the generation was abandoned before the {what} was confirmed")
        self.waited = time.monotonic()

    def confirm_received(self, what: str) -> None:
        """The step gate over everything waited for since the previous gate."""
        works, self.received = self.received, []
        if self.error is not None:
            raise PeerFailure(f"{what} failed: {short_error(self.error)}")
        self.confirm(works, what)

    def drain(self, limit: float) -> None:
        """A clean end: wait at most `limit` seconds until every send has been received
        (NCCL's sends complete only then), watching the abort flag; raise `PeerFailure` if
        one was not (the caller then aborts instead of shutting down, which on NCCL would
        wait for it with no limit)."""
        works = [w for w, _ in self.sends]
        self.sends.clear()  # their reapers (gloo) wait for them: a second wait would block
        self.confirm_all(works, "send", time.monotonic() + limit)

    def confirm_all(self, works, what: str, deadline: float) -> None:
        for work in works:
            self._await(work)
        while not all(w.is_completed() for w in works):
            if self.aborted.is_set():
                raise PeerFailure(f"the generation was abandoned before every {what} completed")
            if time.monotonic() > deadline:
                raise PeerFailure(f"a {what} was not received before the generation's end")
            time.sleep(0.001)
        for work in works:
            error = _error_of(work)
            if error is not None:
                raise PeerFailure(f"{what} failed: {short_error(error)}")

    def allreduce_start(self, flat: torch.Tensor, what: str):
        """Start a SUM over the stage's live workers in place; `wait` for the returned work
        (callers skip it when `stage_group` is None)."""
        try:
            return self.stage_group.allreduce([flat], dist.AllreduceOptions())
        except RuntimeError as exc:
            raise PeerFailure(f"{what} failed: {short_error(exc)}") from None

    def all_stages_start(self, value: torch.Tensor):
        """Start the sum over stages of `value`, which every worker of a stage holds equal
        (computed from its reduced gradients): the stage's first live worker contributes it,
        its peers zeros, so the sum is exact. Returns (work, the tensor summed into). On its
        own group of every member: a collective on the all-member group would queue behind
        point-to-point work on NCCL. `value` goes to the worker's device (a stage without
        gradients gives a CPU zero, which NCCL rejects)."""
        value = value.detach().to(self.device)
        out = value.clone() if self.stage_first else torch.zeros_like(value)
        try:
            work = self.scalar_group.allreduce([out], dist.AllreduceOptions())
        except RuntimeError as exc:
            raise PeerFailure(f"all-stage sum failed: {short_error(exc)}") from None
        return work, out

    def all_stages_sum(self, value: torch.Tensor) -> torch.Tensor:
        """`all_stages_start`, confirmed (the host reads the sum next)."""
        work, out = self.all_stages_start(value)
        self.wait(work, "all-stage sum")
        self.confirm([work], "all-stage sum")
        return out

    def barrier(self) -> None:
        try:
            work = self.group.barrier(dist.BarrierOptions())
        except RuntimeError as exc:
            raise PeerFailure(f"barrier failed: {short_error(exc)}") from None
        self.wait(work, "barrier")
        self.confirm([work], "barrier")

    def send_bytes(self, payload: bytes, dst: int, device: torch.device) -> None:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        self.isend(size, dst, STATE_TAG)
        self.isend(data, dst, STATE_TAG + 1)
        self.drain(self._timeout.total_seconds())

    def recv_bytes(self, src: int, device: torch.device) -> bytes:
        size = torch.zeros(1, dtype=torch.int64, device=device)
        work = self.irecv(size, src, STATE_TAG)
        self.wait(work, "state size")
        self.confirm([work], "state size")
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        work = self.irecv(data, src, STATE_TAG + 1)
        self.wait(work, "state")
        self.confirm([work], "state")
        return data.cpu().numpy().tobytes()

    def broadcast_bytes(self, payload: bytes | None, root: int,
                        device: torch.device) -> bytes | None:
        """`payload` from the stage group's member `root` (which passes it; the others pass
        None and get it back): its size, then its bytes, each confirmed (the host reads
        them next)."""
        size = torch.tensor([0 if payload is None else len(payload)], dtype=torch.int64,
                            device=device)
        self._broadcast(size, root, "state size")
        if payload is not None:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        else:
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        self._broadcast(data, root, "state")
        return None if payload is not None else data.cpu().numpy().tobytes()

    def _broadcast(self, tensor: torch.Tensor, root: int, what: str) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = root
        try:
            work = self.stage_group.broadcast([tensor], options)
        except RuntimeError as exc:
            raise PeerFailure(f"{what} broadcast failed: {short_error(exc)}") from None
        self.wait(work, what)
        self.confirm([work], what)

    def abort(self) -> None:
        """Abort the groups, possibly from another thread, so that every operation blocked in
        them (a receive from a host that vanished without closing its sockets, an all-reduce)
        fails at once instead of at the group timeout (`Backend.abort`)."""
        for group in (self.group, self.stage_group, self.scalar_group):
            if group is None or group.size() < 2:
                continue
            try:
                self.backend.abort(group)
            except RuntimeError as exc:  # gloo's expected timeout, or a group already broken
                log.debug("abort: %s", short_error(exc))

    def close(self, failed: bool = False) -> None:
        """Drop the groups: aborted first after a failure (`Backend.abort`), shut down after a
        clean end (`Backend.shutdown`; `drain` made sure nothing is pending, since NCCL's
        shutdown waits for pending work with no limit). Closing tells every peer blocked on
        this worker that the generation is over, so nothing may keep a reference alive. A
        group with a pending operation on a host that vanished takes as long to destroy as
        that operation takes to fail, so the last references are dropped on a daemon
        thread."""
        if failed:
            self.abort()
        else:
            for group in (self.group, self.stage_group, self.scalar_group):
                if group is not None:
                    try:
                        self.backend.shutdown(group)
                    except RuntimeError as exc:
                        log.debug("shutdown: %s", short_error(exc))
        groups = [self.group, self.stage_group, self.scalar_group]
        self.sends.clear()
        for reaper in self.reapers.values():  # each ends once its last send has (aborted
            reaper.stop()                     # groups fail every pending one at once)
        self.reapers = {}
        self.awaited = []
        self.group = self.stage_group = self.scalar_group = None
        threading.Thread(target=_drop, args=(groups,), name="recycle-close",
                         daemon=True).start()


class SendReaper:
    """A thread that waits, in order, for the sends to one peer, so that their works report
    completion to `Comm.sent` without the training thread ever waiting on a send. A gloo send
    is marked complete only by a wait, and that wait lasts until the receiver has posted the
    matching receive (measured: a 4 KB send to a receiver that posts 1 s later waits 1 s), so
    the training thread cannot wait itself; NCCL's progress engine does this on the device.
    One thread per destination: a receiver takes one sender's messages in program order,
    so a send waits only behind sends the same receiver takes first. A failed wait leaves its
    error in the work (`_error_of`); an aborted group fails every pending send at once."""

    def __init__(self, peer: int):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=f"recycle-sends-{peer}", daemon=True).start()

    def add(self, work) -> None:
        self.queue.put(work)

    def stop(self) -> None:
        self.queue.put(None)

    def _run(self) -> None:
        while (work := self.queue.get()) is not None:
            try:
                work.wait()
            except RuntimeError as exc:  # kept by the work: seen by `sent` and `drain`
                log.debug("send: %s", short_error(exc))


def _error_of(work) -> BaseException | None:
    """The error a completed work ended with (torch's `Work.exception`, which it marks as
    deprecated without a replacement that does not raise), or None.

    torch before 2.13 cannot hand that error to Python: on an H200 with torch 2.11, every
    completed work's `exception()` raised a `TypeError` (its C++ `exception_ptr` has no
    conversion), success or not. No other call says it on every backend (NCCL's `wait()`
    returns without raising), so such a torch is refused in one line rather than a failed
    operation taken for a good one."""
    try:
        return work.exception()
    except RuntimeError as exc:
        return exc
    except TypeError:
        raise RecycleError(f"torch {torch.__version__} cannot tell the executor whether a "
                           f"collective or message failed (Work.exception); it needs torch "
                           f"2.13.0, as `pip install 'recycle-planner[torch]'` installs") from None


def _drop(groups: list) -> None:
    groups.clear()
    gc.collect()


def short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:200]
