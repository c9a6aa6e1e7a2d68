"""The what-if results as text tables (for people) and JSON (for machines)."""

from __future__ import annotations

from typing import Any

from recycle_planner import __version__
from recycle_planner.whatif.engine import Outcome, Run, Study

WHATIF_FORMAT = "recycle-whatif"
WHATIF_VERSION = 2


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
    lib = ctx.library
    if lib is not None:
        lines.append(f"plan library: {lib.folder} (up to {lib.max_failures} dead workers)")
        if lib.policy != ctx.policy:
            lib_rate = ctx.speed(lib.fault_free_period).rate
            lines[0] += f" (baseline; re-routing runs the library's {lib.policy.label})"
            lines[1] = (f"fault-free baseline ({ctx.policy.label}): period "
                        f"{ctx.fault_free_period:.4g} ms, {_num(ff.rate)} {ctx.unit}/s, the "
                        f"reference of every result; with the library's policy "
                        f"({lib.policy.label}): {lib.fault_free_period:.4g} ms, "
                        f"{_num(lib_rate)} {ctx.unit}/s")
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
    lines = ["assumptions (every strategy is costed on the same per-stage costs through the "
             "planner):"]
    lib = study.ctx.library
    differ = lib is not None and lib.policy != study.ctx.policy
    for strategy in study.strategies:
        lines.append(f"  {strategy.title}:")
        whose = ""
        if differ:
            whose = " (the library's)" if strategy.policy == lib.policy else " (the baseline)"
        lines.append(f"    - schedule: policy {strategy.policy.label}{whose}")
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
    lines += notes(study)
    return "\n".join(lines + [""] + assumptions(study))


def notes(study: Study) -> list[str]:
    """Fallbacks, on-demand plans and what they were charged, smaller global batches."""
    out = []
    full = study.ctx.samples_per_iteration
    for run in study.runs:
        for o in run.outcomes:
            if o.fallbacks:
                out.append(f"note: {o.title} fell back to a checkpoint restart {o.fallbacks} "
                           f"time(s) on {run.label} (no configuration for the dead workers)")
            if o.planned:
                out.append(f"note: {o.title} planned {o.planned} situation(s) on demand on "
                           f"{run.label}, charged {o.planning:.3g} s of planning in all "
                           f"({o.planning / o.planned:.3g} s each on average)")
            if o.batch_min and o.batch_min < full - 1e-9:
                out.append(f"note: {o.title} trained with a smaller global batch on "
                           f"{run.label}: down to {o.batch_min:g} {study.ctx.unit} per "
                           f"iteration (fault-free {full}), {o.batch_mean:.4g} on average "
                           f"while training")
    return [""] + out if out else []


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
        "library_policy": (ctx.library.policy.to_dict() if ctx.library is not None
                           else None),
        "strategies": [{"name": s.name, "title": s.title, "infeasible": s.infeasible(),
                        "assumptions": s.assumptions(), **s.record()}
                       for s in study.strategies],
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
