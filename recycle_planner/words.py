"""Numbers and counts as people read them: 133,310 not 1.3331e+05, "1 pipeline" not
"1 pipelines". One home for the figures the CLI, reports and errors print."""

from __future__ import annotations

IRREGULAR = {"micro-batch": "micro-batches"}


def plural(n: int, noun: str) -> str:
    """'1 pipeline', '2 pipelines', '1 micro-batch', '8 micro-batches'."""
    return f"{n:,} {noun if n == 1 else IRREGULAR.get(noun, noun + 's')}"


def number(x: float, digits: int = 4) -> str:
    """`digits` significant digits, whole numbers with thousands separators from 10^digits
    on, never an exponent for a figure a job can have."""
    if abs(x) >= 10 ** digits:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def grid(spec) -> str:
    """'8 stages x 4 pipelines x 8 micro-batches' (', 2 chunks per worker (v)' where
    workers hold several)."""
    chunks = "" if spec.chunks == 1 else f", {spec.chunks} chunks per worker ({spec.layout})"
    return (f"{plural(spec.stages, 'stage')} x {plural(spec.pipelines, 'pipeline')} x "
            f"{plural(spec.microbatches, 'micro-batch')}{chunks}")


def duration(seconds: float) -> str:
    """'40 s', '7 min', '2.5 h': an estimate's size, not its digits."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
