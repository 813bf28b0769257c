"""Sentence splitting, for text that is not one sentence per line.

The models translate one sentence at a time, as they were trained. A line that
holds a paragraph is cut into sentences, each sentence is translated, and the
translations are joined with the source's own spacing, so that a line stays one
line and the whitespace between sentences (one space, two, a tab) is kept.

The splitter is sentencex (Wikimedia; MIT; rule-based, with abbreviation lists
for some 300 languages, a compiled core): of the candidates compared on
``tests/data/sentences`` (docs/decoding.md#paragraphs), it and pySBD split the
most paragraphs right, and pySBD has not been released since 2021.
"""

from __future__ import annotations

from dataclasses import dataclass


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


def split_lines(lines: list[str], lang: str) -> tuple[list[str], list[SplitLine]]:
    """Every line's sentences, in order, one list for all; and each line's split, to join them back."""
    splits = [split_line(line, lang) for line in lines]
    return [s for split in splits for s in split.sentences], splits


def join_lines(translations: list[str], splits: list[SplitLine]) -> list[str]:
    """The inverse of ``split_lines``: per line, its sentences' translations joined."""
    total = sum(len(split.sentences) for split in splits)
    if len(translations) != total:
        raise ValueError(f"{len(translations)} translations for {total} sentences")
    out, start = [], 0
    for split in splits:
        out.append(split.join(translations[start : start + len(split.sentences)]))
        start += len(split.sentences)
    return out
