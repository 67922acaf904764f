"""BERT pre-training examples, as google-research/bert create_pretraining_data.py builds them.

Works on token ids. Documents are lists of sentences (lists of ids, no specials). The algorithm
follows the reference step by step (`create_training_instances`,
`create_instances_from_document`, `truncate_seq_pair`, `create_masked_lm_predictions`), with a
numpy Generator in place of Python's `random` module, so the distributions match the reference
but not its exact random stream. Dynamic masking (RoBERTa, Liu et al. 2019 §4.1) stores unmasked
pairs and masks them while loading, through the Grain transform `DynamicMasking`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grain
import numpy as np

from input_pipeline.errors import UserError

Document = Sequence[Sequence[int]]


@dataclasses.dataclass(frozen=True)
class MaskingVocab:
    """The vocabulary facts masking needs: size, special ids, and which pieces continue a word
    (WordPiece `##x`, sentencepiece pieces without a leading `▁`)."""

    vocab_size: int
    pad_id: int
    cls_id: int
    sep_id: int
    mask_id: int
    continuation: np.ndarray

    def __post_init__(self) -> None:
        if np.shape(self.continuation) != (self.vocab_size,):
            raise UserError(f"continuation has shape {np.shape(self.continuation)}, expected "
                            f"({self.vocab_size},); give one flag per vocabulary id")

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> MaskingVocab:
        """Reads `vocab_size`, the special ids and `continuation` off a tokenizer."""
        return cls(tokenizer.vocab_size, tokenizer.pad_id, tokenizer.cls_id, tokenizer.sep_id,
                   tokenizer.mask_id, np.asarray(tokenizer.continuation, bool))


@dataclasses.dataclass(frozen=True)
class BertExampleConfig:
    """create_pretraining_data.py flags (same defaults), plus `whole_word_mask` (the reference's
    `do_whole_word_mask`). With `dynamic_masking`, one pass over the documents is stored unmasked
    (`dupe_factor` does not apply) and masks are drawn anew each time an example is loaded."""

    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    dupe_factor: int = 10
    whole_word_mask: bool = False
    dynamic_masking: bool = False

    def __post_init__(self) -> None:
        if self.max_seq_length < 5:
            raise UserError(f"examples.max_seq_length={self.max_seq_length} is too small; "
                            "use at least 5 ([CLS] A [SEP] B [SEP])")
        if self.max_predictions_per_seq < 1:
            raise UserError(f"examples.max_predictions_per_seq={self.max_predictions_per_seq} "
                            "must be at least 1, e.g. 20")
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise UserError(f"examples.masked_lm_prob={self.masked_lm_prob} must be in (0, 1), "
                            "e.g. 0.15")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise UserError(f"examples.short_seq_prob={self.short_seq_prob} must be in [0, 1], "
                            "e.g. 0.1")
        if self.dupe_factor < 1:
            raise UserError(f"examples.dupe_factor={self.dupe_factor} must be at least 1, "
                            "e.g. 10")


@dataclasses.dataclass(frozen=True)
class Instance:
    """One sentence pair [CLS] A [SEP] B [SEP] (reference: `TrainingInstance`). Once masked,
    `tokens` holds the masked ids and the masked_lm_* fields are set."""

    tokens: np.ndarray
    segment_ids: np.ndarray
    is_random_next: bool
    masked_lm_positions: np.ndarray | None = None
    masked_lm_labels: np.ndarray | None = None


def truncate_seq_pair(
    tokens_a: np.ndarray, tokens_b: np.ndarray, max_num_tokens: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Drops one token at a time from the longer side (B on ties), from its front or back with
    p=0.5, until the pair fits (reference: `truncate_seq_pair`). Returns the trimmed views."""
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        if len(tokens_a) > len(tokens_b):
            tokens_a = tokens_a[1:] if rng.random() < 0.5 else tokens_a[:-1]
        else:
            tokens_b = tokens_b[1:] if rng.random() < 0.5 else tokens_b[:-1]
    return tokens_a, tokens_b


def _random_segment(
    documents: Sequence[Document], document_index: int, target_length: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """B of a random-next pair: whole sentences from a random start in another document (10
    tries to avoid this one) until `target_length` tokens or the document ends."""
    for _ in range(10):
        random_index = int(rng.integers(0, len(documents)))
        if random_index != document_index:
            break
    random_document = documents[random_index]
    start = int(rng.integers(0, len(random_document)))
    lengths = np.cumsum([len(sentence) for sentence in random_document[start:]])
    count = min(int(np.searchsorted(lengths, target_length)) + 1, len(lengths))
    return np.concatenate(random_document[start:start + count])


def create_instances_from_document(
    documents: Sequence[Document], document_index: int, vocab: MaskingVocab,
    config: BertExampleConfig, rng: np.random.Generator,
) -> list[Instance]:
    """NSP pairs from one document (reference: `create_instances_from_document`), masked at
    creation unless `config.dynamic_masking`. Sentences must be non-empty."""
    document = documents[document_index]
    max_num_tokens = config.max_seq_length - 3
    target_seq_length = max_num_tokens
    if rng.random() < config.short_seq_prob:
        target_seq_length = int(rng.integers(2, max_num_tokens + 1))
    instances: list[Instance] = []
    chunk: list[Sequence[int]] = []
    chunk_length = 0
    i = 0
    while i < len(document):
        chunk.append(document[i])
        chunk_length += len(document[i])
        if i == len(document) - 1 or chunk_length >= target_seq_length:
            a_end = int(rng.integers(1, len(chunk))) if len(chunk) >= 2 else 1
            tokens_a = np.concatenate(chunk[:a_end])
            is_random_next = len(chunk) == 1 or rng.random() < 0.5
            if is_random_next:
                tokens_b = _random_segment(documents, document_index,
                                           target_seq_length - len(tokens_a), rng)
                i -= len(chunk) - a_end  # put the unused sentences back
            else:
                tokens_b = np.concatenate(chunk[a_end:])
            tokens_a, tokens_b = truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
            tokens = np.concatenate([[vocab.cls_id], tokens_a, [vocab.sep_id], tokens_b,
                                     [vocab.sep_id]]).astype(np.int32)
            segment_ids = np.repeat(np.array([0, 1], np.int32),
                                    [len(tokens_a) + 2, len(tokens_b) + 1])
            instance = Instance(tokens, segment_ids, bool(is_random_next))
            if not config.dynamic_masking:
                instance = mask_instance(instance, vocab, config, rng)
            instances.append(instance)
            chunk, chunk_length = [], 0
        i += 1
    return instances


def mask_tokens(
    tokens: np.ndarray, vocab: MaskingVocab, config: BertExampleConfig,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Masked-LM predictions (reference: `create_masked_lm_predictions`).

    Candidates exclude [CLS], [SEP] and [PAD]; with whole-word masking a continuation piece joins
    the group of the candidate right before it. Groups are shuffled and taken while the total
    stays within num_to_predict = min(max_predictions, max(1, int(round(len * masked_lm_prob))))
    (Python 3's round, i.e. half to even, as the reference under Python 3); a group that would
    overshoot is skipped. Each chosen position: 80% [MASK], 10% unchanged, 10% an id drawn
    uniformly from the whole vocabulary. Returns (masked tokens, sorted positions, labels).
    """
    tokens = np.asarray(tokens)
    indices = np.flatnonzero(~np.isin(tokens, (vocab.cls_id, vocab.sep_id, vocab.pad_id)))
    starts = np.ones(len(indices), bool)
    if config.whole_word_mask:
        follows = np.diff(indices, prepend=-2) == 1
        starts = ~(vocab.continuation[tokens[indices]] & follows)
    groups = np.split(indices, np.flatnonzero(starts)[1:])
    num_to_predict = min(config.max_predictions_per_seq,
                         max(1, int(round(len(tokens) * config.masked_lm_prob))))
    chosen: list[int] = []
    for group_index in rng.permutation(len(groups)):
        if len(chosen) >= num_to_predict:
            break
        if len(chosen) + len(groups[group_index]) <= num_to_predict:
            chosen.extend(groups[group_index].tolist())
    chosen_at = np.asarray(chosen, np.int64)
    replace, keep = rng.random(len(chosen_at)) < 0.8, rng.random(len(chosen_at)) < 0.5
    random_ids = rng.integers(0, vocab.vocab_size, len(chosen_at))
    output = tokens.copy()
    output[chosen_at] = np.where(replace, vocab.mask_id,
                                 np.where(keep, tokens[chosen_at], random_ids))
    positions = np.sort(chosen_at).astype(np.int32)
    return output, positions, tokens[positions]


def mask_instance(
    instance: Instance, vocab: MaskingVocab, config: BertExampleConfig, rng: np.random.Generator
) -> Instance:
    """`instance` with masked tokens and its masked_lm_* fields set (see `mask_tokens`)."""
    tokens, positions, labels = mask_tokens(instance.tokens, vocab, config, rng)
    return dataclasses.replace(instance, tokens=tokens, masked_lm_positions=positions,
                               masked_lm_labels=labels)


def to_features(
    instance: Instance, vocab: MaskingVocab, config: BertExampleConfig
) -> dict[str, np.ndarray]:
    """Fixed-shape int32 features (reference: `write_instance_to_example_files`); unmasked
    instances (dynamic masking) omit the masked_lm_* fields. Padding: id pad, mask 0, segment 0,
    position 0, label 0, weight 0 (float32)."""
    length, seq = len(instance.tokens), config.max_seq_length
    features = {
        "input_ids": np.full(seq, vocab.pad_id, np.int32),
        "input_mask": (np.arange(seq) < length).astype(np.int32),
        "segment_ids": np.zeros(seq, np.int32),
    }
    features["input_ids"][:length] = instance.tokens
    features["segment_ids"][:length] = instance.segment_ids
    if instance.masked_lm_positions is not None:
        count, preds = len(instance.masked_lm_positions), config.max_predictions_per_seq
        features["masked_lm_positions"] = np.zeros(preds, np.int32)
        features["masked_lm_ids"] = np.zeros(preds, np.int32)
        features["masked_lm_positions"][:count] = instance.masked_lm_positions
        features["masked_lm_ids"][:count] = instance.masked_lm_labels
        features["masked_lm_weights"] = (np.arange(preds) < count).astype(np.float32)
    features["next_sentence_labels"] = np.asarray(int(instance.is_random_next), np.int32)
    return features


def create_training_examples(
    documents: Sequence[Document], vocab: MaskingVocab, config: BertExampleConfig, seed: int,
) -> Iterator[dict[str, np.ndarray]]:
    """All examples of a corpus (reference: `create_training_instances`): empty sentences and
    documents dropped, documents shuffled, `dupe_factor` passes over them (one when masking is
    dynamic), then all instances shuffled and yielded as `to_features` dicts."""
    rng = np.random.default_rng(seed)
    documents = [kept for kept in ([s for s in doc if len(s)] for doc in documents) if kept]
    documents = [documents[i] for i in rng.permutation(len(documents))]
    passes = 1 if config.dynamic_masking else config.dupe_factor
    instances = [instance for _ in range(passes) for index in range(len(documents))
                 for instance in create_instances_from_document(documents, index, vocab, config,
                                                                rng)]
    for i in rng.permutation(len(instances)):
        yield to_features(instances[i], vocab, config)


class DynamicMasking(grain.transforms.RandomMap):
    """Masks an unmasked record each time it is loaded, with Grain's per-record RNG (derived
    from the loader seed and the record's position, so reruns and resumes see the same masks
    and each epoch new ones). Output has the static layout."""

    def __init__(self, vocab: MaskingVocab, config: BertExampleConfig):
        self.vocab = vocab
        self.config = config

    def random_map(self, element: dict[str, np.ndarray], rng: np.random.Generator
                   ) -> dict[str, np.ndarray]:
        length = int(np.sum(element["input_mask"]))
        instance = Instance(np.asarray(element["input_ids"][:length]),
                            np.asarray(element["segment_ids"][:length]),
                            bool(element["next_sentence_labels"]))
        return to_features(mask_instance(instance, self.vocab, self.config, rng), self.vocab,
                           self.config)


def majority_baseline_accuracy(examples: Mapping[str, np.ndarray]) -> float:
    """Masked-LM accuracy of always predicting the most frequent masked label, over stacked
    examples (weighted by masked_lm_weights); 0.0 when nothing is masked."""
    weights = np.asarray(examples["masked_lm_weights"], np.float64).ravel()
    counts = np.bincount(np.asarray(examples["masked_lm_ids"]).ravel(), weights=weights)
    return float(counts.max() / weights.sum()) if weights.sum() > 0 else 0.0
