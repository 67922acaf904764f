"""XLM pre-training inputs (Lample & Conneau 2019 §3.1-3.3; facebookresearch/XLM `xlm/data/`,
`xlm/trainer.py`, `xlm/utils.py`).

- Shared vocabulary (§3.1): one sentencepiece model trained on sentences sampled from every
  language's training text by a multinomial over languages, q_i = p_i^a / sum_j p_j^a with p_i
  language i's share of the sentences and a = 0.5 (`language_probabilities`,
  `tokenizer_sample`).
- CLM / MLM streams (§3.2-3.3; XLM `StreamDataset`): a language's sentences, each followed by
  the end-of-sentence token (the tokenizer's `eos_id`), form one token stream cut into pieces of
  `stream_length` tokens (256, XLM's `bptt`); each piece is a record tagged with its language
  (`stream_examples`, one `prepare.prepare_text` preparation per language). The last piece of a
  shard is padded (`input_mask` 0).
- Steps (XLM train.py `--mlm_steps 'en,de,en-de'`, `shuf_order`, `get_batch`): every training
  step reads one language's streams or one language pair's TLM records, chosen in cycles by
  `StepSchedule` (languages by q_i over the languages' sentence counts, the end-of-sentence
  counts of `stream_statistics`; pairs by q over their pair counts).
- MLM masking (§3.3; XLM `mask_out` with `sample_alpha`): 15 % of a record's tokens are chosen
  without replacement with weights proportional to count^-0.5 (the square root of the inverse
  corpus frequency; `mask_weights`), never the specials, padding or tokens that never occur;
  then 80 % [MASK], 10 % a random id, 10 % kept. XLM draws ceil(0.15 x slots) over a whole
  batch; here ceil(0.15 x tokens) per record, so a record's masks do not depend on its batch.
  Dynamic: drawn anew at every load by the Grain RandomMap `XLMMasking`.
- TLM (§3.3; XLM `generate_batch` -> `concat_batches(..., reset_positions=True)`): a sentence
  and its translation, each between two end-of-sentence tokens, concatenated; positions restart
  at 0 for the translation, language ids per token; the same MLM masking covers both halves.
  Pairs with an empty side or a side longer than `max_sentence_length` tokens are dropped, as
  XLM's `remove_long_sentences(max_len)` (100) does; nothing is truncated. Held out: a separate
  parallel corpus, or a fixed-seed fraction of the aligned lines (`LineSplit`).

Every record has the same features: `input_ids`, `input_mask`, `positions`, `langs` (int32,
[stream_length]), so stream and TLM records can share a loader.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grain
import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import corpus
from pretext_jax.input_pipeline.descriptions import describe
from pretext_jax.input_pipeline.examples.bert import (
    MaskingVocab,
    check_masking,
    corrupt,
    masked_result,
)
from pretext_jax.input_pipeline.parallel import ParallelSource, open_parallel
from pretext_jax.input_pipeline.prepare import (
    LOADER_ONLY_FIELDS,
    DataConfig,
    Documents,
    fingerprint,
    load_tokenizer,
    prepare_text,
    source_fingerprint,
    split_held_out,
    training_sentences,
)
from pretext_jax.input_pipeline.records import (
    SPEC_FILE,
    UNENDING,
    RecordDirectory,
    write_records,
)
from pretext_jax.input_pipeline.tokenizers import (
    SentencePieceTokenizer,
    Tokenizer,
    language_encoder,
    tokenizer_fingerprint,
)

FEATURES = ("input_ids", "input_mask", "positions", "langs")
TASKS = ("clm", "mlm", "tlm", "mlm_tlm")


@dataclasses.dataclass(frozen=True)
class XLMExampleConfig:
    """XLM's data settings (train.py defaults where the paper gives none)."""

    stream_length: int = 256
    """Tokens per CLM/MLM stream piece and per TLM record (XLM `bptt` 256)."""
    max_sentence_length: int = 100
    """TLM: pairs with a side longer than this many tokens are dropped (XLM `max_len` 100)."""
    language_alpha: float = 0.5
    """Exponent a of the language sampling q_i ~ p_i^a, for the vocabulary and streams (§3.1)."""
    mask_alpha: float = 0.5
    """Masked tokens are drawn with weights count^-mask_alpha (§3.3: square root; XLM
    `sample_alpha`); 0 = uniform."""
    masked_lm_prob: float = 0.15
    """Fraction of a record's tokens to predict (XLM `word_pred` 0.15)."""
    max_predictions_per_seq: int = 39
    """Most predictions per record (39 = ceil(0.15 x 256), never binding at the defaults)."""
    mask_token_prob: float = 0.8
    """Share of chosen tokens replaced by [MASK] (XLM `word_mask_keep_rand` 0.8)."""
    random_token_prob: float = 0.1
    """Share of chosen tokens replaced by a random id (0.1; the rest are kept)."""
    tlm_pairs: str = ""
    """TLM directions, e.g. en-de,de-en; empty = every ordered pair of the parallel languages."""
    task: str = "mlm"
    """What the records are for (§3.1-3.3): clm or mlm (streams of monolingual text, data.source
    en=PATH,de=PATH), tlm (translation pairs, data.source a parallel corpus) or mlm_tlm (MLM
    steps on each language and TLM steps on each pair, alternating as the paper trains)."""
    tlm_source: str = ""
    """mlm_tlm: the parallel corpus of the TLM steps (as data.source for tlm); its
    data.held_out_fraction of lines is held out."""

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise UserError(f"examples.task={self.task!r} is unknown; use one of "
                            f"{', '.join(TASKS)}")
        if self.stream_length < 2:
            raise UserError(f"examples.stream_length={self.stream_length} must be at least 2")
        if not 1 <= self.max_sentence_length <= self.stream_length // 2 - 2:
            raise UserError(f"examples.max_sentence_length={self.max_sentence_length} must be "
                            f"in [1, stream_length/2 - 2 = {self.stream_length // 2 - 2}] so "
                            "that a TLM pair fits a record")
        if not 0.0 < self.language_alpha <= 1.0:
            raise UserError(f"examples.language_alpha={self.language_alpha} must be in (0, 1]; "
                            "the paper uses 0.5")
        if self.mask_alpha < 0.0:
            raise UserError(f"examples.mask_alpha={self.mask_alpha} must be >= 0 (0.5 = square "
                            "root of the inverse frequency)")
        if (self.task == "mlm_tlm") != bool(self.tlm_source):
            raise UserError("examples.task=mlm_tlm reads its TLM pairs from examples.tlm_source "
                            "(e.g. train.en,train.de), and only it; set both or neither")
        check_masking(self)


def language_ids(languages: Iterable[str]) -> dict[str, int]:
    """Language -> id in sorted order (XLM `lang2id`)."""
    return {language: i for i, language in enumerate(sorted(set(languages)))}


def tokenizer_language_ids(languages: Iterable[str], tokenizer: Tokenizer
                           ) -> tuple[dict[str, int], int]:
    """(language -> id, count of language embeddings): the table of the checkpoint whose
    tokenizer this is when it carries one (an HF XLM folder's `lang2id`, e.g. XLM-15's), else
    `language_ids`' sorted order over `languages` alone. A language the table lacks is a
    UserError."""
    table = getattr(tokenizer, "lang2id", None)
    if not table:
        ids = language_ids(languages)
        return ids, len(ids)
    missing = sorted(set(languages) - set(table))
    if missing:
        raise UserError(f"the tokenizer's checkpoint has no language {', '.join(missing)} (its "
                        f"languages: {', '.join(sorted(table))}); use a corpus in its languages")
    return {language: table[language] for language in sorted(set(languages))}, len(table)


def parse_corpora(spec: str) -> dict[str, str]:
    """`en=SOURCE,de=SOURCE` (any text source `data.source` takes) as {language: source}."""
    corpora: dict[str, str] = {}
    for item in (part.strip() for part in spec.split(",")):
        language, _, source = item.partition("=")
        if not item or not source or not language.strip():
            raise UserError(f"monolingual corpora must be LANG=SOURCE, comma-separated (e.g. "
                            f"en=wiki.en.txt,de=wiki.de.txt); got {item!r}")
        if language.strip() in corpora:
            raise UserError(f"language {language.strip()} is given twice in {spec!r}")
        corpora[language.strip()] = source.strip()
    if len(corpora) < 2:
        raise UserError(f"XLM needs two or more languages (en=...,de=...); got {spec!r}")
    return corpora


def language_probabilities(counts: Mapping[str, int], alpha: float) -> np.ndarray:
    """q_i = p_i^alpha / sum_j p_j^alpha with p_i = n_i / sum_k n_k (§3.1; XLM
    `set_sampling_probs`), in the order of `counts`. A language without text is a UserError."""
    empty = [language for language, count in counts.items() if count <= 0]
    if empty:
        raise UserError(f"language {', '.join(empty)} has no text; give a corpus with "
                        "sentences for every language or leave it out")
    shares = np.asarray(list(counts.values()), np.float64)
    shares /= shares.sum()
    weights = shares ** alpha
    return weights / weights.sum()


def tokenizer_sample(sentences: Mapping[str, Callable[[], Iterable[str]]], size: int,
                     alpha: float, seed: int) -> Iterator[str]:
    """At most `size` sentences for the shared vocabulary (§3.1): the number from each language
    is a multinomial draw with probabilities q_i (`language_probabilities` over sentence
    counts), and each language's sentences are drawn uniformly with replacement. Two passes
    over each language's text (`sentences[lang]()` reads it anew); memory is the sample."""
    counts = {language: sum(1 for _ in read()) for language, read in sentences.items()}
    q = language_probabilities(counts, alpha)
    rng = np.random.default_rng(seed)
    draws = rng.multinomial(min(size, sum(counts.values())), q)
    for (language, read), draw in zip(sentences.items(), draws, strict=True):
        picks = np.sort(rng.integers(0, counts[language], draw)).tolist()
        if not picks:
            continue
        cursor = 0
        for index, sentence in enumerate(read()):
            while cursor < len(picks) and picks[cursor] == index:
                yield sentence
                cursor += 1
            if cursor == len(picks):
                break


def train_shared_tokenizer(corpora: Mapping[str, str], data: DataConfig, alpha: float,
                           model: Path, seed: int) -> Tokenizer:
    """The sentencepiece model at `model`, trained (once) on `tokenizer_sample` of every
    language's training sentences (the held-out documents excluded, as `prepare_text` splits
    them), at most `data.tokenizer_sentences` of them."""
    readers = {}
    if not model.is_file():
        for language, source in corpora.items():
            shards = corpus.plan_shards(source, data)
            readers[language] = functools.partial(training_sentences, shards, data, seed)
    return train_sampled_tokenizer(readers, data, alpha, model, seed)


def train_sampled_tokenizer(readers: Mapping[str, Callable[[], Iterable[str]]],
                            data: DataConfig, alpha: float, model: Path, seed: int
                            ) -> Tokenizer:
    """The sentencepiece model at `model`, trained (once, if the file is missing) on
    `tokenizer_sample` of the languages' sentences (`readers[lang]()` reads them anew), the
    languages sampled by q ~ p^alpha."""
    if not model.is_file():
        prefix = model.with_name(f".{model.stem}.{os.getpid()}")
        print(f"training a shared sentencepiece tokenizer ({data.vocab_size} pieces) on "
              f"{', '.join(readers)}", flush=True)
        try:
            SentencePieceTokenizer.train(
                tokenizer_sample(readers, data.tokenizer_sentences, alpha, seed),
                prefix, vocab_size=data.vocab_size, seed=seed,
                max_sentence_bytes=data.tokenizer_max_sentence_bytes)
            Path(f"{prefix}.model").replace(model)
        finally:
            for suffix in (".model", ".vocab"):
                Path(f"{prefix}{suffix}").unlink(missing_ok=True)
    return SentencePieceTokenizer(model)


@dataclasses.dataclass(frozen=True)
class LineSplit:
    """One side of a parallel corpus split by aligned lines: round(`fraction` x lines) lines
    (at least one of two or more) are held out by a fixed-seed choice (`prepare.split_held_out`);
    `held_out` picks that side or the rest. Every direction of a line falls on the same side,
    so no held-out sentence or its translation is trained on."""

    fraction: float
    seed: int
    held_out: bool

    def lines(self, source: ParallelSource) -> Iterator[dict[str, str]]:
        """The aligned lines of this side, in order (two passes: one counts the lines)."""
        chosen = split_held_out(sum(1 for _ in source), self.fraction, self.seed)
        return (line for line, held in zip(source, chosen, strict=True)
                if held == self.held_out)


def split_lines(source: ParallelSource, split: LineSplit | None) -> Iterable[dict[str, str]]:
    """Every aligned line of `source`, or those of one side of `split`."""
    return source if split is None else split.lines(source)


def parallel_sentences(source: ParallelSource, language: str, split: LineSplit | None = None
                       ) -> Iterator[str]:
    """The non-empty sentences of one language of a parallel corpus (of one side of `split`),
    in order."""
    return (line[language] for line in split_lines(source, split) if line[language])


def parallel_tokenizer(spec: str, data: DataConfig, config: XLMExampleConfig, cache_root: Path,
                       seed: int, split: LineSplit | None = None) -> Tokenizer:
    """TLM without monolingual text: `data.tokenizer`, else a sentencepiece model shared by the
    languages of the parallel corpus `spec` (its lines of `split`, the training side), trained on
    its sentences sampled by q ~ p^a (§3.1; the languages of an aligned corpus have equal
    sentence counts, so equal shares)."""
    if data.tokenizer:
        return load_tokenizer(data)
    source = open_parallel(spec)
    settings = {k: v for k, v in dataclasses.asdict(data).items()
                if k not in ("source", "eval_source", *LOADER_ONLY_FIELDS)}
    key = fingerprint(source.fingerprint(), settings, config.language_alpha, seed,
                      *([] if split is None else [dataclasses.asdict(split)]))
    Path(cache_root).mkdir(parents=True, exist_ok=True)
    readers = {language: functools.partial(parallel_sentences, source, language, split)
               for language in source.languages}
    return train_sampled_tokenizer(readers, data, config.language_alpha,
                                   Path(cache_root) / f"xlm-tlm-tokenizer-{key}.model", seed)


# ------------------------------------------------------------------------------ streams
def sentence_stream(documents: Documents, eos_id: int) -> np.ndarray:
    """Every sentence's tokens followed by `eos_id`, in order (XLM's binarised layout)."""
    return np.fromiter((t for document in documents for sentence in document
                        for t in (*sentence, eos_id)), np.int32)


def record(tokens: np.ndarray, positions: np.ndarray, langs: np.ndarray, length: int,
           pad_id: int) -> dict[str, np.ndarray]:
    """The shared record features, padded to `length` (padding: id pad, mask 0)."""
    count = len(tokens)
    out = {name: np.zeros(length, np.int32) for name in FEATURES}
    out["input_ids"][:] = pad_id
    out["input_ids"][:count] = tokens
    out["input_mask"][:count] = 1
    out["positions"][:count] = positions
    out["langs"][:count] = langs
    return out


def stream_pieces(stream: np.ndarray, length: int) -> Iterator[np.ndarray]:
    """Consecutive `length`-token pieces of `stream`; the last may be shorter."""
    for start in range(0, len(stream), length):
        yield stream[start:start + length]


def stream_examples(documents: Documents, tokenizer: Tokenizer, seed: int, *,
                    language_id: int, config: XLMExampleConfig) -> Iterator[dict[str, np.ndarray]]:
    """A `prepare_text` builder: one language's stream pieces, positions 0..n-1 and the
    language's id on every token (`seed` unused: the stream keeps the corpus order)."""
    del seed
    for piece in stream_pieces(sentence_stream(documents, tokenizer.eos_id),
                               config.stream_length):
        yield record(piece, np.arange(len(piece)), np.full(len(piece), language_id),
                     config.stream_length, tokenizer.pad_id)


def prepare_streams(corpora: Mapping[str, str], data: DataConfig, config: XLMExampleConfig,
                    cache_root: Path, seed: int, ids: Mapping[str, int] | None = None,
                    ) -> tuple[dict[str, tuple[RecordDirectory, RecordDirectory]], Tokenizer]:
    """Each language's (training, held-out) stream records and the shared tokenizer (trained on
    the mixed languages unless `data.tokenizer` names one). `ids`: language ids (default
    `language_ids` of the corpora)."""
    if data.eval_source:
        raise UserError("XLM holds out data.held_out_fraction of every language; leave "
                        "data.eval_source empty")

    def build(language_id: int) -> Callable[..., Iterable[dict[str, np.ndarray]]]:
        return functools.partial(stream_examples, language_id=language_id, config=config)

    return prepare_languages(corpora, data, build, config, config.language_alpha, cache_root,
                             seed, ids)


def prepare_languages(corpora: Mapping[str, str], data: DataConfig,
                      build: Callable[[int], Callable[..., Iterable[dict[str, np.ndarray]]]],
                      settings: Any, alpha: float, cache_root: Path, seed: int,
                      ids: Mapping[str, int] | None = None,
                      eval_corpora: Mapping[str, str] | None = None,
                      ) -> tuple[dict[str, tuple[RecordDirectory, RecordDirectory]], Tokenizer]:
    """Each language's (training, held-out) records, built by `build(language id)` (a
    `prepare_text` builder; `settings` are the records' settings in the cache key), and the
    tokenizer shared by the languages: `data.tokenizer`, else a sentencepiece model trained on
    every language's training sentences sampled by q ~ p^alpha (§3.1). Held out: each
    language's `eval_corpora[language]` if given, else `data.held_out_fraction` of its
    documents. `ids`: language ids (default `tokenizer_language_ids`: the tokenizer's checkpoint
    table, else the sorted order of the corpora)."""
    cache_root = Path(cache_root)
    cache_root.mkdir(parents=True, exist_ok=True)
    if data.tokenizer:
        tokenizer_path = data.tokenizer
    else:
        fields = {k: v for k, v in dataclasses.asdict(data).items() if k != "source"}
        key = fingerprint(sorted((language, source_fingerprint(source, data.tfds_data_dir))
                                 for language, source in corpora.items()),
                          fields, alpha, seed)
        tokenizer_path = str(cache_root / f"xlm-tokenizer-{key}.model")
        train_shared_tokenizer(corpora, data, alpha, Path(tokenizer_path), seed)
    shared = load_tokenizer(dataclasses.replace(data, tokenizer=tokenizer_path))
    ids = dict(ids or tokenizer_language_ids(corpora, shared)[0])
    # A language-dependent tokenizer (XLM's Moses rules) reads each corpus in its language.
    bound = hasattr(shared, "for_language")
    prepared = {}
    tokenizer = None
    for language, source in corpora.items():
        if language not in ids:
            raise UserError(f"language {language} has no language id; add it to the languages")
        eval_source = (eval_corpora or {}).get(language, "")
        train, held_out, tokenizer = prepare_text(
            dataclasses.replace(data, source=source, eval_source=eval_source,
                                tokenizer=tokenizer_path, language=language if bound else None),
            build(ids[language]), (settings, ids[language]), cache_root, seed)
        prepared[language] = (train, held_out)
    return prepared, tokenizer


# ------------------------------------------------------------------------ step schedule
SHUF_ORDER_DRAWS = 5
"""Steps drawn per cycle from the monolingual and from the parallel sets (XLM `shuf_order`'s
n = 5, which train.py never changes)."""


class StepSchedule:
    """XLM's training order (train.py's loop `for lang1, lang2 in shuf_order(mlm_steps)`,
    trainer.py `get_batch`), a random-access source for `records.make_loader` read in order:
    each `batch_size` consecutive keys are one step, whose records all come from one set, a
    language's streams (MLM / CLM) or a language pair's TLM records. Steps come in cycles as
    `shuf_order` draws them: min(5, M) of the M monolingual sets drawn with replacement by
    `mono_probabilities` (q ~ p^a over sentence counts, `set_sampling_probs`), then min(5, P) of
    the P pair sets by `pair_probabilities` (q over their pair counts). A step's rows are drawn
    uniformly with replacement from its set. Cycle c's sets come from an RNG seeded by
    (seed, c), a step's rows from (seed, step): key k's record depends on (seed, batch_size, k)
    only, so the loader's position is the schedule's and a resumed loader continues it."""

    def __init__(self, mono: Mapping[str, RecordDirectory], mono_probabilities: Sequence[float],
                 pairs: Mapping[str, RecordDirectory], pair_probabilities: Sequence[float],
                 seed: int, batch_size: int = 1, length: int = UNENDING):
        self.names = (*mono, *pairs)
        self.records = [*mono.values(), *pairs.values()]
        self.mono_probabilities = np.asarray(mono_probabilities, np.float64)
        self.pair_probabilities = np.asarray(pair_probabilities, np.float64)
        if not self.records or len({r.spec for r in self.records}) != 1:
            raise UserError("the languages' records are missing or have different features; "
                            "prepare them with the same examples settings")
        self.mono, self.pairs = dict(mono), dict(pairs)
        self.seed, self.batch_size = seed, batch_size
        self.length = length // batch_size * batch_size
        self.cycle_steps = min(SHUF_ORDER_DRAWS, len(mono)) + min(SHUF_ORDER_DRAWS, len(pairs))
        self.source = self

    def for_global_batch(self, batch_size: int) -> StepSchedule:
        """The same schedule with steps of `batch_size` records."""
        return StepSchedule(self.mono, self.mono_probabilities, self.pairs,
                            self.pair_probabilities, self.seed, batch_size)

    def __len__(self) -> int:
        return self.length

    def cycle(self, index: int) -> list[int]:
        """The sets (indices into `names`) of cycle `index`'s steps, in order."""
        rng = np.random.default_rng([self.seed, index])
        chosen: list[int] = []
        offset = 0
        for count, probabilities in ((len(self.mono), self.mono_probabilities),
                                     (len(self.pairs), self.pair_probabilities)):
            if count:
                draws = rng.choice(count, min(SHUF_ORDER_DRAWS, count), p=probabilities)
                chosen += (offset + draws).tolist()
            offset += count
        return chosen

    def step_set(self, step: int) -> int:
        """The set (index into `names`) that step `step` reads."""
        index, position = divmod(step, self.cycle_steps)
        return self.cycle(index)[position]

    def choose(self, key: int) -> tuple[int, int]:
        """(set index, record index) of key `key`."""
        step, row = divmod(int(key), self.batch_size)
        which = self.step_set(step)
        rng = np.random.default_rng([self.seed, step, 1])
        return which, int(rng.integers(0, len(self.records[which]), self.batch_size)[row])

    def __getitem__(self, key: int) -> bytes:
        which, index = self.choose(key)
        return self.records[which].source[index]

    def load_transforms(self) -> list[grain.transforms.Map]:
        return self.records[0].load_transforms()

    def __repr__(self) -> str:
        probabilities = [*self.mono_probabilities, *self.pair_probabilities]
        return describe("XLM step schedule", seed=self.seed, batch=self.batch_size,
                        length=self.length, **{name: f"{p:.6f} of {r.source!r}" for
                                               name, p, r in zip(self.names, probabilities,
                                                                 self.records, strict=True)})


def stream_statistics(records: RecordDirectory, vocab_size: int) -> np.ndarray:
    """Token counts (per id, over real tokens) of a record directory, one pass over it,
    cached beside the records as `token_counts.npy`."""
    path = records.directory / "token_counts.npy"
    if path.is_file():
        return np.load(path)
    counts = np.zeros(vocab_size, np.int64)
    for index in range(len(records)):
        row = records.spec.decode(records.source[index])
        counts += np.bincount(row["input_ids"][row["input_mask"] > 0], minlength=vocab_size)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.npy")
    np.save(tmp, counts)
    tmp.replace(path)
    return counts


# ---------------------------------------------------------------------------- masking
def mask_weights(counts: np.ndarray, alpha: float, vocab: MaskingVocab) -> np.ndarray:
    """XLM's `mask_scores`: max(count, 1)^-alpha per id, 0 for ids that never occur, for
    padding and for the specials ([CLS], [SEP] = end of sentence, [PAD], [MASK])."""
    counts = np.asarray(counts, np.float64)
    weights = np.maximum(counts, 1.0) ** -alpha
    weights[counts == 0] = 0.0
    special = [i for i in (vocab.pad_id, vocab.cls_id, vocab.sep_id, vocab.mask_id)
               if i < len(weights)]
    weights[special] = 0.0
    return weights


def weighted_mask(tokens: np.ndarray, weights: np.ndarray, vocab: MaskingVocab,
                  config: XLMExampleConfig, rng: np.random.Generator
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(masked tokens, sorted positions, labels): min(ceil(p x n), max_predictions) positions
    of the n tokens, drawn without replacement with probabilities proportional to
    `weights[token]` (XLM `mask_out`), corrupted 80/10/10 (`bert_examples.corrupt`)."""
    token_weights = weights[tokens]
    candidates = np.flatnonzero(token_weights > 0)
    count = min(math.ceil(config.masked_lm_prob * len(tokens)), len(candidates),
                config.max_predictions_per_seq)
    chosen = (rng.choice(candidates, count, replace=False,
                         p=token_weights[candidates] / token_weights[candidates].sum())
              if count else np.zeros(0, np.int64))
    output = tokens.copy()
    corrupt(output, chosen, vocab, config, rng)
    return masked_result(tokens, output, chosen)


class XLMMasking(grain.transforms.RandomMap):
    """MLM / TLM masking of a record at every load (Grain's per-record RNG: deterministic per
    loader seed and record position). Adds `masked_lm_positions`, `masked_lm_ids` and
    `masked_lm_weights` ([max_predictions_per_seq], as BERT's records) and masks `input_ids`."""

    def __init__(self, vocab: MaskingVocab, weights: np.ndarray, config: XLMExampleConfig):
        self.vocab, self.weights, self.config = vocab, np.asarray(weights), config

    def random_map(self, element: dict[str, np.ndarray], rng: np.random.Generator
                   ) -> dict[str, np.ndarray]:
        length = int(element["input_mask"].sum())
        tokens = np.asarray(element["input_ids"][:length])
        output, positions, labels = weighted_mask(tokens, self.weights, self.vocab,
                                                  self.config, rng)
        out = dict(element)
        out["input_ids"] = np.array(element["input_ids"])
        out["input_ids"][:length] = output
        slots, count = self.config.max_predictions_per_seq, len(positions)
        for name, values, dtype in (("masked_lm_positions", positions, np.int32),
                                    ("masked_lm_ids", labels, np.int32),
                                    ("masked_lm_weights", np.ones(count), np.float32)):
            out[name] = np.zeros(slots, dtype)
            out[name][:count] = values
        return out


# -------------------------------------------------------------------------------- TLM
def tlm_record(first: Sequence[int], second: Sequence[int], first_language: int,
               second_language: int, config: XLMExampleConfig, eos_id: int, pad_id: int
               ) -> dict[str, np.ndarray]:
    """</s> first </s> </s> second </s> (XLM `concat_batches` with reset positions): positions
    0.. in each half, each half's language id on its tokens, padded to `stream_length`."""
    halves = [np.asarray([eos_id, *side, eos_id], np.int32) for side in (first, second)]
    return record(np.concatenate(halves),
                  np.concatenate([np.arange(len(h)) for h in halves]),
                  np.concatenate([np.full(len(h), lang) for h, lang in
                                  zip(halves, (first_language, second_language), strict=True)]),
                  config.stream_length, pad_id)


def tlm_directions(languages: Sequence[str], config: XLMExampleConfig) -> list[tuple[str, str]]:
    """The (first, second) language pairs of `config.tlm_pairs`, checked against `languages`."""
    if not config.tlm_pairs:
        return [(a, b) for a in languages for b in languages if a != b]
    directions = []
    for item in config.tlm_pairs.split(","):
        first, _, second = item.strip().partition("-")
        if first not in languages or second not in languages or first == second:
            raise UserError(f"examples.tlm_pairs has {item.strip()!r}; name two different "
                            f"languages of the parallel corpus ({', '.join(languages)}) as a-b")
        directions.append((first, second))
    return directions


def tlm_examples(lines: Iterable[Mapping[str, str]], languages: Sequence[str],
                 tokenizer: Tokenizer, config: XLMExampleConfig, ids: Mapping[str, int]
                 ) -> Iterator[dict[str, np.ndarray]]:
    """One record per aligned line and direction (`tlm_directions`); a pair with an empty side
    or a side over `max_sentence_length` tokens is dropped (XLM `remove_long_sentences`)."""
    directions = tlm_directions(languages, config)
    missing = sorted({lang for pair in directions for lang in pair} - set(ids))
    if missing:
        raise UserError(f"language {', '.join(missing)} of the parallel corpus has no language "
                        f"id (known: {', '.join(ids)}); give its monolingual text too")
    encode = {language: language_encoder(tokenizer, language) for language in languages}
    for line in lines:
        encoded = {language: encode[language](line[language]) for language in languages}
        for first, second in directions:
            a, b = encoded[first], encoded[second]
            if 0 < len(a) <= config.max_sentence_length and 0 < len(b) <= (
                    config.max_sentence_length):
                yield tlm_record(a, b, ids[first], ids[second], config, tokenizer.eos_id,
                                 tokenizer.pad_id)


def prepare_tlm(spec: str, tokenizer: Tokenizer, config: XLMExampleConfig,
                ids: Mapping[str, int], cache_root: Path, split: LineSplit | None = None
                ) -> RecordDirectory:
    """TLM records of the parallel corpus `spec` (`parallel.open_parallel`), of every line or
    of one side of `split`, streamed into ArrayRecord files under `cache_root` (kept: a key of
    the files, tokenizer, settings and split)."""
    source = open_parallel(spec)
    key = fingerprint(source.fingerprint(), tokenizer_fingerprint(tokenizer),
                      dataclasses.asdict(config), ids,
                      *([] if split is None else [dataclasses.asdict(split)]))
    directory = Path(cache_root) / f"tlm-{key}"
    if not (directory / SPEC_FILE).is_file():
        write_records(tlm_examples(split_lines(source, split), source.languages, tokenizer,
                                   config, ids), directory, metadata={"source": spec})
    return RecordDirectory(directory)
