"""Global-norm clipping without a barrier (optimizer post-validation, `data/validation.py`).

A stage steps with the clipping factor its own norm allows and checks it when the global norm
arrives, redoing the step in the rare case it differs; under failures `protocol.decide`
settles the steps still pending. Results must be exactly those of global-norm clipping as the
single-process reference computes it: in one process (every kind of outcome), in `decide`
(every way a failure can leave pending steps), and on real worker processes, fault-free and
with kills on both sides of the validation, on gloo and on gloo with NCCL's host semantics.

The tiny MLP with `--clip 0.6` (Adam, float64, 2 x 2 x 4): iterations 0-2 and 7 are not
clipped (the guess is right); in 3 stage 1's own norm is above 0.6 (it waits for the global
norm) and stage 0's below (redone); in 4-6 both stages' own norms are below and the global one
above (both redo)."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

from recycle_planner.errors import RecycleError  # noqa: E402
from recycle_planner.executor import LaunchConfig, launch, parse_fault  # noqa: E402
from recycle_planner.executor.control import protocol as P  # noqa: E402
from recycle_planner.executor.data.hooks import SKIP, ClipGradNorm, validates  # noqa: E402
from recycle_planner.executor.data.state import StageState  # noqa: E402
from recycle_planner.executor.data.validation import PostValidation  # noqa: E402
from helpers.executor_checks import (TINY, assert_losses_equal,  # noqa: E402
                                     assert_params_equal, checkpoint_params, library,
                                     reference)

ARGS = ["--iterations", "8", "--clip", "0.6"]


# -- one process: every outcome equals the barrier's step ------------------------------------

class _Done:
    """A work that completed without error."""

    def is_completed(self):
        return True

    def exception(self):
        return None


class _Sum:
    """A stand-in for the all-stage sum: the global total is given, already arrived."""

    def __init__(self, total: float):
        self.total = total

    def all_stages_start(self, value):
        return _Done(), torch.tensor(self.total, dtype=torch.float64)

    def wait(self, work, what):
        pass

    def confirm(self, works, what, synchronize=True):
        pass


def _stage(grad_scale: float, steps: int = 0) -> StageState:
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3).double()
    state = StageState(module, torch.optim.Adam(module.parameters(), lr=0.1), steps)
    for p in state.params:
        p.grad = torch.full_like(p, grad_scale)
    return state


def _params(state: StageState) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state.params]


@pytest.mark.parametrize("grad, other, redone, late", [
    (0.01, 0.0, False, False),     # global norm under the limit: the guess stands
    (0.01, 100.0, True, False),    # global norm over it: redone with the global factor
    (10.0, 0.0, False, True),      # the stage's own norm is over: it waits, stepping late
    (0.01, math.inf, True, False),  # another stage overflowed: the step is skipped
])
def test_a_validated_step_is_the_barriers_step(grad, other, redone, late):
    hook = ClipGradNorm(1.0)
    assert validates(hook) and not validates(ClipGradNorm(1.0, post_validate=False))
    want = _stage(grad)
    total = float(hook.stats(0, want.params)) + other
    want.step(hook.apply(0, want.params, torch.tensor(total, dtype=torch.float64)))

    got = _stage(grad, steps=3)
    before = _params(got)
    counted = []
    validation = PostValidation(hook, 0, got, counted.append)
    validation.begin(3, _Sum(total))
    assert got.steps == 3 and validation.pending.iteration == 3
    assert any(p.grad is not None for p in got.params)  # kept until validated
    assert (validation.pending.guess is None) == late
    if not late:
        assert not all(torch.equal(a, b) for a, b in zip(before, _params(got)))  # stepped
    settled = validation.settle(_Sum(total))
    assert (settled.counted, settled.redone, settled.late) == (True, redone, late)
    assert got.steps == 4 and counted == [3] and validation.pending is None
    assert all(p.grad is None for p in got.params)
    for a, b in zip(_params(got), _params(want)):
        assert torch.equal(a, b)
    assert validation.known() == {3: (total,)}
    got.rollback_to(3)  # undone since (a restart at 3): its sum is no longer reported
    assert validation.known() == {}
    for a, b in zip(_params(got), before):
        assert torch.equal(a, b)


def test_a_pending_step_settles_as_the_decision_says():
    """With the sum the decision carries, as in the generation; without it, reverted."""
    hook = ClipGradNorm(1.0)
    total = float(hook.stats(0, _stage(0.01).params)) + 100.0
    want = _stage(0.01)
    want.step(hook.apply(0, want.params, torch.tensor(total, dtype=torch.float64)))
    for sums, steps in (({5: (total,)}, 6), ({4: (1.0,)}, 5)):
        got = _stage(0.01, steps=5)
        before = _params(got)
        validation = PostValidation(hook, 0, got)
        validation.begin(5, _Sum(total))
        validation.detach()  # the generation ended before the step was validated
        assert validation.known() == {5: (total,)}
        settled = validation.settle_with(sums)
        assert settled.counted == (steps == 6) and got.steps == steps
        expect = _params(want) if steps == 6 else before
        for a, b in zip(_params(got), expect):
            assert torch.equal(a, b)
        assert all(p.grad is None for p in got.params)


def test_clip_outcomes_and_guesses():
    hook = ClipGradNorm(2.0, eps=0.0)
    assert hook.outcome(0, torch.tensor(16.0)) == 0.5
    assert hook.outcome(0, torch.tensor(1.0)) == 1.0
    assert hook.outcome(0, torch.tensor(math.nan)) == SKIP
    assert hook.guess(0, torch.tensor(1.0)) == 1.0
    assert hook.guess(0, torch.tensor(16.0)) is None
    assert hook.guess(0, torch.tensor(math.inf)) == SKIP


# -- decide: pending steps after a failure ---------------------------------------------------

def _ok(dead):
    return "plan.json.gz", 0.1


def test_decide_counts_a_pending_step_whose_sum_a_survivor_knows():
    """2 stages x 2 pipelines, rank 2 dead. Rank 1 (stage 1) counted step 4 and took step 5,
    pending; rank 3 (stage 1) and rank 0 (stage 0) still have step 4 pending, and only rank 1
    (which validated with it) knows iteration 4's sum. Rank 3 and rank 0 validate with it,
    rank 1 reverts step 5 (nobody knows its sum), and all restart at 5."""
    steps = {0: 4, 1: 5, 3: 4}
    pending = {0: 4, 1: 5, 3: 4}
    known = {0: {3: (0.5,)}, 1: {4: (0.25,)}, 3: {3: (0.5,)}}
    d = P.decide(7, 2, 2, steps, _ok, pending=pending, known=known)
    assert d.action == "run" and d.restart == 5 and d.sums == {4: (0.25,)}
    assert d.dead == ((1, 0),)
    assert P.Decision.from_json(d.to_json()) == d


def test_decide_reverts_pending_steps_whose_sum_nobody_knows():
    steps = {0: 4, 1: 4, 2: 4}
    d = P.decide(3, 2, 2, steps, _ok, pending={1: 4, 2: 4}, known={0: {3: (1.0,)}})
    assert d.restart == 4 and d.sums == {}
    # the worker's own completed sum is enough
    d = P.decide(3, 2, 2, steps, _ok, pending={0: 4, 1: 4, 2: 4},
                 known={1: {3: (1.0,)}, 2: {4: (math.inf,)}})
    assert d.restart == 5 and d.sums == {4: (math.inf,)}
    assert P.Decision.from_json(d.to_json()).sums == {4: (math.inf,)}


def test_decide_settles_before_a_stop_and_keeps_the_one_step_rule():
    d = P.decide(3, 2, 2, {0: 4, 2: 5}, _ok, pending={0: 4}, known={2: {4: (2.0,)}})
    assert d.action == "stop" and d.restart == 5 and d.sums == {4: (2.0,)}
    assert d.members == (0, 2)
    with pytest.raises(RecycleError, match="at most one step"):
        P.decide(3, 2, 2, {0: 4, 1: 5}, _ok, pending={1: 5}, known={1: {5: (1.0,)}})
    with pytest.raises(RecycleError, match="pending step of iteration 6 after 4"):
        P.decide(3, 2, 2, {0: 4, 1: 4}, _ok, pending={1: 6})


# -- real processes -------------------------------------------------------------------------

def _events(result, kind):
    return [e.to_json() for e in result.events if e.kind == kind]


def _settled(result, kind: str) -> int:
    return sum(table[kind][0] for by_gen in result.op_times.values()
               for table in by_gen.values() if kind in table)


def test_fault_free_clipping_without_a_barrier_equals_the_reference(tmp_path):
    lib = library(tmp_path / "lib", stages=2, pipelines=2, microbatches=4, max_failures=1)
    result = launch(TINY, LaunchConfig(nproc=4, run_dir=str(tmp_path / "run")),
                    ["--library", str(lib), *ARGS])
    assert result.status == "completed" and result.iterations == 8
    # every worker: stage 0 redoes 3-6, stage 1 redoes 4-6 and waits in 3
    assert _settled(result, "VALIDATE") == 4 * 8  # every step, the last before the end
    assert _settled(result, "REDO") == 2 * 4 + 2 * 3 and _settled(result, "LATE") == 2
    ref = reference(ARGS, 2, 4)
    _, params = checkpoint_params(tmp_path / "run", 2)
    assert_params_equal(params, ref.params)
    assert_losses_equal(result.losses, ref.losses)


@pytest.mark.parametrize("backend", ["gloo", "nccl-sim"])
def test_kills_before_and_after_validation_equal_the_reference(tmp_path, backend):
    """Worker 0:1 (rank 1) dies before its optimizer step of iteration 1: nobody can know
    that iteration's norm, so the steps its peers took are reverted and iteration 1 is
    redone. Later worker 1:1 (rank 3), whose step of iteration 4 is pending (a guess that
    will be redone), holds at the start of iteration 5 (`hold`: until a restarted worker
    asks to join, seconds later), and worker 1:0 (rank 2) dies right after validating its
    own step of iteration 4, in its first forward of iteration 5, while rank 0 validates
    its own: iteration 4's norm is complete, rank 3 has not used it when the generation is
    abandoned. The decision carries the norm, rank 3 redoes its step with it, and training
    restarts at 5; the restarted workers re-join at 7."""
    lib = library(tmp_path / "lib", stages=2, pipelines=2, microbatches=4, max_failures=2)
    faults = [parse_fault(f) for f in ("1:1:optimizer", "3:5:hold", "2:4:counted")]
    config = LaunchConfig(nproc=4, run_dir=str(tmp_path / "run"), faults=faults,
                          backend=backend, restart_delay=0.0)
    result = launch(TINY, config, ["--library", str(lib), *ARGS])
    assert result.status == "completed" and result.iterations == 8
    gens = _events(result, "generation")
    assert [g["restart"] for g in gens] == [0, 1, 5, 7]
    assert gens[1]["validated"] == []  # iteration 1's norm never completed
    assert gens[2]["pending"]["3"] == 4 and gens[2]["steps"]["3"] == 4
    assert gens[2]["validated"] == [4]
    assert _settled(result, "REDO") >= 1 + 2  # rank 3's at the decision, ranks 0 and 2's
    ref = reference(ARGS, 2, 4)
    _, params = checkpoint_params(tmp_path / "run", 2)
    assert_params_equal(params, ref.params)
    assert_losses_equal(result.losses, ref.losses)
