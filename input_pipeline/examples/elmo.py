"""ELMo's inputs: a word vocabulary counted from the corpus, characters per token, and
contiguous windows of the token stream (Peters et al. 2018 §3.4; allenai/bilm-tf bilm/data.py
`Vocabulary`, `UnicodeCharsVocabulary`, `LMDataset`; allennlp data/token_indexers/
elmo_indexer.py `ELMoCharacterMapper`).

- Vocabulary (bilm-tf's vocab file: one word per line): `</S>`, `<S>`, `<UNK>`, then the
  training words by descending count (ties alphabetical), at most `size` entries. Ids ordered by
  frequency are what the log-uniform sampler of the sampled softmax assumes. Counting streams
  the sentences; only the counts are held.
- Characters (allennlp's mapping, which bilm-tf's saved models are used with): a token is its
  UTF-8 bytes cut to `max_characters_per_token - 2`, between begin-of-word (258) and
  end-of-word (259), padded with 260; `<S>` and `</S>` are the single characters 256 and 257;
  every id is then + 1, so 0 is a missing token (char vocabulary 262).
- Windows: every sentence becomes `<S> words </S>` and the sentences of a split are one token
  stream, cut into windows of T = `max_seq_length` tokens (bilm-tf: `unroll_steps` 20). A record
  holds the window's characters `chars` [T, C] (of the words themselves, also when they are not
  in the vocabulary) and `ids` [T + 2]: the token before the window, the window's T tokens and
  the token after it, as vocabulary ids, with `mask` [T + 2] marking real tokens (the stream's
  ends and the last window's tail are padding). The forward LM at input t predicts ids[t + 2],
  the backward LM ids[t].
- Independent windows (`stateful_streams` = 0, the default): both directions read the same
  window from a zero state, so every record stands alone and the loader shuffles them.
- Stateful streams (`stateful_streams` = S, bilm-tf's layout: data.py `_get_batch` fills each
  of its S batch rows from a continuing stream of sentences, cut into `unroll_steps` windows,
  and training.py `train` feeds each batch's final LSTM states in as the next batch's initial
  ones): `StreamWindows` reads the training windows as S rows, row r being the consecutive
  windows r W .. r W + W - 1 of the stream (W = windows // S; the last windows % S windows, fewer
  than one batch, are never read), in order, so that row r of batch t + 1 is the window after
  row r's window of batch t. The backward LM reads its own stream right to left, as bilm-tf's
  reversed `LMDataset` (its sentences are `</S> wn .. w1 <S>`, our windows read backwards): row
  r of batch t holds, beside the forward window r W + t, the backward window r W + W - 1 - t,
  the window before row r's backward window of batch t - 1. After W batches each row starts its
  windows again (its forward stream from its first window, its backward stream from its last):
  one more jump between unrelated sentences, which bilm-tf's streams make at every sentence
  (its shards' sentences are shuffled); nothing resets the states. Stream r is row r of every
  global batch: each process reads the same rows of every batch (`records.ProcessRowsSampler`),
  and the carried states are split over the devices as the batch rows are, so row r's state
  stays with row r's data. The training windows are stored as one shard, in stream order
  (`objectives.elmo.prepare_elmo`); the held-out split keeps the independent windows.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import grain
import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.descriptions import describe

BOS, EOS, UNK = "<S>", "</S>", "<UNK>"
SPECIAL = (EOS, BOS, UNK)
BOS_CHAR, EOS_CHAR, BOW_CHAR, EOW_CHAR, PAD_CHAR = 256, 257, 258, 259, 260
CHAR_VOCAB_SIZE = 262  # 261 character ids + 1 (0 = no token)


@dataclasses.dataclass(frozen=True)
class ElmoExampleConfig:
    """Window length, characters per token (bilm-tf: `unroll_steps` 20, 50) and the layout of
    the training windows (see the module docstring)."""

    max_seq_length: int = 20
    """Tokens per window, T (bilm-tf `unroll_steps` 20)."""
    max_characters_per_token: int = 50
    """Characters per token incl. begin/end of word (bilm-tf and allennlp 50)."""
    stateful_streams: int = 0
    """Parallel token streams whose LSTM states carry from batch to batch (bilm-tf's layout;
    must equal train.batch_size); 0 = shuffled independent windows, each from a zero state."""

    def __post_init__(self) -> None:
        if self.max_seq_length < 1:
            raise UserError(f"examples.max_seq_length={self.max_seq_length} must be >= 1; "
                            "e.g. 20")
        if self.max_characters_per_token < 3:
            raise UserError(f"examples.max_characters_per_token={self.max_characters_per_token}"
                            " must be >= 3 (begin, one character, end); e.g. 50")
        if self.stateful_streams < 0:
            raise UserError(f"examples.stateful_streams={self.stateful_streams} must be >= 0 "
                            "(0 = independent windows; else train.batch_size)")


def character_ids(word: str, max_characters: int = 50) -> np.ndarray:
    """The [max_characters] character ids of one token (see the module docstring)."""
    chars = np.full(max_characters, PAD_CHAR, np.int32)
    if word in (BOS, EOS):
        body = [BOS_CHAR if word == BOS else EOS_CHAR]
    else:
        body = list(word.encode("utf-8", "ignore")[:max_characters - 2])
    chars[0] = BOW_CHAR
    chars[1:1 + len(body)] = body
    chars[1 + len(body)] = EOW_CHAR
    return chars + 1


def count_words(sentences: Iterable[str]) -> collections.Counter:
    """The tokens of `token_stream(sentences)` (words, `<S>`, `</S>`), counted."""
    return collections.Counter(token_stream(sentences))


def vocabulary_from_counts(counts: collections.Counter, size: int) -> list[str]:
    """`</S>`, `<S>`, `<UNK>`, then the most frequent words (ties alphabetical): `size` at
    most."""
    if size <= len(SPECIAL):
        raise UserError(f"data.vocab_size={size} leaves no room for words beside {SPECIAL}; "
                        "raise it (e.g. 8000)")
    words = sorted((w for w in counts if w not in SPECIAL), key=lambda w: (-counts[w], w))
    return [*SPECIAL, *words[:size - len(SPECIAL)]]


def read_vocabulary(path: str | Path) -> list[str]:
    """A bilm-tf vocabulary file (one word per line, most frequent first), which must hold
    `<S>`, `</S>` and `<UNK>`; they are moved to the front in that order."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"vocabulary {path} not found; give a file with one word per line, or "
                        "leave data.tokenizer empty to count one from the corpus")
    words = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()
             if line.strip()]
    missing = [s for s in SPECIAL if s not in words]
    if missing:
        raise UserError(f"vocabulary {path} lacks {missing}; add them (bilm-tf's vocab files "
                        "hold <S>, </S> and <UNK>)")
    return [*SPECIAL, *(w for w in words if w not in SPECIAL)]


def token_stream(sentences: Iterable[str]) -> Iterator[str]:
    """`<S> words </S>` for every non-empty sentence, one stream."""
    for sentence in sentences:
        words = sentence.split()
        if words:
            yield BOS
            yield from words
            yield EOS


def windows(sentences: Iterable[str], vocabulary: list[str], config: ElmoExampleConfig
            ) -> Iterator[dict[str, np.ndarray]]:
    """The records of one split's sentences (see the module docstring), streamed."""
    index = {word: i for i, word in enumerate(vocabulary)}
    unk, length, width = index[UNK], config.max_seq_length, config.max_characters_per_token

    def record(previous: str | None, words: list[str], following: str | None
               ) -> dict[str, np.ndarray]:
        chars = np.zeros((length, width), np.int16)
        ids = np.zeros(length + 2, np.int32)
        mask = np.zeros(length + 2, np.int32)
        for t, word in enumerate(words):
            chars[t] = character_ids(word, width)
        for t, word in ([(0, previous)] + list(enumerate(words, 1))
                        + [(len(words) + 1, following)]):
            if word is not None:
                ids[t], mask[t] = index.get(word, unk), 1
        return {"chars": chars, "ids": ids, "mask": mask}

    previous, buffer = None, []
    for word in token_stream(sentences):
        buffer.append(word)
        if len(buffer) == length + 1:
            yield record(previous, buffer[:length], buffer[length])
            previous, buffer = buffer[length - 1], buffer[length:]
    if buffer:
        yield record(previous, buffer, None)


class _Pair(grain.transforms.Map):
    """A (forward, backward) pair of stored windows, each loaded by the records' own
    transforms, as one record: the forward window's fields and the backward one's as
    `backward_<field>`."""

    def __init__(self, transforms: list[Any]):
        self.transforms = transforms

    def map(self, element: tuple[Any, Any]) -> dict[str, np.ndarray]:
        loaded = []
        for record in element:
            for transform in self.transforms:
                record = transform.map(record)
            loaded.append(record)
        forward, backward = loaded
        return {**forward, **{f"backward_{k}": v for k, v in backward.items()}}


def stream_windows(step: int, rows: np.ndarray, per_row: int) -> tuple[np.ndarray, np.ndarray]:
    """The windows (indices in stream order) that `rows` of stateful streams of `per_row`
    windows each read at batch `step` (the module docstring's layout): the forward LM's
    row r W + step, the backward LM's row r W + W - 1 - step."""
    first = np.asarray(rows, np.int64) * per_row
    return first + step, first + per_row - 1 - step


class StreamWindows:
    """The training windows (`records`, in stream order: a `records.RecordDirectory`) as
    `streams` rows of consecutive windows, read in order (the module docstring's stateful
    streams): record k is step k // streams of row k % streams. Its description (kept in
    checkpoints) names the records and the row count."""

    def __init__(self, records: Any, streams: int):
        self.records, self.streams = records, streams
        self.per_row = len(records) // streams
        if self.per_row < 1:
            raise UserError(f"the training split has {len(records)} windows, fewer than "
                            f"examples.stateful_streams={streams}; use more text or fewer "
                            "streams (and train.batch_size)")
        self.source = self
        self.description = describe("stateful streams", records=repr(records.source),
                                    streams=streams)

    def __len__(self) -> int:
        return self.per_row * self.streams

    def windows(self, index: int) -> tuple[int, int]:
        """(forward window, backward window) of record `index`."""
        step, row = divmod(int(index), self.streams)
        forward, backward = stream_windows(step, np.array([row]), self.per_row)
        return int(forward[0]), int(backward[0])

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        forward, backward = self.windows(index)
        return self.records.source[forward], self.records.source[backward]

    def __repr__(self) -> str:
        return self.description

    def load_transforms(self) -> list[Any]:
        return [_Pair(self.records.load_transforms())]
