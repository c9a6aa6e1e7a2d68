"""A MILP in the form every backend reads: columns with bounds and integrality, rows
lb <= a.x <= ub, and linear expressions to build rows from."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

INF = math.inf


@dataclass
class LinearModel:
    """A MILP in a form every backend reads: columns with bounds, rows lb <= a.x <= ub."""

    lb: list[float] = field(default_factory=list)
    ub: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    cost: list[float] = field(default_factory=list)
    rows: list[tuple[list[int], list[float], float, float]] = field(default_factory=list)

    def var(self, lb: float = 0.0, ub: float = INF, integer: bool = False,
            cost: float = 0.0) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        self.integer.append(integer)
        self.cost.append(cost)
        return len(self.lb) - 1

    def binary(self) -> int:
        return self.var(0.0, 1.0, integer=True)

    def row(self, terms: dict[int, float], lb: float = -INF, ub: float = INF) -> None:
        idx = [i for i, c in terms.items() if c != 0.0]
        self.rows.append((idx, [terms[i] for i in idx], lb, ub))

    def size(self) -> dict[str, int]:
        return {"variables": len(self.lb), "binaries": int(sum(self.integer)),
                "constraints": len(self.rows), "nonzeros": sum(len(r[0]) for r in self.rows)}

    def violation(self, values: list[float]) -> float:
        """Largest violation of any row or bound by `values` (0 when feasible)."""
        worst = 0.0
        for i, v in enumerate(values):
            worst = max(worst, self.lb[i] - v, v - self.ub[i])
        for idx, coef, lb, ub in self.rows:
            a = sum(c * values[i] for i, c in zip(idx, coef))
            worst = max(worst, lb - a, a - ub)
        return worst


class Expr(dict):
    """A linear expression: {column: coefficient} plus a constant."""

    def __init__(self, terms: dict[int, float] | None = None, const: float = 0.0):
        super().__init__(terms or {})
        self.const = const

    def add(self, other: "Expr | float", scale: float = 1.0) -> "Expr":
        out = Expr(dict(self), self.const)
        if isinstance(other, Expr):
            for k, v in other.items():
                out[k] = out.get(k, 0.0) + scale * v
            out.const += scale * other.const
        else:
            out.const += scale * other
        return out
