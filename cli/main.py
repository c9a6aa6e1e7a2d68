"""The `recycle-planner` command line."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from recycle_planner import __version__
from recycle_planner.errors import RecycleError
from recycle_planner.policy import SCHEDULES

log = logging.getLogger("recycle_planner")

EPILOG = """\b
Typical session:
  recycle-planner plan examples/small.toml -o ff.json
  recycle-planner plan examples/small.toml --fail 1:0 -o fail.json
  recycle-planner show fail.json
  recycle-planner gantt fail.json -o fail.png --compare ff.json
  recycle-planner validate fail.json
  recycle-planner export-torch ff.json -o schedule.csv
"""


class Cli(click.Group):
    """Bad input (a wrong spec, an impossible failure set, a corrupted plan) is one line on
    stderr and exit status 2, like click's own usage errors; a bug still shows its traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except RecycleError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(2)


@click.group(cls=Cli, epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="recycle-planner")
@click.option("-v", "--verbose", count=True, help="More log output on stderr (-vv for debug).")
def main(verbose: int) -> None:
    """Plan, inspect and export re-routing schedules for hybrid-parallel training.

    When a pipeline-stage worker dies, its micro-batches are re-routed to the data-parallel
    peers that hold the same stage, and the extra work is packed into the pipeline's idle
    time (ReCycle, SOSP 2024). A job is described in a TOML spec (see examples/); plans are
    JSON files that a launcher reads.
    """
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def policy_options(func):
    func = click.option("--stagger/--no-stagger", default=True, show_default=True,
                        help="Staggered optimizer: each stage all-reduces and steps on its own "
                             "(else a global barrier ends each iteration).")(func)
    func = click.option("--decouple/--no-decouple", default=True, show_default=True,
                        help="Split each backward into I (input gradient) and W (weight "
                             "gradient) and let W fill idle time.")(func)
    func = click.option("--schedule", type=click.Choice(SCHEDULES), default="1f1b",
                        show_default=True, help="The pipeline schedule the job runs when "
                                                "nothing has failed.")(func)
    return func


def make_policy(schedule: str, decouple: bool, stagger: bool):
    from recycle_planner.policy import Policy

    return Policy(schedule=schedule, decouple=decouple, stagger=stagger)


@main.command()
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--fail", "fail", multiple=True, metavar="PIPELINE:STAGE",
              help="A dead worker; repeat for several.")
@policy_options
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the plan here (JSON; .json.gz is compressed).")
def plan(spec: Path, fail: tuple[str, ...], schedule: str, decouple: bool, stagger: bool,
         output: Path | None) -> None:
    """Plan one failure situation of the job in SPEC and print its figures.

    With no --fail, the plan is the fault-free schedule. The summary gives the period
    (steady-state time per iteration), the degradation against the fault-free plan of the
    same policy, and a lower bound that no plan can beat.
    """
    from recycle_planner.failures import parse_worker
    from recycle_planner.planfile import write_plan
    from recycle_planner.planner import plan_situation
    from recycle_planner.spec import load_spec
    from recycle_planner.summary import plan_summary

    job = load_spec(spec)
    policy = make_policy(schedule, decouple, stagger)
    failed = [parse_worker(f) for f in fail]
    result = plan_situation(job, policy, failed)
    click.echo(plan_summary(result))
    if output is not None:
        write_plan(result, output)
        click.echo(f"wrote {output}")


@main.command()
@click.argument("plan_file", metavar="PLAN.json", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--width", default=96, show_default=True, type=click.IntRange(20, 1000),
              help="Characters of timeline per worker.")
@click.option("--max-workers", default=32, show_default=True, type=click.IntRange(1),
              help="Rows to show at most (pipelines with failures first).")
@click.option("--critical-path/--no-critical-path", default=True, show_default=True,
              help="List the chain of ops that decides the iteration time (plans of up to "
                   "20,000 ops).")
def show(plan_file: Path, width: int, max_workers: int, critical_path: bool) -> None:
    """Print a plan's summary, a text timeline of one iteration and its critical path."""
    from recycle_planner.planfile import read_plan
    from recycle_planner.summary import plan_summary
    from recycle_planner.timeline import text_timeline

    p = read_plan(plan_file)
    click.echo(plan_summary(p))
    click.echo()
    click.echo(text_timeline(p, width=width, max_workers=max_workers))
    if critical_path and p.schedule.n_ops <= 20_000:
        from recycle_planner.dag import critical_path as chain_of, describe_critical_path, plan_graph

        click.echo()
        click.echo("critical path (first iteration, from an idle start):")
        click.echo(describe_critical_path(chain_of(plan_graph(p.schedule))))


@main.command()
@click.argument("plan_file", metavar="PLAN.json", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Picture to write: .png, .svg or .pdf.")
@click.option("--compare", type=click.Path(dir_okay=False, path_type=Path), metavar="OTHER.json",
              help="Draw another plan below, on the same time scale (for example the "
                   "fault-free plan).")
@click.option("--max-workers", default=48, show_default=True, type=click.IntRange(1),
              help="Rows per plan at most (pipelines with failures first).")
def gantt(plan_file: Path, output: Path, compare: Path | None, max_workers: int) -> None:
    """Draw a plan as a Gantt chart: one row per worker, grouped by pipeline."""
    from recycle_planner.gantt import draw_gantt
    from recycle_planner.planfile import read_plan

    plans = [read_plan(plan_file)]
    if compare is not None:
        plans.append(read_plan(compare))
    draw_gantt(plans, output, max_workers=max_workers)
    click.echo(f"wrote {output}")


@main.command()
@click.argument("plan_file", metavar="PLAN.json", type=click.Path(dir_okay=False, path_type=Path))
def validate(plan_file: Path) -> None:
    """Check every rule a plan must keep: each op once on a live worker of its stage,
    dependencies with p2p latency, no overlap, memory, no deadlock. Exit status 1 when a rule
    is broken."""
    from recycle_planner.planfile import read_plan
    from recycle_planner.validate import validate as check

    problems = check(read_plan(plan_file))
    if not problems:
        click.echo(f"{plan_file}: valid")
        return
    for problem in problems:
        click.echo(f"{plan_file}: {problem}")
    sys.exit(1)


@main.command("export-torch")
@click.argument("plan_file", metavar="PLAN.json", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="CSV file to write.")
@click.option("--pipeline", default=0, show_default=True, type=click.IntRange(0),
              help="Which pipeline's rows to export (all are the same without failures).")
def export_torch(plan_file: Path, output: Path, pipeline: int) -> None:
    """Write a fault-free plan as torch.distributed.pipelining's compute-only CSV, for
    _PipelineScheduleRuntime._load_csv(path, format="compute_only")."""
    from recycle_planner.export_torch import export_torch_csv
    from recycle_planner.planfile import read_plan

    export_torch_csv(read_plan(plan_file), output, pipeline)
    click.echo(f"wrote {output}")
