"""`recycle-planner launch` and `recycle-planner profile`: train a job, measure a job."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from recycle_planner.cli.options import number
from recycle_planner.cli.progress import Ticker
from recycle_planner.executor.config import (BACKEND, BACKENDS, BUCKET_MB, CHECKPOINT_EVERY,
                                             GRACE, HEARTBEAT, LEASE, MAX_RESTARTS,
                                             PG_TIMEOUT, RDZV_BACKEND, RDZV_BACKENDS,
                                             RDZV_ID, RDZV_TIMEOUT, RUN_DIR, UNDO_COPY,
                                             UNDO_PLACES)
from recycle_planner.library.ondemand import (ON_DEMAND_BUDGET, REFINE_BUDGET, REFINE_MARGIN,
                                              REFINE_WHICH)

BYTES_HELP = "bytes, or a size like 80GiB"


def _settings(f):
    """The options that configure the workers: on `launch` for one machine, on `coordinator`
    for a cluster (host agents take them from the coordinator)."""
    options = [
        click.option("--library", type=click.Path(file_okay=False, path_type=Path),
                     help="Plan library folder (overrides the job's)."),
        click.option("--spec", type=click.Path(dir_okay=False, exists=True),
                     help="Job spec (TOML/JSON, as for plan-all) for a run without a library: "
                          "every failure situation, the fault-free one at start, is planned "
                          "when first met, into RUN_DIR/plans."),
        click.option("--on-demand/--no-on-demand", default=True, show_default=True,
                     help="Plan a failure set the library lacks at once (--no-on-demand: "
                          "stop with a checkpoint beyond the library's threshold)."),
        click.option("--plan-budget", type=number("plan_budget"), default=ON_DEMAND_BUDGET,
                     show_default=True, metavar="SECONDS",
                     help="Time for such a plan: one list-scheduling pass always, the whole "
                          "heuristic when it fits."),
        click.option("--refine", type=click.Choice(REFINE_WHICH), default="on-demand",
                     show_default=True,
                     help="Which plans in use a background process improves (the survivors "
                          "switch at an iteration boundary when it is better by the margin)."),
        click.option("--refine-budget", type=number("refine_budget"), default=REFINE_BUDGET,
                     show_default=True, metavar="SECONDS",
                     help="Solver time of one background refinement (0: none)."),
        click.option("--refine-margin", type=number("refine_margin"),
                     default=REFINE_MARGIN, show_default=True, metavar="FRACTION",
                     help="Switch to a refined plan only if its period is this much shorter."),
        click.option("--run-dir", default=RUN_DIR, show_default=True,
                     type=click.Path(file_okay=False, path_type=Path),
                     help="Checkpoints, worker logs and result.json go here (on a cluster: a "
                          "shared filesystem every host mounts at the same path)."),
        click.option("--backend", type=click.Choice(BACKENDS), default=BACKEND,
                     show_default=True, help="gloo on CPU; nccl on GPUs (one per worker); "
                     "nccl-sim: gloo with NCCL's host semantics, for tests."),
        click.option("--lease", type=number("lease"),
                     default=LEASE, show_default=True, metavar="SECONDS",
                     help="A worker whose heartbeat stops (host gone, process stopped) or "
                          "whose training thread makes no progress this long outside "
                          "communication is dead. Must exceed the longest single op, "
                          "data() included."),
        click.option("--heartbeat", type=number("heartbeat"), default=HEARTBEAT,
                     show_default=True, metavar="SECONDS",
                     help="Seconds between a worker's heartbeats."),
        click.option("--pg-timeout", type=number("pg_timeout"), default=PG_TIMEOUT,
                     show_default=True, metavar="SECONDS",
                     help="Timeout of every process group (a backstop: failures are caught "
                          "by the lease and the groups aborted)."),
        click.option("--bucket-mb", type=number("bucket_mb"),
                     default=BUCKET_MB, show_default=True, metavar="MIB",
                     help="Size of a bucket of a stage's gradient all-reduce: each bucket "
                          "starts as soon as its gradients are final, during the worker's "
                          "last backward op, so smaller buckets overlap more with it."),
        click.option("--undo-copy", type=click.Choice(UNDO_PLACES), default=UNDO_COPY,
                     show_default=True,
                     help="Where the copy that undoes a stage's latest optimizer step lives "
                          "(parameters and optimizer state): host memory (pinned on GPUs) or "
                          "the device (faster to make, costs device memory)."),
        click.option("--grace", type=number("grace"), default=GRACE, show_default=True,
                     metavar="SECONDS",
                     help="On SIGTERM (preemption), stop within this long: every worker "
                          "undoes a half-finished iteration and a consistent checkpoint is "
                          "written, which --resume continues."),
        click.option("--checkpoint-every", type=number("checkpoint_every"),
                     default=CHECKPOINT_EVERY,
                     show_default=True, metavar="ITERATIONS",
                     help="Checkpoint every so many iterations (0: only the final one, and "
                          "one when training has to stop)."),
        click.option("--resume", is_flag=True,
                     help="Continue the run in --run-dir from its latest complete checkpoint "
                          "(a new attempt: its logs go to logs/attempt-N/)."),
        click.option("--start-over", is_flag=True,
                     help="--run-dir holds another run's checkpoints: remove them (and its "
                          "losses and result) and start a new run there. Without it (or "
                          "--resume) such a folder is refused."),
        click.option("--inject-fault", "faults", multiple=True,
                     metavar="RANK:ITER:POINT[:ACTION[:after-step=R,...]]",
                     help="Testing: kill (or hang, stall, take a host down) worker RANK at a "
                          "point of iteration ITER, e.g. 2:3:F1, 1:4:step, 0:5:I0:hang, "
                          "2:3:F0:host-down; 3:3:W3:kill:after-step=4,5 waits until ranks 4 "
                          "and 5 have taken that iteration's step. Repeatable."),
        click.option("--json", "as_json", is_flag=True, help="Print the result as JSON."),
    ]
    return _apply(options, f)


def _rdzv(backend: str, endpoint: str, job: str):
    """The rendezvous options, one definition (choices, defaults, metavar) for `launch` (a
    host agent dials the endpoint) and `coordinator` (it campaigns there): each command's
    help says what the option means for it."""
    options = [
        click.option("--rdzv-backend", type=click.Choice(RDZV_BACKENDS), default=RDZV_BACKEND,
                     show_default=True, help=backend),
        click.option("--rdzv-endpoint", default=None, metavar="HOST:PORT[,HOST:PORT...]",
                     help=endpoint),
        click.option("--rdzv-id", default=RDZV_ID, show_default=True, help=job),
    ]
    return functools.partial(_apply, options)


def _apply(options: list, f):
    """`f` with click `options`, in their order in --help."""
    for option in reversed(options):
        f = option(f)
    return f


def _launch_config(nproc: int, library, run_dir, backend, lease, heartbeat, pg_timeout,
                   checkpoint_every, resume, faults, **more):
    from recycle_planner.executor.control.agent import LaunchConfig
    from recycle_planner.executor.faults import parse_fault
    from recycle_planner.io import check_writable

    check_writable(run_dir, folder=True)  # before any worker starts
    return LaunchConfig(nproc=nproc, run_dir=str(run_dir), backend=backend,
                        heartbeat=heartbeat, lease=lease, pg_timeout=pg_timeout,
                        checkpoint_every=checkpoint_every, resume=resume,
                        library=str(library) if library else None,
                        faults=[parse_fault(f) for f in faults], **more)


def _finish(result, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
        return
    click.echo(result_summary(result))


def _show(as_json: bool):
    def show(event) -> None:
        if not as_json and event.kind != "end":
            click.echo(f"[{event.t:8.3f}s] {event.message}")
    return show


@click.command(context_settings={"ignore_unknown_options": True,
                                 "allow_interspersed_args": False})
@click.argument("target", metavar="JOB")
@click.argument("args", nargs=-1, type=click.UNPROCESSED, metavar="[-- JOB ARGS]...")
@click.option("-n", "--nproc", "--nproc-per-node", "nproc", type=number("nproc"),
              required=True, help="Worker processes on this host (on one machine: pipelines x "
                                  "stages of the plan library).")
@click.option("--nnodes", type=number("nnodes"), default=None,
              help="Hosts of a cluster job: this command then runs this host's agent, which "
                   "starts --nproc-per-node workers and answers to the coordinator at "
                   "--rdzv-endpoint (see 'recycle-planner coordinator').")
@click.option("--node-rank", type=number("node_rank"), default=None,
              help="This host's index (ranks NODE_RANK*NPROC ... are placed here); default: "
                   "in order of arrival at the coordinator.")
@_rdzv(backend="Cluster jobs: c10d, --rdzv-endpoint is the coordinator's store; etcd, it is "
               "etcd's, where coordinators that fail over (see 'recycle-planner "
               "coordinator') publish their store, and this host agent follows the leader, "
               "again after each failover.",
       endpoint="The coordinator's store, or etcd's client endpoints (cluster jobs).",
       job="The job's name at the endpoint (cluster jobs).")
@click.option("--rdzv-timeout", type=number("rdzv_timeout"), default=RDZV_TIMEOUT,
              show_default=True, metavar="SECONDS",
              help="How long a host agent waits for the coordinator at --rdzv-endpoint "
                   "(saying so in its log) before it gives up (cluster jobs).")
@click.option("--master-addr", default="127.0.0.1", show_default=True,
              help="One machine: address of the store the launcher hosts.")
@click.option("--master-port", type=number("master_port"), default=0, show_default=True,
              help="One machine: port of the store (0: any free port).")
@click.option("--restart-delay", type=number("restart_delay"), default=None,
              metavar="SECONDS", help="Restart a dead worker this long after it died; it "
                                      "re-joins at an iteration boundary (default: never).")
@click.option("--max-restarts", type=number("max_restarts"), default=MAX_RESTARTS,
              show_default=True,
              help="Restarts per worker (with --restart-delay).")
@_settings
def launch(target: str, args: tuple[str, ...], nproc: int, nnodes: int | None,
           node_rank: int | None, rdzv_backend: str, rdzv_endpoint: str | None, rdzv_id: str,
           rdzv_timeout: float, master_addr: str,
           master_port: int, restart_delay: float | None, max_restarts: int,
           as_json: bool, **settings) -> None:
    """Train JOB on worker processes and keep training when workers or hosts die.

    JOB is a job factory (FILE.py:FUNCTION or MODULE:FUNCTION returning a
    recycle_planner.executor.Job; words after JOB go to the factory) or a training script
    that calls recycle_planner.executor.run (started like torchrun starts it: RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). A dead worker's micro-batches are
    re-routed to its stage's peers with the library's plan for the new failure set; one
    whose lease expires is declared dead. A failure set the library lacks (beyond its
    threshold, or no library: --spec) is planned on the spot and added to the library, and
    improved in the background. Training stops with a checkpoint (exit status 2) only when a
    stage has no live worker left; an exception in user code stops it too (exit status 2,
    traceback shown once), never re-routed.

    \b
    One machine (the launcher hosts the store):
      recycle-planner launch -n 4 examples/tiny_mlp.py:make_job -- --library plans/
    A cluster (one agent per host; the coordinator runs elsewhere):
      recycle-planner launch --nnodes 2 --nproc-per-node 4 --node-rank 0 \\
          --rdzv-endpoint coord:29400 examples/tiny_mlp.py:make_job -- --library plans/
    A cluster whose coordinators fail over (they campaign on etcd):
      recycle-planner launch --nnodes 2 --nproc-per-node 4 --node-rank 0 \\
          --rdzv-backend etcd --rdzv-endpoint etcd1:2379,etcd2:2379,etcd3:2379 \\
          --rdzv-id job7 examples/tiny_mlp.py:make_job -- --library plans/
    """
    from recycle_planner.executor.control.agent import check_target, launch as run_launch, \
        worker_command

    args = args[1:] if args[:1] == ("--",) else args
    if nnodes is not None or rdzv_endpoint is not None:
        from recycle_planner.errors import RecycleError
        from recycle_planner.executor.control.hostagent import HostAgent, HostConfig

        if nnodes is None or rdzv_endpoint is None:
            raise RecycleError("a cluster job needs both --nnodes and --rdzv-endpoint (the "
                               "coordinator's HOST:PORT)")
        check_target(target)
        if rdzv_backend == "etcd":
            import socket

            from recycle_planner.executor.control import failover

            child = own_command(click.get_current_context(), drop=("rdzv_backend",),
                                rdzv_endpoint=failover.COORDINATOR)
            host = None if node_rank is None else failover.HostRecord(
                node_rank, socket.gethostname(),
                tuple(range(node_rank * nproc, (node_rank + 1) * nproc)))
            sys.exit(_in_etcd(lambda: failover.follow_leader(
                rdzv_endpoint, rdzv_id, settings["lease"], child, rdzv_timeout, host)))
        host = HostAgent(worker_command(target, args), HostConfig(
            nnodes=nnodes, nproc_per_node=nproc, endpoint=rdzv_endpoint, node_rank=node_rank,
            rdzv_id=rdzv_id, max_restarts=max_restarts if restart_delay is not None else 0,
            restart_delay=restart_delay or 0.0, rdzv_timeout=rdzv_timeout,
            successor=failover_successor()), on_event=click.echo)
        sys.exit(host.run())
    config = _launch_config(nproc, master_addr=master_addr, master_port=master_port,
                            restart_delay=restart_delay, max_restarts=max_restarts, **settings)
    result = run_launch(target, config, args, on_event=_show(as_json))
    _finish(result, as_json)


@click.command()
@click.option("--nnodes", type=number("nnodes"), required=True, help="Training hosts.")
@click.option("--nproc-per-node", type=number("nproc"), required=True,
              help="Workers per host (hosts x workers = pipelines x stages of the library).")
@click.option("--port", type=number("port"), default=29400, show_default=True,
              help="Port of the store (listens on every interface of this machine).")
@_rdzv(backend="c10d: this is the job's one coordinator. etcd: run this command on two or "
               "more machines; they campaign on the etcd at --rdzv-endpoint, one leads and "
               "the others stand by; when the leader is lost (killed, cut off) another leads "
               "within --lease and takes over the running workers (--take-over).",
       endpoint="etcd's client endpoints (with --rdzv-backend etcd).",
       job="The job's name on etcd (host agents give the same).")
@click.option("--advertise", default=None, metavar="HOST",
              help="With etcd: the address host agents dial for this coordinator's store "
                   "(default: this machine's name).")
@click.option("--take-over", is_flag=True,
              help="Continue the run in --run-dir whose coordinator was lost, its workers "
                   "still running: wait for the host agents to re-attach and adopt their "
                   "generation (a new attempt; if no host runs one, start again from the "
                   "latest checkpoint). What a coordinator that leads after another runs "
                   "with (--rdzv-backend etcd).")
@click.option("--rdzv-timeout", type=number("rdzv_timeout"), default=RDZV_TIMEOUT,
              show_default=True, metavar="SECONDS",
              help="Taking over: how long to wait for a host whose lease etcd still holds "
                   "to re-attach before its workers count as lost (give the host agents' "
                   "launch the same: they give up on finding a coordinator after it).")
@_settings
def coordinator(nnodes: int, nproc_per_node: int, port: int, rdzv_backend: str,
                rdzv_endpoint: str | None, rdzv_id: str, advertise: str | None, take_over: bool,
                rdzv_timeout: float, as_json: bool, **settings) -> None:
    """Coordinate a cluster job from a machine that does not train.

    Hosts the store, declares a worker dead when its lease expires or its host agent
    reports its exit, decides the plan for every failure set, marks checkpoints complete and
    writes RUN_DIR/result.json. Every training host runs 'recycle-planner launch --nnodes N
    --nproc-per-node K --rdzv-endpoint THIS_HOST:PORT JOB'. If this process is lost, the
    workers stop with a checkpoint; start it again with --resume, then the host agents
    (with --rdzv-backend etcd another coordinator takes over, the workers running).

    \b
      recycle-planner coordinator --nnodes 2 --nproc-per-node 4 --run-dir /shared/run
    Coordinators that fail over (the same command on two machines or more):
      recycle-planner coordinator --nnodes 2 --nproc-per-node 4 --run-dir /shared/run \\
          --rdzv-backend etcd --rdzv-endpoint etcd1:2379,etcd2:2379,etcd3:2379 --rdzv-id job7
    """
    from recycle_planner.executor.control.coordinator import coordinate

    if rdzv_backend == "etcd":
        import socket

        from recycle_planner.executor.control import failover

        if rdzv_endpoint is None:
            raise click.UsageError("--rdzv-backend etcd needs --rdzv-endpoint (etcd's "
                                   "client endpoints)")
        child = own_command(click.get_current_context(),
                            drop=("rdzv_backend", "rdzv_endpoint", "rdzv_id", "advertise"))
        where = f"{advertise or socket.getfqdn()}:{port}"
        sys.exit(_in_etcd(lambda: failover.campaign_and_coordinate(
            rdzv_endpoint, rdzv_id, settings["lease"], where, child)))

    from recycle_planner.executor.control.failover import TAKE_OVER, standby_word

    word = standby_word()  # run by a coordinator that campaigns: loaded, it waits to lead
    if word == "":
        sys.exit(0)  # it never led
    if word == TAKE_OVER:
        settings["resume"], take_over = False, True
    config = _launch_config(nnodes * nproc_per_node, master_port=port, take_over=take_over,
                            rdzv_timeout=rdzv_timeout, **settings)
    result = coordinate(config, nnodes, on_event=_show(as_json))
    _finish(result, as_json)


def failover_successor():
    """Where a host agent run by a follower (`--rdzv-backend etcd`) finds the next leader."""
    from recycle_planner.executor.control.failover import Successor

    return Successor.from_env()


def own_command(ctx: click.Context, drop: tuple[str, ...] = (), **values) -> list[str]:
    """This command's command line rebuilt from what it was given, less the options `drop`
    names, with `values` set: what a wrapper that campaigns on etcd or follows its leader
    runs as its child."""
    words = [sys.executable, "-m", "recycle_planner.cli", ctx.info_name]
    arguments: list[str] = []
    for param in ctx.command.params:
        if param.name in drop or param.name is None:
            continue
        value = values.get(param.name, ctx.params.get(param.name))
        if isinstance(param, click.Argument):
            more = [str(v) for v in value] if param.nargs != 1 else [str(value)]
            if param.nargs == -1 and more:
                arguments += ["--", *(more[1:] if more[0] == "--" else more)]
            else:
                arguments += more
        elif param.name in values or ctx.get_parameter_source(param.name) in (
                click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT):
            words += _option_words(param, value)
    return words + [str(a) for a in arguments]


def _option_words(param: click.Option, value) -> list[str]:
    if param.is_flag:
        return [param.opts[0]] if value else param.secondary_opts[:1]
    if param.multiple:
        return [w for v in value for w in (param.opts[0], str(v))]
    return [param.opts[0], str(value)]


def _in_etcd(run) -> int:
    """`run()`'s exit status, its wrapper's log shown; an etcd that cannot answer is one line
    and exit status 3
    (no decision can be made: the workers stop with a checkpoint, --resume continues)."""
    import logging

    from recycle_planner.executor.control.failover import STORE_UNAVAILABLE, log
    from recycle_planner.executor.control.store import StoreUnavailable

    shown = logging.StreamHandler(sys.stderr)  # who leads, whom a host agent follows
    shown.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log.addHandler(shown)
    log.setLevel(logging.INFO)
    try:
        return run()
    except StoreUnavailable as exc:
        click.echo(f"error: the control store is unavailable: {exc}", err=True)
        return STORE_UNAVAILABLE


def result_summary(result) -> str:
    lines = [f"{result.message}"]
    losses = [l for l in result.losses if l is not None]
    if losses:
        lines.append(f"  loss            {losses[0]:.6g} (first) -> {losses[-1]:.6g} (last)")
    ends = [e for e in result.iteration_end if e is not None]
    if len(ends) > 1:
        lines.append(f"  iterations      {result.iterations}, median step "
                     f"{1e3 * _median_step(ends):.2f} ms")
    lines += predicted_and_measured(result)
    for rec in result.recoveries:
        replanned = rec.replanned_after
        lines.append(f"  recovery        worker {rec.worker} died at {rec.t_death:.3f} s; "
                     + (f"new plan {replanned:.3f} s later, " if replanned is not None else "")
                     + f"iteration {rec.first_iteration} completed {rec.seconds:.3f} s later")
    if result.checkpoint:
        lines.append(f"  checkpoint      {result.checkpoint}")
    lines.append(f"  run folder      {result.run_dir} (result.json, logs/)")
    return "\n".join(lines)


def _median_step(ends: list[float]) -> float:
    steps = sorted(b - a for a, b in zip(ends, ends[1:]))
    return steps[len(steps) // 2]


def predicted_and_measured(result) -> list[str]:
    """Per generation: the plan's predicted period, the same plan re-timed with the op costs
    the run measured (replayed), and the measured step; for a failure also the degradation
    predicted and measured (against the fault-free generation's step). On a CPU shared with
    other work they differ: docs/executor.md, "Predicted and measured", says why."""
    records = result.generations
    base = next((g.measured_ms for g in records if not g.dead and g.measured_ms), None)
    lines = []
    for g in records:
        if g.iterations == 0:
            continue
        dead = ", ".join(f"{d}:{s}" for d, s in g.dead) or "none"
        parts = [f"predicted {g.predicted_ms:.4g} ms"]
        if g.replayed_ms is not None:
            parts.append(f"replayed {g.replayed_ms:.4g} ms")
        if g.measured_ms is not None:
            parts.append(f"measured {g.measured_ms:.4g} ms")
        line = f"  generation {g.gen:<4} dead {dead}: period " + ", ".join(parts)
        if g.dead:
            line += f"; degradation predicted {g.predicted_degradation:+.1%}"
            if base and g.measured_ms is not None:
                line += f", measured {g.measured_ms / base - 1:+.1%}"
        lines.append(line)
    return lines


@click.command()
@click.argument("target", metavar="JOB")
@click.argument("args", nargs=-1, type=click.UNPROCESSED, metavar="[-- JOB ARGS]...")
@click.option("--pipelines", "-d", type=number("pipelines"), required=True,
              help="Data-parallel degree D of the job.")
@click.option("--microbatches", "-m", type=number("microbatches"), required=True,
              help="Micro-batches M per pipeline per iteration.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Job spec (TOML) to write.")
@click.option("--name", default=None, help="Name written into the spec.")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda[:N].")
@click.option("--repeats", type=number("repeats"), default=10, show_default=True,
              help="Timed runs per measurement (the median is kept).")
@click.option("--warmup", type=number("warmup"), default=2, show_default=True)
@click.option("--memory-budget", default=None, metavar="BYTES", help=BYTES_HELP + " per "
              "worker (default: the GPU's memory, or this machine's shared by D x S workers).")
@click.option("--p2p", type=number("p2p"), default=None, metavar="MS",
              help="Point-to-point latency instead of measuring it.")
@click.option("--allreduce", type=number("allreduce"), default=None, metavar="MS",
              help="Gradient all-reduce time instead of measuring it.")
@click.option("--undo-copy", type=click.Choice(UNDO_PLACES), default=UNDO_COPY,
              show_default=True, help="Where the run keeps the copy that undoes a step (as "
              "launch --undo-copy): 'device' adds one copy of the parameters and optimizer "
              "state to the static memory.")
def profile(target: str, args: tuple[str, ...], pipelines: int, microbatches: int,
            output: Path, name: str | None, device: str, repeats: int, warmup: int,
            memory_budget: str | None, p2p: float | None, allreduce: float | None,
            undo_copy: str) -> None:
    """Measure JOB's stages on this machine and write a job spec for the planner.

    Per stage: forward, input-gradient and weight-gradient time, optimizer step, activation
    and static memory; on CPU also point-to-point and all-reduce times between local gloo
    processes. Then: recycle-planner plan-all SPEC -f F -o plans/.

    \b
      recycle-planner profile examples/tiny_mlp.py:make_job -d 2 -m 4 -o tiny.toml
    """
    from recycle_planner.executor.job import load_job
    from recycle_planner.io import check_writable, is_stdout
    from recycle_planner.executor.profile import profile_job
    from recycle_planner.job.profiler import spread_note, write_spec
    from recycle_planner.job.spec import JobSpec

    check_writable(output)  # before minutes of measuring

    budget = None
    if memory_budget is not None:
        probe = JobSpec.from_dict({"stages": 1, "pipelines": 1, "microbatches": 1,
                                   "time": {"forward": 1, "backward_input": 1,
                                            "backward_weight": 0, "p2p": 0, "allreduce": 0,
                                            "optimizer": 0},
                                   "memory": {"activation": 1, "budget": memory_budget}},
                                  "--memory-budget")
        budget = probe.memory.budget
    args = args[1:] if args[:1] == ("--",) else args
    job = load_job(target, args)
    with Ticker(f"profiling {target} on {device}"):
        spec, stages = profile_job(job, pipelines, microbatches, name=name, device=device,
                                   repeats=repeats, warmup=warmup, memory_budget=budget,
                                   p2p=p2p, allreduce=allreduce, undo_copy=undo_copy)
    header = (f"Profiled by recycle-planner profile {target} on {device}\n"
              f"({sys.platform}, {repeats} repeats); times in ms, memory in bytes\n"
              + spread_note(stages))
    write_spec(spec, output, header)
    echo = functools.partial(click.echo, err=is_stdout(output))  # '-o -': the spec on stdout
    echo(f"{'stage':>5} {'F ms':>9} {'I ms':>9} {'W ms':>9} {'opt ms':>9} "
         f"{'p2p ms':>8} {'ar ms':>8} {'activation':>11}")
    for s, st in enumerate(stages):
        echo(f"{s:>5} {st.forward:9.4f} {st.backward_input:9.4f} "
             f"{st.backward_weight:9.4f} {st.optimizer:9.4f} {spec.p2p[s]:8.4f} "
             f"{spec.allreduce[s]:8.4f} {st.activation:>11}")
    if not is_stdout(output):
        echo(f"wrote {output}")
