"""The what-if results as text tables (for people) and JSON (for machines)."""

from __future__ import annotations

from typing import Any

from recycle_planner import __version__
from recycle_planner.whatif.engine import Outcome, Run, Study

WHATIF_FORMAT = "recycle-whatif"
WHATIF_VERSION = 1


def header(study: Study) -> list[str]:
    ctx = study.ctx
    spec = ctx.spec
    ff = ctx.fault_free
    lines = [f"{spec.name or 'job'}: {spec.stages} stages x {spec.pipelines} pipelines x "
             f"{spec.microbatches} micro-batches ({spec.workers} workers), policy "
             f"{ctx.policy.label}",
             f"fault-free: period {ctx.fault_free_period:.4g} ms, {_num(ff.rate)} {ctx.unit}/s"
             + ("" if spec.microbatch_size else " (no microbatch_size in the spec: counting "
                                                "micro-batches)")]
    if ctx.library is not None:
        lines.append(f"plan library: {ctx.library.folder} (up to {ctx.library.max_failures} "
                     f"dead workers)")
    lines.append(f"costs: {ctx.costs.describe()}")
    return lines


def _num(x: float) -> str:
    """Whole numbers with thousands separators from 1,000 up, one decimal from 10 up."""
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"


def _duration(seconds: float) -> str:
    """Time paused or waiting, to one decimal in the largest unit that fits."""
    for size, unit in ((86400.0, "d"), (3600.0, "h"), (60.0, "min")):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def run_table(run: Run, unit: str) -> list[str]:
    """One trace: every strategy with its mean throughput and where the rest went."""
    lines = [f"{'strategy':<30} {unit + '/s':>15} {'vs fault-free':>13} {'restarts':>8} "
             f"{'reconfig.':>9} {'lost (rollback)':>16} {'paused':>8} {'waiting':>8}"]
    for o in run.outcomes:
        lines.append(f"{o.title:<30} {_num(o.mean_rate):>15} {o.relative:>13.1%} {o.restarts:>8} "
                     f"{o.reconfigurations:>9} {_num(o.lost_rollback):>16} "
                     f"{_duration(o.paused):>8} {_duration(o.waiting):>8}")
    for name, why in run.infeasible.items():
        lines.append(f"{name:<30} {'infeasible':>15}   {why}")
    return lines


def frequency_table(study: Study) -> list[str]:
    """Mean throughput of every strategy (rows) on every trace (columns)."""
    unit = study.ctx.unit
    width = max(20, *(len(r.label) + 2 for r in study.runs))
    lines = [f"mean throughput, {unit}/s (vs fault-free)",
             f"{'strategy':<30}" + "".join(f"{r.label:>{width}}" for r in study.runs)]
    for strategy in study.strategies:
        row = f"{strategy.title:<30}"
        for run in study.runs:
            o = _outcome(run, strategy.name)
            cell = f"{_num(o.mean_rate)} ({o.relative:.1%})" if o else "infeasible"
            row += f"{cell:>{width}}"
        lines.append(row)
    return lines


def _outcome(run: Run, name: str) -> Outcome | None:
    return next((o for o in run.outcomes if o.strategy == name), None)


def assumptions(study: Study) -> list[str]:
    lines = ["assumptions (every strategy runs the library's policy on the same per-stage "
             "costs):"]
    for strategy in study.strategies:
        lines.append(f"  {strategy.title}:")
        why = strategy.infeasible()
        if why is not None:
            lines.append(f"    - cannot run this job: {why}")
        lines += [f"    - {a}" for a in strategy.assumptions()]
    return lines


def study_text(study: Study) -> str:
    lines = header(study)
    if len(study.runs) == 1:
        run = study.runs[0]
        lines += [f"trace: {run.trace.describe()}", ""] + run_table(run, study.ctx.unit)
    else:
        lines += [f"trace {r.label}: {r.trace.describe()}" for r in study.runs]
        lines += [""] + frequency_table(study)
    fallbacks = [(r.label, o) for r in study.runs for o in r.outcomes if o.fallbacks]
    if fallbacks:
        lines.append("")
        for label, o in fallbacks:
            lines.append(f"note: {o.title} fell back to a checkpoint restart {o.fallbacks} "
                         f"time(s) on {label} (no configuration for the dead workers)")
    return "\n".join(lines + [""] + assumptions(study))


def study_dict(study: Study) -> dict[str, Any]:
    ctx = study.ctx
    out: dict[str, Any] = {
        "format": WHATIF_FORMAT, "version": WHATIF_VERSION,
        "generator": f"recycle-planner {__version__}",
        "spec": ctx.spec.to_dict(), "policy": ctx.policy.to_dict(),
        "library": ({"folder": str(ctx.library.folder),
                     "max_failures": ctx.library.max_failures}
                    if ctx.library is not None else None),
        "unit": ctx.unit, "samples_per_iteration": ctx.samples_per_iteration,
        "fault_free": {"period_ms": ctx.fault_free_period, "throughput": ctx.fault_free.rate},
        "costs_s": ctx.costs.to_dict(),
        "strategies": [{"name": s.name, "title": s.title, "infeasible": s.infeasible(),
                        "assumptions": s.assumptions()} for s in study.strategies],
        "runs": [],
        "timing_s": dict(study.seconds),
    }
    for run in study.runs:
        results = [o.to_dict() for o in run.outcomes]
        results += [{"strategy": name, "feasible": False, "reason": why}
                    for name, why in run.infeasible.items()]
        out["runs"].append({"label": run.label, "trace": run.trace.to_dict(),
                            "results": results})
    return out
