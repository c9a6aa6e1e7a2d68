"""The short human-readable summary of a plan that the CLI prints."""

from __future__ import annotations

from typing import Any

from recycle_planner.job.workers import format_workers
from recycle_planner.timing.plan import Plan
from recycle_planner.words import grid, number, plural

SUMMARY_FORMAT = "recycle-plan-summary"
SUMMARY_VERSION = 1
ENGINE_NAMES = {"milp": "the MILP", "cp": "the CP engine"}


def summary_dict(plan: Plan) -> dict[str, Any]:
    """What `plan --json` and `show --json` print: the job, dead workers, policy, solver and
    metrics of a plan, without its ops (the plan file has those)."""
    return {"format": SUMMARY_FORMAT, "version": SUMMARY_VERSION,
            "name": plan.spec.name, "stages": plan.spec.stages,
            "pipelines": plan.spec.pipelines, "microbatches": plan.spec.microbatches,
            "failed": [list(w) for w in plan.failed], "policy": plan.policy.to_dict(),
            "solver": dict(plan.solver), "metrics": plan.metrics.to_dict()}


def plan_summary(plan: Plan) -> str:
    m = plan.metrics
    spec = plan.spec
    name = spec.name or "job"
    solver = plan.solver.get("name", "?")
    detail = plan.solver.get("detail")
    milp = plan.solver.get("milp")
    engines = [name for name in ("milp", "cp") if plan.solver.get(name)]
    if engines and detail and not any(plan.solver[n].get("improved") for n in engines):
        # the plan is the warm start's, not the exact engines'
        made = (f"solver {solver}: {detail}, "
                + " and ".join(ENGINE_NAMES[n] for n in engines) + " found nothing shorter")
    else:
        made = f"solver {solver}" + (f" ({detail})" if detail else "")
    lines = [
        f"{name}: {grid(spec)}, failed: {format_workers(plan.failed)}",
        f"  policy          {plan.policy.label}   {made}",
        f"  period          {number(m.period)} ms   "
        f"(fault-free {number(m.fault_free_period)} ms with this policy, degradation "
        f"{m.degradation:+.1%})",
        f"  iteration time  {number(m.iteration_time)} ms"
        + ("   (first op to last step; the next iteration starts before it ends)"
           if m.period < m.iteration_time - 1e-9 else ""),
        f"  lower bound     {number(m.lower_bound)} ms   (gap {m.gap or 0.0:.1%}"
        + (f": {m.lower_bound_reason}" if m.lower_bound_reason else "") + ")",
    ]
    if milp:
        size = milp.get("model", {})
        lines.append(_engine_line("milp", milp, m.period,
                                  f"{size.get('binaries', '?')} binaries, "
                                  f"{size.get('constraints', '?')} constraints, "
                                  f"{milp.get('seconds', 0):.1f} s ({milp.get('backend')}, "
                                  f"warm start {milp.get('warm_start')})"))
    for name in ("cp", "prove"):  # the CP engine, and plan-all --prove's run of it
        cp = plan.solver.get(name)
        if cp:
            probes = len(cp.get("probes", ()))
            lines.append(_engine_line(name, cp, m.period,
                                      f"{cp.get('seconds', 0):.1f} s (work limit "
                                      f"{cp.get('work_limit')}, warm start {cp.get('warm_start')}"
                                      + (f", {probes} probes" if probes else "") + ")"))
    budget = plan.solver.get("budget")
    if budget:
        lines.append(f"  auto budget     {budget['time_limit']:g} s MILP, {budget['work_limit']:g} "
                     f"CP work; spent {budget['seconds']:.1f} s")
    if m.bubble_rate is not None:
        worst = m.bubble_rate if m.max_bubble_rate is None else m.max_bubble_rate
        lines.append(f"  bubble rate     {m.bubble_rate:.1%} mean, {worst:.1%} worst worker")
    if m.peak_inflight is not None:
        unit = "micro-batch" if plan.spec.chunks == 1 else "micro-batch chunk"
        lines.append(f"  peak in-flight  {plural(m.peak_inflight, unit)} per worker")
    if m.rerouted_ops is not None:
        lines.append(f"  re-routed ops   {m.rerouted_ops:,} of {m.ops or 0:,}")
    if m.throughput is not None:
        lines.append(f"  throughput      {number(m.throughput, 5)} samples/s")
    return "\n".join(lines)


def _engine_line(name: str, report: dict, period: float, tail: str) -> str:
    """An exact engine's status, objective, bound and gap, then `tail`. An objective that is
    not the plan's period says whose it is."""
    obj = "none" if report.get("objective") is None else number(report["objective"])
    if report.get("objective") is not None and abs(report["objective"] - period) > 1e-6:
        obj += " in its model" + ("" if report.get("improved") else
                                  f", its own plan's; the plan kept: {number(period)}")
    bnd = "none" if report.get("best_bound") is None else number(report["best_bound"])
    gap = "" if report.get("gap") is None else f", gap {report['gap']:.1%}"
    return f"  {name:<16}{report['status']}: objective {obj}, best bound {bnd}{gap}; {tail}"
