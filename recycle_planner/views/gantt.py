"""Gantt charts of plans (matplotlib): one row per worker, grouped by pipeline.

Colours by op kind, one shade per model chunk where workers hold several (the first chunk
darkest); re-routed ops are hatched and labelled with the pipeline they belong to;
dead workers are drawn as dead; the all-reduce and the optimizer step are blocks of their own.
Several plans are stacked on one time scale, for example a fault-free plan above a failure
plan. The file's extension picks the format: .png, .svg or .pdf.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from recycle_planner.job.workers import format_workers
from recycle_planner.schedules.ops import (KIND_NAMES, KIND_TITLES, is_collective, worker_at,
                                          worker_index)
from recycle_planner.schedules.schedule import rerouted
from recycle_planner.timing.plan import Plan
from recycle_planner.views.figures import picture_format, pyplot, save_figure
from recycle_planner.views.timeline import shown_pipelines

COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#3A3A3A")
LABEL_LIMIT = 700  # above this many ops in a panel, only re-routed bars are labelled
FONT = 6  # points, of the labels in the bars
CHAR = 0.62 * FONT  # points per character of those labels, with room to spare


def plan_title(plan: Plan) -> str:
    m = plan.metrics
    name = plan.spec.name or "job"
    return (f"{name} | failed: {format_workers(plan.failed)} | {plan.policy.label} | "
            f"period {m.period:.4g} ms ({m.degradation:+.1%} vs fault-free), "
            f"lower bound {m.lower_bound:.4g} ms")


def draw_gantt(plans: Sequence[Plan], path: str | Path, titles: Sequence[str] | None = None,
               max_workers: int = 48) -> None:
    """Draw `plans` one above the other on one time axis and write the figure to `path`."""
    path = Path(path)
    fmt = picture_format(path)
    plt = pyplot()
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    panels = []
    for plan in plans:
        panels.append((plan, shown_pipelines(plan, max_workers)))
    rows = [len(p) * plan.spec.stages + len(p) - 1 for plan, p in panels]
    height = sum(0.24 * r + 1.1 for r in rows) + 0.9
    fig, axes = plt.subplots(len(plans), 1, figsize=(14, height), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [r + 3 for r in rows]})
    t_max = max(float(np.nanmax(plan.timing.end[plan.schedule.flat[0]])) for plan in plans)
    for i, (plan, pipelines) in enumerate(panels):
        ax = axes[i][0]
        ax.set_xlim(0, t_max * 1.01)
        width_pt = ax.get_position().width * fig.get_figwidth() * 72
        _draw_panel(ax, plan, pipelines, PolyCollection, ms_per_pt=t_max * 1.01 / width_pt)
        title = titles[i] if titles else plan_title(plan)
        if len(pipelines) < plan.spec.pipelines:
            title += f"  (showing {len(pipelines)} of {plan.spec.pipelines} pipelines)"
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1][0].set_xlabel("time (ms)")
    # The legend names what the picture shows.
    kinds = set()
    for plan, _ in panels:
        kinds |= set(plan.schedule.space.decode(plan.schedule.flat[0])[0].tolist())
    handles = [Patch(facecolor=COLOURS[k], label=f"{KIND_NAMES[k]}: {KIND_TITLES[k]}"
                     if not is_collective(k) else KIND_TITLES[k])
               for k in range(len(KIND_NAMES)) if k in kinds]
    chunks = max(plan.spec.chunks for plan, _ in panels)
    if chunks > 1:
        handles += [Patch(facecolor=shade("#7f7f7f", c, chunks), label=f"chunk {c}")
                    for c in range(chunks)]
    if any(plan.schedule.rerouted_count() for plan, _ in panels):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///",
                             label="re-routed (label: pPIPELINE:MICRO-BATCH, or pPIPELINE)"))
    if any(plan.failed for plan, _ in panels):
        handles.append(Patch(facecolor="#d9d9d9", edgecolor="#7f7f7f", hatch="xx",
                             label="dead worker"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.6 / height, 1, 1))
    save_figure(fig, path, fmt)


def _draw_panel(ax, plan: Plan, pipelines: list[int], PolyCollection, ms_per_pt: float) -> None:
    """One plan's rows. A bar is labelled only where its label fits inside it (`ms_per_pt`:
    milliseconds per point of the axis): micro-batch numbers on up to LABEL_LIMIT ops, and
    every re-routed op with its own pipeline (and micro-batch where there is room)."""
    sched, timing = plan.schedule, plan.timing
    S = sched.spec.stages
    dead = set(plan.failed)
    ids, workers = sched.flat
    t_end = float(np.nanmax(timing.end[ids]))
    y_of: dict[int, float] = {}
    labels, ticks = [], []
    y = 0.0
    for d in pipelines:
        for s in range(S):
            y_of[worker_index(S, d, s)] = y
            labels.append(f"p{d} s{s}")
            ticks.append(y)
            y += 1.0
        y += 0.6
    keep = np.array([int(w) in y_of for w in workers], dtype=bool)
    ids_k, workers_k = ids[keep], workers[keep]
    kind, pipe, vstage, mb = sched.space.decode(ids_k)
    coll = is_collective(kind)
    chunk = np.where(coll, 0, sched.space.chunk_of[np.where(coll, 0, vstage)])
    start, end = timing.start[ids_k], timing.end[ids_k]
    ys = np.array([y_of[int(w)] for w in workers_k])
    moved = rerouted(sched.space, ids_k, workers_k)
    h = 0.8
    for k, c, rr in np.unique(np.stack([kind, chunk, moved]), axis=1).T.tolist():
        sel = (kind == k) & (chunk == c) & (moved == rr)
        x0, x1, yy = start[sel], end[sel], ys[sel] - h / 2
        verts = np.stack([np.stack([x0, yy], 1), np.stack([x1, yy], 1),
                          np.stack([x1, yy + h], 1), np.stack([x0, yy + h], 1)], 1)
        ax.add_collection(PolyCollection(verts, facecolors=shade(COLOURS[k], c, sched.space.C),
                                         edgecolors="white", linewidths=0.4,
                                         hatch="///" if rr else None))
    for w, yy in y_of.items():
        if worker_at(S, w) in dead:
            ax.add_patch(_dead_patch(t_end, yy, h))
            ax.text(t_end / 2, yy, "dead", ha="center", va="center", fontsize=8, color="#404040")
    fits = lambda text, x0, x1: (x1 - x0) / ms_per_pt >= CHAR * len(text) + 2  # noqa: E731
    plain = len(ids_k) <= LABEL_LIMIT
    for x0, x1, yy, p, m, rr in zip(start, end, ys, pipe, mb, moved):
        if m < 0 or not (rr or plain):
            continue
        text = next((t for t in ((f"p{p}:{m}", f"p{p}") if rr else (str(m),))
                     if fits(t, x0, x1)), None)
        if text is not None:
            ax.text((x0 + x1) / 2, yy, text, ha="center", va="center", fontsize=FONT,
                    color="black" if rr else "white",
                    bbox=dict(boxstyle="square,pad=0.05", facecolor="white", edgecolor="none")
                    if rr else None)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_ylim(y - 0.6 + 0.5, -0.7)
    ax.grid(axis="x", color="#e0e0e0", linewidth=0.5)
    ax.set_axisbelow(True)


def shade(colour: str, chunk: int, chunks: int) -> str:
    """`colour` for chunk `chunk` of `chunks`: the first as it is, each later one mixed with
    more white (up to 55%), so that a worker's chunks tell apart at a glance."""
    mix = 0.55 * chunk / max(1, chunks - 1)
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(v + (255 - v) * mix):02x}" for v in rgb)


def _dead_patch(t_end: float, y: float, h: float):
    from matplotlib.patches import Rectangle

    return Rectangle((0, y - h / 2), t_end, h, facecolor="#d9d9d9", edgecolor="#7f7f7f",
                     hatch="xx", linewidth=0.5)
