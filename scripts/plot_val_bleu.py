"""Greedy validation BLEU against wall-clock training minutes, one curve per
run (the README's plot), with reference points beside them.

    python scripts/plot_val_bleu.py RUN [RUN ...] --out curve.png [--point "LABEL=MINUTES:BLEU" ...]

Reads the ``val_bleu`` and ``minutes`` columns of every ``logs/version_*/metrics.csv``
of each run directory; a resumed run's versions are laid end to end.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from mt.inspect.plotting import plt, save_figure


def curve(run: Path) -> list[tuple[float, float]]:
    """(minutes, validation BLEU) of every validation of ``run``, in order."""
    versions = sorted((run / "logs").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    points, offset = [], 0.0
    for version in versions:
        with open(version / "metrics.csv", newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("val_bleu") and r.get("minutes")]
        points += [(offset + float(r["minutes"]), float(r["val_bleu"])) for r in rows]
        offset = points[-1][0] if points else offset
    return points


def point(text: str) -> tuple[str, float, float]:
    label, sep, where = text.rpartition("=")
    minutes, sep2, bleu = where.partition(":")
    try:
        if not (sep and sep2 and label):
            raise ValueError
        return label, float(minutes), float(bleu)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LABEL=MINUTES:BLEU") from None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run directories")
    p.add_argument("--out", required=True, help="image file: .png, .svg or .pdf")
    p.add_argument("--point", type=point, action="append", default=[], help="a reference: LABEL=MINUTES:BLEU")
    p.add_argument("--title", default="greedy BLEU on the validation split during training")
    args = p.parse_args()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for run in args.runs:
        points = curve(run)
        if not points:
            sys.exit(f"{run}: no validation with val_bleu and minutes in logs/version_*/metrics.csv")
        ax.plot(*zip(*points), marker=".", label=str(run))
    for label, minutes, bleu in args.point:
        ax.plot([minutes], [bleu], marker="D", linestyle="none", label=label)
    ax.set_xlabel("training minutes (wall-clock, validations included)")
    ax.set_ylabel("BLEU")
    ax.set_title(args.title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    save_figure(fig, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
