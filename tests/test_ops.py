"""The op text form parses back; the rank layout helpers invert each other."""

import numpy as np
import pytest

from recycle_planner.schedules.ops import (Op, OpSpace, is_collective, worker_at, worker_index,
                                          worker_name)


def test_every_op_text_parses_back_to_the_op():
    space = OpSpace(stages=3, pipelines=2, microbatches=4)
    ops = space.to_ops(np.arange(space.size))
    assert len(set(map(str, ops))) == space.size
    for op in ops:
        assert Op.parse(str(op)) == op
        if op.microbatch is not None:
            assert Op.from_torch_action(op.torch_action(), op.pipeline) == op
    assert str(Op("ALLREDUCE", 1, 2, None)) == "ALLREDUCE(p1 s2)"
    assert Op("W", 0, 1, 3).torch_action() == "1W3"


@pytest.mark.parametrize("text", ["F(p0 s1)", "ALLREDUCE(p0 s1 mb2)", "X(p0 s1 mb2)", "0F1"])
def test_malformed_op_text_is_refused(text):
    with pytest.raises(ValueError, match="not an op"):
        Op.parse(text)


def test_rank_layout_helpers():
    stages = 4
    w = np.arange(12)
    d, s = worker_at(stages, w)
    assert (worker_index(stages, d, s) == w).all()
    assert worker_at(stages, worker_index(stages, 2, 3)) == (2, 3)
    assert worker_name(stages, 9) == "2:1"
    kinds = np.arange(6)
    assert is_collective(kinds).tolist() == [False] * 4 + [True] * 2
