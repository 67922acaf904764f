"""ALBERT pre-training examples, as google-research/albert create_pretraining_data.py builds them.

Pairs are BERT's (`bert_examples.create_instances_from_document`, short_seq_prob 0.1,
truncation) with sentence-order prediction in place of NSP (Lan et al. 2020 §4.1): A and B are
consecutive segments of one document, swapped with probability 0.5; label 0 = original order,
1 = swapped (HF `sentence_order_label`; the reference's `is_random_next`). Masking is n-gram
masking (`ngram_mask_tokens`, the reference's `create_masked_lm_predictions` with ngram=3 and
favor_shorter_ngram): spans of n = 1..3 whole words with p(n) proportional to 1/n, BERT's
80/10/10 within them. Masks are static (`dupe_factor` passes), as in the reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import bert as bert_examples
from pretext_jax.input_pipeline.examples.bert import Document, MaskingVocab


@dataclasses.dataclass(frozen=True)
class AlbertExampleConfig(bert_examples.BertExampleConfig):
    """BERT's example settings with create_pretraining_data.py's ALBERT defaults
    (max_seq_length 512, max_predictions_per_seq 20, dupe_factor 40, do_whole_word_mask true)
    and `max_ngram` (the reference's `ngram` flag, 3)."""

    max_seq_length: int = 512
    dupe_factor: int = 40
    whole_word_mask: bool = True
    max_ngram: int = 3
    """Longest masked n-gram in words, p(n) proportional to 1/n (ALBERT `ngram` 3)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_ngram < 1:
            raise UserError(f"examples.max_ngram={self.max_ngram} must be at least 1 "
                            "(ALBERT: 3)")
        if self.dynamic_masking:
            raise UserError("examples.dynamic_masking is not available for ALBERT, whose "
                            "n-gram masks are drawn once per pass as in the reference; set "
                            "examples.dynamic_masking=false and choose examples.dupe_factor")


def ngram_probabilities(max_ngram: int) -> np.ndarray:
    """p(n) = (1/n) / sum_k (1/k) for n = 1..max_ngram (6/11, 3/11, 2/11 for 3)."""
    weights = 1.0 / np.arange(1, max_ngram + 1)
    return weights / weights.sum()


def choose_ngram_spans(candidates: list[list[int]], budget: int, probabilities: np.ndarray,
                       rng: np.random.Generator) -> list[list[list[int]]]:
    """The spans to mask, each a list of consecutive candidate words (lists of positions).

    Span starts are the words in random order; for each, n is drawn with `probabilities`
    (p(n) for n = 1, 2, ...: ALBERT's `ngram_probabilities`, UniLM's 0.8/0.1/0.1) and the
    span is the next n words, fewer where the run of adjacent words ends (at a special token
    or the end; the reference cuts only at the end and lets a span step over [SEP]). While
    the span would exceed `budget` predictions n shrinks; a span that still does not fit, or
    that overlaps a chosen one, is skipped.
    """
    covered: set[int] = set()
    spans: list[list[list[int]]] = []
    count = 0
    for start in rng.permutation(len(candidates)):
        if count >= budget:
            break
        n = int(rng.choice(len(probabilities), p=probabilities)) + 1
        run = [candidates[start]]
        while (len(run) < n and start + len(run) < len(candidates)
               and candidates[start + len(run)][0] == run[-1][-1] + 1):
            run.append(candidates[start + len(run)])
        n = min(n, len(run))
        while n > 1 and count + sum(len(word) for word in run[:n]) > budget:
            n -= 1
        span = run[:n]
        positions = [index for word in span for index in word]
        if count + len(positions) > budget or covered.intersection(positions):
            continue
        covered.update(positions)
        spans.append(span)
        count += len(positions)
    return spans


def ngram_mask_tokens(
    tokens: np.ndarray, vocab: MaskingVocab, config: AlbertExampleConfig,
    rng: np.random.Generator, probabilities: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """N-gram masked-LM predictions over `masking_candidates` (whole words with
    `whole_word_mask`), within BERT's `prediction_budget`, each position corrupted 80/10/10;
    span lengths drawn with `probabilities` (default: ALBERT's, up to `config.max_ngram`).
    Returns (masked tokens, sorted positions, labels) as `bert_examples.mask_tokens`."""
    if probabilities is None:
        probabilities = ngram_probabilities(config.max_ngram)
    candidates = bert_examples.masking_candidates(tokens, vocab, config.whole_word_mask)
    budget = bert_examples.prediction_budget(len(tokens), config)
    output = tokens.copy()
    chosen = [i for span in choose_ngram_spans(candidates, budget, probabilities, rng)
              for word in span for i in word]
    bert_examples.corrupt(output, np.asarray(chosen, np.int64), vocab, config, rng)
    return bert_examples.masked_result(tokens, output, chosen)


def create_training_examples(
    documents: Sequence[Document], vocab: MaskingVocab, config: AlbertExampleConfig, seed: int,
) -> Iterator[dict[str, np.ndarray]]:
    """All examples of a corpus: BERT's passes and shuffling with sentence-order pairs and
    n-gram masks; `next_sentence_labels` holds the sentence-order label."""
    return bert_examples.create_training_examples(
        documents, vocab, config, seed, sentence_order=True, mask=ngram_mask_tokens)
