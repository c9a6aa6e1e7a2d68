"""A tiny MLP cut into pipeline stages: the model of the executor's tests, demo and benchmarks.

Use it as a job factory: `recycle-planner launch -n 4 examples/tiny_mlp.py:make_job -- --library
plans/` (the words after `--` are this factory's options, see `options()`), or
`recycle-planner profile examples/tiny_mlp.py:make_job --pipelines 2 --microbatches 4`; or as a
training script, started the way torchrun starts one: `recycle-planner launch -n 4
examples/tiny_mlp.py --library plans/`.

Every stage is a few Linear+Tanh blocks (the last one ends in a Linear head), seeded per stage
so that a single-process reference builds the same weights. Data is a deterministic function
of (iteration, logical pipeline, micro-batch): a seeded generator draws the inputs, the
targets are a fixed smooth function of them (one the MLP learns within a few dozen steps), so
any worker can (re)load any micro-batch.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from recycle_planner.executor import Job, run
from recycle_planner.executor import ClipGradNorm


def options(argv=()) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tiny_mlp", description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=2, help="Linear+Tanh blocks per stage")
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float64")
    parser.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--library", default=None, help="plan library folder")
    parser.add_argument("--data-delay", type=float, default=0.0,
                        help="seconds to sleep per micro-batch loaded (a slow data loader)")
    parser.add_argument("--device-ms", default=None, metavar="F,I,W",
                        help="emulate an accelerator: every stage also spends F ms in each "
                             "forward, I ms in each input-gradient and W ms in each "
                             "weight-gradient pass sleeping, with the CPU free (as while a "
                             "GPU kernel runs), so that step times show the schedule rather "
                             "than CPU contention")
    parser.add_argument("--slow-backward", default=None, metavar="STAGE:SECONDS",
                        help="make one stage's backward pass take this much longer per "
                             "micro-batch (tests use it to order events across stages)")
    parser.add_argument("--data-error", default=None, metavar="ITER:PIPELINE:MB",
                        help="data() raises ValueError for this sample (a bug in user code, "
                             "which stops the job instead of being re-routed)")
    parser.add_argument("--boundary", choices=["tensor", "dict"], default="tensor",
                        help="dict: stages pass {'h': activations, 'sign': an int64 tensor} "
                             "(a float leaf with a gradient and an integer one without)")
    parser.add_argument("--clip", type=float, default=None, metavar="NORM",
                        help="clip gradients to this global norm over all stages")
    parser.add_argument("--clip-barrier", action="store_true",
                        help="with --clip: every stage waits for the global norm before its "
                             "step (the default steps at once and checks it afterwards)")
    parser.add_argument("--warmup", type=int, default=0, metavar="STEPS",
                        help="linear LR warm-up over this many steps (a LambdaLR scheduler)")
    parser.add_argument("--autocast", choices=["bfloat16", "float16"], default=None,
                        help="run forwards under torch.autocast with this dtype")
    return parser.parse_args(list(argv))


class DictBoundary(torch.nn.Module):
    """Wraps a stage: takes {'h', 'sign'} (except stage 0) and returns them (except the last
    stage), where `sign` (int64) is whether each row of h sums to a positive number."""

    def __init__(self, body: torch.nn.Module, first: bool, last: bool):
        super().__init__()
        self.body, self.first, self.last = body, first, last

    def forward(self, h, sign=None):
        if not self.first:
            h = h + 0.1 * sign.unsqueeze(-1).to(h.dtype)
        h = self.body(h)
        if self.last:
            return h
        return {"h": h, "sign": (h.sum(-1) > 0).long()}


class _SleepInBackward(torch.autograd.Function):
    """Identity; sleeps when its gradient is computed."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class Slow(torch.nn.Module):
    """Makes the backward pass through it slower by `seconds` (it sleeps)."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        return _SleepInBackward.apply(x, self.seconds)


class DeviceTime(torch.nn.Module):
    """Spends fixed times per pass with the CPU free: `forward_s` in the forward, `input_s`
    in the input-gradient pass (on the input's path) and `weight_s` in the weight-gradient
    pass (on the path of a one-element parameter whose gradient is always zero, so that
    training is unchanged)."""

    def __init__(self, forward_s: float, input_s: float, weight_s: float, dtype):
        super().__init__()
        self.times = (forward_s, input_s, weight_s)
        self.anchor = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, x):
        time.sleep(self.times[0])
        weight_path = _SleepInBackward.apply(self.anchor, self.times[2]) * 0.0
        return _SleepInBackward.apply(x, self.times[1]) + weight_path


def stage_factory(s: int, opts: argparse.Namespace):
    def build() -> torch.nn.Module:
        torch.manual_seed(1000 + s)
        layers: list[torch.nn.Module] = []
        if opts.device_ms:
            f, i, w = (float(v) / 1e3 for v in opts.device_ms.split(","))
            layers.append(DeviceTime(f, i, w, getattr(torch, opts.dtype)))
        for _ in range(opts.blocks):
            layers += [torch.nn.Linear(opts.width, opts.width), torch.nn.Tanh()]
        if s == opts.stages - 1:
            layers.append(torch.nn.Linear(opts.width, 1))
        if opts.slow_backward and int(opts.slow_backward.split(":")[0]) == s:
            layers.append(Slow(float(opts.slow_backward.split(":")[1])))  # after a Linear:
            # its input needs a gradient even on stage 0
        body = torch.nn.Sequential(*layers).to(getattr(torch, opts.dtype))
        if opts.boundary == "dict":
            return DictBoundary(body, s == 0, s == opts.stages - 1)
        return body
    return build


def data_source(opts: argparse.Namespace):
    dtype = getattr(torch, opts.dtype)

    def data(iteration: int, pipeline: int, microbatch: int):
        if opts.data_error == f"{iteration}:{pipeline}:{microbatch}":
            raise ValueError(f"corrupt sample {microbatch} of pipeline {pipeline} in "
                             f"iteration {iteration}")
        if opts.data_delay:
            time.sleep(opts.data_delay)
        g = torch.Generator().manual_seed(((iteration * 1009) + pipeline) * 9173 + microbatch)
        x = torch.randn(opts.microbatch_size, opts.width, generator=g, dtype=dtype)
        y = torch.tanh(x[:, :1] - 0.5 * x[:, 1:2]) + 0.3 * x[:, 2:3]  # learnable in a few
        # dozen steps, so that a run's losses show it training
        return x, y
    return data


def make_job(argv=()) -> Job:
    opts = options(argv)
    if opts.optimizer == "adam":
        def optimizer(params):
            return torch.optim.Adam(params, lr=opts.lr)
    else:
        def optimizer(params):
            return torch.optim.SGD(params, lr=opts.lr, momentum=0.9)
    scheduler = None
    if opts.warmup:
        def scheduler(opt):
            return torch.optim.lr_scheduler.LambdaLR(
                opt, lambda step: min(1.0, (step + 1) / opts.warmup))
    return Job(stages=[stage_factory(s, opts) for s in range(opts.stages)],
               loss_fn=torch.nn.functional.mse_loss, optimizer=optimizer,
               data=data_source(opts), iterations=opts.iterations, library=opts.library,
               scheduler=scheduler,
               step_hook=(ClipGradNorm(opts.clip, post_validate=not opts.clip_barrier)
                          if opts.clip is not None else None),
               autocast=opts.autocast)


if __name__ == "__main__":
    run(make_job(sys.argv[1:]))
