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


def issue_order(ops: int, op: np.ndarray, sends: np.ndarray, time: np.ndarray,
                tag: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The issue order of a rank with `ops` ops (run in their order) and messages `op`
    (the op each feeds or comes from), `sends` (True: a send), `time` and `tag` (the key):
    per step, RUN, RECV or SEND, and its op (for a RUN) or message (otherwise) index."""
    by_key = np.lexsort((tag, time))
    # A message goes out after the latest op whose send is at or before it in key order.
    after = np.maximum.accumulate(np.where(sends[by_key], op[by_key], -1)) if len(op) else op
    late = ~sends[by_key] & (after >= op[by_key])
    if late.any():
        k = int(op[by_key][late][0])
        raise RecycleError(f"op {k} receives a message the plan sends after a message this "
                           f"rank sends later: the plan's times contradict its op order")
    major = np.concatenate([np.arange(ops), after])
    minor = np.concatenate([np.zeros(ops, np.int64), np.ones(len(op), np.int64)])
    index = np.concatenate([np.arange(ops), by_key])
    order = np.lexsort((np.arange(len(major)), minor, major))
    step = np.concatenate([np.full(ops, RUN), np.where(sends[by_key], SEND, RECV)])[order]
    return step, index[order]
