"""Supervised translation examples from a parallel corpus (`input_pipeline.parallel`): the
fine-tuning data of MASS's unsupervised-NMT models once they are trained on pairs, and the
Multi30K check (Song et al. 2019 §4.1 fine-tune and evaluate translation; here supervised).

Each aligned line gives one record for the direction `source_language` -> `target_language`:
the source sentence's tokens and EOS in `inputs` (`input_mask` 1 on them), the target sentence's
tokens and EOS in `targets` (`target_mask` 1 on them), both padded with the tokenizer's pad id; a
side longer than its `max_*_length` (EOS included) is cut, a pair with an empty side is dropped
(it would teach the model to stop at once or translate nothing). `source_language_ids` and
`target_language_ids` hold the two languages' ids (sorted order of the corpus's languages,
`xlm_examples.language_ids`, the ids MASS's bilingual pre-training uses for the same languages)
on every position, for models with language embeddings.

With `tokens_per_batch` a pair's length is its longer side's (fairseq's `num_tokens`), and a
batch of length L holds each side cut to min(L, its padded length) (`token_batches.cut_rows`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.parallel import ParallelSource, open_parallel
from pretext_jax.input_pipeline.prepare import fingerprint
from pretext_jax.input_pipeline.records import SPEC_FILE, RecordDirectory, write_records
from pretext_jax.input_pipeline.tokenizers import Tokenizer


@dataclasses.dataclass(frozen=True)
class TranslationExampleConfig:
    """The direction, the lengths, and how much of the held-out set is decoded for BLEU, and
    how."""

    source_language: str = "en"
    """Language translated from: a language of the parallel corpus (Multi30K: en, de, fr)."""
    target_language: str = "de"
    """Language translated into."""
    max_source_length: int = 64
    """Source tokens incl. EOS; longer sentences are cut."""
    max_target_length: int = 64
    """Target tokens incl. EOS; longer ones are cut, and decoding stops after as many."""
    bleu_sentences: int = 0
    """Held-out pairs decoded for BLEU at each evaluation: the first n; 0 = all."""
    num_beams: int = 1
    """Beams of the BLEU check's decoding: 1 = greedy; more = beam search (XLM, MASS: 1 in
    training evaluation; MASS supervised NMT 5), and greedy BLEU is reported beside."""
    length_penalty: float = 1.0
    """Beam search's length penalty: score = sum(log p) / length ** this (XLM's default 1)."""
    tokens_per_batch: int = 0
    """Training batches of at most this many tokens (rows x the longer side's length), pairs of
    similar length together and their number varying per step (fairseq's --max-tokens, XLM's
    --tokens_per_batch; `input_pipeline.token_batches`); 0 = train.batch_size rows."""
    length_buckets: int = 8
    """With tokens_per_batch: at most this many row lengths (percentiles), so at most this many
    batch shapes compile."""

    def __post_init__(self) -> None:
        if self.source_language == self.target_language:
            raise UserError(f"examples.source_language and examples.target_language are both "
                            f"{self.source_language}; name two languages of the corpus")
        if min(self.max_source_length, self.max_target_length) < 2:
            raise UserError("examples.max_source_length and examples.max_target_length must be "
                            ">= 2 (a token and EOS)")
        if self.tokens_per_batch < 0 or self.length_buckets < 1:
            raise UserError(f"examples.tokens_per_batch={self.tokens_per_batch} must be >= 0 (0 "
                            f"= fixed rows) and examples.length_buckets={self.length_buckets} "
                            ">= 1; e.g. examples.tokens_per_batch=4000")
        if self.bleu_sentences < 0:
            raise UserError(f"examples.bleu_sentences={self.bleu_sentences} must be >= 0 "
                            "(0 = every held-out pair)")
        if self.num_beams < 1:
            raise UserError(f"examples.num_beams={self.num_beams} must be >= 1 (1 = greedy)")


def direction(source: ParallelSource, config: TranslationExampleConfig) -> tuple[str, str]:
    """(source language, target language), both checked to be in the corpus."""
    missing = [lang for lang in (config.source_language, config.target_language)
               if lang not in source.languages]
    if missing:
        raise UserError(f"the parallel corpus has no {', '.join(missing)} (it has "
                        f"{', '.join(source.languages)}); set examples.source_language / "
                        "examples.target_language")
    return config.source_language, config.target_language


def padded(ids: list[int], length: int, eos_id: int, pad_id: int) -> tuple[np.ndarray,
                                                                          np.ndarray]:
    """(ids cut to length - 1, then EOS, padded with pad_id to `length`; the 0/1 mask)."""
    tokens = [*ids[:length - 1], eos_id]
    out = np.full(length, pad_id, np.int32)
    out[:len(tokens)] = tokens
    return out, (np.arange(length) < len(tokens)).astype(np.int32)


def translation_record(source_ids: list[int], target_ids: list[int],
                       languages: tuple[int, int], config: TranslationExampleConfig,
                       eos_id: int, pad_id: int) -> dict[str, np.ndarray]:
    """The record of one pair (module docstring)."""
    inputs, input_mask = padded(source_ids, config.max_source_length, eos_id, pad_id)
    targets, target_mask = padded(target_ids, config.max_target_length, eos_id, pad_id)
    return {"inputs": inputs, "input_mask": input_mask, "targets": targets,
            "target_mask": target_mask,
            "source_language_ids": np.full(config.max_source_length, languages[0], np.int32),
            "target_language_ids": np.full(config.max_target_length, languages[1], np.int32)}


def pairs(source: ParallelSource, config: TranslationExampleConfig
          ) -> Iterator[tuple[str, str]]:
    """(source sentence, target sentence) of every line with both sides non-empty."""
    first, second = direction(source, config)
    for line in source:
        if line[first] and line[second]:
            yield line[first], line[second]


def encoded_pairs(sentence_pairs: Iterable[tuple[str, str]], tokenizer: Tokenizer
                  ) -> Iterator[tuple[str, list[int], list[int]]]:
    """(target text, source ids, target ids) of every pair whose sides both have tokens."""
    for source_text, target_text in sentence_pairs:
        source_ids, target_ids = tokenizer.encode(source_text), tokenizer.encode(target_text)
        if source_ids and target_ids:
            yield target_text, source_ids, target_ids


def translation_examples(sentence_pairs: Iterable[tuple[str, str]], tokenizer: Tokenizer,
                         config: TranslationExampleConfig, languages: tuple[int, int]
                         ) -> Iterator[dict[str, np.ndarray]]:
    """One record per pair whose sides both have tokens."""
    for _, source_ids, target_ids in encoded_pairs(sentence_pairs, tokenizer):
        yield translation_record(source_ids, target_ids, languages, config, tokenizer.eos_id,
                                 tokenizer.pad_id)


def language_pair(source: ParallelSource, config: TranslationExampleConfig,
                  ids: Mapping[str, int]) -> tuple[int, int]:
    first, second = direction(source, config)
    return ids[first], ids[second]


def prepare_pairs(spec: str, tokenizer: Tokenizer, tokenizer_key: object,
                  config: TranslationExampleConfig, ids: Mapping[str, int], cache_root: Path
                  ) -> RecordDirectory:
    """The records of the parallel corpus `spec`, streamed into ArrayRecord files under
    `cache_root` (kept under a key of the files, the tokenizer and the settings; the decoding
    settings and the batching, which the records do not depend on, left out)."""
    source = open_parallel(spec)
    settings = {name: value for name, value in dataclasses.asdict(config).items()
                if name not in ("num_beams", "length_penalty", "tokens_per_batch",
                                "length_buckets")}
    key = fingerprint(source.fingerprint(), tokenizer_key, settings, ids)
    directory = Path(cache_root) / f"translation-{key}"
    if not (directory / SPEC_FILE).is_file():
        count = write_records(translation_examples(pairs(source, config), tokenizer, config,
                                                   language_pair(source, config, ids)),
                              directory, metadata={"source": spec})
        if not count:
            raise UserError(f"{spec} has no pair with both sides non-empty; check data.source")
    return RecordDirectory(directory)


def held_out_pairs(spec: str, tokenizer: Tokenizer, config: TranslationExampleConfig,
                   ids: Mapping[str, int]) -> tuple[dict[str, np.ndarray], list[str]]:
    """The held-out records of `spec` (in memory, in order) and their reference translations
    as written in the corpus (BLEU scores detokenised text against them)."""
    source = open_parallel(spec)
    languages = language_pair(source, config, ids)
    kept = list(encoded_pairs(pairs(source, config), tokenizer))
    if not kept:
        raise UserError(f"{spec} has no pair with both sides non-empty; check data.eval_source")
    records = [translation_record(source_ids, target_ids, languages, config, tokenizer.eos_id,
                                  tokenizer.pad_id) for _, source_ids, target_ids in kept]
    return ({k: np.stack([r[k] for r in records]) for k in records[0]},
            [target for target, _, _ in kept])
