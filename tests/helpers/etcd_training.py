"""What the tests of real training under coordinators that fail over on etcd share: how they
run the CLI in network namespaces, and how they wait for its processes (bounded, the logs of
every process in the failure)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from recycle_planner.executor.control.etcd_local import etcd_missing

from helpers.netns import unavailable

CLI = [sys.executable, "-m", "recycle_planner.cli"]
ROOT = Path(__file__).resolve().parent.parent.parent
WHY = unavailable() or etcd_missing()
"""Why these tests cannot run here (None: they can)."""


def env(**more: str) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **more)


def tails(logs: dict[str, Path], chars: int = 2500) -> str:
    return "".join(f"\n== {n}\n" + p.read_text(errors="replace")[-chars:]
                   for n, p in logs.items() if p.exists())


def wait_all(procs, seconds: float, logs: dict[str, Path]) -> list[int]:
    """The exit status of each of `procs`, all within `seconds`."""
    deadline = time.time() + seconds
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(1.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            raise AssertionError(tails(logs)) from None
    return codes
