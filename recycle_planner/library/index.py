"""The library's index.json: its format, writing it, and checking one that was read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recycle_planner.errors import PlanFileError, RecycleError
from recycle_planner.io import read_json, write_json
from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.library.entries import ON_DEMAND, REFINED, LibraryEntry
from recycle_planner.library.settings import Settings
from recycle_planner.words import plural

LIBRARY_FORMAT = "recycle-plan-library"
LIBRARY_VERSION = 2
"""2: compact plan files (action strings, see files/planfile.py) and entries made at run time
(`made`). A version-1 library (timed plan files) is still read as it is."""
READABLE_VERSIONS = (1, 2)
INDEX = "index.json"


def reusable_entries(folder: Path, spec: JobSpec, shash: str, force: bool,
                     max_failures: int) -> list[dict]:
    """The entries of the library already in `folder` that a build for `max_failures` may
    keep; a library of another job, a corrupted index or one for more failures (which the
    build would shrink) is refused unless `force`."""
    path = folder / INDEX
    if not path.exists():
        return []
    try:
        index = check_index(read_json(path, "library index"), path)
    except PlanFileError as exc:
        if force:
            return []
        raise PlanFileError(f"{exc}; delete it or pass --force to rebuild the library") from None
    if index["spec_hash"] != shash and not force:
        other = index.get("spec", {}).get("name") or "another job"
        raise RecycleError(f"{folder} holds a library for another spec or policy ({other}, hash "
                           f"{index['spec_hash']}, this one is {shash}); pass --force to rebuild "
                           f"it there or choose another folder")
    if index["max_failures"] > max_failures and not force:
        dropped = sum(sum(e.get("failed_per_stage", ())) > max_failures for e in index["entries"]
                      if e.get("made") not in (ON_DEMAND, REFINED))
        raise RecycleError(f"{folder} holds a library for up to {index['max_failures']} "
                           f"failures; building it for {max_failures} would drop "
                           f"{plural(dropped, 'situation')}: pass -f {index['max_failures']} "
                           f"to keep it complete, --force to shrink it, or choose another "
                           f"folder")
    return index["entries"]


def write_index(folder: Path, spec: JobSpec, policy: Policy, max_failures: int,
                 settings: Settings, shash: str, reference: float | None,
                 entries: dict[tuple[int, ...], dict], wanted: list[tuple[int, ...]]) -> dict:
    """Write index.json atomically: the entries of `wanted` in its order, then the entries
    made at run time beyond it (a plan-all rebuild keeps them)."""
    order = {k: i for i, k in enumerate(wanted)}
    listed = sorted((e for k, e in entries.items() if k in order),
                    key=lambda e: order[tuple(e["failed_per_stage"])])
    extra = sorted((e for k, e in entries.items() if k not in order
                    and e.get("made") in (ON_DEMAND, REFINED)),
                   key=lambda e: (sum(e["failed_per_stage"]), e["failed_per_stage"]))
    index = {"format": LIBRARY_FORMAT, "version": LIBRARY_VERSION, "spec_hash": shash,
             "spec": spec.to_dict(), "policy": policy.to_dict(), "max_failures": max_failures,
             "settings": settings.to_dict(), "fault_free_period": reference,
             "complete": len(listed) == len(wanted), "entries": listed + extra}
    write_json(folder / INDEX, index)
    return index


def check_index(data: Any, path: Path) -> dict:
    if not isinstance(data, dict) or data.get("format") != LIBRARY_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise PlanFileError(f"{path}: not a recycle-plan-library index (format is {found!r})")
    if data.get("version") not in READABLE_VERSIONS:
        raise PlanFileError(f"{path}: library version {data.get('version')!r} is not supported "
                            f"(this recycle-planner reads versions "
                            f"{', '.join(map(str, READABLE_VERSIONS))}): rebuild it with "
                            f"'recycle-planner plan-all --force'")
    for key, kind in (("spec_hash", str), ("spec", dict), ("policy", dict),
                      ("max_failures", int), ("entries", list)):
        if not isinstance(data.get(key), kind):
            raise PlanFileError(f"{path}: '{key}' is missing or malformed")
    for i, entry in enumerate(data["entries"]):
        LibraryEntry.from_dict(entry, f"{path}: entries[{i}]")
    return data
