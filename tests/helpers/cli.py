"""Running the CLI in-process, and what a user-caused error must look like."""

from click.testing import CliRunner

from recycle_planner.cli.main import main


def run(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def one_line_error(r, *words, status=2):
    """Exit `status`, one line on stderr starting 'error: ' that names each of `words`, no
    traceback."""
    assert r.exit_code == status, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    for word in words:
        assert word in lines[0], r.output
    assert "Traceback" not in r.output
