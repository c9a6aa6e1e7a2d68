"""Boundary shapes that vary with the data (a sequence length per batch), known on every worker
without a message.

The job declares its dynamic dims by name with a maximum, and a function giving their sizes for
any micro-batch: `DynamicDims({"seq": 512}, sizes)` with `sizes(iteration, pipeline,
microbatch) -> {"seq": 371}`, deterministic like `Job.data` (usually the same draw). At start
every boundary gets a *symbolic* layout (`boundary.Layout` whose dims are ints or names):
stage 0 learns which dims of its input are which name from a few samples of the data
(`input_layout`), and every stage traces its output on meta tensors at the maximal sizes and
once more per name at a smaller size (`output_layout`), so a dim that follows a name is that
name. Before each message, its sender and its receiver resolve the layout with `sizes` of the
micro-batch: both know the exact byte count, so the receive is still posted early, NCCL's
count-matching holds, no header travels and nothing is read back from the device.

Why not a header with the shapes before each payload (Megatron's `variable_seq_lengths`): the
payload's receive could be posted only after the header was read on the host (a device sync
per message), which also breaks the issue order's early receives on NCCL. docs/executor.md
weighs the two.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from recycle_planner.errors import RecycleError
from recycle_planner.executor.data.boundary import Layout, layout_of, symbolic

SCAN_ITERATIONS = 64
"""How many iterations of `sizes` `input_layout` scans for micro-batches whose dims differ."""

SEEN = 4096
"""How many micro-batches' sizes `DynamicDims.of` remembers (several iterations' worth)."""

SizesFn = Callable[[int, int, int], Mapping[str, int]]


@dataclass(frozen=True)
class DynamicDims:
    """Named boundary dims whose sizes vary per micro-batch: `maxima` bounds each (and sizes
    the traces), `sizes(iteration, pipeline, microbatch)` gives them (`pipeline` logical, as
    in `Job.data`)."""

    maxima: Mapping[str, int]
    sizes: SizesFn
    _seen: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """Checked sizes by micro-batch: a worker asks up to four times per micro-batch (its
    activation and gradient, in and out), the user's function runs once."""

    def __post_init__(self) -> None:
        if not self.maxima:
            raise RecycleError("DynamicDims needs at least one named dim")
        for name, top in self.maxima.items():
            if not isinstance(name, str) or not name:
                raise RecycleError(f"a dynamic dim's name must be a non-empty string, "
                                   f"got {name!r}")
            if isinstance(top, bool) or not isinstance(top, int) or top < 2:
                raise RecycleError(f"dynamic dim {name!r}: the maximum must be a whole "
                                   f"number >= 2, got {top!r}")

    def of(self, iteration: int, pipeline: int, microbatch: int) -> dict[str, int]:
        """The sizes of one micro-batch, checked against the declaration."""
        key = (iteration, pipeline, microbatch)
        got = self._seen.get(key)
        if got is None:
            if len(self._seen) >= SEEN:
                self._seen.clear()
            got = self._seen[key] = self._check(key, dict(self.sizes(*key)))
        return got

    def _check(self, key: tuple[int, int, int], got: dict[str, int]) -> dict[str, int]:
        iteration, pipeline, microbatch = key
        where = f"iteration {iteration}, micro-batch {microbatch} of pipeline {pipeline}"
        if got.keys() != self.maxima.keys():
            raise RecycleError(f"dynamic dim sizes of {where} name {sorted(got)}, but "
                               f"{sorted(self.maxima)} were declared")
        for name, size in got.items():
            if isinstance(size, bool) or not isinstance(size, int) or \
                    not 1 <= size <= self.maxima[name]:
                raise RecycleError(f"dynamic dim {name!r} is {size!r} in {where}: it must "
                                   f"be a whole number from 1 to its declared maximum "
                                   f"{self.maxima[name]}")
        return got


def input_layout(dims: DynamicDims, data: Callable, pipelines: int, microbatches: int) -> Layout:
    """The symbolic layout of stage 0's input: a dim is a name when it equals that name's size
    in samples where the size differs; constant dims stay numbers."""
    names = sorted(dims.maxima)
    first = (0, 0, 0)
    base = dims.of(*first)
    picks = [first]
    for name in names:
        other = next((key for key in _keys(pipelines, microbatches)
                      if dims.of(*key)[name] != base[name]), None)
        if other is None:
            raise RecycleError(f"dynamic dim {name!r} is {base[name]} in every micro-batch of "
                               f"the first {SCAN_ITERATIONS} iterations: cannot tell which "
                               f"input dims it is (fixed shapes need no DynamicDims)")
        picks.append(other)
    samples = [(layout_of(data(*key)[0], "stage 0's input"), dims.of(*key)) for key in picks]
    return _label([s for s, _ in samples], [z for _, z in samples], names,
                  "stage 0's input (from the data)")


def output_layout(inp: Layout, dims: DynamicDims, trace: Callable[[Any], Layout],
                  what: str) -> Layout:
    """The symbolic layout of a stage's output: `trace(value)` (the layout of the stage's output
    for input `value`, on meta tensors) at the maximal sizes, then once per name at half its
    maximum."""
    names = sorted(dims.maxima)
    top = dict(dims.maxima)
    assignments = [top] + [{**top, name: top[name] // 2} for name in names]
    outs = [trace(inp.resolve(sizes).meta()) for sizes in assignments]
    return _label(outs, assignments, names, what)


def largest(dims: DynamicDims | None) -> tuple[int, int, int]:
    """The (iteration, pipeline, microbatch) with the largest sizes among the first
    `SCAN_ITERATIONS` iterations' first micro-batches ((0, 0, 0) for fixed shapes): what the
    profiler measures, so that the plan's memory and times hold for every micro-batch."""
    if dims is None:
        return (0, 0, 0)
    return max(_keys(1, 1), key=lambda key: (math.prod(dims.of(*key).values()), -key[0]))


def _keys(pipelines: int, microbatches: int):
    return itertools.product(range(SCAN_ITERATIONS), range(pipelines), range(microbatches))


def _label(layouts: list[Layout], assignments: list[dict[str, int]], names: list[str],
           what: str) -> Layout:
    """One symbolic layout from concrete `layouts` observed under `assignments`: each dim is
    the one name whose sizes it follows, or the number it always is."""
    first = layouts[0]
    for other in layouts[1:]:
        if other.spec != first.spec or [(len(x.shape), x.dtype) for x in other.leaves] != \
                [(len(x.shape), x.dtype) for x in first.leaves]:
            raise RecycleError(f"{what}: the structure, ranks or dtypes change with the "
                               f"dynamic dims; only sizes may change")
    shapes = []
    for i, leaf in enumerate(first.leaves):
        shape: list[int | str] = []
        for d in range(len(leaf.shape)):
            seen = [layout.leaves[i].shape[d] for layout in layouts]
            follows = [n for n in names if seen == [a[n] for a in assignments]]
            if len(follows) == 1:
                shape.append(follows[0])
            elif len(set(seen)) == 1:
                shape.append(seen[0])
            else:
                raise RecycleError(
                    f"{what}: dim {d} of tensor {i} is {seen} under the dynamic dims "
                    f"{assignments}: " + ("it follows several of them alike" if follows else
                                          "not equal to one declared dim (derived sizes such "
                                          "as 2*seq are not supported)"))
        shapes.append(tuple(shape))
    return symbolic(first.spec, [(s, x.dtype) for s, x in zip(shapes, first.leaves)])
