"""Plot ``held_snapshot.py`` timelines: consumed/s, publish-to-consume p99 and the queue
table's dead tuples over time, one line per run, the held phase shaded.

Usage (from the repository root)::

    python benchmarks/plot_held_snapshot.py LABEL=RESULTS.json[:TARGET] ... \
        [--out docs/held_snapshot.png]

``TARGET`` picks one target of a file that holds several (default: the first).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _timeline(spec: str) -> tuple[str, list[dict[str, Any]]]:
    label, _, path = spec.partition("=")
    file, _, target = path.partition(":")
    results = json.loads(Path(file).read_text())["results"]
    chosen = next((r for r in results if r["target"] == target), None) if target else None
    return label, (chosen or results[0])["timeline"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=RESULTS.json[:TARGET]")
    parser.add_argument("--out", type=Path, default=Path("docs/held_snapshot.png"))
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 8.5), sharex=True)
    panels = (
        ("consumed_per_s", "consumed / s"),
        ("p99_ms", "publish -> consume p99 (ms, log)"),
        ("dead_tuples", "dead tuples in the queue table"),
    )
    shaded = False
    for spec in args.runs:
        label, timeline = _timeline(spec)
        t = [row["t"] / 60 for row in timeline]
        held = [row["t"] / 60 for row in timeline if row["phase"] == "held"]
        if held and not shaded:
            for ax in axes:
                ax.axvspan(min(held) - 1 / 6, max(held), color="0.9", zorder=0)
            shaded = True
        for ax, (key, _) in zip(axes, panels, strict=True):
            ax.plot(t, [row.get(key) for row in timeline], label=label, linewidth=1.4)
    for ax, (key, title) in zip(axes, panels, strict=True):
        ax.set_ylabel(title)
        ax.grid(True, linewidth=0.3)
        if key == "p99_ms":
            ax.set_yscale("log")
    axes[0].legend(loc="lower left", fontsize=8)
    axes[0].set_title("500 msgs/s; grey: a REPEATABLE READ session idle in its transaction")
    axes[-1].set_xlabel("minutes")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
