"""What crosses a stage boundary: a tensor, or a tuple, list or dict of tensors, as one message.

Real models pass more than one tensor between stages (hidden states and a mask, a dict of
named tensors). Every leaf is packed into one byte buffer at 16-byte aligned offsets, so that
one message per micro-batch and direction still suffices (the issue order and the tags stay as
they are) and the receive buffer of each message can be allocated once and reused. A
`Layout` (leaf shapes and dtypes and the tree's structure) is agreed once per run through the
store; a stage module receives a tuple as positional arguments, a dict as keyword arguments.
Gradients travel back the same way, packed for the floating-point leaves only.

A layout may be *symbolic*: some dims are names (`shapes.DynamicDims`) whose sizes vary per
micro-batch; `resolve` gives the concrete layout of one message, and the buffers are reused by
capacity (`fit`: the largest message seen, the message a prefix of it).
"""

from __future__ import annotations

import json
from typing import Any, Callable, NamedTuple

import torch
from torch.utils import _pytree as pytree

from recycle_planner.errors import RecycleError

ALIGN = 16


class Leaf(NamedTuple):
    shape: tuple[int | str, ...]  # a str: a dynamic dim's name (symbolic layouts only)
    dtype: torch.dtype
    offset: int       # bytes into the packed buffer (0 in a symbolic layout)
    nbytes: int


class Layout(NamedTuple):
    spec: Any                 # pytree TreeSpec
    leaves: tuple[Leaf, ...]
    nbytes: int               # 0 in a symbolic layout
    dynamic: bool = False     # some dims are names: `resolve` before use

    def to_json(self) -> str:
        return json.dumps({"spec": pytree.treespec_dumps(self.spec),
                           "leaves": [[list(x.shape), str(x.dtype).removeprefix("torch.")]
                                      for x in self.leaves]})

    @classmethod
    def from_json(cls, text: str) -> "Layout":
        data = json.loads(text)
        return symbolic(pytree.treespec_loads(data["spec"]),
                        [(tuple(shape), getattr(torch, dtype))
                         for shape, dtype in data["leaves"]])

    def grads(self) -> "Layout":
        """The layout of the gradients sent back for this value: its floating-point leaves."""
        floats = [(x.shape, x.dtype) for x in self.leaves if x.dtype.is_floating_point]
        return symbolic(pytree.tree_flatten([0] * len(floats))[1], floats)

    def resolve(self, sizes: dict[str, int]) -> "Layout":
        """The concrete layout for the dynamic dims' `sizes` (itself when it has none)."""
        if not self.dynamic:
            return self
        return _layout(self.spec, [(tuple(sizes[d] if isinstance(d, str) else d
                                          for d in x.shape), x.dtype) for x in self.leaves])

    def meta(self) -> Any:
        """The value as meta tensors (shapes and dtypes only), to trace a module."""
        return pytree.tree_unflatten([torch.empty(x.shape, dtype=x.dtype, device="meta")
                                      for x in self.leaves], self.spec)


def symbolic(spec: Any, leaves: list[tuple[tuple[int | str, ...], torch.dtype]]) -> Layout:
    """A layout whose dims may be names (dynamic: offsets wait for `resolve`)."""
    if any(isinstance(d, str) for shape, _ in leaves for d in shape):
        return Layout(spec, tuple(Leaf(tuple(shape), dtype, 0, 0) for shape, dtype in leaves),
                      0, dynamic=True)
    return _layout(spec, leaves)


def _layout(spec: Any, leaves: list[tuple[tuple[int, ...], torch.dtype]]) -> Layout:
    out, offset = [], 0
    for shape, dtype in leaves:
        nbytes = _numel(shape) * dtype.itemsize
        out.append(Leaf(tuple(shape), dtype, offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return Layout(spec, tuple(out), offset)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def layout_of(value: Any, what: str = "stage output") -> Layout:
    leaves, spec = pytree.tree_flatten(value)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise RecycleError(f"{what} holds a {type(leaf).__name__}: stages may pass a "
                               f"tensor or a tuple, list or dict of tensors")
    return _layout(spec, [(tuple(x.shape), x.dtype) for x in leaves])


def flat(value: Any) -> list[torch.Tensor]:
    return pytree.tree_flatten(value)[0]


def fit(buf: torch.Tensor | None, nbytes: int, device: torch.device) -> torch.Tensor:
    """`buf` if it holds `nbytes`, else a new buffer of exactly that many: a buffer grows to
    the largest message seen and every message uses a prefix of it."""
    if buf is not None and buf.numel() >= nbytes:
        return buf
    return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)


def prefix(buf: torch.Tensor, nbytes: int) -> torch.Tensor:
    """What one message of `nbytes` sends or receives from a buffer `fit` gave."""
    n = max(nbytes, 1)
    return buf if buf.numel() == n else buf[:n]


def agreed_at_start() -> str:
    """Where a fixed layout comes from, for `pack`'s error."""
    return "was agreed at start: shapes must not change during training without DynamicDims"


def pack(leaves: list[torch.Tensor | None], layout: Layout, out: torch.Tensor,
         expected: Callable[[], str] = agreed_at_start) -> torch.Tensor:
    """Copy `leaves` (None: zeros) into `out` (at least `layout.nbytes` bytes); `expected()`
    says where the layout came from, for the error on a tensor that does not fit it (built
    only then)."""
    for leaf, x in zip(leaves, layout.leaves):
        view = out[x.offset:x.offset + x.nbytes].view(x.dtype).view(x.shape)
        if leaf is None:
            view.zero_()
        else:
            if tuple(leaf.shape) != x.shape or leaf.dtype != x.dtype:
                raise RecycleError(f"a stage boundary tensor is {tuple(leaf.shape)} "
                                   f"{leaf.dtype}, but {x.shape} {x.dtype} {expected()}")
            view.copy_(leaf.detach())
    return out


def unpack(buf: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """The leaves of `layout` as views into `buf`."""
    return [buf[x.offset:x.offset + x.nbytes].view(x.dtype).view(x.shape)
            for x in layout.leaves]


def call(module: torch.nn.Module, value: Any) -> Any:
    """Run a stage on a boundary value: a tuple as positional arguments, a dict as keywords."""
    if isinstance(value, tuple):
        return module(*value)
    if isinstance(value, dict):
        return module(**value)
    return module(value)
