"""Pictures of a what-if study: throughput over time on one trace, and every strategy across
failure frequencies. The file's extension picks the format (.png, .svg, .pdf)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from recycle_planner.views.figures import picture_format, pyplot, save_figure
from recycle_planner.whatif.durations import format_duration
from recycle_planner.whatif.engine import Run, Study
from recycle_planner.whatif.trace import FAIL

COLOURS = {"reroute": "#C44E52", "reroute-library-only": "#DA8BC3",
           "checkpoint-spares": "#4C72B0", "checkpoint-wait": "#8172B3",
           "drop-pipelines": "#DD8452", "oobleck": "#55A868", "bamboo": "#937860"}


BIN_WIDTHS = (60.0, 300.0, 600.0, 1800.0, 3600.0, 3 * 3600.0, 6 * 3600.0, 86400.0, 7 * 86400.0)


def bin_width(duration: float, most: int = 300) -> float:
    """The shortest round bin width that cuts `duration` into at most `most` bins."""
    return next((w for w in BIN_WIDTHS if duration / w <= most), duration / most)


def plot_over_time(study: Study, run: Run, path: str | Path) -> None:
    """Top: one strip per strategy, its training speed (mean per bin, % of fault-free) filled
    in its colour, with the failures marked above them: strips do not hide each other the
    way overlapping step lines do. Bottom: net samples trained so far (rollbacks subtracted)
    against fault-free, in plain units (no offset exponent)."""
    path = Path(path)
    fmt = picture_format(path)
    plt = pyplot()
    ctx = study.ctx
    ff = ctx.fault_free.rate
    T = run.trace.duration
    scale, unit = (86400.0, "days") if T >= 3 * 86400 else (3600.0, "hours") if T >= 3 * 3600 \
        else (60.0, "minutes")
    width = bin_width(T)
    edges = np.append(np.arange(0.0, T, width), T)
    outcomes = list(run.outcomes)
    n = len(outcomes)
    fig, axes = plt.subplots(n + 2, 1, figsize=(11, 2.6 + 0.75 * n + 2.6), sharex=True,
                             gridspec_kw={"height_ratios": [0.35] + [1.0] * n + [3.2]})
    marks, strips, bottom = axes[0], axes[1:-1], axes[-1]
    fails = np.array([s.time for s in run.trace.steps() if s.kind == FAIL])
    marks.vlines(fails / scale, 0, 1, color="#333333", linewidth=0.8)
    marks.set_yticks([])
    marks.set_ylim(0, 1)
    marks.set_ylabel(f"{fails.size} failures", rotation=0, ha="right", va="center", fontsize=8)
    for spine in ("top", "right", "left"):
        marks.spines[spine].set_visible(False)
    rates = [100 * o.binned_rate(edges) / ff for o in outcomes]
    peak = max([100.0] + [float(r.max()) for r in rates])  # above 100% when re-routing's
    for ax, o, rate in zip(strips, outcomes, rates):      # policy beats the baseline's
        colour = COLOURS.get(o.strategy, "#555555")
        ax.fill_between(edges / scale, np.append(rate, rate[-1]), step="post", color=colour,
                        alpha=0.55, linewidth=0)
        ax.step(edges / scale, np.append(rate, rate[-1]), where="post", color=colour,
                linewidth=0.8)
        ax.set_ylim(0, peak * 1.05)
        ax.set_yticks([0, 50, 100])
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(alpha=0.3)
        ax.text(1.005, 0.5, f"{o.title}\nmean {o.relative:.1%}", transform=ax.transAxes,
                fontsize=8, va="center", ha="left", color=colour)
    strips[n // 2].set_ylabel(f"throughput, % of fault-free (mean per "
                              f"{format_duration(width)})", fontsize=9)
    total = max(ff * T, 1.0)
    power = 3 * int(np.floor(np.log10(total) / 3)) if total >= 1e3 else 0
    factor, word = 10.0 ** power, {0: "", 3: "thousands", 6: "millions", 9: "billions",
                                   12: "trillions"}.get(power, f"x 1e{power}")
    at = np.linspace(0.0, T, 600)
    for o in outcomes:
        bottom.plot(at / scale, o.cumulative(at) / factor, color=COLOURS.get(o.strategy),
                    linewidth=1.4, label=o.title)
    bottom.plot(at / scale, ff * at / factor, "--", color="#555555", linewidth=1,
                label="fault-free")
    bottom.set_ylabel(f"{ctx.unit} trained (net" + (f", {word})" if word else ")"))
    bottom.set_xlabel(unit)
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=7.5, loc="upper left", ncol=2, frameon=False)
    bottom.set_xlim(0, T / scale)
    bottom.set_ylim(0, None)
    spec = ctx.spec
    fig.suptitle(f"{spec.name or 'job'} ({spec.stages}x{spec.pipelines}, {ctx.policy.label}), "
                 f"trace {run.label}: {run.trace.failures} failures", fontsize=10, x=0.01,
                 ha="left")
    fig.tight_layout(rect=(0, 0, 0.84, 1))
    save_figure(fig, path, fmt)


def plot_frequencies(study: Study, path: str | Path) -> None:
    """Grouped bars: mean throughput (% of fault-free) of each strategy on each trace."""
    path = Path(path)
    fmt = picture_format(path)
    plt = pyplot()
    runs = study.runs
    names = [s for s in study.strategies if s.infeasible() is None]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(runs) * max(1, len(names)) / 3), 4.5))
    width = 0.8 / max(1, len(names))
    for i, strategy in enumerate(names):
        xs, ys = [], []
        for j, run in enumerate(runs):
            o = next((o for o in run.outcomes if o.strategy == strategy.name), None)
            if o is not None:
                xs.append(j + (i - (len(names) - 1) / 2) * width)
                ys.append(100 * o.relative)
        bars = ax.bar(xs, ys, width * 0.95, color=COLOURS.get(strategy.name),
                      label=strategy.title)
        ax.bar_label(bars, labels=[f"{y:.0f}" for y in ys], fontsize=6.5, padding=1)
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels([r.label for r in runs])
    ax.set_ylabel("mean throughput, % of fault-free")
    peak = max([100.0] + [100 * o.relative for r in runs for o in r.outcomes])
    ax.set_ylim(0, peak + 12)
    ax.axhline(100, color="#555555", linestyle="--", linewidth=0.8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    spec = study.ctx.spec
    ax.set_title(f"{spec.name or 'job'} ({spec.stages}x{spec.pipelines}, "
                 f"{study.ctx.policy.label}): failures at different frequencies", fontsize=10,
                 loc="left")
    ax.legend(fontsize=7.5, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.1),
              frameon=False)
    fig.tight_layout()
    save_figure(fig, path, fmt)
