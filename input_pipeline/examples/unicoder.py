"""Unicoder pre-training inputs (Huang et al. 2019 §3) from one line-aligned parallel corpus of
two languages: every kept aligned line i makes one record that holds the fields of all five
tasks, so one batch feeds every loss.

- Base language: each record draws one of the two languages uniformly (`base`); the other is
  its translation side (`other`).
- MLM (XLM §3.2 as Unicoder keeps it): a monolingual stream in the base language of lines i,
  i+1, ... (XLM's layout: `</s> s_i </s> s_i+1 </s> ...`), as many whole sentences as fit
  `stream_length` tokens (`document`).
- Cross-lingual MLM (§3.3): the same lines as a cross-lingual document, the sentences at even
  index (the 2nd, 4th, ... of the document) replaced by their translations, so the document's
  languages alternate, starting in the base language; language ids follow each sentence,
  positions run through the document.
- TLM (XLM §3.3): `</s> base_i </s> </s> other_i </s>`, positions reset for the translation
  (`input_pipeline.examples.xlm.tlm_record`).
- Cross-lingual word recovery (§3.1): the base sentence X (`wr_source`) and its translation Y
  (`wr_target`), each padded to `max_sentence_length`; the model attends from X's embeddings
  over Y's and recovers X.
- Cross-lingual paraphrase classification (§3.2): `</s> base_i </s> </s> other_j </s>` with
  `pc_label` 1 for j = i (the aligned pair) and 0 for a negative, drawn with probability
  `paraphrase_negative_rate`, whose j is another kept line drawn uniformly. The paper mines hard
  negatives with a light paraphrase model (DSSM) trained on random negatives; here negatives are
  the random ones (no such model is part of this suite).

Pairs with an empty side or a side over `max_sentence_length` tokens are dropped (XLM's
`remove_long_sentences`). The draws (base language, negatives) are made once per preparation
from its seed; the MLM / TLM / cross-lingual MLM masks are drawn at every load
(`UnicoderMasking`, XLM's count^-alpha weighted choice of 15 %, 80/10/10)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path

import grain
import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples.bert import MaskingVocab, check_masking
from pretext_jax.input_pipeline.examples.xlm import (
    LineSplit,
    record,
    split_lines,
    tlm_record,
)
from pretext_jax.input_pipeline.examples.xlm import weighted_mask as xlm_weighted_mask
from pretext_jax.input_pipeline.parallel import open_parallel
from pretext_jax.input_pipeline.prepare import fingerprint
from pretext_jax.input_pipeline.records import SPEC_FILE, RecordDirectory, write_records
from pretext_jax.input_pipeline.tokenizers import Tokenizer, language_encoder, tokenizer_fingerprint

MASKED = ("mlm", "tlm", "xmlm")
"""The record groups masked at load (each `{group}_input_ids`, ... of `xlm.FEATURES`)."""


@dataclasses.dataclass(frozen=True)
class UnicoderExampleConfig:
    """Unicoder's data settings (XLM's where Unicoder keeps XLM's inputs)."""

    stream_length: int = 256
    """Tokens of a (cross-lingual) document, a TLM pair and a paraphrase pair (XLM `bptt`)."""
    max_sentence_length: int = 100
    """Aligned lines with a side longer than this many tokens are dropped (XLM `max_len`); also
    the word-recovery length."""
    paraphrase_negative_rate: float = 0.5
    """Share of paraphrase pairs whose second sentence is another line's translation."""
    language_alpha: float = 0.5
    """Exponent of the language sampling of the shared vocabulary (XLM §3.1)."""
    mask_alpha: float = 0.5
    """Masked tokens drawn with weights count^-mask_alpha (XLM §3.3)."""
    masked_lm_prob: float = 0.15
    """Fraction of a sequence's tokens to predict (XLM `word_pred`)."""
    max_predictions_per_seq: int = 39
    """Most predictions per sequence."""
    mask_token_prob: float = 0.8
    """Share of chosen tokens replaced by [MASK]."""
    random_token_prob: float = 0.1
    """Share of chosen tokens replaced by a random id (the rest are kept)."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_sentence_length <= self.stream_length // 2 - 2:
            raise UserError(f"examples.max_sentence_length={self.max_sentence_length} must be "
                            f"in [1, stream_length/2 - 2 = {self.stream_length // 2 - 2}] so "
                            "that a pair fits a record")
        if not 0.0 <= self.paraphrase_negative_rate <= 1.0:
            raise UserError(f"examples.paraphrase_negative_rate="
                            f"{self.paraphrase_negative_rate} must be in [0, 1]")
        if not 0.0 < self.language_alpha <= 1.0 or self.mask_alpha < 0.0:
            raise UserError("examples.language_alpha must be in (0, 1] and examples.mask_alpha "
                            ">= 0 (XLM: 0.5 and 0.5)")
        check_masking(self)


def parallel_languages(spec: str) -> tuple[str, str]:
    """The two languages of the parallel corpus `spec`; anything else is a UserError."""
    languages = tuple(open_parallel(spec).languages)
    if len(languages) != 2:
        raise UserError(f"Unicoder trains on a parallel corpus of two languages (data.source="
                        f"train.en,train.de); {spec!r} has {len(languages)}")
    return languages  # type: ignore[return-value]


def document(lines: Sequence[dict[str, list[int]]], start: int, languages: Sequence[str],
             ids: dict[str, int], length: int, eos_id: int, pad_id: int
             ) -> dict[str, np.ndarray]:
    """`</s> s_0 </s> s_1 </s> ...` of lines start, start+1, ... with sentence k in
    `languages[k % len(languages)]` (one language: a monolingual stream; two: a cross-lingual
    document whose even-index sentences are translations), whole sentences while they fit
    `length`; each sentence's closing </s> takes its language, the opening one the first's."""
    tokens, langs = [eos_id], [ids[languages[0]]]
    for k, line in enumerate(lines[start:]):
        language = languages[k % len(languages)]
        sentence = line[language]
        if len(tokens) + len(sentence) + 1 > length:
            break
        tokens += [*sentence, eos_id]
        langs += [ids[language]] * (len(sentence) + 1)
    return record(np.asarray(tokens, np.int32), np.arange(len(tokens)), np.asarray(langs),
                  length, pad_id)


def padded(tokens: Sequence[int], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(`tokens` padded to `length` with `pad_id`, its 0/1 mask), int32."""
    ids = np.full(length, pad_id, np.int32)
    ids[:len(tokens)] = tokens
    return ids, (np.arange(length) < len(tokens)).astype(np.int32)


def prefixed(prefix: str, features: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {f"{prefix}_{key}": value for key, value in features.items()}


def unicoder_examples(lines: Sequence[dict[str, list[int]]], languages: Sequence[str],
                      ids: dict[str, int], config: UnicoderExampleConfig, eos_id: int,
                      pad_id: int, seed: int) -> Iterator[dict[str, np.ndarray]]:
    """One record per tokenized aligned line (see the module docstring); the base language and
    the paraphrase negatives are drawn from `seed`."""
    rng = np.random.default_rng(seed)
    count, length = len(lines), config.stream_length
    bases = rng.integers(0, 2, count)
    negatives = rng.random(count) < config.paraphrase_negative_rate
    if count < 2:
        negatives[:] = False
    partners = (np.arange(count) + rng.integers(1, max(count, 2), count)) % max(count, 1)
    for i, line in enumerate(lines):
        base, other = languages[bases[i]], languages[1 - bases[i]]
        source, source_mask = padded(line[base], config.max_sentence_length, pad_id)
        target, target_mask = padded(line[other], config.max_sentence_length, pad_id)
        partner = lines[partners[i]] if negatives[i] else line
        yield {
            **prefixed("mlm", document(lines, i, [base], ids, length, eos_id, pad_id)),
            **prefixed("xmlm", document(lines, i, [base, other], ids, length, eos_id, pad_id)),
            **prefixed("tlm", tlm_record(line[base], line[other], ids[base], ids[other],
                                         config, eos_id, pad_id)),
            **prefixed("pc", tlm_record(line[base], partner[other], ids[base], ids[other],
                                        config, eos_id, pad_id)),
            "pc_label": np.asarray([0 if negatives[i] else 1], np.int32),
            "wr_source": source, "wr_source_mask": source_mask,
            "wr_target": target, "wr_target_mask": target_mask,
            "wr_langs": np.asarray([ids[base], ids[other]], np.int32),
        }


def tokenized_lines(spec: str, tokenizer: Tokenizer, config: UnicoderExampleConfig,
                    split: LineSplit | None) -> list[dict[str, list[int]]]:
    """The aligned lines of `spec` (one side of `split`) as token ids, those with an empty side
    or a side over `max_sentence_length` tokens dropped."""
    source = open_parallel(spec)
    encode = {language: language_encoder(tokenizer, language) for language in source.languages}
    kept = []
    for line in split_lines(source, split):
        encoded = {language: list(encode[language](line[language]))
                   for language in source.languages}
        if all(0 < len(t) <= config.max_sentence_length for t in encoded.values()):
            kept.append(encoded)
    return kept


def prepare_unicoder_records(spec: str, tokenizer: Tokenizer, config: UnicoderExampleConfig,
                             ids: dict[str, int], cache_root: Path, seed: int,
                             split: LineSplit | None = None) -> RecordDirectory:
    """Unicoder's records of the parallel corpus `spec` (of one side of `split`), written once
    under `cache_root` (kept: a key of the files, tokenizer, settings, split and seed)."""
    languages = parallel_languages(spec)
    key = fingerprint(open_parallel(spec).fingerprint(), tokenizer_fingerprint(tokenizer),
                      dataclasses.asdict(config), ids, seed,
                      *([] if split is None else [dataclasses.asdict(split)]))
    directory = Path(cache_root) / f"unicoder-{key}"
    if not (directory / SPEC_FILE).is_file():
        lines = tokenized_lines(spec, tokenizer, config, split)
        if not lines:
            raise UserError(f"{spec!r} has no aligned line with both sides of 1 to "
                            f"{config.max_sentence_length} tokens; raise "
                            "examples.max_sentence_length or give a parallel corpus")
        write_records(unicoder_examples(lines, languages, ids, config, tokenizer.eos_id,
                                        tokenizer.pad_id, seed),
                      directory, metadata={"source": spec})
    return RecordDirectory(directory)


class UnicoderMasking(grain.transforms.RandomMap):
    """XLM's MLM masking (`input_pipeline.examples.xlm.weighted_mask`) of each masked group of a
    record (MLM, TLM, cross-lingual MLM) at every load: masks `{group}_input_ids` and adds
    `{group}_masked_lm_positions`, `_ids` and `_weights` ([max_predictions_per_seq])."""

    def __init__(self, vocab: MaskingVocab, weights: np.ndarray, config: UnicoderExampleConfig):
        self.vocab, self.weights, self.config = vocab, np.asarray(weights), config

    def random_map(self, element: dict[str, np.ndarray], rng: np.random.Generator
                   ) -> dict[str, np.ndarray]:
        out = dict(element)
        slots = self.config.max_predictions_per_seq
        for group in MASKED:
            length = int(element[f"{group}_input_mask"].sum())
            ids = np.array(element[f"{group}_input_ids"])
            output, positions, labels = xlm_weighted_mask(ids[:length], self.weights,
                                                          self.vocab, self.config, rng)
            ids[:length] = output
            out[f"{group}_input_ids"] = ids
            count = len(positions)
            for name, values, dtype in (("masked_lm_positions", positions, np.int32),
                                        ("masked_lm_ids", labels, np.int32),
                                        ("masked_lm_weights", np.ones(count), np.float32)):
                out[f"{group}_{name}"] = np.zeros(slots, dtype)
                out[f"{group}_{name}"][:count] = values
        return out


def token_counts(records: RecordDirectory, vocab_size: int) -> np.ndarray:
    """Per-id counts of the TLM halves' real tokens (each kept line's two sentences and their
    </s>), the corpus counts that the masking weights read."""
    counts = np.zeros(vocab_size, np.int64)
    for index in range(len(records)):
        row = records.spec.decode(records.source[index])
        counts += np.bincount(row["tlm_input_ids"][row["tlm_input_mask"] > 0],
                              minlength=vocab_size)
    return counts
