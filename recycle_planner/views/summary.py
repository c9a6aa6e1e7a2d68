"""The short human-readable summary of a plan that the CLI prints."""

from __future__ import annotations

from recycle_planner.job.workers import format_workers
from recycle_planner.timing.plan import Plan


def plan_summary(plan: Plan) -> str:
    m = plan.metrics
    spec = plan.spec
    name = spec.name or "job"
    solver = plan.solver.get("name", "?")
    detail = plan.solver.get("detail")
    lines = [
        f"{name}: {spec.stages} stages x {spec.pipelines} pipelines x {spec.microbatches} "
        f"micro-batches, failed: {format_workers(plan.failed)}",
        f"  policy          {plan.policy.label}   solver {solver}"
        + (f" ({detail})" if detail else ""),
        f"  period          {m['period']:.4g} ms   (fault-free {m['fault_free_period']:.4g} ms, "
        f"degradation {m['degradation']:+.1%})",
        f"  iteration time  {m['iteration_time']:.4g} ms",
        f"  lower bound     {m['lower_bound']:.4g} ms   (gap {m.get('gap', 0.0):.1%}"
        + (f": {m['lower_bound_reason']}" if m.get("lower_bound_reason") else "") + ")",
    ]
    milp = plan.solver.get("milp")
    if milp:
        size = milp.get("model", {})
        lines.append(_engine_line("milp", milp, f"{size.get('binaries', '?')} binaries, "
                                  f"{size.get('constraints', '?')} constraints, "
                                  f"{milp.get('seconds', 0):.1f} s ({milp.get('backend')}, "
                                  f"warm start {milp.get('warm_start')})"))
    for name in ("cp", "prove"):  # the CP engine, and plan-all --prove's run of it
        cp = plan.solver.get(name)
        if cp:
            probes = len(cp.get("probes", ()))
            lines.append(_engine_line(name, cp, f"{cp.get('seconds', 0):.1f} s (work limit "
                                      f"{cp.get('work_limit')}, warm start {cp.get('warm_start')}"
                                      + (f", {probes} probes" if probes else "") + ")"))
    budget = plan.solver.get("budget")
    if budget:
        lines.append(f"  auto budget     {budget['time_limit']:g} s MILP, {budget['work_limit']:g} "
                     f"CP work; spent {budget['seconds']:.1f} s")
    if "bubble_rate" in m:
        lines.append(f"  bubble rate     {m['bubble_rate']:.1%} mean, "
                     f"{m.get('max_bubble_rate', m['bubble_rate']):.1%} worst worker")
    if "peak_inflight" in m:
        lines.append(f"  peak in-flight  {m['peak_inflight']} micro-batches per worker")
    if "rerouted_ops" in m:
        lines.append(f"  re-routed ops   {m['rerouted_ops']} of {m.get('ops', '?')}")
    if "throughput" in m:
        lines.append(f"  throughput      {m['throughput']:.5g} samples/s")
    return "\n".join(lines)


def _engine_line(name: str, report: dict, tail: str) -> str:
    """An exact engine's status, objective, bound and gap, then `tail`."""
    obj = "none" if report.get("objective") is None else f"{report['objective']:.4g}"
    bnd = "none" if report.get("best_bound") is None else f"{report['best_bound']:.4g}"
    gap = "" if report.get("gap") is None else f", gap {report['gap']:.1%}"
    return f"  {name:<16}{report['status']}: objective {obj}, best bound {bnd}{gap}; {tail}"
