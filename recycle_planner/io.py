"""Writing files safely: atomically (a reader never sees half a file, a failure leaves
nothing behind), into a folder that must exist; JSON optionally gzip-compressed.

Shared by plan files, the library, pictures, the what-if output and the executor. An output
named '-' is standard output; one the system refuses (read-only, full disk, no permission) is
an `OutputError` naming the file, checked before the work where it can be (`check_writable`).
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from recycle_planner.errors import OutputError, PlanFileError


STDOUT = "-"  # an output named '-' is standard output, as usual on the command line


def is_stdout(path: str | Path | None) -> bool:
    return path is not None and str(path) == STDOUT


def output_folder(path: Path) -> Path:
    """The folder a file will be written to; a clear error if it does not exist."""
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise OutputError(f"{path}: folder {folder} does not exist")
    return folder


def check_writable(path: str | Path, folder: bool = False) -> None:
    """Fail before any work when `path` (a file, or with `folder` a folder that may not exist
    yet) cannot be written: no such folder, a read-only file system, no permission. Probes by
    creating and removing an empty file, which also works for root and for mounts."""
    path = Path(path)
    if is_stdout(path):
        return
    if folder:
        where = path
        while not where.exists() and where != where.parent:
            where = where.parent
        if not where.is_dir():
            raise OutputError(f"{path}: {where} is not a folder")
    else:
        if path.is_dir():
            raise OutputError(f"{path}: is a folder, not a file name")
        where = output_folder(path)
    try:
        fd, probe = tempfile.mkstemp(prefix=".recycle-probe.", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write to {where}: {exc.strerror or exc}") from None


def atomic_write(path: str | Path, write: Callable[[Any], None], binary: bool = False) -> None:
    """Write through a temporary file in the same folder and rename it into place, so that a
    reader never sees half a file and a failure (a full disk, a read-only file system) leaves
    nothing behind and is an `OutputError` naming the file. '-' is standard output."""
    if is_stdout(path):
        stream = sys.stdout.buffer if binary else sys.stdout
        write(stream)
        stream.flush()
        return
    path = Path(path)
    folder = output_folder(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
        text_mode = {} if binary else {"encoding": "utf-8"}
        with os.fdopen(fd, "wb" if binary else "w", **text_mode) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        if isinstance(exc, OSError):
            raise OutputError(f"{path}: cannot write: {exc.strerror or exc}") from None
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: str | Path, data: dict[str, Any], level: int = 3) -> bytes:
    """Atomically write `data` as JSON, gzip-compressed (at `level`) when the name ends in .gz;
    returns the bytes written (to checksum them without reading the file back)."""
    path = Path(path)
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    if path.suffix == ".gz":
        blob = gzip.compress(text.encode(), compresslevel=level, mtime=0)
    else:
        blob = (text + "\n").encode()
    atomic_write(path, lambda fh: fh.write(blob), binary=True)
    return blob


def read_json(path: str | Path, what: str = "plan") -> Any:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PlanFileError(f"{path}: cannot read {what} file: {exc.strerror or exc}") from None
    try:
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        return json.loads(raw.decode("utf-8"))
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanFileError(f"{path}: not a {what} file (truncated or not JSON: {exc})") from None
