"""The order in which a worker issues its receives, compute ops and sends: safe on NCCL.

NCCL matches point-to-point messages by order, not by tag, and runs the operations between two
ranks on one stream in the order they were issued: a receive issued before a send to the same
peer blocks that send until the receive is matched. Posting receives "a few ops ahead" (what
the executor did before) therefore deadlocks every pipeline schedule: stage 0 queues "receive
gradient 0" before "send activation 1", stage 1 queues "receive activation 1" first, and both
streams wait for each other.

The rule here: every message has a key, the plan's time at which it is sent (the end of the
op that produces it) with its tag as tie-break, computed identically by its sender and its
receiver. Each worker issues all its messages, sends and receives together, in key order;
a receive as early as that order allows (so data still lands while the worker computes), a
send once its op has run. Why no schedule of a valid plan can deadlock that way: a stream
(per pair of ranks, or one per rank: both are covered, as a subsequence of a key-ordered list
is key-ordered) then carries messages in increasing send time on both of its ends, a receive
waits only for messages sent earlier, an op waits only for data sent before it starts, and
an op's send waits for that op: every wait points back in the plan's time, so the waits
cannot form a cycle. `nccl_check.replay` checks it by replaying the order; gloo (tags) runs
the same order.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from recycle_planner.errors import RecycleError

POST, RUN, SEND = "recv", "run", "send"


class Issue(NamedTuple):
    """One step of a worker's iteration: post the receive of instruction `instr`, run it, or
    send its output."""

    kind: str
    instr: int


def issue_order(instrs: Sequence) -> tuple[Issue, ...]:
    """The steps of one iteration of `instrs` (the runtime's `Instr`: `src`/`dst` say whether
    it receives/sends, `recv_key`/`send_key` order its messages)."""
    messages = sorted([(ins.recv_key, POST, k) for k, ins in enumerate(instrs)
                       if ins.src is not None]
                      + [(ins.send_key, SEND, k) for k, ins in enumerate(instrs)
                         if ins.dst is not None])
    out: list[Issue] = []
    posted: set[int] = set()
    nxt = 0

    def advance(ran: int) -> int:
        i = nxt
        while i < len(messages):
            _, kind, k = messages[i]
            if kind == SEND and k > ran:
                break
            out.append(Issue(kind, k))
            if kind == POST:
                posted.add(k)
            i += 1
        return i

    nxt = advance(-1)
    for k, ins in enumerate(instrs):
        if ins.src is not None and k not in posted:
            raise RecycleError(f"op {k} ({ins.kind}) receives a message the plan sends after "
                               f"a message this worker sends later: the plan's times "
                               f"contradict its op order")
        out.append(Issue(RUN, k))
        nxt = advance(k)
    return tuple(out)
