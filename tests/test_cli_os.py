"""Outputs the operating system refuses (read-only file system, full disk, no permission) and
Ctrl-C: one line, a documented exit status, nothing half-written, and before expensive work."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import EXAMPLES, ROOT
from helpers.cli import one_line_error, run

SMALL = str(EXAMPLES / "small.toml")
GPT = str(EXAMPLES / "gpt.toml")
CLI = [sys.executable, "-m", "recycle_planner.cli"]


@pytest.fixture(scope="module")
def mounts(tmp_path_factory):
    """A read-only file system and a nearly full one (tmpfs: we are root in CI)."""
    base = tmp_path_factory.mktemp("mounts")
    ro, full = base / "ro", base / "full"
    ro.mkdir()
    full.mkdir()
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                        capture_output=True).returncode == 0
    if not ok:
        pytest.skip("needs root to mount a tmpfs")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12k", "tmpfs", str(full)], check=True)
    yield ro, full
    subprocess.run(["umount", str(ro)])
    subprocess.run(["umount", str(full)])


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    base = tmp_path_factory.mktemp("plans")
    assert run("plan", SMALL, "-o", base / "ff.json").exit_code == 0
    assert run("plan-all", SMALL, "-f", "1", "-o", base / "lib", "-j", "1").exit_code == 0
    return base


def test_read_only_file_system_is_one_line_before_the_work(mounts, plans):
    ro, _ = mounts
    ff, lib = plans / "ff.json", plans / "lib"
    for args in (["plan", SMALL, "-o", ro / "p.json"],
                 ["gantt", ff, "-o", ro / "g.png"],
                 ["plan-all", SMALL, "-f", "1", "-o", ro / "lib"],
                 ["plan-all", SMALL, "-f", "1", "-o", ro],
                 ["export-torch", ff, "-o", ro / "s.csv"],
                 ["report", lib, "-o", ro / "r.png"],
                 ["simulate-trace", SMALL, "--library", lib, "--mtbf", "1h", "-o", ro / "w"],
                 ["profile", "no_such_module:make_job", "-d", "2", "-m", "4", "-o", ro / "t.toml"],
                 ["launch", "-n", "4", "--run-dir", ro / "run", "no_such_module:make_job"]):
        r = run(*args)
        one_line_error(r, "Read-only file system", str(ro))
        assert "period" not in r.output  # refused before planning
    assert os.listdir(ro) == []


def test_profile_checks_its_output_before_measuring():
    r = run("profile", "no_such_module:make_job", "-d", "2", "-m", "4", "-o",
            "/nonexistent/t.toml")
    one_line_error(r, "/nonexistent/t.toml", "does not exist")


def test_full_disk_is_one_line_and_leaves_nothing(mounts):
    _, full = mounts
    r = run("plan", GPT, "-o", full / "p.json")
    one_line_error(r, str(full / "p.json"), "No space left on device")
    assert os.listdir(full) == []


def test_permission_denied_is_one_line():
    import shutil
    import tempfile

    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv to run as nobody")
    folder = Path(tempfile.mkdtemp(prefix="recycle-locked-"))  # nobody can reach, not write
    folder.chmod(0o555)
    try:
        proc = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534",
                               "--clear-groups", *CLI, "plan", SMALL, "-o",
                               str(folder / "p.json")], capture_output=True, text=True,
                              cwd=ROOT, timeout=120)
    finally:
        files = os.listdir(folder)
        shutil.rmtree(folder)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {folder / 'p.json'}: cannot write to {folder}: Permission denied"]
    assert proc.stdout == "" and files == []


def terminal_ctrl_c() -> None:
    """In a child about to run the CLI: SIGINT as a terminal delivers it. A suite started in the
    background (`make test &`) inherits an ignored SIGINT, which Python would keep ignoring."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_a_milp_promptly_with_status_130(tmp_path):
    """SIGINT while HiGHS works on a 120-second budget: stopped long before it (HiGHS stops at
    its next check, which can take seconds on a loaded machine), exit 130, one line, no
    traceback, no plan file."""
    out = tmp_path / "p.json"
    proc = subprocess.Popen([*CLI, "plan", SMALL, "--fail", "1:2", "--fail", "0:1", "--solver",
                             "milp", "--time-limit", "120", "-v", "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=terminal_ctrl_c)
    deadline = time.monotonic() + 120
    seen = ""
    while "solving the MILP" not in seen:  # the -v log line just before HiGHS starts
        line = proc.stderr.readline()
        assert line or proc.poll() is None, seen
        seen += line
        assert time.monotonic() < deadline, seen
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    stdout, stderr = proc.communicate(timeout=150)
    assert time.monotonic() - t0 < 30  # without the interrupt it runs to its 120 s limit
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "interrupted"
    assert "Traceback" not in stderr and not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_a_long_plan_is_announced_shows_progress_and_stops_on_ctrl_c(tmp_path):
    """stages = 100000: before any work, one line says how big the job is and how long and
    how much memory it should take; on a terminal a progress line follows after two seconds;
    Ctrl-C stops it at once with 130."""
    import pty

    spec = tmp_path / "huge.toml"
    spec.write_text("stages = 100000\npipelines = 2\nmicrobatches = 8\n[time]\nforward = 1\n"
                    "backward_input = 1\n")
    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI on a terminal
        terminal_ctrl_c()
        os.execv(sys.executable, [*CLI, "plan", str(spec), "--fail", "0:1"])
    seen = b""
    deadline = time.monotonic() + 120
    try:
        while b"planning (" not in seen:
            assert time.monotonic() < deadline, seen
            try:
                seen += os.read(fd, 4096)
            except OSError:
                break
        text = seen.decode(errors="replace")
        assert ("planning 4,800,000 ops per iteration (and the fault-free plan for reference): "
                "expect about") in text, text
        assert "GiB" in text and "planning (" in text
        os.kill(pid, signal.SIGINT)
        t0 = time.monotonic()
        while True:  # bounded: a child that ignores Ctrl-C fails the test, never hangs it
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            assert time.monotonic() - t0 < 20, "Ctrl-C did not stop the planner within 20 s"
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(status) == 130
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.close(fd)
