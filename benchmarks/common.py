"""Shared helpers for the benchmarks: the machine they ran on, and a stopwatch."""

from __future__ import annotations

import os
import platform
import time
from contextlib import contextmanager


def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu}, {cores} cores, Python {platform.python_version()}"


@contextmanager
def stopwatch(times: dict, key: str):
    t0 = time.perf_counter()
    yield
    times[key] = time.perf_counter() - t0


def read_stamped(stream, lines: list, log, each=lambda line: None) -> None:
    """Each line of a process's output `stream`, stamped with this process's clock on
    arrival into `lines` (so that several processes' lines share one clock), copied to `log`,
    then given to `each`."""
    for raw in stream:
        line = raw.decode(errors="replace").rstrip("\n")
        lines.append((time.time(), line))
        log.write(line + "\n")
        log.flush()
        each(line)
