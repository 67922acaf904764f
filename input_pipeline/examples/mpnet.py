"""MPNet pre-training examples, as microsoft/MPNet's `masked_permutation_lm` task builds them.

Preparation (`create_training_examples`, once, stored): documents in a seeded random order,
each followed by [SEP] (fairseq ends every line with </s>), concatenated and cut into blocks of
`max_seq_length - 1` tokens, each after a [CLS] (fairseq `TokenBlockDataset` with
`--sample-break-mode none`, then `PrependTokenDataset` with <s>). Every record is full, so every
record predicts exactly `pred_size` tokens (the reference's `complete` mode pads short blocks
and lets the padding take part in the permutation).

Loading (`MaskedPermutation`, per record, so every epoch draws anew as the reference's
`MaskedDataset.collater`): a permutation of the positions (whole words kept together with
`whole_word_mask`, as `span_perm`, the predicted part shuffled again), the last
b = round(n * pred_prob) positions of it predicted, their input tokens replaced 80% [MASK] /
10% random / 10% kept (`mask_perm`), and the content stream laid out as
`models.mpnet.two_stream_visibility` expects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import grain
import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples.bert import Document, MaskingVocab


@dataclasses.dataclass(frozen=True)
class MPNetExampleConfig:
    """masked_permutation_lm flags: `tokens_per_sample` [max_seq_length] 512, `pred_prob` 0.15,
    `rand_prob` [random_token_prob] 0.1, `keep_prob` 0.1 (so mask_token_prob 0.8),
    `mask_whole_words` [whole_word_mask] (the paper's setting, §3.1)."""

    max_seq_length: int = 512
    """Tokens per example incl. the leading [CLS] (MPNet `tokens_per_sample` 512)."""
    pred_prob: float = 0.15
    """Fraction of tokens predicted, b = round(n x pred_prob) (MPNet 0.15)."""
    mask_token_prob: float = 0.8
    """Share of predicted tokens given [MASK] in the input (MPNet 0.8)."""
    random_token_prob: float = 0.1
    """Share of predicted tokens given a random token (MPNet `rand_prob` 0.1; the rest stay)."""
    whole_word_mask: bool = True
    """Permute whole words, keeping a word's pieces together (MPNet `mask_whole_words`)."""

    def __post_init__(self) -> None:
        if self.max_seq_length < 3:
            raise UserError(f"examples.max_seq_length={self.max_seq_length} is too small; use "
                            "at least 3")
        if not 1 <= self.pred_size < self.max_seq_length:
            raise UserError(f"examples.pred_prob={self.pred_prob} predicts {self.pred_size} of "
                            f"{self.max_seq_length} tokens; choose it so that at least one "
                            "token is predicted and one is not (MPNet: 0.15)")
        if (min(self.mask_token_prob, self.random_token_prob) < 0.0
                or self.mask_token_prob + self.random_token_prob > 1.0):
            raise UserError(
                f"examples.mask_token_prob={self.mask_token_prob} and examples.random_token_prob"
                f"={self.random_token_prob} must be >= 0 with a sum <= 1 (MPNet: 0.8 and 0.1)")

    @property
    def pred_size(self) -> int:
        """b = round(n * pred_prob) predicted tokens per sequence (Python's round, as the
        collater); n - b = c is the split point of the factorisation order."""
        return int(round(self.max_seq_length * self.pred_prob))


def create_training_examples(
    documents: Sequence[Document], vocab: MaskingVocab, config: MPNetExampleConfig, seed: int,
) -> Iterator[dict[str, np.ndarray]]:
    """Full blocks `[CLS] + max_seq_length - 1 stream tokens` of the documents (in a seeded
    random order, each ending with [SEP]); the incomplete last block is dropped, so documents
    of fewer tokens than one block give none (`prepare_text` says so when no shard has any)."""
    rng = np.random.default_rng(seed)
    pieces = []
    for index in rng.permutation(len(documents)):
        pieces.extend(np.asarray(s, np.int32) for s in documents[index])
        pieces.append(np.asarray([vocab.sep_id], np.int32))
    stream = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    block = config.max_seq_length - 1
    for start in range(0, len(stream) - block + 1, block):
        yield {"input_ids": np.concatenate([[vocab.cls_id], stream[start:start + block]]
                                           ).astype(np.int32)}


def span_permutation(word_start: np.ndarray, pred_size: int,
                     rng: np.random.Generator) -> np.ndarray:
    """A permutation of the positions that keeps every word's pieces together and in order
    (the words are permuted), with its last `pred_size` entries shuffled again
    (`MaskedDataset.span_perm` with max_gram 1 and `make_span_perm`)."""
    starts = np.flatnonzero(word_start)
    bounds = np.append(starts, len(word_start))
    order = rng.permutation(len(starts))
    lengths = bounds[order + 1] - bounds[order]
    offsets = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    perm = np.repeat(bounds[order], lengths) + offsets
    rng.shuffle(perm[len(perm) - pred_size:])
    return perm


class MaskedPermutation(grain.transforms.RandomMap):
    """Per loaded record: `input_ids` and `position_ids` [n + b], the content stream
    [non-predicted tokens | corrupted predicted tokens ([MASK]s) | predicted tokens] with their
    original (0-based) positions, and `target_ids` [b], the predicted tokens in factorisation
    order. Random replacements are drawn uniformly from the ids other than [PAD], [CLS], [SEP]
    and [MASK] (the reference gives its special symbols weight 0)."""

    def __init__(self, vocab: MaskingVocab, config: MPNetExampleConfig):
        self.vocab = vocab
        self.config = config
        special = [vocab.pad_id, vocab.cls_id, vocab.sep_id, vocab.mask_id]
        self.random_ids = np.setdiff1d(np.arange(vocab.vocab_size), special).astype(np.int32)

    def permutation(self, ids: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        if not self.config.whole_word_mask:
            return rng.permutation(len(ids))
        word_start = self.vocab.word_starts(ids)
        word_start[0] = True
        return span_permutation(word_start, self.config.pred_size, rng)

    def corrupt(self, tokens: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """`mask_perm`: [MASK] with mask_token_prob, else a random id with random_token_prob
        (as a share of all), else kept."""
        c = self.config
        masked = rng.random(len(tokens)) < c.mask_token_prob
        rest = 1.0 - c.mask_token_prob
        randomised = ~masked & (rng.random(len(tokens)) < (c.random_token_prob / rest
                                                           if rest > 0 else 0.0))
        out = np.where(masked, self.vocab.mask_id, tokens)
        return np.where(randomised, rng.choice(self.random_ids, len(tokens)), out).astype(
            np.int32)

    def random_map(self, element: dict[str, np.ndarray], rng: np.random.Generator
                   ) -> dict[str, np.ndarray]:
        ids = np.asarray(element["input_ids"])
        split = len(ids) - self.config.pred_size
        perm = self.permutation(ids, rng).astype(np.int32)
        permuted = ids[perm]
        targets = permuted[split:]
        return {
            "input_ids": np.concatenate([permuted[:split], self.corrupt(targets, rng),
                                         targets]).astype(np.int32),
            "position_ids": np.concatenate([perm, perm[split:]]),
            "target_ids": targets.astype(np.int32),
        }
