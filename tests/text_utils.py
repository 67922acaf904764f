"""Token documents for the example builders' tests: every token id unique, so a token says which
document and place it came from."""

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
