"""Draw the loss curves of training runs in one picture.

    python examples/plot_losses.py RUN_DIR[=LABEL] ... -o losses.png

Each RUN_DIR is a run folder of `recycle-planner launch` (its result.json is read); the
iterations where a worker died are marked on its curve.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR[=LABEL]")
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument("--title", default="training loss")
    args = parser.parse_args(argv)
    fig, ax = plt.subplots(figsize=(7, 4))
    styles = [dict(lw=3, alpha=0.5), dict(lw=1.2, ls="--", marker=".", ms=4)]
    for i, item in enumerate(args.runs):
        folder, _, label = item.partition("=")
        result = json.loads((Path(folder) / "result.json").read_text())
        losses = result["losses"]
        ax.plot(range(len(losses)), losses, label=label or folder, **styles[i % 2])
        for event in result["events"]:
            if event["kind"] == "generation" and event.get("dead"):
                ax.axvline(event["restart"], color="red", lw=0.8, ls=":")
                dead = ", ".join(f"{d}:{s}" for d, s in event["dead"])
                ax.annotate(f" {dead} dead", (event["restart"], max(losses)), color="red",
                            fontsize=8)
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean loss over the global batch")
    ax.set_title(args.title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)


if __name__ == "__main__":
    main()
