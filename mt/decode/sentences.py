"""Sentence splitting, for text that is not one sentence per line.

The models translate one sentence at a time, as they were trained. A line that
holds a paragraph is cut into sentences, each sentence is translated, and the
translations are joined with the source's own spacing, so that a line stays one
line and the whitespace between sentences (one space, two, a tab) is kept.

The splitter is sentencex (Wikimedia; MIT; rule-based, with abbreviation lists
for some 300 languages, a compiled core): of the candidates compared on
``tests/data/sentences`` (docs/decoding.md#paragraphs), it and pySBD split the
most paragraphs right, and pySBD has not been released since 2021.

A sentence longer than the model's positions is cut into parts (``cut_long``):
after a clause's punctuation where it can, else between words; each part is
translated and the parts joined, so nothing of it is lost.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class SplitLine:
    """A line as ``lead + sentences[0] + gaps[0] + sentences[1] + gaps[1] ...``:
    the sentences without their surrounding whitespace, and that whitespace."""

    lead: str
    sentences: list[str]
    gaps: list[str]

    def join(self, translations: list[str]) -> str:
        """The translations in the sentences' places, with the source's spacing."""
        if len(translations) != len(self.sentences):
            raise ValueError(f"{len(translations)} translations for {len(self.sentences)} sentences")
        return self.lead + "".join(t + gap for t, gap in zip(translations, self.gaps))


def split_line(line: str, lang: str) -> SplitLine:
    """``line`` cut into sentences by sentencex's rules for ``lang`` (an ISO 639 code;
    an unknown one gets its fallback rules). A line of whitespace has no sentence."""
    from sentencex import segment

    lead = line[: len(line) - len(line.lstrip())]
    sentences, gaps = [], []
    for part in segment(lang, line[len(lead) :]):  # the parts, joined, are the text: each keeps its trailing space
        text = part.rstrip()
        if not text:  # whitespace alone: it belongs to the gap before it
            if gaps:
                gaps[-1] += part
            else:
                lead += part
            continue
        sentences.append(text.lstrip())
        if text != text.lstrip():  # sentencex gave leading space to a part: move it to the gap before it
            space = text[: len(text) - len(text.lstrip())]
            if gaps:
                gaps[-1] += space
            else:
                lead += space
        gaps.append(part[len(text) :])
    return SplitLine(lead, sentences, gaps)


def split_lines(lines: list[str], lang: str | None) -> list[SplitLine]:
    """Each line's split (``split_line``), to translate its sentences and join them back;
    with ``lang`` None, each line whole as its one sentence."""
    if lang is None:
        return [SplitLine("", [line], [""]) for line in lines]
    return [split_line(line, lang) for line in lines]


def per_line(items: list[T], splits: list[SplitLine]) -> list[list[T]]:
    """``items``, one per sentence of ``splits`` in order (their translations), grouped by line."""
    total = sum(len(split.sentences) for split in splits)
    if len(items) != total:
        raise ValueError(f"{len(items)} translations for {total} sentences")
    out, start = [], 0
    for split in splits:
        out.append(items[start : start + len(split.sentences)])
        start += len(split.sentences)
    return out


# Where a sentence too long for the model is best cut: after a clause's punctuation,
# else between words; a text with no space at all is cut between characters.
CLAUSE_ENDS = re.compile(r"(?<=[,;:)\]»”\"'–—])\s+")
SPACES = re.compile(r"\s+")


def cut_long(text: str, pieces: Callable[[str], int], most: int) -> tuple[list[str], list[str], str]:
    """``text`` cut into parts of at most ``most`` pieces (``pieces(part)`` counts them),
    as few as the boundaries allow, each as long as fits: ``(parts, gaps, how)`` with
    ``text == parts[0] + gaps[0] + parts[1] + ...`` (the last gap empty) and ``how``
    the boundaries used ("punctuation", "spaces", "characters", joined by " and ")."""
    parts: list[str] = []
    gaps: list[str] = []
    used: dict[str, None] = {}
    rest = text
    while pieces(rest) > most:
        cut = None
        for kind, pattern in (("punctuation", CLAUSE_ENDS), ("spaces", SPACES)):
            cut = _last_fitting([m for m in pattern.finditer(rest) if m.start() > 0], rest, pieces, most)
            if cut is not None:
                used[kind] = None
                break
        if cut is None:  # no boundary with a part that fits before it: the longest run of characters that fits
            used["characters"] = None
            lo, hi = 1, len(rest) - 1
            while lo < hi:  # the most characters whose pieces fit
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if pieces(rest[:mid]) <= most else (lo, mid - 1)
            parts.append(rest[:lo])
            gaps.append("")
            rest = rest[lo:]
            continue
        parts.append(rest[: cut.start()])
        gaps.append(cut.group())
        rest = rest[cut.end() :]
    return [*parts, rest], [*gaps, ""], " and ".join(used)


def _last_fitting(boundaries: list[re.Match], text: str, pieces: Callable[[str], int], most: int) -> re.Match | None:
    """The last boundary with at most ``most`` pieces before it, by bisection (a longer
    prefix has as many pieces or more), so a long line costs a few encodings per cut."""
    lo, hi, found = 0, len(boundaries) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if pieces(text[: boundaries[mid].start()]) <= most:
            found, lo = boundaries[mid], mid + 1
        else:
            hi = mid - 1
    return found
