"""The library's index.json as one typed record, `LibraryIndex`, and its only read and write
path: plan-all, a run's on-demand additions and every reader go through `read` and `write`
(under the folder's lock, `lock.py`, for writers)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from recycle_planner.errors import PlanFileError, RecycleError
from recycle_planner.io import read_json, write_json
from recycle_planner.job.policy import Policy
from recycle_planner.job.situations import situations
from recycle_planner.job.spec import JobSpec
from recycle_planner.library.entries import MADE_AT_RUN_TIME, LibraryEntry
from recycle_planner.library.hashing import spec_hash
from recycle_planner.words import plural

LIBRARY_FORMAT = "recycle-plan-library"
LIBRARY_VERSION = 3
"""3: the spec may give workers several chunks, and plan files carry every op's chunk (plan
format versions 3 and 4). 2: compact plan files (action strings, see files/planfile.py) and
entries made at run time (`made`). Versions 1 (timed plan files) and 2 are still read as they
are; a write makes the index 3."""
READABLE_VERSIONS = (1, 2, 3)
INDEX = "index.json"


def situation_order(counts: tuple[int, ...]) -> tuple:
    """Entries are listed like `situations`: by the number of failures, then the earliest
    stages' failures first."""
    return sum(counts), tuple(-k for k in counts)


@dataclass(frozen=True)
class LibraryIndex:
    """index.json: the job (spec and policy, whose hash it records), the threshold plan-all
    built for, its settings, one entry per situation in `situation_order`, and the entries a
    run replaced (a generation decided just before the replacement still runs one).
    `complete` and the fault-free period are derived from the entries, never stored apart."""

    spec: JobSpec
    policy: Policy
    max_failures: int
    settings: dict[str, Any]                 # Settings.to_dict() of the build
    entries: tuple[LibraryEntry, ...] = ()
    replaced: tuple[LibraryEntry, ...] = ()
    version: int = LIBRARY_VERSION           # as read; written as LIBRARY_VERSION

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.entries, key=lambda e: situation_order(e.counts)))
        object.__setattr__(self, "entries", ordered)

    @cached_property
    def spec_hash(self) -> str:
        return spec_hash(self.spec, self.policy)

    @cached_property
    def by_counts(self) -> dict[tuple[int, ...], LibraryEntry]:
        return {e.counts: e for e in self.entries}

    @property
    def fault_free_period(self) -> float | None:
        zero = self.by_counts.get((0,) * self.spec.stages)
        return None if zero is None else zero.period

    @property
    def missing(self) -> list[tuple[int, ...]]:
        """The situations up to the threshold that have no entry."""
        return [k for k in situations(self.spec, self.max_failures) if k not in self.by_counts]

    @property
    def complete(self) -> bool:
        return not self.missing

    def with_entry(self, entry: LibraryEntry, keep_replaced: bool = False) -> "LibraryIndex":
        """This index with `entry` as its situation's entry; the entry it replaces is kept
        under `replaced` when `keep_replaced` (a run's replacement of a plan in use)."""
        old = self.by_counts.get(entry.counts)
        entries = [e for e in self.entries if e.counts != entry.counts] + [entry]
        replaced = self.replaced + ((old,) if keep_replaced and old is not None else ())
        return replace(self, entries=tuple(entries), replaced=replaced)

    def to_json(self) -> dict[str, Any]:
        return {"format": LIBRARY_FORMAT, "version": LIBRARY_VERSION,
                "spec_hash": self.spec_hash, "spec": self.spec.to_dict(),
                "policy": self.policy.to_dict(), "max_failures": self.max_failures,
                "settings": self.settings, "fault_free_period": self.fault_free_period,
                "complete": self.complete, "entries": [e.to_dict() for e in self.entries],
                **({"replaced": [e.to_dict() for e in self.replaced]} if self.replaced else {})}

    @classmethod
    def from_json(cls, data: Any, path: Path) -> "LibraryIndex":
        """The index in `data`; a PlanFileError naming `path` for anything foreign, newer,
        malformed or edited (a spec that no longer matches its hash)."""
        if not isinstance(data, dict) or data.get("format") != LIBRARY_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise PlanFileError(f"{path}: not a recycle-plan-library index (format is {found!r})")
        if data.get("version") not in READABLE_VERSIONS:
            raise PlanFileError(f"{path}: library version {data.get('version')!r} is not "
                                f"supported (this recycle-planner reads versions "
                                f"{', '.join(map(str, READABLE_VERSIONS))}): rebuild it with "
                                f"'recycle-planner plan-all --force'")
        for key, kind in (("spec_hash", str), ("spec", dict), ("policy", dict),
                          ("max_failures", int), ("entries", list)):
            if not isinstance(data.get(key), kind) or isinstance(data.get(key), bool):
                raise PlanFileError(f"{path}: '{key}' is missing or malformed")
        spec = JobSpec.from_dict(data["spec"], f"{path}: spec")
        if spec.chunks > 1 and data["version"] < 3:
            raise PlanFileError(f"{path}: a version-{data['version']} library has one chunk "
                                f"per worker, but its spec has {spec.chunks}")
        try:
            policy = Policy.from_dict(data["policy"])
        except RecycleError as exc:
            raise PlanFileError(f"{path}: {exc}") from None
        index = cls(spec=spec, policy=policy, max_failures=data["max_failures"],
                    settings=data.get("settings") if isinstance(data.get("settings"), dict)
                    else {},
                    entries=_entries(data["entries"], spec, f"{path}: entries"),
                    replaced=_entries(data.get("replaced", []), spec, f"{path}: replaced"),
                    version=data["version"])
        if index.spec_hash != data["spec_hash"]:
            raise PlanFileError(f"{path}: its spec and policy do not match its spec_hash (was "
                                f"the index edited?); rebuild it with 'recycle-planner "
                                f"plan-all --force'")
        if len(index.by_counts) != len(index.entries):
            raise PlanFileError(f"{path}: a situation has two entries")
        return index

    @classmethod
    def read(cls, folder: Path) -> "LibraryIndex":
        path = Path(folder) / INDEX
        if not path.is_file():
            raise PlanFileError(f"{folder}: no plan library here (missing {INDEX}); build one "
                                f"with 'recycle-planner plan-all'")
        return cls.from_json(read_json(path, "library index"), path)

    def write(self, folder: Path) -> None:
        """Atomically; the caller holds the folder's lock."""
        write_json(Path(folder) / INDEX, self.to_json())


def _entries(data: Any, spec: JobSpec, where: str) -> tuple[LibraryEntry, ...]:
    if not isinstance(data, list):
        raise PlanFileError(f"{where} must be a list")
    out = []
    for i, item in enumerate(data):
        entry = LibraryEntry.from_dict(item, f"{where}[{i}]")
        entry.check(spec, f"{where}[{i}]")
        out.append(entry)
    return tuple(out)


def reusable_entries(folder: Path, spec: JobSpec, shash: str, force: bool,
                     max_failures: int) -> list[LibraryEntry]:
    """The entries of the library already in `folder` that a build for `max_failures` may
    keep; a library of another job, a corrupted index or one for more failures (which the
    build would shrink) is refused unless `force`."""
    if not (folder / INDEX).exists():
        return []
    try:
        index = LibraryIndex.read(folder)
    except PlanFileError as exc:
        if force:
            return []
        raise PlanFileError(f"{exc}; delete it or pass --force to rebuild the library") from None
    if index.spec_hash != shash and not force:  # with force its files are removed
        raise RecycleError(f"{folder} holds a library for another spec or policy "
                           f"({index.spec.name or 'another job'}, hash {index.spec_hash}, this "
                           f"one is {shash}{_same_shape(index, spec)}); pass --force to "
                           f"rebuild it there or choose another folder")
    if index.max_failures > max_failures and not force:
        dropped = sum(sum(e.counts) > max_failures for e in index.entries
                      if e.made not in MADE_AT_RUN_TIME)
        raise RecycleError(f"{folder} holds a library for up to {index.max_failures} "
                           f"failures; building it for {max_failures} would drop "
                           f"{plural(dropped, 'situation')}: pass -f {index.max_failures} "
                           f"to keep it complete, --force to shrink it, or choose another "
                           f"folder")
    return list(index.entries)


def _same_shape(index: LibraryIndex, spec: JobSpec) -> str:
    """A hint when the other spec is this job with other costs (profiled again, edited)."""
    shape = (spec.name, spec.stages, spec.pipelines, spec.microbatches)
    if shape == (index.spec.name, index.spec.stages, index.spec.pipelines,
                 index.spec.microbatches):
        return ": the same job with other costs or policy, e.g. profiled again"
    return ""
