"""The bucketed gradient all-reduce (`executor/buckets.py`) in one process, with a recording
stand-in for the process groups: buckets start in a fixed order as they complete, during the
worker's last gradient op (before its ALLREDUCE op is reached), the last stage's losses after
the last bucket, a failed start surfaces as `PeerFailure` at the wait, `reset` drops pending
work. The message pools (`pool.py`) against the receives and sends in flight. Exactness
against one process is tests/test_executor*.py's (real groups)."""

import threading

import pytest

from recycle_planner.job.policy import Policy
from recycle_planner.library import PlanLibrary, Settings, build_library

from conftest import make_spec

torch = pytest.importorskip("torch")

from recycle_planner.executor.data.boundary import layout_of  # noqa: E402
from recycle_planner.executor.data.buckets import GradBuckets, plan_buckets  # noqa: E402
from recycle_planner.executor.data.comm import PeerFailure  # noqa: E402
from recycle_planner.executor.faults import FaultInjector  # noqa: E402
from recycle_planner.executor.data.runtime import StageRuntime, bind  # noqa: E402
from recycle_planner.executor.data.state import StageState  # noqa: E402
from recycle_planner.programs import compile_program  # noqa: E402

S, D, M, WIDTH, BATCH = 2, 2, 4, 8, 3


class Work:
    def __init__(self, fail=False):
        self.fail = fail


class RecordingComm:
    """Completes every operation at once; records the stage collectives it starts."""

    def __init__(self, events, fail_start=False, size=D * S):
        self.events = events
        self.size = size  # the generation's members
        self.stage_group = object() if size > 1 else None
        self.fail_start = fail_start
        self.waited_works = []
        self.waited = 0.0  # Comm.waited: when the last wait for a peer ended

    def irecv(self, buf, src, tag):
        buf.zero_()
        return Work()

    def isend(self, buf, dst, tag):
        return Work()

    def sent(self, work):
        return True

    def wait(self, work, what="operation"):
        self.waited_works.append(work)
        if work.fail:
            raise PeerFailure(f"{what} failed: connection closed")

    def confirm_received(self, what):
        """The step gate: every operation here completed at once, without an error."""
        self.events.append(("gate", what))

    def allreduce_start(self, flat, what):
        if self.fail_start:
            raise PeerFailure(f"{what} failed: group aborted")
        self.events.append(("start", what, flat.numel()))
        return Work()


def _stage(s, seed=0):
    torch.manual_seed(seed + s)
    layers = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(3)]
    module = torch.nn.Sequential(layers[0], torch.nn.Tanh(), layers[1], torch.nn.Tanh(),
                                 layers[2])
    return StageState(module, torch.optim.SGD(module.parameters(), lr=0.1))


def _data(iteration, pipeline, microbatch):
    g = torch.Generator().manual_seed(1000 * iteration + 10 * pipeline + microbatch)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def test_buckets_are_reverse_ordered_split_by_size_and_dtype():
    params = [torch.zeros(10), torch.zeros(10), torch.zeros(30), torch.zeros(4, dtype=torch.int64),
              torch.zeros(5)]
    # 4 bytes per float32: 40, 40, 120, (int64) 32, 20 bytes; buckets of 100 bytes
    assert plan_buckets(params, 100) == ((4,), (3,), (2,), (1, 0))
    assert plan_buckets([torch.zeros(10)] * 3, 1 << 20) == ((2, 1, 0),)


@pytest.fixture(scope="module", params=[Policy(), Policy(decouple=False)],
                ids=["split", "fused"])
def plan(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lib")
    build_library(make_spec(stages=S, pipelines=D, microbatches=M), request.param, 0, folder,
                  Settings(solver="heuristic"), jobs=1)
    return PlanLibrary.open(folder).lookup([])


def _run(plan, s, events, bucket_mb, **comm):
    """Run iteration 0 of worker (0, s) and record its ops and stage collectives."""
    program = bind(compile_program(plan.plan(), s, plan.mapping), list(range(D * S)))
    state = _stage(s)
    layout = layout_of(torch.zeros(BATCH, WIDTH))
    runtime = StageRuntime(state, torch.nn.functional.mse_loss, _data, s, S, D, M,
                           torch.device("cpu"), layout if s > 0 else None,
                           layout if s < S - 1 else None, bucket_mb=bucket_mb)
    runtime.comm = RecordingComm(events, **comm)
    for name, handler in list(runtime.handlers.items()):
        def recorded(k, ins, it, handler=handler, name=name):
            events.append(("op", name, k))
            handler(k, ins, it)
            events.append(("end", name, k))
        runtime.handlers[name] = recorded
    first = state.params[0]  # in the last bucket: its gradient is the backward's last
    first.register_post_accumulate_grad_hook(lambda p: events.append(("grad", 0)))
    return program, state, runtime


@pytest.mark.parametrize("s", range(S))
def test_buckets_start_during_the_last_gradient_op_in_order(plan, s):
    events = []
    program, state, runtime = _run(plan, s, events, bucket_mb=1e-4)  # ~100 B: one per tensor
    grads = {}
    reduce = runtime.handlers["ALLREDUCE"]

    def allreduce(k, ins, it):
        grads["local"] = [p.grad.clone() for p in state.params]
        reduce(k, ins, it)
        grads["reduced"] = [p.grad.clone() for p in state.params]
    runtime.handlers["ALLREDUCE"] = allreduce
    runtime.run_iteration(program, 0, threading.Event(), FaultInjector([], 0, 0, print))

    launch = program.launch
    kind = program.instrs[launch].kind
    assert kind in ("W", "B")
    starts = [i for i, e in enumerate(events) if e[0] == "start"]
    op_start = events.index(("op", kind, launch))
    op_end = events.index(("end", kind, launch))
    allreduce = next(i for i, e in enumerate(events) if e[:2] == ("op", "ALLREDUCE"))
    buckets = runtime.buckets.buckets
    assert len(buckets) == len(state.params) == 6
    # every bucket starts during the last gradient op, none at the ALLREDUCE op
    grad_starts = [i for i in starts if events[i][1] == "gradient all-reduce"]
    assert len(grad_starts) == len(buckets)
    assert all(op_start < i < op_end < allreduce for i in grad_starts)
    # in bucket order, sizes as planned (the last layer's bias first)
    assert [events[i][2] for i in grad_starts] == [state.params[b[0]].numel() for b in buckets]
    if kind == "B" or s == 0:  # autograd's hooks: the first buckets start mid-backward
        assert grad_starts[0] < events.index(("grad", 0), op_start)
    # the last stage's losses after the last bucket
    loss_starts = [i for i in starts if events[i][1] == "loss all-reduce"]
    assert len(loss_starts) == (s == S - 1)
    assert all(grad_starts[-1] < i < op_end for i in loss_starts)
    # the reduced gradients (the stand-in sums over one worker) are the local ones
    assert all(torch.equal(a, b) for a, b in zip(grads["local"], grads["reduced"]))
    assert state.can_undo  # peers could report fewer steps: the undo copy was taken


def test_a_lone_worker_reduces_nothing_and_keeps_no_undo_copy(plan):
    events = []
    program, state, runtime = _run(plan, S - 1, events, bucket_mb=1e-4, size=1)
    runtime.run_iteration(program, 0, threading.Event(), FaultInjector([], 0, 0, print))
    assert [e for e in events if e[0] == "start"] == [] and state.steps == 1
    assert not state.can_undo and runtime.all_losses.count_nonzero() == M  # its own micro-batches


def test_a_failed_start_is_raised_at_the_wait_and_reset_drops_pending_work():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    params = list(module.parameters())
    buckets = GradBuckets(params, 1e-5)
    events = []
    comm = RecordingComm(events, fail_start=True)
    buckets.arm(comm)
    module(torch.ones(2, 4)).sum().backward()  # hooks start buckets: failures are kept
    buckets.finish(comm)
    with pytest.raises(PeerFailure, match="group aborted"):
        buckets.wait()
    assert events == [] and buckets.works == []

    comm = RecordingComm(events)
    buckets.arm(comm)
    buckets.ready([2])  # bucket 1 complete, bucket 0 (the last bias) not: nothing starts
    assert buckets.next == 0 and buckets.works == []
    buckets.ready([3])
    assert buckets.next == 2 and len(buckets.works) == 2 and len(events) == 2
    buckets.reset()  # the generation is abandoned with work pending
    assert buckets.works == [] and buckets.next == 0 and buckets.flats == [None] * 4
    module(torch.ones(2, 4)).sum().backward()  # not armed: the hooks start nothing
    assert len(events) == 2 and buckets.next == 0


class HoldingComm(RecordingComm):
    """As a real group: a pending receive's work holds its tensor until waited for."""

    def irecv(self, buf, src, tag):
        buf.zero_()
        work = Work()
        work.tensor = buf
        return work

    def wait(self, work, what="operation"):
        super().wait(work, what)
        work.tensor = None


def test_receive_buffers_are_pooled_by_what_is_in_flight_not_one_per_op(tmp_path):
    """The last stage of a 2 x 2 job with 8 micro-batches receives 8 activations an
    iteration (12 with a dead peer's re-routed ones), each busy from its post to its W:
    the pool holds as many buffers as were in flight at once, not one per receiving op."""
    microbatches = 8
    build_library(make_spec(stages=S, pipelines=D, microbatches=microbatches), Policy(), 1,
                  tmp_path, Settings(solver="heuristic"), jobs=1)
    for dead in ([], [(1, 1)]):
        hit = PlanLibrary.open(tmp_path).lookup(dead)
        members = [r for r in range(D * S) if (r // S, r % S) not in dead]
        program = bind(compile_program(hit.plan(), S - 1, hit.mapping), members)
        layout = layout_of(torch.zeros(BATCH, WIDTH))
        runtime = StageRuntime(_stage(S - 1), torch.nn.functional.mse_loss, _data, S - 1, S,
                               D, microbatches, torch.device("cpu"), layout, None)
        runtime.comm = HoldingComm([], size=len(members))
        for it in range(2):
            runtime.run_iteration(program, it, threading.Event(),
                                  FaultInjector([], 0, 0, print))
        receives = sum(1 for kind, _ in program.issues if kind == "recv")
        assert receives >= microbatches
        assert 1 <= runtime.recv_pool.peak < receives, (dead, runtime.recv_pool.peak)


class LaggingComm(RecordingComm):
    """A send completes once the worker has waited for a later operation (the peers move on),
    or never (`complete=False`); `sent` is asked, never waited for."""

    def __init__(self, events, complete=True, **kwargs):
        super().__init__(events, **kwargs)
        self.complete = complete
        self.in_flight: list[Work] = []
        self.most = 0

    def isend(self, buf, dst, tag):
        work = Work()
        work.done = False
        self.in_flight.append(work)
        self.most = max(self.most, len(self.in_flight))
        return work

    def sent(self, work):
        return work.done

    def wait(self, work, what="operation"):
        super().wait(work, what)
        if self.complete:
            for w in self.in_flight:
                w.done = True
            self.in_flight = []


def test_send_buffers_are_pooled_by_what_is_in_flight_and_never_waited_for(tmp_path):
    """Stage 0 of a 2 x 2 job with 8 micro-batches sends 8 activations an iteration (16 with
    its dead peer's re-routed ones): a buffer is refilled only once its send is known
    complete, so the pool holds as many as were in flight at once; sends that never
    complete cost one buffer each and block nothing."""
    microbatches = 8
    build_library(make_spec(stages=S, pipelines=D, microbatches=microbatches), Policy(), 1,
                  tmp_path, Settings(solver="heuristic"), jobs=1)
    layout = layout_of(torch.zeros(BATCH, WIDTH))
    for dead in ([], [(1, 0)]):
        hit = PlanLibrary.open(tmp_path).lookup(dead)
        members = [r for r in range(D * S) if (r // S, r % S) not in dead]
        program = bind(compile_program(hit.plan(), 0, hit.mapping), members)
        sends = sum(1 for kind, _ in program.issues if kind == "send")
        assert sends >= microbatches
        for complete in (True, False):
            runtime = StageRuntime(_stage(0), torch.nn.functional.mse_loss, _data, 0, S, D,
                                   microbatches, torch.device("cpu"), None, layout)
            runtime.comm = comm = LaggingComm([], complete, size=len(members))
            iterations = 2 if complete else 1
            for it in range(iterations):
                runtime.run_iteration(program, it, threading.Event(),
                                      FaultInjector([], 0, 0, print))
            if complete:
                assert runtime.send_pool.peak == comm.most < sends, (dead, comm.most)
            else:
                assert runtime.send_pool.peak == sends
