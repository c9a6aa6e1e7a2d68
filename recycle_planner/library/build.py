"""plan-all: compute or complete a library, resumably and in parallel."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable

from recycle_planner.job.policy import Policy
from recycle_planner.job.situations import check_threshold, situations
from recycle_planner.job.spec import JobSpec
from recycle_planner.library.entries import ON_DEMAND, REFINED, build_entry
from recycle_planner.library.hashing import file_sha256, spec_hash
from recycle_planner.library.index import reusable_entries, write_index
from recycle_planner.library.pool import planning_pool
from recycle_planner.library.settings import Settings
from recycle_planner.timing.metrics import Metrics

log = logging.getLogger("recycle_planner.library")


def build_library(spec: JobSpec, policy: Policy, max_failures: int, folder: str | Path,
                  settings: Settings = Settings(), jobs: int | None = None, force: bool = False,
                  progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Compute (or complete) the library for `spec` in `folder`; returns the index.

    `progress(done, total)` is called after each situation."""
    check_threshold(spec, max_failures)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shash = spec_hash(spec, policy)
    old_entries = reusable_entries(folder, spec, shash, force, max_failures)
    wanted = situations(spec, max_failures)
    keep = {}
    to_prove = {}  # --prove: intact entries that are not proven yet, improved from their plan
    for entry in old_entries:
        counts = tuple(entry.get("failed_per_stage", ()))
        if (entry.get("spec_hash") == shash and entry.get("settings_hash") == settings.hash
                and entry.get("sha256") is not None
                and file_sha256(folder / str(entry.get("file", ""))) == entry["sha256"]):
            # a missing, damaged or replaced plan file is planned again
            if settings.prove_work is None or Metrics.from_dict(entry["metrics"]).optimal or \
                    (entry.get("proved") or 0) >= settings.prove_work:
                keep[counts] = entry
            else:
                to_prove[counts] = entry
    # Plans made at run time for situations beyond this threshold stay while their file is intact.
    within = set(wanted)
    made = {tuple(e["failed_per_stage"]): e for e in old_entries
            if e.get("made") in (ON_DEMAND, REFINED) and tuple(e["failed_per_stage"]) not in within
            and e.get("sha256") is not None
            and file_sha256(folder / str(e.get("file", ""))) == e["sha256"]}
    todo = [k for k in wanted if k not in keep]
    log.info("library %s: %d situations, %d up to date, %d to plan", folder, len(wanted),
             len(wanted) - len(todo), len(todo))
    zero = (0,) * spec.stages
    entries = {**made, **keep, **to_prove}  # an interrupted --prove keeps what it has not reached
    done = len(wanted) - len(todo)
    if progress:
        progress(done, len(wanted))
    index: dict[str, Any] | None = None

    def save() -> dict[str, Any]:  # after every situation: an interrupted build resumes
        written = write_index(folder, spec, policy, max_failures, settings, shash, reference,
                               entries, wanted)
        if progress:
            progress(done, len(wanted))
        return written

    # The fault-free situation first: every other entry's degradation is measured against it.
    if zero not in keep:
        entries[zero] = build_entry((spec, policy, zero, settings, None, folder, shash,
                                     to_prove.get(zero)))
        todo.remove(zero)
        done += 1
    fault_free = Metrics.from_dict(entries[zero]["metrics"])
    reference = fault_free.period
    if zero not in keep:
        index = save()
    jobs = jobs or max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                       else os.cpu_count() or 1)
    tasks = [(spec, policy, k, settings, reference, str(folder), shash,
              to_prove.get(k)) for k in todo]
    with planning_pool(jobs if len(tasks) > 1 else 1) as run:
        for entry in run(build_entry, tasks):
            entries[tuple(entry["failed_per_stage"])] = entry
            done += 1
            index = save()
    if index is None:  # nothing was planned: the index still records this build's threshold
        index = write_index(folder, spec, policy, max_failures, settings, shash, reference,
                             entries, wanted)
    listed = {e["file"] for e in index["entries"]}
    for entry in old_entries:  # a --force rebuild leaves no plan file outside its index
        name = str(entry.get("file", ""))
        if name and name not in listed and "/" not in name and (folder / name).is_file():
            (folder / name).unlink()
    return index
