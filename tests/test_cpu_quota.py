"""The benchmarks' CPU quota wrapper (benchmarks/cpu_quota.py), on a plain folder standing in
for the cgroup controller: what it writes and that it becomes the command."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from cpu_quota import CpuQuota, QuotaGroups, wrap_command  # noqa: E402

from recycle_planner.errors import RecycleError  # noqa: E402


def test_quota_in_microseconds_and_checked():
    q = CpuQuota(0.45)
    assert q.quota_us == 4500
    assert list(q.settings()) == ["cpu.cfs_period_us", "cpu.cfs_quota_us"]
    assert CpuQuota.from_dict(q.to_dict()) == q
    with pytest.raises(RecycleError, match="below the kernel's 1 ms"):
        CpuQuota(0.05, period_us=10_000)
    with pytest.raises(RecycleError, match="period"):
        CpuQuota(1.0, period_us=500)


def test_wrapper_makes_its_own_group_moves_itself_in_and_runs_the_command(tmp_path):
    quota = CpuQuota(0.3, period_us=5000)
    out = subprocess.run(wrap_command([sys.executable, "-c", "import os; print(os.getpid())"],
                                      tmp_path, quota), capture_output=True, text=True, check=True)
    pid = out.stdout.strip()
    group = tmp_path / f"p{pid}"   # exec kept the shell's pid: the command is what was moved
    assert (group / "cgroup.procs").read_text().strip() == pid
    assert (group / "cpu.cfs_quota_us").read_text().strip() == "1500"
    assert (group / "cpu.cfs_period_us").read_text().strip() == "5000"


def test_wrapper_does_not_run_the_command_when_the_group_cannot_be_made(tmp_path):
    marker = tmp_path / "ran"
    proc = subprocess.run(wrap_command(["touch", str(marker)], tmp_path / "missing",
                                       CpuQuota(0.5)), capture_output=True)
    assert proc.returncode != 0 and not marker.exists()


def test_no_controller_is_a_one_line_error(tmp_path):
    with pytest.raises(RecycleError, match="no cgroup v1 cpu controller"):
        with QuotaGroups(CpuQuota(0.5), base=tmp_path):
            pass
