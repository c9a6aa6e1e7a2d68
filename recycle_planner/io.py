"""Writing files safely: atomically (a reader never sees half a file, a failure leaves
nothing behind), into a folder that must exist; JSON optionally gzip-compressed. Reading JSON
strictly: hostile content (deep nesting, huge or non-finite numbers, decompression bombs) is
one clear error naming the file, never a traceback.

Shared by plan files, the library, pictures, the what-if output and the executor. An output
named '-' is standard output; one the system refuses (read-only, full disk, no permission) is
an `OutputError` naming the file, checked before the work where it can be (`check_writable`).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np

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


MAX_DEPTH = 64
"""Nesting that a file the tool reads may have: its formats need 5 levels; deeper is hostile."""
MAX_BYTES = 1 << 31
"""Bytes a compressed file may expand to (2 GiB): more is a decompression bomb, not a plan."""
MAX_DIGITS = 30
"""Digits of a whole number in a file: counts and times need far fewer."""


def read_json(path: str | Path, what: str = "plan") -> Any:
    """The JSON (or gzip-compressed JSON) document in `path`; a `PlanFileError` naming the file
    for anything unreadable, truncated or hostile (see `parse_json`)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PlanFileError(f"{path}: cannot read {what} file: {exc.strerror or exc}") from None
    return parse_json(raw, str(path), what)


def parse_json(raw: bytes, where: str, what: str = "plan", error: type = PlanFileError) -> Any:
    """JSON from bytes (gunzipped first if they are gzip), refusing what no file of ours holds:
    NaN or infinite numbers, numbers too large for a float, whole numbers of more than
    MAX_DIGITS digits, nesting deeper than MAX_DEPTH, and more than MAX_BYTES once
    decompressed. Every refusal is an `error` naming `where`. The checks scan the text (at C
    speed) before the parser reads it, so a 200k-op plan costs a fraction of its parse."""
    try:
        if raw[:2] == b"\x1f\x8b":
            raw = _gunzip(raw, where, error)
        hostile = _hostile(raw)
        if hostile:
            raise error(f"{where}: not a {what} file: {hostile}")
        return json.loads(raw.decode("utf-8"))
    except RecursionError:  # not reached after the scan; kept for a parser that recurses
        raise error(f"{where}: not a {what} file: nested more than {MAX_DEPTH} levels "
                    f"deep") from None
    except (OSError, EOFError, UnicodeDecodeError, ValueError, zlib.error) as exc:
        raise error(f"{where}: not a {what} file (truncated or not JSON: {exc})") from None


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_CONSTANT = re.compile(rb"NaN|Infinity")
_LONG = re.compile(rb"[0-9]{%d,}" % (MAX_DIGITS + 1))
_LARGE = re.compile(rb"[0-9.]+[eE]\+?[0-9]{3,}")
_NESTING = np.zeros(256, dtype=np.int8)
_NESTING[list(b"[{")] = 1
_NESTING[list(b"]}")] = -1


def _hostile(raw: bytes) -> str | None:
    """What no file of ours holds, found in the JSON text outside its strings."""
    bare = _STRING.sub(b'""', raw)
    found = _CONSTANT.search(bare)
    if found:
        return f"{found[0].decode()} is not a number this tool reads"
    found = _LONG.search(bare)
    if found:
        return f"a number of {len(found[0]):,} digits is too large"
    for found in _LARGE.finditer(bare):
        if not math.isfinite(float(found[0])):
            return f"the number {found[0][:20].decode()} is too large for a float"
    depth = np.cumsum(_NESTING[np.frombuffer(bare, dtype=np.uint8)], dtype=np.int64)
    if depth.size and depth.max() > MAX_DEPTH:
        return f"nested more than {MAX_DEPTH} levels deep"
    return None


def check_depth(data: Any, where: str, error: type = PlanFileError) -> None:
    """Refuse nesting deeper than MAX_DEPTH in parsed data (a TOML spec; walked without
    recursion, containers only)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise error(f"{where}: nested more than {MAX_DEPTH} levels deep")
        children = value.values() if isinstance(value, dict) else value
        stack.extend((v, depth + 1) for v in children if isinstance(v, (dict, list)))


def _gunzip(raw: bytes, where: str, error: type) -> bytes:
    """Decompress at most MAX_BYTES; a truncated stream raises EOFError like gzip's."""
    inflate = zlib.decompressobj(wbits=31)
    out = inflate.decompress(raw, MAX_BYTES)
    if inflate.unconsumed_tail:
        raise error(f"{where}: expands to more than {MAX_BYTES >> 30} GiB once decompressed")
    if not inflate.eof:
        raise EOFError("compressed file ended before the end-of-stream marker was reached")
    return out
