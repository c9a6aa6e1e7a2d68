"""Replay every worker's issue order under NCCL's rules and report deadlocks and mismatches.

gloo matches messages by tag and never blocks one operation behind another, so a test on gloo
cannot show what NCCL would do with the same order. The model here is NCCL's, pessimistic
where NCCL may be kind (a send completes only when its receive is matched, as for messages
too large to be buffered):

- `streams="pair"`: the point-to-point operations between two ranks run on one FIFO stream,
  in issue order (ProcessGroupNCCL's per-pair communicators); `"rank"`: all of a rank's
  point-to-point operations share one stream (one communicator for every peer).
- A receive from `a` is matched with the next send of `a` to it; if their tags differ, NCCL
  would deliver the wrong tensor (a mismatch).
- A send starts once the op producing its tensor has run; an op runs once its receive has
  completed. The stage's collectives (gradient buckets, the last stage's losses) run on their
  own communicator: a worker starts them during its program's `launch` op (its last W or B,
  or ALLREDUCE itself when it has neither) and its ALLREDUCE completes once every live worker
  of the stage has started them.

`replay` returns one line per problem (empty: the order is safe for these iterations).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping

from recycle_planner.executor.issue import POST, RUN, SEND

STREAMS = ("pair", "rank")


def replay(programs: Mapping[int, object], stage_of: Mapping[int, int], iterations: int = 2,
           streams: str = "pair", order=None) -> list[str]:
    """Replay `iterations` consecutive iterations of `programs` (group rank -> the runtime's
    `Program`); `stage_of[rank]` groups the all-reduce. `order(program)` gives a program's
    issue steps (default: `program.issues`, what the runtime runs)."""
    if streams not in STREAMS:
        raise ValueError(f"streams must be one of {STREAMS}, got {streams!r}")
    order = order or (lambda program: program.issues)
    # Per rank: the compute sequence and its comm streams, as lists of (kind, k, iteration).
    compute: dict[int, list[tuple[int, int]]] = {}
    queues: dict[tuple, list[tuple[str, int, int]]] = defaultdict(list)
    for rank, program in programs.items():
        steps = order(program)
        runs = []
        for it in range(iterations):
            for kind, k in steps:
                if kind == RUN:
                    runs.append((k, it))
                else:
                    ins = program.instrs[k]
                    peer = ins.src if kind == POST else ins.dst
                    queues[_stream(rank, peer, streams)].append((kind, k, it))
        compute[rank] = runs
    ran: set[tuple[int, int, int]] = set()        # (rank, k, iteration)
    received: set[tuple[int, int, int]] = set()
    head = {rank: 0 for rank in programs}
    qhead = {q: 0 for q in queues}
    problems: list[str] = []
    stages: dict[int, list[int]] = defaultdict(list)
    for rank in programs:
        stages[stage_of[rank]].append(rank)

    def instr(rank, k):
        return programs[rank].instrs[k]

    def started(rank, it):
        """Whether `rank` has started its stage's collectives of iteration `it`."""
        launch = programs[rank].launch
        if (rank, launch, it) in ran:
            return True
        runs = compute[rank]  # no W or B: started at its ALLREDUCE, even while it waits there
        return instr(rank, launch).kind == "ALLREDUCE" and head[rank] < len(runs) \
            and runs[head[rank]] == (launch, it)

    def tag(rank, k, it, kind):
        ins = instr(rank, k)
        return (ins.recv_tags if kind == POST else ins.send_tags)[it % 2]

    progress = True
    while progress and not problems:
        progress = False
        for rank, runs in compute.items():
            while head[rank] < len(runs):
                k, it = runs[head[rank]]
                ins = instr(rank, k)
                if ins.src is not None and (rank, k, it) not in received:
                    break
                if ins.kind == "ALLREDUCE" and not all(
                        started(r, it) for r in stages[stage_of[rank]]):
                    break
                ran.add((rank, k, it))
                head[rank] += 1
                progress = True
        for q, items in queues.items():
            if qhead[q] >= len(items):
                continue
            kind, k, it = items[qhead[q]]
            rank = q[0]
            if kind != SEND or (rank, k, it) not in ran:
                continue
            dst = instr(rank, k).dst
            other = _stream(dst, rank, streams)
            peer_items = queues.get(other, [])
            if qhead.get(other, 0) >= len(peer_items):
                continue
            pkind, pk, pit = peer_items[qhead[other]]
            if pkind != POST or instr(dst, pk).src != rank:
                continue
            sent, wanted = tag(rank, k, it, SEND), tag(dst, pk, pit, POST)
            if sent != wanted:
                problems.append(f"mismatch: rank {dst} receives {_name(instr(dst, pk), pit)} "
                                f"from rank {rank}, which sends "
                                f"{_name(instr(rank, k), it)} first")
                break
            received.add((dst, pk, pit))
            qhead[q] += 1
            qhead[other] += 1
            progress = True
    if problems:
        return problems
    stuck = [f"rank {rank} waits before {_name(instr(rank, runs[head[rank]][0]), it)}"
             for rank, runs in compute.items() if head[rank] < len(runs)
             for it in [runs[head[rank]][1]]]
    stuck += [f"rank {q[0]} stream {q[1:] or ''}: {items[qhead[q]][0]} of "
              f"{_name(instr(q[0], items[qhead[q]][1]), items[qhead[q]][2])} pending"
              for q, items in queues.items() if qhead[q] < len(items)]
    if stuck:
        return [f"deadlock ({len(stuck)} blocked): " + "; ".join(stuck[:6])]
    return []


def _stream(rank: int, peer: int, streams: str) -> tuple:
    return (rank, peer) if streams == "pair" else (rank,)


def _name(ins, iteration: int) -> str:
    mb = "" if ins.microbatch is None else f" mb{ins.microbatch}"
    return f"{ins.kind}(p{ins.pipeline}{mb}) of iteration {iteration}"
