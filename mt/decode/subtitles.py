"""SubRip subtitles (``.srt``): the cues' numbers and timings kept, each cue's text
translated (its lines joined into one), and the translation wrapped again to
subtitle lines.

A cue is a number, a timing line (``00:00:01,000 --> 00:00:04,000``, possibly
with position settings after it) and one or more lines of text, cues separated
by blank lines.
"""

from __future__ import annotations

import math
import re
import textwrap
from dataclasses import dataclass

from mt.errors import DataError

TIMING = re.compile(r"\d+:\d{2}:\d{2}[,.]\d{1,3}\s*-->\s*\d+:\d{2}:\d{2}[,.]\d{1,3}.*")
LINE_WIDTH = 42  #: characters per subtitle line, the common broadcast limit


@dataclass
class Cue:
    number: str
    timing: str
    lines: list[str]

    @property
    def text(self) -> str:
        """The cue's lines as one line of text, for translation."""
        return " ".join(line.strip() for line in self.lines if line.strip())


def parse_srt(text: str, name: str) -> list[Cue]:
    """The cues of a SubRip file's text; a malformed cue is a ``DataError`` naming
    ``name`` and the line."""
    lines = text.lstrip("\ufeff").splitlines()
    cues, n = [], 0
    while n < len(lines):
        if not lines[n].strip():
            n += 1
            continue
        if not lines[n].strip().isdigit():
            raise DataError(f"{name}, line {n + 1}: expected a cue's number, got {lines[n][:60]!r}")
        if n + 1 >= len(lines) or not TIMING.fullmatch(lines[n + 1].strip()):
            got = repr(lines[n + 1][:60]) if n + 1 < len(lines) else "the end of the file"
            raise DataError(f"{name}, line {n + 2}: expected a timing such as "
                            f"'00:00:01,000 --> 00:00:04,000', got {got}")  # fmt: skip
        start = n + 2
        end = start
        while end < len(lines) and lines[end].strip():
            end += 1
        cues.append(Cue(lines[n].strip(), lines[n + 1].strip(), lines[start:end]))
        n = end
    return cues


def wrap(text: str, width: int = LINE_WIDTH) -> list[str]:
    """``text`` as subtitle lines: one line if it fits, else as few lines as fit
    ``width``, balanced in length (two lines of 30 rather than 42 and 18)."""
    if len(text) <= width:
        return [text] if text else []
    count = len(textwrap.wrap(text, width))
    balanced = math.ceil(len(text) / count)
    for target in range(balanced, width + 1):  # the narrowest width that needs no more lines
        lines = textwrap.wrap(text, target, break_long_words=False, break_on_hyphens=False)
        if len(lines) <= count:
            return lines
    return textwrap.wrap(text, width)


def write_srt(cues: list[Cue], translations: list[str], newline: str = "\n") -> str:
    """The cues with their text replaced by the translations, wrapped."""
    blocks = []
    for cue, translation in zip(cues, translations, strict=True):
        blocks.append(newline.join([cue.number, cue.timing, *wrap(translation)]))
    return (newline * 2).join(blocks) + newline if blocks else ""
