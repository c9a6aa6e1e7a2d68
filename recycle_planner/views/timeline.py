"""A compact text timeline of a plan for the terminal: one row per worker, one character per
slice of time. Upper case: the worker's own pipeline; lower case: re-routed work; A and O: the
all-reduce and the optimizer step; '.': idle; 'x': a dead worker."""

from __future__ import annotations

import numpy as np

from recycle_planner.schedules.ops import KIND_TITLES, is_collective, worker_at, worker_index
from recycle_planner.schedules.schedule import rerouted
from recycle_planner.timing.plan import Plan

LETTERS = ("F", "I", "W", "B", "A", "O")
ABSURD_SPAN = 100
"""A plan whose ops span this many times its iteration time has been edited or damaged: its
timeline would be one character per many iterations, so it is not drawn."""


def shown_pipelines(plan: Plan, max_workers: int) -> list[int]:
    """Pipelines to draw when not all fit: those with dead workers first, then those that run
    re-routed work, then the rest."""
    spec = plan.spec
    dead = sorted({d for d, _ in plan.failed})
    hosts = sorted(_hosting_pipelines(plan) - set(dead))
    rest = [d for d in range(spec.pipelines) if d not in dead and d not in hosts]
    return sorted((dead + hosts + rest)[: max(1, max_workers // spec.stages)])


def _hosting_pipelines(plan: Plan) -> set[int]:
    sched = plan.schedule
    ids, workers = sched.flat
    hosts, _ = worker_at(sched.spec.stages, workers[rerouted(sched.space, ids, workers)])
    return set(hosts.tolist())


def text_timeline(plan: Plan, width: int = 96, max_workers: int = 32) -> str:
    """The timeline of the plan's first iteration from an idle start, or one line saying why
    there is none (times far beyond the plan's own iteration time)."""
    sched, timing = plan.schedule, plan.timing
    spec = sched.spec
    S = spec.stages
    ids, _ = sched.flat
    t0 = float(np.nanmin(timing.start[ids]))
    t1 = float(np.nanmax(timing.end[ids]))
    span = max(t1 - t0, 1e-12)
    if not span <= ABSURD_SPAN * max(plan.metrics.iteration_time, 1e-12):
        return (f"(no timeline: the ops span {span:.6g} ms, more than {ABSURD_SPAN} times the "
                f"plan's iteration time of {plan.metrics.iteration_time:.6g} ms)")
    step = span / width
    centres = t0 + (np.arange(width) + 0.5) * step
    pipelines = shown_pipelines(plan, max_workers)
    dead = set(plan.failed)
    lines = [f"time 0 .. {span:.6g} ms, one character = {step:.4g} ms"]
    for d in pipelines:
        for s in range(S):
            label = f"p{d} s{s} |"
            if (d, s) in dead:
                lines.append(label + "x" * width + "| dead")
                continue
            order = sched.orders[worker_index(S, d, s)]
            row = np.full(width, ".", dtype="<U1")
            starts, ends = timing.start[order], timing.end[order]
            kind, pipe, _, _ = sched.space.decode(order)
            for k, p, a, b in zip(kind.tolist(), pipe.tolist(), starts.tolist(), ends.tolist()):
                lo = int(np.searchsorted(centres, a, side="left"))
                hi = int(np.searchsorted(centres, b, side="left"))
                if hi <= lo and lo < width and b > a:
                    hi = lo + 1  # never hide an op, however short
                letter = LETTERS[k]
                row[lo:hi] = letter if (p == d or is_collective(k)) else letter.lower()
            lines.append(label + "".join(row.tolist()) + "|")
    if len(pipelines) < spec.pipelines:
        lines.append(f"(showing {len(pipelines)} of {spec.pipelines} pipelines: those with dead "
                     f"workers or re-routed work first)")
    lines.append("legend: " + ", ".join(f"{LETTERS[i]}={KIND_TITLES[i]}" for i in range(6))
                 + "; lower case = re-routed from another pipeline; . = idle; x = dead")
    return "\n".join(lines)
