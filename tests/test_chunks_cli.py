"""The planner's commands on a job whose workers hold several chunks: plan, show, validate,
gantt, export-torch, plan-all, lookup, report and simulate-trace take it; program and launch
refuse it in one line (the executor runs one chunk per worker)."""

import json

import pytest
from click.testing import CliRunner

from recycle_planner.cli.main import main
from recycle_planner.errors import RecycleError
from recycle_planner.executor.control.agent import LaunchConfig, prepare_library

SPEC = """\
name = "interleaved"
stages = 3
pipelines = 3
microbatches = 6
chunks = 2
layout = "LAYOUT"
[time]
forward = 1
backward_input = 1
backward_weight = 1
p2p = 0.1
allreduce = 1
optimizer = 0.5
"""


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module", params=["interleaved", "v"])
def job(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    spec = folder / "job.toml"
    spec.write_text(SPEC.replace("LAYOUT", request.param))
    run("plan-all", spec, "--max-failures", 2, "-o", folder / "lib")
    return folder, spec, request.param


def test_plan_show_validate_and_gantt(job):
    folder, spec, layout = job
    out = run("plan", spec, "--fail", "1:0", "-o", folder / "fail.json")
    assert "2 chunks per worker" in out and "micro-batch chunks per worker" in out
    run("plan", spec, "-o", folder / "ff.json")
    assert "c1" in run("show", folder / "fail.json")
    assert "valid" in run("validate", folder / "fail.json")
    run("gantt", folder / "fail.json", "-o", folder / "fail.png", "--compare", folder / "ff.json")
    assert (folder / "fail.png").stat().st_size > 10_000
    run("export-torch", folder / "ff.json", "-o", folder / "ff.csv")
    first = (folder / "ff.csv").read_text().splitlines()[0].split(",")
    assert {a[0] for a in first} == ({"0", "5"} if layout == "v" else {"0", "3"})


def test_library_lookup_report_and_trace(job):
    folder, spec, _ = job
    hit = json.loads(run("lookup", folder / "lib", "--fail", "2:1", "--fail", "0:2", "--json"))
    assert hit["file"]
    assert "failures" in run("report", folder / "lib")
    out = run("simulate-trace", spec, "--library", folder / "lib", "--mtbf", "30min",
              "--duration", "1d", "--json")
    assert json.loads(out)["format"] == "recycle-whatif"


def test_program_and_launch_refuse_chunked_plans(job):
    folder, _, _ = job
    result = CliRunner().invoke(main, ["program", str(folder / "lib"), "-o",
                                       str(folder / "programs")])
    assert result.exit_code == 2 and "one chunk per worker" in result.output
    with pytest.raises(RecycleError, match="gives each worker 2 model chunks; launch runs one"):
        prepare_library(LaunchConfig(nproc=9, library=str(folder / "lib"),
                                     run_dir=str(folder / "run")))
