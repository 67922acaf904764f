"""BERT pre-training examples, as google-research/bert create_pretraining_data.py builds them.

Works on token ids. Documents are lists of sentences (lists of ids, no specials). The algorithm
follows the reference step by step (`create_instances_from_document`, `truncate_seq_pair`,
`create_masked_lm_predictions`, `create_training_instances`), with a numpy Generator in place
of Python's `random` module. BERT's own records are made the same way in bulk (`bert_batches`:
many pairs per numpy operation, the same distribution, other draws for a seed); ALBERT,
StructBERT, ERNIE and whole-word masking use the one-by-one functions. Dynamic masking
(RoBERTa, Liu et al. 2019 §4.1) stores unmasked pairs and masks them while loading, through the
Grain transform `DynamicMasking`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grain
import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.records import ExampleBatch
from pretext_jax.input_pipeline.tokenizers import word_starts

Document = Sequence[Sequence[int]]


@dataclasses.dataclass(frozen=True)
class MaskingVocab:
    """The vocabulary facts masking needs: size, special ids, and where words begin: which
    pieces continue a word (WordPiece `##x`, sentencepiece pieces without a leading `▁`) and
    which leave theirs open (fastBPE pieces without `</w>`; none: no vocabulary marks word
    ends)."""

    vocab_size: int
    pad_id: int
    cls_id: int
    sep_id: int
    mask_id: int
    continuation: np.ndarray
    joins_next: np.ndarray | None = None

    def word_starts(self, ids: np.ndarray) -> np.ndarray:
        """A bool per position of `ids`: the piece begins a word (`tokenizers.word_starts`)."""
        return word_starts(ids, self.continuation, self.joins_next)

    @functools.cached_property
    def never_masked(self) -> np.ndarray:
        """A bool per id: [CLS], [SEP] and [PAD] are never masking candidates."""
        table = np.zeros(max(self.vocab_size, self.cls_id, self.sep_id, self.pad_id) + 1, bool)
        table[[self.cls_id, self.sep_id, self.pad_id]] = True
        return table

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> MaskingVocab:
        return cls(tokenizer.vocab_size, tokenizer.pad_id, tokenizer.cls_id, tokenizer.sep_id,
                   tokenizer.mask_id, np.asarray(tokenizer.continuation, bool),
                   tokenizer.joins_next)


@dataclasses.dataclass(frozen=True)
class BertExampleConfig:
    """create_pretraining_data.py flags (same defaults). With `dynamic_masking`, one pass over
    the documents is stored unmasked (`dupe_factor` does not apply) and masks are drawn anew
    each time an example is loaded."""

    max_seq_length: int = 128
    """Tokens per example incl. [CLS] and [SEP], at least 5 (BERT 128; see long_phase_*)."""
    max_predictions_per_seq: int = 20
    """Most masked positions per example (BERT 20 at 128 tokens, 80 at 512)."""
    masked_lm_prob: float = 0.15
    """Fraction of tokens chosen for prediction, in (0, 1) (BERT §3.1 0.15)."""
    short_seq_prob: float = 0.1
    """Probability that a pair aims at a random shorter length (BERT 0.1)."""
    dupe_factor: int = 10
    """Passes over the corpus, each with new pairs and masks (BERT 10; 1 with dynamic_masking)."""
    whole_word_mask: bool = False
    """Mask all pieces of a word together (BERT's whole-word-masking models)."""
    dynamic_masking: bool = False
    """Store pairs unmasked and draw masks at every load (RoBERTa §4.1)."""
    mask_token_prob: float = 0.8
    """Share of chosen tokens replaced by [MASK] (BERT 0.8)."""
    random_token_prob: float = 0.1
    """Share of chosen tokens replaced by a random token (BERT 0.1; the rest stay)."""
    long_phase_fraction: float = 0.0
    """The last fraction of the run's steps trains on examples of long_max_seq_length tokens
    (google-research/bert README: 0.1, the last 10 % at 512); 0 = one phase."""
    long_max_seq_length: int = 512
    """Tokens per example in the long phase (BERT 512)."""
    long_max_predictions_per_seq: int = 80
    """Most masked positions per example in the long phase (BERT 80)."""

    def long_phase(self) -> BertExampleConfig:
        """The examples of the long phase: the same settings at the long length."""
        return dataclasses.replace(self, max_seq_length=self.long_max_seq_length,
                                   max_predictions_per_seq=self.long_max_predictions_per_seq,
                                   long_phase_fraction=0.0)

    def __post_init__(self) -> None:
        if not 0.0 <= self.long_phase_fraction < 1.0:
            raise UserError(f"examples.long_phase_fraction={self.long_phase_fraction} must be in "
                            "[0, 1) (BERT: 0.1; 0 = one phase)")
        if self.long_phase_fraction and self.long_max_seq_length < self.max_seq_length:
            raise UserError(f"examples.long_max_seq_length={self.long_max_seq_length} must be at "
                            f"least examples.max_seq_length={self.max_seq_length}")
        if self.long_phase_fraction and self.dynamic_masking:
            raise UserError("examples.long_phase_fraction needs static masks (BERT's); set "
                            "examples.dynamic_masking=false or examples.long_phase_fraction=0")
        if self.max_seq_length < 5:
            raise UserError(f"examples.max_seq_length={self.max_seq_length} is too small; "
                            "use at least 5 ([CLS] A [SEP] B [SEP])")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise UserError(f"examples.short_seq_prob={self.short_seq_prob} must be in [0, 1]")
        if self.dupe_factor < 1:
            raise UserError("examples.dupe_factor must be at least 1")
        check_masking(self)


def check_masking(config: Any) -> None:
    """Validates the masking fields that `mask_tokens` reads (shared by BERT and ELECTRA)."""
    if not 0.0 < config.masked_lm_prob < 1.0:
        raise UserError(f"examples.masked_lm_prob={config.masked_lm_prob} must be in (0, 1), "
                        "e.g. 0.15")
    if config.max_predictions_per_seq < 1:
        raise UserError("examples.max_predictions_per_seq must be at least 1")
    if (min(config.mask_token_prob, config.random_token_prob) < 0.0
            or config.mask_token_prob + config.random_token_prob > 1.0):
        raise UserError(
            f"examples.mask_token_prob={config.mask_token_prob} and examples.random_token_prob="
            f"{config.random_token_prob} must be >= 0 with a sum <= 1 (BERT: 0.8 and 0.1)")


@dataclasses.dataclass
class Instance:
    """One sentence pair: [CLS] A [SEP] B [SEP] with segment ids and the pair's label."""

    tokens: np.ndarray
    segment_ids: np.ndarray
    is_random_next: int
    """The pair's label: BERT's is-random-next, ALBERT's swapped (0/1), StructBERT's 0/1/2."""


def truncate_seq_pair(a: list[int], b: list[int], max_num_tokens: int,
                      rng: np.random.Generator) -> None:
    """Trims the longer side, from its front or back at random, until the pair fits
    (reference: `truncate_seq_pair`). One uniform draw per removed token as the reference's loop,
    but the removals are counted first and cut as slices, so a huge sentence costs linear time:
    the longer side shrinks until the sides are equal, then B, A, B, ... (ties go to B)."""
    excess = len(a) + len(b) - max_num_tokens
    if excess <= 0:
        return
    length_a, length_b = len(a), len(b)
    front_a = front_b = 0
    for draw in rng.random(excess).tolist():
        if length_a > length_b:
            length_a -= 1
            front_a += draw < 0.5
        else:
            length_b -= 1
            front_b += draw < 0.5
    for tokens, length, front in ((a, length_a, front_a), (b, length_b, front_b)):
        del tokens[front + length:]
        del tokens[:front]


def random_next_segment(documents: Sequence[Document], document_index: int,
                        target_length: int, rng: np.random.Generator) -> list[int]:
    """A random B for next-sentence prediction (the reference's `is_random_next` branch):
    consecutive sentences from a random start in another document (10 tries to avoid this
    one), until `target_length` tokens are reached."""
    random_index = document_index
    for _ in range(10):
        random_index = int(rng.integers(0, len(documents)))
        if random_index != document_index:
            break
    random_document = documents[random_index]
    start = int(rng.integers(0, len(random_document)))
    tokens: list[int] = []
    for sentence in random_document[start:]:
        tokens.extend(sentence)
        if len(tokens) >= target_length:
            break
    return tokens


# How B relates to A in a pair, and the label stored: `relation(sentences in the chunk, rng)`
# -> (NEXT, PREVIOUS or RANDOM, label), or None to skip the chunk.
NEXT, PREVIOUS, RANDOM = "next", "previous", "random"
Relation = Callable[[int, np.random.Generator], "tuple[str, int] | None"]


def next_sentence_relation(sentences: int, rng: np.random.Generator) -> tuple[str, int]:
    """BERT's NSP: a random B (label 1) half the time and always for a one-sentence chunk."""
    return (RANDOM, 1) if sentences == 1 or rng.random() < 0.5 else (NEXT, 0)


def sentence_order_relation(sentences: int, rng: np.random.Generator) -> tuple[str, int]:
    """ALBERT's SOP: where BERT would draw a random B, A and B swapped (label 1); a
    one-sentence chunk still gets a random B (label 1), as albert's reference."""
    kind, label = next_sentence_relation(sentences, rng)
    return (PREVIOUS, 1) if kind == RANDOM and sentences > 1 else (kind, label)


def create_instances_from_document(
    documents: Sequence[Document], document_index: int, config: BertExampleConfig,
    vocab: MaskingVocab, rng: np.random.Generator, sentence_order: bool = False,
    relation: Relation | None = None, min_chunk_sentences: int = 1,
) -> list[Instance]:
    """NSP pairs from one document (reference: `create_instances_from_document`).

    `sentence_order` makes sentence-order pairs instead (ALBERT, Lan et al. 2020 §4.1;
    albert create_pretraining_data.py with random_next_sentence=False): where BERT would draw
    a random B, the two consecutive segments A, B are swapped (label 1) instead; a chunk of one
    sentence still gets a random B from another document (label 1), as in that reference.
    `relation` replaces both (StructBERT's three classes); PREVIOUS puts B before A. A chunk
    ends at the target length once it holds `min_chunk_sentences` (StructBERT: 2, so that most
    chunks can be split into two segments), else at the document's end.
    """
    if relation is None:
        relation = sentence_order_relation if sentence_order else next_sentence_relation
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
        if i == len(document) - 1 or (chunk_length >= target_seq_length
                                      and len(chunk) >= min_chunk_sentences):
            a_end = int(rng.integers(1, len(chunk))) if len(chunk) >= 2 else 1
            tokens_a = [t for sentence in chunk[:a_end] for t in sentence]
            picked = relation(len(chunk), rng)
            if picked is not None:
                kind, label = picked
                if kind == RANDOM:
                    tokens_b = random_next_segment(documents, document_index,
                                                   target_seq_length - len(tokens_a), rng)
                    i -= len(chunk) - a_end  # the unused sentences are not wasted
                else:
                    tokens_b = [t for sentence in chunk[a_end:] for t in sentence]
                    if kind == PREVIOUS:
                        tokens_a, tokens_b = tokens_b, tokens_a
                truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
                if tokens_a and tokens_b:
                    tokens = [vocab.cls_id, *tokens_a, vocab.sep_id, *tokens_b, vocab.sep_id]
                    segment_ids = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
                    instances.append(Instance(np.asarray(tokens, np.int32),
                                              np.asarray(segment_ids, np.int32), label))
            chunk, chunk_length = [], 0
        i += 1
    return instances


def _special(tokens: np.ndarray, vocab: MaskingVocab) -> np.ndarray:
    return vocab.never_masked[tokens]


def masking_candidates(tokens: np.ndarray, vocab: MaskingVocab,
                       whole_word_mask: bool) -> list[list[int]]:
    """Positions that may be masked, grouped: all but [CLS], [SEP] and [PAD], one group per
    piece, or with whole-word masking per word: a piece that begins no word joins the group
    before it, as google-research/bert create_pretraining_data.py `create_masked_lm_predictions`
    builds `cand_indexes`, which skips [CLS] and [SEP] first, so a segment B that starts with a
    continuation piece (its front truncated) joins A's last word across [SEP]."""
    positions = np.flatnonzero(~_special(tokens, vocab))
    if not whole_word_mask or len(positions) < 2:
        return [[p] for p in positions.tolist()]
    starts = vocab.word_starts(tokens[positions])
    return [group.tolist() for group in np.split(positions, np.flatnonzero(starts[1:]) + 1)]


def prediction_budget(length: int, config: Any) -> int:
    """min(max_predictions, max(1, round(length * masked_lm_prob))), Python's round as the
    reference."""
    return min(config.max_predictions_per_seq,
               max(1, int(round(length * config.masked_lm_prob))))


def corrupt(output: np.ndarray, positions: np.ndarray, vocab: MaskingVocab, config: Any,
            rng: np.random.Generator) -> None:
    """Each of `positions` in `output` becomes [MASK] with `mask_token_prob`, a random id drawn
    uniformly from the whole vocabulary with `random_token_prob`, and stays otherwise (the
    reference's two draws per position, made for all positions at once)."""
    count = len(positions)
    keep_or_random = 1.0 - config.mask_token_prob
    random_given_not_masked = (config.random_token_prob / keep_or_random
                               if keep_or_random > 0.0 else 0.0)
    draws = rng.random(3 * count)  # mask?, random?, which random id
    masked = draws[:count] < config.mask_token_prob
    replaced = ~masked & (draws[count:2 * count] >= 1.0 - random_given_not_masked)
    positions = np.asarray(positions, np.int64)
    output[positions[masked]] = vocab.mask_id
    output[positions[replaced]] = (draws[2 * count:][replaced] * vocab.vocab_size).astype(
        output.dtype)


def masked_result(tokens: np.ndarray, output: np.ndarray, chosen: Sequence[int] | np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(masked tokens, sorted positions, their original ids)."""
    positions = np.sort(np.asarray(chosen, np.int32))
    return output, positions, tokens[positions]


def mask_tokens(
    tokens: np.ndarray, vocab: MaskingVocab, config: Any, rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Masked-LM predictions (reference: `create_masked_lm_predictions`).

    Candidate groups (`masking_candidates`) are shuffled and taken while the total stays within
    `prediction_budget` (with single-piece groups: the first `budget` of the shuffled
    positions). The chosen positions are corrupted by `corrupt` (BERT 0.8/0.1/0.1; ELECTRA
    0.85/0/0.15). `config` is any object with the fields `check_masking` validates.
    Returns (masked tokens, sorted positions, labels).
    """
    num_to_predict = prediction_budget(len(tokens), config)
    if config.whole_word_mask:
        candidates = masking_candidates(tokens, vocab, True)
        chosen: list[int] = []
        for group_index in rng.permutation(len(candidates)):
            if len(chosen) >= num_to_predict:
                break
            group = candidates[group_index]
            if len(chosen) + len(group) <= num_to_predict:
                chosen.extend(group)
        positions = np.asarray(chosen, np.int64)
    else:
        candidates_array = np.flatnonzero(~_special(tokens, vocab))
        positions = candidates_array[rng.permutation(len(candidates_array))[:num_to_predict]]
    output = tokens.copy()
    corrupt(output, positions, vocab, config, rng)
    return masked_result(tokens, output, positions)


def to_features(
    tokens: np.ndarray, segment_ids: np.ndarray, is_random_next: int | None, config: Any,
    vocab: MaskingVocab, masked: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
) -> dict[str, np.ndarray]:
    """Fixed-shape features as run_pretraining.py reads them; unmasked records (dynamic
    masking) omit the masked_lm_* fields, and `is_random_next=None` (no NSP task, e.g.
    ELECTRA) omits `next_sentence_labels`. Padding: id pad, position 0, label 0, weight 0."""
    length, seq = len(tokens), config.max_seq_length
    features = {
        "input_ids": np.full(seq, vocab.pad_id, np.int32),
        "input_mask": np.zeros(seq, np.int32),
        "segment_ids": np.zeros(seq, np.int32),
    }
    features["input_mask"][:length] = 1
    features["segment_ids"][:length] = segment_ids
    if masked is None:
        features["input_ids"][:length] = tokens
    else:
        output, positions, labels = masked
        features["input_ids"][:length] = output
        count, preds = len(positions), config.max_predictions_per_seq
        features["masked_lm_positions"] = np.zeros(preds, np.int32)
        features["masked_lm_ids"] = np.zeros(preds, np.int32)
        features["masked_lm_weights"] = np.zeros(preds, np.float32)
        features["masked_lm_positions"][:count] = positions
        features["masked_lm_ids"][:count] = labels
        features["masked_lm_weights"][:count] = 1.0
    if is_random_next is not None:
        features["next_sentence_labels"] = np.asarray(int(is_random_next), np.int32)
    return features


def create_training_examples(
    documents: Sequence[Document], vocab: MaskingVocab, config: BertExampleConfig, seed: int,
    *, sentence_order: bool = False, mask: Callable[..., tuple[np.ndarray, ...]] = mask_tokens,
    relation: Relation | None = None, min_chunk_sentences: int = 1,
    finish: Callable[[dict[str, np.ndarray], np.random.Generator], dict[str, np.ndarray]]
    | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """The examples of a group of documents (reference: `create_training_instances`):
    documents shuffled, `dupe_factor` passes (each with fresh pairs and masks). Yielded as they
    are made: the reference's final shuffle of all instances is the loader's global shuffle,
    and a corpus is prepared shard by shard (`prepare.prepare_text`), so a random next sentence
    comes from a document of the same input shard. ALBERT passes `sentence_order=True` and its
    n-gram `mask`; StructBERT its three-way `relation`, `min_chunk_sentences` and `finish` (a
    last change to every example's features: its trigram shuffle)."""
    rng = np.random.default_rng(seed)
    documents = [documents[i] for i in rng.permutation(len(documents))]
    passes = 1 if config.dynamic_masking else config.dupe_factor
    for _ in range(passes):
        for index in range(len(documents)):
            for instance in create_instances_from_document(documents, index, config, vocab, rng,
                                                           sentence_order, relation,
                                                           min_chunk_sentences):
                masked = (None if config.dynamic_masking
                          else mask(instance.tokens, vocab, config, rng))
                features = to_features(instance.tokens, instance.segment_ids,
                                       instance.is_random_next, config, vocab, masked)
                yield features if finish is None else finish(features, rng)


def build_with_vocab(create_examples: Callable[..., Iterable[dict[str, np.ndarray]]],
                     examples: Any, documents: Any, tokenizer: Any, seed: int
                     ) -> Iterable[dict[str, np.ndarray] | ExampleBatch]:
    """A `prepare.prepare_text` builder (picklable as a `functools.partial` of this; it lives
    here so that preparation workers import the input pipeline alone):
    `create_examples(documents, masking vocab, examples, seed)`."""
    return create_examples(documents, MaskingVocab.from_tokenizer(tokenizer), examples, seed)


# ------------------------------------------------------------------------ in bulk (numpy)
# `bert_batches` makes the records of `create_training_examples` for BERT's own settings (NSP,
# one masked piece per candidate) with numpy over many pairs at once. Every draw has the
# reference's distribution, but the draws come in another order, so a seed gives other records
# than `create_training_examples` does.
BATCH_ROWS = 2048
"""Pairs materialised, masked and encoded together."""
MAX_LANES = 1 << 16
"""(pass, document) walks advanced together; more wait for the next group."""


@dataclasses.dataclass(frozen=True)
class _FlatDocuments:
    """A group of documents as one token array: sentence s is tokens[starts[s]:starts[s + 1]],
    document d its sentences first[d] to first[d + 1] - 1. After the documents' tokens come
    [CLS], [SEP] and a row of [PAD]s, so that `pair_features` gathers whole rows at once."""

    tokens: np.ndarray
    starts: np.ndarray
    first: np.ndarray

    @classmethod
    def of(cls, documents: Sequence[Document], vocab: MaskingVocab, max_seq_length: int
           ) -> _FlatDocuments:
        lengths = [len(sentence) for document in documents for sentence in document]
        text = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(
            documents)), np.int32, sum(lengths))
        tokens = np.concatenate([text, [vocab.cls_id, vocab.sep_id],
                                 np.full(max_seq_length, vocab.pad_id)]).astype(np.int32)
        starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        first = np.concatenate([[0], np.cumsum([len(d) for d in documents], dtype=np.int64)])
        return cls(tokens, starts, first)

    def sentences_reaching(self, start: np.ndarray, length: np.ndarray, stop: np.ndarray
                           ) -> np.ndarray:
        """For each walk: the end (exclusive) of the fewest sentences from `start` that hold
        at least `length` tokens, at least one sentence and at most up to `stop`."""
        end = np.searchsorted(self.starts, self.starts[start] + length, side="left")
        return np.clip(end, start + 1, stop)


def truncated_lengths(length_a: np.ndarray, length_b: np.ndarray, max_num_tokens: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """How many tokens `truncate_seq_pair` removes from A and from B: the longer side until the
    sides are equal, then B, A, B, ... (ties go to B)."""
    excess = np.maximum(length_a + length_b - max_num_tokens, 0)
    difference = np.abs(length_a - length_b)
    first = np.minimum(excess, difference)  # from the longer side alone
    rest = excess - first
    from_a = np.where(length_a > length_b, first, 0) + rest // 2
    return from_a, excess - from_a


def _pair_ranges(flat: _FlatDocuments, walks: np.ndarray, config: BertExampleConfig,
                 rng: np.random.Generator) -> Iterator[tuple[np.ndarray, ...]]:
    """`create_instances_from_document` for many documents at once (`walks`: one document
    index per (pass, document)), one chunk of every unfinished walk per step. Yields
    (start of A, length of A, start of B, length of B, is_random_next) for the pairs of each
    step, as token offsets into `flat.tokens` after `truncate_seq_pair`."""
    documents = len(flat.first) - 1
    max_num_tokens = config.max_seq_length - 3
    position, stop = flat.first[walks], flat.first[walks + 1]
    short = rng.random(len(walks)) < config.short_seq_prob
    target = np.where(short, rng.integers(2, max_num_tokens + 1, len(walks)), max_num_tokens)
    while len(walks):
        end = flat.sentences_reaching(position, target, stop)
        sentences = end - position
        draws = rng.random((4, len(walks)))
        a_end = position + 1 + (draws[0] * np.maximum(sentences - 1, 0)).astype(np.int64)
        a_start, a_stop = flat.starts[position], flat.starts[a_end]
        random_next = (sentences == 1) | (draws[1] < 0.5)
        # A random B: consecutive sentences from a random start in another document (10 tries)
        other = (draws[2] * documents).astype(np.int64)
        for _ in range(9):
            again = np.flatnonzero(random_next & (other == walks))
            if not len(again):
                break
            other[again] = (rng.random(len(again)) * documents).astype(np.int64)
        size = flat.first[other + 1] - flat.first[other]
        b_first = flat.first[other] + (draws[3] * size).astype(np.int64)
        b_end = flat.sentences_reaching(b_first, target - (a_stop - a_start),
                                        flat.first[other + 1])
        b_start = np.where(random_next, flat.starts[b_first], a_stop)
        b_stop = np.where(random_next, flat.starts[b_end], flat.starts[end])
        length_a, length_b = a_stop - a_start, b_stop - b_start
        from_a, from_b = truncated_lengths(length_a, length_b, max_num_tokens)
        front_a, front_b = rng.binomial(from_a, 0.5), rng.binomial(from_b, 0.5)
        length_a, length_b = length_a - from_a, length_b - from_b
        kept = (length_a > 0) & (length_b > 0)
        yield (a_start[kept] + front_a[kept], length_a[kept], b_start[kept] + front_b[kept],
               length_b[kept], random_next[kept].astype(np.int32))
        position = np.where(random_next, a_end, end)  # a random B leaves the rest unused
        going = position < stop
        walks, position, stop, target = walks[going], position[going], stop[going], target[going]


def pair_features(flat: _FlatDocuments, a_start: np.ndarray, length_a: np.ndarray,
                  b_start: np.ndarray, length_b: np.ndarray, max_seq_length: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[CLS] A [SEP] B [SEP] of many pairs, padded: (input_ids, input_mask, segment_ids). A
    row's ids are `flat.tokens` at column + an offset that is constant within each of its parts
    ([CLS], A, [SEP], B, [SEP] and the padding after it): one gather, the offsets a cumulative
    sum of their changes."""
    count = len(a_start)
    cls_at = flat.starts[-1]  # then [SEP], then the [PAD]s
    length = length_a + length_b + 3
    offsets = np.stack([np.full(count, cls_at), a_start - 1, cls_at - length_a,
                        b_start - length_a - 2, cls_at + 2 - length], 1)
    changes_at = np.stack([np.zeros(count, np.int64), np.ones(count, np.int64), length_a + 1,
                           length_a + 2, length - 1], 1)
    changes = np.zeros((count, max_seq_length), np.int32)
    changes[np.arange(count)[:, None], changes_at] = np.diff(offsets, axis=1, prepend=0)
    column = np.arange(max_seq_length, dtype=np.int32)
    ids = flat.tokens[np.cumsum(changes, axis=1, dtype=np.int32) + column]
    input_mask = column < length[:, None]
    segment_ids = input_mask & (column >= (length_a + 2)[:, None])
    return ids, input_mask.astype(np.int32), segment_ids.astype(np.int32)


def mask_rows(ids: np.ndarray, lengths: np.ndarray, vocab: MaskingVocab, config: Any,
              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`mask_tokens` (without whole-word masking) of many padded rows at once: of each row's
    candidates, a uniformly random `prediction_budget` of them, corrupted as `corrupt` does.
    Returns (masked ids, positions, labels, weights), the last three padded to
    `max_predictions_per_seq` with 0.

    The choice takes the candidates with the smallest random keys: 64-bit words whose low bits
    hold the position (so sorting the keys, which is faster than sorting indices, gives the
    positions), the other bits (57 of them at 128 positions) uniform; non-candidates get keys
    above them all."""
    count, width = ids.shape
    predictions = config.max_predictions_per_seq
    budget = np.minimum(predictions, np.maximum(1, np.rint(lengths * config.masked_lm_prob)
                                                .astype(np.int64)))
    low = np.uint64((1 << max(width - 1, 1).bit_length()) - 1)  # the position's bits
    high = ~low  # the random bits; all set: not a candidate
    candidate = (np.arange(width)[None, :] < lengths[:, None]) & ~vocab.never_masked[ids]
    keys = rng.integers(0, np.iinfo(np.uint64).max, (count, width), np.uint64, endpoint=True)
    keys &= high
    keys[~candidate] = high
    keys |= np.arange(width, dtype=np.uint64)
    take = min(predictions, width)
    smallest = np.sort(np.partition(keys, take - 1, axis=1)[:, :take], axis=1)
    valid = (np.arange(take)[None, :] < budget[:, None]) & (smallest < high)
    chosen = (smallest & low).astype(np.int64)
    positions = np.full((count, predictions), width)
    positions[:, :take] = np.sort(np.where(valid, chosen, width), axis=1)  # ascending
    valid = positions < width
    positions = np.where(valid, positions, 0)
    rows = np.arange(count)[:, None]
    labels = np.where(valid, ids[rows, positions], 0)
    keep_or_random = 1.0 - config.mask_token_prob
    random_given_not_masked = (config.random_token_prob / keep_or_random
                               if keep_or_random > 0.0 else 0.0)
    draws = rng.random((3, count, predictions))
    masked = draws[0] < config.mask_token_prob
    replaced = ~masked & (draws[1] >= 1.0 - random_given_not_masked)
    shown = np.where(masked, vocab.mask_id, np.where(
        replaced, (draws[2] * vocab.vocab_size).astype(np.int64), labels))
    output = ids.copy()
    output[rows, positions] = np.where(valid, shown, output[rows, positions])
    return (output, positions.astype(np.int32), labels.astype(np.int32),
            valid.astype(np.float32))


def bert_batches(documents: Sequence[Document], vocab: MaskingVocab, config: BertExampleConfig,
                 seed: int) -> Iterator[ExampleBatch]:
    """`create_training_examples` for BERT's settings without whole-word masking, in bulk:
    `dupe_factor` passes over the documents (one with dynamic masking), all walked together
    (`_pair_ranges`), each pair made, masked and encoded with the others of its batch. The
    records have the reference's distribution (see the note above `BATCH_ROWS`)."""
    if not documents:
        return
    rng = np.random.default_rng(seed)
    flat = _FlatDocuments.of(documents, vocab, config.max_seq_length)
    passes = 1 if config.dynamic_masking else config.dupe_factor
    walks = np.tile(np.arange(len(documents)), passes)
    pending: list[tuple[np.ndarray, ...]] = []
    for group in range(0, len(walks), MAX_LANES):
        steps = _pair_ranges(flat, walks[group:group + MAX_LANES], config, rng)
        last = group + MAX_LANES >= len(walks)
        for ranges in itertools.chain(steps, [None] if last else []):
            if ranges is not None:
                pending.append(ranges)
            rows = sum(len(r[0]) for r in pending)
            if rows < BATCH_ROWS and not (ranges is None and rows):
                continue
            joined = [np.concatenate(column) for column in zip(*pending, strict=True)]
            whole = rows if ranges is None else rows - rows % BATCH_ROWS
            for begin in range(0, whole, BATCH_ROWS):
                yield _batch(flat, [column[begin:min(begin + BATCH_ROWS, whole)]
                                    for column in joined], vocab, config, rng)
            pending = [tuple(column[whole:] for column in joined)] if whole < rows else []


def _batch(flat: _FlatDocuments, ranges: list[np.ndarray], vocab: MaskingVocab,
           config: BertExampleConfig, rng: np.random.Generator) -> ExampleBatch:
    """The features of `to_features` for pairs given as `_pair_ranges` yields them."""
    a_start, length_a, b_start, length_b, random_next = ranges
    ids, input_mask, segment_ids = pair_features(flat, a_start, length_a, b_start, length_b,
                                                 config.max_seq_length)
    features = {"input_ids": ids, "input_mask": input_mask, "segment_ids": segment_ids}
    if not config.dynamic_masking:
        output, positions, labels, weights = mask_rows(ids, length_a + length_b + 3, vocab,
                                                       config, rng)
        features.update(input_ids=output, masked_lm_positions=positions, masked_lm_ids=labels,
                        masked_lm_weights=weights)
    features["next_sentence_labels"] = random_next
    return ExampleBatch(features)


def bert_training_examples(documents: Sequence[Document], vocab: MaskingVocab,
                           config: BertExampleConfig, seed: int
                           ) -> Iterable[dict[str, np.ndarray] | ExampleBatch]:
    """BERT's records: in bulk (`bert_batches`), or one by one with whole-word masking."""
    if config.whole_word_mask:
        return create_training_examples(documents, vocab, config, seed)
    return bert_batches(documents, vocab, config, seed)


class DynamicMasking(grain.transforms.RandomMap):
    """Masks an unmasked record each time it is loaded, with Grain's per-record RNG (derived
    from the loader seed and the record's position, so reruns and resumes see the same masks).
    `config` is a BERT or ELECTRA example config (see `mask_tokens`)."""

    def __init__(self, vocab: MaskingVocab, config: Any):
        self.vocab = vocab
        self.config = config

    def random_map(self, element: dict[str, np.ndarray], rng: np.random.Generator
                   ) -> dict[str, np.ndarray]:
        length = int(element["input_mask"].sum())
        tokens = np.asarray(element["input_ids"][:length])
        masked = mask_tokens(tokens, self.vocab, self.config, rng)
        is_random_next = element.get("next_sentence_labels")
        return to_features(tokens, element["segment_ids"][:length],
                           None if is_random_next is None else bool(is_random_next),
                           self.config, self.vocab, masked)


def majority_baseline_accuracy(examples: dict[str, np.ndarray]) -> float:
    """Masked-LM accuracy of always predicting the most frequent masked label."""
    labels = examples["masked_lm_ids"].ravel()
    weights = examples["masked_lm_weights"].ravel()
    counts = np.bincount(labels, weights=weights)
    return float(counts.max() / max(weights.sum(), 1e-12))
