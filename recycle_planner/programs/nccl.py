"""Replay every rank's program under NCCL's rules: deadlocks and mismatched messages.

gloo matches messages by tag and blocks only the calling thread, so a run on gloo cannot show
what NCCL does with the same order. This replays the programs of consecutive iterations as NCCL
runs them, pessimistic wherever NCCL may be kind (a send completes only when its receive runs,
as for messages too large to be buffered; a collective only when every member runs it). What a
rank issues becomes *items* on streams: point-to-point operations on the stream of their pair
(ProcessGroupNCCL makes one communicator per pair of ranks), compute on the compute stream, the
stage's gradient all-reduce (its buckets and the last stage's loss all-reduce) on the stage's
communicator, started after the program's `launch` action, the all-stage scalar sum of
gradient clipping (`scalars`) on a communicator of every rank at OPTIMIZER, and a barrier after
the iteration when the plan has one. An item starts once the items it depends on are complete
and completes as said. The rules, each a `MODELS` level that adds to the one before:

- `fifo`, NCCL's per-pair FIFO rule (tags are ignored): the operations of one pair run in
  issue order on one stream, the n-th send from a to b is the n-th receive at b from a (other
  tags there: a mismatch, NCCL would hand over the wrong tensor); a compute waits for its
  receive, a send for the compute that produces it.
- `streams`, the stream semantics of ProcessGroupNCCL: an operation issued after compute waits
  for that compute (the NCCL stream waits on an event of the current stream): *a receive posted
  behind compute* starts only when the compute before it is done; the concurrency of the pair:
  a send and its receive complete only together, each running on its rank's stream; a
  collective on its own communicator; the host waits where it reads a result (the clipping
  sum, the barrier), so that nothing it issues later starts before.
- `serial`, one hardware queue per GPU (`CUDA_DEVICE_MAX_CONNECTIONS=1`, which Megatron-LM
  sets) with kernels that do not all fit at once: every item starts after the one issued
  before it has completed. The pair communicators of one rank, the bucket and the scalar
  communicators then never overlap.

Adding rules only adds dependencies, and an item once ready stays ready, so an order that
completes under `serial` completes under the other two: `check.check_plan` replays `serial`
with the scalar sum (in numpy, by events), once per plan, when the library stores a plan and
when `plan` writes one. Under
`serial` the GPU runs kernels in issue order, so the replay covers kernels that do not fit side
by side; with several hardware queues NCCL's own rule applies (kernels of communicators used
concurrently must all fit, or be issued in one order on every rank), which per-pair
communicators share with every pipeline runtime.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping

from recycle_planner.programs.actions import AllReduce, Compute, Program, Recv, Send

MODELS = ("fifo", "streams", "serial")
RUN, P2P, COLL = 0, 1, 2
STAGE, SCALARS, BARRIER = -1, -2, -3  # what a collective item is (an action index otherwise)
COLLECTIVE_NAMES = {STAGE: "the stage all-reduce", SCALARS: "the clipping sum",
                    BARRIER: "the barrier"}


class _Net:
    """The items of every rank (each rank's contiguous, in issue order) and their
    dependencies, which all point to earlier items of the same rank."""

    def __init__(self, programs: Mapping[int, Program]):
        self.programs = programs
        self.kind: list[int] = []
        self.what: list[tuple[int, int]] = []  # (action index or collective code, iteration)
        self.deps: list[tuple] = []
        self.partner: list[int] = []            # p2p: the matching item; coll: its group
        self.ranks: dict[int, range] = {}

    def name(self, i: int) -> str:
        k, it = self.what[i]
        rank = next(r for r, items in self.ranks.items() if i in items)
        label = COLLECTIVE_NAMES[k] if k < 0 else str(self.programs[rank].actions[k])
        return f"{label} of iteration {it}"


class _Issuer:
    """One rank's items in issue order, with the dependencies `model` gives them (under
    `serial` only the item before: it completes after everything before it)."""

    def __init__(self, net: _Net, model: str):
        self.net, self.model = net, model
        self.last: dict[object, int] = {}  # per stream
        self.compute = self.sync = self.prev = None

    def add(self, kind: int, stream: object, what: tuple[int, int], *needs: int,
            sync: bool = False) -> int:
        net = self.net
        i = len(net.kind)
        if self.model == "serial":
            deps = () if self.prev is None else (self.prev,)
        else:
            deps = tuple(d for d in (self.last.get(stream), self.sync, *needs,
                                     self.compute if kind != RUN and self.model != "fifo"
                                     else None) if d is not None)
        net.kind.append(kind)
        net.what.append(what)
        net.deps.append(deps)
        self.last[stream] = self.prev = i
        if kind == RUN:
            self.compute = i
        if sync:
            self.sync = i
        return i


def replay(programs: Mapping[int, Program], model: str = "serial", iterations: int = 2,
           scalars: bool = True) -> list[str]:
    """Replay `iterations` consecutive iterations of `programs` (rank -> program, every live
    rank) under `model` (one of MODELS); `scalars`: every OPTIMIZER first sums a scalar over
    all ranks and reads it (gradient clipping). One line per problem; empty: safe."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    net = _Net(programs)
    sends: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)
    colls: dict[tuple, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    everyone = tuple(sorted(programs))
    problems: list[str] = []
    strict = model != "fifo"
    for rank, program in programs.items():
        first = len(net.kind)
        issuer = _Issuer(net, model)
        add = issuer.add
        launch = program.launch
        group = next(a.ranks for a in program.actions if type(a) is AllReduce)
        if rank not in group:
            problems.append(f"rank {rank}'s ALLREDUCE is over ranks {list(group)}, without it")
        expected = {(a.what, a.pipeline, a.microbatch, a.chunk) for a in program.actions
                    if type(a) is Recv}
        stage_colls = colls[(STAGE, group)][rank] if len(group) > 1 else None
        for it in range(iterations):
            posted: dict[tuple, int] = {}
            ran: dict[tuple, int] = {}
            coll = None
            for k, a in enumerate(program.actions):
                t = type(a)
                if t is Compute:
                    key = (a.consumes, a.pipeline, a.microbatch, a.chunk)
                    if key in posted:
                        i = add(RUN, RUN, (k, it), posted[key])
                    elif key in expected:
                        problems.append(f"rank {rank} runs {a} before posting its receive")
                        continue
                    else:
                        i = add(RUN, RUN, (k, it))
                    ran[key] = i  # what it consumes is what it sends on
                elif t is Recv:
                    i = add(P2P, (P2P, a.peer), (k, it))
                    posted[(a.what, a.pipeline, a.microbatch, a.chunk)] = i
                    recvs[(a.peer, rank)].append((i, a.tag, it))
                    continue
                elif t is Send:
                    source = ran.get((a.what, a.pipeline, a.microbatch, a.chunk))
                    if source is None:
                        problems.append(f"rank {rank} sends {a} before computing it")
                        continue
                    i = add(P2P, (P2P, a.peer), (k, it), source)
                    sends[(rank, a.peer)].append((i, a.tag, it))
                    continue
                elif t is AllReduce:
                    if k == launch and stage_colls is not None:
                        coll = add(COLL, STAGE, (STAGE, it))
                        stage_colls.append(coll)
                    i = add(RUN, RUN, (k, it), *(() if coll is None else (coll,)))
                    continue
                else:  # Optimizer
                    if scalars and strict:
                        c = add(COLL, SCALARS, (SCALARS, it), sync=True)
                        colls[(SCALARS, everyone)][rank].append(c)
                    add(RUN, RUN, (k, it))
                    continue
                if k == launch and stage_colls is not None:  # started once gradients are final
                    coll = add(COLL, STAGE, (STAGE, it), i)
                    stage_colls.append(coll)
            if program.barrier and strict:
                c = add(COLL, BARRIER, (BARRIER, it), sync=True)
                colls[(BARRIER, everyone)][rank].append(c)
        net.ranks[rank] = range(first, len(net.kind))
    net.partner = [-1] * len(net.kind)
    problems += _match(net, sends, recvs)
    if problems:
        return problems
    groups = _groups(net, colls)
    done = _run(net, groups)
    stuck = []
    for rank, items in net.ranks.items():
        blocked = next((i for i in items if not done[i]), None)
        if blocked is not None:
            stuck.append(f"rank {rank} waits at {net.name(blocked)}")
    if stuck:
        return [f"deadlock under the {model!r} model ({len(stuck)} ranks blocked): "
                + "; ".join(stuck[:6])]
    return []


def _match(net: _Net, sends: dict, recvs: dict) -> list[str]:
    """Pair the n-th send from a to b with the n-th receive at b from a (NCCL's rule), and say
    where the two differ."""
    problems = []
    for pair in sorted(set(sends) | set(recvs)):
        src, dst = pair
        out, into = sends.get(pair, []), recvs.get(pair, [])
        for n in range(max(len(out), len(into))):
            if n >= len(out):
                problems.append(f"rank {dst} waits for {net.name(into[n][0])}, which rank {src} "
                                f"never sends")
            elif n >= len(into):
                problems.append(f"rank {src} sends {net.name(out[n][0])}, which rank {dst} never "
                                f"receives")
            elif out[n][1:] != into[n][1:]:
                problems.append(f"mismatch: rank {dst} receives {net.name(into[n][0])}, but "
                                f"rank {src} sends {net.name(out[n][0])} first")
            else:
                net.partner[out[n][0]], net.partner[into[n][0]] = into[n][0], out[n][0]
                continue
            break
    return problems


def _groups(net: _Net, colls: dict) -> list[list[int]]:
    """The n-th collective of every member of a communicator, as one group (a member that
    never gets there leaves its group incomplete: a deadlock)."""
    groups: list[list[int]] = []
    for (_, members), by_rank in colls.items():
        longest = max(len(items) for items in by_rank.values())
        for n in range(longest):
            group = [by_rank[r][n] for r in members if n < len(by_rank.get(r, ()))]
            if len(group) < len(members):
                group.append(-1)  # never complete
            for i in group:
                if i >= 0:
                    net.partner[i] = len(groups)
            groups.append(group)
    return groups


def _run(net: _Net, groups: list[list[int]]) -> bytearray:
    """Start every item whose dependencies are complete until nothing changes; which items
    completed."""
    n = len(net.kind)
    started, done = bytearray(n), bytearray(n)
    arrived = [0] * len(groups)
    kind, partner = net.kind, net.partner
    left = [len(deps) for deps in net.deps]
    waiters: list[list[int]] = [[] for _ in range(n)]
    for i, deps in enumerate(net.deps):
        for d in deps:
            waiters[d].append(i)
    ready = [i for i in range(n) if left[i] == 0]
    finished: list[int] = []
    while ready:
        i = ready.pop()
        started[i] = 1
        if kind[i] == RUN:
            finished.append(i)
        elif kind[i] == P2P:
            if started[partner[i]]:
                finished += (i, partner[i])
        else:
            g = partner[i]
            arrived[g] += 1
            if arrived[g] == len(groups[g]):
                finished += groups[g]
        for j in finished:
            done[j] = 1
            for w in waiters[j]:
                left[w] -= 1
                if left[w] == 0:
                    ready.append(w)
        finished.clear()
    return done
