"""One writer per library folder: plan-all for its whole build, a run for each plan it adds
(or for the whole run, holding `library_lock` itself).

The lock is `flock` on `FOLDER/.lock`, which the kernel releases when its holder dies, so a
crashed writer never blocks the next one; the file records who holds it (command, pid, host,
since when), for the message a second writer gets. A clean release removes the file; one that
is still there with a record when the lock is free was left by a writer that crashed or was
killed, which the next writer says (a stale lock) before it takes over and checks the folder
as plan-all always does (damaged or missing plan files are planned again).

flock works on local file systems and on NFSv4 (as a POSIX lock); a library shared between
hosts on a file system without locks is not protected.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from recycle_planner.errors import RecycleError

log = logging.getLogger("recycle_planner.library")

LOCK = ".lock"


class LibraryBusy(RecycleError):
    """Another writer holds the library folder."""


_held: dict[Path, list] = {}  # folder -> [fd, depth]: this process's locks (reentrant)


@contextmanager
def library_lock(folder: str | Path, command: str) -> Iterator[None]:
    """Hold `folder`'s writer lock for the block (the folder must exist); a `LibraryBusy`
    naming the holder if another process has it. Reentrant within a process."""
    key = Path(folder).resolve()
    if key in _held:
        _held[key][1] += 1
        try:
            yield
        finally:
            _held[key][1] -= 1
        return
    fd = _acquire(Path(folder), command)
    _held[key] = [fd, 1]
    try:
        yield
    finally:
        del _held[key]
        _release(Path(folder), fd)


def holds_lock(folder: str | Path) -> bool:
    return Path(folder).resolve() in _held


def _acquire(folder: Path, command: str) -> int:
    path = folder / LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _record(fd)
            os.close(fd)
            raise LibraryBusy(f"{folder}: the plan library is being written by "
                              f"{_describe(holder)}: wait for it to finish (or stop it), or "
                              f"use another folder") from None
        except OSError as exc:
            os.close(fd)
            raise RecycleError(f"{path}: cannot lock the plan library: "
                               f"{exc.strerror or exc}") from None
        try:  # the file we locked may have been removed by a holder releasing it: retry
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    stale = _record(fd)
    if stale:
        log.warning("%s: the previous writer, %s, ended without releasing the lock (crashed "
                    "or killed); taking over: damaged or missing plan files are planned again",
                    folder, _describe(stale))
    record = {"command": command, "pid": os.getpid(), "host": socket.gethostname(),
              "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    return fd


def _release(folder: Path, fd: int) -> None:
    try:
        os.unlink(folder / LOCK)  # while still holding it: see the inode check in _acquire
    except FileNotFoundError:
        pass
    os.close(fd)


def _record(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {"command": "an unknown writer"}
    return data if isinstance(data, dict) else {"command": "an unknown writer"}


def _describe(record: dict) -> str:
    who = str(record.get("command") or "another recycle-planner")
    where = ", ".join(f"{k} {record[k]}" for k in ("pid", "host", "since") if k in record)
    return f"{who} ({where})" if where else who
