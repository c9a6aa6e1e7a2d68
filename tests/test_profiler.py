"""`recycle-planner profile` and the launcher's command line: specs from measurements, and
one-line errors for bad input."""

import pytest
from click.testing import CliRunner

from recycle_planner.cli.main import main
from recycle_planner.executor.job import Job
from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import load_spec
from recycle_planner.planner import plan_situation

from conftest import EXAMPLES

pytest.importorskip("torch")

TINY = f"{EXAMPLES / 'tiny_mlp.py'}:make_job"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_profile_measures_every_stage_and_writes_a_spec_the_planner_reads(tmp_path):
    out = tmp_path / "tiny.toml"
    r = run("profile", TINY, "-d", "2", "-m", "4", "-o", out, "--repeats", "5", "--name", "tiny",
            "--", "--blocks", "3", "--microbatch-size", "8")
    assert r.exit_code == 0, r.output
    assert "wrote" in r.output and "activation" in r.output
    spec = load_spec(out)
    assert (spec.name, spec.stages, spec.pipelines, spec.microbatches) == ("tiny", 2, 2, 4)
    assert spec.microbatch_size == 8
    for values in (spec.forward, spec.backward_input, spec.backward_weight, spec.optimizer,
                   spec.p2p, spec.allreduce):  # communication measured between processes
        assert all(v > 0 for v in values)
    # Stage 0 keeps its input and each block's Tanh output: 4 float64 tensors of 8 x 16, and
    # the send buffer of its output while the micro-batch is in flight (pooled by what is in
    # flight, as the receive buffers: the received input of stage 1 is one of its tensors).
    message = 8 * 16 * 8
    assert spec.memory.activation[0] == 4 * message + message
    assert spec.memory.activation[1] > spec.memory.activation[0]
    params0 = 3 * (16 * 16 + 16) * 8
    base = 5 * params0  # params, grads, buckets, Adam's two moments (no send buffers now)
    assert base <= spec.memory.static[0] <= base + 64  # + Adam's step counters
    text = out.read_text()
    assert "# stage 0 spread (p90-p10)/median: F " in text and "p2p" in text
    # the step-undo copy on the device: one more copy of the parameters and Adam's state
    dev = tmp_path / "dev.toml"
    r = run("profile", TINY, "-d", "2", "-m", "4", "-o", dev, "--repeats", "2", "--p2p", "0.1",
            "--allreduce", "0.1", "--undo-copy", "device", "--", "--blocks", "3",
            "--microbatch-size", "8")
    assert r.exit_code == 0, r.output
    undo = load_spec(dev).memory.static[0] - spec.memory.static[0]
    assert 3 * params0 <= undo <= 3 * params0 + 64
    # Stage 0 has no input gradient: its I is bookkeeping, its W the whole backward.
    assert spec.backward_input[0] < spec.backward_weight[0]
    plan = plan_situation(spec, Policy(), [(1, 0)])
    assert plan.metrics.period > 0


def test_profile_with_given_communication_costs(tmp_path):
    out = tmp_path / "spec.toml"
    r = run("profile", TINY, "-d", "3", "-m", "2", "-o", out, "--p2p", "0.05",
            "--allreduce", "0.25", "--memory-budget", "1GiB", "--repeats", "2", "--warmup", "0")
    assert r.exit_code == 0, r.output
    spec = load_spec(out)
    assert spec.p2p == (0.05, 0.05) and spec.allreduce == (0.25, 0.25)
    assert spec.memory.budget == 2**30 and spec.pipelines == 3


@pytest.mark.parametrize("args, message", [
    (["profile", "nothere.py:make_job", "-d", "2", "-m", "2", "-o", "x.toml"], "does not exist"),
    (["profile", TINY, "-d", "2", "-m", "2", "-o", "x.toml", "--memory-budget", "lots"],
     "memory-budget"),
    (["launch", "-n", "4", "nothere.py:make_job"], "does not exist"),
    (["launch", "-n", "4", "--inject-fault", "1:x:F0", TINY], "RANK:ITERATION:POINT"),
    (["launch", "-n", "4", "--inject-fault", "7:1:F0", TINY], "outside 0..3"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    r = run(*args)
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]


def test_launch_checks_the_library_against_the_worker_count(tmp_path):
    lib = tmp_path / "lib"
    r = run("plan-all", EXAMPLES / "small.toml", "-f", "1", "-o", lib, "-j", "1")
    assert r.exit_code == 0, r.output
    r = run("launch", "-n", "4", "--library", lib, "--run-dir", tmp_path / "run", TINY)
    assert r.exit_code == 2
    assert "2 pipelines x 4 stages = 8 workers, not 4" in r.output


@pytest.mark.parametrize("device, message", [("foo", "unknown device 'foo'"),
                                             ("mps", "measures cpu or cuda")])
def test_unusable_device_is_one_line(device, message):
    from recycle_planner.errors import RecycleError
    from recycle_planner.executor.profile import usable_device

    with pytest.raises(RecycleError, match=message):
        usable_device(device)
    assert str(usable_device("cpu")) == "cpu"


def test_profile_a_job_whose_stages_pass_dicts(tmp_path):
    """Stages that pass {'h': floats, 'sign': int64} (tiny_mlp --boundary dict), through a
    middle stage: the float leaf gets gradients, the integer one is passed along."""
    out = tmp_path / "dict.toml"
    r = run("profile", TINY, "-d", "2", "-m", "2", "-o", out, "--p2p", "0.05", "--allreduce",
            "0.25", "--repeats", "2", "--warmup", "0", "--", "--boundary", "dict",
            "--stages", "3", "--microbatch-size", "4")
    assert r.exit_code == 0, r.output
    spec = load_spec(out)
    assert spec.stages == 3 and spec.microbatch_size == 4
    assert all(v > 0 for v in spec.forward + spec.backward_weight)
    assert spec.backward_input[1] > 0  # the middle stage differentiates its received 'h'
    assert min(spec.memory.activation) > 0


def test_spread_is_the_interdecile_range_over_the_median_and_warns_when_large(caplog):
    from recycle_planner.job.profiler import StageProfile, spread, spread_note

    assert spread([1.0]) == 0.0
    assert spread([1.0] * 9 + [2.0]) == pytest.approx(0.0)  # one outlier of ten: p90 is 1.0
    assert spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((5 - 1) / 3)
    st = StageProfile(1, 1, 1, 1, 1, 1, 1, 1, spread={"F": 0.1, "p2p": 40.0})
    with caplog.at_level("WARNING"):
        note = spread_note([st])
    assert note == "stage 0 spread (p90-p10)/median: F 10%, p2p 4000%"
    assert "stage 0's p2p varied by 4000% of its median" in caplog.text


def _job(autocast=None, events=None):
    """Two float32 stages, an LR scheduler and a step hook that record what the profiler
    ran."""
    import torch

    events = events if events is not None else []

    def stage(s):
        def build():
            torch.manual_seed(s)
            return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(),
                                       torch.nn.Linear(32, 32))
        return build

    def scheduler(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda k: events.append("scheduler") or 1.0 / (k + 1))

    class Hook:
        def stats(self, stage, params):
            events.append(("stats", stage))
            return torch.zeros((), dtype=torch.float64)

        def apply(self, stage, params, total):
            events.append(("apply", stage))
            return True

    def data(iteration, pipeline, microbatch):
        g = torch.Generator().manual_seed(iteration)
        return torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)

    return Job([stage(0), stage(1)], torch.nn.functional.mse_loss,
               lambda p: torch.optim.SGD(p, lr=0.1), data, iterations=1, scheduler=scheduler,
               step_hook=Hook(), autocast=autocast)


def test_the_profiler_runs_the_runtimes_handlers_with_autocast_scheduler_and_hook():
    """What is measured is what runs: under bfloat16 autocast the forward saves and sends
    bfloat16 tensors (the old copy of the runtime ran float32 whatever the job said), and
    every profiled step stepped the job's LR scheduler and ran its step hook."""
    from recycle_planner.executor.profile import profile_stages

    events = []
    plain = profile_stages(_job(events=events), repeats=3, warmup=1)
    steps = 3 + 1 + 1  # repeats, warm-up, the iteration that measures activations
    assert events.count("scheduler") == 2 * (steps + 1)  # LambdaLR's own first call per stage
    assert [e for e in events if e != "scheduler"] == \
        [("stats", 0), ("apply", 0)] * steps + [("stats", 1), ("apply", 1)] * steps
    mixed = profile_stages(_job("bfloat16"), repeats=3, warmup=1)
    assert plain[0].output_bytes == 16 * 32 * 4 and mixed[0].output_bytes == 16 * 32 * 2
    assert mixed[1].input_bytes == 16 * 32 * 2
    assert mixed[0].activation < plain[0].activation
    assert mixed[0].static == plain[0].static  # parameters and optimizer stay float32


def test_nccl_buffers_are_estimated_from_its_defaults_into_a_cuda_jobs_static_memory():
    """A worker holds one two-rank communicator per neighbouring-stage worker (re-routing may
    reach any), plus its generation's, stage's and scalar rings: 4 MiB per connection and
    channel. The estimate goes into the static memory it is given for; gloo's is 0."""
    from recycle_planner.job.profiler import (NCCL_BUFFSIZE, StageProfile, job_spec,
                                              nccl_estimate)

    middle = nccl_estimate(1, 3, 4, scalars=True)
    assert (middle.pair_communicators, middle.collective_communicators) == (8, 3)
    assert middle.total == (8 * 2 * 2 + 3 * 2 * 2) * NCCL_BUFFSIZE  # 176 MiB
    alone = nccl_estimate(0, 1, 1, scalars=False)
    assert (alone.pair_communicators, alone.collective_communicators) == (0, 1)
    st = StageProfile(1.0, 1.0, 1.0, 1.0, activation=100, static=1000, output_bytes=10,
                      grad_bytes=8, undo_bytes=8, input_bytes=20)
    stages = [st, st, st]
    nccl = [nccl_estimate(s, 3, 4, True).total for s in range(3)]
    spec, _ = job_spec(stages, 4, 2, [0.1] * 3, [0.1] * 3, [], [], 2**40, 8, nccl=nccl)
    assert list(spec.memory.static) == [1000 + n for n in nccl]
    assert list(spec.memory.activation) == [100 + 10 + 20] * 3  # and its two send buffers
    spec, _ = job_spec(stages, 4, 2, [0.1] * 3, [0.1] * 3, [], [], 2**40, 8,
                       undo_on_device=True)
    assert list(spec.memory.static) == [1008] * 3
