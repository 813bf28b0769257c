"""A one-line progress report on the terminal, for ``mt translate`` on large files:
lines done (of how many), lines per second and the time left, redrawn in place at
most twice a second."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO


def count_lines(path: str | Path) -> int | None:
    """The lines of a regular file (its newlines, and a last line without one); None
    for what cannot be read twice (a pipe, a FIFO) or read at all."""
    path = Path(path)
    try:
        if not path.is_file():
            return None
        lines, last = 0, b"\n"
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                lines += block.count(b"\n")
                last = block[-1:]
        return lines + (last != b"\n")
    except OSError:
        return None


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Progress:
    """``update(done)`` as lines are written; ``close()`` ends the line. ``mt translate``
    shows it only while it writes a file from a terminal (stdout and stderr both one)."""

    def __init__(self, total: int | None, stream: TextIO = sys.stderr, every: float = 0.5):
        self.total, self.stream, self.every = total, stream, every
        self.start = self.drawn_at = time.monotonic()
        self.done, self.width = 0, 0

    def update(self, done: int) -> None:
        self.done = done
        now = time.monotonic()
        if now - self.drawn_at >= self.every:
            self.drawn_at = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        rate = self.done / max(now - self.start, 1e-9)
        text = f"{self.done:,} lines"
        if self.total:
            text = f"{self.done:,} of {self.total:,} lines ({100 * self.done / self.total:.0f}%)"
        text += f" · {rate:,.0f} lines/s"
        if self.total and rate > 0 and self.done < self.total:
            text += f" · {_duration((self.total - self.done) / rate)} left"
        self.stream.write("\r" + text.ljust(self.width))
        self.stream.flush()
        self.width = len(text)

    def close(self) -> None:
        """The final count, and a new line; nothing if nothing was drawn and nothing done."""
        if self.done or self.width:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
