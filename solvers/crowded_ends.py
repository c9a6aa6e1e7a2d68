"""(crowded ends) A lower bound from the busiest workers of one stage crowding stage 0's first
and last moments.

Stage 0's workers share one window: each one's ops lie between its previous step and its next,
and its step waits for stage 0's all-reduce, which waits for all of them (with a barrier,
between time 0 and the barrier). Put that window at [0, Z - AR_0 - OPT_0) for a period Z. A
live worker X of stage s >= 1 that runs c micro-batches then runs its forwards no earlier than
L = head_s and its input backwards ending no later than U = Z - AR_0 - OPT_0 - W_0 - up_s (each
one's gradient still travels to stage 0 and is followed by W_0). Between them it runs
  work = c (F_s + I_s) + (c - cap_s)+ W_s,
the weight gradients counted being those that must end before its last forward starts (the
memory cap). The slack sigma = U - L - work is idle or extra weight gradients.

Its last forward (micro-batch x) starts a round trip of length rho_s (round_trip_s - F_s)
before x's own input backward, and in between X runs no forward and, idle and extra work
included, at most sigma of anything but input backwards: so at least
k = 1 + ceil((rho_s - sigma) / I_s)+ input backwards follow its last forward, and the j-th last
of them (j <= k) ends no earlier than L + work - (j - 1) I_s (everything else of `work` is
before it). Its micro-batch then needs I_0 and W_0 on its stage-0 worker after the gradient's
trip, before the window closes. Mirrored, at least 1 + ceil((rho_s - sigma) / F_s)+ forwards
precede X's first input backward, and the j-th first of them starts no later than
U - work + (j - 1) F_s, so its micro-batch's F_0 has a deadline.

One stage-0 worker runs the F_0, I_0 and W_0 of many such micro-batches: a set of them fits
only if every time interval holds the work of the windows inside it. Each micro-batch's
stage-0 worker is its pipeline's (any live one if that is dead), and a worker of a stage with
dead workers may run any dead pipeline's micro-batches, so the candidates are known; if no
assignment of the micro-batches at X's ends to stage-0 workers fits, no plan has period Z.
Which workers are busiest is not known: at least D M - live (n_s - 1) of them run n_s or more
(busiest_load), every other one its own M, and fewer micro-batches only loosen all of the
above, so every choice of those workers is tried (up to swapping interchangeable ones). Only
one stage at a time is counted (the same micro-batch at two stages would be counted twice).
A search that runs out of nodes refutes nothing, so every limit here only weakens the bound.

All of it is monotone in Z, so the bound is the largest Z on the cost grid (grid.py) above the
other bounds for which this refutes every period below Z. (4x4x8, unit costs, worker 1:2 dead,
split, staggered: the two peers that run 11 micro-batches each need their last two input
backwards' micro-batches on four different stage-0 workers, and they can use only three: 35,
the plan, where the other bounds give 34.)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.schedules.ops import Worker
from recycle_planner.solvers.chains import busiest_load, chains
from recycle_planner.solvers.grid import model_scale

# Micro-batches counted at each end of a worker (fewer only weakens the bound).
ENDS = 4
# Assignment search nodes per stage and period tried; beyond them the stage is left to the
# other bounds (refuting nothing is sound).
MAX_NODES = 2_000
# Grid steps above the other bounds tried by doubling (then bisection below the first miss).
MAX_STEPS = 1 << 12
EPS = 1e-9


@dataclass(frozen=True)
class Job:
    """Stage-0 work of one micro-batch at a worker's end: `amount` inside [release, deadline)
    on one of `workers`."""

    release: float
    deadline: float
    amount: float
    workers: tuple[int, ...]


def fits(jobs: list[Job]) -> bool:
    """Whether one machine can run these jobs: every interval between a release and a deadline
    holds the work of the windows inside it with room to spare (at any period just below the
    one tried, every window is a little shorter)."""
    for lo in {j.release for j in jobs}:
        for hi in {j.deadline for j in jobs}:
            if hi <= lo:
                continue
            inside = sum(j.amount for j in jobs if j.release >= lo and j.deadline <= hi)
            if inside > 0 and inside >= hi - lo - EPS:
                return False
    return True


def assignable(jobs: list[Job], workers: int, budget: list[int]) -> bool:
    """Whether the jobs can go to their candidate stage-0 workers so that each one's set
    fits; depth-first, the most constrained first. True when the node budget runs out."""
    order = sorted(jobs, key=lambda j: (len(j.workers), j.deadline - j.release - j.amount))
    on: list[list[Job]] = [[] for _ in range(workers)]

    def place(i: int) -> bool:
        if i == len(order):
            return True
        budget[0] -= 1
        if budget[0] < 0:
            return True
        job = order[i]
        for w in job.workers:
            on[w].append(job)
            if fits(on[w]) and place(i + 1):
                return True
            on[w].pop()
        return False

    return place(0)


class CrowdedEnds:
    """The refutation test for one situation (module docstring)."""

    def __init__(self, spec: JobSpec, policy: Policy, failed: tuple[Worker, ...]):
        S, D = spec.stages, spec.pipelines
        self.spec = spec
        self.dead = set(failed)
        c = chains(spec, policy)
        self.fwd, self.inp, self.wgt, self.caps = c.fwd, c.inp, c.wgt, c.caps
        self.tail0, self.head, self.up = c.tail[0], c.head, c.up
        # From the end of stage s's forward to the start of its input backward.
        self.rho = [c.round_trip[s] - c.fwd[s] for s in range(S)]
        self.n = busiest_load(spec, failed)
        live0 = [d for d in range(D) if (d, 0) not in self.dead]
        self.index0 = {d: i for i, d in enumerate(live0)}
        self.live0 = len(live0)
        self.dead_at = [[p for p in range(D) if (p, s) in self.dead] for s in range(S)]

    def stage0_of(self, d: int) -> tuple[int, ...]:
        """The stage-0 workers that may run pipeline d's first and last ops."""
        if (d, 0) in self.dead:
            return tuple(range(self.live0))
        return (self.index0[d],)

    def candidates(self, d: int, s: int) -> tuple[int, ...]:
        """Stage-0 workers of the micro-batches that live worker (d, s) may run."""
        return tuple(sorted({w for p in [d] + self.dead_at[s] for w in self.stage0_of(p)}))

    @staticmethod
    def count(rho: float, sigma: float, dur: float) -> int:
        """Ops at one end: 1 + ceil((rho - sigma) / dur)+ at a slack just below sigma."""
        if dur <= 0:
            return 1
        x = (rho - sigma) / dur
        return 1 if x < -EPS else min(ENDS, 2 + math.floor(x + EPS))

    def ends(self, s: int, count: int, z: float) -> list[tuple[float, float, float]] | None:
        """(release, deadline, amount) of the stage-0 work of the micro-batches at the ends of a
        stage-s worker that runs `count` micro-batches, at a period just below z; None if its
        work alone does not fit."""
        fwd, inp, wgt = self.fwd, self.inp, self.wgt
        close = z - self.tail0
        low, high = self.head[s], close - wgt[0] - self.up[s]
        work = count * (fwd[s] + inp[s]) + max(0, count - self.caps[s]) * wgt[s]
        sigma = high - low - work
        if sigma <= EPS:
            return None
        out = []
        for j in range(self.count(self.rho[s], sigma, inp[s])):
            out.append((low + work - j * inp[s] + self.up[s] - inp[0], close, inp[0] + wgt[0]))
        for j in range(self.count(self.rho[s], sigma, fwd[s])):
            out.append((0.0, high - work + j * fwd[s] - self.head[s] + fwd[0], fwd[0]))
        return out

    def choices(self, s: int) -> Iterator[dict[int, int]]:
        """Micro-batch counts per live stage-s worker: the busiest ones at n_s, the rest M.
        Only which workers do not matter (the test sees a worker through its candidates), so
        choices that swap workers of the same kind (pipelines whose stage-0 worker is dead,
        or not) are tried once."""
        D, M = self.spec.pipelines, self.spec.microbatches
        live = [d for d in range(D) if (d, s) not in self.dead]
        n = self.n[s]
        busiest = D * M - len(live) * (n - 1)
        kinds = [[d for d in live if ((d, 0) in self.dead) == gone] for gone in (False, True)]
        for take in range(max(0, busiest - len(kinds[1])), min(busiest, len(kinds[0])) + 1):
            chosen = set(kinds[0][:take]) | set(kinds[1][:busiest - take])
            yield {d: (n if d in chosen else M) for d in live}

    def refutes(self, z: float, stages: list[int] | None = None) -> int | None:
        """A stage (of `stages`, by default all after stage 0) at which no plan has a period
        just below z, or None."""
        for s in stages if stages is not None else range(1, self.spec.stages):
            if self._refutes_at(s, z):
                return s
        return None

    def _refutes_at(self, s: int, z: float) -> bool:
        shapes = {c: self.ends(s, c, z) for c in {self.n[s], self.spec.microbatches}}
        if self.spread(s, shapes[self.n[s]]):
            return False
        budget = [MAX_NODES]
        any_choice = False
        for counts in self.choices(s):
            any_choice = True
            if any(shapes[c] is None for c in counts.values()):
                continue  # a worker's work alone does not fit
            jobs = {d: [Job(*t, self.candidates(d, s)) for t in shapes[c]]
                    for d, c in counts.items()}
            if self.own_fit(jobs) or assignable([j for js in jobs.values() for j in js],
                                                self.live0, budget):
                return False
        return any_choice

    def own_fit(self, jobs: dict[int, list[Job]]) -> bool:
        """Whether every micro-batch at a worker's ends fits on its own pipeline's stage-0
        worker."""
        if any((d, 0) in self.dead for d in jobs):
            return False
        return all(fits(js) for js in jobs.values())

    def spread(self, s: int, busiest: list[tuple[float, float, float]] | None) -> bool:
        """An assignment that fits whatever the counts, found without a search (the common
        case): every stage-s worker as if it were one of the busiest (fewer micro-batches
        only loosen a worker's ends) on its own pipeline's stage-0 worker; those whose own is
        dead first on the stage-0 workers of pipelines with no stage-s worker, then one on each
        other stage-0 worker."""
        if busiest is None:
            return False
        one = [Job(*t, ()) for t in busiest]
        if not fits(one):
            return False
        D = self.spec.pipelines
        homes = sum((d, 0) not in self.dead and (d, s) not in self.dead for d in range(D))
        homeless = sum((d, 0) in self.dead and (d, s) not in self.dead for d in range(D))
        free = sum((d, 0) not in self.dead and (d, s) in self.dead for d in range(D))
        left = homeless - free
        return left <= 0 or (left <= homes and fits(one + one))


def crowded_ends(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...], above: float
                 ) -> tuple[float, str] | None:
    """The largest period on the cost grid above `above` (the other bounds) below which the
    test refutes every plan, with its reason; None where it refutes nothing above it."""
    if spec.stages < 2:
        return None
    test = CrowdedEnds(spec, policy, failed)
    scale = model_scale(spec, policy)[0]
    first = math.floor(above * scale + 1e-6) + 1  # the first grid point above, in steps

    # A stage that refutes nothing at the first grid point refutes nothing above it.
    stages = [s for s in range(1, spec.stages) if test.refutes(first / scale, [s]) is not None]

    def refuted(i: int) -> int | None:  # i grid steps above the first
        return test.refutes((first + i) / scale, stages)

    if not stages:
        return None
    stage = stages[0]
    good, bad = 0, 1
    while bad <= MAX_STEPS and (found := refuted(bad)) is not None:  # doubling
        good, stage, bad = bad, found, 2 * bad
    while bad - good > 1:  # bisection
        mid = (good + bad) // 2
        found = refuted(mid)
        if found is None:
            bad = mid
        else:
            good, stage = mid, found
    return (first + good) / scale, (f"the busiest stage-{stage} workers' first forwards and "
                                    f"last input backwards cannot all reach stage 0 in time")
