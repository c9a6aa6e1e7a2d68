"""Processes in tests: what a test signals besides the process it started."""


def children(pid: int) -> list[int]:
    """The direct children of `pid` (none once it has gone)."""
    try:
        return [int(p) for p in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []
