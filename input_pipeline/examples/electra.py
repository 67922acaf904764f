"""ELECTRA pre-training examples, as google-research/electra build_pretraining_dataset.py builds
them: consecutive sentences packed up to the target length, split into one or two segments, no
next-sentence task. Records are stored unmasked; ELECTRA masks dynamically (15% of tokens,
85% [MASK] / 15% kept, no random replacement), applied by `bert_examples.DynamicMasking` with
the masking fields of `ElectraExampleConfig`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples.bert import (
    Document,
    MaskingVocab,
    check_masking,
    to_features,
)


@dataclasses.dataclass(frozen=True)
class ElectraExampleConfig:
    """build_pretraining_dataset.py and configure_pretraining.py settings (same defaults):
    `max_predictions_per_seq` = int((mask_prob + 0.005) * max_seq_length) = 19 for 128;
    `single_segment_prob` 0.1 (one segment, "as in classification tasks"); `short_seq_prob`
    0.05 (a random target length in [5, max_seq_length]). Masking is always dynamic."""

    max_seq_length: int = 128
    """Tokens per example incl. [CLS] and [SEP], at least 5 (ELECTRA-Small 128)."""
    max_predictions_per_seq: int = 19
    """Most masked positions: int((masked_lm_prob + 0.005) x max_seq_length), 19 for 128."""
    masked_lm_prob: float = 0.15
    """Fraction of tokens masked, in (0, 1) (ELECTRA `mask_prob` 0.15)."""
    mask_token_prob: float = 0.85
    """Share of masked positions given [MASK]; the rest keep their token (ELECTRA 0.85)."""
    random_token_prob: float = 0.0
    """Share of masked positions given a random token (ELECTRA 0)."""
    whole_word_mask: bool = False
    """Mask all pieces of a word together (ELECTRA: false)."""
    single_segment_prob: float = 0.1
    """Probability that an example is one segment instead of two (ELECTRA 0.1)."""
    short_seq_prob: float = 0.05
    """Probability of a random target length in [5, max_seq_length] (ELECTRA 0.05)."""

    def __post_init__(self) -> None:
        if self.max_seq_length < 5:
            raise UserError(f"examples.max_seq_length={self.max_seq_length} is too small; "
                            "use at least 5")
        for name in ("single_segment_prob", "short_seq_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise UserError(f"examples.{name}={getattr(self, name)} must be in [0, 1]")
        check_masking(self)


class ExamplePacker:
    """Packs sentences into examples (reference: `ExampleBuilder.add_line`/`_create_example`).

    Sentences accumulate until their length reaches the target (or the document ends); then the
    first segment takes sentences while it stays under half the target (with 10% probability
    it takes everything), a sentence that would overflow it goes in with probability 0.5 while
    the second segment is empty, and the rest forms the second segment. Both are cut to fit
    [CLS] A [SEP] B [SEP] in `max_seq_length`.
    """

    def __init__(self, config: ElectraExampleConfig, vocab: MaskingVocab,
                 rng: np.random.Generator):
        self.config, self.vocab, self.rng = config, vocab, rng
        self.sentences: list[Sequence[int]] = []
        self.length = 0
        self.target_length = config.max_seq_length

    def add_sentence(self, sentence: Sequence[int]) -> dict[str, np.ndarray] | None:
        self.sentences.append(sentence)
        self.length += len(sentence)
        return self.flush() if self.length >= self.target_length else None

    def flush(self) -> dict[str, np.ndarray] | None:
        """Makes an example of the pending sentences (called at document ends too)."""
        if not self.length:
            return None
        config, rng = self.config, self.rng
        first_target = (10**9 if rng.random() < config.single_segment_prob
                        else (self.target_length - 3) // 2)
        first: list[int] = []
        second: list[int] = []
        for sentence in self.sentences:
            if (not first or len(first) + len(sentence) < first_target
                    or (not second and len(first) < first_target and rng.random() < 0.5)):
                first.extend(sentence)
            else:
                second.extend(sentence)
        max_length = config.max_seq_length
        first = first[: max_length - 2]
        second = second[: max(0, max_length - len(first) - 3)]
        self.sentences, self.length = [], 0
        self.target_length = (int(rng.integers(5, max_length + 1))
                              if rng.random() < config.short_seq_prob else max_length)
        v = self.vocab
        tokens = [v.cls_id, *first, v.sep_id] + ([*second, v.sep_id] if second else [])
        segment_ids = [0] * (len(first) + 2) + [1] * (len(second) + 1 if second else 0)
        return to_features(np.asarray(tokens, np.int32), np.asarray(segment_ids, np.int32),
                           None, config, v, None)


def create_training_examples(
    documents: Sequence[Document], vocab: MaskingVocab, config: ElectraExampleConfig, seed: int,
) -> Iterator[dict[str, np.ndarray]]:
    """Unmasked examples of a corpus: documents in a seeded random order (the reference shuffles
    its input files), sentences packed in order, an example closed at every document end."""
    rng = np.random.default_rng(seed)
    packer = ExamplePacker(config, vocab, rng)
    for index in rng.permutation(len(documents)):
        for sentence in documents[index]:
            example = packer.add_sentence(sentence)
            if example is not None:
                yield example
        example = packer.flush()
        if example is not None:
            yield example
