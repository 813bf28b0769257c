"""Greedy validation BLEU of training runs side by side, averaged over
windows of updates: a steadier comparison than single validations; and
each run's median training throughput (target tokens/s). ``--column
val_loss`` compares validation loss instead (lower is better): unlike greedy
BLEU it does not depend on the decoding code a run validated with.

    python experiments/val_windows.py runs/a runs/b [--window 500] [--upto N] [--column val_loss]

Reads every ``logs/version_*/metrics.csv`` of each run directory (a resumed
run has several); a validation logged at step ``s`` (0-based) belongs to
update ``s + 1``, and window ``(lo, hi]`` holds the updates after ``lo`` up
to ``hi``.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from statistics import median


def logged(run_dir: Path, column: str) -> dict[int, float]:
    """Update number -> the value of ``column`` logged there (a later version wins)."""
    logs = sorted((run_dir / "logs").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    if not logs:
        sys.exit(f"{run_dir}: no logs/version_*/metrics.csv")
    out = {}
    for path in logs:
        with open(path) as f:
            for row in csv.DictReader(f):
                if row.get(column):
                    out[int(row["step"]) + 1] = float(row[column])
    return out


def validations(run_dir: Path, column: str = "val_bleu") -> dict[int, float]:
    """Update number -> greedy validation BLEU (or another validation ``column``)."""
    out = logged(run_dir, column)
    if not out:
        sys.exit(f"{run_dir}: no {column} logged yet")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--window", type=int, default=500, help="updates per window (default 500)")
    parser.add_argument("--upto", type=int, default=None, help="ignore validations after this update")
    parser.add_argument("--column", choices=("val_bleu", "val_loss"), default="val_bleu", help="what to compare")
    args = parser.parse_args()
    runs = [validations(r, args.column) for r in args.runs]
    if args.upto is not None:
        runs = [{step: b for step, b in r.items() if step <= args.upto} for r in runs]
    last = max(max(r) for r in runs)
    digits = 2 if args.column == "val_bleu" else 4
    print(f"{'updates':>13}" + "".join(f"{r.name[-24:]:>26}" for r in args.runs))
    for lo in range(0, last, args.window):
        hi = min(lo + args.window, last)
        cells = []
        for r in runs:
            scores = [b for step, b in r.items() if lo < step <= hi]
            cells.append(f"{sum(scores) / len(scores):.{digits}f} ({len(scores)})" if scores else "-")
        print(f"{lo + 1:>6}-{hi:<6}" + "".join(f"{c:>26}" for c in cells))
    for name, r in zip(args.runs, runs):
        step = max(r, key=r.get) if args.column == "val_bleu" else min(r, key=r.get)
        best, final = f"{r[step]:.{digits}f}", f"{r[max(r)]:.{digits}f}"
        print(f"{name}: best {best} at update {step}, last {final} at update {max(r)}", end="")
        speed = [v for update, v in logged(name, "tok_per_s").items() if args.upto is None or update <= args.upto]
        print(f", median {median(speed):,.0f} target tokens/s" if speed else "")


if __name__ == "__main__":
    main()
