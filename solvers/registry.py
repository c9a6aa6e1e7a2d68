"""The solver registry: every solver by name, what it reads, and the one home of its defaults.

The command line's --solver choices and help, the library's `Settings` and `planner.solve` all
read `SOLVERS`. Adding a solver is one entry there: a function
`run(spec, policy, failed, settings, fast=None) -> Solution` (see `portfolio.py`) and the
settings it reads, for example

    "tabu": SolverEntry(solve_tabu, "tabu search with a time limit", ("time_limit",)),

`SolverSettings` is how one situation is solved; it checks the solver and MILP backend names
(the only place they are checked) and travels in library indexes as `to_dict()`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable

from recycle_planner.errors import RecycleError
from recycle_planner.limits import LIMITS
from recycle_planner.solvers import Solution
from recycle_planner.solvers.milp_backends import BACKENDS
from recycle_planner.solvers.portfolio import (solve_auto, solve_cp, solve_dp, solve_heuristic,
                                               solve_milp)

TIME_LIMIT = 10.0       # seconds per situation for the solvers with a budget
LIBRARY_NODE_LIMIT = 500  # the MILP's deterministic budget in a library (the time limit is a net)
LIBRARY_WORK_LIMIT = 1.0  # the CP engine's deterministic seconds per situation in a library
PROVE_WORK = 30.0       # plan-all --prove: the CP engine's deterministic seconds per situation


@dataclass(frozen=True)
class SolverEntry:
    run: Callable[..., Solution]  # (spec, policy, failed, settings, fast=None) -> Solution
    summary: str                  # one phrase for --solver's help
    options: tuple[str, ...] = ()  # the SolverSettings fields it reads beyond its name


SOLVERS: dict[str, SolverEntry] = {
    "heuristic": SolverEntry(solve_heuristic, "list scheduling (fast, any size)"),
    "dp": SolverEntry(solve_dp, "dynamic programs that pack re-routed work into idle time"),
    "milp": SolverEntry(solve_milp, "exact model with a time limit",
                        ("time_limit", "backend", "node_limit")),
    "cp": SolverEntry(solve_cp, "the constraint-programming engine (OR-Tools CP-SAT) with a "
                      "work limit, the same plan on every machine", ("work_limit", "prove")),
    "auto": SolverEntry(solve_auto, "the fast solvers, then the exact engines that fit the "
                        "budget while a gap is left, then swaps on the plan's critical path",
                        ("time_limit", "backend", "node_limit", "work_limit")),
}


def solver_help() -> str:
    """--solver's help: each solver's name and summary."""
    return "; ".join(f"{name}: {entry.summary}" for name, entry in SOLVERS.items()) + "."


@dataclass(frozen=True)
class SolverSettings:
    """How one situation is solved. Unknown solver or backend names, and budgets that are not
    finite or out of range, are refused here."""

    solver: str = "heuristic"
    time_limit: float = TIME_LIMIT
    backend: str = "highs"
    node_limit: int | None = None  # also stop the MILP after this many nodes (reproducible)
    work_limit: float | None = None  # the CP engine's deterministic seconds (None: time_limit)
    prove: bool = False  # the CP engine spends its budget on closing the gap (bisection)

    def __post_init__(self) -> None:
        for f in fields(self):  # budgets and limits: finite and in range (limits.py)
            value = getattr(self, f.name)
            if f.name in LIMITS and value is not None:
                LIMITS[f.name].check(value, f.name)
        if self.solver not in SOLVERS:
            raise RecycleError(f"unknown solver {self.solver!r} (expected one of: "
                               f"{', '.join(SOLVERS)})")
        if self.backend not in BACKENDS:
            raise RecycleError(f"unknown MILP backend {self.backend!r} (expected one of: "
                               f"{', '.join(BACKENDS)})")

    @classmethod
    def of(cls, solver: "str | SolverSettings | None" = None, **options: Any) -> "SolverSettings":
        """Settings from a name or other settings, with `options` (None: the default) changed."""
        changes = {k: v for k, v in options.items() if v is not None}
        if isinstance(solver, SolverSettings):
            return replace(solver, **changes)
        if solver is not None:
            changes["solver"] = solver
        return cls(**changes)

    @property
    def cp_work(self) -> float:
        """The CP engine's budget in CP-SAT's deterministic seconds (about CPU seconds)."""
        return self.time_limit if self.work_limit is None else float(self.work_limit)

    @property
    def entry(self) -> SolverEntry:
        return SOLVERS[self.solver]

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SolverSettings":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
