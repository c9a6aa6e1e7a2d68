"""`recycle-planner simulate-trace`: training throughput over a failure trace, per strategy."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
from click.core import ParameterSource

from recycle_planner.cli.options import number
from recycle_planner.cli.progress import Ticker
from recycle_planner.errors import RecycleError
from recycle_planner.whatif.engine import STRATEGIES
from recycle_planner.whatif.hosts import PLACEMENTS
from recycle_planner.whatif.trace import DISTRIBUTIONS, REPAIR_DISTRIBUTIONS, SAMPLINGS

EPILOG = """\b
Examples:
  recycle-planner plan-all examples/gpt.toml --max-failures 2 -o plans/
  recycle-planner simulate-trace examples/gpt.toml --library plans/ --mtbf 6h,2h,30min -o out/
  recycle-planner simulate-trace examples/gpt.toml --library plans/ --trace examples/trace.csv
  recycle-planner simulate-trace examples/gpt.toml -l plans/ --mtbf 2h \
      --baseline-policy 1f1b/fused/barrier
  recycle-planner simulate-trace examples/gpt.toml -l plans/ --mtbf 2h --workers-per-host 4
"""


@click.command("simulate-trace", epilog=EPILOG)
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--library", "-l", "library", required=True,
              type=click.Path(file_okay=False, path_type=Path),
              help="Plan library of this spec (from plan-all): re-routing's plans and policy "
                   "(situations it lacks are planned on demand).")
@click.option("--trace", "trace_file", type=click.Path(dir_okay=False, path_type=Path),
              metavar="TRACE.csv", help="Replay this trace (lines: time,event,worker).")
@click.option("--mtbf", metavar="DURATIONS",
              help="Sample traces instead: mean time between failures of the whole job; "
                   "several, comma-separated (6h,2h,30min), give one run each.")
@click.option("--repair", default="1h", show_default=True, metavar="DURATION",
              help="Mean repair time of a worker (sampled traces; more than 0).")
@click.option("--duration", metavar="DURATION",
              help="Length of the trace [default: 7d when sampling, the last event of a trace "
                   "file].")
@click.option("--seed", default=0, show_default=True, type=number("seed"),
              help="Seed of the sampling.")
@click.option("--distribution", type=click.Choice(DISTRIBUTIONS), default="exponential",
              show_default=True, help="Distribution of the times between failures.")
@click.option("--shape", default=0.7, show_default=True, type=number("shape"),
              help="Weibull shape, with --distribution weibull (below 1: failures come in "
                   "bursts).")
@click.option("--sampling", type=click.Choice(SAMPLINGS), default="worker", show_default=True,
              help="worker: each worker fails on its own (MTBF x workers each); fleet: one "
                   "failure process for the job, hitting a uniformly chosen live worker.")
@click.option("--repair-distribution", type=click.Choice(REPAIR_DISTRIBUTIONS),
              default="exponential", show_default=True, help="Distribution of repair times.")
@click.option("--strategies", default=",".join(STRATEGIES), show_default=True,
              help="Which strategies to compare, comma-separated.")
@click.option("--detect", default="10s", show_default=True, metavar="DURATION",
              help="Time to notice a failure.")
@click.option("--switch", default="5s", show_default=True, metavar="DURATION",
              help="Re-routing plan switch; also a regrouping for dropped pipelines and "
                   "Bamboo's fail-over.")
@click.option("--reconfigure", default="60s", show_default=True, metavar="DURATION",
              help="Oobleck's re-instantiation of pipelines (fixed part; the layers it moves "
                   "are added at --bandwidth).")
@click.option("--checkpoint-interval", default="30min", show_default=True, metavar="DURATION",
              help="Wall-clock time between checkpoints.")
@click.option("--restart", default="10min", show_default=True, metavar="DURATION",
              help="Relaunch from a checkpoint.")
@click.option("--spares", default=2, show_default=True, type=number("spares"),
              help="Spare hosts (of --workers-per-host workers each) for checkpoint-restart "
                   "with spares.")
@click.option("--plan-time", default="measured", show_default=True, metavar="measured|DURATION",
              help="What re-routing is charged the first time it plans a situation the library "
                   "lacks: the heuristic's time measured on this job, or a fixed duration.")
@click.option("--baseline-policy", metavar="POLICY",
              help="Schedule policy of the fault-free baseline and of every strategy but "
                   "re-routing, e.g. 1f1b/fused/barrier (as DeepSpeed and Megatron run 1F1B) "
                   "[default: the library's].")
@click.option("--workers-per-host", default=1, show_default=True, type=number("workers_per_host"),
              help="Workers on one host; a host fails and is repaired as one (sampled traces, "
                   "and host:H in trace files).")
@click.option("--host-placement", default="pipeline", show_default=True,
              metavar="|".join(PLACEMENTS),
              help="pipeline: a host holds consecutive ranks d*S+s (stages of one pipeline); "
                   "stage: ranks s*D+d (one stage of several pipelines).")
@click.option("--bandwidth", default="12.5GB/s", show_default=True, metavar="BYTES/s",
              help="Bandwidth a worker receives layers at when Oobleck re-instantiates "
                   "pipelines.")
@click.option("--parameter-bytes", metavar="SIZE",
              help="Model state that moves with Oobleck's layers (weights and optimizer state, "
                   "e.g. 40GiB), when the spec has no [memory] static sizes.")
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path),
              help="Folder (created) for whatif.json, the plots and the sampled traces.")
@click.option("--plot-format", type=click.Choice(["png", "svg", "pdf"]), default="png",
              show_default=True)
@click.option("--json", "as_json", is_flag=True,
              help="Print the results as JSON instead of the tables.")
def simulate_trace(spec: Path, library: Path, trace_file: Path | None, mtbf: str | None,
                   repair: str, duration: str | None, seed: int, distribution: str,
                   shape: float, sampling: str, repair_distribution: str, strategies: str,
                   detect: str, switch: str, reconfigure: str, checkpoint_interval: str,
                   restart: str, spares: int, plan_time: str, baseline_policy: str | None,
                   workers_per_host: int, host_placement: str, bandwidth: str,
                   parameter_bytes: str | None, output: Path | None, plot_format: str,
                   as_json: bool) -> None:
    """Replay worker failures and repairs and compare how much each recovery strategy trains.

    Strategies: re-routing with the plan library, planning situations it lacks on demand
    (reroute), or with the library only, falling back to a checkpoint restart beyond it
    (reroute-library-only), checkpoint-restart with spares and without (checkpoint-spares,
    checkpoint-wait), dropping the broken pipelines (drop-pipelines), Oobleck-style
    re-instantiation of shorter pipelines (oobleck) and Bamboo-style redundant computation
    (bamboo). All are costed with the same per-stage costs through the planner; re-routing
    runs the library's policy, the others the baseline policy; each strategy's policy and
    assumptions are printed with the results.
    """
    from recycle_planner.job.spec import load_spec
    from recycle_planner.library import PlanLibrary
    from recycle_planner.io import check_writable
    from recycle_planner.job.policy import Policy
    from recycle_planner.whatif.durations import parse_duration, parse_durations, parse_size
    from recycle_planner.whatif.hosts import Hosts
    from recycle_planner.whatif.engine import simulate
    from recycle_planner.whatif.output import study_dict, study_text
    from recycle_planner.whatif.strategy import Context, Costs
    from recycle_planner.whatif.trace import read_trace, sample_trace

    if (trace_file is None) == (mtbf is None):
        raise RecycleError("give either --trace TRACE.csv or --mtbf DURATIONS (to sample "
                           "traces), " + ("not both" if mtbf is not None else "one of them"))
    if output is not None:
        check_writable(output, folder=True)
    job = load_spec(spec)
    lib = PlanLibrary.open(library, spec=job)
    problems = lib.problems()
    if problems:
        raise RecycleError(f"{library}: the plan library is incomplete ({problems[0]}): run "
                           f"plan-all again")
    costs = Costs(detect=parse_duration(detect, "--detect"),
                  switch=parse_duration(switch, "--switch"),
                  reconfigure=parse_duration(reconfigure, "--reconfigure"),
                  checkpoint_interval=parse_duration(checkpoint_interval,
                                                     "--checkpoint-interval", allow_zero=False),
                  restart=parse_duration(restart, "--restart"),
                  spares=spares * max(workers_per_host, 1),
                  plan=(None if plan_time.strip().lower() == "measured"
                        else parse_duration(plan_time, "--plan-time")),
                  bandwidth=parse_size(bandwidth, "--bandwidth", per_second=True),
                  parameter_bytes=(parse_size(parameter_bytes, "--parameter-bytes")
                                   if parameter_bytes is not None else None))
    policy = None
    if baseline_policy is not None:
        try:
            policy = Policy.from_label(baseline_policy)
        except RecycleError as exc:
            raise RecycleError(f"--baseline-policy: {exc}") from None
    hosts = Hosts(job.stages, job.pipelines, workers_per_host, host_placement)
    names = [n.strip() for n in strategies.split(",") if n.strip()]
    if not names:
        raise RecycleError(f"--strategies names none: give one or more of "
                           f"{', '.join(STRATEGIES)}, comma-separated")
    source = click.get_current_context().get_parameter_source("shape")
    if distribution != "weibull" and source is not ParameterSource.DEFAULT:
        raise RecycleError(f"--shape is the Weibull shape: add --distribution weibull (the "
                           f"{distribution} distribution has no shape)")
    if trace_file is not None:
        length = parse_duration(duration, "--duration", allow_zero=False) if duration else None
        traces = [(trace_file.name, read_trace(trace_file, job, length, hosts))]
    else:
        length = parse_duration(duration or "7d", "--duration", allow_zero=False)
        mean_repair = parse_duration(repair, "--repair", allow_zero=False)
        traces = []
        for value, text in zip(parse_durations(mtbf, "--mtbf"), mtbf.split(",")):
            traces.append((f"every {text.strip()}",
                           sample_trace(job, value, mean_repair, length, seed, distribution,
                                        shape, sampling, repair_distribution, hosts)))
    with Ticker("simulating"):
        study = simulate(Context.from_library(lib, costs, policy), traces, names)
    click.echo(json.dumps(study_dict(study), indent=1) if as_json else study_text(study))
    if output is not None:
        _write_outputs(study, output, plot_format, sampled=trace_file is None, quiet=as_json)


def _write_outputs(study, folder: Path, fmt: str, sampled: bool, quiet: bool) -> None:
    """whatif.json, one throughput-over-time plot per trace, the across-frequencies plot when
    there are several traces, and the sampled traces as CSV."""
    from recycle_planner.io import write_json
    from recycle_planner.whatif.output import study_dict
    from recycle_planner.whatif.plots import plot_frequencies, plot_over_time
    from recycle_planner.whatif.trace import write_trace

    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RecycleError(f"{folder}: cannot create the output folder: "
                           f"{exc.strerror or exc}") from None
    written = [folder / "whatif.json"]
    write_json(written[0], study_dict(study))
    for run in study.runs:
        slug = re.sub(r"[^A-Za-z0-9.]+", "-", re.sub(r"\.csv$", "", run.label)).strip("-")
        written.append(folder / f"throughput-{slug}.{fmt}")
        plot_over_time(study, run, written[-1])
        if sampled:
            written.append(folder / f"trace-{slug}.csv")
            write_trace(run.trace, written[-1])
    if len(study.runs) > 1:
        written.append(folder / f"frequencies.{fmt}")
        plot_frequencies(study, written[-1])
    if not quiet:
        click.echo("")
        click.echo("wrote " + ", ".join(str(p) for p in written))
