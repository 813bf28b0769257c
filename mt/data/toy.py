"""A synthetic "translation" task for tests and smoke runs.

The source is a random sentence over a small lexicon; the target translates
each word through a fixed dictionary and reverses the order, so a model must
learn both lexical mapping and reordering (through cross-attention).
"""

from __future__ import annotations

import random

WORDS = [
    "cat", "dog", "bird", "fish", "tree", "house", "red", "blue", "big", "small",
    "runs", "sleeps", "eats", "sees", "the", "a", "green", "old", "young", "jumps",
]  # fmt: skip
TRANSLATION = {w: w[::-1] + "o" for w in WORDS}  # "cat" -> "taco"


def toy_pair(rng: random.Random, min_len: int = 3, max_len: int = 8) -> tuple[str, str]:
    words = [rng.choice(WORDS) for _ in range(rng.randint(min_len, max_len))]
    return " ".join(words), " ".join(TRANSLATION[w] for w in reversed(words))


def toy_corpus(sizes: dict[str, int], seed: int = 0) -> dict[str, tuple[list[str], list[str]]]:
    """{split: (sources, targets)} with ``sizes[split]`` pairs each, reproducible from ``seed``."""
    rng = random.Random(seed)
    splits = {}
    for name, n in sizes.items():
        pairs = [toy_pair(rng) for _ in range(n)]
        splits[name] = ([s for s, _ in pairs], [t for _, t in pairs])
    return splits
