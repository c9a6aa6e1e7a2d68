"""Durations written the way people say them: `45s`, `30min`, `2h`, `7d`, `1.5h`, `1h30min`;
and sizes and bandwidths (`20GiB`, `12.5GB/s`) with the job spec's units.

Everything in the what-if simulator counts seconds and bytes; this module is the only place
that turns option text into them and seconds back, so that every option and every trace file
reads the same way.
"""

from __future__ import annotations

import math
import re

from recycle_planner.errors import RecycleError, SpecError
from recycle_planner.job.spec import _bytes
from recycle_planner.limits import MAX_DURATION, YEAR

UNITS = {"ms": 1e-3, "s": 1.0, "sec": 1.0, "min": 60.0, "h": 3600.0, "d": 86400.0,
         "w": 604800.0}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_PART = re.compile(r"\s*" + _NUMBER + r"\s*([a-zA-Z]*)\s*")


class DurationError(RecycleError):
    """A duration that cannot be read."""


def parse_duration(text: str | float | int, what: str = "duration",
                   allow_zero: bool = True) -> float:
    """Seconds in `text`: numbers with units (ms, s, min, h, d, w), summed ('1h30min'), or a
    bare number of seconds. 'm' is refused as ambiguous (minutes or months?)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        value = _parse_text(str(text), what)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = "zero or more" if allow_zero else "more than zero"
        raise DurationError(f"{what}: must be {bound}, got {text!r}")
    if value > MAX_DURATION:
        raise DurationError(f"{what}: {text!r} is more than {MAX_DURATION / YEAR:.0f} years")
    return value


def _parse_text(text: str, what: str) -> float:
    """Sum of number-unit parts ('1h30min'); a bare number alone is seconds."""
    parts, pos = [], 0
    while pos < len(text):
        match = _PART.match(text, pos)
        if not match or match.end() == pos:
            break
        parts.append((match.group(1), match.group(2)))
        pos = match.end()
    if not parts or pos != len(text) or (len(parts) > 1 and not all(u for _, u in parts)):
        raise DurationError(f"{what}: {text!r} is not a duration (write for example 45s, "
                            f"30min, 2h, 7d, 1h30min)")
    value = 0.0
    for number, unit in parts:
        unit_key = unit.lower()
        if unit_key == "m":
            raise DurationError(f"{what}: unit 'm' in {text!r} is ambiguous: write 'min' for "
                                f"minutes")
        if unit_key and unit_key not in UNITS:
            raise DurationError(f"{what}: unknown unit {unit!r} in {text!r} (use one of: "
                                f"{', '.join(UNITS)})")
        value += float(number) * UNITS.get(unit_key, 1.0)
    return value


def parse_durations(text: str, what: str = "duration") -> list[float]:
    """A comma-separated list of durations, each more than zero: `6h,2h,30min`."""
    parts = [p for p in str(text).split(",")]
    if not parts or any(not p.strip() for p in parts):
        raise DurationError(f"{what}: {text!r} is not a comma-separated list of durations")
    return [parse_duration(p, what, allow_zero=False) for p in parts]


def parse_size(text: str, what: str, per_second: bool = False) -> float:
    """Bytes (or bytes per second, written with `/s`) in `text`, more than zero: `20GiB`,
    `1.5e9`, `12.5GB/s`."""
    body = str(text).strip()
    if per_second:
        if not body.lower().endswith("/s"):
            raise DurationError(f"{what}: {text!r} is not a bandwidth (write for example "
                                f"12.5GB/s)")
        body = body[:-2]
    try:
        value = _bytes(body, what, what)
    except SpecError:
        example = "12.5GB/s" if per_second else "20GiB"
        raise DurationError(f"{what}: {text!r} is not a {'bandwidth' if per_second else 'size'}"
                            f" (write for example {example})") from None
    if not value > 0:
        raise DurationError(f"{what}: must be more than zero, got {text!r}")
    return value


def format_duration(seconds: float) -> str:
    """The shortest exact-looking spelling: 21600 -> '6h', 1800 -> '30min', 90 -> '90s'."""
    if seconds == 0:
        return "0s"
    for unit in ("d", "h", "min", "s"):
        size = UNITS[unit]
        value = seconds / size
        if value >= 1 and abs(value - round(value)) < 1e-9 * max(1.0, value):
            return f"{int(round(value))}{unit}"
    for unit in ("d", "h", "min", "s"):
        if seconds >= UNITS[unit]:
            return f"{seconds / UNITS[unit]:.3g}{unit}"
    return f"{seconds * 1000:.3g}ms"
