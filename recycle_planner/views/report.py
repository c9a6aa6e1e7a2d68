"""Summaries of a plan library: how bad it gets with 1, 2, ... failures, and how sure we are."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from recycle_planner.library import PlanLibrary
from recycle_planner.views.figures import picture_format, pyplot, save_figure
from recycle_planner.words import grid, number, plural


def library_rows(lib: PlanLibrary) -> list[dict]:
    """One row per number of failures: situations, raw failure sets, degradation, gap, and the
    lower bound's degradation (how much any plan must lose)."""
    ref = lib.fault_free_period
    groups: dict[int, list[dict]] = defaultdict(list)
    for entry in lib.entries():
        groups[sum(entry.failed_per_stage)].append(entry)
    rows = []
    for n in sorted(groups):
        es = groups[n]
        deg = [e.metrics.degradation for e in es]
        gap = [e.metrics.gap or 0.0 for e in es]
        bound = [e.metrics.lower_bound / ref - 1 for e in es]
        rows.append({"failures": n, "situations": len(es),
                     "failure_sets": sum(e.failure_sets or 0 for e in es),
                     "mean_degradation": sum(deg) / len(deg), "worst_degradation": max(deg),
                     "mean_gap": sum(gap) / len(gap), "worst_gap": max(gap),
                     "optimal": sum(bool(e.metrics.optimal) for e in es),
                     "mean_lower_bound_degradation": sum(bound) / len(bound)})
    return rows


def library_dict(lib: PlanLibrary) -> dict:
    """`report --json`: the library's job, threshold, whether it is complete (and if not, why:
    `problems`), rows per failure count and entries."""
    problems = lib.problems()
    return {"format": "recycle-library-report", "version": 1, "library": str(lib.folder),
            "spec": lib.spec.to_dict(), "policy": lib.policy.to_dict(),
            "max_failures": lib.max_failures, "complete": not problems, "problems": problems,
            "fault_free_period": lib.fault_free_period, "rows": library_rows(lib),
            "situations": [{k: v for k, v in e.to_dict().items()
                            if k in ("failed_per_stage", "file", "metrics", "solver", "made")}
                           for e in lib.entries()]}


def library_text(lib: PlanLibrary) -> str:
    """The report: the library, its rows per failure count, its worst situations; an
    incomplete library (a situation without a plan, a plan file missing or changed) says so
    first."""
    spec = lib.spec
    problems = lib.problems()
    entries = lib.entries()
    gaps = [e.metrics.gap or 0.0 for e in entries]
    lines = [f"library {lib.folder}: {spec.name or 'job'}, {grid(spec)}, "
             f"policy {lib.policy.label}, up to {plural(lib.max_failures, 'failure')}",
             f"fault-free period {number(lib.fault_free_period)} ms; "
             f"{plural(len(entries), 'situation')}; "
             f"mean gap to lower bound {sum(gaps) / max(1, len(gaps)):.2%}"]
    if problems:
        lines.append(f"INCOMPLETE: {plural(len(problems), 'problem')}, first "
                     f"{problems[0]}: run plan-all again to plan what is missing")
    lines += ["", f"{'failures':>8} {'situations':>10} {'failure sets':>12} {'mean degr.':>10} "
                  f"{'worst degr.':>11} {'mean gap':>9} {'worst gap':>9} {'optimal':>8}"]
    for r in library_rows(lib):
        lines.append(f"{r['failures']:>8} {r['situations']:>10} {r['failure_sets']:>12} "
                     f"{r['mean_degradation']:>10.1%} {r['worst_degradation']:>11.1%} "
                     f"{r['mean_gap']:>9.2%} {r['worst_gap']:>9.2%} "
                     f"{r['optimal']:>4}/{r['situations']:<3}")
    worst = sorted(entries, key=lambda e: -e.metrics.degradation)[:5]
    if worst and worst[0].metrics.degradation > 0:
        lines += ["", "worst situations (dead workers per stage):"]
        for e in worst:
            m = e.metrics
            lines.append(f"  {e.failed_per_stage}  period {number(m.period)} ms, "
                         f"degradation {m.degradation:+.1%}, gap {m.gap or 0:.1%}, "
                         f"solver {(e.solver or {}).get('name', '?')}  ({e.file})")
    return "\n".join(lines)


def plot_library(lib: PlanLibrary, path: str | Path) -> None:
    """Degradation against the number of failures: every situation as a dot, the mean as a
    line, the lower bound's degradation as a dashed line."""
    path = Path(path)
    fmt = picture_format(path)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = [sum(e.failed_per_stage) for e in lib.entries()]
    ys = [100 * e.metrics.degradation for e in lib.entries()]
    # Spread the dots of one failure count sideways so that equal values stay visible.
    jitter = list(map(float, xs))
    for n in set(xs):
        idx = [i for i, x in enumerate(xs) if x == n]
        for j, i in enumerate(sorted(idx, key=lambda i: ys[i])):
            jitter[i] += 0.0 if len(idx) == 1 else 0.3 * (j / (len(idx) - 1) - 0.5)
    ax.scatter(jitter, ys, s=12, alpha=0.6, label="each situation (plan)")
    rows = library_rows(lib)
    counts = [r["failures"] for r in rows]
    ax.plot(counts, [100 * r["mean_degradation"] for r in rows], "-o", color="#C44E52",
            label="mean")
    ax.plot(counts, [100 * r["mean_lower_bound_degradation"] for r in rows], "--",
            color="#555555", label="mean lower bound")
    ax.set_xlabel("dead workers")
    ax.set_ylabel("period degradation vs fault-free (%)")
    ax.set_xticks(counts)
    spec = lib.spec
    ax.set_title(f"{spec.name or 'job'}: {spec.stages}x{spec.pipelines}x{spec.microbatches}, "
                 f"{lib.policy.label}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, fmt)
