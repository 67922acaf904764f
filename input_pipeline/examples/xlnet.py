"""XLNet pre-training examples, as zihangdai/xlnet data_utils.py builds them.

Preparation (`create_training_examples`, once, stored): the corpus becomes one token stream
with sentence ids, cut into `num_streams` parallel rows (`batchify`; with `bi_data` the second
half of the rows are the first half reversed). Every step takes the next `reuse_len` tokens of
each row as the part that memory will carry, then a fresh [A | SEP | B | SEP | CLS] of the
remaining length (`_split_a_and_b`: B continues A half of the time, else comes from elsewhere),
and samples `num_predict` targets in spans (`_sample_mask`). Records are stored batch by batch,
row by row, so reading them in order gives every row the continuation of its previous segment,
which the recurrence memory needs.

Loading (`PermutationSampling`, per record, vectorised numpy): a factorisation order for each
half (`_local_perm`), given as per-position ranks from which the objective builds `perm_mask`
on device, and the targets gathered into `num_predict` slots (`target_mapping`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import grain
import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples.bert import Document, MaskingVocab


@dataclasses.dataclass(frozen=True)
class XLNetExampleConfig:
    """data_utils.py / train_gpu.py flags (XLNet-Base defaults): seq_len 512, reuse_len 256,
    num_predict 85, perm_size 256, mask_alpha 6, mask_beta 1, spans of at most 5 tokens.
    `num_streams` is the number of parallel rows, i.e. the global batch size the records are
    laid out for (`train.batch_size` must equal it)."""

    max_seq_length: int = 512
    """Tokens per example, reused part included (XLNet `seq_len` 512)."""
    reuse_len: int = 256
    """Leading tokens continuing the row's previous example (XLNet 256); = model.reuse_len."""
    num_predict: int = 85
    """Targets per example (XLNet 85)."""
    perm_size: int = 256
    """Block length of the factorisation order; divides reuse_len and the rest (XLNet 256)."""
    mask_alpha: int = 6
    """Span sampling: n-token spans sit in n x mask_alpha / mask_beta token contexts (XLNet 6)."""
    mask_beta: int = 1
    """Span sampling: divisor of that context length (XLNet 1)."""
    max_span: int = 5
    """Longest target span in tokens, p(n) proportional to 1/n (XLNet 5)."""
    num_streams: int = 32
    """Parallel token streams: the global batch the records are laid out for (train.batch_size)."""
    bi_data: bool = False
    """Second half of the streams = first half reversed (XLNet `bi_data`); = model.bi_data."""

    def __post_init__(self) -> None:
        new_len = self.max_seq_length - self.reuse_len
        if self.reuse_len < 0 or new_len < 5:
            raise UserError(f"examples.reuse_len={self.reuse_len} must leave at least 5 of "
                            f"examples.max_seq_length={self.max_seq_length} for A, B and the "
                            "3 special tokens")
        if self.perm_size < 1 or new_len % self.perm_size or self.reuse_len % self.perm_size:
            raise UserError(f"examples.perm_size={self.perm_size} must divide reuse_len "
                            f"({self.reuse_len}) and max_seq_length - reuse_len ({new_len}); "
                            "XLNet uses reuse_len = perm_size = max_seq_length / 2")
        if not 1 <= self.num_predict <= self.max_seq_length:
            raise UserError(f"examples.num_predict={self.num_predict} must be in "
                            f"[1, {self.max_seq_length}]")
        if self.mask_alpha < 1 or self.mask_beta < 1 or self.max_span < 1:
            raise UserError("examples.mask_alpha, mask_beta and max_span must be >= 1")
        if self.num_streams < 1 or (self.bi_data and self.num_streams % 2):
            raise UserError(f"examples.num_streams={self.num_streams} must be >= 1 (and even "
                            "with bi_data); set it to train.batch_size")

    @property
    def predict_per_half(self) -> tuple[int, int]:
        """(targets in the reuse half, in the new half): num_predict split as the reference."""
        second = self.num_predict // 2
        return self.num_predict - second, second


def token_stream(documents: Sequence[Document]) -> tuple[np.ndarray, np.ndarray]:
    """All sentences end to end, and a sentence id that flips at every sentence (data_utils.py
    `_create_data`; there is no <eod> token in our vocabularies, so a document boundary is a
    sentence boundary)."""
    ids = [np.asarray(s, np.int32) for doc in documents for s in doc]
    if not ids:
        raise UserError("the corpus has no sentences; pass a non-empty corpus")
    flips = np.repeat(np.arange(len(ids)) % 2 == 1, [len(s) for s in ids])
    return np.concatenate(ids), flips


def batchify(ids: np.ndarray, sent_ids: np.ndarray, rows: int, bi_data: bool
             ) -> tuple[np.ndarray, np.ndarray]:
    """[rows, length] parallel streams; with `bi_data` the second half of the rows are the first
    half reversed (data_utils.py `batchify`, `create_tfrecords`)."""
    forward_rows = rows // 2 if bi_data else rows
    length = len(ids) // forward_rows
    ids = ids[: forward_rows * length].reshape(forward_rows, length)
    sent_ids = sent_ids[: forward_rows * length].reshape(forward_rows, length)
    if bi_data:
        ids = np.concatenate([ids, ids[:, ::-1]])
        sent_ids = np.concatenate([sent_ids, sent_ids[:, ::-1]])
    return ids, sent_ids


def split_a_and_b(ids: np.ndarray, sent_ids: np.ndarray, begin: int, total_len: int,
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray] | None:
    """Segments A and B of `total_len` tokens together, starting at `begin` (data_utils.py
    `_split_a_and_b`): A ends at a random sentence boundary; B follows A half of the time (and
    always when there is no boundary) or is a random stretch elsewhere, widened to whole
    sentences; the longer side is cut from its end until they fit. None at the row's end."""
    data_len = len(ids)
    if begin + total_len >= data_len:
        return None
    end = begin + 1
    cut_points = []
    while end < data_len:
        if sent_ids[end] != sent_ids[end - 1]:
            if end - begin >= total_len:
                break
            cut_points.append(end)
        end += 1
    if not cut_points or rng.random() < 0.5:
        a_end = end if not cut_points else int(rng.choice(cut_points))
        b_len = max(1, total_len - (a_end - begin))
        b_begin = int(rng.integers(0, data_len - 1 - b_len + 1))
        b_end = b_begin + b_len
        while b_begin > 0 and sent_ids[b_begin - 1] == sent_ids[b_begin]:
            b_begin -= 1
        while b_end < data_len - 1 and sent_ids[b_end - 1] == sent_ids[b_end]:
            b_end += 1
    else:
        a_end = int(rng.choice(cut_points))
        b_begin, b_end = a_end, end
    while a_end - begin + b_end - b_begin > total_len:
        if a_end - begin > b_end - b_begin:
            a_end -= 1
        else:
            b_end -= 1
    return ids[begin:a_end], ids[b_begin:b_end]


def sample_span_mask(word_starts: np.ndarray, goal: int, config: XLNetExampleConfig,
                     rng: np.random.Generator, reverse: bool = False) -> np.ndarray:
    """Exactly `goal` positions to predict (data_utils.py `_sample_mask`): spans of n tokens,
    P(n) proportional to 1/n for n <= max_span, each starting at a word start at a random offset
    in a context of n * alpha / beta tokens; then random single positions until the goal is met.
    (The reference's span loop re-tests the span's first piece, so a span is n tokens, not n
    words; we keep that behaviour.) `word_starts` holds a bool per position of the segment;
    `reverse` samples on the reversed segment (bi_data rows)."""
    length = len(word_starts)
    starts = word_starts[::-1] if reverse else word_starts
    mask = np.zeros(length, bool)
    spans = np.arange(1, config.max_span + 1)
    probabilities = 1.0 / spans
    probabilities /= probabilities.sum()
    predicted, position = 0, 0
    while position < length and predicted < goal:
        n = min(int(rng.choice(spans, p=probabilities)), goal - predicted)
        context = n * config.mask_alpha // config.mask_beta
        left = int(rng.integers(context))
        begin = position + left
        while begin < length and not starts[begin]:
            begin += 1
        end = begin + n
        if end >= length:
            break
        mask[begin:end] = True
        predicted += n
        position = end + context - left
    while predicted < goal:
        index = int(rng.integers(length))
        if not mask[index]:
            mask[index] = True
            predicted += 1
    return mask[::-1] if reverse else mask


def create_training_examples(
    documents: Sequence[Document], vocab: MaskingVocab, config: XLNetExampleConfig, seed: int,
) -> Iterator[dict[str, np.ndarray]]:
    """The stored records, batch by batch, row by row (data_utils.py `create_tfrecords`):
    `input_ids` [reuse | A | SEP | B | SEP | CLS], `segment_ids` (0 for reuse and A with its
    SEP, 1 for B with its SEP, 2 for CLS) and `is_masked` (the sampled targets)."""
    rng = np.random.default_rng(seed)
    documents = [documents[i] for i in rng.permutation(len(documents))]
    ids, sent_ids = batchify(*token_stream(documents), config.num_streams, config.bi_data)
    seq_len, reuse = config.max_seq_length, config.reuse_len
    goal_reuse, goal_new = config.predict_per_half
    tail = np.asarray([vocab.sep_id, vocab.cls_id], np.int32)
    position = 0
    while position + seq_len <= ids.shape[1]:
        batch = []
        for row in range(config.num_streams):
            pair = split_a_and_b(ids[row], sent_ids[row], position + reuse, seq_len - reuse - 3,
                                 rng)
            if pair is None:
                return
            a, b = pair
            reverse = config.bi_data and row >= config.num_streams // 2
            reused = ids[row, position:position + reuse]
            new = np.concatenate([a, [vocab.sep_id], b, tail]).astype(np.int32)
            masked = np.concatenate([
                sample_span_mask(vocab.word_starts(reused), goal_reuse, config, rng, reverse),
                sample_span_mask(vocab.word_starts(new), goal_new, config, rng, reverse)])
            segments = np.concatenate([np.zeros(reuse + len(a) + 1, np.int32),
                                       np.ones(len(b) + 1, np.int32), [2]]).astype(np.int32)
            batch.append({"input_ids": np.concatenate([reused, new]).astype(np.int32),
                          "segment_ids": segments, "is_masked": masked.astype(np.int8)})
        yield from batch
        position += reuse


def local_permutation(input_ids: np.ndarray, is_masked: np.ndarray, perm_size: int,
                      functional: np.ndarray, rng: np.random.Generator
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One half's factorisation order (data_utils.py `_local_perm`) as per-position arrays:
    (`rank`, `is_target`, `hidden`). One random order of perm_size offsets is shared by every
    block of the half (the reference shuffles the rows of the [perm_size, blocks] index);
    non-target, non-functional tokens get rank -1 (everyone sees them, they see no target);
    targets are the masked non-functional tokens; `hidden` marks the positions subject to the
    order (masked or functional). The attention rule, built on device, is: i may not see j
    when `hidden[j]` and rank_i' <= rank[j], with rank_i' = rank[i] for targets (they do not see
    themselves) and rank[i] + 1 otherwise."""
    length = len(input_ids)
    offsets = rng.permutation(perm_size)
    order = (np.arange(length) // perm_size) * perm_size + offsets[np.arange(length) % perm_size]
    visible = ~is_masked & ~functional
    rank = np.where(visible, -1, order).astype(np.int32)
    is_target = is_masked & ~functional
    return rank, is_target, ~visible


class PermutationSampling(grain.transforms.RandomMap):
    """Per loaded record: a factorisation order for the reuse half and for the new half, and
    the targets gathered into `num_predict` slots (data_utils.py `parser`). Outputs
    `perm_rank`, `perm_target`, `perm_hidden` [T] for the device-side mask, `target_positions`,
    `target_ids`, `target_weights` [num_predict] (padding slots: position 0, weight 0; a
    sampled SEP/CLS is no target, which leaves slots unused as in the reference)."""

    def __init__(self, vocab: MaskingVocab, config: XLNetExampleConfig):
        self.vocab = vocab
        self.config = config

    def random_map(self, element: dict[str, np.ndarray], rng: np.random.Generator
                   ) -> dict[str, np.ndarray]:
        c, ids = self.config, element["input_ids"]
        masked = element["is_masked"].astype(bool)
        functional = (ids == self.vocab.sep_id) | (ids == self.vocab.cls_id)
        halves = [local_permutation(ids[part], masked[part], c.perm_size, functional[part], rng)
                  for part in (slice(0, c.reuse_len), slice(c.reuse_len, None))]
        rank, is_target, hidden = (np.concatenate(parts) for parts in zip(*halves, strict=True))
        positions = np.flatnonzero(is_target)[: c.num_predict]
        count = len(positions)
        target_positions = np.zeros(c.num_predict, np.int32)
        target_positions[:count] = positions
        weights = np.zeros(c.num_predict, np.float32)
        weights[:count] = 1.0
        return {"input_ids": ids, "segment_ids": element["segment_ids"], "perm_rank": rank,
                "perm_target": is_target.astype(np.int8), "perm_hidden": hidden.astype(np.int8),
                "target_positions": target_positions,
                "target_ids": np.where(weights > 0, ids[target_positions], 0).astype(np.int32),
                "target_weights": weights}
