"""Boundary shapes that vary with the data: symbolic layouts found by tracing, resolved per
micro-batch, buffers reused by capacity, and one clear line for bad input."""

import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

from recycle_planner.errors import RecycleError  # noqa: E402
from recycle_planner.executor.data.boundary import (Layout, call, fit, layout_of,  # noqa: E402
                                                    pack, prefix, unpack)
from recycle_planner.executor.data.shapes import (DynamicDims, input_layout, largest,  # noqa: E402
                                                  output_layout)

B, DIM, MAX = 3, 4, 8


def _sizes(iteration, pipeline, microbatch):
    return {"seq": 2 + (iteration + microbatch) % 7}


DIMS = DynamicDims({"seq": MAX}, _sizes)


def _data(iteration, pipeline, microbatch):
    seq = _sizes(iteration, pipeline, microbatch)["seq"]
    return torch.zeros(B, seq, dtype=torch.long), None


class _Stage(torch.nn.Module):
    """An embedding that also returns a causal mask: two leaves with the dynamic dim."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, DIM)

    def forward(self, idx):
        seq = idx.shape[1]
        return {"h": self.emb(idx), "mask": torch.ones(seq, seq, dtype=torch.bool,
                                                       device=idx.device).tril()}


def _trace(module):
    def trace(value):
        with torch.no_grad():
            meta = module.to("meta")
            return layout_of(call(meta, value))
    return trace


def test_stage_input_and_output_layouts_name_the_dims_that_follow_the_data():
    inp = input_layout(DIMS, _data, pipelines=2, microbatches=2)
    assert [x.shape for x in inp.leaves] == [(B, "seq")] and inp.dynamic
    out = output_layout(inp, DIMS, _trace(_Stage()), "stage 0's output")
    assert [x.shape for x in out.leaves] == [(B, "seq", DIM), ("seq", "seq")]
    assert Layout.from_json(out.to_json()) == out
    grads = out.grads()  # the bool mask has no gradient
    assert grads.dynamic and [x.shape for x in grads.leaves] == [(B, "seq", DIM)]
    concrete = out.resolve({"seq": 5})
    real = layout_of(_Stage()(torch.zeros(B, 5, dtype=torch.long)))
    assert concrete == real and not concrete.dynamic
    static = layout_of(torch.zeros(2, 2))
    assert static.resolve({"seq": 5}) is static  # fixed layouts take no detour


def test_messages_of_varying_sizes_share_one_buffer_grown_to_the_largest():
    out = output_layout(input_layout(DIMS, _data, 1, 1), DIMS, _trace(_Stage()), "stage 0")
    buf = None
    grown = []
    for seq in (4, 2, 7, 3, 7):
        layout = out.resolve({"seq": seq})
        new = fit(buf, layout.nbytes, torch.device("cpu"))
        grown.append(new is not buf)
        buf = new
        leaves = [torch.randn(B, seq, DIM), torch.ones(seq, seq, dtype=torch.bool).tril()]
        pack(leaves, layout, buf)
        message = prefix(buf, layout.nbytes)
        assert message.numel() == layout.nbytes  # what travels: exactly this message
        got = unpack(message.clone(), layout)
        assert all(torch.equal(a, b) for a, b in zip(got, leaves))
    assert grown == [True, False, True, False, False]
    assert buf.numel() == out.resolve({"seq": 7}).nbytes


def test_bad_sizes_and_shapes_get_one_line_errors():
    with pytest.raises(RecycleError, match=r"'seq' is 9 in iteration 1, micro-batch 2 of "
                                           r"pipeline 0: .* maximum 8"):
        DynamicDims({"seq": MAX}, lambda i, p, m: {"seq": 9}).of(1, 0, 2)
    with pytest.raises(RecycleError, match=r"name \['len'\], but \['seq'\] were declared"):
        DynamicDims({"seq": MAX}, lambda i, p, m: {"len": 3}).of(0, 0, 0)
    with pytest.raises(RecycleError, match="maximum must be a whole number >= 2"):
        DynamicDims({"seq": 1}, _sizes)
    with pytest.raises(RecycleError, match="'seq' is 8 in every micro-batch"):
        input_layout(DynamicDims({"seq": MAX}, lambda i, p, m: {"seq": 8}), _data, 1, 1)
    layout = layout_of(torch.zeros(2, 3)).resolve({})
    buf = fit(None, layout.nbytes, torch.device("cpu"))
    with pytest.raises(RecycleError, match=r"is \(2, 3\) torch.float64, but \(2, 3\) "
                                           r"torch.float32 was agreed"):
        pack([torch.zeros(2, 3, dtype=torch.float64)], layout, buf)
    for error in [str(e) for e in _errors()]:
        assert "\n" not in error


def _errors():
    inp = input_layout(DIMS, _data, 1, 1)
    doubled = torch.nn.Module()
    doubled.forward = lambda idx: torch.zeros(B, 2 * idx.shape[1], device=idx.device)
    with pytest.raises(RecycleError, match=r"dim 1 of tensor 0 is \[16, 8\] .*derived sizes") \
            as derived:
        output_layout(inp, DIMS, lambda v: layout_of(doubled.forward(v)), "stage 0's output")
    yield derived.value
    shrinking = torch.nn.Module()
    shrinking.forward = lambda idx: (idx.float(),) * (1 if idx.shape[1] == MAX else 2)
    with pytest.raises(RecycleError, match="structure, ranks or dtypes change") as structure:
        output_layout(inp, DIMS, lambda v: layout_of(shrinking.forward(v)), "stage 0's output")
    yield structure.value


def test_the_profiler_measures_the_largest_microbatch_and_sizes_are_asked_once():
    calls = []

    def sizes(iteration, pipeline, microbatch):
        calls.append((iteration, pipeline, microbatch))
        return _sizes(iteration, pipeline, microbatch)

    dims = DynamicDims({"seq": MAX}, sizes)
    key = largest(dims)
    assert dims.of(*key) == {"seq": MAX} and key == (6, 0, 0)  # the first to reach 8
    assert largest(None) == (0, 0, 0)
    calls.clear()
    for _ in range(4):  # a worker's activation and gradient, in and out
        dims.of(3, 1, 2)
    assert calls == [(3, 1, 2)]
