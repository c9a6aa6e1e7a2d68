"""Program files: one JSON per rank and a manifest, written atomically, checked when read.

`recycle-planner program` writes a folder:

    programs.json      {"format": "recycle-programs", "version": 1, "job": {...}, "policy": {...},
                        "dead": [[1, 3]], "plan": {"file": ..., "sha256": ..., "period": ...},
                        "nccl_check": "serial", "ranks": [{"rank": 0, "file": "rank-0000.json",
                        "sha256": "..."}, ...], "torch_csv": [...]}
    rank-0000.json     {"format": "recycle-program", "version": 1, "rank": 0, ...,
                        "actions": [...]}   (`Program.to_json`)

One file per rank, not one for all: a rank's launcher reads only its own (proportional to its
own ops: about 18 KB on `examples/large.toml`'s 1,024 ranks, where one file for all would be
18 MiB for every rank to parse), and the manifest says which ranks are alive. Each rank file's
SHA-256 is in the manifest, as each plan file's is in a library's index: a file that was
edited, truncated or swapped is refused in one line, never run. The rank files are written
first and the manifest last, each atomically, so a reader that finds a manifest finds its
files; rank files and torch CSVs that the manifest does not list (a rank dead now, from an
earlier export) are removed.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from recycle_planner import __version__
from recycle_planner.errors import PlanFileError
from recycle_planner.io import read_json, write_json
from recycle_planner.library.hashing import file_sha256
from recycle_planner.programs.actions import Program

MANIFEST = "programs.json"
MANIFEST_FORMAT, PROGRAM_FORMAT, VERSION = "recycle-programs", "recycle-program", 1
RANK_FILE = re.compile(r"rank-[0-9]+\.json")
TORCH_CSV = re.compile(r"torch-pipeline-[0-9]+\.csv")


def torch_csv(pipeline: int) -> str:
    """The name of a fault-free plan's torch CSV of one pipeline (compute_comms format)."""
    return f"torch-pipeline-{pipeline}.csv"


def rank_file(rank: int, ranks: int) -> str:
    return f"rank-{rank:0{max(4, len(str(ranks - 1)))}d}.json"


def write_programs(folder: str | Path, programs: dict[int, Program],
                   header: dict[str, Any]) -> dict[str, Any]:
    """Write every rank's program and the manifest (`header` plus the ranks); remove the rank
    files and torch CSVs of an earlier export that the manifest does not list; the manifest."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    generator = f"recycle-planner {__version__}"
    ranks = []
    for rank, program in sorted(programs.items()):
        name = rank_file(rank, program.stages * program.pipelines)
        data = {"format": PROGRAM_FORMAT, "version": VERSION, "generator": generator,
                **program.to_json()}
        blob = write_json(folder / name, data)
        ranks.append({"rank": rank, "file": name, "sha256": hashlib.sha256(blob).hexdigest()})
    manifest = {"format": MANIFEST_FORMAT, "version": VERSION, "generator": generator,
                **header, "ranks": ranks}
    write_json(folder / MANIFEST, manifest)
    listed = {r["file"] for r in ranks} | set(header.get("torch_csv", ()))
    for path in folder.iterdir():
        if (RANK_FILE.fullmatch(path.name) or TORCH_CSV.fullmatch(path.name)) and \
                path.name not in listed:
            path.unlink()
    return manifest


def read_manifest(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise PlanFileError(f"{folder}: no programs here (missing {MANIFEST}); write them with "
                            f"'recycle-planner program'")
    data = read_json(path, "programs manifest")
    _check_format(data, MANIFEST_FORMAT, str(path))
    ranks = data.get("ranks")
    if not isinstance(ranks, list) or not all(
            isinstance(r, dict) and isinstance(r.get("rank"), int) and isinstance(
                r.get("file"), str) and RANK_FILE.fullmatch(r["file"]) and isinstance(
                r.get("sha256"), str) for r in ranks):
        raise PlanFileError(f"{path}: 'ranks' must list each rank with its file and sha256")
    return data


def read_program(folder: str | Path, rank: int) -> Program:
    """Rank `rank`'s program, checked against the manifest; a `PlanFileError` (one line) for a
    dead rank, a missing, edited, truncated or foreign file."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    entry = next((r for r in manifest["ranks"] if r["rank"] == rank), None)
    if entry is None:
        raise PlanFileError(f"{folder / MANIFEST}: rank {rank} has no program (dead in this "
                            f"plan, or outside the job)")
    path = folder / entry["file"]
    digest = file_sha256(path)
    if digest is None:
        raise PlanFileError(f"{path}: rank {rank}'s program file is missing")
    if digest != entry["sha256"]:
        raise PlanFileError(f"{path}: the file has changed since it was written (its SHA-256 "
                            f"differs from {MANIFEST}); write the programs again")
    data = read_json(path, "program")
    _check_format(data, PROGRAM_FORMAT, str(path))
    program = Program.from_json(data, str(path))
    if program.rank != rank:
        raise PlanFileError(f"{path}: holds rank {program.rank}'s program, not rank {rank}'s")
    return program


def _check_format(data: Any, name: str, where: str) -> None:
    found = data.get("format") if isinstance(data, dict) else type(data).__name__
    if found != name:
        raise PlanFileError(f"{where}: not a {name} file (format is {found!r})")
    if data.get("version") != VERSION:
        raise PlanFileError(f"{where}: {name} version {data.get('version')!r} is not supported "
                            f"(this recycle-planner reads version {VERSION})")
