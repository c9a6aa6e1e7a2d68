"""Shared pieces of the executor's multi-process tests: plan libraries for the tiny MLP,
the single-process reference, and the comparisons."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from recycle_planner.executor import train_reference
from recycle_planner.executor.data.state import latest_checkpoint, load_stage_checkpoint
from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.library import Settings, build_library

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = f"{EXAMPLES / 'tiny_mlp.py'}:make_job"
RTOL = 1e-9
"""float64 runs agree to about 1e-15; the issue asks for 1e-5."""


def tiny_job(args: list[str]):
    sys.path.insert(0, str(EXAMPLES))
    from tiny_mlp import make_job

    return make_job(args)


def library(folder: Path, stages: int, pipelines: int, microbatches: int, max_failures: int,
            policy: Policy = Policy()) -> Path:
    spec = JobSpec.from_dict({"stages": stages, "pipelines": pipelines,
                              "microbatches": microbatches,
                              "time": {"forward": 1, "backward_input": 1, "backward_weight": 1,
                                       "p2p": 0.1, "allreduce": 0.5, "optimizer": 0.2}})
    build_library(spec, policy, max_failures, folder, Settings(solver="heuristic"), jobs=1)
    return folder


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def assert_params_equal(stage_params: list[dict], want: list[dict], rtol: float = RTOL) -> None:
    assert len(stage_params) == len(want)
    for s, (got, ref) in enumerate(zip(stage_params, want)):
        assert got.keys() == ref.keys(), f"stage {s}"
        for name in ref:
            err = max_rel(got[name], ref[name])
            assert err <= rtol, f"stage {s} {name}: relative difference {err:.3g}"


def checkpoint_params(run_dir: Path, stages: int) -> tuple[int, list[dict]]:
    found = latest_checkpoint(run_dir)
    assert found is not None, f"no complete checkpoint in {run_dir}"
    iteration, folder = found
    return iteration, [load_stage_checkpoint(folder, s)["model"] for s in range(stages)]


def assert_losses_equal(got: list, want: list[float], rtol: float = RTOL) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a is not None, f"iteration {i}: loss missing"
        assert abs(a - b) <= rtol * abs(b), f"iteration {i}: loss {a} != {b}"


def reference(args: list[str], pipelines: int, microbatches: int):
    return train_reference(tiny_job(args), pipelines, microbatches)
