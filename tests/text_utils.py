"""Token documents for the example builders' tests: every token id unique, so a token says which
document and place it came from; and the made-up parallel sentences of the XLM and Unicoder
tests."""

from __future__ import annotations

import numpy as np


def unique_token_documents(first: int, stride: int, lengths: tuple[int, int],
                           count: int = 60, sentences: int = 8) -> list[list[list[int]]]:
    """`count` documents of `sentences` sentences of `lengths[0]`..`lengths[1]` tokens (seed 0);
    document d's ids count up from `first + stride * d`, so they increase along it."""
    rng = np.random.default_rng(0)
    out = []
    for d in range(count):
        ids = iter(range(first + stride * d, first + stride * (d + 1)))
        out.append([[next(ids) for _ in range(int(rng.integers(lengths[0], lengths[1] + 1)))]
                    for _ in range(sentences)])
    return out


# Two made-up languages with one grammar: "en" words and their "de" translations.
WORDS = {"en": ["the", "cat", "dog", "bird", "sees", "likes", "big", "small", "red", "blue",
                "and", "house", "tree", "runs", "to", "a"],
         "de": ["der", "katze", "hund", "vogel", "sieht", "mag", "gross", "klein", "rot",
                "blau", "und", "haus", "baum", "rennt", "zum", "ein"]}


def sentences(count: int, seed: int) -> list[tuple[str, str]]:
    """(en, de) pairs: adjective subject verb object, word for word."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(count):
        picks = [int(rng.integers(6, 10)), int(rng.integers(1, 4)), int(rng.integers(4, 6)),
                 int(rng.choice([1, 2, 3, 11, 12]))]
        pairs.append(tuple(" ".join(WORDS[lang][i] for i in picks) for lang in ("en", "de")))
    return pairs
