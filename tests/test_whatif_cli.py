"""`recycle-planner simulate-trace`: tables, files, JSON, and bad input as one line."""

import json

import pytest
from click.testing import CliRunner

from recycle_planner.cli.main import main
from recycle_planner.whatif.engine import STRATEGIES

from conftest import EXAMPLES

GPT = str(EXAMPLES / "gpt.toml")
SMALL = str(EXAMPLES / "small.toml")
TRACE = str(EXAMPLES / "trace.csv")
# Bad values of the host, policy and cost options (issue 12), checked with the others below.
OPTION_ERRORS = [
    (["--mtbf", "2h", "--workers-per-host", 3], "--workers-per-host 3 does not divide the "
                                                "job's 32 workers"),
    (["--mtbf", "2h", "--workers-per-host", 0], "--workers-per-host': 0 is out of range"),
    (["--mtbf", "2h", "--baseline-policy", "1f1b/fused"], "--baseline-policy: policy "
                                                          "'1f1b/fused' is not SCHEDULE/"),
    (["--mtbf", "2h", "--baseline-policy", "zz/fused/barrier"], "unknown schedule 'zz'"),
    (["--mtbf", "2h", "--bandwidth", "12GB"], "--bandwidth: '12GB' is not a bandwidth"),
    (["--mtbf", "2h", "--parameter-bytes", "lots"], "--parameter-bytes: 'lots' is not a size"),
    (["--mtbf", "2h", "--plan-time", "soon"], "--plan-time: 'soon' is not a duration"),
    (["--mtbf", "2h", "--host-placement", "rack"], "unknown host placement 'rack' (expected "
                                                   "one of: pipeline, stage)"),
]


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def gpt_library(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt-plans")
    r = run("plan-all", GPT, "--max-failures", 2, "-o", folder, "--jobs", 1,
            "--solver", "heuristic")
    assert r.exit_code == 0, r.output
    return folder


def test_help_names_every_strategy():
    out = run("simulate-trace", "--help").output
    for name in STRATEGIES:
        assert name in out
    assert "simulate-trace" in run("--help").output


def test_trace_file_table_and_assumptions(gpt_library, tmp_path):
    r = run("simulate-trace", GPT, "--library", gpt_library, "--trace", TRACE,
            "--duration", "1d", "-o", tmp_path / "out", "--plot-format", "svg")
    assert r.exit_code == 0, r.output
    out = r.output
    assert "fault-free: period 501.4 ms, 255.3 samples/s" in out
    for title in ("re-routing (ReCycle)", "checkpoint-restart, spares",
                  "checkpoint-restart, no spares", "drop pipelines", "Oobleck-style",
                  "Bamboo-style"):
        assert out.count(title) >= 2  # a row of the table and a block of assumptions
    assert "assumptions" in out and "fell back to a checkpoint restart 1 time(s)" in out
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["throughput-trace.svg", "whatif.json"]
    data = json.loads((tmp_path / "out" / "whatif.json").read_text())
    assert data["format"] == "recycle-whatif" and data["version"] == 2
    assert data["runs"][0]["trace"]["failures"] == 7
    assert {s["name"] for s in data["strategies"]} == set(STRATEGIES)
    assert all(s["assumptions"] for s in data["strategies"])


def test_frequencies_table_plots_and_json(gpt_library, tmp_path):
    r = run("simulate-trace", GPT, "-l", gpt_library, "--mtbf", "6h,30min", "--duration", "2d",
            "--seed", 5, "--strategies", "reroute,checkpoint-wait", "-o", tmp_path)
    assert r.exit_code == 0, r.output
    assert "every 6h" in r.output and "every 30min" in r.output
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["frequencies.png", "throughput-every-30min.png", "throughput-every-6h.png",
                     "trace-every-30min.csv", "trace-every-6h.csv", "whatif.json"]
    assert all((tmp_path / n).stat().st_size > 10_000 for n in names if n.endswith(".png"))
    r = run("simulate-trace", GPT, "-l", gpt_library, "--mtbf", "6h,30min", "--duration", "2d",
            "--seed", 5, "--strategies", "reroute,checkpoint-wait", "--plan-time", "1s", "--json")
    data = json.loads(r.stdout)
    rel = [[x["relative"] for x in run_["results"]] for run_ in data["runs"]]
    assert all(0 < v <= 1 for row in rel for v in row)
    # The sampled trace written out replays to the same numbers.
    r2 = run("simulate-trace", GPT, "-l", gpt_library, "--trace",
             tmp_path / "trace-every-6h.csv", "--duration", "2d",
             "--strategies", "reroute,checkpoint-wait", "--plan-time", "1s", "--json")
    again = json.loads(r2.stdout)["runs"][0]["results"]
    assert [x["samples"] for x in again] == pytest.approx(
        [x["samples"] for x in data["runs"][0]["results"]], rel=1e-9)


@pytest.mark.parametrize("args, message", OPTION_ERRORS + [
    (["--mtbf", "2h", "--trace", TRACE], "not both"),
    ([], "give either --trace"),
    (["--mtbf", "2x"], "--mtbf: unknown unit 'x'"),
    (["--mtbf", "2h", "--detect", "5m"], "--detect: unit 'm' in '5m' is ambiguous"),
    (["--mtbf", "2h", "--checkpoint-interval", "0s"], "must be more than zero"),
    (["--mtbf", "2h", "--strategies", "reroute,magic"], "unknown strategy 'magic'"),
    (["--trace", "missing.csv"], "cannot read trace"),
])
def test_bad_input_is_one_line(gpt_library, args, message):
    r = run("simulate-trace", GPT, "--library", gpt_library, *args)
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_library_of_another_spec_is_refused(gpt_library, tmp_path):
    r = run("simulate-trace", SMALL, "--library", gpt_library, "--mtbf", "2h")
    assert r.exit_code == 2 and "built for another spec" in r.output
    r = run("simulate-trace", GPT, "--library", tmp_path, "--mtbf", "2h")
    assert r.exit_code == 2 and "no plan library here" in r.output


def test_bad_trace_line_is_named(gpt_library, tmp_path):
    bad = tmp_path / "t.csv"
    bad.write_text("time,event,worker\n1h,fail,9:0\n")
    r = run("simulate-trace", GPT, "--library", gpt_library, "--trace", bad)
    assert r.exit_code == 2
    assert r.output.strip() == f"error: {bad} line 2: unknown worker 9:0 (the job has 4 " \
                               f"pipelines x 8 stages)"


def test_host_failures_baseline_policy_and_on_demand_plans(gpt_library, tmp_path):
    """Hosts of 4 workers fail every 2 h over 2 days, every baseline on plain 1F1B: the trace
    is written with host lines and replays to the same numbers; the JSON says what each
    strategy ran and what planning was charged."""
    common = ["--workers-per-host", 4, "--baseline-policy", "1f1b/fused/barrier",
              "--plan-time", "2s", "--strategies", "reroute,reroute-library-only,oobleck"]
    r = run("simulate-trace", GPT, "-l", gpt_library, "--mtbf", "2h", "--duration", "2d",
            "--seed", 1, "-o", tmp_path, "--json", *common)
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["policy"]["decouple"] is False and data["library_policy"]["decouple"] is True
    names = {s["name"]: s for s in data["strategies"]}
    assert names["reroute"]["policy_label"] == "1f1b/split/staggered"
    assert names["oobleck"]["policy_label"] == "1f1b/fused/barrier"
    assert all(v["charged_s"] == 2.0 for v in names["reroute"]["on_demand"].values())
    run0 = data["runs"][0]
    assert run0["trace"]["hosts"] == {"workers_per_host": 4, "placement": "pipeline", "hosts": 8}
    assert run0["trace"]["worker_failures"] == 4 * run0["trace"]["failures"]
    results = {x["strategy"]: x for x in run0["results"]}
    assert results["reroute"]["planned_on_demand"] >= 1  # a host is 4 dead: beyond 2
    assert results["reroute"]["planning_s"] == 2.0 * results["reroute"]["planned_on_demand"]
    assert results["reroute-library-only"]["fallbacks"] >= 1
    assert "host:" in (tmp_path / "trace-every-2h.csv").read_text()
    r2 = run("simulate-trace", GPT, "-l", gpt_library, "--trace", tmp_path / "trace-every-2h.csv",
             "--duration", "2d", "--json", *common)
    assert r2.exit_code == 0, r2.output
    again = json.loads(r2.stdout)["runs"][0]["results"]
    assert [x["samples"] for x in again] == pytest.approx(
        [x["samples"] for x in run0["results"]], rel=1e-9)
