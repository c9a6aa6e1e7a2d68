"""Checks that must not pass broken files, and the CLI's conventions (issue 14)."""

import json
import subprocess
import sys

import pytest

from conftest import EXAMPLES
from helpers.cli import one_line_error, run

SMALL = str(EXAMPLES / "small.toml")
GPT = str(EXAMPLES / "gpt.toml")


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    base = tmp_path_factory.mktemp("plans")
    for args, name in (([], "ff.json"), (["--fail", "1:2"], "fail.json")):
        r = run("plan", SMALL, *args, "-o", base / name)
        assert r.exit_code == 0, r.output
    r = run("plan-all", SMALL, "-f", "1", "-o", base / "lib", "-j", "1")
    assert r.exit_code == 0, r.output
    return base


def edited(plans, tmp_path, name, change):
    data = json.loads((plans / name).read_text())
    change(data)
    path = tmp_path / f"edited-{name}"
    path.write_text(json.dumps(data))
    return path


def test_validate_checks_the_metrics_against_the_ops(plans, tmp_path):
    path = edited(plans, tmp_path, "fail.json", lambda d: d["metrics"].update(period=1))
    r = run("validate", path)
    assert r.exit_code == 1
    assert "metrics.period is 1 but the ops repeat every" in r.output
    r = run("show", path)
    one_line_error(r, "metrics.period", status=1)
    path = edited(plans, tmp_path, "fail.json", lambda d: d["metrics"].update(degradation=0))
    assert "metrics.degradation is 0" in run("validate", path).output


def test_export_torch_refuses_a_plan_that_breaks_a_rule(plans, tmp_path):
    def drop(d):
        ops = d["workers"][0]["ops"]
        ops.remove(next(o for o in ops if o["kind"] == "F" and o["microbatch"] == 3))

    def swap(d):
        ops = d["workers"][1]["ops"]
        ops[0], ops[1] = ops[1], ops[0]

    for change in (drop, swap):
        path = edited(plans, tmp_path, "ff.json", change)
        r = run("export-torch", path, "-o", tmp_path / "s.csv")
        one_line_error(r, str(path), "not exported", "see 'recycle-planner validate'")
        assert not (tmp_path / "s.csv").exists()


def test_a_plan_without_workers_is_a_clear_error(plans, tmp_path):
    path = edited(plans, tmp_path, "fail.json", lambda d: d.update(workers=[]))
    for args in (["show", path], ["gantt", path, "-o", tmp_path / "g.png"], ["validate", path]):
        one_line_error(run(*args), str(path), "'workers' is empty")
    assert not (tmp_path / "g.png").exists()


def test_lookup_on_a_folder_holding_another_jobs_index(plans, tmp_path):
    other = tmp_path / "other"
    assert run("plan-all", GPT, "-f", "1", "-o", other, "-j", "1", "--solver",
               "heuristic").exit_code == 0
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for p in (plans / "lib").iterdir():
        (mixed / p.name).write_bytes(p.read_bytes())
    (mixed / "index.json").write_bytes((other / "index.json").read_bytes())
    r = run("lookup", mixed, "--fail", "0:1")
    one_line_error(r, "another library's", "gpt-2.7b", "plan-all")


def test_plan_all_does_not_silently_shrink_a_library(plans, tmp_path):
    lib = tmp_path / "lib"
    fast = ("-j", "1", "--solver", "heuristic")
    assert run("plan-all", SMALL, "-f", "2", "-o", lib, *fast).exit_code == 0
    before = sorted(p.name for p in lib.iterdir())
    r = run("plan-all", SMALL, "-f", "1", "-o", lib, *fast)
    one_line_error(r, "up to 2 failures", "would drop", "--force")
    assert sorted(p.name for p in lib.iterdir()) == before
    r = run("plan-all", SMALL, "-f", "1", "-o", lib, *fast, "--force")
    assert r.exit_code == 0, r.output
    index = json.loads((lib / "index.json").read_text())
    assert index["max_failures"] == 1
    files = {e["file"] for e in index["entries"]} | {"index.json"}
    assert {p.name for p in lib.iterdir()} == files  # no plan file left outside the index


@pytest.mark.parametrize("args, words", [
    (["--repair", "0"], ["--repair", "more than zero"]),
    (["--strategies", ""], ["--strategies names none", "reroute"]),
    (["--strategies", " , "], ["--strategies names none"]),
    (["--shape", "0.5"], ["--shape", "--distribution weibull"]),
])
def test_simulate_trace_options_that_would_be_ignored_or_crash(plans, args, words):
    r = run("simulate-trace", SMALL, "--library", plans / "lib", "--mtbf", "1h",
            "--duration", "1d", *args)
    one_line_error(r, *words)


def test_dash_means_standard_output(plans, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run("plan", SMALL, "--fail", "1:2", "-o", "-")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["format"] == "recycle-plan"
    assert "period" in r.stderr  # the summary moves to stderr
    r = run("export-torch", plans / "ff.json", "-o", "-")
    assert r.exit_code == 0 and r.stdout.splitlines()[0].startswith("0F0,0F1")
    r = run("gantt", plans / "ff.json", "-o", "-")
    assert r.exit_code == 0 and r.stdout_bytes.startswith(b"\x89PNG")
    assert list(tmp_path.iterdir()) == []


def test_json_on_plan_show_validate_report(plans, tmp_path):
    r = run("plan", SMALL, "--fail", "1:2", "--json")
    data = json.loads(r.stdout)
    assert data["format"] == "recycle-plan-summary" and data["failed"] == [[1, 2]]
    assert data["metrics"]["period"] > 0
    data = json.loads(run("show", plans / "fail.json", "--json").stdout)
    assert data["metrics"] == json.loads((plans / "fail.json").read_text())["metrics"]
    assert data["critical_path"][0]["kind"] == "F"
    data = json.loads(run("validate", plans / "fail.json", "--json").stdout)
    assert data == {"file": str(plans / "fail.json"), "valid": True, "problems": []}
    path = edited(plans, tmp_path, "fail.json", lambda d: d["metrics"].update(period=1))
    r = run("validate", path, "--json")
    assert r.exit_code == 1 and json.loads(r.stdout)["problems"][0]["rule"] == "metrics"
    data = json.loads(run("report", plans / "lib", "--json").stdout)
    assert data["max_failures"] == 1 and data["rows"][0]["failures"] == 0
    assert len(data["situations"]) == 5


def test_verbose_works_after_the_subcommand_and_plan_logs():
    proc = subprocess.run([sys.executable, "-m", "recycle_planner.cli", "plan", SMALL,
                           "--fail", "1:2", "-v"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "INFO" in proc.stderr and "heuristic" in proc.stderr
    quiet = subprocess.run([sys.executable, "-m", "recycle_planner.cli", "plan", SMALL],
                           capture_output=True, text=True)
    assert quiet.stderr == ""


def test_fail_is_one_name_with_failed_as_a_hidden_alias(plans):
    for cmd in (["plan", SMALL], ["lookup", plans / "lib"]):
        assert "--fail " in run(*cmd[:1], "--help").output
        assert "--failed" not in run(*cmd[:1], "--help").output
        for flag in ("--fail", "--failed"):
            r = run(*cmd, flag, "1:2")
            assert r.exit_code == 0, r.output


def test_numbers_and_counts_read_well(tmp_path):
    spec = tmp_path / "job.toml"
    spec.write_text("stages = 2\npipelines = 1\nmicrobatches = 1\nmicrobatch_size = 4096\n"
                    "[time]\nforward = 0.01\nbackward_input = 0.01\n")
    r = run("plan", spec)
    assert r.exit_code == 0, r.output
    assert "2 stages x 1 pipeline x 1 micro-batch," in r.output
    assert "e+" not in r.output
    assert "peak in-flight  1 micro-batch per worker" in r.output
    throughput = next(l for l in r.output.splitlines() if "throughput" in l)
    assert "," in throughput.split()[1]  # 102,400 samples/s, not 1.024e+05


@pytest.mark.parametrize("args, words", [
    (["plan", SMALL, "--node-limit", "5"], ["--node-limit", "heuristic", "milp"]),
    (["plan", SMALL, "--backend", "pulp-cbc"], ["--backend", "heuristic"]),
    (["plan", SMALL, "--solver", "dp", "--time-limit", "3"], ["--time-limit", "dp"]),
    (["plan-all", SMALL, "-f", "1", "-o", "lib", "--solver", "heuristic", "--node-limit", "9"],
     ["--node-limit", "heuristic"]),
])
def test_solver_options_the_solver_does_not_read_are_errors(args, words, tmp_path,
                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_line_error(run(*args), *words)
    assert list(tmp_path.iterdir()) == []


def test_a_milp_that_kept_the_warm_start_says_so(plans):
    from recycle_planner.files.planfile import read_plan
    from recycle_planner.views.summary import plan_summary

    p = read_plan(plans / "fail.json")
    period = p.metrics.period
    p.solver.update(name="milp", detail="W deferred", milp={
        "status": "Feasible (stopped at the time limit)", "objective": period + 0.25,
        "best_bound": period - 1, "gap": 0.01, "improved": False, "model": {}})
    text = plan_summary(p)
    assert "solver milp: W deferred, the MILP found nothing shorter" in text
    assert (f"objective {period + 0.25:.4g} in its model, its own plan's; the plan kept: "
            f"{period:.4g}") in text


def test_legends_say_what_the_letters_are(plans):
    r = run("show", plans / "fail.json")
    legend = next(line for line in r.output.splitlines() if line.startswith("legend:"))
    assert "F=forward" in legend and "W=weight gradient" in legend and "F=F" not in legend
