"""Transformer-XL's data: one token stream read as parallel streams of consecutive segments
(kimiyoung/transformer-xl pytorch/data_utils.py `LMOrderedIterator`, `Corpus`).

- Stream: every document's tokens followed by the end-of-text id, documents in corpus order
  (data_utils.py reads WikiText-103 with `add_eos`: an `<eos>` after every line). It is stored
  as chunks of `CHUNK` tokens (`create_training_examples`; the storage unit only, so the cache
  serves any segment length and stream count) and joined back in order (`token_stream`).
- Layout (`LMOrderedIterator`): the N tokens are cut into B = `num_streams` rows of
  n = N // B consecutive tokens (the last N % B dropped); batch s reads, in every row, the
  inputs at s T .. s T + T - 1 and the targets one further (T = `tgt_len`), for
  s = 0 .. ceil((n - 1) / T) - 1, the last batch shorter when T does not divide n - 1 (here
  padded, its `token_mask` marking the real tokens). Row b of batch s + 1 continues row b of
  batch s, so the memory of one step is the context of the next; `stream_offset` = s T is how
  many tokens of its row come before the segment (0 starts the row: no memory yet, as
  train.py starts every epoch from empty `mems`).
- Record k of `StreamSegments` is row k % B of batch k // B, so reading the records in order
  in batches of B gives the iterator's batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.descriptions import describe

CHUNK = 1024


@dataclasses.dataclass(frozen=True)
class TransformerXLExampleConfig:
    """Segment length and parallel streams (train.py `--tgt_len`, `--batch_size`)."""

    tgt_len: int = 150
    """Tokens per segment, T (WikiText-103 base 150)."""
    num_streams: int = 60
    """Parallel token streams: the global batch the segments are laid out for
    (train.batch_size; WikiText-103 base 60)."""

    def __post_init__(self) -> None:
        if self.tgt_len < 1:
            raise UserError(f"examples.tgt_len={self.tgt_len} must be >= 1; e.g. 150")
        if self.num_streams < 1:
            raise UserError(f"examples.num_streams={self.num_streams} must be >= 1; set it to "
                            "train.batch_size")


def create_training_examples(documents: Sequence[Sequence[Sequence[int]]], tokenizer: object,
                             seed: int) -> Iterator[dict[str, np.ndarray]]:
    """`prepare_text`'s builder: the documents' tokens, each document followed by the
    tokenizer's end-of-text id, in chunks of `CHUNK` (`tokens`, and `length` of the last)."""
    del seed
    eos = tokenizer.eos_id
    stream = np.fromiter((t for document in documents
                          for t in [*(t for sentence in document for t in sentence), eos]),
                         np.int32)
    for start in range(0, len(stream), CHUNK):
        piece = stream[start:start + CHUNK]
        tokens = np.zeros(CHUNK, np.int32)
        tokens[:len(piece)] = piece
        yield {"tokens": tokens, "length": np.int32(len(piece))}


def token_stream(chunks: dict[str, np.ndarray]) -> np.ndarray:
    """The stream that `create_training_examples` cut into `chunks` (in written order)."""
    return np.concatenate([tokens[:length] for tokens, length
                           in zip(chunks["tokens"], chunks["length"], strict=True)]
                          or [np.zeros(0, np.int32)])


class StreamSegments:
    """`LMOrderedIterator`'s batches of `stream` for `streams` rows and segments of `tgt_len`
    (see the module docstring) as records in batch order: record k is row k % B of batch
    k // B, with `tokens` [T + 1] (inputs and the last target), `token_mask` [T + 1] and
    `stream_offset`. `description` names the stream (kept in checkpoints); `setting` names the
    stream count's config key in the refusal of a text too short for it."""

    def __init__(self, stream: np.ndarray, streams: int, tgt_len: int, name: str,
                 setting: str = "examples.num_streams"):
        self.streams, self.tgt_len = streams, tgt_len
        per_row = len(stream) // streams
        if per_row < 2:
            raise UserError(f"the {name} text has {len(stream)} tokens, fewer than 2 per stream "
                            f"for {setting}={streams}; use more text or fewer streams")
        self.rows = np.asarray(stream[:per_row * streams], np.int32).reshape(streams, per_row)
        self.batches = -(-(per_row - 1) // tgt_len)
        self.source = self
        self.description = describe("ordered segments", records=name, streams=streams,
                                    tgt_len=tgt_len, tokens=int(len(stream)))

    def __len__(self) -> int:
        return self.batches * self.streams

    def batch(self, step: int, rows: slice | np.ndarray = slice(None)) -> dict[str, np.ndarray]:
        """Batch `step` (0-based) of the iterator: `LMOrderedIterator.get_batch(step * T)`,
        padded to T + 1 tokens per row."""
        begin = step * self.tgt_len
        piece = self.rows[rows, begin:begin + self.tgt_len + 1]
        tokens = np.zeros((len(piece), self.tgt_len + 1), np.int32)
        tokens[:, :piece.shape[1]] = piece
        mask = np.zeros_like(tokens)
        mask[:, :piece.shape[1]] = 1
        return {"tokens": tokens, "token_mask": mask,
                "stream_offset": np.full(len(piece), begin, np.int32)}

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        step, row = divmod(int(index), self.streams)
        return {k: v[0] for k, v in self.batch(step, np.array([row])).items()}

    def examples(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        records = [self[i] for i in indices]
        return {k: np.stack([r[k] for r in records]) for k in records[0]}

    def __repr__(self) -> str:
        return self.description

    def load_transforms(self) -> list:
        return []
