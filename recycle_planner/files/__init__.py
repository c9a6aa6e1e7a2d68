"""Plan files and exports: the versioned JSON plan format and torch's compute-only CSV. The
plan library (`recycle_planner.library`) stores one plan file per situation."""
