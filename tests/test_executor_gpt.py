"""The small GPT of examples/gpt_small.py (embedding on stage 0, LM head last, AdamW, LR
warm-up, global-norm clipping, byte-level text from the standard library) on 4 worker
processes, shrunk to seconds: worker 1:0 is killed mid-forward in iteration 2, its pipeline's
micro-batches are re-routed, and training ends with the parameters and losses of one process
training the same model on the same data (float64, so they agree to rounding)."""

import sys

import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

from recycle_planner.executor import (LaunchConfig, launch, parse_fault,  # noqa: E402
                                      train_reference)
from helpers.executor_checks import (EXAMPLES, assert_losses_equal,  # noqa: E402
                                     assert_params_equal, checkpoint_params, library)

GPT = f"{EXAMPLES / 'gpt_small.py'}:make_job"
SMALL = ["--dim", "16", "--heads", "2", "--layers", "1", "--seq", "16", "--microbatch-size",
         "2", "--iterations", "5", "--warmup", "3", "--clip", "0.5", "--dtype", "float64"]


def _reference(args):
    sys.path.insert(0, str(EXAMPLES))
    from gpt_small import make_job

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_reference(make_job(args), pipelines=2, microbatches=2)
    finally:
        torch.set_num_threads(threads)


def _killed_run(tmp_path, args: list[str], fault: str):
    """The 2x2x2 GPT trained 5 iterations by 4 processes with one worker killed at `fault`:
    the launch result and its generation events."""
    lib = library(tmp_path / "lib", stages=2, pipelines=2, microbatches=2, max_failures=1)
    config = LaunchConfig(nproc=4, run_dir=str(tmp_path / "run"), faults=[parse_fault(fault)])
    result = launch(GPT, config, ["--library", str(lib), *args])
    assert result.status == "completed" and result.iterations == 5
    return result, [e.to_json() for e in result.events if e.kind == "generation"]


def _assert_equals_reference(tmp_path, result, ref) -> None:
    _, params = checkpoint_params(tmp_path / "run", 2)
    assert_params_equal(params, ref.params)
    assert_losses_equal(result.losses, ref.losses)


def test_a_small_gpt_loses_a_worker_and_trains_on_exactly(tmp_path):
    result, gens = _killed_run(tmp_path, SMALL, "2:2:F1")
    assert [g["dead"] for g in gens] == [[], [[1, 0]]] and gens[1]["restart"] == 2

    ref = _reference(SMALL)
    assert ref.losses[-1] < ref.losses[0]  # it learns
    _assert_equals_reference(tmp_path, result, ref)


def test_sequence_lengths_vary_per_microbatch_through_a_kill(tmp_path):
    """Each micro-batch has its own length (5 to 16 bytes, drawn from the seed): every
    activation and gradient message has the shape its micro-batch's draw gives, on both ends,
    also for the micro-batches re-routed after worker 0:1 dies in the middle of iteration 3's
    backward; the result equals one process training on the same data."""
    args = [*SMALL, "--min-seq", "5", "--vary", "microbatch"]
    result, gens = _killed_run(tmp_path, args, "1:3:I0")
    assert [g["dead"] for g in gens] == [[], [[0, 1]]]

    sys.path.insert(0, str(EXAMPLES))
    from gpt_small import make_job

    lengths = {make_job(args).data(i, p, m)[0].shape[1]
               for i in range(5) for p in range(2) for m in range(2)}
    assert len(lengths) >= 5  # the shapes really vary
    _assert_equals_reference(tmp_path, result, _reference(args))
