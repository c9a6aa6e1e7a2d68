"""The `recycle-planner` command line."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from recycle_planner import __version__
from recycle_planner.errors import RecycleError
from recycle_planner.job.policy import SCHEDULES, compute_ops
from recycle_planner.library import Settings
from recycle_planner.solvers.milp_backends import BACKENDS
from recycle_planner.solvers.registry import PROVE_WORK, SOLVERS, SolverSettings, solver_help
from recycle_planner.cli.options import number
from recycle_planner.cli.progress import Ticker, count_step, progress_log
from recycle_planner.words import plural

log = logging.getLogger("recycle_planner")

EPILOG = """\b
Typical session:
  recycle-planner plan examples/small.toml -o ff.json
  recycle-planner plan examples/small.toml --fail 1:0 -o fail.json
  recycle-planner show fail.json
  recycle-planner gantt fail.json -o fail.png --compare ff.json
  recycle-planner validate fail.json
  recycle-planner export-torch ff.json -o schedule.csv
  recycle-planner plan-all examples/gpt.toml --max-failures 2 -o plans/
  recycle-planner lookup plans/ --fail 3:1 --fail 0:5
  recycle-planner program plans/ --fail 3:1 --fail 0:5 -o programs/
  recycle-planner report plans/ -o degradation.png
"""


def examples(*lines: str, note: str = "") -> str:
    """A command's epilog: examples kept verbatim by click (the \\b line), then a note."""
    text = "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)
    return text + (f"\n\n{note}" if note else "")


PLAN_EPILOG = examples(
    "recycle-planner plan examples/gpt.toml -o ff.json",
    "recycle-planner plan examples/gpt.toml --fail 1:3 -o fail.json",
    "recycle-planner plan examples/gpt.toml --fail 1:3 --no-decouple --no-stagger",
    "recycle-planner plan examples/small.toml --fail 0:1 --fail 1:2 --solver milp",
    "recycle-planner plan examples/small.toml --fail 0:1 --fail 1:2 --no-stagger --solver cp",
    note="A worker is PIPELINE:STAGE, both counted from 0. Times are in milliseconds. "
         "--no-decouple --no-stagger is plain re-routing, the baseline.")
SHOW_EPILOG = examples("recycle-planner show fail.json",
                       "recycle-planner show big.json --width 160 --no-critical-path")
GANTT_EPILOG = examples(
    "recycle-planner gantt fail.json -o fail.png",
    "recycle-planner gantt fail.json --compare ff.json -o fail-vs-ff.svg",
    note="Re-routed ops are hatched and labelled with their own pipeline; a dead worker's row "
         "is grey, crossed and labelled dead. Both plans of --compare share one time axis "
         "(ms).")
VALIDATE_EPILOG = examples("recycle-planner validate fail.json && echo ok")
EXPORT_EPILOG = examples(
    "recycle-planner plan examples/small.toml -o ff.json",
    "recycle-planner export-torch ff.json -o schedule.csv",
    note="Only fault-free plans: torch's runtime has no notion of re-routed micro-batches.")
PLAN_ALL_EPILOG = examples(
    "recycle-planner plan-all examples/gpt.toml --max-failures 2 -o plans/",
    "recycle-planner plan-all examples/gpt.toml -f 3 -o plans/ -j 8   # resumes plans/",
    "recycle-planner plan-all examples/gpt.toml -f 3 -o plans/ --prove   # closes gaps",
    "recycle-planner plan-all big.toml -f 2 --solver heuristic -o big-plans/")
LOOKUP_EPILOG = examples(
    "recycle-planner lookup plans/ --fail 2:5 --fail 0:1",
    "recycle-planner lookup plans/ --fail 2:5 --json | jq .file",
    note="In Python: PlanLibrary.open('plans/').lookup([(2, 5), (0, 1)]).")
REPORT_EPILOG = examples("recycle-planner report plans/ -o degradation.png")


class Cli(click.Group):
    """Bad input (a wrong spec, an impossible failure set, a corrupted plan), an output that
    cannot be written (no such folder, read-only, full disk, no permission) and a usage error
    (an unknown option, a value out of range) are one line on stderr and exit status 2; a
    reader that stops reading (`| head`) ends the command quietly with status 141, as SIGPIPE
    ends Unix tools; Ctrl-C stops at once with status 130; a bug still shows its traceback."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:
            raise OneLineUsageError(exc) from None
        except BrokenPipeError:  # --help into `| head`
            if not reader_gone(sys.stdout):
                raise
            quiet_stdout()
            sys.exit(128 + signal.SIGPIPE)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            raise OneLineUsageError(exc) from None
        except RecycleError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(2)
        except OSError as exc:
            if isinstance(exc, BrokenPipeError) and reader_gone(sys.stdout):
                quiet_stdout()
                ctx.exit(128 + signal.SIGPIPE)
            where = f"{exc.filename}: " if exc.filename else ""
            click.echo(f"error: {where}{exc.strerror or exc}", err=True)
            ctx.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        """Every subcommand also takes -v/--verbose, after its name as well as before."""
        cmd.params.append(click.Option(["-v", "--verbose"], count=True, expose_value=False,
                                       callback=set_verbosity, help=VERBOSE_HELP))
        super().add_command(cmd, name)


class OneLineUsageError(click.UsageError):
    """click's usage error as one line, like every other error: `error: MESSAGE (see
    'recycle-planner plan --help')` rather than click's usage, hint and message."""

    def __init__(self, exc: click.UsageError):
        super().__init__(exc.format_message(), exc.ctx)

    def show(self, file=None) -> None:
        where = f" (see '{self.ctx.command_path} --help')" if self.ctx is not None else ""
        click.echo(f"error: {self.format_message().rstrip('.')}{where}", err=True)


def reader_gone(stream) -> bool:
    """Whether `stream` is a pipe whose reader has closed it (poll says POLLERR)."""
    import select

    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))


def quiet_stdout() -> None:
    """Point standard output at /dev/null, so that the interpreter's last flush of what is
    still buffered does not fail again on the closed pipe."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


class AliasOption(click.Option):
    """An option whose first name is shown in --help; later names are old spellings that still
    work (lookup's --failed is plan's --fail)."""

    def get_help_record(self, ctx: click.Context):
        opts = self.opts
        self.opts = opts[:1]
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = opts


LONG_PLAN = 5.0  # seconds: a plan expected to take longer is announced with its estimate
VERBOSE_HELP = "More log output on stderr (-vv for debug)."


class EchoHandler(logging.Handler):
    """Log records as lines on the current stderr (click's, so that tests see them too)."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(self.format(record), err=True)


def set_verbosity(ctx: click.Context, param: click.Parameter, verbose: int) -> int:
    """-v: info, -vv: debug; without it, warnings only (the progress line reads the info
    records either way). The last -v given wins when it raises the level."""
    handler = next((h for h in log.handlers if isinstance(h, EchoHandler)), None)
    if handler is None:
        handler = EchoHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
        progress = EchoHandler()  # progress lines off a terminal show at every verbosity
        progress.setFormatter(handler.formatter)
        progress_log.addHandler(progress)
        progress_log.setLevel(logging.INFO)
        progress_log.propagate = False
    if verbose or param.name == "verbose" and ctx.parent is None:
        handler.setLevel(logging.WARNING - 10 * min(verbose, 2))
        log.setLevel(logging.DEBUG if verbose >= 2 else logging.INFO)
    return verbose


@click.group(cls=Cli, epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="recycle-planner")
@click.option("-v", "--verbose", count=True, expose_value=False, callback=set_verbosity,
              help=VERBOSE_HELP)
def main() -> None:
    """Plan, inspect and export re-routing schedules for hybrid-parallel training.

    When a pipeline-stage worker dies, its micro-batches are re-routed to the data-parallel
    peers that hold the same stage, and the extra work is packed into the pipeline's idle
    time (ReCycle, SOSP 2024). A job is described in a TOML spec (see examples/); plans are
    JSON files that a launcher reads. An output named '-' is standard output.

    Exit status: 0 done; 1 a check failed (validate); 2 bad input or an output that cannot
    be written (one line on stderr, nothing half-written left behind); 130 interrupted.
    """


def policy_options(func):
    func = click.option("--stagger/--no-stagger", default=True, show_default=True,
                        help="Staggered optimizer: each stage all-reduces and steps on its own "
                             "(else a global barrier ends each iteration).")(func)
    func = click.option("--decouple/--no-decouple", default=True, show_default=True,
                        help="Split each backward into I (input gradient) and W (weight "
                             "gradient) and let W fill idle time.")(func)
    func = click.option("--schedule", type=click.Choice(SCHEDULES), default="1f1b",
                        show_default=True, help="The pipeline schedule the job runs when "
                                                "nothing has failed. With 'chunks' in the spec: "
                                                "1f1b is interleaved 1F1B (layout v: ZB-V's "
                                                "order, fused), zb-h1 interleaved zero bubble "
                                                "or ZB-V.")(func)
    return func


def solver_options(default: str):
    return lambda func: _solver_options(func, default)


def _solver_options(func, default: str):
    defaults = SolverSettings()
    func = click.option("--backend", type=click.Choice(list(BACKENDS)), default=defaults.backend,
                        show_default=True,
                        help="MILP backend: highspy directly, or PuLP with CBC or HiGHS.")(func)
    func = click.option("--node-limit", type=number("node_limit"), default=None, metavar="NODES",
                        help="Also stop the MILP after this many branch-and-bound nodes: the "
                             "same answer on every machine (plan-all defaults to "
                             f"{Settings().node_limit}).")(func)
    func = click.option("--time-limit", type=number("time_limit"),
                        default=defaults.time_limit, show_default=True, metavar="SECONDS",
                        help="Budget of the MILP (and of 'auto') per situation.")(func)
    func = click.option("--work-limit", type=number("work_limit"), default=None,
                        metavar="WORK",
                        help="Budget of the CP engine in CP-SAT's deterministic seconds (about "
                             "CPU seconds), the same plan on every machine (default: the time "
                             f"limit; plan-all: {Settings().work_limit:g}).")(func)
    func = click.option("--solver", type=click.Choice(list(SOLVERS)), default=default,
                        show_default=True, help=solver_help())(func)
    return func


def check_solver_options(solver: str, *more: str) -> None:
    """An option the chosen solver does not read is an error, not silently ignored (the
    registry says which solver reads what); `more` names options beyond the budgets (plan's
    --prove, which plan-all reads for every solver)."""
    ctx = click.get_current_context()
    for name in ("time_limit", "backend", "node_limit", "work_limit", *more):
        if ctx.get_parameter_source(name) in (ParameterSource.DEFAULT, None):
            continue
        if name not in SOLVERS[solver].options:
            readers = [n for n, entry in SOLVERS.items() if name in entry.options]
            raise RecycleError(f"--{name.replace('_', '-')} is not read by the {solver} "
                               f"solver, only by {' and '.join(readers)}: add --solver "
                               f"{readers[0]} or leave it out")


def check_output(path: Path | None, picture: bool = False, folder: bool = False) -> None:
    """Fail before any work on an output that cannot be written (no such folder, read-only,
    no permission, or a picture name without .png/.svg/.pdf)."""
    from recycle_planner.io import check_writable
    from recycle_planner.views.figures import picture_format

    if path is None:
        return
    if picture:
        picture_format(path)
    check_writable(path, folder=folder)


def wrote(path: Path | None) -> None:
    """Say what was written, unless it went to standard output."""
    from recycle_planner.io import is_stdout

    if path is not None and not is_stdout(path):
        click.echo(f"wrote {path}")


def make_policy(schedule: str, decouple: bool, stagger: bool):
    from recycle_planner.job.policy import Policy

    return Policy(schedule=schedule, decouple=decouple, stagger=stagger)


@main.command(epilog=PLAN_EPILOG)
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--fail", "--failed", "fail", cls=AliasOption, multiple=True,
              metavar="PIPELINE:STAGE", help="A dead worker; repeat for several.")
@policy_options
@solver_options(default=SolverSettings().solver)
@click.option("--prove", is_flag=True,
              help="With --solver cp: spend the work limit on closing the gap to the lower "
                   "bound (bisection with 'is there a schedule under X?').")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the plan here (JSON; .json.gz is compressed; '-' is standard output, "
                   "the summary then goes to stderr).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def plan(spec: Path, fail: tuple[str, ...], schedule: str, decouple: bool, stagger: bool,
         solver: str, time_limit: float, node_limit: int | None, backend: str,
         work_limit: float | None, prove: bool, output: Path | None, as_json: bool) -> None:
    """Plan one failure situation of the job in SPEC and print its figures.

    With no --fail, the plan is the fault-free schedule. The summary gives the period
    (steady-state time per iteration), the degradation against the fault-free plan of the
    same policy, and a lower bound that no plan can beat.
    """
    from recycle_planner.files.planfile import write_plan
    from recycle_planner.io import is_stdout
    from recycle_planner.job.spec import load_spec
    from recycle_planner.job.workers import check_failed, parse_worker
    from recycle_planner.planner import expected_memory, expected_seconds, plan_situation
    from recycle_planner.programs import check_plan
    from recycle_planner.words import duration, number

    check_solver_options(solver, "prove")
    check_output(output)
    job = load_spec(spec)
    policy = make_policy(schedule, decouple, stagger)
    failed = [parse_worker(f) for f in fail]
    settings = SolverSettings(solver=solver, time_limit=time_limit, backend=backend,
                              node_limit=node_limit, work_limit=work_limit, prove=prove)
    failed = check_failed(job, failed)
    expected = expected_seconds(job, policy, failed, settings)
    if expected > LONG_PLAN:  # say so before the silence, not after minutes of it
        click.echo(f"planning {compute_ops(job, policy):,} ops per iteration"
                   + (" (and the fault-free plan for reference)" if failed else "")
                   + f": expect about {duration(expected)} and "
                   f"{number(expected_memory(job, policy) / 2**30, 2)} GiB", err=True)
    with Ticker("planning"):
        result = plan_situation(job, policy, failed, settings)
        check_plan(result)  # once per plan, so that no launcher has to
    print_summary(result, as_json, err=is_stdout(output))
    if output is not None:
        write_plan(result, output)
        wrote(output)


def print_summary(p, as_json: bool, err: bool = False) -> None:
    """The plan's summary, as text or as JSON (format recycle-plan-summary)."""
    import json

    from recycle_planner.views.summary import plan_summary, summary_dict

    click.echo(json.dumps(summary_dict(p), indent=2) if as_json else plan_summary(p), err=err)


def broken(plan_file: Path, p, what: str | None) -> str | None:
    """The one-line refusal for a plan that breaks a rule (None when it keeps them all), after
    `what` was refused."""
    from recycle_planner.timing.validate import validate

    problems = validate(p)
    if not problems:
        return None
    return (f"{plan_file}: {f'{what}, ' if what else ''}the plan breaks "
            f"{plural(len(problems), 'rule')}, first {problems[0]} (see 'recycle-planner "
            f"validate')")


def critical_path_heading(m) -> str:
    """The critical path ends at the iteration time, which is longer than the headline period
    when iterations overlap: say so where both numbers meet."""
    from recycle_planner.words import number

    heading = (f"critical path of the first iteration, from an idle start to its end at the "
               f"iteration time, {number(m.iteration_time)} ms")
    if m.period < m.iteration_time - 1e-9:
        heading += (f"\n(the period, {number(m.period)} ms, is shorter: each stage starts its "
                    f"next iteration before the last stages finish this one)")
    return heading + ":"


@main.command(epilog=SHOW_EPILOG)
@click.argument("plan_file", metavar="PLAN.json", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--width", default=96, show_default=True, type=number("width"),
              help="Characters of timeline per worker.")
@click.option("--max-workers", default=32, show_default=True, type=number("max_workers"),
              help="Rows to show at most (pipelines with failures first).")
@click.option("--critical-path/--no-critical-path", default=True, show_default=True,
              help="List the chain of ops that decides the iteration time (plans of up to "
                   "20,000 ops).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the summary (and the critical path) as JSON, without the timeline.")
def show(plan_file: Path, width: int, max_workers: int, critical_path: bool,
         as_json: bool) -> None:
    """Print a plan's summary, a text timeline of one iteration and its critical path. A plan
    that breaks a rule is shown, then named on stderr with exit status 1."""
    import json

    from recycle_planner.files.planfile import read_plan
    from recycle_planner.views.summary import plan_summary, summary_dict
    from recycle_planner.views.timeline import text_timeline

    p = read_plan(plan_file)
    chain = None
    problem = broken(plan_file, p, "no critical path" if critical_path else None)
    if critical_path and problem is None and p.schedule.n_ops <= 20_000:
        from recycle_planner.timing.dag import critical_path as chain_of
        from recycle_planner.timing.dag import plan_graph

        chain = chain_of(plan_graph(p.schedule))
    if as_json:
        out = summary_dict(p)
        if chain is not None:
            out["critical_path"] = [
                {"kind": op.kind, "pipeline": op.pipeline, "stage": op.stage,
                 "microbatch": op.microbatch, "worker": list(worker), "start": a, "end": b}
                for op, worker, a, b in chain]
        click.echo(json.dumps(out, indent=2))
    else:
        click.echo(plan_summary(p))
        click.echo()
        click.echo(text_timeline(p, width=width, max_workers=max_workers))
        if chain is not None:
            from recycle_planner.timing.dag import describe_critical_path

            click.echo()
            click.echo(critical_path_heading(p.metrics))
            click.echo(describe_critical_path(chain))
    if problem is not None:
        click.echo(f"error: {problem}", err=True)
        sys.exit(1)


@main.command(epilog=GANTT_EPILOG)
@click.argument("plan_file", metavar="PLAN.json", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Picture to write: .png, .svg or .pdf ('-': PNG on standard output).")
@click.option("--compare", type=click.Path(dir_okay=False, path_type=Path), metavar="OTHER.json",
              help="Draw another plan below, on the same time scale (for example the "
                   "fault-free plan).")
@click.option("--max-workers", default=48, show_default=True, type=number("max_workers"),
              help="Rows per plan at most (pipelines with failures first).")
def gantt(plan_file: Path, output: Path, compare: Path | None, max_workers: int) -> None:
    """Draw a plan as a Gantt chart: one row per worker, grouped by pipeline. A plan that
    breaks a rule is refused (exit status 2; 'recycle-planner validate' lists them)."""
    from recycle_planner.errors import PlanFileError
    from recycle_planner.files.planfile import read_plan
    from recycle_planner.views.gantt import draw_gantt

    check_output(output, picture=True)
    plans = [read_plan(plan_file)]
    if compare is not None:
        plans.append(read_plan(compare))
        if plans[1].schedule.spec != plans[0].schedule.spec:
            log.warning("%s and %s are plans of different jobs: the comparison is of shapes "
                        "only", plan_file, compare)
    for path, p in zip((plan_file, compare), plans):
        problem = broken(path, p, "not drawn")
        if problem is not None:
            raise PlanFileError(problem)
    draw_gantt(plans, output, max_workers=max_workers)
    wrote(output)


@main.command(epilog=VALIDATE_EPILOG)
@click.argument("plan_file", metavar="PLAN.json", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True,
              help='Print {"file", "valid", "problems": [{"rule", "message"}]} as JSON.')
def validate(plan_file: Path, as_json: bool) -> None:
    """Check every rule a plan must keep: each op once on a live worker of its stage,
    dependencies with p2p latency, no overlap, memory, no deadlock, and metrics that the ops
    give (the period re-simulated). Exit status 1 when a rule is broken."""
    import json

    from recycle_planner.files.planfile import read_plan
    from recycle_planner.timing.validate import validate as check

    problems = check(read_plan(plan_file))
    if as_json:
        click.echo(json.dumps({"file": str(plan_file), "valid": not problems,
                               "problems": [{"rule": p.rule, "message": p.message}
                                            for p in problems]}, indent=2))
    elif not problems:
        click.echo(f"{plan_file}: valid")
    for problem in problems if not as_json else ():
        click.echo(f"{plan_file}: {problem}")
    if problems:
        sys.exit(1)


@main.command("export-torch", epilog=EXPORT_EPILOG)
@click.argument("plan_file", metavar="PLAN.json", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="CSV file to write ('-': standard output).")
@click.option("--pipeline", default=0, show_default=True, type=number("pipeline"),
              help="Which pipeline's rows to export (all are the same without failures).")
def export_torch(plan_file: Path, output: Path, pipeline: int) -> None:
    """Write a fault-free plan as torch.distributed.pipelining's compute-only CSV, for
    _PipelineScheduleRuntime._load_csv(path, format="compute_only"). The plan is validated
    first: a plan that breaks a rule is refused (exit status 2)."""
    from recycle_planner.errors import PlanFileError
    from recycle_planner.files.export_torch import export_torch_csv
    from recycle_planner.files.planfile import read_plan

    check_output(output)
    p = read_plan(plan_file)
    problem = broken(plan_file, p, "not exported")
    if problem is not None:
        raise PlanFileError(problem)
    export_torch_csv(p, output, pipeline)
    wrote(output)


@main.command("plan-all", epilog=PLAN_ALL_EPILOG)
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--max-failures", "-f", required=True, type=number("max_failures"), metavar="F",
              help="Plan every situation with up to F dead workers.")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Library folder (created; index.json plus one plan per situation).")
@policy_options
@solver_options(default=Settings.solver)
@click.option("--jobs", "-j", type=number("jobs"), default=None,
              help="Processes (default: every core).")
@click.option("--max-placements", type=number("max_placements"), default=4, show_default=True,
              help="Ways to line up the holes across logical pipelines to try per situation.")
@click.option("--force", is_flag=True, help="Rebuild even if the folder holds a library for "
                                            "another spec, a corrupted index, or one for more "
                                            "failures (which is then shrunk to F).")
@click.option("--prove", is_flag=True,
              help="Spend more time to close gaps: every situation whose plan is not proven "
                   "optimal gets the CP engine with --prove-work of budget, warm-started from "
                   "its plan (bisection with 'is there a schedule under X?'); entries already "
                   "proven optimal are kept. Resumable like plan-all.")
@click.option("--prove-work", type=number("prove_work"), default=PROVE_WORK,
              show_default=True, metavar="WORK",
              help="The CP engine's deterministic seconds per situation with --prove.")
def plan_all(spec: Path, max_failures: int, output: Path, schedule: str, decouple: bool,
             stagger: bool, solver: str, time_limit: float, node_limit: int | None, backend: str,
             work_limit: float | None, jobs: int | None, max_placements: int, force: bool,
             prove: bool, prove_work: float) -> None:
    """Precompute the best plan for every failure situation with up to F dead workers.

    Workers of a stage are interchangeable, so a situation is the number of dead workers per
    stage; one plan covers every physical failure set with those counts. Resumable: run it
    again and only missing or stale situations are planned. Prints the library report.
    """
    from tqdm import tqdm

    from recycle_planner.job.spec import load_spec
    from recycle_planner.library import PlanLibrary, build_library
    from recycle_planner.views.report import library_text

    check_solver_options(solver)
    check_output(output, folder=True)
    job = load_spec(spec)
    policy = make_policy(schedule, decouple, stagger)
    settings = Settings(solver=solver, time_limit=time_limit, backend=backend,
                        max_placements=max_placements,
                        node_limit=Settings().node_limit if node_limit is None else node_limit,
                        work_limit=Settings().work_limit if work_limit is None else work_limit,
                        prove_work=prove_work if prove else None)
    bar = tqdm(total=None, unit="situation", desc="planning", file=sys.stderr, disable=None)
    ticker = Ticker("plan-all", logger=None, terminal=False)  # off a terminal: log lines
    counts: list[int] = []  # situations done when the build started, done now, in all

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()
        counts[:] = [counts[0] if counts else done, done, total]
        ticker.step = lambda: "planned " + count_step(counts[1], counts[2], "situations",
                                                      ticker.t0, counts[0])

    # SIGTERM (a supervisor) is like Ctrl-C: the worker processes are stopped, the index stays
    # whole. A signal that lands while the pool forks is held and raised again by planning_pool.
    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with ticker:
            index = build_library(job, policy, max_failures, output, settings, jobs=jobs,
                                  force=force, progress=progress)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        bar.close()
    click.echo(library_text(PlanLibrary(output, index)))


@main.command(epilog=LOOKUP_EPILOG)
@click.argument("library", type=click.Path(file_okay=False, path_type=Path))
@click.option("--fail", "--failed", "failed", cls=AliasOption, multiple=True,
              metavar="PIPELINE:STAGE", help="A dead physical worker; repeat for several.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def lookup(library: Path, failed: tuple[str, ...], as_json: bool) -> None:
    """Find the plan for the workers that are actually dead, and which logical pipeline each
    physical worker plays in it."""
    import json

    from recycle_planner.job.workers import format_workers, parse_worker
    from recycle_planner.library import PlanLibrary

    lib = PlanLibrary.open(library)
    hit = lib.lookup([parse_worker(f) for f in failed])
    if as_json:
        click.echo(json.dumps(hit.to_dict(), indent=2))
        return
    m = hit.entry.metrics
    click.echo(f"plan: {hit.file}")
    click.echo(f"dead (physical): {format_workers(sorted(parse_worker(f) for f in failed))}; "
               f"per stage {list(hit.failed_per_stage)}; in the plan (logical): "
               f"{format_workers(tuple(map(tuple, hit.entry.failed or [])))}")
    click.echo(f"period {m.period:.4g} ms, degradation {m.degradation:+.1%}, "
               f"gap {m.gap or 0:.1%}")
    click.echo("logical pipeline of each physical worker, by stage (pipeline 0, 1, ...):")
    for s, row in enumerate(hit.mapping.logical_of_physical):
        click.echo(f"  stage {s}: {' '.join(str(x) for x in row)}")


@main.command(epilog=REPORT_EPILOG)
@click.argument("library", type=click.Path(file_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Also plot degradation against the number of failures (.png/.svg/.pdf).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the report as JSON: one row per number of failures, and every "
                   "situation.")
def report(library: Path, output: Path | None, as_json: bool) -> None:
    """Summarize a plan library: situations, worst and mean degradation, gaps to the lower
    bounds."""
    import json

    from recycle_planner.library import PlanLibrary
    from recycle_planner.views.report import library_dict, library_text, plot_library

    check_output(output, picture=True)
    lib = PlanLibrary.open(library)
    click.echo(json.dumps(library_dict(lib), indent=2) if as_json else library_text(lib))
    if output is not None:
        plot_library(lib, output)
        if not as_json:
            wrote(output)


from recycle_planner.cli.executor import coordinator, launch, profile  # noqa: E402
from recycle_planner.cli.program import program  # noqa: E402
from recycle_planner.cli.whatif import simulate_trace  # noqa: E402

main.add_command(simulate_trace)
main.add_command(program)
main.add_command(launch)
main.add_command(coordinator)
main.add_command(profile)
