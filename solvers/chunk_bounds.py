"""Lower bounds on the period of any plan for a job whose workers hold several chunks.

A stage-s worker runs every chunk it holds (virtual stages `spec.virtual(s, c)`), and a dead
worker's micro-batches of each chunk go to live peers, which hold the same chunks; which peer
runs which (micro-batch, chunk) is free, so every bound here holds for every assignment.

(work) Stage s has D x M micro-batches of each chunk on D - k_s live workers: the busiest runs
at least the average work, D M sum_c c_{s,c} / (D - k_s), and at least
ceil(D M v / (D - k_s)) of the (micro-batch, chunk) units, each costing at least the cheapest
chunk's c_{s,c} (c = F + I + W, or F + B fused). Its all-reduce and optimizer step follow its
last op, so with the staggered optimizer the period is at least that work plus AR_s + OPT_s;
with a barrier add the earliest moment any op of the worker can start: the forward chain to the
first virtual stage it holds.
(drain) A worker's last input backward (or fused backward) runs after every forward and input
backward of the worker (each forward's backward is its own, and precedes it), at a virtual
stage u no lower than the first it holds, u0; its gradient then still travels down to virtual
stage 0, whose weight gradient and worker's all-reduce and step follow. Before it, the worker
waited for the forward chain to u0: from the iteration's start with a barrier, and with the
staggered optimizer from stage 0's step of the iteration before (the next forwards at virtual
stage 0 wait for it), which closes a cycle. Either way the period is at least the forward
chain to u0, the busiest worker's forwards and input backwards, the gradient chain from u0
down to 0, W at virtual stage 0 and stage 0's all-reduce and step.
(round trip) One micro-batch's forward runs through every virtual stage, its gradient comes back
through every one, then the weight gradient of virtual stage 0 and its worker's all-reduce
and step follow; with a barrier that is one iteration, and with the staggered optimizer the
next iteration's first forward on that worker waits for its step, so the chain closes a cycle:
either way the period is at least the chain.
They are sound rather than tight: the gap they leave says how far a plan may be from perfect,
not that it is.
"""

from __future__ import annotations

import math

from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.job.workers import dead_per_stage
from recycle_planner.schedules.ops import Worker


def chunk_bounds(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...]) -> list:
    """Every bound of the module docstring (each sound alone), as solvers.bounds.Bound."""
    from recycle_planner.solvers.bounds import Bound

    S, D, M, v = spec.stages, spec.pipelines, spec.microbatches, spec.chunks
    V = spec.virtual_stages
    fwd, p2p = spec.forward, spec.p2p
    inp = spec.backward_input if policy.decouple else spec.backward
    wgt = spec.backward_weight if policy.decouple else (0.0,) * V
    unit = [fwd[j] + inp[j] + wgt[j] for j in range(V)]
    head = [sum(fwd[j] + p2p[j] for j in range(u)) for u in range(V)]
    tail = [spec.allreduce[s] + spec.optimizer[s] for s in range(S)]
    # From the end of a backward at virtual stage u to the end of virtual stage 0's.
    down = [sum(p2p[j + 1] + inp[j] for j in range(u)) for u in range(V)]
    out = []
    for s, k in enumerate(dead_per_stage(spec, failed)):
        live = D - k
        held = [spec.virtual(s, c) for c in range(v)]
        work = max(D * M * sum(unit[u] for u in held) / live,
                   math.ceil(D * M * v / live) * min(unit[u] for u in held))
        start = 0.0 if policy.stagger else min(head[u] for u in held)
        out.append(Bound(start + work + tail[s],
                         f"work of the busiest stage-{s} worker ({v} chunks on {live} live "
                         f"workers)"))
        first = min(held)
        gradients = D * M * sum(fwd[u] + inp[u] for u in held) / live
        out.append(Bound(head[first] + gradients + down[first] + wgt[0] + tail[spec.holder(0)],
                         f"the busiest stage-{s} worker's forwards and input backwards, then its "
                         f"last gradient travelling down to virtual stage 0"))
    chain = (sum(fwd) + sum(p2p[j] for j in range(V - 1)) + sum(inp)
             + sum(p2p[j] for j in range(1, V)) + wgt[0] + tail[spec.holder(0)])
    out.append(Bound(chain, f"one micro-batch's round trip through all {V} virtual stages, "
                            f"then stage {spec.holder(0)}'s step"))
    return out
