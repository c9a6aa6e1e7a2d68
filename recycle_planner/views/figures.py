"""Writing matplotlib figures: headless, format from the file's extension, atomically."""

from __future__ import annotations

from pathlib import Path

from recycle_planner.errors import RecycleError
from recycle_planner.io import atomic_write

FORMATS = (".png", ".svg", ".pdf")


def picture_format(path: Path) -> str:
    """'png', 'svg' or 'pdf' from the name ('-', standard output, is PNG); a clear error for
    anything else, before any work."""
    if str(path) == "-":
        return "png"
    if path.suffix.lower() not in FORMATS:
        raise RecycleError(f"{path}: unknown picture format {path.suffix!r} (use "
                           f"{', '.join(FORMATS)})")
    return path.suffix.lower().lstrip(".")


def pyplot():
    """matplotlib.pyplot on the Agg backend: no display is needed or used."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, fmt: str) -> None:
    """Write the figure atomically and release it."""
    import matplotlib.pyplot as plt

    try:
        atomic_write(path, lambda fh: fig.savefig(fh, format=fmt, dpi=130), binary=True)
    finally:
        plt.close(fig)
