"""MASS examples (Song et al. 2019, "MASS: Masked Sequence to Sequence Pre-training for Language
Generation", §2.2 and §3.1; reference microsoft/MASS MASS-unsupNMT/src/trainer.py
`restricted_mask_sent`, `shuffle_segments`, `mask_word`).

Preparation (`create_training_examples`, stored once) keeps each sentence of the corpus as one
segment: its tokens followed by EOS ([SEP]), cut into pieces of at most `max_seq_length` tokens
(EOS included) where a sentence is longer, or with `drop_long_sentences` left out (the
reference's `--max_len`); pieces of fewer than `min_length` tokens before EOS are dropped (MASS
trains with --min_len 5). With `pack_sentences` (ProphetNet's 512-token
inputs) a document's sentences, each followed by EOS, are joined and cut into pieces of
`max_seq_length`. Records hold the segment's tokens, padded with 0.

Masking (`MassMasking`, a Grain `RandomMap`, drawn every time a record is loaded, as
`seq2seq_examples.Seq2SeqNoising`) of a segment x of m tokens (EOS included):
- The fragment x[u : u + k] is k = max(1, round(fragment_fraction x (m + 1))) consecutive
  tokens, m + 1 counting the sentence-start </s> before every XLM sentence as the reference
  does (`fragment_counts_sentence_start`; without it round(fragment_fraction x m); Python's
  round halves to even, as the reference), or `fragment_length` (capped at m) when set. Its
  start u is 0 with probability `fragment_at_start_prob` (0.2), m - k with
  `fragment_at_end_prob` (0.2), and otherwise uniform over 0 .. m - k (the reference's
  `shuffle_segments`: the fragment at the sentence start 20% of the time, at its end 20%, at a
  random place 60%). With both probabilities 0 the start is uniform. With `fragment_block` B
  (ProphetNet §4.1: a span of 15 % in every 64 tokens) there is one such fragment in every
  block of B tokens, sized and placed within its block (`fragment_positions`).
- Encoder input: x with the fragment's tokens replaced 80/10/10 (§3.1, as BERT): [MASK] with
  `mask_token_prob`, a random id of the whole vocabulary with `random_token_prob`, unchanged
  otherwise (`bert_examples.corrupt`, the reference's `mask_word`). `input_mask` marks the m
  tokens of the segment (a random token may be 0 = pad, so the mask is explicit); the encoder
  attends over all of them. `cross_attention_mask` marks those of them that are not [MASK]: the
  decoder's cross-attention skips the [MASK]ed encoder positions (the reference's `mass_step`
  passes `enc_mask = x1 != mask_index` to its decoder), not the random or kept ones.
- Decoder: it predicts exactly the fragment (`targets` = x at u .. u + k - 1, 0 elsewhere; the
  loss is on non-zero targets only). Its input at position j of the fragment is x[j - 1], the
  fragment shifted right, the first being the token before the fragment (or the decoder start
  token 0 when u = 0, which plays the reference's sentence-start </s>); every other position of
  the segment is [MASK].

Positions: the paper keeps the decoder's tokens at their positions in the sentence; to save
computation it drops the masked decoder positions and keeps the absolute position embeddings of
the fragment tokens (§3.1; the reference passes `positions` to its decoder). The T5 model has
no absolute positions: its decoder knows where the fragment sits only through its relative
position bias to the decoder positions before it. So the decoder input and the targets keep the
segment's full length, with the fragment at its original positions and [MASK] elsewhere (the
paper's Figure 1); positions after the fragment cannot affect it (causal attention) and carry
no loss. The one difference from the paper's figure: where it draws [MASK] as the first
decoder input, the reference (and we) feed the token before the fragment, which the encoder
sees unmasked anyway, so the decoder learns no fragment token from it.

The reference's layout (`XLMMassMasking`, for the XLM encoder-decoder of `models.xlm`, whose
positions are absolute; MASS-unsupNMT/src/trainer.py `restricted_mask_sent` and `mass_step`):
the sentence is `</s> x </s>` (XLM's batches start every sentence with EOS), l = m + 1 tokens,
position p of it being position p - 1 of the segment. The fragment has k = round(fraction x l)
tokens (at most m; the reference's `mask_len` of the sentence length with both EOS) among
positions 1 .. l - 1 (the leading EOS is never masked), placed as above. The encoder reads the
l tokens at positions 0 .. l - 1 with the fragment corrupted 80/10/10. The decoder reads only
the k fragment tokens shifted right, `decoder_inputs` = sentence[p - 1] for each fragment
position p, at `decoder_positions` p - 1 (the positions of the tokens it reads, the reference's
`positions`), and predicts `targets` = sentence[p]; rows are padded to the longest fragment
of their padded length (`xlm_decoder_length`) and `decoder_mask` marks the k real ones.

Batches: `train.batch_size` rows of `max_seq_length` per step, or with `tokens_per_batch` the
reference's batches of a token budget (XLM's `--tokens_per_batch`, which MASS-unsupNMT trains
with: rows of similar length together, their number varying per step;
`input_pipeline.token_batches`). A row of a batch of length L is its record cut to L tokens
(`cut_segment`; L - 1 in the reference's layout, whose leading </s> the budget counts) before
it is masked, so every field follows L: the decoder rows of the reference's layout are the
longest fragment of L tokens.

Edge cases (§2.2, Table 1): k = 1 is BERT's masked LM (one masked token, the decoder's only
non-[MASK] input is a token the encoder sees); k = m is a standard LM (the whole encoder input
is masked, the decoder reads x shifted right from the start token and predicts all of x).

Bilingual pre-training (§3.1 and §4.1, unsupervised NMT; MASS-unsupNMT on XLM, which trains
`--mass_steps 'en,fr'` with one monolingual batch of each language in turn and language
embeddings in encoder and decoder): `data.source` names monolingual text per language,
`en=SOURCE,de=SOURCE` (`language_corpora`; not aligned, each side is its own corpus), with one
sentencepiece vocabulary trained on both (`xlm_examples.prepare_languages`, languages sampled in
proportion to their sentences: alpha 1, as a vocabulary learned on the concatenation) and
held-out text per language (`data.eval_source` of the same form, or `data.held_out_fraction`
of each). Language ids are the sorted order of the languages (`xlm_examples.language_ids`:
de = 0, en = 1), stored per segment (`language`) and given to every token of the encoder and
decoder inputs (`language_ids`). Every training step reads one language, drawn as XLM's
`shuf_order` draws the `--mass_steps` languages (uniform: MASS-unsupNMT leaves
`lg_sampling_factor` at -1), through `xlm_examples.StepSchedule`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples.bert import Document, MaskingVocab, corrupt
from pretext_jax.input_pipeline.examples.xlm import parse_corpora

DECODER_START = 0  # T5's decoder start token (= pad), models.t5.PAD_ID


@dataclasses.dataclass(frozen=True)
class MassExampleConfig:
    """Segment length, fragment length and start, and the 80/10/10 of the fragment in the
    encoder input (see the module docstring)."""

    max_seq_length: int = 100
    """Tokens per segment incl. EOS; longer sentences are cut (MASS/XLM --max_len 100)."""
    min_length: int = 5
    """Segments with fewer tokens (before EOS) are dropped (MASS --min_len 5)."""
    fragment_fraction: float = 0.5
    """k = max(1, round(fraction x m)) masked consecutive tokens of m (MASS --word_mass 0.5)."""
    fragment_length: int = 0
    """A fixed k instead (capped at m); 0 = use fragment_fraction. 1 gives BERT's MLM (§2.2)."""
    fragment_counts_sentence_start: bool = True
    """k = round(fraction x (m + 1)): the fraction of the sentence as MASS-unsupNMT's
    `restricted_mask_sent` counts it, with the sentence-start </s> XLM puts before every
    sentence (words + 2 positions, never itself masked). False = round(fraction x m) (ProphetNet's
    15 % of each block)."""
    fragment_at_start_prob: float = 0.2
    """Probability that the fragment starts the segment (the reference's 0.2)."""
    fragment_at_end_prob: float = 0.2
    """Probability that the fragment ends the segment (the reference's 0.2); else uniform."""
    mask_token_prob: float = 0.8
    """Share of fragment tokens given [MASK] in the encoder input (MASS §3.1 0.8)."""
    random_token_prob: float = 0.1
    """Share of fragment tokens given a random token (0.1; the rest stay unchanged)."""
    fragment_block: int = 0
    """One fragment in every block of this many tokens (ProphetNet §4.1: 64, a span of 15 %
    in every 64 tokens); 0 = one fragment per segment (MASS)."""
    pack_sentences: bool = False
    """Fill each segment with a document's consecutive sentences (each ending in EOS) up to
    max_seq_length (ProphetNet's 512-token inputs); False = one sentence per segment (MASS)."""
    drop_long_sentences: bool = False
    """Leave out sentences longer than max_seq_length - 1 tokens (the reference's --max_len
    removes them); False = cut them into pieces."""
    tokens_per_batch: int = 0
    """Training batches of at most this many tokens (rows x their length, the reference's
    sentence with its leading </s> in mass_xlm's layout), rows of similar length together and
    their number varying per step (XLM's --tokens_per_batch, summed over the GPUs;
    `input_pipeline.token_batches`); 0 = train.batch_size rows of max_seq_length per step."""
    length_buckets: int = 8
    """With tokens_per_batch: the row lengths a batch is padded to, at most this many
    (percentiles of the segments' lengths, the longest included), so at most this many batch
    shapes compile."""

    def __post_init__(self) -> None:
        if self.max_seq_length < 2:
            raise UserError(f"examples.max_seq_length={self.max_seq_length} is too small; use "
                            "at least 2 (a token and EOS)")
        if not 1 <= self.min_length < self.max_seq_length:
            raise UserError(f"examples.min_length={self.min_length} must be in [1, "
                            f"examples.max_seq_length) (MASS: 5)")
        if not 0.0 < self.fragment_fraction <= 1.0 or self.fragment_length < 0:
            raise UserError("examples.fragment_fraction must be in (0, 1] and "
                            "examples.fragment_length >= 0 (MASS: 0.5 and 0 = use the fraction)")
        probabilities = (self.fragment_at_start_prob, self.fragment_at_end_prob)
        if min(probabilities) < 0.0 or sum(probabilities) > 1.0:
            raise UserError("examples.fragment_at_start_prob and examples.fragment_at_end_prob "
                            "must be >= 0 with a sum <= 1 (MASS: 0.2 and 0.2)")
        if self.tokens_per_batch < 0 or self.length_buckets < 1:
            raise UserError(f"examples.tokens_per_batch={self.tokens_per_batch} must be >= 0 (0 "
                            f"= fixed rows) and examples.length_buckets={self.length_buckets} "
                            ">= 1; e.g. examples.tokens_per_batch=24000 examples.length_buckets=8")
        if self.fragment_block < 0:
            raise UserError(f"examples.fragment_block={self.fragment_block} must be >= 0 "
                            "(0 = one fragment per segment; ProphetNet: 64)")
        if (min(self.mask_token_prob, self.random_token_prob) < 0.0
                or self.mask_token_prob + self.random_token_prob > 1.0):
            raise UserError(
                f"examples.mask_token_prob={self.mask_token_prob} and examples.random_token_prob"
                f"={self.random_token_prob} must be >= 0 with a sum <= 1 (MASS: 0.8 and 0.1)")

    def fragment_size(self, length: int) -> int:
        """k for a segment of `length` tokens (EOS included)."""
        if self.fragment_length:
            return min(self.fragment_length, length)
        counted = length + 1 if self.fragment_counts_sentence_start else length
        return min(max(1, int(round(self.fragment_fraction * counted))), length)


def fragment_start(length: int, size: int, config: MassExampleConfig,
                   rng: np.random.Generator) -> int:
    """The fragment's first position u in 0 .. length - size (see the module docstring)."""
    last = length - size
    draw = rng.random()
    if draw < config.fragment_at_start_prob:
        return 0
    if draw < config.fragment_at_start_prob + config.fragment_at_end_prob:
        return last
    return int(rng.integers(0, last + 1))


def fragment_positions(length: int, config: MassExampleConfig, rng: np.random.Generator
                       ) -> np.ndarray:
    """The masked positions of a segment of `length` tokens: one fragment (MASS), or with
    `fragment_block` one in every block of that many tokens (the last block may be shorter),
    each sized by `fragment_size` of its block and placed in it by `fragment_start`."""
    block = config.fragment_block or length
    fragments = []
    for first in range(0, length, block):
        block_length = min(block, length - first)
        size = config.fragment_size(block_length)
        start = first + fragment_start(block_length, size, config, rng)
        fragments.append(np.arange(start, start + size))
    return np.concatenate(fragments)


def segments(documents: Sequence[Document], config: MassExampleConfig, eos_id: int
             ) -> Iterator[np.ndarray]:
    """Every sentence's tokens in pieces of at most max_seq_length - 1, each followed by EOS
    (longer sentences left out with `drop_long_sentences`); pieces shorter than min_length are
    dropped. With `pack_sentences`, a document's sentences
    (each followed by EOS) are joined and cut into pieces of max_seq_length; a shorter last
    piece is kept if it has min_length tokens."""
    if config.pack_sentences:
        yield from packed_segments(documents, config, eos_id)
        return
    piece = config.max_seq_length - 1
    for document in documents:
        for sentence in document:
            tokens = np.asarray(sentence, np.int32)
            if config.drop_long_sentences and len(tokens) > piece:
                continue
            for start in range(0, len(tokens), piece):
                chunk = tokens[start:start + piece]
                if len(chunk) >= config.min_length:
                    yield np.append(chunk, np.int32(eos_id))


def packed_segments(documents: Sequence[Document], config: MassExampleConfig, eos_id: int
                    ) -> Iterator[np.ndarray]:
    """Each document's sentences, each followed by EOS, as one stream cut into pieces of
    max_seq_length tokens (`segments` with `pack_sentences`)."""
    for document in documents:
        stream = np.concatenate([np.append(np.asarray(sentence, np.int32), np.int32(eos_id))
                                 for sentence in document] or [np.zeros(0, np.int32)])
        for start in range(0, len(stream), config.max_seq_length):
            piece = stream[start:start + config.max_seq_length]
            if len(piece) >= config.min_length:
                yield piece


def create_training_examples(documents: Sequence[Document], config: MassExampleConfig,
                             eos_id: int, language: int | None = None
                             ) -> Iterator[dict[str, np.ndarray]]:
    """Records {"tokens": [max_seq_length] int32}: one segment each, padded with 0; with a
    `language` id (bilingual corpora) also {"language": [1] int32}."""
    if not documents:
        raise UserError("the corpus has no documents; pass a non-empty corpus")
    for segment in segments(documents, config, eos_id):
        tokens = np.zeros(config.max_seq_length, np.int32)
        tokens[:len(segment)] = segment
        yield {"tokens": tokens} if language is None else {
            "tokens": tokens, "language": np.array([language], np.int32)}


def language_corpora(spec: str) -> dict[str, str] | None:
    """{language: source} of a bilingual `data.source` (`en=SOURCE,de=SOURCE`, as XLM's), or
    None for one monolingual source (no `LANG=` in it)."""
    if "=" not in spec:
        return None
    return parse_corpora(spec)


def mass_example(tokens: np.ndarray, fragment: np.ndarray, vocab: MaskingVocab,
                 config: MassExampleConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The features of a segment (`tokens`, padded with 0) with the fragment positions
    `fragment` (`fragment_positions`): `inputs`, `input_mask`, `cross_attention_mask`,
    `decoder_inputs` and `targets`, each [len(tokens)] int32 (see the module docstring). A
    bilingual segment's `language_ids` are added by `MassMasking`."""
    length = int(np.count_nonzero(tokens))
    inputs = tokens.copy()
    corrupt(inputs, fragment, vocab, config, rng)
    previous = np.concatenate([[DECODER_START], tokens[:-1]]).astype(np.int32)
    decoder_inputs = np.zeros_like(tokens)
    decoder_inputs[:length] = vocab.mask_id
    decoder_inputs[fragment] = previous[fragment]
    targets = np.zeros_like(tokens)
    targets[fragment] = tokens[fragment]
    input_mask = np.arange(len(tokens)) < length
    return {"inputs": inputs, "input_mask": input_mask.astype(np.int32),
            "cross_attention_mask": (input_mask & (inputs != vocab.mask_id)).astype(np.int32),
            "decoder_inputs": decoder_inputs, "targets": targets}


def cut_segment(element: dict[str, np.ndarray], length: int, rng: np.random.Generator, *,
                extra: int) -> dict[str, np.ndarray]:
    """A record as a row of a batch `length` tokens long (`token_batches.TokenBudgetBatches`'
    `fit`): its padded `tokens` cut to `length - extra` (`extra`: the positions the layout
    adds, 1 for the reference's leading </s>); every field the masking makes follows that
    length. Nothing is drawn (`rng` unused)."""
    del rng
    return {**element, "tokens": element["tokens"][:length - extra]}


class MassMasking(grain.transforms.RandomMap):
    """Draws the fragment and its 80/10/10 each time a record is loaded, with Grain's
    per-record RNG (so reruns and resumes see the same masks)."""

    def __init__(self, vocab: MaskingVocab, config: MassExampleConfig):
        self.vocab = vocab
        self.config = config

    def random_map(self, element: dict[str, Any], rng: np.random.Generator
                   ) -> dict[str, np.ndarray]:
        tokens = np.asarray(element["tokens"], np.int32)
        length = int(np.count_nonzero(tokens))
        fragment = fragment_positions(length, self.config, rng)
        example = mass_example(tokens, fragment, self.vocab, self.config, rng)
        if "language" in element:  # every token of encoder and decoder is of that language
            example["language_ids"] = np.full(len(tokens), element["language"][0], np.int32)
        return example


def xlm_decoder_length(config: MassExampleConfig) -> int:
    """The decoder rows' length in the reference's layout: the longest fragment, that of a
    segment of `max_seq_length` tokens (k grows with the segment's length)."""
    return config.fragment_size(config.max_seq_length)


def xlm_mass_example(tokens: np.ndarray, vocab: MaskingVocab, config: MassExampleConfig,
                     rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The reference's layout of a segment (`tokens` [L], padded with 0; see the module
    docstring): `inputs`, `input_mask`, `cross_attention_mask` [L + 1] (the sentence with its
    leading EOS) and `decoder_inputs`, `decoder_positions`, `targets`, `decoder_mask`
    [the longest fragment of L tokens: `xlm_decoder_length` for a record of max_seq_length],
    int32."""
    length = int(np.count_nonzero(tokens))
    size = config.fragment_size(length)  # the leading EOS counted, as the T5 layout's
    sentence = np.concatenate([[vocab.sep_id], tokens]).astype(np.int32)
    fragment = 1 + fragment_start(length, size, config, rng) + np.arange(size)  # in sentence
    inputs = sentence.copy()
    corrupt(inputs, fragment, vocab, config, rng)
    input_mask = np.arange(len(sentence)) < length + 1
    decoder = {key: np.zeros(config.fragment_size(len(tokens)), np.int32)
               for key in ("decoder_inputs", "decoder_positions", "targets", "decoder_mask")}
    decoder["decoder_inputs"][:size] = sentence[fragment - 1]
    decoder["decoder_positions"][:size] = fragment - 1
    decoder["targets"][:size] = sentence[fragment]
    decoder["decoder_mask"][:size] = 1
    return {"inputs": inputs, "input_mask": input_mask.astype(np.int32),
            "cross_attention_mask": (input_mask & (inputs != vocab.mask_id)).astype(np.int32),
            **decoder}


class XLMMassMasking(MassMasking):
    """`MassMasking` in the reference's layout (`xlm_mass_example`); a bilingual segment's
    language is on every encoder (`language_ids`) and decoder (`decoder_language_ids`)
    position."""

    def random_map(self, element: dict[str, Any], rng: np.random.Generator
                   ) -> dict[str, np.ndarray]:
        example = xlm_mass_example(np.asarray(element["tokens"], np.int32), self.vocab,
                                   self.config, rng)
        if "language" in element:
            language = element["language"][0]
            example["language_ids"] = np.full(len(example["inputs"]), language, np.int32)
            example["decoder_language_ids"] = np.full(len(example["targets"]), language,
                                                      np.int32)
        return example
