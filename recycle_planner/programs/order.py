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
right after its op has run. Why no execution can deadlock, even the most serial one NCCL allows
(one operation at a time per rank, in issue order; `nccl.py` lists the rules): take the pending
message with the least key. Everything its sender and its receiver issued before it is a
message with a smaller key (done, by choice of the least) or a compute whose input is such a
message or is local (done); a collective is issued only after the rank's last gradient op,
which every message of that iteration precedes. So both ends reach the message and it
completes: every wait points back in the plan's time, and the waits cannot form a cycle.
`nccl.check_plan` replays it under NCCL's rules on every plan the library stores.
"""

from __future__ import annotations

from typing import Sequence

from recycle_planner.errors import RecycleError
from recycle_planner.programs.actions import Action, Recv, Send


def issue_order(ops: Sequence[tuple[Action, Recv | None, Send | None]]) -> tuple[Action, ...]:
    """The actions of one iteration: each op of `ops` (in the plan's order, with the message it
    receives and the one it sends, if any) with its messages placed in key order."""
    messages = sorted([(recv.key, k, recv) for k, (_, recv, _) in enumerate(ops) if recv]
                      + [(send.key, k, send) for k, (_, _, send) in enumerate(ops) if send],
                      key=lambda m: m[0])
    out: list[Action] = []
    posted: set[int] = set()
    nxt = 0

    def advance(ran: int) -> int:
        """Issue messages in key order up to the first send of an op that has not run."""
        i = nxt
        while i < len(messages):
            _, k, message = messages[i]
            if isinstance(message, Send) and k > ran:
                break
            out.append(message)
            if isinstance(message, Recv):
                posted.add(k)
            i += 1
        return i

    nxt = advance(-1)
    for k, (action, recv, _) in enumerate(ops):
        if recv is not None and k not in posted:
            raise RecycleError(f"{action} receives a message the plan sends after a message "
                               f"this rank sends later: the plan's times contradict its op "
                               f"order")
        out.append(action)
        nxt = advance(k)
    return tuple(out)
