"""Errors a user can cause. The CLI prints them as one line and exits 2; nothing else is caught."""


class RecycleError(Exception):
    """Base class: bad input (spec, failure set, plan file, library) rather than a bug."""


class SpecError(RecycleError):
    """The job spec is malformed or impossible."""


class FailureSetError(RecycleError):
    """A failure set names workers outside the grid, repeats one, or kills a whole stage."""


class PlanFileError(RecycleError):
    """A plan or library file is truncated, foreign, or inconsistent with itself."""


class ScheduleError(RecycleError):
    """A schedule cannot be built or timed (for example it deadlocks)."""


class OutputError(RecycleError):
    """An output cannot be written: no such folder, read-only, full disk, no permission."""
