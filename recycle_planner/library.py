"""The plan library: the best plan for every failure situation up to a threshold, and lookup.

A folder with one plan file per situation and `index.json`:

    {"format": "recycle-plan-library", "version": 1, "spec_hash": "...", "spec": {...},
     "policy": {...}, "max_failures": 2, "settings": {...}, "fault_free_period": 501.4,
     "entries": [{"failed_per_stage": [0, 1, 0, 0], "file": "k0-1-0-0.json.gz",
                  "placement": [[1]], "failed": [[0, 1]], "failure_sets": 4,
                  "metrics": {...}, "solver": {...}, "gap": 0.0, "spec_hash": "...",
                  "settings_hash": "...", "sha256": "..."}, ...]}

Every entry records its plan file's SHA-256, so a missing, truncated or swapped plan file is
found before a launcher runs it. Building is parallel over processes, resumable (an entry whose
file is intact and whose spec and settings hashes match is kept) and deterministic: each
situation's plan depends only on the spec, the policy and the settings, the MILP's budget is a
node limit (one thread, fixed seed) and its time limit only a safety net that a normal run does
not reach. A launcher looks up the physical dead workers and gets the plan file plus the
physical -> logical mapping.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import multiprocessing
import os
import re
import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from recycle_planner import __version__
from recycle_planner.errors import FailureSetError, PlanFileError, RecycleError
from recycle_planner.files.planfile import read_plan, write_plan
from recycle_planner.io import read_json, write_json
from recycle_planner.job.policy import Policy
from recycle_planner.job.situations import (Mapping, Placement, canonical, check_threshold,
                                            counts_of, failure_sets, logical_failed, map_failure,
                                            placements, situations)
from recycle_planner.job.spec import JobSpec
from recycle_planner.job.workers import check_failed, dead_per_stage
from recycle_planner.planner import plan_situation
from recycle_planner.solvers.heuristic import list_schedule
from recycle_planner.solvers.registry import LIBRARY_NODE_LIMIT, SolverSettings
from recycle_planner.timing.plan import Plan
from recycle_planner.timing.simulate import simulate
from recycle_planner.words import plural

log = logging.getLogger(__name__)

LIBRARY_FORMAT = "recycle-plan-library"
LIBRARY_VERSION = 1
INDEX = "index.json"
LIBRARY_FILE = re.compile(r"k[0-9]+(-[0-9]+)*\.json\.gz")  # situation_file's names


def _digest(data: Any) -> str:
    """16 hex digits of the SHA-256 of `data` as canonical JSON."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def spec_hash(spec: JobSpec, policy: Policy) -> str:
    return _digest({"spec": spec.to_dict(), "policy": policy.to_dict()})


@dataclass(frozen=True)
class Settings(SolverSettings):
    """How a library's plans are computed (a change makes entries stale): the solver settings,
    with the library's defaults, and how many placements of the holes to try."""

    solver: str = "auto"
    node_limit: int | None = LIBRARY_NODE_LIMIT  # deterministic; the time limit is a safety net
    max_placements: int = 4

    def to_dict(self) -> dict[str, Any]:
        return {"solver": self.solver, "time_limit": self.time_limit, "backend": self.backend,
                "max_placements": self.max_placements, "node_limit": self.node_limit,
                "planner": __version__}

    @property
    def hash(self) -> str:
        return _digest(self.to_dict())


def situation_file(counts: tuple[int, ...]) -> str:
    return "k" + "-".join(str(k) for k in counts) + ".json.gz"


# Above this many ops per plan, placements are compared with one list-scheduling pass and only
# the best one is planned with the full solver.
SCREEN_ABOVE_OPS = 50_000


def plan_best_placement(spec: JobSpec, policy: Policy, counts: tuple[int, ...],
                        settings: Settings, reference: float | None,
                        reference_bound: float | None = None) -> tuple[Plan, Placement]:
    """Plan every placement of the holes (up to the settings' limit) and keep the shortest
    period; ties go to the placement listed first (packed before spread). On large jobs the
    placements are screened by one list-scheduling pass first."""
    options = placements(counts, spec.pipelines, settings.max_placements)
    ops = spec.workers * spec.microbatches * (3 if policy.decouple else 2)
    if len(options) > 1 and ops > SCREEN_ABOVE_OPS:
        periods = [simulate(list_schedule(spec, policy, logical_failed(p))).period for p in options]
        options = [options[min(range(len(options)), key=lambda i: (periods[i], i))]]
    best: tuple[Plan, Placement] | None = None
    for placement in options:
        plan = plan_situation(spec, policy, logical_failed(placement), settings,
                              reference=reference, reference_bound=reference_bound)
        if best is None or plan.metrics["period"] < best[0].metrics["period"] - 1e-9:
            best = (plan, placement)
    assert best is not None
    return best


def _build_one(args: tuple) -> dict[str, Any]:
    spec, policy, counts, settings, reference, reference_bound, folder, shash = args
    plan, placement = plan_best_placement(spec, policy, counts, settings, reference,
                                          reference_bound)
    plan = Plan(plan.schedule, plan.timing, plan.metrics, plan.solver,
                mapping={"placement": [list(g) for g in placement]})
    name = situation_file(counts)
    digest = hashlib.sha256(write_plan(plan, Path(folder) / name)).hexdigest()
    m = plan.metrics
    return {"failed_per_stage": list(counts), "file": name,
            "placement": [list(g) for g in placement],
            "failed": [list(w) for w in plan.failed],
            "failure_sets": failure_sets(spec, counts),
            "metrics": {k: m[k] for k in ("period", "iteration_time", "fault_free_period",
                                          "degradation", "lower_bound", "gap", "optimal")
                        if k in m},
            "solver": plan.solver, "gap": m["gap"], "spec_hash": shash,
            "settings_hash": settings.hash, "sha256": digest}


def file_sha256(path: Path) -> str | None:
    """The file's SHA-256, or None if it cannot be read."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    except OSError:
        return None
    return h.hexdigest()


def build_library(spec: JobSpec, policy: Policy, max_failures: int, folder: str | Path,
                  settings: Settings = Settings(), jobs: int | None = None, force: bool = False,
                  progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Compute (or complete) the library for `spec` in `folder`; returns the index.

    `progress(done, total)` is called after each situation."""
    check_threshold(spec, max_failures)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shash = spec_hash(spec, policy)
    old_entries = _reusable_entries(folder, spec, shash, force, max_failures)
    wanted = situations(spec, max_failures)
    keep = {}
    for entry in old_entries:
        counts = tuple(entry.get("failed_per_stage", ()))
        if (entry.get("spec_hash") == shash and entry.get("settings_hash") == settings.hash
                and entry.get("sha256") is not None
                and file_sha256(folder / str(entry.get("file", ""))) == entry["sha256"]):
            keep[counts] = entry  # a missing, damaged or replaced plan file is planned again
    todo = [k for k in wanted if k not in keep]
    log.info("library %s: %d situations, %d up to date, %d to plan", folder, len(wanted),
             len(wanted) - len(todo), len(todo))
    zero = (0,) * spec.stages
    entries = dict(keep)
    done = len(wanted) - len(todo)
    if progress:
        progress(done, len(wanted))
    index: dict[str, Any] | None = None

    def save() -> dict[str, Any]:  # after every situation: an interrupted build resumes
        written = _write_index(folder, spec, policy, max_failures, settings, shash, reference,
                               entries, wanted)
        if progress:
            progress(done, len(wanted))
        return written

    # The fault-free situation first: every other entry's degradation is measured against it.
    if zero not in keep:
        entries[zero] = _build_one((spec, policy, zero, settings, None, None, folder, shash))
        todo.remove(zero)
        done += 1
    reference = entries[zero]["metrics"]["period"]
    reference_bound = entries[zero]["metrics"]["lower_bound"]
    if zero not in keep:
        index = save()
    jobs = jobs or max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                       else os.cpu_count() or 1)
    tasks = [(spec, policy, k, settings, reference, reference_bound, str(folder), shash)
             for k in todo]
    with _planning_pool(jobs if len(tasks) > 1 else 1) as run:
        for entry in run(_build_one, tasks):
            entries[tuple(entry["failed_per_stage"])] = entry
            done += 1
            index = save()
    if index is None:  # nothing was planned: the index still records this build's threshold
        index = _write_index(folder, spec, policy, max_failures, settings, shash, reference,
                             entries, wanted)
    listed = {e["file"] for e in index["entries"]}
    for entry in old_entries:  # a --force rebuild leaves no plan file outside its index
        name = str(entry.get("file", ""))
        if name and name not in listed and "/" not in name and (folder / name).is_file():
            (folder / name).unlink()
    return index


@contextmanager
def _planning_pool(jobs: int) -> Iterator[Callable[[Callable, list], Iterable]]:
    """`run(fn, tasks)` yields results in task order, over `jobs` processes. However the
    build ends (an error, Ctrl-C, SIGTERM to the parent), no worker outlives it: the pool is
    terminated on the way out, and on Linux a worker also gets SIGTERM when its parent dies."""
    if jobs <= 1:
        yield lambda fn, tasks: map(fn, tasks)
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    pool = multiprocessing.get_context(method).Pool(jobs, initializer=_worker_setup,
                                                   initargs=(os.getpid(),))
    try:
        yield lambda fn, tasks: pool.imap(fn, tasks, chunksize=1)
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()


def _worker_setup(parent: int) -> None:
    """In a planning worker: die with the parent, and let SIGTERM unwind (so that a plan file
    being written is removed, not left half-written)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, _exit_on_signal)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent:  # the parent died before the line above
            raise SystemExit(1)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _reusable_entries(folder: Path, spec: JobSpec, shash: str, force: bool,
                      max_failures: int) -> list[dict]:
    path = folder / INDEX
    if not path.exists():
        return []
    try:
        index = _check_index(read_json(path, "library index"), path)
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
        dropped = sum(sum(e.get("failed_per_stage", ())) > max_failures for e in index["entries"])
        raise RecycleError(f"{folder} holds a library for up to {index['max_failures']} "
                           f"failures; building it for {max_failures} would drop "
                           f"{plural(dropped, 'situation')}: pass -f {index['max_failures']} "
                           f"to keep it complete, --force to shrink it, or choose another "
                           f"folder")
    return index["entries"]


def _write_index(folder: Path, spec: JobSpec, policy: Policy, max_failures: int,
                 settings: Settings, shash: str, reference: float,
                 entries: dict[tuple[int, ...], dict], wanted: list[tuple[int, ...]]) -> dict:
    order = {k: i for i, k in enumerate(wanted)}
    listed = sorted((e for k, e in entries.items() if k in order),
                    key=lambda e: order[tuple(e["failed_per_stage"])])
    index = {"format": LIBRARY_FORMAT, "version": LIBRARY_VERSION, "spec_hash": shash,
             "spec": spec.to_dict(), "policy": policy.to_dict(), "max_failures": max_failures,
             "settings": settings.to_dict(), "fault_free_period": reference,
             "complete": len(listed) == len(wanted), "entries": listed}
    write_json(folder / INDEX, index)
    return index


def _check_index(data: Any, path: Path) -> dict:
    if not isinstance(data, dict) or data.get("format") != LIBRARY_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise PlanFileError(f"{path}: not a recycle-plan-library index (format is {found!r})")
    if data.get("version") != LIBRARY_VERSION:
        raise PlanFileError(f"{path}: library version {data.get('version')!r} is not supported "
                            f"(this recycle-planner reads version {LIBRARY_VERSION})")
    for key, kind in (("spec_hash", str), ("spec", dict), ("policy", dict),
                      ("max_failures", int), ("entries", list)):
        if not isinstance(data.get(key), kind):
            raise PlanFileError(f"{path}: '{key}' is missing or malformed")
    for i, entry in enumerate(data["entries"]):
        if not (isinstance(entry, dict) and isinstance(entry.get("failed_per_stage"), list)
                and isinstance(entry.get("file"), str) and isinstance(entry.get("placement"), list)
                and isinstance(entry.get("metrics"), dict)):
            raise PlanFileError(f"{path}: entries[{i}] is malformed (needs failed_per_stage, "
                                f"file, placement and metrics)")
        name = entry["file"]
        if "/" in name or "\\" in name or name.startswith("."):
            raise PlanFileError(f"{path}: entries[{i}].file {name!r} must be a file in the folder")
    return data


def _check_entry(spec: JobSpec, entry: dict[str, Any], where: str) -> None:
    """An entry's situation and placement must fit the spec (an edited index is not trusted)."""
    counts = entry["failed_per_stage"]
    if len(counts) != spec.stages or not all(
            isinstance(k, int) and not isinstance(k, bool) and 0 <= k < spec.pipelines
            for k in counts):
        raise PlanFileError(f"{where}.failed_per_stage must be {spec.stages} counts below "
                            f"{spec.pipelines}, got {counts!r}")
    groups = entry["placement"]
    if len(groups) > spec.pipelines or not all(
            isinstance(g, list) and len(set(g)) == len(g) and all(
                isinstance(s, int) and not isinstance(s, bool) and 0 <= s < spec.stages
                for s in g) for g in groups):
        raise PlanFileError(f"{where}.placement must be at most {spec.pipelines} lists of "
                            f"distinct stages below {spec.stages}, got {groups!r}")
    if list(counts_of(groups, spec.stages)) != counts:
        raise PlanFileError(f"{where}.placement {groups!r} does not hold the situation's "
                            f"holes {counts!r}")


@dataclass(frozen=True)
class Lookup:
    """What a launcher needs for a set of dead physical workers."""

    file: Path
    failed_per_stage: tuple[int, ...]
    mapping: Mapping
    entry: dict[str, Any]
    spec: JobSpec

    def plan(self) -> Plan:
        """The plan file, checked against the index: the library's job, this failure set."""
        plan = read_plan(self.file)
        if plan.schedule.spec != self.spec:
            raise PlanFileError(f"{self.file}: the plan is for another job than its library")
        failed = [list(w) for w in plan.failed]
        if failed != [list(w) for w in self.entry.get("failed", failed)] or tuple(
                dead_per_stage(self.spec, plan.failed)) != self.failed_per_stage:
            raise PlanFileError(f"{self.file}: the plan's dead workers {failed} are not the "
                                f"library entry's ({list(self.failed_per_stage)} per stage)")
        return plan

    def to_dict(self) -> dict[str, Any]:
        return {"file": str(self.file), "failed_per_stage": list(self.failed_per_stage),
                "mapping": self.mapping.to_dict(), "placement": self.entry["placement"],
                "failed_logical": self.entry.get("failed", []), "metrics": self.entry["metrics"]}


class PlanLibrary:
    """A built library, opened for lookups. `PlanLibrary.open("plans/").lookup([(1, 3)])`."""

    def __init__(self, folder: Path, index: dict[str, Any]):
        self.folder = folder
        self.index = index
        self.spec = JobSpec.from_dict(index["spec"], f"{folder / INDEX}: spec")
        try:
            self.policy = Policy.from_dict(index["policy"])
        except RecycleError as exc:
            raise PlanFileError(f"{folder / INDEX}: {exc}") from None
        if spec_hash(self.spec, self.policy) != index["spec_hash"]:
            raise PlanFileError(f"{folder / INDEX}: its spec and policy do not match its "
                                f"spec_hash (was the index edited?); rebuild it with "
                                f"'recycle-planner plan-all --force'")
        self.max_failures = int(index["max_failures"])
        for i, entry in enumerate(index["entries"]):
            _check_entry(self.spec, entry, f"{folder / INDEX}: entries[{i}]")
        self._by_counts = {tuple(e["failed_per_stage"]): e for e in index["entries"]}

    @classmethod
    def open(cls, folder: str | Path, spec: JobSpec | None = None) -> "PlanLibrary":
        folder = Path(folder)
        path = folder / INDEX
        if not path.is_file():
            raise PlanFileError(f"{folder}: no plan library here (missing {INDEX}); build one "
                                f"with 'recycle-planner plan-all'")
        lib = cls(folder, _check_index(read_json(path, "library index"), path))
        if spec is not None and spec_hash(spec, lib.policy) != lib.index["spec_hash"]:
            raise RecycleError(f"{folder} was built for another spec (hash "
                               f"{lib.index['spec_hash']}); rebuild it with 'recycle-planner "
                               f"plan-all' for this one")
        return lib

    def _check_folder_is_ours(self) -> None:
        """A folder whose plan files are none of those its index lists holds another library's
        index (copied or moved there): say so rather than call one plan file missing."""
        listed = {str(e["file"]) for e in self.index["entries"]}
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
            if isinstance(other, dict) and other != self.index["spec"]:
                raise PlanFileError(f"{self.folder / INDEX}: this index is another library's: "
                                    f"its plan file {name} is of another job "
                                    f"({other.get('name') or 'unnamed'}); run plan-all for "
                                    f"this folder's job to rebuild its index")

    @property
    def fault_free_period(self) -> float:
        return float(self.index["fault_free_period"])

    def entries(self) -> list[dict[str, Any]]:
        return list(self.index["entries"])

    def entry(self, counts: tuple[int, ...]) -> dict[str, Any] | None:
        return self._by_counts.get(tuple(counts))

    def lookup(self, failed: Iterable[Iterable[int]]) -> Lookup:
        """The plan and mapping for these dead physical workers; an error if a worker is outside
        the grid or listed twice, if a stage has no live worker left, or if the set is beyond
        the library's threshold."""
        dead = check_failed(self.spec, failed)
        counts = dead_per_stage(self.spec, dead)
        if len(dead) > self.max_failures:
            raise FailureSetError(f"{len(dead)} dead workers is beyond this library's threshold "
                                  f"of {self.max_failures}: fall back to a checkpoint restart")
        entry = self._by_counts.get(counts)
        if entry is None:
            raise PlanFileError(f"{self.folder}: the library has no plan for per-stage failures "
                                f"{list(counts)} (incomplete library: run plan-all again)")
        placement = canonical(entry["placement"])
        mapping = map_failure(self.spec, dead, placement)
        path = self.folder / entry["file"]
        digest = file_sha256(path)
        if digest is None or digest != entry.get("sha256", digest):
            self._check_folder_is_ours()
        if digest is None:
            raise PlanFileError(f"{path}: the library's plan file for {list(counts)} is missing "
                                f"(run plan-all again to restore it)")
        if entry.get("sha256") is not None and digest != entry["sha256"]:
            raise PlanFileError(f"{path}: the plan file has changed since the library was built "
                                f"(its SHA-256 differs from the index); run plan-all again")
        return Lookup(path, counts, mapping, entry, self.spec)
