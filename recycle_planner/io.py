"""Writing files safely: atomically (a reader never sees half a file, a failure leaves
nothing behind), into a folder that must exist; JSON optionally gzip-compressed.

Shared by plan files, the library, pictures, the what-if output and the executor.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from recycle_planner.errors import PlanFileError, RecycleError


def output_folder(path: Path) -> Path:
    """The folder a file will be written to; a clear error if it does not exist."""
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise RecycleError(f"{path}: folder {folder} does not exist")
    return folder


def atomic_write(path: str | Path, write: Callable[[Any], None], binary: bool = False) -> None:
    """Write through a temporary file in the same folder and rename it into place, so that a
    reader never sees half a file and a failure leaves nothing behind."""
    path = Path(path)
    folder = output_folder(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
        text_mode = {} if binary else {"encoding": "utf-8"}
        with os.fdopen(fd, "wb" if binary else "w", **text_mode) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: str | Path, data: dict[str, Any]) -> bytes:
    """Atomically write `data` as JSON, gzip-compressed when the name ends in .gz; returns the
    bytes written (to checksum them without reading the file back)."""
    path = Path(path)
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    if path.suffix == ".gz":
        blob = gzip.compress(text.encode(), compresslevel=3, mtime=0)
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
