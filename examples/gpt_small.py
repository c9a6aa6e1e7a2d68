"""A small GPT cut into pipeline stages, trained byte by byte on text that ships with Python.

Stage 0 holds the token and position embeddings and the first transformer blocks, the last
stage the last blocks and the LM head (LayerNorm + Linear to 256 byte values); blocks are
`torch.nn.TransformerEncoderLayer` with a causal mask (pre-norm, GELU, no dropout so that runs
are reproducible). AdamW, a linear LR warm-up (`LambdaLR`, undone with a step when a failure
makes a stage redo its iteration) and clipping to a global gradient norm over all stages.

The text is the source of a few standard-library modules read from the Python install, so
nothing is downloaded; `data(iteration, pipeline, microbatch)` takes windows at offsets drawn
from a generator seeded by its arguments, so any worker can (re)load any micro-batch. With
`--min-seq N` each batch has its own length, from N to `--seq` bytes, drawn per iteration (or
per micro-batch: `--vary microbatch`) from the same kind of seeded generator: the boundaries'
sequence dim is then declared dynamic (`DynamicDims`) and every worker derives each message's
shape from the same draw.

    recycle-planner profile examples/gpt_small.py:make_job --pipelines 2 --microbatches 4 \
        -o gpt.toml
    recycle-planner plan-all gpt.toml --max-failures 1 -o gpt-plans
    recycle-planner launch -n 4 examples/gpt_small.py:make_job -- --library gpt-plans

examples/gpt_demo.sh does all of it, with a worker killed mid-run, and draws the loss curves.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import sys

import torch
from torch import nn

from recycle_planner.errors import RecycleError
from recycle_planner.executor import DynamicDims, Job, run
from recycle_planner.executor import ClipGradNorm

TEXT_MODULES = ("argparse", "textwrap", "json.decoder", "dataclasses", "functools")
VOCAB = 256
VARY = ("iteration", "microbatch")


def options(argv=()) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpt_small", description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks per stage")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64,
                        help="bytes per sequence (the maximum with --min-seq)")
    parser.add_argument("--min-seq", type=int, default=0,
                        help="draw each batch's length from MIN_SEQ to --seq (0: fixed)")
    parser.add_argument("--vary", choices=VARY, default="iteration",
                        help="with --min-seq: one length per iteration or per micro-batch")
    parser.add_argument("--microbatch-size", type=int, default=8, help="sequences")
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=10, help="LR warm-up steps (0: none)")
    parser.add_argument("--clip", type=float, default=1.0,
                        help="global gradient norm (0: no clipping)")
    parser.add_argument("--clip-barrier", action="store_true",
                        help="every stage waits for the global norm before its step (the "
                             "default steps at once and checks it afterwards)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--library", default=None, help="plan library folder")
    return parser.parse_args(list(argv))


@functools.lru_cache(maxsize=1)
def corpus() -> torch.Tensor:
    """The bytes of a few standard-library modules' source, as token ids."""
    import importlib

    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in TEXT_MODULES)
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).long()


class Embed(nn.Module):
    def __init__(self, dim: int, seq: int):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, dim)
        self.positions = nn.Embedding(seq, dim)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.tokens(idx) + self.positions(pos)


class Blocks(nn.Module):
    def __init__(self, n: int, dim: int, heads: int, seq: int):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True) for _ in range(n))
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq),
                             persistent=False)

    def forward(self, h):
        mask = self.mask[:h.shape[1], :h.shape[1]].to(h.dtype)
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        return h


class Head(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, VOCAB)

    def forward(self, h):
        return self.out(self.norm(h))


def stage_factory(s: int, opts: argparse.Namespace):
    def build() -> nn.Module:
        torch.manual_seed(2000 + s)
        parts: list[nn.Module] = []
        if s == 0:
            parts.append(Embed(opts.dim, opts.seq))
        parts.append(Blocks(opts.layers, opts.dim, opts.heads, opts.seq))
        if s == opts.stages - 1:
            parts.append(Head(opts.dim))
        return nn.Sequential(*parts).to(getattr(torch, opts.dtype))
    return build


def seed(iteration: int, pipeline: int, microbatch: int) -> int:
    """One micro-batch's seed: any worker draws the same windows (and length) for it."""
    return ((iteration * 1009) + pipeline) * 9173 + microbatch


def seq_lengths(opts: argparse.Namespace):
    """`(iteration, pipeline, microbatch) -> {"seq": n}`: the batch's length, seeded by the
    iteration (and the micro-batch with `--vary microbatch`), so every worker draws the same."""
    def sizes(iteration: int, pipeline: int, microbatch: int) -> dict[str, int]:
        if not opts.min_seq:
            return {"seq": opts.seq}
        key = iteration if opts.vary == "iteration" else seed(iteration, pipeline, microbatch)
        g = torch.Generator().manual_seed(7919 + key)
        return {"seq": int(torch.randint(opts.min_seq, opts.seq + 1, (1,), generator=g))}
    return sizes


def data_source(opts: argparse.Namespace):
    length = seq_lengths(opts)

    def data(iteration: int, pipeline: int, microbatch: int):
        tokens = corpus()
        seq = length(iteration, pipeline, microbatch)["seq"]
        g = torch.Generator().manual_seed(seed(iteration, pipeline, microbatch))
        starts = torch.randint(0, len(tokens) - opts.seq - 1, (opts.microbatch_size,),
                               generator=g)
        window = torch.stack([tokens[i:i + seq + 1] for i in starts.tolist()])
        return window[:, :-1], window[:, 1:]
    return data


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_job(argv=()) -> Job:
    opts = options(argv)

    def optimizer(params):
        return torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.01)

    def scheduler(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / opts.warmup))

    if not 0 <= opts.min_seq <= opts.seq:
        raise RecycleError(f"--min-seq must be from 0 to --seq ({opts.seq}), got "
                           f"{opts.min_seq}")
    dynamic = DynamicDims({"seq": opts.seq}, seq_lengths(opts)) if opts.min_seq else None
    return Job(stages=[stage_factory(s, opts) for s in range(opts.stages)], loss_fn=loss_fn,
               optimizer=optimizer, data=data_source(opts), iterations=opts.iterations,
               library=opts.library, scheduler=scheduler if opts.warmup else None,
               step_hook=(ClipGradNorm(opts.clip, post_validate=not opts.clip_barrier)
                          if opts.clip else None), dynamic=dynamic)


if __name__ == "__main__":
    run(make_job(sys.argv[1:]))
