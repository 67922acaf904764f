"""UniLM pre-training examples (Dong et al. 2019, §2.1-2.3).

A document is cut into chunks of consecutive sentences as BERT's create_pretraining_data.py
cuts it (target length `max_seq_length` - 3, shorter with `short_seq_prob`). Each chunk draws
its language-modelling objective with the paper's rates (§2.3: 1/3 bidirectional, 1/3
sequence-to-sequence, 1/6 left-to-right, 1/6 right-to-left):

- bidirectional: BERT's pair [CLS] A [SEP] B [SEP], B the actual continuation or, with
  probability 0.5 (always for a one-sentence chunk), a random segment of another document;
  the next-sentence label is kept (§2.2: NSP is also trained for the bidirectional LM);
- sequence-to-sequence: the chunk split into a source A and its continuation B (a
  one-sentence chunk is split inside the sentence), [CLS] A [SEP] B [SEP];
- left-to-right and right-to-left: the chunk as one segment, [CLS] text [SEP].

[CLS] is the paper's [SOS] and [SEP] its [EOS], as in microsoft/unilm unilm-v1. The token
types double as the LM identifier (§2.1 "segment embeddings ... as LM identifier"; unilm-v1
`new_segment_ids`): 0/1 bidirectional, 2 left-to-right, 3 right-to-left, 4/5
sequence-to-sequence source/target, so the model needs 6 token types. Masking (§2.3) is over
both segments of every objective, never [CLS]/[SEP]: 15% of the tokens, 80/10/10, spans of one
token 80% of the time and of two or three tokens (equally likely) 20% of the time
(unilm-v1 `skipgram_prb` 0.2, `skipgram_size` 3), through ALBERT's n-gram span chooser.
Objectives and masks are drawn once per pass (`dupe_factor` passes), seeded; the attention
mask of each example is built on the device from `objective`, `segment_ids` and `input_mask`
(`objectives.unilm.attention_masks`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import albert as albert_examples
from pretext_jax.input_pipeline.examples.bert import (
    BertExampleConfig,
    Document,
    Instance,
    MaskingVocab,
    random_next_segment,
    to_features,
    truncate_seq_pair,
)

BIDIRECTIONAL, SEQ2SEQ, LEFT_TO_RIGHT, RIGHT_TO_LEFT = range(4)
OBJECTIVES = ("bidirectional", "seq2seq", "left_to_right", "right_to_left")
"""Names of the objective ids 0..3 (the records' `objective` field)."""
OBJECTIVE_RATES = np.array([1 / 3, 1 / 3, 1 / 6, 1 / 6])
"""Share of examples per objective (Dong et al. 2019 §2.3)."""
SEGMENT_TYPES = {BIDIRECTIONAL: (0, 1), SEQ2SEQ: (4, 5), LEFT_TO_RIGHT: (2, 2),
                 RIGHT_TO_LEFT: (3, 3)}
"""Token types of the first and second segment per objective (unilm-v1 `new_segment_ids`)."""
TYPE_VOCAB_SIZE = 6


@dataclasses.dataclass(frozen=True)
class UnilmExampleConfig(BertExampleConfig):
    """BERT's example settings at UniLM's values (max length 512, 15%, 80/10/10) plus its span
    masking: `ngram_prob` of the spans are n-grams of 2..`max_ngram` tokens."""

    max_seq_length: int = 512
    max_predictions_per_seq: int = 77
    """Most masked positions per example (77 = round(0.15 x 512))."""
    ngram_prob: float = 0.2
    """Share of masked spans longer than one token, in [0, 1] (UniLM §2.3: 0.2)."""
    max_ngram: int = 3
    """Longest masked span; lengths 2..max_ngram are equally likely (UniLM: bigram or trigram)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_ngram < 1 or not 0.0 <= self.ngram_prob <= 1.0:
            raise UserError(f"examples.max_ngram={self.max_ngram} must be at least 1 and "
                            f"examples.ngram_prob={self.ngram_prob} in [0, 1] (UniLM: 3, 0.2)")
        if self.max_ngram == 1 and self.ngram_prob > 0.0:
            raise UserError("examples.ngram_prob > 0 needs examples.max_ngram >= 2 "
                            "(UniLM: 3); or set examples.ngram_prob=0")
        if self.dynamic_masking:
            raise UserError("examples.dynamic_masking is not available for UniLM, whose "
                            "objectives and masks are drawn once per pass; set "
                            "examples.dynamic_masking=false and choose examples.dupe_factor")

    @property
    def span_probabilities(self) -> np.ndarray:
        """p(span of n tokens) for n = 1..max_ngram."""
        longer = np.full(self.max_ngram - 1, self.ngram_prob / max(self.max_ngram - 1, 1))
        return np.concatenate([[1.0 - self.ngram_prob], longer])


def chunk_instance(chunk: Sequence[Sequence[int]], objective: int, target_length: int,
                   documents: Sequence[Document], document_index: int,
                   config: UnilmExampleConfig, vocab: MaskingVocab, rng: np.random.Generator
                   ) -> Instance | None:
    """The example of one chunk under `objective` (module docstring); None when the chunk is
    too short for a pair."""
    first, second = SEGMENT_TYPES[objective]
    if objective in (LEFT_TO_RIGHT, RIGHT_TO_LEFT):
        text = [t for sentence in chunk for t in sentence]
        truncate_seq_pair(text, [], config.max_seq_length - 2, rng)
        tokens = [vocab.cls_id, *text, vocab.sep_id]
        return Instance(np.asarray(tokens, np.int32), np.full(len(tokens), first, np.int32),
                        False)
    if len(chunk) >= 2:
        a_end = int(rng.integers(1, len(chunk)))
        tokens_a = [t for sentence in chunk[:a_end] for t in sentence]
        tokens_b = [t for sentence in chunk[a_end:] for t in sentence]
    else:
        text = list(chunk[0])
        cut = int(rng.integers(1, len(text))) if len(text) >= 2 else 1
        tokens_a, tokens_b = text[:cut], text[cut:]
    is_random_next = objective == BIDIRECTIONAL and (len(chunk) == 1 or rng.random() < 0.5)
    if is_random_next:
        tokens_b = random_next_segment(documents, document_index,
                                       target_length - len(tokens_a), rng)
    truncate_seq_pair(tokens_a, tokens_b, config.max_seq_length - 3, rng)
    if not (tokens_a and tokens_b):
        return None
    tokens = [vocab.cls_id, *tokens_a, vocab.sep_id, *tokens_b, vocab.sep_id]
    segment_ids = [first] * (len(tokens_a) + 2) + [second] * (len(tokens_b) + 1)
    return Instance(np.asarray(tokens, np.int32), np.asarray(segment_ids, np.int32),
                    is_random_next)


def document_instances(documents: Sequence[Document], document_index: int,
                       config: UnilmExampleConfig, vocab: MaskingVocab, rng: np.random.Generator
                       ) -> Iterator[tuple[int, Instance]]:
    """(objective, instance) for each chunk of one document (BERT's chunking; unlike BERT the
    sentences after a random B are not reused)."""
    document = documents[document_index]
    max_num_tokens = config.max_seq_length - 3
    target_length = max_num_tokens
    if rng.random() < config.short_seq_prob:
        target_length = int(rng.integers(2, max_num_tokens + 1))
    chunk: list[Sequence[int]] = []
    chunk_length = 0
    for i, sentence in enumerate(document):
        chunk.append(sentence)
        chunk_length += len(sentence)
        if i == len(document) - 1 or chunk_length >= target_length:
            objective = int(rng.choice(len(OBJECTIVES), p=OBJECTIVE_RATES))
            instance = chunk_instance(chunk, objective, target_length, documents,
                                      document_index, config, vocab, rng)
            if instance is not None:
                yield objective, instance
            chunk, chunk_length = [], 0


def create_training_examples(
    documents: Sequence[Document], vocab: MaskingVocab, config: UnilmExampleConfig, seed: int,
) -> Iterator[dict[str, np.ndarray]]:
    """All examples of a corpus: documents shuffled, `dupe_factor` passes, each drawing new
    chunks, objectives and masks; BERT's features plus `objective` (0..3, `OBJECTIVES`)."""
    rng = np.random.default_rng(seed)
    documents = [documents[i] for i in rng.permutation(len(documents))]
    for _ in range(config.dupe_factor):
        for index in range(len(documents)):
            for objective, instance in document_instances(documents, index, config, vocab, rng):
                masked = albert_examples.ngram_mask_tokens(
                    instance.tokens, vocab, config, rng, config.span_probabilities)
                features = to_features(instance.tokens, instance.segment_ids,
                                       instance.is_random_next, config, vocab, masked)
                features["objective"] = np.asarray(objective, np.int32)
                yield features
