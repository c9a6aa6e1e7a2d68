"""The order in which a rank issues its receives, compute and sends: safe on NCCL.

NCCL matches point-to-point messages by order, not by tag, and runs the operations between two
ranks on one stream in the order they were issued: a receive issued before a send to the same
peer blocks that send until the receive is matched. Posting receives "a few ops ahead" therefore
deadlocks every pipeline schedule: stage 0 queues "receive gradient 0" before "send activation
1", stage 1 queues "receive activation 1" first, and both streams wait for each other.

The rule here: every message has a key, the plan's time at which it is sent (the end of the op
that produces it) with its tag as tie-break, computed identically by its sender and its
receiver. Each rank issues all its messages, sends and receives together, in key order; a
receive as early as that order allows (so that data lands while the rank computes), a send
right after its op has run. Why nothing can deadlock, even when a rank runs one operation at a
time in issue order (the most serial execution NCCL allows; `nccl.py` lists the rules): take
the pending message with the least key. Everything its sender and its receiver issued before
it is a message with a smaller key (complete, by choice of the least) or a compute whose input
is such a message or is local (complete), so both ends reach it and it completes. Every wait
points back in the plan's time. The stage's all-reduce and the optimizer's collectives come
after a rank's last op of the iteration; `nccl.check_plan` replays them with the messages on
every plan the library stores.
"""

from __future__ import annotations

import numpy as np

from recycle_planner.errors import RecycleError

RUN, RECV, SEND = 0, 1, 2  # the steps of an issue order


def issue_order(op_rank: np.ndarray, op: np.ndarray, msg_rank: np.ndarray, msg_op: np.ndarray,
                sends: np.ndarray, time: np.ndarray, tag: np.ndarray) -> np.ndarray:
    """The issue order of several ranks' ops and messages, as a permutation of the ops followed
    by the messages: rank by rank, each rank's ops (`op_rank`, `op`: their place in the rank's
    plan order) in that order, and its messages (`msg_rank`; `msg_op`: the op each feeds or
    comes from; `sends`: True for a send; `time` and `tag`: the key) placed in key order."""
    by_key = np.lexsort((tag, time, msg_rank))
    ranks, ops = msg_rank[by_key], msg_op[by_key]
    # A message goes out after the latest op whose send is at or before it in key order: a
    # prefix maximum within each rank (offset by rank so that ranks do not mix).
    span = int(op.max(initial=0)) + 2
    base = ranks * span
    after = np.maximum.accumulate(base + np.where(sends[by_key], ops, -1) + 1) - base - 1 \
        if len(ops) else ops
    late = ~sends[by_key] & (after >= ops)
    if late.any():
        raise RecycleError(f"rank {int(ranks[late][0])}'s op {int(ops[late][0])} receives a "
                           f"message the plan sends after a message this rank sends later: "
                           f"the plan's times contradict its op order")
    rank = np.concatenate([op_rank, ranks])
    major = np.concatenate([op, after])
    minor = np.concatenate([np.zeros(len(op), np.int64), np.ones(len(ops), np.int64)])
    order = np.lexsort((np.arange(len(rank)), minor, major, rank))
    return np.concatenate([np.arange(len(op)), len(op) + by_key])[order]
