"""RoBERTa pre-training inputs: FULL-SENTENCES packing (Liu et al. 2019 §4.2), masked dynamically.

"Each input is packed with full sentences sampled contiguously from one or more documents,
such that the total length is at most 512 tokens. Inputs may cross document boundaries. When
we reach the end of one document, we begin sampling sentences from the next document and add
an extra separator token between documents." (fairseq: `TokenBlockDataset` with
break_mode='complete' over the corpus stream, then <s> prepended.) Here the stream is the
documents in a seeded random order; a block takes whole sentences while
[CLS] block [SEP] fits in `max_seq_length`, and a [SEP] stands between the last sentence of a
document and the first of the next when both are in one block (a block boundary needs none).
A sentence longer than a whole block is cut into block-sized pieces, so every token of the
stream is used exactly once per pass. One segment, no next-sentence task. Records are stored
unmasked; `bert_examples.DynamicMasking` masks them on every load (§4.1) with BERT's 80/10/10.
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
class RobertaExampleConfig:
    """FULL-SENTENCES inputs of at most `max_seq_length` tokens (512 in the paper) and BERT's
    masking (15%, 80/10/10). fairseq masks 15% of every input with no cap; the default
    `max_predictions_per_seq` 77 = round(0.15 x 512) never binds at 512."""

    max_seq_length: int = 512
    """Tokens per input incl. [CLS] and [SEP], at least 3 (RoBERTa 512)."""
    max_predictions_per_seq: int = 77
    """Most masked positions per input (77 = round(0.15 x 512), never binding at 512)."""
    masked_lm_prob: float = 0.15
    """Fraction of tokens chosen for prediction, in (0, 1) (RoBERTa 0.15)."""
    mask_token_prob: float = 0.8
    """Share of chosen tokens replaced by [MASK] (RoBERTa 0.8)."""
    random_token_prob: float = 0.1
    """Share of chosen tokens replaced by a random token (RoBERTa 0.1; the rest stay)."""
    whole_word_mask: bool = False
    """Mask all pieces of a word together (RoBERTa: false)."""

    def __post_init__(self) -> None:
        if self.max_seq_length < 3:
            raise UserError(f"examples.max_seq_length={self.max_seq_length} is too small; "
                            "use at least 3 ([CLS] x [SEP])")
        check_masking(self)


def pack_full_sentences(documents: Sequence[Document], capacity: int,
                        separator: int) -> Iterator[list[int]]:
    """Blocks of at most `capacity` tokens made of whole consecutive sentences of the document
    stream, with `separator` between two documents inside a block (see the module docstring)."""
    block: list[int] = []
    for document in documents:
        new_document = True
        for sentence in document:
            for start in range(0, len(sentence), capacity):
                piece = sentence[start:start + capacity]
                joint = [separator] if new_document and block else []
                if len(block) + len(joint) + len(piece) > capacity:
                    yield block
                    block, joint = [], []
                block.extend(joint)
                block.extend(piece)
                new_document = False
    if block:
        yield block


def create_training_examples(
    documents: Sequence[Document], vocab: MaskingVocab, config: RobertaExampleConfig, seed: int,
) -> Iterator[dict[str, np.ndarray]]:
    """Unmasked [CLS] block [SEP] records of a corpus, documents in a seeded random order (the
    loader shuffles the records)."""
    rng = np.random.default_rng(seed)
    ordered = [documents[i] for i in rng.permutation(len(documents))]
    for block in pack_full_sentences(ordered, config.max_seq_length - 2, vocab.sep_id):
        tokens = np.asarray([vocab.cls_id, *block, vocab.sep_id], np.int32)
        yield to_features(tokens, np.zeros(len(tokens), np.int32), None, config, vocab, None)
