"""One library entry: planning a situation into its plan file and index entry, and checking an
entry read back against the job."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from recycle_planner.errors import PlanFileError
from recycle_planner.files.planfile import read_plan, write_plan
from recycle_planner.job.situations import Placement, counts_of, failure_sets
from recycle_planner.job.spec import JobSpec
from recycle_planner.job.workers import dead_per_stage
from recycle_planner.library.hashing import file_sha256
from recycle_planner.library.placement import plan_best_placement
from recycle_planner.library.prove import prove_plan
from recycle_planner.programs.check import check_plan
from recycle_planner.timing.metrics import Metrics
from recycle_planner.timing.plan import Plan


PLAN_ALL, ON_DEMAND, REFINED = "plan-all", "on-demand", "refined"
MADE = (PLAN_ALL, ON_DEMAND, REFINED)
"""Who made an entry: plan-all, the coordinator when it met a situation the library lacked
(the fast solver under a time budget), or the background refinement of such a plan."""
MADE_AT_RUN_TIME = (ON_DEMAND, REFINED)

LIBRARY_FILE = re.compile(r"k[0-9]+(-[0-9]+)*(\.[a-z]+[0-9]*)?\.json\.gz")  # situation_file's


def situation_file(counts: tuple[int, ...], made: str | None = None, serial: int = 0) -> str:
    """`k0-1-0-0.json.gz` for plan-all; a plan made at run time gets its own name
    (`k0-1-0-0.ondemand1.json.gz`), so that a worker never mistakes it for one it loaded."""
    tag = "" if made in (None, PLAN_ALL) else f".{made.replace('-', '')}{serial}"
    return "k" + "-".join(str(k) for k in counts) + tag + ".json.gz"



@dataclass(frozen=True)
class LibraryEntry:
    """One situation in index.json. The optional fields are absent from hand-made or older
    indexes; `sha256` checks the plan file, the hashes decide whether a rebuild keeps it."""

    failed_per_stage: list[int]
    file: str
    placement: list[list[int]]
    metrics: Metrics                        # the plan's, Metrics.entry()
    failed: list[list[int]] | None = None   # the plan's dead workers (logical)
    failure_sets: int | None = None         # physical failure sets this entry covers
    solver: dict[str, Any] | None = None
    gap: float | None = None
    spec_hash: str | None = None
    settings_hash: str | None = None
    sha256: str | None = None
    proved: float | None = None             # the --prove budget this entry's plan has had
    made: str | None = None                 # one of MADE; absent: plan-all

    def to_dict(self) -> dict[str, Any]:
        order = ("failed_per_stage", "file", "placement", "failed", "failure_sets", "metrics",
                 "solver", "gap", "spec_hash", "settings_hash", "sha256", "proved", "made")
        out = {k: getattr(self, k) for k in order if getattr(self, k) is not None}
        return dict(out, metrics=self.metrics.to_dict())

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(self.failed_per_stage)

    @property
    def period(self) -> float:
        return self.metrics.period

    def intact(self, folder: Path) -> bool:
        """Whether its plan file is in `folder` with the SHA-256 the entry recorded."""
        return self.sha256 is not None and file_sha256(folder / self.file) == self.sha256

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "LibraryEntry":
        """The entry `data`, or a PlanFileError naming `where` if its shape is wrong."""
        if not (isinstance(data, dict) and isinstance(data.get("failed_per_stage"), list)
                and isinstance(data.get("file"), str) and isinstance(data.get("placement"), list)
                and isinstance(data.get("metrics"), dict)):
            raise PlanFileError(f"{where} is malformed (needs failed_per_stage, file, placement "
                                f"and metrics)")
        if data.get("made") not in (None, *MADE):
            raise PlanFileError(f"{where}.made must be one of {', '.join(MADE)}, got "
                                f"{data.get('made')!r}")
        name = data["file"]
        if "/" in name or "\\" in name or name.startswith("."):
            raise PlanFileError(f"{where}.file {name!r} must be a file in the folder")
        values = {f.name: data.get(f.name) for f in fields(cls)}
        return cls(**dict(values, metrics=Metrics.from_dict(data["metrics"], where)))

    def check(self, spec: JobSpec, where: str) -> None:
        """The situation and placement must fit the spec (an edited index is not trusted)."""
        counts = self.failed_per_stage
        if len(counts) != spec.stages or not all(
                isinstance(k, int) and not isinstance(k, bool) and 0 <= k < spec.pipelines
                for k in counts):
            raise PlanFileError(f"{where}.failed_per_stage must be {spec.stages} counts below "
                                f"{spec.pipelines}, got {counts!r}")
        groups = self.placement
        if len(groups) > spec.pipelines or not all(
                isinstance(g, list) and len(set(g)) == len(g) and all(
                    isinstance(s, int) and not isinstance(s, bool) and 0 <= s < spec.stages
                    for s in g) for g in groups):
            raise PlanFileError(f"{where}.placement must be at most {spec.pipelines} lists of "
                                f"distinct stages below {spec.stages}, got {groups!r}")
        if list(counts_of(groups, spec.stages)) != counts:
            raise PlanFileError(f"{where}.placement {groups!r} does not hold the situation's "
                                f"holes {counts!r}")


def build_entry(args: tuple) -> LibraryEntry:
    """Plan one situation (the best placement), write its plan file; its index entry."""
    spec, policy, counts, settings, reference, folder, shash, old = args
    if old is not None:  # --prove on an entry already built: start from its plan
        plan = read_plan(Path(folder) / old.file)
        placement = tuple(tuple(g) for g in old.placement)
    else:
        plan, placement = plan_best_placement(spec, policy, counts, settings, reference)
    if settings.prove_work is not None and not plan.metrics.optimal:
        ref = plan.metrics.fault_free_period if reference is None else reference
        plan = prove_plan(plan, ref, settings.prove_work)
    return store_plan(spec, plan, placement, Path(folder), situation_file(counts), shash,
                      settings.hash, PLAN_ALL, settings.prove_work)


def store_plan(spec: JobSpec, plan: Plan, placement: Placement, folder: Path, name: str,
               shash: str, settings_hash: str | None, made: str | None = None,
               proved: float | None = None) -> LibraryEntry:
    """Check that its programs are safe on NCCL (once per plan: workers trust the library),
    write `plan` (compact, atomically) as `folder/name`; its index entry, with the file's
    SHA-256."""
    check_plan(plan)
    counts = tuple(dead_per_stage(spec, plan.failed))
    plan = Plan(plan.schedule, plan.timing, plan.metrics, plan.solver,
                mapping={"placement": [list(g) for g in placement]})
    digest = hashlib.sha256(write_plan(plan, folder / name, compact=True)).hexdigest()
    m = plan.metrics
    return LibraryEntry(
        failed_per_stage=list(counts), file=name, placement=[list(g) for g in placement],
        failed=[list(w) for w in plan.failed], failure_sets=failure_sets(spec, counts),
        metrics=m.entry(), solver=plan.solver, gap=m.gap,
        spec_hash=shash, settings_hash=settings_hash, sha256=digest, proved=proved, made=made)
