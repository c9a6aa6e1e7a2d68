"""Every plan of the example libraries, replayed under NCCL's point-to-point rules: the
runtime's issue order (`executor/issue.py`) never deadlocks or mismatches a message, on
per-pair streams or one stream per rank, over two iterations (the staggered optimizer lets
them overlap); the order the runtime used before (receives posted a few ops ahead) deadlocks
every one of them, which the replay must see."""

from dataclasses import replace

import pytest

from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import load_spec
from recycle_planner.library import PlanLibrary, Settings, build_library
from recycle_planner.library.entries import LibraryEntry

from conftest import EXAMPLES

torch = pytest.importorskip("torch")

from recycle_planner.executor.control import protocol as P  # noqa: E402
from recycle_planner.executor.issue import POST, RUN, SEND, Issue  # noqa: E402
from recycle_planner.executor.nccl_check import replay  # noqa: E402
from recycle_planner.executor.data.runtime import Program, compile_program  # noqa: E402

LIBRARIES = [("small.toml", Policy(), 2),
             ("small.toml", Policy(decouple=False, stagger=False), 1),
             ("gpt.toml", Policy(), 1)]


def prefetched(prefetch: int):
    """The issue order the runtime used before: receives posted `prefetch` ops ahead of the
    op that needs them, each send right after its op."""
    def order(program: Program) -> list[Issue]:
        recvs = [k for k, ins in enumerate(program.instrs) if ins.src is not None]
        out, posted, consumed = [], 0, 0
        for k, ins in enumerate(program.instrs):
            consumed += ins.src is not None
            while posted < len(recvs) and posted < consumed + prefetch:
                out.append(Issue(POST, recvs[posted]))
                posted += 1
            out.append(Issue(RUN, k))
            if ins.dst is not None:
                out.append(Issue(SEND, k))
        return out
    return order


def _programs(lib: PlanLibrary, entry: LibraryEntry):
    S, D = lib.spec.stages, lib.spec.pipelines
    dead = [(d, s) for d, stages in enumerate(entry.placement) for s in stages]
    hit = lib.lookup(dead)
    plan = hit.plan()
    members = [r for r in range(D * S) if P.worker_of(r, S) not in set(dead)]
    programs = {i: compile_program(plan, hit.mapping, P.worker_of(r, S), members)
                for i, r in enumerate(members)}
    return programs, {i: P.worker_of(r, S)[1] for i, r in enumerate(members)}


@pytest.fixture(scope="module", params=LIBRARIES, ids=["small", "small-fused-barrier", "gpt"])
def example_library(request, tmp_path_factory):
    name, policy, failures = request.param
    folder = tmp_path_factory.mktemp("lib")
    build_library(load_spec(EXAMPLES / name), policy, failures, folder,
                  Settings(solver="heuristic"), jobs=1)
    return PlanLibrary.open(folder)


def test_every_plan_is_safe_on_nccl_and_the_old_order_deadlocks(example_library):
    lib = example_library
    assert len(lib.entries()) > 1
    for entry in lib.entries():
        programs, stage_of = _programs(lib, entry)
        for streams in ("pair", "rank"):
            assert replay(programs, stage_of, streams=streams) == [], (entry.file, streams)
        old = replay(programs, stage_of, order=prefetched(1))
        assert old and old[0].startswith("deadlock"), entry.file


def test_the_replay_sees_messages_received_in_another_order(example_library):
    """Two receives of one worker swapped: NCCL would hand it the wrong tensor."""
    lib = example_library
    programs, stage_of = _programs(lib, lib.entries()[0])
    rank = next(r for r, s in stage_of.items() if s == 1)
    prog = programs[rank]
    issues = list(prog.issues)
    posts = [i for i, step in enumerate(issues) if step.kind == POST][:2]
    issues[posts[0]], issues[posts[1]] = issues[posts[1]], issues[posts[0]]
    programs[rank] = replace(prog, issues=tuple(issues))
    assert replay(programs, stage_of)[0].startswith("mismatch")
