"""How a library's plans are computed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from recycle_planner import __version__
from recycle_planner.library.hashing import digest
from recycle_planner.solvers.registry import LIBRARY_NODE_LIMIT, SolverSettings


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
        return digest(self.to_dict())
