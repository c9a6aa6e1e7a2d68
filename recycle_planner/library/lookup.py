"""A library opened for lookups (the plan and mapping for a set of dead workers), and for
adding the plans a run makes on demand.

The library is a cache, not a wall: a dead set it lacks is a `MissingPlan`, which the
coordinator answers by planning it (`library/ondemand.py`) and `add`ing it. Only the
coordinator writes, under the folder's lock (the plan file first, then index.json, each
atomically); every lookup reads the index again if it changed, so a worker sees what the
coordinator added or replaced."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from recycle_planner.errors import FailureSetError, PlanFileError, RecycleError
from recycle_planner.files.planfile import read_plan
from recycle_planner.io import read_json
from recycle_planner.job.policy import Policy
from recycle_planner.job.situations import Mapping, Placement, canonical, map_failure
from recycle_planner.job.spec import JobSpec
from recycle_planner.job.workers import check_failed, dead_per_stage
from recycle_planner.library.entries import (LIBRARY_FILE, LibraryEntry, situation_file,
                                             store_plan)
from recycle_planner.library.hashing import file_sha256, spec_hash
from recycle_planner.library.index import INDEX, LibraryIndex
from recycle_planner.library.lock import library_lock
from recycle_planner.library.settings import Settings
from recycle_planner.timing.plan import Plan
from recycle_planner.words import plural


class MissingPlan(FailureSetError):
    """The library has no plan for these dead workers (beyond its threshold, or an incomplete
    build): plan it on demand, or fall back to a checkpoint."""

    def __init__(self, message: str, counts: tuple[int, ...]):
        super().__init__(message)
        self.counts = counts


@dataclass(frozen=True)
class Lookup:
    """What a launcher needs for a set of dead physical workers."""

    file: Path
    failed_per_stage: tuple[int, ...]
    mapping: Mapping
    entry: LibraryEntry
    spec: JobSpec

    def plan(self) -> Plan:
        """The plan file, checked against the index: the library's job, this failure set."""
        plan = read_plan(self.file)
        if plan.schedule.spec != self.spec:
            raise PlanFileError(f"{self.file}: the plan is for another job than its library")
        failed = [list(w) for w in plan.failed]
        if failed != [list(w) for w in (self.entry.failed or failed)] or tuple(
                dead_per_stage(self.spec, plan.failed)) != self.failed_per_stage:
            raise PlanFileError(f"{self.file}: the plan's dead workers {failed} are not the "
                                f"library entry's ({list(self.failed_per_stage)} per stage)")
        return plan

    def to_dict(self) -> dict[str, Any]:
        return {"file": str(self.file), "failed_per_stage": list(self.failed_per_stage),
                "mapping": self.mapping.to_dict(), "placement": self.entry.placement,
                "failed_logical": self.entry.failed or [], "metrics": self.entry.metrics.to_dict(),
                "made": self.entry.made or "plan-all"}


class PlanLibrary:
    """A built library, opened for lookups. `PlanLibrary.open("plans/").lookup([(1, 3)])`."""

    def __init__(self, folder: Path, index: LibraryIndex):
        self.folder = Path(folder)
        self.index = index
        self._stamp = _stamp(self.folder / INDEX)

    spec = property(lambda self: self.index.spec)
    policy = property(lambda self: self.index.policy)
    max_failures = property(lambda self: self.index.max_failures)

    @classmethod
    def create(cls, folder: str | Path, spec: JobSpec, policy: Policy = Policy()
               ) -> "PlanLibrary":
        """An empty library in `folder` (created if needed) for a run without one: every
        situation, the fault-free one first, is planned when the run first meets it. An
        existing library of this job there is opened instead (a resumed run keeps its plans)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        with library_lock(folder, "a run planning on demand"):
            if (folder / INDEX).is_file():
                return cls.open(folder, spec, policy)
            LibraryIndex(spec, policy, 0, Settings().to_dict()).write(folder)
        return cls.open(folder)

    @classmethod
    def open(cls, folder: str | Path, spec: JobSpec | None = None,
             policy: Policy | None = None) -> "PlanLibrary":
        folder = Path(folder)
        lib = cls(folder, LibraryIndex.read(folder))
        if spec is not None and spec_hash(spec, policy or lib.policy) != lib.index.spec_hash:
            raise RecycleError(f"{folder} was built for another spec or policy (hash "
                               f"{lib.index.spec_hash}); rebuild it with 'recycle-planner "
                               f"plan-all' for this one")
        return lib

    def reload(self) -> bool:
        """Read index.json again if it changed since it was read (the coordinator added a
        plan); whether it did."""
        stamp = _stamp(self.folder / INDEX)
        if stamp == self._stamp:
            return False
        fresh = LibraryIndex.read(self.folder)
        if fresh.spec_hash != self.index.spec_hash:
            raise PlanFileError(f"{self.folder / INDEX} now holds another job's library")
        self.index, self._stamp = fresh, stamp
        return True

    def add(self, plan: Plan, placement: Placement, made: str,
            settings_hash: str | None = None) -> LibraryEntry:
        """Store `plan` (its placement of the holes, who `made` it) as the entry of its
        situation, replacing any (kept under `replaced`): the plan file under a name never used
        before, then the index, each written atomically, under the folder's lock (a
        `LibraryBusy` if another process writes the library; the index is read again under
        the lock, so that no other writer's entry is lost); the entry records the file's
        SHA-256."""
        counts = tuple(dead_per_stage(self.spec, plan.failed))
        with library_lock(self.folder, f"a run adding a plan ({made})"):
            self.reload()
            serial = 1
            while (self.folder / situation_file(counts, made, serial)).exists():
                serial += 1
            entry = store_plan(self.spec, plan, placement, self.folder,
                               situation_file(counts, made, serial), self.index.spec_hash,
                               settings_hash, made)
            self.index = self.index.with_entry(entry, keep_replaced=True)
            self.index.write(self.folder)
            self._stamp = _stamp(self.folder / INDEX)
        return entry

    def problems(self) -> list[str]:
        """What keeps the library from being complete: situations up to its threshold without
        an entry, and entries whose plan file is missing or not the one recorded."""
        out = [f"no plan for per-stage failures {list(k)}" for k in self.index.missing]
        for entry in self.index.entries:
            if not entry.intact(self.folder):
                state = "missing" if not (self.folder / entry.file).is_file() else "changed"
                out.append(f"plan file {entry.file} {state}")
        return out

    def _check_folder_is_ours(self) -> None:
        """A folder whose plan files are none of those its index lists holds another library's
        index (copied or moved there): say so rather than call one plan file missing."""
        listed = {e.file for e in self.index.entries}
        here = {p.name for p in self.folder.iterdir() if LIBRARY_FILE.fullmatch(p.name)}
        if here and not here & {name for name in listed
                                if file_sha256(self.folder / name) is not None}:
            name = self.spec.name or "a job"
            raise PlanFileError(f"{self.folder / INDEX}: this index is another library's "
                                f"({name}, {self.spec.stages}x{self.spec.pipelines}): none of its "
                                f"{plural(len(listed), 'plan file')} is in the folder, which "
                                f"holds {plural(len(here), 'other plan file')}; run plan-all "
                                f"for this folder's job to rebuild its index")
        for name in sorted(listed & here)[:1]:
            data = read_json(self.folder / name)
            other = data.get("spec") if isinstance(data, dict) else None
            if isinstance(other, dict) and other != self.spec.to_dict():
                raise PlanFileError(f"{self.folder / INDEX}: this index is another library's: "
                                    f"its plan file {name} is of another job "
                                    f"({other.get('name') or 'unnamed'}); run plan-all for "
                                    f"this folder's job to rebuild its index")

    @property
    def fault_free_period(self) -> float:
        if self.index.fault_free_period is None:
            raise PlanFileError(f"{self.folder}: the library has no fault-free plan yet")
        return self.index.fault_free_period

    def entries(self) -> list[LibraryEntry]:
        return list(self.index.entries)

    def entry(self, counts: tuple[int, ...]) -> LibraryEntry | None:
        return self.index.by_counts.get(tuple(counts))

    @property
    def reference_period(self) -> float | None:
        """The period of the library's fault-free plan, the reference of a new plan's
        degradation; None while it has none (a run without a library, before its first plan)."""
        return self.index.fault_free_period

    def lookup(self, failed: Iterable[Iterable[int]], file: str | None = None) -> Lookup:
        """The plan and mapping for these dead physical workers; an error if a worker is outside
        the grid or listed twice, if a stage has no live worker left, or a `MissingPlan` if the
        library has none for them. `file` asks for that plan file of the situation, also one
        a run has replaced since (what a launcher decided before the replacement)."""
        dead = check_failed(self.spec, failed)
        counts = dead_per_stage(self.spec, dead)
        self.reload()  # one stat; the index is read again only if a run added a plan
        entry = self.entry(counts)
        if entry is None and len(dead) > self.max_failures:
            raise MissingPlan(f"{len(dead)} dead workers is beyond this library's threshold "
                              f"of {self.max_failures}", counts)
        if entry is None:
            raise MissingPlan(f"{self.folder}: the library has no plan for per-stage failures "
                              f"{list(counts)} (incomplete library: run plan-all again)", counts)
        if file is not None and entry.file != file:
            entry = next((e for e in self.index.replaced if e.file == file), None)
            if entry is None or entry.counts != counts:
                raise PlanFileError(f"{self.folder}: the library has no plan file {file} for "
                                    f"per-stage failures {list(counts)}")
        placement = canonical(entry.placement)
        mapping = map_failure(self.spec, dead, placement)
        path = self.folder / entry.file
        digest = file_sha256(path)
        if digest is None or digest != (entry.sha256 or digest):
            self._check_folder_is_ours()
        if digest is None:
            raise PlanFileError(f"{path}: the library's plan file for {list(counts)} is missing "
                                f"(run plan-all again to restore it)")
        if entry.sha256 is not None and digest != entry.sha256:
            raise PlanFileError(f"{path}: the plan file has changed since the library was built "
                                f"(its SHA-256 differs from the index); run plan-all again")
        return Lookup(path, counts, mapping, entry, self.spec)


def _stamp(path: Path) -> tuple[int, int] | None:
    """What tells a changed index.json (replaced atomically: a new inode or time)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns
