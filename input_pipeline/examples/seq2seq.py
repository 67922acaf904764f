"""Encoder-decoder pre-training examples: T5's span corruption and BART's text infilling.

Preparation (`create_training_examples`, stored once) lays the corpus out as T5's pipeline does
(google-research/text-to-text-transfer-transformer t5/data/preprocessors.py `span_corruption`):
documents in a seeded random order, a random chunk of at most 65,536 tokens from each
(`select_random_chunk`), 128 documents concatenated (`reduce_concat_tokens`) and cut into
pieces of the raw length (`split_tokens`; the last piece of a group may be shorter). Records
hold those raw tokens; the noise is drawn every time a record is loaded (`Seq2SeqNoising`, a
Grain `RandomMap`), as T5's and fairseq's pipelines draw it every epoch.

- Span corruption (Raffel et al. 2020 §3.1.4, §3.3.4; `random_spans_helper`,
  `random_spans_noise_mask`, `noise_span_to_unique_sentinel`,
  `nonnoise_span_to_unique_sentinel`): round(length x noise_density) noise tokens in
  round(noise / mean_noise_span_length) spans, span lengths by random segmentation, noise and
  non-noise spans interleaved starting with non-noise. Each noise span becomes one sentinel in
  the inputs; the targets are each sentinel followed by the tokens it dropped. Sentinels count
  down from the top of the vocabulary (`<extra_id_0>` = vocab_size - 1), which is the
  tokenizer's plus `extra_ids` (100, as T5). EOS is appended to both. The raw length is chosen
  so that the inputs are exactly `inputs_length` (512 -> 568 raw tokens, targets 114).
- Text infilling (Lewis et al. 2020 §2.2; fairseq denoising_dataset.py `add_whole_word_mask`
  with mask_length span-poisson, replace_length 1, and `add_insertion_noise`): ceil(words x
  mask_ratio) words are masked in spans of Poisson(poisson_lambda) words starting at random
  word starts; each span becomes ONE mask token, 0-length spans insert a mask token; the
  decoder's target is the whole original text. BART's sentence permutation is not done (its
  records keep no sentence boundaries).

Our tokenizers have no EOS; `[SEP]` serves as EOS here (T5's vocabulary: pad 0, EOS 1). Pad is 0
in every vocabulary of this repo, as in T5, and the decoder starts from it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples.bert import Document
from pretext_jax.input_pipeline.tokenizers import word_starts

NOISES = ("span_corruption", "text_infilling")
MAX_CHUNK_TOKENS = 65536  # select_random_chunk's max_length in span_corruption
CONCAT_DOCUMENTS = 128  # reduce_concat_tokens' batch_size in span_corruption
POISSON_CUTOFF = 1e-7  # fairseq stops the span-length table where P(k) falls below this


@dataclasses.dataclass(frozen=True)
class Seq2SeqExampleConfig:
    """`noise`: `span_corruption` (T5) or `text_infilling` (BART). `inputs_length` is the
    encoder's length (T5: 512). Span corruption: `noise_density` 0.15, `mean_noise_span_length`
    3, `extra_ids` 100 sentinels appended to the tokenizer's vocabulary. Text infilling:
    `mask_ratio` 0.3 of the words in spans of Poisson(`poisson_lambda` 3) words; a span's mask
    token is a random token instead with probability `random_ratio` (fairseq --mask-random;
    the paper's text infilling: 0)."""

    noise: str = "span_corruption"
    """Noise: span_corruption (T5 §3.1.4) or text_infilling (BART §2.2)."""
    inputs_length: int = 512
    """Encoder input length in tokens incl. EOS, at least 8 (T5 512)."""
    noise_density: float = 0.15
    """Span corruption: fraction of tokens dropped into noise spans (T5 0.15)."""
    mean_noise_span_length: float = 3.0
    """Span corruption: mean length of a noise span in tokens (T5 3)."""
    extra_ids: int = 100
    """Sentinel ids added above the tokenizer's vocabulary, whatever the noise (T5 100)."""
    mask_ratio: float = 0.3
    """Text infilling: fraction of the words masked (BART 0.3)."""
    poisson_lambda: float = 3.0
    """Text infilling: mean of the Poisson span length in words (BART 3)."""
    random_ratio: float = 0.0
    """Text infilling: probability that a mask token is a random token instead (BART 0)."""

    def __post_init__(self) -> None:
        if self.noise not in NOISES:
            raise UserError(f"examples.noise={self.noise!r} is unknown; use one of {NOISES}")
        if self.inputs_length < 8:
            raise UserError(f"examples.inputs_length={self.inputs_length} is too small; use at "
                            "least 8")
        if not 0.0 < self.noise_density < 1.0 or self.mean_noise_span_length < 1.0:
            raise UserError("examples.noise_density must be in (0, 1) and "
                            "examples.mean_noise_span_length >= 1 (T5: 0.15 and 3)")
        if not 0.0 < self.mask_ratio < 1.0 or self.poisson_lambda <= 0.0:
            raise UserError("examples.mask_ratio must be in (0, 1) and examples.poisson_lambda "
                            "> 0 (BART: 0.3 and 3)")
        if not 0.0 <= self.random_ratio <= 1.0:
            raise UserError(f"examples.random_ratio={self.random_ratio} must be in [0, 1]")
        if self.extra_ids < 0:
            raise UserError("examples.extra_ids must be >= 0")
        if self.noise == "span_corruption":
            spans = span_counts(self.raw_length, self.noise_density,
                                self.mean_noise_span_length)[1]
            if spans > self.extra_ids:
                raise UserError(f"span corruption of {self.raw_length} tokens makes {spans} "
                                f"spans but examples.extra_ids={self.extra_ids} sentinels "
                                "exist; raise examples.extra_ids")

    @property
    def raw_length(self) -> int:
        """Tokens of original text per example."""
        if self.noise == "span_corruption":
            return random_spans_helper(self.inputs_length, self.noise_density,
                                       self.mean_noise_span_length)[0]
        return self.inputs_length - 1  # + EOS

    @property
    def targets_length(self) -> int:
        """The decoder's length."""
        if self.noise == "span_corruption":
            return random_spans_helper(self.inputs_length, self.noise_density,
                                       self.mean_noise_span_length)[1]
        return self.inputs_length


# --- Span corruption (T5) -------------------------------------------------------------------


def span_counts(length: int, noise_density: float, mean_noise_span_length: float
                ) -> tuple[int, int]:
    """(noise tokens, noise spans) of a `length`-token sequence: round(length x density), at
    least 1 and at most length - 1, in round(noise / mean) spans, at least 1 (Python's round
    halves to even, as tf.round)."""
    length = max(length, 2)
    noise = min(max(int(round(length * noise_density)), 1), length - 1)
    return noise, max(int(round(noise / mean_noise_span_length)), 1)


def random_spans_helper(inputs_length: int, noise_density: float,
                        mean_noise_span_length: float) -> tuple[int, int]:
    """(raw tokens, targets length) such that span corruption with one sentinel per span and
    EOS gives inputs of exactly `inputs_length` (the longest raw length that fits)."""

    def lengths(tokens: int) -> tuple[int, int]:
        noise = int(round(tokens * noise_density))
        spans = int(round(noise / mean_noise_span_length))
        return tokens - noise + spans + 1, noise + spans + 1

    tokens = inputs_length - 1
    while lengths(tokens + 1)[0] <= inputs_length:
        tokens += 1
    targets = lengths(tokens)[1]
    if noise_density == 0.5 and targets > inputs_length:  # the reference's adjustment
        tokens -= 1
        targets -= 1
    return tokens, targets


def random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator
                        ) -> np.ndarray:
    """`num_segments` positive lengths summing to `num_items`, every split equally likely: a
    random choice of num_segments - 1 of the num_items - 1 gaps."""
    first_in_segment = np.zeros(num_items, np.int64)
    first_in_segment[1:] = rng.permutation(np.arange(num_items - 1) < num_segments - 1)
    return np.bincount(np.cumsum(first_in_segment), minlength=num_segments)


def random_spans_noise_mask(length: int, noise_density: float, mean_noise_span_length: float,
                            rng: np.random.Generator) -> np.ndarray:
    """Boolean [length]: noise spans interleaved with non-noise spans, starting with
    non-noise, with the counts of `span_counts` and random span lengths. (Where there are
    fewer non-noise tokens than spans, which T5's settings never give, the span count is
    lowered to fit.)"""
    padded = max(length, 2)
    noise, spans = span_counts(length, noise_density, mean_noise_span_length)
    spans = min(spans, padded - noise)
    interleaved = np.stack([random_segmentation(padded - noise, spans, rng),
                            random_segmentation(noise, spans, rng)], axis=1).ravel()
    return np.repeat(np.tile([False, True], spans), interleaved)[:length]


def noise_span_to_unique_sentinel(tokens: np.ndarray, noise_mask: np.ndarray,
                                  top_sentinel: int) -> np.ndarray:
    """Each run of noise tokens replaced by one sentinel: top_sentinel for the first run,
    top_sentinel - 1 for the second, ..."""
    previous = np.concatenate([[False], noise_mask[:-1]])
    first = noise_mask & ~previous
    sentinels = top_sentinel + 1 - np.cumsum(first)
    return np.where(first, sentinels, tokens)[~(noise_mask & previous)]


def span_corruption(tokens: np.ndarray, config: Seq2SeqExampleConfig, vocab_size: int,
                    eos_id: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of T5's objective, each ending in EOS and unpadded."""
    mask = random_spans_noise_mask(len(tokens), config.noise_density,
                                   config.mean_noise_span_length, rng)
    inputs = noise_span_to_unique_sentinel(tokens, mask, vocab_size - 1)
    targets = noise_span_to_unique_sentinel(tokens, ~mask, vocab_size - 1)
    return np.append(inputs, eos_id), np.append(targets, eos_id)


# --- Text infilling (BART) ------------------------------------------------------------------


def poisson_probabilities(lam: float) -> np.ndarray:
    """P(k) for k = 0, 1, ... of Poisson(lam), up to (and including) the first below 1e-7 or
    k = 127 (fairseq's span-length table), normalised."""
    probabilities, term = [], math.exp(-lam)
    for k in range(128):
        probabilities.append(term)
        if term < POISSON_CUTOFF:
            break
        term *= lam / (k + 1)
    table = np.asarray(probabilities)
    return table / table.sum()


def sample_span_lengths(budget: int, probabilities: np.ndarray, rng: np.random.Generator
                        ) -> np.ndarray:
    """Span lengths (in words, 0 allowed) drawn until they cover `budget`, the last one cut
    so that they sum to exactly `budget`."""
    lengths = rng.choice(len(probabilities), size=budget, p=probabilities)
    while lengths.sum() < budget:
        lengths = np.concatenate([lengths, rng.choice(len(probabilities), size=budget,
                                                      p=probabilities)])
    cumulative = np.cumsum(lengths)
    last = int(np.searchsorted(cumulative, budget))  # first index reaching the budget
    lengths = lengths[: last + 1].copy()
    lengths[last] = budget - (cumulative[last - 1] if last else 0)
    return lengths


@dataclasses.dataclass(frozen=True)
class Infilled:
    """`source`: the noised tokens; `masked`: which original tokens a span covered (replaced by
    its mask token or deleted); `spans`: mask tokens standing for spans; `inserted`: mask
    tokens inserted for 0-length spans."""

    source: np.ndarray
    masked: np.ndarray
    spans: int
    inserted: int


def text_infilling(tokens: np.ndarray, word_starts: np.ndarray, mask_id: int,
                   config: Seq2SeqExampleConfig, random_vocab_size: int,
                   rng: np.random.Generator) -> Infilled:
    """BART's text infilling of `tokens` (ending in EOS, which is never masked; `word_starts`
    a bool per position). A span of n words starts at a random word start, keeps its first
    token as the mask token and deletes the rest of the n words; spans may run into each
    other, as in fairseq."""
    source = tokens.copy()
    is_start = word_starts.astype(np.int64)
    is_start[-1] = 0
    starts = np.flatnonzero(is_start)
    budget = int(math.ceil(len(starts) * config.mask_ratio))
    keep = np.ones(len(tokens), bool)
    if budget == 0:
        return Infilled(source, ~keep, 0, 0)
    lengths = sample_span_lengths(budget, poisson_probabilities(config.poisson_lambda), rng)
    inserts = int(np.sum(lengths == 0))
    lengths = lengths[lengths > 0]
    indices = starts[rng.permutation(len(starts))[: len(lengths)]]
    replace = rng.random(len(indices)) < config.random_ratio
    source[indices] = np.where(replace, rng.integers(1, random_vocab_size, len(indices)),
                               mask_id)
    first = indices
    covered = np.zeros(len(tokens), bool)
    covered[indices] = True
    is_start[-1] = len(tokens)  # acts as a huge word: a span never runs into EOS
    remaining = lengths - 1
    while len(indices):
        remaining = remaining - is_start[indices + 1]
        going = remaining >= 0
        indices, remaining = indices[going] + 1, remaining[going]
        keep[indices] = False
        covered[indices] = True
    source = insert_masks(source[keep], inserts, mask_id, config.random_ratio,
                          random_vocab_size, rng)
    return Infilled(source, covered, int(keep[first].sum()), inserts)


def insert_masks(tokens: np.ndarray, count: int, mask_id: int, random_ratio: float,
                 random_vocab_size: int, rng: np.random.Generator) -> np.ndarray:
    """`count` mask tokens (ceil(count x random_ratio) of them random tokens) inserted at
    random places before the final EOS (fairseq `add_insertion_noise`)."""
    if count == 0:
        return tokens
    total = len(tokens) + count
    positions = rng.permutation(total - 1)[:count]
    result = np.empty(total, tokens.dtype)
    is_noise = np.zeros(total, bool)
    is_noise[positions] = True
    num_random = int(math.ceil(count * random_ratio))
    result[positions[num_random:]] = mask_id
    result[positions[:num_random]] = rng.integers(1, random_vocab_size, num_random)
    result[~is_noise] = tokens
    return result


# --- Records --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Seq2SeqVocab:
    """The vocabulary facts the noise needs: the tokenizer's size (`text_vocab_size`), the
    model's (`vocab_size` = text + extra_ids; sentinels at the top), EOS, mask, and where words
    begin (the tokenizer's `continuation` and `joins_next`, as `MaskingVocab`)."""

    text_vocab_size: int
    vocab_size: int
    eos_id: int
    mask_id: int
    continuation: np.ndarray
    joins_next: np.ndarray | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, extra_ids: int) -> Seq2SeqVocab:
        return cls(tokenizer.vocab_size, tokenizer.vocab_size + extra_ids, tokenizer.sep_id,
                   tokenizer.mask_id, np.asarray(tokenizer.continuation, bool),
                   tokenizer.joins_next)

    def word_starts(self, ids: np.ndarray) -> np.ndarray:
        """A bool per position of `ids`: the piece begins a word (`tokenizers.word_starts`)."""
        return word_starts(ids, self.continuation, self.joins_next)


def chunk_documents(documents: Sequence[Document], raw_length: int, rng: np.random.Generator
                    ) -> Iterator[np.ndarray]:
    """Raw pieces of T5's layout: documents in random order, a random chunk of at most 65,536
    tokens of each, groups of 128 concatenated and cut into `raw_length` pieces."""
    order = rng.permutation(len(documents))
    for group_start in range(0, len(order), CONCAT_DOCUMENTS):
        pieces = []
        for index in order[group_start: group_start + CONCAT_DOCUMENTS]:
            tokens = np.concatenate([np.asarray(s, np.int32) for s in documents[index]])
            chunks = max(1, (len(tokens) - 1) // MAX_CHUNK_TOKENS + 1)
            chunk = int(rng.integers(0, chunks))
            pieces.append(tokens[chunk * MAX_CHUNK_TOKENS: (chunk + 1) * MAX_CHUNK_TOKENS])
        stream = np.concatenate(pieces)
        for start in range(0, len(stream), raw_length):
            yield stream[start: start + raw_length]


def create_training_examples(documents: Sequence[Document], config: Seq2SeqExampleConfig,
                             seed: int) -> Iterator[dict[str, np.ndarray]]:
    """Records {"tokens": [raw_length] int32}, padded with 0 where a group's last piece is
    shorter."""
    if not documents:
        raise UserError("the corpus has no documents; pass a non-empty corpus")
    for piece in chunk_documents(documents, config.raw_length, np.random.default_rng(seed)):
        tokens = np.zeros(config.raw_length, np.int32)
        tokens[: len(piece)] = piece
        yield {"tokens": tokens}


def noise_example(tokens: np.ndarray, vocab: Seq2SeqVocab, config: Seq2SeqExampleConfig,
                  rng: np.random.Generator) -> dict[str, np.ndarray]:
    """{"inputs": [inputs_length], "targets": [targets_length]} (int32, padded with 0) from the
    raw tokens of a record (its padding stripped)."""
    tokens = tokens[tokens != 0]
    if config.noise == "span_corruption":
        inputs, targets = span_corruption(tokens, config, vocab.vocab_size, vocab.eos_id, rng)
    else:
        targets = np.append(tokens, vocab.eos_id)
        inputs = text_infilling(targets, vocab.word_starts(targets), vocab.mask_id, config,
                                vocab.text_vocab_size, rng).source
        if len(inputs) > config.inputs_length:  # only if many 0-length spans add masks
            inputs = np.append(inputs[: config.inputs_length - 1], vocab.eos_id)
    features = {"inputs": np.zeros(config.inputs_length, np.int32),
                "targets": np.zeros(config.targets_length, np.int32)}
    features["inputs"][: len(inputs)] = inputs
    features["targets"][: len(targets)] = targets
    return features


class Seq2SeqNoising(grain.transforms.RandomMap):
    """Draws the noise each time a record is loaded, with Grain's per-record RNG (so reruns and
    resumes see the same noise)."""

    def __init__(self, vocab: Seq2SeqVocab, config: Seq2SeqExampleConfig):
        self.vocab = vocab
        self.config = config

    def random_map(self, element: dict[str, np.ndarray], rng: np.random.Generator
                   ) -> dict[str, np.ndarray]:
        return noise_example(np.asarray(element["tokens"]), self.vocab, self.config, rng)
