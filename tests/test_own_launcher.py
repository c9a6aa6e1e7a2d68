"""examples/own_launcher.py runs a failure plan's programs with nothing but torch.distributed
(gloo, 5 processes) and torch modules, and its parameters and gradients after three steps are
one process's: the proof that another launcher can follow the programs."""

import ast
import subprocess
import sys

import pytest
from click.testing import CliRunner

from recycle_planner.cli.main import main
from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import load_spec
from recycle_planner.library import Settings, build_library
from recycle_planner.programs import Compute
from recycle_planner.programs.files import read_program

from conftest import EXAMPLES, ROOT

EXAMPLE = EXAMPLES / "own_launcher.py"


def test_the_example_imports_only_the_programs_api():
    modules = {node.module for node in ast.walk(ast.parse(EXAMPLE.read_text()))
               if isinstance(node, ast.ImportFrom)}
    ours = {m for m in modules if m.startswith("recycle_planner")}
    assert ours == {"recycle_planner.programs", "recycle_planner.programs.files"}


@pytest.mark.torch
def test_a_failure_plan_run_by_hand_equals_one_process(tmp_path):
    pytest.importorskip("torch")
    build_library(load_spec(EXAMPLES / "launcher.toml"), Policy(), 1, tmp_path / "plans",
                  Settings(solver="heuristic"), jobs=1)
    assert CliRunner().invoke(main, ["program", str(tmp_path / "plans"), "--fail", "1:1", "-o",
                                     str(tmp_path / "programs")]).exit_code == 0
    peer = read_program(tmp_path / "programs", 1)  # worker 0:1 also runs pipeline 1's
    assert {a.pipeline for a in peer.actions if isinstance(a, Compute)} == {0, 1}
    done = subprocess.run([sys.executable, str(EXAMPLE), str(tmp_path / "programs"),
                           "--steps", "3"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 ranks (dead: [[1, 1]]), 3 steps: parameters and gradients equal one " \
           "process's" in done.stdout
