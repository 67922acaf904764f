"""InfoWord pre-training examples (Kong et al. 2020, "A Mutual Information Maximization
Perspective of Language Representation Learning", §4).

Pairs, NSP labels and the 15% prediction budget are BERT's (`bert_examples`:
create_pretraining_data.py's chunks and truncation, static masks over `dupe_factor` passes).
What InfoWord adds is one contiguous n-gram x_{i:j} per example, masked in the sentence
(x-hat_{i:j}, §4) and also kept on its own as the second view of the DIM term:

- Length: n uniform over `ngram_min_length`..`ngram_max_length`, among the lengths that fit a
  segment of the example (a span never crosses [SEP]: it is a piece of one sentence).
- Position: the start uniform over the positions where n consecutive non-special tokens lie.
- Masking: every token of the span becomes [MASK] (x-hat_{i:j} is the sentence with
  positions i..j masked; a kept or random token would show the n-gram to the global view)
  and is a masked-LM target; the rest of BERT's budget, min(max_predictions, max(1,
  round(0.15 x length))) - n positions when positive, is drawn uniformly from the other
  candidates and corrupted 80/10/10 as BERT does (`bert_examples.corrupt`).
- The n-gram view: `ngram_ids` = [CLS] x_i .. x_j [SEP], padded to ngram_max_length + 2, with
  `ngram_mask`; the encoder reads it as a one-segment input of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import bert as bert_examples
from pretext_jax.input_pipeline.examples.bert import Document, MaskingVocab


@dataclasses.dataclass(frozen=True)
class InfoWordExampleConfig(bert_examples.BertExampleConfig):
    """BERT's example settings plus the masked n-gram's length range."""

    ngram_min_length: int = 1
    """Shortest masked n-gram, at least 1."""
    ngram_max_length: int = 5
    """Longest masked n-gram, >= ngram_min_length and <= max_predictions_per_seq."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.ngram_min_length <= self.ngram_max_length:
            raise UserError(f"examples.ngram_min_length={self.ngram_min_length} and "
                            f"examples.ngram_max_length={self.ngram_max_length} must satisfy "
                            "1 <= min <= max (InfoWord: 1 and 5)")
        if self.ngram_max_length > self.max_predictions_per_seq:
            raise UserError(f"examples.ngram_max_length={self.ngram_max_length} exceeds "
                            f"examples.max_predictions_per_seq={self.max_predictions_per_seq}; "
                            "every token of the n-gram is predicted, so raise the second")
        if self.dynamic_masking:
            raise UserError("examples.dynamic_masking is not available for InfoWord, whose "
                            "n-grams and masks are drawn once per pass; set "
                            "examples.dynamic_masking=false and choose examples.dupe_factor")
        if self.whole_word_mask:
            raise UserError("examples.whole_word_mask is not available for InfoWord (its "
                            "n-grams are of tokens); set examples.whole_word_mask=false")


def segment_runs(free: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of True in `free` (the non-special tokens of one
    segment each)."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], free.astype(np.int8), [0]])))
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def sample_ngram(free: np.ndarray, config: InfoWordExampleConfig, rng: np.random.Generator
                 ) -> tuple[int, int]:
    """(start, n) of the masked n-gram: n uniform over the configured lengths that fit a run
    of `free` positions, then the start uniform over the places it fits (module docstring)."""
    runs = segment_runs(free)
    longest = max(length for _, length in runs)
    low = min(config.ngram_min_length, longest)
    n = int(rng.integers(low, min(config.ngram_max_length, longest) + 1))
    starts = np.concatenate([np.arange(start, start + length - n + 1)
                             for start, length in runs if length >= n])
    return int(starts[rng.integers(len(starts))]), n


def mask_with_ngram(features: dict[str, np.ndarray], vocab: MaskingVocab,
                    config: InfoWordExampleConfig, rng: np.random.Generator
                    ) -> dict[str, np.ndarray]:
    """An unmasked example's features -> its masked sentence, masked-LM targets and n-gram
    view (module docstring)."""
    length = int(features["input_mask"].sum())
    tokens = features["input_ids"][:length].copy()
    free = ~vocab.never_masked[tokens]
    start, n = sample_ngram(free, config, rng)
    span = np.arange(start, start + n)
    free[span] = False
    others = np.flatnonzero(free)
    extra = max(bert_examples.prediction_budget(length, config) - n, 0)
    chosen = others[rng.permutation(len(others))[:extra]]
    output = tokens.copy()
    bert_examples.corrupt(output, chosen, vocab, config, rng)
    output[span] = vocab.mask_id
    masked = bert_examples.masked_result(tokens, output, np.concatenate([span, chosen]))
    is_random_next = features.get("next_sentence_labels")
    out = bert_examples.to_features(tokens, features["segment_ids"][:length],
                                    None if is_random_next is None else int(is_random_next),
                                    config, vocab, masked)
    width = config.ngram_max_length + 2
    out["ngram_ids"] = np.full(width, vocab.pad_id, np.int32)
    out["ngram_ids"][:n + 2] = [vocab.cls_id, *tokens[span].tolist(), vocab.sep_id]
    out["ngram_mask"] = (np.arange(width) < n + 2).astype(np.int32)
    return out


def unmasked(tokens: np.ndarray, vocab: MaskingVocab, config: InfoWordExampleConfig,
             rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """No BERT masking yet: `mask_with_ngram` draws the n-gram and the rest of the budget."""
    empty = np.zeros(0, np.int32)
    return tokens.copy(), empty, empty


def create_training_examples(
    documents: Sequence[Document], vocab: MaskingVocab, config: InfoWordExampleConfig,
    seed: int,
) -> Iterator[dict[str, np.ndarray]]:
    """All examples of a corpus: BERT's passes and NSP pairs, each with its masked n-gram."""
    return bert_examples.create_training_examples(
        documents, vocab, config, seed, mask=unmasked,
        finish=lambda features, rng: mask_with_ngram(features, vocab, config, rng))
