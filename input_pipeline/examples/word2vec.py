"""word2vec's inputs: a word vocabulary counted from the corpus in one streaming pass, and
contiguous windows of the corpus's word ids (Mikolov et al. 2013b; tmikolov/word2vec word2vec.c
`LearnVocabFromTrainFile`, `SortVocab`, `ReadWordIndex`).

- Words are whitespace-separated tokens, case kept (word2vec.c `ReadWord`). Counting streams the
  training sentences and holds only the counts.
- Vocabulary: the words seen at least `min_count` times (word2vec.c's default 5), by descending
  count (ties alphabetical, so it is deterministic). Ids are positions in that order; a word's
  count is kept beside it (`vocabulary.tsv`), from which the loss derives the subsampling and
  noise distributions on device. word2vec.c's `</s>` (newline) entry is not a word here.
- Records: the split's words in order, words outside the vocabulary dropped (word2vec.c skips
  them while reading), as one stream cut into windows of T = `max_seq_length` words: `ids` [T]
  and `mask` [T] (1 = a word, 0 = the last window's padding). Subsampling, the dynamic window,
  the (centre, context) pairs and the negatives are drawn on device in the loss
  (`objectives.word2vec`), fresh at every step. word2vec.c ends a context window at each line
  and after 1,000 words; here windows end at record boundaries (every T words) and run across
  sentences and documents.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from pretext_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Word2VecExampleConfig:
    """Record length and the vocabulary's frequency cut-off."""

    max_seq_length: int = 128
    """Words per record, T: context windows never cross a record's ends."""
    min_count: int = 5
    """Words seen fewer times in the training split are dropped (word2vec.c -min-count 5)."""

    def __post_init__(self) -> None:
        if self.max_seq_length < 2:
            raise UserError(f"examples.max_seq_length={self.max_seq_length} must be >= 2 (a "
                            "centre word and a context word); e.g. 128")
        if self.min_count < 1:
            raise UserError(f"examples.min_count={self.min_count} must be >= 1; e.g. 5")


def count_words(sentences: Iterable[str]) -> collections.Counter:
    """The whitespace-separated words of `sentences`, counted (streamed)."""
    counts: collections.Counter = collections.Counter()
    for sentence in sentences:
        counts.update(sentence.split())
    return counts


def vocabulary_from_counts(counts: dict[str, int], min_count: int
                           ) -> tuple[list[str], np.ndarray]:
    """(words, counts [V]): the words seen at least `min_count` times, most frequent first
    (ties alphabetical)."""
    words = sorted((w for w, n in counts.items() if n >= min_count),
                   key=lambda w: (-counts[w], w))
    if not words:
        raise UserError(f"no word occurs examples.min_count={min_count} times in the training "
                        "text; lower examples.min_count or give more text")
    return words, np.array([counts[w] for w in words], np.int64)


def write_vocabulary(path: Path, words: list[str], counts: np.ndarray) -> None:
    """`word<TAB>count` per line, in id order (written under a temporary name, then renamed)."""
    tmp = path.with_name(f".{path.name}.{id(words)}.tmp")
    tmp.write_text("".join(f"{w}\t{n}\n" for w, n in zip(words, counts, strict=True)),
                   encoding="utf-8")
    tmp.replace(path)


def read_vocabulary(path: str | Path) -> tuple[list[str], np.ndarray]:
    """(words, counts) of a `write_vocabulary` file."""
    words, counts = [], []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        word, count = line.rsplit("\t", 1)
        words.append(word)
        counts.append(int(count))
    return words, np.array(counts, np.int64)


def windows(sentences: Iterable[str], words: list[str], config: Word2VecExampleConfig
            ) -> Iterator[dict[str, np.ndarray]]:
    """The records of one split's sentences (see the module docstring), streamed."""
    index = {word: i for i, word in enumerate(words)}
    length = config.max_seq_length
    buffer: list[int] = []

    def record(ids: list[int]) -> dict[str, np.ndarray]:
        out = {"ids": np.zeros(length, np.int32), "mask": np.zeros(length, np.int32)}
        out["ids"][:len(ids)] = ids
        out["mask"][:len(ids)] = 1
        return out

    for sentence in sentences:
        buffer.extend(index[w] for w in sentence.split() if w in index)
        while len(buffer) >= length:
            yield record(buffer[:length])
            del buffer[:length]
    if buffer:
        yield record(buffer)
