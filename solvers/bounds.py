"""Lower bounds on the period of any plan for a failure situation.

Every bound holds for every peer assignment, and each counts memory only where it says so (the
terms with cap_s below; otherwise it is a relaxation without the cap): the busiest live
worker of stage s must run at least n_s = ceil(D*M / (D - k_s)) micro-batches, where k_s
workers of stage s are dead. Costs: c_s = F_s + I_s + W_s per micro-batch; with the fused
backward the input gradient of a micro-batch is ready only after the whole B.

With a global barrier the period is the iteration time, which is at least, for every stage s:
  (work)       head_s + n_s c_s + AR_s + OPT_s, where head_s is when stage s can first start;
  (last input) head_s + n_s (F_s + I_s) + the input-gradient chain from s up to stage 0
               + W_0 + AR_0 + OPT_0 (the last backward of stage s still has to reach stage 0);
  (first input) the earliest time stage s can get its first gradient + n_s (I_s + W_s)
               + AR_s + OPT_s.
With the staggered optimizer a worker's iterations still run one after the other, so the period
is at least the shortest span of one worker's iteration, for every stage s:
  (work)       n_s c_s + AR_s + OPT_s;
  (round trip) forward chain from s to the last stage and gradient chain back to s
               + n_s (I_s + W_s) + AR_s + OPT_s;
and (last input) becomes a cycle that closes at any stage j <= s: every stage-j worker steps
its optimizer when stage j's all-reduce (which waits for all of them) is done, and its next
forwards wait for that step; so from stage j's step, the forward chain from j to s, the busiest
stage-s worker's forwards and input backwards, the chain of gradients from s up to j, one W_j
and stage j's all-reduce and step fit in one period.
Memory sharpens them. A worker holds at most cap_s in-flight micro-batches (forward started,
weight gradient not done), so after its last input backward at most cap_s weight gradients
remain: (last input) counts (n_s - cap_s)+ W_s more; and before its first input backward it
can have started at most cap_s forwards: (first input) and (round trip) count
(n_s - cap_s)+ F_s more. Both at once give (first and last input), for every j <= s (with a
barrier j counts from time 0 through stage 0's forwards): the forward chain from j to s, the
round trip to stage s's first gradient, then n_s I_s and both memory terms before its last
input backward, whose gradient travels up to stage j, then W_j and stage j's all-reduce and
step.
(last forward) The memory cap also holds back a worker's last forward: of its n_s micro-batches
at most cap_s are in flight, so its last forward starts only after n_s - cap_s weight gradients
(and their input backwards) are done, which wait for the round trip, as do the
n_s - cap_s - 1 forwards before it that also wait for a freed slot; that micro-batch then makes
its own round trip, and its input gradient travels up to stage j, for every j <= s. (The
8x8x16 job without failures: 16.4 + 8 x 2 + 7 = 39.4, then 16.4 + 2 + 4.6: 62.4, the plan.)
(late pipeline) When stage s has k_s > 0 dead workers, the first forwards of the D pipelines at
stage s run on D - k_s workers, so one pipeline's starts at least (ceil(D / (D - k_s)) - 1) F_s
after the others could; every live worker of that pipeline at a stage t >= s then runs its own
M micro-batches in one of the cycles above that much late. Which pipeline is late is not known,
so the least of the pipelines counts. (GPT example, one dead stage-3 worker: 501.4 + 12.)
(drain) The same at the other end: where stage t has k_t > 0 dead workers, take r > D - k_t
pipelines, each with a live worker above t that runs its own M micro-batches: each one's last
gradient reaches stage t no earlier than in that worker's cycle (closing at any j <= t), so
all r arrive after the r-th latest such cycle's arrival, and one of the D - k_t live workers runs
ceil(r / (D - k_t)) of them: (ceil(r / (D - k_t)) - 1) more I_t before the last one travels on,
or, when t = j, (ceil(r / (D - k_t)) - 1) more I_j + W_j before stage j's all-reduce. (GPT
example, one dead stage-0 worker: 501.4 + 24 = 525.4, the CP engine's plan; stage 3: 513.9.)
(crowded ends) Several workers of one stage that are nearly full at once crowd stage 0's first
and last moments with the micro-batches at their ends: crowded_ends.py, counted above the others.
These bounds are tight for 1F1B and ZB-H1 without failures (33 and 27 with unit costs, p = 4,
m = 8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.job.workers import dead_per_stage
from recycle_planner.schedules.ops import Worker
from recycle_planner.solvers.chains import busiest_load, chains
from recycle_planner.solvers.chunk_bounds import chunk_bounds
from recycle_planner.solvers.crowded_ends import crowded_ends


@dataclass(frozen=True)
class Bound:
    value: float
    reason: str


def lower_bound(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...]) -> Bound:
    """The largest of the bounds in the module docstring, with the one that decided it."""
    return max(all_bounds(spec, policy, failed), key=lambda b: b.value)


def all_bounds(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...]) -> list[Bound]:
    """Every bound of the module docstring for this situation (each one is sound alone); a
    job with several chunks per worker has its own (chunk_bounds.py)."""
    if spec.chunks > 1:
        return chunk_bounds(spec, policy, failed)
    S, D, M = spec.stages, spec.pipelines, spec.microbatches
    n = busiest_load(spec, failed)
    k = dead_per_stage(spec, failed)
    c = chains(spec, policy)
    fwd, inp, wgt, tail, caps = c.fwd, c.inp, c.wgt, c.tail, c.caps
    head, up, round_trip = c.head, c.up, c.round_trip
    # Forwards that memory forces after a worker's first input backward (`cycles` counts the
    # weight gradients it forces after the last one).
    late_f = [max(0, n[s] - caps[s]) * fwd[s] for s in range(S)]
    work = [n[s] * (fwd[s] + inp[s] + wgt[s]) for s in range(S)]

    def last_forward(s: int, count: int) -> float:
        """(last forward) The earliest start of a stage-s worker's last forward after its
        first, when it runs `count` micro-batches: the other forwards run before it, and with
        more than cap_s micro-batches it waits for count - cap_s weight gradients (and their
        input backwards), which wait for the round trip, as do count - cap_s - 1 forwards."""
        over = max(0, count - caps[s])
        done = (count - 1) * fwd[s] + over * (inp[s] + wgt[s])
        if over == 0:
            return done
        return max(done, round_trip[s] + over * (inp[s] + wgt[s]) + (over - 1) * fwd[s])

    def closing(s: int, j: int) -> float:
        """Forwards from stage j to s before, and the gradient from s up to j's step after."""
        before = head[s] - (0.0 if not policy.stagger else head[j])
        return before + up[s] - up[j] + wgt[j] + tail[j]

    def cycles(s: int, j: int, count: int) -> tuple[float, float, float]:
        """(last input), (first and last input) and (last forward) through a stage-s worker
        that runs `count` micro-batches, closing at stage j."""
        late = max(0, count - caps[s])
        return (closing(s, j) + count * (fwd[s] + inp[s]) + late * wgt[s],
                closing(s, j) + round_trip[s] + count * inp[s] + late * (fwd[s] + wgt[s]),
                closing(s, j) + last_forward(s, count) + round_trip[s] + inp[s])

    bounds: list[Bound] = []
    dead = set(failed)
    # own[u][j]: the longest cycle through a stage-u worker that runs its own M micro-batches,
    # closing at stage j (the late-pipeline and drain bounds take it per pipeline).
    own = [[max(cycles(u, j, M)) for j in range(u + 1)] for u in range(S)]

    def drain(j: int, t: int) -> list[Bound]:
        """(drain) The cycles closing at stage j in which the last gradients of r pipelines
        all reach stage t (j <= t, k_t > 0) on D - k_t live workers, one of which runs
        ceil(r / (D - k_t)) of them."""
        live = D - k[t]
        if k[t] == 0:
            return []
        # Pipeline d's last gradient, from its live worker at a stage above t that runs its
        # own M micro-batches, reaches stage t no earlier than in that worker's cycle (the
        # worker at stage t itself would count its own work twice).
        per_pipeline = sorted((max((own[u][j] for u in range(t + 1, S) if (d, u) not in dead),
                                   default=-math.inf) for d in range(D)), reverse=True)
        # Each extra one costs an input backward at stage t (the last of them then travels
        # on); at the closing stage also its weight gradient, before the all-reduce.
        extra = inp[t] + (wgt[t] if t == j else 0.0)
        return [Bound(per_pipeline[r - 1] + (math.ceil(r / live) - 1) * extra,
                      f"the last gradients of {r} pipelines reach stage {t} on {live} live "
                      f"workers, then travel up to stage {j}")
                for r in range(live + 1, D + 1) if per_pipeline[r - 1] > -math.inf]
    for s in range(S):
        for j in range(s + 1):
            last, both, gated = cycles(s, j, n[s])
            bounds.append(Bound(last, f"stage {s}'s last gradient travelling up to stage {j}"))
            bounds.append(Bound(both, f"stage {s}'s first gradient, its input backwards and its "
                                      f"last gradient travelling up to stage {j}"))
            bounds.append(Bound(gated, f"stage {s}'s last forward, after the weight gradients "
                                       f"that free its memory, travelling up to stage {j}"))
            live = D - k[s]
            if k[s] == 0:
                continue
            # (late pipeline) The first forwards of the D pipelines at stage s run on `live`
            # workers, so one of them starts at least (ceil(D / live) - 1) F_s after the
            # others could; every op of that pipeline from stage s on is that much late, and
            # each of its live workers at a stage t >= s runs its M micro-batches in a cycle.
            # Which pipeline is late is not known: the least of them.
            late = (math.ceil(D / live) - 1) * fwd[s]
            least = min(max((own[t][j] for t in range(s, S) if (d, t) not in dead),
                            default=-math.inf) for d in range(D))
            if least > -math.inf:  # else some pipeline has no live worker from stage s on
                bounds.append(Bound(late + least,
                                    f"{live} live stage-{s} workers start {D} pipelines: one "
                                    f"starts {late:g} late, its gradients travel up to stage {j}"))
        for t in range(s + 1):
            bounds.extend(drain(t, s))
        if policy.stagger:
            bounds.append(Bound(work[s] + tail[s], f"work of the busiest stage-{s} worker"))
            bounds.append(Bound(round_trip[s] + n[s] * (inp[s] + wgt[s]) + late_f[s] + tail[s],
                                f"round trip to stage {s}'s first gradient plus its backwards"))
        else:
            bounds.append(Bound(head[s] + work[s] + tail[s],
                                f"start of stage {s} plus the work of its busiest worker"))
            bounds.append(Bound(head[s] + round_trip[s] + n[s] * (inp[s] + wgt[s]) + late_f[s]
                                + tail[s],
                                f"stage {s}'s first gradient plus its backwards"))
    crowded = crowded_ends(spec, policy, failed, max(b.value for b in bounds))
    if crowded is not None:
        bounds.append(Bound(*crowded))
    return bounds
