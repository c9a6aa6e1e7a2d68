"""Issue 25: the tool under misuse. Every number a subcommand takes refuses NaN, infinity and
values out of range; every file it reads refuses hostile content; usage errors, broken pipes,
unread options and JSON specs behave as the README promises."""

import gzip
import json
import os
import subprocess
import sys

import click
import pytest
from click.types import _NumberParamTypeBase

from conftest import EXAMPLES, ROOT
from helpers.cli import one_line_error, run
from recycle_planner.cli.main import main
from recycle_planner.cli.options import Number

SMALL = str(EXAMPLES / "small.toml")
SCRIPT = str(ROOT / ".venv" / "bin" / "recycle-planner")


def numeric_options():
    for name, command in sorted(main.commands.items()):
        for param in command.params:
            if isinstance(param, click.Option) and isinstance(param.type, Number):
                yield name, param


def test_every_number_option_has_a_range_from_limits():
    """No subcommand takes a number through click's own int or float types, which accept NaN
    and infinity: each is a `Number` whose range lives in recycle_planner/limits.py."""
    plain = [(name, p.name) for name, command in main.commands.items() for p in command.params
             if isinstance(p.type, _NumberParamTypeBase) and not getattr(p, "count", False)]
    assert plain == []
    assert len(list(numeric_options())) >= 40


def bad_values(rng):
    values = ["nan", "inf", "-inf", "1e999", "NaN", repr(rng.high * 10 + 1)]
    values.append(repr(rng.low) if rng.low_open else repr(rng.low - 1))
    if rng.integer:
        values.append("1.5")
    return values


@pytest.mark.parametrize("name, param", list(numeric_options()),
                         ids=lambda x: x if isinstance(x, str) else x.opts[-1])
def test_every_number_option_refuses_nan_infinity_and_out_of_range(name, param):
    for value in bad_values(param.type.range):
        r = run(name, param.opts[-1], value)
        one_line_error(r, param.opts[0], f"(see 'main {name} --help')")


def test_usage_errors_are_one_line():
    one_line_error(run("plan", SMALL, "--widht", "3"), "No such option '--widht'",
                   "(see 'main plan --help')")
    one_line_error(run("plam"), "No such command 'plam'", "Did you mean 'plan'?")
    one_line_error(run("plan"), "Missing argument 'SPEC'")


def test_prove_and_work_limit_with_a_solver_that_does_not_read_them_are_refused():
    one_line_error(run("plan", SMALL, "--prove"), "--prove is not read by the heuristic")
    one_line_error(run("plan", SMALL, "--solver", "dp", "--work-limit", "3"),
                   "--work-limit is not read by the dp")
    assert run("plan", SMALL, "--solver", "cp", "--prove", "--work-limit", "0.5").exit_code == 0


def test_a_json_spec_is_read_like_its_toml(tmp_path):
    """`--spec` and `plan` say TOML or JSON: a JSON object with the TOML keys is a spec."""
    from recycle_planner.job.spec import load_spec

    data = load_spec(SMALL).to_dict()
    for name in ("job.json", "job.spec"):  # by its name, or by its first character
        (tmp_path / name).write_text(json.dumps(data, indent=1))
        assert load_spec(tmp_path / name) == load_spec(SMALL)
    (tmp_path / "list.json").write_text("[1, 2]")
    one_line_error(run("plan", tmp_path / "list.json"), "list.json", "object of the TOML keys")


HOSTILE = {
    "deep": "[" * 100_000 + "]" * 100_000,
    "deep-but-parsed": '{"a":' * 200 + "1" + "}" * 200,
    "huge-float": '{"format": "recycle-plan", "version": 1e999}',
    "huge-int": '{"format": "recycle-plan", "version": ' + "9" * 5000 + "}",
    "nan": '{"format": "recycle-plan", "version": NaN}',
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_files_are_one_line(tmp_path, kind):
    """Every file the tool reads: a plan (also gzipped), a library index, a JSON or TOML
    spec."""
    text = HOSTILE[kind]
    plan, packed, spec = tmp_path / "p.json", tmp_path / "p.json.gz", tmp_path / "s.json"
    plan.write_text(text)
    packed.write_bytes(gzip.compress(text.encode()))
    spec.write_text(text if text.startswith("{") else "{}" + text)
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "index.json").write_text(text)
    for args in (["show", plan], ["validate", packed], ["gantt", plan, "-o", tmp_path / "g.png"],
                 ["lookup", lib], ["report", lib], ["plan", spec]):
        one_line_error(run(*args), str(args[1]))
    toml = tmp_path / "s.toml"
    for body, words in (("a = " + "[" * 100_000 + "]" * 100_000, "nested"),
                        ("a = " + "9" * 5000, "too large"),
                        ("a = " + "{b = " * 300 + "1" + "}" * 300, "nested")):
        toml.write_text(body)
        one_line_error(run("plan", toml), str(toml), words)


def test_a_decompression_bomb_is_one_line(tmp_path, monkeypatch):
    import recycle_planner.io as io

    monkeypatch.setattr(io, "MAX_BYTES", 1 << 20)
    bomb = tmp_path / "p.json.gz"
    bomb.write_bytes(gzip.compress(b" " * (2 << 20) + b"{}"))
    one_line_error(run("show", bomb), str(bomb), "expands to more than")


def closed_pipe_run(*args):
    """Run the command with standard output a pipe whose reader is already gone, as
    `... | head -1` becomes once head has its line."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "recycle_planner.cli", *map(str, args)],
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)


def test_a_closed_pipe_ends_quietly_like_a_unix_tool(tmp_path):
    plan = tmp_path / "p.json"
    assert run("plan", SMALL, "--fail", "1:2", "-o", plan).exit_code == 0
    for args in (["show", plan], ["gantt", plan, "-o", "-"], ["plan", SMALL, "-o", "-"],
                 ["--help"]):
        proc = closed_pipe_run(*args)
        assert proc.returncode == 141, (args, proc.stderr)
        assert "error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def edited(tmp_path, plan, name, change):
    data = json.loads(plan.read_text())
    change(data["workers"][0]["ops"])
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_a_plan_with_an_op_moved_is_named_by_show_and_refused_by_gantt(tmp_path):
    plan = tmp_path / "p.json"
    assert run("plan", SMALL, "--fail", "1:2", "-o", plan).exit_code == 0

    def move(ops):
        ops[5]["start"] += 100
        ops[5]["end"] += 100

    moved = edited(tmp_path, plan, "moved.json", move)
    for extra in ([], ["--no-critical-path"], ["--json"], ["--json", "--no-critical-path"]):
        r = run("show", moved, *extra)
        assert r.exit_code == 1, (extra, r.output)
        assert r.stderr.startswith(f"error: {moved}: ") and "the plan breaks 3 rules" in r.stderr
    one_line_error(run("gantt", moved, "-o", tmp_path / "g.png"), "not drawn", "overlap")
    one_line_error(run("gantt", plan, "--compare", moved, "-o", tmp_path / "g.png"), "moved.json")
    assert not (tmp_path / "g.png").exists()

    def far(ops):
        ops[-1]["end"] = 1e308

    r = run("show", edited(tmp_path, plan, "far.json", far))
    assert r.exit_code == 1
    assert "(no timeline: the ops span 1e+308 ms, more than 100 times the plan's iteration " \
           "time of 50 ms)" in r.stdout


def test_the_critical_path_says_why_it_ends_after_the_period(tmp_path):
    """The chain ends at the iteration time, which the staggered optimizer makes longer than
    the headline period: both are named where they meet."""
    plan = tmp_path / "p.json"
    assert run("plan", SMALL, "--fail", "1:2", "-o", plan).exit_code == 0
    out = run("show", plan).stdout
    assert "iteration time  50 ms   (first op to last step; the next iteration starts" in out
    assert "critical path of the first iteration, from an idle start to its end at the " \
           "iteration time, 50 ms\n(the period, 49 ms, is shorter" in out
    plain = run("plan", SMALL, "--fail", "1:2", "--no-decouple", "--no-stagger").stdout
    assert "(fault-free 33 ms with this policy, degradation" in plain  # not 27 ms, above's


JOB_FILES = {
    "raises.py": ('raise ValueError("no GPU here")\n',
                  "importing it raised ValueError: no GPU here (raises.py, line 1)"),
    "syntax.py": ("def make_job(:\n", "importing it raised SyntaxError: invalid syntax"),
    "factory.py": ('def make_job():\n    raise KeyError("nope")\n',
                   "the job function raised KeyError: 'nope' (factory.py, line 2)"),
    "stage.py": ("import torch\nfrom recycle_planner.executor import Job\n"
                 "def make_job():\n"
                 "    return Job(stages=[3, torch.nn.Linear(4, 4)], loss_fn=None,\n"
                 "               optimizer=None, iterations=1,\n"
                 "               data=lambda i, p, m: (torch.zeros(2, 4), torch.zeros(2, 4)))\n",
                 "stage 0 of the job is int, not a torch.nn.Module"),
}


@pytest.mark.parametrize("name", sorted(JOB_FILES))
def test_profile_of_a_broken_job_file_is_one_line(tmp_path, name):
    pytest.importorskip("torch")
    text, words = JOB_FILES[name]
    (tmp_path / name).write_text(text)
    r = run("profile", f"{tmp_path / name}:make_job", "-d", "2", "-m", "2", "-o",
            tmp_path / "out.toml")
    one_line_error(r, words)
    assert not (tmp_path / "out.toml").exists()


def slowed(monkeypatch, module, name, seconds=0.3):
    """Make `module.name` take at least `seconds`, so that progress has something to report
    however fast the machine is."""
    import time

    real = getattr(module, name)

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, slow)


def test_long_work_off_a_terminal_logs_its_progress(tmp_path, monkeypatch):
    """Not on a terminal (a pipe, a log file), plan-all and simulate-trace write a progress
    line to the log now and then (LOG_EVERY, 30 s; shortened here), at every verbosity."""
    import recycle_planner.cli.progress as progress
    import recycle_planner.library.build as build
    import recycle_planner.whatif.engine as engine

    monkeypatch.setattr(progress, "LOG_EVERY", 0.05)
    slowed(monkeypatch, build, "build_entry")
    lib = tmp_path / "lib"
    r = run("plan-all", SMALL, "-f", "1", "-o", lib, "--solver", "heuristic", "-j", "1")
    assert r.exit_code == 0, r.output
    lines = [line for line in r.stderr.splitlines() if "progress" in line]
    assert lines and all(line.startswith("INFO recycle_planner.progress: plan-all (")
                         for line in lines), r.stderr
    assert any(" situations (" in line for line in lines), lines
    slowed(monkeypatch, engine, "replay")
    r = run("simulate-trace", SMALL, "-l", lib, "--mtbf", "1h", "--duration", "1d")
    assert r.exit_code == 0, r.output
    assert "INFO recycle_planner.progress: simulating (" in r.stderr
    assert "s): replaying trace 1 of 1 (every 1h, " in r.stderr


def test_simulate_trace_is_bounded(tmp_path):
    lib = tmp_path / "lib"
    assert run("plan-all", SMALL, "-f", "1", "-o", lib, "--solver", "heuristic").exit_code == 0
    one_line_error(run("simulate-trace", SMALL, "-l", lib, "--mtbf", "2h", "--duration",
                       "1000000d"), "--duration: '1000000d' is more than 100 years")
    one_line_error(run("simulate-trace", SMALL, "-l", lib, "--mtbf", "1s"),
                   "about 604,800 failures; a trace may have 100,000")
    for text in ("1e300h", "1e999h"):
        trace = tmp_path / "t.csv"
        trace.write_text(f"time,event,worker\n1h,fail,0:1\n{text},repair,0:1\n")
        one_line_error(run("simulate-trace", SMALL, "-l", lib, "--trace", trace), "line 3")
