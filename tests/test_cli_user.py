"""The command line as a new user meets it (issue 14): first steps, OS errors, conventions."""

import subprocess

from conftest import EXAMPLES, ROOT
from helpers.cli import run

SMALL = str(EXAMPLES / "small.toml")


def test_costs_that_can_be_zero_default_to_zero(tmp_path):
    spec = tmp_path / "job.toml"
    spec.write_text("stages = 4\npipelines = 2\nmicrobatches = 8\n[time]\nforward = 1\n"
                    "backward_input = 1\nbackward_weight = 1\n")
    r = run("plan", spec)
    assert r.exit_code == 0, r.output
    assert "period" in r.output


def test_every_missing_key_is_reported_at_once(tmp_path):
    spec = tmp_path / "job.toml"
    spec.write_text("pipelines = 2\n[time]\nbackward_weight = 1\n")
    r = run("plan", spec)
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == [
        f"error: {spec}: missing keys 'stages', 'microbatches', 'time.forward', "
        f"'time.backward_input'"]


def readme_block(heading: str) -> list[str]:
    """The command lines of the first sh block after `heading` in the README."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index(heading):].split("```sh\n", 1)[1].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_first_steps_work_as_written(tmp_path):
    """After `make demo`, the README's activation line and its 'Using it' commands run as
    written in the repository folder (here a copy of its examples)."""
    assert readme_block("is installed in `.venv`") == ["source .venv/bin/activate"]
    commands = readme_block("## Using it")
    assert commands[0].startswith("recycle-planner plan examples/gpt.toml")
    (tmp_path / "examples").symlink_to(EXAMPLES)
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    script = "set -e\nsource .venv/bin/activate\n" + "\n".join(commands) + "\n"
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "fail.png").stat().st_size > 1000
    assert (tmp_path / "schedule.csv").exists()
