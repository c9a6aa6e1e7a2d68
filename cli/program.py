"""`recycle-planner program`: every live rank's program of a plan, as files a launcher reads."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import click

from recycle_planner.cli.progress import Ticker
from recycle_planner.errors import RecycleError

log = logging.getLogger("recycle_planner.programs")

EPILOG = """\b
Examples:
  recycle-planner plan-all examples/small.toml -f 1 -o plans/
  recycle-planner program plans/ --fail 1:2 -o programs/
  recycle-planner program plans/ -o ff-programs/          # fault-free: also torch's CSVs
  recycle-planner program fail.json -o programs/          # a plan file (its dead workers)

A rank reads programs/programs.json and its own rank-NNNN.json (ranks are pipeline-major:
pipeline * stages + stage); recycle_planner.programs.files.read_program checks both. See
docs/programs.md, "Using the plans from your own launcher".
"""


@click.command("program", epilog=EPILOG)
@click.argument("source", type=click.Path(exists=True, path_type=Path),
                metavar="LIBRARY|PLAN")
@click.option("--fail", "fail", multiple=True, metavar="PIPELINE:STAGE",
              help="A dead physical worker (with a LIBRARY); repeat for several.")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Folder for programs.json, one rank-NNNN.json per live rank and, for a "
                   "fault-free plan, torch's compute_comms CSV of each pipeline.")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
def program(source: Path, fail: tuple[str, ...], output: Path, as_json: bool) -> None:
    """Write the program of every live rank: its compute, the ranks it receives from and sends
    to in an order that is safe on NCCL, its stage's all-reduce and optimizer step.

    LIBRARY|PLAN is a plan library (with the dead workers as --fail) or a plan file (whose dead
    workers are the physical ones). The plan is replayed under NCCL's rules first.
    """
    from recycle_planner.files.export_torch import export_torch_comms_csv
    from recycle_planner.io import check_writable
    from recycle_planner.library.hashing import file_sha256
    from recycle_planner.programs import rank_orders
    from recycle_planner.programs.check import require_safe
    from recycle_planner.programs.files import torch_csv, write_programs

    check_writable(output, folder=True)
    with Ticker("writing programs"):
        t0 = time.perf_counter()
        log.info("reading the plan")
        plan, mapping, file, dead = _plan(source, fail)
        t1 = time.perf_counter()
        log.info("compiling every rank's program")
        orders = rank_orders(plan, mapping)
        t2 = time.perf_counter()
        log.info("replaying them under NCCL's rules")
        require_safe(orders)  # a library built by an older version was never checked
        t3 = time.perf_counter()
        log.info("writing %d program files", len(orders.ranks))
        programs = orders.programs()
        spec = plan.spec
        output.mkdir(parents=True, exist_ok=True)
        csvs = []
        if not plan.failed:
            for d in range(spec.pipelines):
                name = torch_csv(d)
                export_torch_comms_csv([programs[d * spec.stages + s]
                                        for s in range(spec.stages)], output / name)
                csvs.append(name)
        header = {"job": spec.to_dict(), "policy": plan.policy.to_dict(),
                  "dead": [list(w) for w in dead],
                  "plan": {"file": str(file), "sha256": file_sha256(Path(file)),
                           "period": plan.metrics.period},
                  "nccl_check": "serial", "torch_csv": csvs}
        manifest = write_programs(output, programs, header)
        t4 = time.perf_counter()
    size = sum((output / r["file"]).stat().st_size for r in manifest["ranks"])
    summary = {"format": "recycle-programs-summary", "version": 1, "folder": str(output),
               "ranks": len(programs), "bytes": size, "torch_csv": csvs,
               "seconds": {"read": round(t1 - t0, 3), "compile": round(t2 - t1, 3),
                           "check": round(t3 - t2, 3), "write": round(t4 - t3, 3)}}
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    click.echo(f"wrote the programs of {len(programs):,} ranks to {output}/ "
               f"({size / 2**20:.1f} MiB; plan read in {t1 - t0:.2f} s, programs compiled in "
               f"{t2 - t1:.2f} s, NCCL order checked in {t3 - t2:.2f} s, written in "
               f"{t4 - t3:.2f} s)")
    if csvs:
        click.echo(f"fault-free: torch compute_comms CSVs {csvs[0]} .. {csvs[-1]}")


def _plan(source: Path, fail: tuple[str, ...]):
    """The plan of a library's dead set (physical `fail`) or of a plan file, with its mapping,
    file and physical dead workers."""
    from recycle_planner.files.planfile import read_plan
    from recycle_planner.job.workers import parse_worker
    from recycle_planner.library import PlanLibrary

    if source.is_dir():
        dead = sorted(parse_worker(f) for f in fail)
        hit = PlanLibrary.open(source).lookup(dead)
        return hit.plan(), hit.mapping, hit.file, dead
    if fail:
        raise RecycleError(f"{source}: a plan file names its own dead workers: drop --fail or "
                           f"give a library")
    plan = read_plan(source)
    return plan, None, source, list(plan.failed)
