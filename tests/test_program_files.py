"""`recycle-planner program`: the program files a launcher reads are versioned, checked against
the manifest's SHA-256s and refused in one line when edited, truncated or foreign."""

import json
import re

import pytest
from click.testing import CliRunner

from recycle_planner.cli.main import main
from recycle_planner.errors import PlanFileError
from recycle_planner.job.policy import Policy
from recycle_planner.library import PlanLibrary, Settings, build_library
from recycle_planner.programs import compile_program, lookup_program
from recycle_planner.programs.files import MANIFEST, read_manifest, read_program

from conftest import make_spec


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lib")
    build_library(make_spec(stages=3, pipelines=2, microbatches=4), Policy(), 1, folder,
                  Settings(solver="heuristic"), jobs=1)
    return folder


def one_line_error(result, *words):
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
    for word in words:
        assert word in result.output, result.output


def test_every_live_rank_gets_its_program_and_the_manifest_says_what_was_written(library,
                                                                                   tmp_path):
    out = tmp_path / "programs"
    r = run("program", library, "--fail", "1:1", "-o", out)
    assert r.exit_code == 0, r.output
    assert "wrote the programs of 5 ranks" in r.output and "NCCL order checked" in r.output
    manifest = read_manifest(out)
    assert (manifest["format"], manifest["version"], manifest["dead"]) == (
        "recycle-programs", 1, [[1, 1]])
    assert [e["rank"] for e in manifest["ranks"]] == [0, 1, 2, 3, 5]
    assert manifest["torch_csv"] == [] and manifest["nccl_check"] == "serial"
    hit = PlanLibrary.open(library).lookup([(1, 1)])
    assert manifest["plan"]["file"] == str(hit.file)
    assert lookup_program(PlanLibrary.open(library), [(1, 1)], 5) == read_program(out, 5)
    for rank in (0, 1, 2, 3, 5):
        assert read_program(out, rank) == compile_program(hit.plan(), rank, hit.mapping)
    with pytest.raises(PlanFileError, match="rank 4 has no program"):
        read_program(out, 4)
    first = json.loads((out / "rank-0000.json").read_text())
    assert (first["format"], first["version"], first["loss_scale"], first["reduce"]) == (
        "recycle-program", 1, 1 / 8, "sum")

    # The fault-free plan into the same folder: rank 4 lives again, torch's CSVs come along.
    r = run("program", library, "-o", out, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["torch_csv"] == ["torch-pipeline-0.csv", "torch-pipeline-1.csv"]
    assert read_program(out, 4).rank == 4
    assert (out / "torch-pipeline-1.csv").read_text().startswith("0F0,0SEND_F0")
    # ... and a failure plan again: the dead rank's file goes, the CSVs too.
    assert run("program", library, "--fail", "0:2", "-o", out).exit_code == 0
    assert not (out / "rank-0002.json").exists() and not (out / "torch-pipeline-0.csv").exists()


def test_an_edited_truncated_or_foreign_file_is_refused_in_one_line(library, tmp_path):
    out = tmp_path / "programs"
    assert run("program", library, "--fail", "0:0", "-o", out).exit_code == 0
    path = out / "rank-0001.json"
    good = path.read_text()
    path.write_text(re.sub(r'"peer":(\d+)', lambda m: f'"peer":{int(m[1]) ^ 1}', good,
                           count=1))  # still valid JSON
    with pytest.raises(PlanFileError, match="has changed since it was written") as info:
        read_program(out, 1)
    path.write_text(good[: len(good) // 2])
    with pytest.raises(PlanFileError, match="has changed since it was written"):
        read_program(out, 1)
    path.write_text(good)
    assert read_program(out, 1).rank == 1
    manifest = (out / MANIFEST).read_text()
    (out / MANIFEST).write_text(manifest[:100])
    with pytest.raises(PlanFileError, match="truncated or not JSON"):
        read_program(out, 1)
    (out / MANIFEST).write_text(manifest.replace('"version":1', '"version":7', 1))
    with pytest.raises(PlanFileError, match="version 7 is not supported"):
        read_program(out, 1)
    (out / MANIFEST).write_text(manifest.replace("rank-0001.json", "rank-0003.json", 1))
    with pytest.raises(PlanFileError, match="has changed since it was written"):
        read_program(out, 1)
    (out / MANIFEST).unlink()
    with pytest.raises(PlanFileError, match="no programs here") as info:
        read_program(out, 1)
    assert "\n" not in str(info.value)


def test_bad_input_is_one_line(library, tmp_path):
    plan = tmp_path / "fail.json"
    assert run("plan", tmp_path / "none.toml").exit_code == 2
    spec = tmp_path / "job.toml"
    spec.write_text("stages = 3\npipelines = 2\nmicrobatches = 4\n[time]\nforward = 1\n"
                    "backward_input = 1\nbackward_weight = 1\n")
    assert run("plan", spec, "--fail", "1:2", "-o", plan).exit_code == 0
    one_line_error(run("program", plan, "--fail", "0:0", "-o", tmp_path / "p"),
                   "names its own dead workers")
    r = run("program", plan, "-o", tmp_path / "p")
    assert r.exit_code == 0 and read_manifest(tmp_path / "p")["dead"] == [[1, 2]]
    one_line_error(run("program", library, "--fail", "0:1", "--fail", "1:1", "-o",
                       tmp_path / "q"), "every worker of stage 1 is dead")
    one_line_error(run("program", library, "--fail", "9:1", "-o", tmp_path / "q"),
                   "outside the grid")
    (tmp_path / "file").write_text("")
    one_line_error(run("program", library, "-o", tmp_path / "file" / "x"), "not a folder")
