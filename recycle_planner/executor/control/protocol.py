"""How the launcher and the workers agree on who is alive: generations and the membership decision.

Training runs in *generations*. A generation is a set of live workers with their own process
groups (created under a fresh store namespace `gen{n}/`, so that gloo never reads a dead
worker's stale address) and one plan from the library. Every change of membership (a worker
dies or hangs, a restarted worker joins) ends the generation:

1. The launcher posts `Abort` (failure) or `JoinRequest` (a worker asks to join; the
   workers then stop at an agreed iteration boundary, `SwitchAt`).
2. Every live worker abandons what it was doing and reports `Ready` with the number of
   optimizer steps its stage has counted (`steps`), the step it took and has not validated
   yet, if any (`pending`: post-validated clipping, `data/validation.py`), and the all-stage
   sums it knows (`sums`).
3. The launcher decides (`decide`) and posts generation n+1's `Decision`: the members, the dead
   workers, the iteration to (re)start from, which worker sends its stage's state to which
   newcomer, or `stop` when a stage has no live worker left. A dead set the library lacks is
   first a `plan` decision, never posted: the launcher plans it on demand, adds it to the
   library and decides again.

`JoinRequest` also serves a plan switch without a membership change: when a background
refinement finds a better plan for the current dead set, the members leave the generation at an
agreed iteration boundary the same way, and the next generation runs the better plan.

The store lives in the launcher process, which never takes part in training, so it survives
every worker failure. The messages themselves are the typed records of `messages.py`.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from recycle_planner.errors import RecycleError
from recycle_planner.job.workers import format_workers
from recycle_planner.schedules.ops import Worker, worker_at, worker_index


def decision_key(gen: int) -> str:
    """Where generation `gen`'s `Decision` is posted."""
    return f"gen{gen}/decision"


def worker_of(rank: int, stages: int) -> Worker:
    """Physical (pipeline, stage) of a global rank: ranks are pipeline-major, like
    `Schedule.workers()` (the planner's `worker_at`)."""
    return worker_at(stages, rank)


def rank_of(worker: Worker, stages: int) -> int:
    """The global rank of physical worker (pipeline, stage) (the planner's `worker_index`)."""
    return worker_index(stages, *worker)


def dumps(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"))


DECISION_VERSION = 2
"""The version of `Decision`'s wire format (1, unnumbered: every member, incarnation and
source spelled out). A decision of another version is refused in one line."""


def rank_runs(ranks: Sequence[int]) -> list[list[int]]:
    """Ranks as runs of consecutive ones, [first, count] each, in their order: a
    generation's members are every rank but the dead, so a few runs."""
    runs: list[list[int]] = []
    first = end = None
    for r in ranks:
        if r != end:
            if first is not None:
                runs.append([first, end - first])
            first = r
        end = r + 1
    if first is not None:
        runs.append([first, end - first])
    return runs


def ranks_of(runs: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The ranks `rank_runs` wrote."""
    return tuple(itertools.chain.from_iterable(range(r, r + n) for r, n in runs))


def int_runs(mapping: Mapping[int, int]) -> list[list[int]]:
    """A map of ranks to integers as arithmetic runs, [first rank, count, first value, step]
    each: ranks first .. first+count-1 map to value, value+step, ... Keys in order; a run is
    extended while the next key follows and its value keeps the run's step. Incarnations are
    a constant over the members but a restarted host's (a few runs); the sources of the first
    generation step through the stages (a run per pipeline); a restarted host's sources are
    one run."""
    runs: list[list[int]] = []
    first = n = start = step = 0
    for k in sorted(mapping):
        v = mapping[k]
        if n and k == first + n and (n == 1 or v == start + n * step):
            if n == 1:
                step = v - start
            n += 1
            continue
        if n:
            runs.append([first, n, start, step])
        first, n, start, step = k, 1, v, 0
    if n:
        runs.append([first, n, start, step])
    return runs


def ints_of(runs: Sequence[Sequence[int]]) -> dict[int, int]:
    """The map `int_runs` wrote."""
    out: dict[int, int] = {}
    for first, n, value, step in runs:
        keys = range(first, first + n)
        out.update(zip(keys, range(value, value + n * step, step)) if step
                   else dict.fromkeys(keys, value))
    return out


@dataclass(frozen=True)
class Decision:
    """What generation `gen` is: `members` (sorted global ranks; a member's rank in the
    generation's process group is its index here), the `dead` physical workers, the iteration
    every member starts at (`restart`), `sources[rank] = rank` that sends its stage's
    parameters and optimizer state to a worker that has none (a restarted worker, or every
    non-first worker of a stage at the very start), and the plan file chosen for the dead set.
    `action` is `run`, `stop` (then `reason` says why, and the members only write a
    checkpoint of iteration `restart`) or `plan` (the library has no plan for the dead set:
    the launcher's to answer, never posted). `incarnations[rank]` is the process of that rank
    the decision counts on: a worker that reads a decision that does not count on it (its
    lease expired, a newer incarnation took its place) is fenced and leaves without acting
    on it (`excludes`). `sums[i]` is the all-stage sum of iteration i for every member whose
    step of iteration i is pending: it validates that step with it before anything else
    (`settle`); a member whose pending step's iteration is not there reverts it."""

    gen: int
    action: str
    members: tuple[int, ...]
    dead: tuple[Worker, ...]
    restart: int
    sources: Mapping[int, int] = field(default_factory=dict)
    plan: str | None = None
    degradation: float | None = None
    reason: str = ""
    incarnations: Mapping[int, int] = field(default_factory=dict)
    sums: Mapping[int, tuple[float, ...]] = field(default_factory=dict)

    def excludes(self, rank: int, incarnation: int) -> bool:
        """Whether this decision leaves out the worker process (`rank`, `incarnation`)."""
        return rank not in self.members or self.incarnations.get(rank, incarnation) != incarnation

    def to_json(self) -> str:
        """The wire format, version `DECISION_VERSION`: members as runs of consecutive ranks,
        `incarnations` and `sources` as arithmetic runs (`int_runs`). At 8,192 ranks, a
        host's loss: 0.1 kB instead of 112 kB (every member and its incarnation spelled out),
        which each survivor decodes and the coordinator's store sends once per host."""
        return dumps({"v": DECISION_VERSION, "gen": self.gen, "action": self.action,
                      "members": rank_runs(self.members),
                      "dead": [list(w) for w in self.dead], "restart": self.restart,
                      "sources": int_runs(self.sources),
                      "plan": self.plan, "degradation": self.degradation,
                      "reason": self.reason,
                      "incarnations": int_runs(self.incarnations),
                      "sums": {str(k): list(v) for k, v in self.sums.items()}})

    @classmethod
    def from_json(cls, text: str | bytes) -> "Decision":
        d = json.loads(text)
        version = d.get("v", 1) if isinstance(d, dict) else None  # unnumbered: version 1
        if version != DECISION_VERSION:
            raise RecycleError(f"a decision in format version {version}, this build reads "
                               f"version {DECISION_VERSION}: the coordinator and the workers "
                               f"run different versions of recycle-planner")
        return cls(gen=int(d["gen"]), action=d["action"], members=ranks_of(d["members"]),
                   dead=tuple(tuple(w) for w in d["dead"]), restart=int(d["restart"]),
                   sources=ints_of(d["sources"]), plan=d["plan"],
                   degradation=d["degradation"], reason=d["reason"],
                   incarnations=ints_of(d["incarnations"]),
                   sums={int(k): tuple(float(x) for x in v) for k, v in d["sums"].items()})

    def group_rank(self, rank: int) -> int:
        return self.members.index(rank)


def settle(steps: Mapping[int, int | None], pending: Mapping[int, int],
           known: Mapping[int, Mapping[int, Sequence[float]]]
           ) -> tuple[dict[int, int | None], dict[int, tuple[float, ...]]]:
    """The step counts once every pending step is settled, and the sums that settle them.

    `pending[rank]` is the iteration of a step the worker took before the all-stage sum it
    depends on was known (it counted `steps[rank]` steps before, so that is
    `steps[rank]`); `known[rank]` the sums it knows by iteration. A pending step of
    iteration i counts iff some reporting worker knows iteration i's sum: every member of
    the generation contributed to it, so nobody holds a result that depends on i's other
    outcome. Why this keeps stages within one step: a worker that counted step i knows
    i's sum (it validated with it), and i's sum completed only once every member had taken
    (or was waiting to take) step i; so when some survivor has counted i, every survivor
    still at i has i pending and counts it now, and a pending step of i+1 that cannot count
    (its sum needs every member past i) only ever meets survivors at i+1."""
    sums: dict[int, tuple[float, ...]] = {}
    for rank in sorted(known):
        for iteration, values in known[rank].items():
            sums.setdefault(iteration, tuple(float(v) for v in values))
    settled = dict(steps)
    used: dict[int, tuple[float, ...]] = {}
    for rank, iteration in pending.items():
        if steps.get(rank) != iteration:
            raise RecycleError(f"rank {rank} reports a pending step of iteration {iteration} "
                               f"after {steps.get(rank)} counted steps")
        if iteration in sums:
            settled[rank] = iteration + 1
            used[iteration] = sums[iteration]
    return settled, used


def decide(gen: int, pipelines: int, stages: int, steps: Mapping[int, int | None],
           lookup: Callable[[list[Worker]], tuple[str, float] | None], initial: bool = False,
           bug: str | None = None, incarnations: Mapping[int, int] | None = None,
           pending: Mapping[int, int] | None = None,
           known: Mapping[int, Mapping[int, Sequence[float]]] | None = None) -> Decision:
    """The membership decision for generation `gen`, from the workers that reported.

    `steps[rank]` is the number of optimizer steps a reporting worker's stage has taken, or
    None for a worker that holds no state (a restarted one). Every other rank is dead.
    `lookup(dead)` returns the plan file and its predicted degradation for the dead physical
    workers, None when the library has no plan for them (the decision is then `plan`: plan it,
    then decide again), or raises a `RecycleError` (a launcher that does not plan on demand:
    beyond the threshold).
    With `initial`, everyone holds a fresh model and the first worker of each stage sends its
    parameters to its peers, so that all replicas start equal.

    The restart iteration is the least step count: a stage that already stepped in the
    abandoned iteration undoes that step (steps differ by at most one, because no stage can
    step iteration i+1 before every stage has stepped iteration i).

    `pending` and `known` (by rank: the iteration of a step taken before its all-stage sum was
    known, and the sums known) are settled first (`settle`): the step counts iff a survivor
    knows its sum, which the decision carries (`Decision.sums`); the restart is then the
    least settled count.

    `bug` (an exception in user code, reported by a worker) is never re-routed: the decision
    is a stop at the restart iteration, so that the members write a consistent checkpoint;
    so is any other reason to stop the job (a SIGTERM at preemption) passed as `bug`.
    `incarnations[rank]`: the process of each reporting rank, recorded in the decision."""
    steps, sums = settle(steps, pending or {}, known or {})
    members = tuple(sorted(steps))
    incs = {r: incarnations[r] for r in members} if incarnations else {}
    dead = tuple(worker_of(r, stages) for r in range(pipelines * stages) if r not in steps)
    stateful = {r: k for r, k in steps.items() if k is not None}
    by_stage: dict[int, list[int]] = {}
    for r in sorted(stateful):
        by_stage.setdefault(worker_of(r, stages)[1], []).append(r)
    restart = min(stateful.values()) if stateful else 0
    if stateful and max(stateful.values()) - restart > 1:
        raise RecycleError(f"workers report step counts {sorted(set(stateful.values()))}: "
                           f"stages may differ by at most one step")

    def stop(reason: str) -> Decision:
        return Decision(gen, "stop", tuple(sorted(stateful)), dead, restart, reason=reason,
                        incarnations=incs, sums=sums)

    if bug is not None:
        return stop(bug)
    holders = [s for s in range(stages) if s not in by_stage]
    if holders:
        s = holders[0]
        return stop(f"no live worker holds the parameters of stage {s} (dead: "
                    f"{format_workers(dead)})")
    try:
        found = lookup(list(dead))
    except RecycleError as exc:
        return stop(str(exc))
    if found is None:
        return Decision(gen, "plan", members, dead, restart,
                        reason=f"no plan for dead workers {format_workers(dead)}", sums=sums)
    plan, degradation = found
    sources: dict[int, int] = {}
    for r in members:
        s = worker_of(r, stages)[1]
        first = by_stage[s][0]
        if steps[r] is None or (initial and r != first):
            sources[r] = first
    return Decision(gen, "run", members, dead, restart, sources, plan, degradation,
                    incarnations=incs, sums=sums)
