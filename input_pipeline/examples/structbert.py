"""StructBERT pre-training examples (Wang et al. 2020, "StructBERT: Incorporating Language
Structures into Pre-training for Deep Language Understanding", §2.2-2.3).

Pairs and masks are BERT's (`bert_examples`: create_pretraining_data.py's chunks, truncation,
15% of tokens masked 80/10/10, static masks over `dupe_factor` passes), with two changes:

- Sentence structural objective (§2.3): B follows A (NEXT, label 0), precedes it (PREVIOUS,
  label 1: the chunk's two consecutive segments swapped, so the second segment is the one
  before the first) or comes from another document (RANDOM, label 2: BERT's random B), each
  with probability 1/3. A chunk (BERT's: consecutive sentences up to the target length) takes
  at least two sentences; a chunk of a single sentence (a one-sentence document, or the last
  sentence of one) can be neither NEXT nor PREVIOUS, so it is skipped (BERT would give it a
  random B, which would tilt the classes towards RANDOM).
- Word structural objective (§2.2): after masking, `shuffle_fraction` (5%) of the trigrams of
  unmasked tokens are shuffled. The trigrams of an example are its windows of K = 3 adjacent
  tokens that are neither special ([CLS], [SEP], padding) nor chosen for masked-LM
  prediction; the number shuffled is 5% of them (stochastically rounded, so 5% in expectation
  at any length), drawn in random order, disjoint from each other. The windows overlap, so
  ~15% of the free tokens move; the paper does not say whether its 5% counts overlapping or
  non-overlapping trigrams (`shuffle_fraction` 0.0167 gives the other reading). Each is
  reordered by a uniformly drawn non-identity permutation (so every chosen trigram is really
  out of order; the paper does not say whether the identity may occur). The model predicts
  the original token at each shuffled position through the masked-LM head: the records carry
  `shuffled_positions`, `shuffled_ids` (the original tokens) and `shuffled_weights`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence

import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import bert as bert_examples
from pretext_jax.input_pipeline.examples.bert import NEXT, PREVIOUS, RANDOM, Document, MaskingVocab

# The sentence structural labels, in the order the 3-way classifier predicts them.
RELATIONS = ((NEXT, 0), (PREVIOUS, 1), (RANDOM, 2))


@dataclasses.dataclass(frozen=True)
class StructBertExampleConfig(bert_examples.BertExampleConfig):
    """BERT's example settings plus the word structural objective's trigram shuffle."""

    shuffle_fraction: float = 0.05
    """Share of an example's unmasked trigrams that are shuffled, in [0, 1) (StructBERT 5%)."""
    shuffle_length: int = 3
    """K, the tokens per shuffled span, at least 2 (StructBERT: trigrams, K = 3)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.shuffle_fraction < 1.0:
            raise UserError(f"examples.shuffle_fraction={self.shuffle_fraction} must be in "
                            "[0, 1) (StructBERT: 0.05)")
        if self.shuffle_length < 2:
            raise UserError(f"examples.shuffle_length={self.shuffle_length} must be at least 2 "
                            "(StructBERT: 3)")
        if self.dynamic_masking:
            raise UserError("examples.dynamic_masking is not available for StructBERT, whose "
                            "masks and shuffles are drawn once per pass; set "
                            "examples.dynamic_masking=false and choose examples.dupe_factor")

    @property
    def max_shuffled_tokens(self) -> int:
        """The fixed size of the shuffled_* features: K x the most trigrams one example can
        have shuffled (its windows number fewer than max_seq_length)."""
        return self.shuffle_length * math.ceil(self.shuffle_fraction * self.max_seq_length)


def structural_relation(sentences: int, rng: np.random.Generator) -> tuple[str, int] | None:
    """NEXT, PREVIOUS or RANDOM with probability 1/3 each (§2.3); a one-sentence chunk is
    skipped (None)."""
    return None if sentences == 1 else RELATIONS[int(rng.integers(3))]


def shuffle_trigrams(features: dict[str, np.ndarray], vocab: MaskingVocab,
                     config: StructBertExampleConfig, rng: np.random.Generator
                     ) -> dict[str, np.ndarray]:
    """The word structural objective's shuffle (module docstring) applied to one masked
    example's features; adds shuffled_positions / shuffled_ids / shuffled_weights."""
    k = config.shuffle_length
    ids = features["input_ids"].copy()
    free = (features["input_mask"] > 0) & ~vocab.never_masked[ids]
    free[features["masked_lm_positions"][features["masked_lm_weights"] > 0]] = False
    run = np.lib.stride_tricks.sliding_window_view(free, k).all(axis=1)
    starts = np.flatnonzero(run)
    wanted = config.shuffle_fraction * len(starts)
    count = int(wanted) + int(rng.random() < wanted - int(wanted))
    taken = np.zeros(len(ids), bool)
    positions: list[int] = []
    for start in starts[rng.permutation(len(starts))]:
        if len(positions) >= count * k:
            break
        window = np.arange(start, start + k)
        if taken[window].any():
            continue
        taken[window] = True
        order = rng.permutation(k)
        while (order == np.arange(k)).all():
            order = rng.permutation(k)
        ids[window] = features["input_ids"][window[order]]
        positions.extend(window.tolist())
    size = config.max_shuffled_tokens
    out = {**features, "input_ids": ids,
           "shuffled_positions": np.zeros(size, np.int32),
           "shuffled_ids": np.zeros(size, np.int32),
           "shuffled_weights": np.zeros(size, np.float32)}
    out["shuffled_positions"][:len(positions)] = positions
    out["shuffled_ids"][:len(positions)] = features["input_ids"][positions]
    out["shuffled_weights"][:len(positions)] = 1.0
    return out


def create_training_examples(
    documents: Sequence[Document], vocab: MaskingVocab, config: StructBertExampleConfig,
    seed: int,
) -> Iterator[dict[str, np.ndarray]]:
    """All examples of a corpus: BERT's passes and masks with the three sentence relations
    (`next_sentence_labels` holds 0/1/2) and the trigram shuffle."""
    return bert_examples.create_training_examples(
        documents, vocab, config, seed, relation=structural_relation, min_chunk_sentences=2,
        finish=lambda features, rng: shuffle_trigrams(features, vocab, config, rng))
