"""Per-rank programs (`recycle_planner.programs`): every plan of the example libraries compiles,
rank by rank, into programs that NCCL runs without a deadlock or a mixed-up message under every
model of `programs/nccl.py`; the order the executor used before (receives posted a few ops
ahead) deadlocks every one of them, which the replay must see; the executor runs exactly these
programs; they survive JSON; no torch is needed."""

import subprocess
import sys
from dataclasses import replace

import pytest

from recycle_planner.errors import PlanFileError, RecycleError
from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import load_spec
from recycle_planner.library import PlanLibrary, Settings, build_library
from recycle_planner.programs import (Compute, Message, Program, Orders, Recv, Send,
                                      check_orders, compile_all, compile_program, rank_orders,
                                      replay)
from recycle_planner.programs.actions import BACKWARD, FORWARD, message_tag
from recycle_planner.programs.nccl import MODELS

from conftest import EXAMPLES

LIBRARIES = [("small.toml", Policy(), 2),
             ("small.toml", Policy(decouple=False, stagger=False), 1),
             ("gpt.toml", Policy(), 1)]


@pytest.fixture(scope="module", params=LIBRARIES, ids=["small", "small-fused-barrier", "gpt"])
def library(request, tmp_path_factory):
    name, policy, failures = request.param
    folder = tmp_path_factory.mktemp("lib")
    build_library(load_spec(EXAMPLES / name), policy, failures, folder,
                  Settings(solver="heuristic"), jobs=1)
    return PlanLibrary.open(folder)


def situations(lib: PlanLibrary):
    """Per library entry: a physical dead set of its situation, and every live rank's program
    compiled on its own (as a worker does)."""
    S, D = lib.spec.stages, lib.spec.pipelines
    for entry in lib.entries():
        # physical dead workers that differ from the plan's logical ones where they can
        dead = [((D - 1 - g) % D, s) for g, stages in enumerate(entry.placement) for s in stages]
        hit = lib.lookup(dead)
        plan = hit.plan()
        live = [r for r in range(S * D) if (r // S, r % S) not in set(dead)]
        yield dead, hit, plan, {r: compile_program(plan, r, hit.mapping) for r in live}


def prefetched(program: Program, prefetch: int = 1) -> Program:
    """The order the executor used before: each receive posted `prefetch` ops ahead of the op
    that needs it, each send right after its op."""
    ops = [a for a in program.actions if not isinstance(a, Message)]
    recvs = {(a.what, a.pipeline, a.microbatch): a for a in program.actions
             if isinstance(a, Recv)}
    sends = {(a.what, a.pipeline, a.microbatch): a for a in program.actions
             if isinstance(a, Send)}
    keys = [(getattr(a, "consumes", None), getattr(a, "pipeline", None),
             getattr(a, "microbatch", None)) for a in ops]
    needed = [recvs[key] for key in keys if key in recvs]
    out, posted, consumed = [], 0, 0
    for a, key in zip(ops, keys):
        consumed += key in recvs
        while posted < min(len(needed), consumed + prefetch):
            out.append(needed[posted])
            posted += 1
        out.append(a)
        if key in sends:
            out.append(sends[key])
    return replace(program, actions=tuple(out))


def test_every_plan_is_safe_on_nccl_and_the_old_order_deadlocks(library):
    count = 0
    for dead, hit, plan, programs in situations(library):
        for model in MODELS:
            for scalars in (False, True):
                assert replay(programs, model, scalars=scalars) == [], (hit.file, model)
        assert check_orders(rank_orders(plan, hit.mapping)) == []  # the fast check agrees
        old = {r: prefetched(p) for r, p in programs.items()}
        assert replay(old, "fifo")[0].startswith("deadlock"), hit.file
        assert check_orders(Orders.of_programs(old.values()))[
            0].startswith("deadlock"), hit.file
        assert compile_all(plan, hit.mapping) == programs  # a rank alone compiles the same
        count += 1
    assert count == len(library.entries()) > 1


def test_each_rank_talks_to_the_physical_workers_that_run_its_neighbours(library):
    """Every message has one sender and one receiver, the peers are live physical ranks, the
    micro-batches of every pipeline are each computed once per stage (some of them on another
    pipeline's rank when a worker is dead), and the stage's all-reduce names its live ranks."""
    spec = library.spec
    S, D, M = spec.stages, spec.pipelines, spec.microbatches
    for dead, hit, plan, programs in situations(library):
        sends = sorted((r, a.peer, a.tag) for r, p in programs.items() for a in p.actions
                       if isinstance(a, Send))
        recvs = sorted((a.peer, r, a.tag) for r, p in programs.items() for a in p.actions
                       if isinstance(a, Recv))
        assert sends == recvs and len(set(sends)) == len(sends) == 2 * D * M * (S - 1)
        for s in range(S):
            stage = [p for p in programs.values() if p.stage == s]
            forwards = sorted((a.pipeline, a.microbatch) for p in stage for a in p.actions
                              if isinstance(a, Compute) and a.kind == "F")
            assert forwards == [(q, m) for q in range(D) for m in range(M)]
            live = tuple(p.rank for p in stage)
            assert all(p.actions[-2].ranks == live for p in stage)
        assert all(p.loss_scale == 1 / (D * M) for p in programs.values())
        if dead:
            assert any(a.pipeline != p.plays for p in programs.values() for a in p.actions
                       if isinstance(a, Compute))
            with pytest.raises(RecycleError, match="is dead in this plan"):
                compile_program(plan, dead[0][0] * S + dead[0][1], hit.mapping)


def test_the_replay_sees_messages_received_in_another_order(library):
    """A rank posts its second receive from a peer before its first: NCCL would hand it the
    wrong tensor."""
    _, _, _, programs = next(situations(library))
    rank = next(r for r, p in programs.items() if p.stage == 1)
    actions = list(programs[rank].actions)
    i, j = [k for k, a in enumerate(actions) if isinstance(a, Recv)
            and a.peer == actions[0].peer][:2]
    actions.insert(i, actions.pop(j))
    programs[rank] = replace(programs[rank], actions=tuple(actions))
    assert replay(programs, "fifo")[0].startswith("mismatch")
    assert check_orders(Orders.of_programs(programs.values()))[
        0].startswith("mismatch")


@pytest.mark.torch
def test_the_executor_runs_these_programs_in_their_order(library):
    """The executor's runtime only renames the peers as ranks of the generation's group and
    adds the iteration's parity to the tags: its steps are the program's actions, one by one."""
    pytest.importorskip("torch")
    from recycle_planner.executor.data.runtime import POST, RUN, bind

    for dead, hit, plan, programs in situations(library):
        members = sorted(programs)
        for rank, program in programs.items():
            bound = bind(program, members)
            assert len(bound.issues) == len(program.actions)
            for (kind, k), action in zip(bound.issues, program.actions):
                ins = bound.instrs[k]
                if isinstance(action, Message):
                    peer, tags = (ins.src, ins.recv_tags) if kind == POST else (
                        ins.dst, ins.send_tags)
                    assert (isinstance(action, Recv), members[peer], tags) == (
                        kind == POST, action.peer, (action.tag,
                                                    action.tag + program.tag_stride))
                    assert (ins.pipeline, ins.microbatch) == (action.pipeline,
                                                              action.microbatch)
                else:
                    assert kind == RUN and ins.kind == getattr(action, "kind", ins.kind)
            assert bound.instrs[bound.launch].kind in ("W", "B", "ALLREDUCE")
            assert bound.stagger == plan.policy.stagger and bound.logical == program.plays


def test_programs_survive_json_and_an_edited_one_is_refused(library):
    _, _, _, programs = next(situations(library))
    program = programs[max(programs)]
    data = program.to_json()
    assert Program.from_json(data) == program
    for change, message in [
            ({"rank": program.rank - 1}, "is not worker"),
            ({"loss_scale": 0.5}, "'loss_scale' must be"),
            ({"reduce": "mean"}, "'reduce' must be 'sum'"),
            ({"actions": data["actions"][:-2]}, "exactly one ALLREDUCE"),
            ({"actions": [{"op": "Q"}]}, "unknown op 'Q'"),
            ({"actions": [dict(data["actions"][0], peer=10 ** 6)]}, "'peer' must be")]:
        with pytest.raises(PlanFileError, match=message) as info:
            Program.from_json({**data, **change}, "rank.json")
        assert "\n" not in str(info.value) and str(info.value).startswith("rank.json")


def test_tags_name_every_message_of_two_iterations_apart():
    S, D, M = 3, 4, 5
    stride = Program(0, 0, 0, 0, S, D, M, False, ()).tag_stride
    tags = {message_tag(direction, s, p, m, S, D, M) + parity * stride
            for direction in (FORWARD, BACKWARD) for s in range(S) for p in range(D)
            for m in range(M) for parity in (0, 1)}
    assert tags == set(range(2 * stride))


def test_programs_need_no_torch():
    code = ("import sys, recycle_planner.programs, recycle_planner.programs.files, "
            "recycle_planner.cli.program; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
