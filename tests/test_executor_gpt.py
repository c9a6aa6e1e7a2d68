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


def test_a_small_gpt_loses_a_worker_and_trains_on_exactly(tmp_path):
    lib = library(tmp_path / "lib", stages=2, pipelines=2, microbatches=2, max_failures=1)
    config = LaunchConfig(nproc=4, run_dir=str(tmp_path / "run"),
                          faults=[parse_fault("2:2:F1")])
    result = launch(GPT, config, ["--library", str(lib), *SMALL])
    assert result.status == "completed" and result.iterations == 5
    gens = [e for e in result.events if e["kind"] == "generation"]
    assert [g["dead"] for g in gens] == [[], [[1, 0]]] and gens[1]["restart"] == 2

    sys.path.insert(0, str(EXAMPLES))
    from gpt_small import make_job

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = train_reference(make_job(SMALL), pipelines=2, microbatches=2)
    finally:
        torch.set_num_threads(threads)
    assert ref.losses[-1] < ref.losses[0]  # it learns
    _, params = checkpoint_params(tmp_path / "run", 2)
    assert_params_equal(params, ref.params)
    assert_losses_equal(result.losses, ref.losses)
