"""The plan library: the best plan for every failure situation up to a threshold, and lookup.

A folder with one plan file per situation and `index.json`:

    {"format": "recycle-plan-library", "version": 3, "spec_hash": "...", "spec": {...},
     "policy": {...}, "max_failures": 2, "settings": {...}, "fault_free_period": 501.4,
     "entries": [{"failed_per_stage": [0, 1, 0, 0], "file": "k0-1-0-0.json.gz",
                  "placement": [[1]], "failed": [[0, 1]], "failure_sets": 4,
                  "metrics": {...}, "solver": {...}, "gap": 0.0, "spec_hash": "...",
                  "settings_hash": "...", "sha256": "...", "made": "plan-all"}, ...],
     "replaced": [...]}

Plan files are compact (files/planfile.py: per-worker action strings, times recomputed on
load): 23 KB for a 200k-op plan. The library is also a cache that runs fill: the coordinator
plans a dead set it lacks on demand (`made: on-demand`, its own file name) and a background
process may replace that entry with a better plan (`made: refined`; the replaced entry stays
under `replaced` for a generation that still runs it). A version-1 index (timed plan files)
is still read.

Every entry records its plan file's SHA-256, so a missing, truncated or swapped plan file is
found before a launcher runs it. Building is parallel over processes, resumable (an entry whose
file is intact and whose spec and settings hashes match is kept) and deterministic: each
situation's plan depends only on the spec, the policy and the settings, the MILP's budget is a
node limit (one thread, fixed seed) and its time limit only a safety net that a normal run does
not reach. A launcher looks up the physical dead workers and gets the plan file plus the
physical -> logical mapping.

One writer at a time: plan-all (for its whole build) and a run adding a plan (for that
addition) hold the folder's lock (`lock.py`); a second writer gets a `LibraryBusy` naming the
holder, and a lock left by a crashed writer is detected and taken over.

The package, one module per job: `build.py` (plan-all), `placement.py` (the best placement of
a situation's holes), `entries.py` (one entry: its plan file and index record, and its checks),
`index.py` (index.json as the typed `LibraryIndex`, its only read and write path), `lock.py`
(the writer's lock), `hashing.py`, `settings.py`, `pool.py` (the process pool), `lookup.py`
(`PlanLibrary`, `Lookup`, `MissingPlan`) and `ondemand.py` (planning at run time: fast under a
budget, then refined in the background).
"""

from recycle_planner.library.build import build_library
from recycle_planner.library.index import LibraryIndex
from recycle_planner.library.lock import LibraryBusy, library_lock
from recycle_planner.library.lookup import Lookup, PlanLibrary
from recycle_planner.library.settings import Settings

__all__ = ["LibraryBusy", "LibraryIndex", "Lookup", "PlanLibrary", "Settings", "build_library",
           "library_lock"]
