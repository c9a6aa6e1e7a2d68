"""Option types: every number a subcommand takes is a `Number`, whose range comes from
`recycle_planner/limits.py`, the one home of the bounds; NaN, infinity and out-of-range values
are usage errors before any work."""

from __future__ import annotations

import click

from recycle_planner.limits import LIMITS


class Number(click.ParamType):
    """A finite number in the range named `limit` in `LIMITS` (a whole number if it says so)."""

    def __init__(self, limit: str):
        self.limit = limit
        self.range = LIMITS[limit]
        self.name = "integer" if self.range.integer else "float"

    def convert(self, value, param, ctx):
        if isinstance(value, str):
            text = value.strip()
            try:
                value = int(text) if self.range.integer else float(text)
            except ValueError:
                self.fail(f"{value!r} is not {self.range.describe()}", param, ctx)
        problem = self.range.problem(value)
        if problem is not None:
            self.fail(f"{problem}: give {self.range.describe()}", param, ctx)
        return value

    def __repr__(self) -> str:
        return f"Number({self.limit!r})"


def number(limit: str) -> Number:
    return Number(limit)
