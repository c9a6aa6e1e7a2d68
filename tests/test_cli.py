import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from recycle_planner.cli.main import main

from conftest import EXAMPLES

SMALL = str(EXAMPLES / "small.toml")
GPT = str(EXAMPLES / "gpt.toml")


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result


def test_help_teaches():
    out = run("--help").output
    assert "re-routed" in out and "Typical session" in out
    for cmd in ("plan", "show", "gantt", "validate", "export-torch"):
        assert cmd in out
    plan_help = run("plan", "--help").output
    for flag in ("--fail", "--schedule", "--decouple / --no-decouple", "--stagger / --no-stagger"):
        assert flag in plan_help


def test_plan_show_validate_gantt_export(tmp_path):
    ff, fail = tmp_path / "ff.json", tmp_path / "fail.json"
    r = run("plan", SMALL, "-o", ff)
    assert r.exit_code == 0, r.output
    r = run("plan", SMALL, "--fail", "1:2", "-o", fail)
    assert r.exit_code == 0, r.output
    assert "failed: 1:2" in r.output and "degradation" in r.output and "lower bound" in r.output
    data = json.loads(fail.read_text())
    assert data["failed"] == [[1, 2]] and data["format"] == "recycle-plan"
    r = run("show", fail)
    assert r.exit_code == 0 and "p1 s2 |xxxx" in r.output and "critical path" in r.output
    assert any(c in r.output for c in "fiw")  # re-routed work in lower case
    r = run("validate", fail)
    assert r.exit_code == 0 and "valid" in r.output
    for ext in ("png", "svg", "pdf"):
        r = run("gantt", fail, "-o", tmp_path / f"g.{ext}", "--compare", ff)
        assert r.exit_code == 0, r.output
        assert (tmp_path / f"g.{ext}").stat().st_size > 1000
    r = run("export-torch", ff, "-o", tmp_path / "s.csv")
    assert r.exit_code == 0
    assert (tmp_path / "s.csv").read_text().splitlines()[0].startswith("0F0,0F1")


def test_policies_and_schedules(tmp_path):
    for args in (["--no-decouple", "--no-stagger"], ["--schedule", "zb-h1"], ["--schedule", "gpipe"]):
        r = run("plan", SMALL, "--fail", "0:1", *args)
        assert r.exit_code == 0, r.output


def test_validate_reports_broken_plan_with_status_1(tmp_path):
    path = tmp_path / "p.json"
    run("plan", SMALL, "--fail", "1:2", "-o", path)
    data = json.loads(path.read_text())
    data["workers"][0]["ops"][5]["start"] -= 0.5
    path.write_text(json.dumps(data))
    r = run("validate", path)
    assert r.exit_code == 1
    assert "overlap" in r.output or "duration" in r.output


@pytest.mark.parametrize("args, message", [
    (["plan", SMALL, "--fail", "9:0"], "outside the grid"),
    (["plan", SMALL, "--fail", "0:1", "--fail", "1:1"], "every worker of stage 1 is dead"),
    (["plan", SMALL, "--fail", "0:1", "--fail", "0:1"], "listed twice"),
    (["plan", SMALL, "--fail", "one"], "not PIPELINE:STAGE"),
    (["plan", SMALL, "--schedule", "zb-h1", "--no-decouple"], "needs the I/W split"),
    (["plan", "missing.toml"], "cannot read spec"),
    (["show", "missing.json"], "cannot read plan file"),
    (["plan", SMALL, "--schedule", "zb-h2"], "Invalid value"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    r = run(*args)
    assert r.exit_code == 2, r.output
    assert message in r.output
    assert "Traceback" not in r.output


def test_export_of_failure_plan_is_refused_and_leaves_nothing(tmp_path):
    path = tmp_path / "p.json"
    run("plan", SMALL, "--fail", "1:2", "-o", path)
    r = run("export-torch", path, "-o", tmp_path / "out.csv")
    assert r.exit_code == 2 and "needs a fault-free plan" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


def test_bad_output_folder_leaves_nothing(tmp_path):
    r = run("plan", SMALL, "-o", tmp_path / "no" / "such" / "dir" / "p.json")
    assert r.exit_code == 2 and "does not exist" in r.output
    r = run("plan", SMALL, "-o", tmp_path / "p.json")
    r = run("gantt", tmp_path / "p.json", "-o", tmp_path / "p.bmp")
    assert r.exit_code == 2 and "unknown picture format" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


def test_outputs_are_checked_before_the_work(tmp_path):
    lib = tmp_path / "lib"
    assert run("plan-all", SMALL, "-f", "1", "-o", lib, "-j", "1").exit_code == 0
    r = run("report", lib, "-o", tmp_path / "deg.txt")
    assert r.exit_code == 2 and "unknown picture format" in r.output
    assert "situations" not in r.output  # refused before printing the report
    r = run("plan", SMALL, "-o", tmp_path / "nowhere" / "p.json")
    assert r.exit_code == 2 and "period" not in r.output


def test_show_refuses_the_critical_path_of_a_broken_plan(tmp_path):
    path = tmp_path / "p.json"
    run("plan", SMALL, "--fail", "1:2", "-o", path)
    data = json.loads(path.read_text())
    data["workers"][0]["ops"].insert(1, dict(data["workers"][0]["ops"][0]))
    path.write_text(json.dumps(data))
    r = run("show", path)
    assert r.exit_code == 1 and "no critical path" in r.output and "duplicate-op" in r.output
    assert "Traceback" not in r.output


def test_schedule_choice_is_kept(tmp_path):
    """--schedule gpipe exports GPipe's forward-first order; a 1F1B job's fault-free plan keeps
    its policy label even when its order is ZB-H1's."""
    run("plan", SMALL, "--schedule", "gpipe", "-o", tmp_path / "g.json")
    run("export-torch", tmp_path / "g.json", "-o", tmp_path / "g.csv")
    first = (tmp_path / "g.csv").read_text().splitlines()[0].split(",")
    assert all(a[1] == "F" for a in first[:8]), first
    run("plan", SMALL, "-o", tmp_path / "o.json")
    data = json.loads((tmp_path / "o.json").read_text())
    assert data["policy"]["schedule"] == "1f1b"
    assert json.loads((tmp_path / "g.json").read_text())["policy"]["schedule"] == "gpipe"


def test_console_script_error_has_no_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("stages = 4\npipelines = 2\nmicrobatches = 8\n[time]\nforward = 1\n")
    proc = subprocess.run([sys.executable, "-m", "recycle_planner.cli", "plan", str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {bad}: missing key 'time.backward_input'"]
    assert proc.stdout == ""
