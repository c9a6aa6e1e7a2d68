"""The executor's pieces that need no second process: faults, membership decisions,
routing of a re-routed plan, undo of an optimizer step, checkpoints, job loading."""

import copy
import threading

import pytest

from recycle_planner.errors import FailureSetError, RecycleError
from recycle_planner.job.policy import Policy
from recycle_planner.library import PlanLibrary, Settings, build_library
from recycle_planner.programs import compile_program

from conftest import EXAMPLES, make_spec

torch = pytest.importorskip("torch")

from recycle_planner.executor.control import protocol as P  # noqa: E402
from recycle_planner.executor.control.agent import LaunchConfig  # noqa: E402
from recycle_planner.executor.faults import Fault, FaultInjector, parse_fault  # noqa: E402
from recycle_planner.executor.job import Job, load_job  # noqa: E402
from recycle_planner.executor.data.runtime import Program, bind  # noqa: E402
from recycle_planner.executor.data.state import (StageState, latest_checkpoint,  # noqa: E402
                                                 load_stage_checkpoint,
                                                 write_manifest,
                                                 write_stage_checkpoint)


def test_faults_parse_and_fire_once_per_point():
    assert parse_fault("3:2:F1") == Fault(3, 2, "F1", "kill")
    assert parse_fault("0:4:step:hang") == Fault(0, 4, "step", "hang")
    assert str(parse_fault("1:0:hold")) == "1:0:hold"
    assert parse_fault("2:3:F1:host-down") == Fault(2, 3, "F1", "host-down")
    for bad in ("1:2", "a:2:F1", "1:2:X1", "1:2:F", "1:2:F1:explode", "1:2:F1:kill:x"):
        with pytest.raises(RecycleError, match="fault"):
            parse_fault(bad)
    fired = []
    inj = FaultInjector([Fault(1, 2, "I0"), Fault(0, 2, "F0")], rank=1, incarnation=0,
                        announce=fired.append)
    inj.fire = fired.append  # do not kill the test process
    inj.trigger(2, "F0")
    inj.trigger(1, "I0")
    assert fired == []
    inj.trigger(2, "I0")
    assert fired == [Fault(1, 2, "I0")]
    restarted = FaultInjector([Fault(1, 2, "I0")], rank=1, incarnation=1, announce=fired.append)
    assert not restarted.active


def test_a_fault_after_steps_waits_for_them():
    """`after-step`: the watched workers record their step of that iteration (and only of
    that one); the fault fires once all have, or after the bounded wait, never before."""
    fault = parse_fault("3:3:W3:kill:after-step=5,4,5")
    assert fault == Fault(3, 3, "W3", "kill", (4, 5)) and str(fault) == \
        "3:3:W3:kill:after-step=4,5" and Fault.from_dict(fault.to_dict()) == fault
    assert Fault.from_dict({"rank": 1, "iteration": 2, "point": "F0"}).after_step == ()
    for bad, why in (("3:3:W3:kill:after=4", "after-step=R"), ("3:3:W3:kill:after-step=",
                     "after-step=R"), ("3:3:hold:kill:after-step=4", "does not apply"),
                     ("3:3:W3:kill:after-step=3", "its own step")):
        with pytest.raises(RecycleError, match=why):
            parse_fault(bad)
    with pytest.raises(RecycleError, match="rank 7 is outside"):
        LaunchConfig(nproc=6, faults=[parse_fault("3:3:W3:kill:after-step=7")])
    with pytest.raises(RecycleError, match="need a store"):
        FaultInjector([fault], rank=4, incarnation=0, announce=print)
    steps: set[tuple[int, int]] = set()

    def injector(rank, wait=60.0):
        return FaultInjector([fault], rank, 0, announce=print,
                             stepped=lambda it: steps.add((it, rank)),
                             have_stepped=lambda it, ranks: {(it, r) for r in ranks} <= steps,
                             wait=wait)
    watched = [injector(4), injector(5)]
    assert all(w.active for w in watched) and not injector(2).active
    for w in watched:
        w.counted(2)
        w.trigger(3, "W3")
    assert steps == set()
    victim = injector(3)
    fired = []
    victim.fire = lambda f: fired.append((f, set(steps)))
    worker4 = threading.Timer(0.05, watched[0].counted, (3,))
    worker5 = threading.Timer(0.15, watched[1].counted, (3,))
    worker4.start(), worker5.start()
    victim.trigger(3, "W3")
    worker4.join(), worker5.join()
    assert fired == [(fault, {(3, 4), (3, 5)})]
    impatient = injector(3, wait=0.05)
    impatient.fire = fired.append
    steps.clear()
    impatient.trigger(3, "W3")  # nobody steps: it fires after its wait
    assert fired[-1] == fault


def _lookup_ok(dead):
    return "plan.json.gz", 0.1


def test_decision_at_start_copies_from_the_first_worker_of_each_stage():
    steps = {r: 0 for r in range(6)}
    d = P.decide(0, pipelines=3, stages=2, steps=steps, lookup=_lookup_ok, initial=True)
    assert d.action == "run" and d.members == tuple(range(6)) and d.dead == ()
    assert d.sources == {2: 0, 4: 0, 3: 1, 5: 1}
    assert P.Decision.from_json(d.to_json()) == d


def test_decision_after_failure_restarts_at_the_least_step_and_copies_to_newcomers():
    # 2 stages x 3 pipelines; 1:0 (rank 2) died, stage 1 already stepped, rank 4 restarted.
    steps = {0: 3, 1: 4, 3: 4, 5: 4, 4: None}
    d = P.decide(5, pipelines=3, stages=2, steps=steps, lookup=_lookup_ok)
    assert d.action == "run" and d.restart == 3 and d.dead == ((1, 0),)
    assert d.sources == {4: 0}
    assert d.group_rank(4) == 3


def test_decision_stops_when_a_stage_is_empty_or_beyond_the_threshold():
    d = P.decide(2, pipelines=2, stages=2, steps={0: 5, 2: 5}, lookup=_lookup_ok)
    assert d.action == "stop" and "stage 1" in d.reason and d.restart == 5

    def beyond(dead):
        raise FailureSetError("3 dead workers is beyond this library's threshold of 2")

    d = P.decide(2, pipelines=3, stages=2, steps={0: 5, 1: 4, 5: 5, 4: None}, lookup=beyond)
    assert d.action == "stop" and "threshold" in d.reason and d.restart == 4
    assert d.members == (0, 1, 5)  # the newcomer holds no state to save
    with pytest.raises(RecycleError, match="at most one step"):
        P.decide(2, pipelines=2, stages=2, steps={0: 5, 1: 3}, lookup=_lookup_ok)


def test_a_bug_in_user_code_is_a_stop_never_a_reroute():
    """Everyone alive, one stage a step ahead: a reported bug stops at the least step."""
    d = P.decide(3, pipelines=2, stages=2, steps={0: 6, 1: 5, 2: 6, 3: 5}, lookup=_lookup_ok,
                 bug="worker 1:0 raised ValueError")
    assert d.action == "stop" and d.restart == 5 and d.dead == ()
    assert d.reason == "worker 1:0 raised ValueError" and d.members == (0, 1, 2, 3)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lib")
    spec = make_spec(stages=3, pipelines=3, microbatches=4)
    build_library(spec, Policy(), 2, folder, Settings(solver="heuristic"), jobs=1)
    return PlanLibrary.open(folder)


@pytest.mark.parametrize("dead", [[], [(1, 1)], [(2, 0), (0, 2)], [(1, 1), (2, 1)]])
def test_every_message_of_a_rerouted_plan_has_exactly_one_receiver(library, dead):
    """Compile every live worker's program: each send (to a group rank, with a tag) matches
    exactly one receive (from the sender, same tag), also for micro-batches that cross
    pipelines, and the stage-order of the work covers every micro-batch once."""
    hit = library.lookup(dead)
    plan = hit.plan()
    S, D, M = 3, 3, 4
    members = [r for r in range(D * S) if P.worker_of(r, S) not in set(dead)]
    programs: dict[int, Program] = {
        i: bind(compile_program(plan, r, hit.mapping), members) for i, r in enumerate(members)}
    sends, recvs = [], []
    for i, prog in programs.items():
        for ins in prog.instrs:
            if ins.dst is not None:
                sends.append((i, ins.dst, ins.send_tags[0]))
            if ins.src is not None:
                recvs.append((ins.src, i, ins.recv_tags[0]))
    assert sorted(sends) == sorted(recvs)
    assert len(set(sends)) == len(sends)
    assert len(sends) == 2 * D * M * (S - 1)  # one activation and one gradient per boundary
    for s in range(S):
        forwards = sorted((ins.pipeline, ins.microbatch) for i, prog in programs.items()
                          if P.worker_of(members[i], S)[1] == s
                          for ins in prog.instrs if ins.kind == "F")
        assert forwards == [(p, m) for p in range(D) for m in range(M)]
    if dead:
        assert any(ins.pipeline != prog.logical for prog in programs.values()
                   for ins in prog.instrs if ins.microbatch is not None)


def _state(seed=0):
    torch.manual_seed(seed)
    module = torch.nn.Linear(3, 2).double()
    return StageState(module, torch.optim.Adam(module.parameters(), lr=0.1))


def test_an_optimizer_step_can_be_undone_exactly():
    st = _state()
    for _ in range(2):
        st.module(torch.ones(4, 3, dtype=torch.float64)).sum().backward()
        st.step()
    before = [p.detach().clone() for p in st.params]
    opt_before = {k: v.clone() for k, v in st.optimizer.state_dict()["state"][0].items()}
    st.module(torch.ones(4, 3, dtype=torch.float64)).pow(2).sum().backward()
    st.step()
    assert st.steps == 3 and not torch.equal(st.params[0], before[0])
    st.rollback_to(2)
    assert st.steps == 2
    assert all(torch.equal(a, b) for a, b in zip(st.params, before))
    for k, v in st.optimizer.state_dict()["state"][0].items():
        assert torch.equal(v, opt_before[k])
    st.rollback_to(2)  # already there: nothing to do
    with pytest.raises(RecycleError, match="undo"):
        st.rollback_to(1)


@pytest.mark.parametrize("place", ["host", "device"])
def test_the_undo_copy_lives_where_asked_and_undoes_exactly(place):
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2).double()
    opt = torch.optim.AdamW(module.parameters(), lr=0.1)
    st = StageState(module, opt, scheduler=torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: (k + 1) / 4), undo_copy=place)
    for k in range(3):
        before = copy.deepcopy(st.state_dict())
        st.module(torch.ones(4, 3, dtype=torch.float64)).pow(k + 1).sum().backward()
        st.step()
    assert all(b.device.type == "cpu" for b in st.undo.params)  # no GPU here: both on CPU
    st.rollback_to(2)
    after = st.state_dict()
    assert torch.equal(after["model"]["weight"], before["model"]["weight"])
    assert after["optimizer"]["param_groups"] == before["optimizer"]["param_groups"]
    assert all(torch.equal(v, before["optimizer"]["state"][0][k])
               for k, v in after["optimizer"]["state"][0].items())
    assert after["scheduler"] == before["scheduler"]
    with pytest.raises(RecycleError, match="undo copy place 'disk'"):
        StageState(module, opt, undo_copy="disk")


def test_the_undo_copy_is_skipped_where_no_undo_can_come():
    """A skipped step (apply=False) keeps no tensor, yet its undo restores the LR schedule;
    the generation's only member keeps nothing, and an undo is then refused."""
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2).double()
    opt = torch.optim.Adam(module.parameters(), lr=0.1)
    st = StageState(module, opt, scheduler=torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: (k + 1) / 4))
    st.module(torch.ones(4, 3, dtype=torch.float64)).sum().backward()
    st.step()
    weight = st.params[0].detach().clone()
    state = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    buffers = [b.data_ptr() for b in st.undo.params]
    st.module(torch.ones(4, 3, dtype=torch.float64)).sum().backward()
    st.step(apply=False)
    assert not st.undo.tensors and opt.param_groups[0]["lr"] == pytest.approx(0.075)
    assert [b.data_ptr() for b in st.undo.params] == buffers  # kept for the next full copy
    st.rollback_to(1)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05) and st.scheduler.last_epoch == 1
    assert torch.equal(st.params[0], weight)
    assert all(torch.equal(v, state[k]) for k, v in opt.state_dict()["state"][0].items())

    st.module(torch.ones(4, 3, dtype=torch.float64)).sum().backward()
    st.step(undoable=False)
    assert st.steps == 2 and not st.can_undo
    with pytest.raises(RecycleError, match="only the latest step can be undone"):
        st.rollback_to(1)


def test_state_copies_and_checkpoints_round_trip(tmp_path):
    src, dst = _state(0), _state(1)
    src.module(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
    src.step()
    dst.load_bytes(src.to_bytes())
    assert dst.steps == 1
    assert all(torch.equal(a, b) for a, b in zip(src.params, dst.params))
    assert dst.optimizer.state_dict()["state"][0]["exp_avg"].equal(
        src.optimizer.state_dict()["state"][0]["exp_avg"])
    write_stage_checkpoint(tmp_path, 1, 0, src)
    assert (tmp_path / "checkpoints" / "iter-000001" / "stage0" / ".metadata").is_file()  # DCP
    assert write_manifest(tmp_path, 1, stages=2) is None  # stage 1 missing: not complete
    assert latest_checkpoint(tmp_path) is None
    write_stage_checkpoint(tmp_path, 1, 1, dst)
    folder = write_manifest(tmp_path, 1, stages=2)
    assert latest_checkpoint(tmp_path) == (1, folder)
    back = load_stage_checkpoint(folder, 1)
    assert back["steps"] == 1
    fresh = _state(2)
    fresh.load(back)  # a fresh optimizer takes the DCP-loaded state (int parameter keys)
    assert fresh.optimizer.state_dict()["state"][0]["exp_avg"].equal(
        src.optimizer.state_dict()["state"][0]["exp_avg"])


def test_jobs_load_from_a_file_with_arguments():
    job = load_job(f"{EXAMPLES / 'tiny_mlp.py'}:make_job", ["--stages", "3", "--iterations", "2"])
    assert isinstance(job, Job) and len(job.stages) == 3 and job.iterations == 2
    assert isinstance(job.build_stage(2), torch.nn.Module)
    for target, message in (("nofile.py:make_job", "does not exist"),
                            (f"{EXAMPLES / 'tiny_mlp.py'}:nothing", "no function"),
                            ("tiny_mlp", "FILE.py:FUNCTION"),
                            ("no_such_module_xyz:make", "cannot import")):
        with pytest.raises(RecycleError, match=message):
            load_job(target)
    with pytest.raises(RecycleError, match="iterations"):
        Job(stages=[torch.nn.Linear(1, 1)], loss_fn=None, optimizer=None, data=None,
            iterations=0)


class _FakeGroup:
    """Records what the backend does to a group."""

    def __init__(self):
        self.calls = []

    def size(self):
        return 2

    def abort(self):
        self.calls.append("abort")

    def shutdown(self):
        self.calls.append("shutdown")


def test_nccl_groups_are_aborted_after_a_failure_and_shut_down_after_a_clean_end():
    from recycle_planner.executor.data.comm import BACKENDS, Comm

    for failed, want in ((True, ["abort"]), (False, ["shutdown"])):
        comm = Comm.__new__(Comm)  # no process group on a CPU build: fake ones
        comm.backend, comm.sends, comm.reapers = BACKENDS["nccl"], [], {}
        comm.group, comm.stage_group, comm.scalar_group = _FakeGroup(), _FakeGroup(), None
        groups = (comm.group, comm.stage_group)
        comm.close(failed=failed)
        assert [g.calls for g in groups] == [want, want]
        assert comm.group is None and comm.stage_group is None


def test_backends_set_their_environment_and_device_before_the_first_group():
    from recycle_planner.executor.data.comm import BACKENDS, prepare, set_environment

    env = {"LOCAL_RANK": "3", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert BACKENDS["nccl"].device(env) == torch.device("cuda", 3)
    assert prepare("gloo", env) == torch.device("cpu")
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"   # gloo leaves NCCL's alone
    set_environment("nccl", env)  # torch's default 1 would kill a survivor: CleanUpOnly
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"  # no stale exception_dump in the store
    from recycle_planner.executor import config
    assert tuple(BACKENDS) == config.BACKENDS  # what the CLI offers
    with pytest.raises(RecycleError, match="unknown backend 'mpi'"):
        prepare("mpi", env)
