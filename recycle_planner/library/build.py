"""plan-all: compute or complete a library, resumably and in parallel, as the folder's only
writer (`lock.py`)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

from recycle_planner.job.policy import Policy
from recycle_planner.job.situations import check_threshold, situations
from recycle_planner.job.spec import JobSpec
from recycle_planner.library.entries import MADE_AT_RUN_TIME, LibraryEntry, build_entry
from recycle_planner.library.hashing import spec_hash
from recycle_planner.library.index import LibraryIndex, reusable_entries
from recycle_planner.library.lock import library_lock
from recycle_planner.library.pool import planning_pool
from recycle_planner.library.settings import Settings

log = logging.getLogger("recycle_planner.library")


def build_library(spec: JobSpec, policy: Policy, max_failures: int, folder: str | Path,
                  settings: Settings = Settings(), jobs: int | None = None, force: bool = False,
                  progress: Callable[[int, int], None] | None = None) -> LibraryIndex:
    """Compute (or complete) the library for `spec` in `folder`; returns its index.

    `progress(done, total)` is called after each situation. A folder this build created is
    removed again if the build fails before it has written anything there."""
    check_threshold(spec, max_failures)
    folder = Path(folder)
    created = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with library_lock(folder, "plan-all"):
            return _build(spec, policy, max_failures, folder, settings, jobs, force, progress)
    except BaseException:
        for path in created:  # innermost first; a folder with anything in it stays
            try:
                path.rmdir()
            except OSError:
                break
        raise


def _build(spec: JobSpec, policy: Policy, max_failures: int, folder: Path, settings: Settings,
           jobs: int | None, force: bool, progress: Callable[[int, int], None] | None
           ) -> LibraryIndex:
    shash = spec_hash(spec, policy)
    old_entries = reusable_entries(folder, spec, shash, force, max_failures)
    wanted = situations(spec, max_failures)
    within = set(wanted)
    keep: dict[tuple[int, ...], LibraryEntry] = {}
    to_prove = {}  # --prove: intact entries that are not proven yet, improved from their plan
    made = {}  # plans made at run time beyond this threshold stay while their file is intact
    for entry in old_entries:
        if entry.spec_hash != shash or not entry.intact(folder):
            continue  # stale, or a missing, damaged or replaced plan file: planned again
        if entry.counts not in within:
            if entry.made in MADE_AT_RUN_TIME:
                made[entry.counts] = entry
        elif entry.settings_hash != settings.hash:
            continue
        elif settings.prove_work is None or entry.metrics.optimal or \
                (entry.proved or 0) >= settings.prove_work:
            keep[entry.counts] = entry
        else:
            to_prove[entry.counts] = entry
    todo = [k for k in wanted if k not in keep]
    log.info("library %s: %d situations, %d up to date, %d to plan", folder, len(wanted),
             len(wanted) - len(todo), len(todo))
    # an interrupted --prove keeps what it has not reached
    index = LibraryIndex(spec, policy, max_failures, settings.to_dict(),
                         entries=tuple({**made, **keep, **to_prove}.values()))
    done = len(wanted) - len(todo)
    if progress:
        progress(done, len(wanted))

    def add(entry: LibraryEntry) -> None:  # after every situation: an interrupted build resumes
        nonlocal index, done
        index = index.with_entry(entry)
        index.write(folder)
        done += 1
        if progress:
            progress(done, len(wanted))

    # The fault-free situation first: every other entry's degradation is measured against it.
    zero = (0,) * spec.stages
    if zero not in keep:
        add(build_entry((spec, policy, zero, settings, None, folder, shash,
                         to_prove.get(zero))))
        todo.remove(zero)
    reference = index.fault_free_period
    jobs = jobs or max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                       else os.cpu_count() or 1)
    tasks = [(spec, policy, k, settings, reference, str(folder), shash,
              to_prove.get(k)) for k in todo]
    with planning_pool(jobs if len(tasks) > 1 else 1) as run:
        for entry in run(build_entry, tasks):
            add(entry)
    index.write(folder)  # also when nothing was planned: the index records this threshold
    listed = {e.file for e in index.entries}
    for entry in old_entries:  # a --force rebuild leaves no plan file outside its index
        if entry.file not in listed and (folder / entry.file).is_file():
            (folder / entry.file).unlink()
    return index
