"""Host-side preparation shared by the text methods: corpus -> tokenizer -> examples -> records,
streamed shard by shard, over worker processes and hosts, resumable.

The method supplies only its example builder (BERT: NSP pairs and masking), a picklable
`build(documents, tokenizer, seed)` applied to one input shard's documents at a time.

- The corpus is cut into input shards (`corpus.plan_shards`: ~`data.input_shard_mb` MB of files
  cut at document boundaries, small files grouped; 4,096 TFDS records; 128 demo documents).
  A worker reads one shard, holds out a fraction of its documents (`split_held_out`),
  tokenises the rest and writes the builder's examples to one ArrayRecord file per shard and
  split as they are made. Nothing proportional to the corpus is held: memory is bounded by one
  shard per worker. The reference shuffles all examples in memory; here the loader's global
  shuffle over every shard does that, and examples that draw on other documents (BERT's random
  next sentence, RoBERTa/ELECTRA/GPT/MPNet/T5 packing, XLNet's parallel streams) draw on the
  documents of the same input shard (a shard holds thousands of documents at the default size).
- Records are identical whatever the number of workers and hosts: the shard plan depends only on
  the files, each shard's seed on (seed, split, shard index), and file names on the shard.
- Resumable and atomic: a shard's files are written under temporary names and renamed, its
  summary last; a shard with a summary is never redone, so a preparation killed at any moment
  and restarted finishes the rest with exactly the records of an uninterrupted one. Two
  processes preparing one cache at once write identical files and rename them atomically.
- Tokenizer training reads the training documents once and lets sentencepiece keep a seeded
  uniform sample of `data.tokenizer_sentences` sentences (its reservoir sampler), so memory is
  bounded whatever the corpus size.
- With several JAX processes, process p prepares shards p, p + P, ...; every process then
  prepares whatever it still cannot see (a cache that is not on a shared file system).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gc
import hashlib
import json
import multiprocessing
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import corpus, tokenizers
from pretext_jax.input_pipeline.records import (
    SPEC_FILE,
    ExampleBatch,
    RecordDirectory,
    temporary_path,
    write_shard,
)

DEMO_CORPUS = corpus.DEMO_CORPUS
# DataConfig fields that change how records are made or loaded, not what they contain.
LOADER_ONLY_FIELDS = ("cache_dir", "worker_count", "prepare_workers")
SPLITS = ("train", "eval")

Documents = list[list[list[int]]]
ExampleBuilder = Callable[[Documents, Any, int], Iterable[dict[str, np.ndarray] | ExampleBatch]]


class Markup(Protocol):
    """Annotations written inline in a corpus's text that a method reads itself (ERNIE's
    entity and phrase spans). Picklable (it travels to the preparation workers)."""

    def plain(self, sentence: str) -> str:
        """The sentence without its markup (what a trained tokenizer learns from)."""
        ...

    def tokenize(self, documents: Iterable[list[str]], tokenizer: Any) -> Documents:
        """What the example builder receives in place of `tokenize_documents`'s ids."""
        ...


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the data comes from and how it is tokenised, prepared and loaded (one line per
    field below; `run.py config` prints them). Records do not depend on the loader-only
    fields (`LOADER_ONLY_FIELDS`)."""

    source: str = DEMO_CORPUS
    """Corpus or dataset: file, folder or glob; tfds:NAME[/CONFIG]; python-docs/digits (demos)."""
    text_format: str = "auto"
    """plain (one sentence per line, blank line between documents), wikitext, or auto."""
    tfds_split: str = "train"
    """The TFDS split read for training (tfds: sources)."""
    tfds_text_key: str = ""
    """The TFDS feature holding the text; empty = the records' only string feature."""
    tfds_data_dir: str = ""
    """Where prepared TFDS datasets live; empty = TFDS's default (~/tensorflow_datasets)."""
    eval_source: str = ""
    """A separate held-out corpus (e.g. WikiText's valid.txt); empty = hold out a fraction."""
    tokenizer: str = ""
    """sentencepiece .model, BERT vocab.txt, HF tokenizer folder; empty = train sentencepiece."""
    lowercase: bool | None = None
    """Force a WordPiece/XLNet tokenizer's casing; none = from its folder, else from the vocab."""
    language: str | None = None
    """The text's language for a language-dependent tokenizer (XLM's Moses rules); none =
    English. XLM's monolingual corpora set it per corpus."""
    vocab_size: int = 8000
    """Pieces of the sentencepiece unigram model trained when data.tokenizer is empty."""
    tokenizer_sentences: int = 1_000_000
    """At most this many training sentences (a seeded uniform sample) train the tokenizer."""
    tokenizer_max_sentence_bytes: int | None = None
    """Longer training lines (UTF-8 bytes) are left out of tokenizer training; none = 4192."""
    held_out_fraction: float = 0.05
    """Fraction of each input shard's documents held out for evaluation (no eval_source)."""
    input_shard_mb: float = 8.0
    """Size of the corpus pieces prepared one per worker; examples never combine two."""
    cache_dir: str = ""
    """Where prepared records are kept; empty = <workdir>/data (share it between runs)."""
    worker_count: int = 0
    """Grain loader worker processes (0 = load in the training process)."""
    prepare_workers: int = 0
    """Preparation worker processes on this host (0 = one per core, or in process for a corpus
    under 8 MB / 4,096 records, where starting a pool costs more than it saves; 1 = in
    process)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.held_out_fraction < 1.0:
            raise UserError(f"data.held_out_fraction={self.held_out_fraction} must be in (0, 1); "
                            "e.g. data.held_out_fraction=0.05")
        if not 0.001 <= self.input_shard_mb <= 4096:
            raise UserError(f"data.input_shard_mb={self.input_shard_mb} must be in "
                            "[0.001, 4096]; e.g. data.input_shard_mb=8")
        if self.tokenizer_sentences < 1:
            raise UserError(f"data.tokenizer_sentences={self.tokenizer_sentences} must be >= 1; "
                            "e.g. 1000000")
        if not 1 <= (self.tokenizer_max_sentence_bytes or 1) < 2**31:
            raise UserError(f"data.tokenizer_max_sentence_bytes={self.tokenizer_max_sentence_bytes}"
                            " must be in [1, 2147483647]; e.g. 100000")
        for name in ("prepare_workers", "worker_count"):
            if getattr(self, name) < 0:
                raise UserError(f"data.{name}={getattr(self, name)} must be >= 0 (0 = automatic)")


def fingerprint(*parts: Any) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def source_fingerprint(spec: str, tfds_data_dir: str = "") -> Any:
    """Paths with their sizes and mtimes (so edited files invalidate the cache), a TFDS
    dataset's name, version and info digest (`corpus.source_fingerprint`)."""
    return corpus.source_fingerprint(spec, tfds_data_dir)


def tokenizer_identity(data: DataConfig) -> list[Any]:
    """What names `data.tokenizer` as it reads text, in a fine-tuning cache's key: its files,
    the casing and `data.language` (left out when unset, so keys made before it existed still
    match); a tokenizer object is named by `tokenizers.tokenizer_fingerprint`."""
    return [source_fingerprint(data.tokenizer), data.lowercase,
            *([data.language] if data.language else [])]


def inputs_fingerprint(data: DataConfig) -> dict[str, tuple[int, str]]:
    """What a run's input files are, saved in its checkpoints so that a resume compares them
    before anything is prepared: for `data.source` and `data.eval_source`, (the number of files,
    a digest of their paths, sizes and modification times; `corpus.read_files_identity`)."""
    inputs = {}
    for setting, spec in (("data.source", data.source), ("data.eval_source", data.eval_source)):
        if spec:
            files, identities = corpus.read_files_identity(spec, data.tfds_data_dir)
            inputs[setting] = (files, fingerprint(identities))
    return inputs


def shard_seed(seed: int, split: str, index: int) -> int:
    """The seed of one shard's examples: a function of (seed, split, shard index) only."""
    entropy = [seed, {"train": 0, "eval": 1, "eval_source": 2}[split], index]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def split_held_out(count: int, fraction: float, seed: int) -> np.ndarray:
    """Which of a shard's `count` documents are held out: round(count x fraction), at least one
    and never all when there are two or more (a fixed-seed random choice)."""
    held = np.zeros(count, bool)
    if fraction > 0 and count >= 2:
        number = min(max(1, round(count * fraction)), count - 1)
        held[np.random.default_rng(seed).permutation(count)[:number]] = True
    return held


def tokenize_documents(documents: Iterable[list[str]], tokenizer: Any) -> Documents:
    """Token ids per sentence; sentences that tokenise to nothing are dropped."""
    out = []
    for document in documents:
        ids = [ids for ids in (tokenizer.encode(s) for s in document) if ids]
        if ids:
            out.append(ids)
    return out


# ----------------------------------------------------------------------------------- workers
@dataclasses.dataclass(frozen=True)
class ShardJob:
    """One input shard and everything a worker process needs to turn it into records."""

    shard: corpus.InputShard
    data: DataConfig
    tokenizer: str
    build: ExampleBuilder
    split: str  # "train" (documents split into train / held out) or "eval_source"
    seed: int
    prefix: str  # output files: PREFIX.train.array_record, PREFIX.eval.array_record, PREFIX.json
    markup: Markup | None = None

    @property
    def summary_path(self) -> Path:
        return Path(self.prefix + ".json")


_PROGRESS: dict[str, Any] = {}


def _init_worker(counters: dict[str, Any], path: list[str]) -> None:
    """Pool initializer: shared progress counters and the parent's import path (user objectives
    imported from a file are found by name)."""
    sys.path[:] = path
    _PROGRESS.update(counters)


def _count(name: str, amount: int) -> None:
    counter = _PROGRESS.get(name)
    if counter is not None:
        with counter.get_lock():
            counter.value += amount


_TOKENIZERS: dict[tuple[str, bool | None, str | None], Any] = {}


def load_tokenizer(data: DataConfig, spec: str | Path | None = None) -> Any:
    """`spec` (default `data.tokenizer`) with the casing `data.lowercase` forces, for text in
    `data.language` (`tokenizers.for_language`); loaded once per process."""
    key = (str(spec or data.tokenizer), data.lowercase, data.language)
    if key not in _TOKENIZERS:
        tokenizer = tokenizers.load_tokenizer(key[0], data.lowercase)
        _TOKENIZERS[key] = (tokenizers.for_language(tokenizer, data.language)
                            if data.language else tokenizer)
    return _TOKENIZERS[key]


def prepare_shard(job: ShardJob) -> dict[str, Any]:
    """Reads, splits, tokenises and builds one shard; writes its record files, then its summary
    (the mark of a finished shard). Returns the summary."""
    with _no_cycle_collection():
        return _prepare_shard(job)


@contextlib.contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """Python's cycle collector paused: a shard's millions of short-lived lists and strings
    (tokenised sentences) have no cycles, and its passes over them cost a fifth of the
    tokenisation; reference counting still frees everything."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _prepare_shard(job: ShardJob) -> dict[str, Any]:
    tokenizer = load_tokenizer(job.data, job.tokenizer)
    documents = list(corpus.read_shard(job.shard, job.data))
    if job.split == "train":
        fraction = 0.0 if job.data.eval_source else job.data.held_out_fraction
        held = split_held_out(len(documents), fraction, job.seed)
    else:
        held = np.ones(len(documents), bool)
    summary: dict[str, Any] = {"shard": dataclasses.asdict(job.shard),
                               "documents": len(documents), "bytes": job.shard.size}
    sentences = tokens = 0
    tokenize = job.markup.tokenize if job.markup is not None else tokenize_documents
    for split, chosen in (("train", ~held), ("eval", held)):
        group = tokenize([d for d, keep in zip(documents, chosen, strict=True) if keep],
                         tokenizer)
        sentences += sum(len(d) for d in group)
        tokens += sum(len(s) for d in group for s in d)
        examples = _counted(job.build(group, tokenizer, job.seed + SPLITS.index(split)))
        path = Path(f"{job.prefix}.{split}.array_record")
        count, spec = write_shard(examples, path) if group else (0, None)
        summary[split] = {"count": count, "spec": spec.to_json() if spec else None,
                          "file": path.name if count else None}
    summary.update(sentences=sentences, tokens=tokens)
    _write_atomic(job.summary_path, json.dumps(summary))
    _count("bytes", job.shard.size)
    return summary


def _counted(examples: Iterable[dict[str, np.ndarray] | ExampleBatch]
             ) -> Iterator[dict[str, np.ndarray] | ExampleBatch]:
    pending = 0
    for example in examples:
        yield example
        pending += len(example) if isinstance(example, ExampleBatch) else 1
        if pending >= 256:
            _count("examples", pending)
            pending = 0
    _count("examples", pending)


def _write_atomic(path: Path, text: str) -> None:
    tmp = temporary_path(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"could not write {path} ({e.strerror}); free space in "
                        f"{path.parent} or choose another data.cache_dir, then rerun "
                        "(finished shards are kept)") from None


# ------------------------------------------------------------------------------- the driver
# Below these sizes the automatic setting prepares in process: spawning a pool (each worker
# imports this package and JAX) costs seconds, more than a small corpus takes on one core.
POOL_MIN_BYTES = 8 * 2**20
POOL_MIN_RECORDS = 4096


def _workers(data: DataConfig, jobs: list[ShardJob]) -> int:
    if data.prepare_workers:
        return data.prepare_workers
    total = sum(job.shard.size for job in jobs)
    if total < (POOL_MIN_BYTES if all(job.shard.kind == "files" for job in jobs)
                else POOL_MIN_RECORDS):
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


class _Progress:
    """A tqdm bar of MB read, examples written, MB/s and ETA, fed by counters the workers
    update; a one-line summary at the end. On stdout, so stderr holds errors alone."""

    def __init__(self, total: int, unit: str, label: str, pool: bool):
        from tqdm import tqdm

        ctx = multiprocessing.get_context("spawn")
        self.counters = ({"bytes": ctx.Value("q", 0), "examples": ctx.Value("q", 0)} if pool
                         else {"bytes": _Value(), "examples": _Value()})
        self.scale = 2**20 if unit == "MB" else 1
        self.bar = tqdm(total=total / self.scale, unit=unit, desc=label, dynamic_ncols=True,
                        file=sys.stdout, mininterval=1.0 if sys.stdout.isatty() else 30.0,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} "
                                   "{unit} [{elapsed}<{remaining}, {rate_fmt}{postfix}]")

    def refresh(self) -> None:
        self.bar.set_postfix_str(f"{self.counters['examples'].value:,} examples", refresh=False)
        self.bar.update(self.counters["bytes"].value / self.scale - self.bar.n)

    def close(self) -> None:
        self.refresh()
        self.bar.close()


class _Value:
    """A counter with the interface of multiprocessing.Value, for in-process preparation."""

    def __init__(self) -> None:
        self.value = 0

    def get_lock(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def run_jobs(jobs: list[ShardJob], workers: int, progress: _Progress) -> None:
    """Runs the jobs whose summary is missing: in this process (`workers` 1) or in a pool of
    spawned processes (this process may hold JAX's threads, which forking would copy)."""
    jobs = [job for job in jobs if not job.summary_path.is_file()]
    if not jobs:
        return
    if workers <= 1 or len(jobs) == 1:
        _PROGRESS.update(progress.counters)
        try:
            for job in jobs:
                prepare_shard(job)
                progress.refresh()
        finally:
            _PROGRESS.clear()
        return
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(min(workers, len(jobs)), initializer=_init_worker,
                  initargs=(progress.counters, list(sys.path))) as pool:
        results = pool.imap_unordered(prepare_shard, jobs)
        for _ in jobs:
            while True:
                try:
                    results.next(timeout=0.5)
                    break
                except multiprocessing.TimeoutError:
                    progress.refresh()
            progress.refresh()


def _barrier(name: str) -> None:
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _process() -> tuple[int, int]:
    import jax

    return jax.process_index(), jax.process_count()


def prepare_text(
    data: DataConfig, build_examples: ExampleBuilder, example_settings: Any, cache_root: Path,
    seed: int, ordered: bool = False, markup: Markup | None = None,
    check_tokenizer: Callable[[Any], Any] | None = None,
) -> tuple[RecordDirectory, RecordDirectory, Any]:
    """Returns (train records, held-out records, tokenizer), building what is not cached.
    `build_examples(documents, tokenizer, seed)` must be picklable (a module-level function or
    a `functools.partial` of one). `ordered`: the records are read in the order they were built
    (shard by shard), as XLNet's streams need. `markup`: annotations inline in the text that
    the builder reads (`Markup`). `check_tokenizer(tokenizer)` raises a UserError where the
    builder cannot use the tokenizer (a vocabulary without [MASK]), before any shard is
    prepared. Called by every JAX process at once.

    The held-out split is made at document level before tokenizer training, so evaluation text
    is never seen by the tokenizer or the model.
    """
    started = time.monotonic()
    # Unset optional fields stay out of the key, so caches made before they existed still match.
    settings = {k: v for k, v in dataclasses.asdict(data).items()
                if k not in LOADER_ONLY_FIELDS + ("source", "eval_source") and v is not None}
    tokenizer_identity = source_fingerprint(data.tokenizer) if data.tokenizer else "trained"
    base = Path(cache_root) / fingerprint(settings, example_settings, seed, tokenizer_identity,
                                          ordered)
    corpus_key = fingerprint(source_fingerprint(data.source, data.tfds_data_dir),
                             source_fingerprint(data.eval_source, data.tfds_data_dir)
                             if data.eval_source else "")
    index_dir = base / corpus_key
    if all((index_dir / split / SPEC_FILE).is_file() for split in SPLITS):
        return (RecordDirectory(index_dir / "train"), RecordDirectory(index_dir / "eval"),
                _tokenizer_at(data, base, corpus_key))
    process, processes = _process()
    train_shards = corpus.plan_shards(data.source, data)
    eval_shards = corpus.plan_shards(data.eval_source, data) if data.eval_source else []
    if data.tokenizer and check_tokenizer is not None:  # a given one is refused before writing
        check_tokenizer(load_tokenizer(data))
    _make_dirs(base / "shards")
    tokenizer = _ensure_tokenizer(data, base, corpus_key, train_shards, seed, process, markup)
    if check_tokenizer is not None:
        check_tokenizer(tokenizer)
    tokenizer_spec = data.tokenizer or str(base / f"tokenizer-{corpus_key}.model")
    tokenizer_id = tokenizer_identity if data.tokenizer else _file_digest(tokenizer_spec)
    jobs = [ShardJob(shard, data, tokenizer_spec, build_examples, split,
                     shard_seed(seed, split, shard.index),
                     str(base / "shards" / f"{split}-{shard.index:05d}-"
                         f"{fingerprint(shard.identity, tokenizer_id)}"), markup)
            for split, shards in (("train", train_shards), ("eval_source", eval_shards))
            for shard in shards]
    workers = _workers(data, jobs)
    total = sum(job.shard.size for job in jobs)
    unit = "MB" if all(job.shard.kind == "files" for job in jobs) else "documents"
    progress = _Progress(total, unit, f"preparing {data.source}", workers > 1)
    try:
        run_jobs(jobs[process::processes], workers, progress)
        _barrier("pretext: data shards prepared")
        run_jobs(jobs, workers, progress)  # anything another host made where we cannot see it
    finally:
        progress.close()
    summaries = [json.loads(job.summary_path.read_text()) for job in jobs]
    if not sum(summary["documents"] for summary in summaries):
        raise UserError(f"corpus {data.source} is empty (no non-blank text); give a file with "
                        "text")
    for split in SPLITS:
        _write_index(index_dir / split, jobs, summaries, split, data)
    _report(summaries, len(jobs), time.monotonic() - started, data.source, unit)
    return RecordDirectory(index_dir / "train"), RecordDirectory(index_dir / "eval"), tokenizer


def _make_dirs(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the data cache {path} ({e.strerror}); choose a "
                        "writable data.cache_dir or --workdir") from None


def _file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _tokenizer_at(data: DataConfig, base: Path, corpus_key: str) -> Any:
    return load_tokenizer(data, data.tokenizer or base / f"tokenizer-{corpus_key}.model")


def training_sentences(shards: list[corpus.InputShard], data: DataConfig, seed: int,
                       held_out: bool = False, markup: Markup | None = None
                       ) -> Iterator[str]:
    """Every sentence of the training documents (held-out ones excluded), shard by shard,
    without its `markup`; with `held_out`, those of the held-out documents instead."""
    fraction = 0.0 if data.eval_source else data.held_out_fraction
    for shard in shards:
        documents = list(corpus.read_shard(shard, data))
        held = split_held_out(len(documents), fraction, shard_seed(seed, "train", shard.index))
        for document, is_held in zip(documents, held, strict=True):
            if is_held == held_out:
                yield from (document if markup is None else map(markup.plain, document))


def held_out_sentences(shards: list[corpus.InputShard], data: DataConfig, seed: int
                       ) -> Iterator[str]:
    """Every sentence of the held-out text: `data.eval_source`'s if given, else the held-out
    documents of `shards` (`training_sentences(..., held_out=True)`)."""
    if data.eval_source:
        return (sentence for shard in corpus.plan_shards(data.eval_source, data)
                for document in corpus.read_shard(shard, data) for sentence in document)
    return training_sentences(shards, data, seed, held_out=True)


def _ensure_tokenizer(data: DataConfig, base: Path, corpus_key: str,
                      shards: list[corpus.InputShard], seed: int, process: int,
                      markup: Markup | None = None) -> Any:
    """The given tokenizer, or the one trained for this corpus (process 0 first; under a file
    lock so that two preparations of one cache train it once)."""
    if data.tokenizer:
        return load_tokenizer(data)
    model = base / f"tokenizer-{corpus_key}.model"
    if process == 0:
        _train_tokenizer(data, base, model, shards, seed, markup)
    _barrier("pretext: tokenizer trained")
    if not model.is_file():  # no shared file system: train the same one here
        _train_tokenizer(data, base, model, shards, seed, markup)
    return load_tokenizer(data, model)


def _train_tokenizer(data: DataConfig, base: Path, model: Path,
                     shards: list[corpus.InputShard], seed: int,
                     markup: Markup | None = None) -> None:
    with _locked(base / "tokenizer.lock"):
        if model.is_file():
            return
        prefix = base / f".{model.stem}.{uuid.uuid4().hex}"
        print(f"training a sentencepiece tokenizer ({data.vocab_size} pieces) on up to "
              f"{data.tokenizer_sentences:,} sentences of {data.source}", flush=True)
        failures: list[BaseException] = []

        def sentences() -> Iterator[str]:  # sentencepiece would hide the reader's errors
            try:
                empty = True
                for sentence in training_sentences(shards, data, seed, markup=markup):
                    empty = False
                    yield sentence
                if empty:
                    raise UserError(f"corpus {data.source} is empty (no non-blank text); give "
                                    "a file with text")
            except BaseException as error:
                failures.append(error)

        try:
            try:
                tokenizers.SentencePieceTokenizer.train(
                    sentences(), prefix, vocab_size=data.vocab_size,
                    sample_sentences=data.tokenizer_sentences, seed=seed,
                    max_sentence_bytes=data.tokenizer_max_sentence_bytes)
            finally:
                if failures:
                    raise failures[0]
            os.replace(f"{prefix}.vocab", model.with_suffix(".vocab"))
            os.replace(f"{prefix}.model", model)
        finally:
            for leftover in base.glob(f"{prefix.name}.*"):
                leftover.unlink(missing_ok=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive OS file lock (released on exit and when the process dies)."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_index(directory: Path, jobs: list[ShardJob], summaries: list[dict[str, Any]],
                 split: str, data: DataConfig) -> None:
    """The split's `features.json`: its shard files in shard order, their counts and spec."""
    files, counts, specs = [], [], set()
    for job, summary in zip(jobs, summaries, strict=True):
        part = summary[split]
        if part["count"]:
            files.append(os.path.relpath(Path(job.prefix).parent / part["file"], directory))
            counts.append(part["count"])
            specs.add(part["spec"])
    if not files:
        what = "held-out" if split == "eval" else "training"
        raise UserError(f"no {what} examples could be built from {data.source}: the corpus is "
                        "too small or its documents too short; give more text"
                        + (" or set data.eval_source" if split == "eval" else ""))
    if len(specs) != 1:
        raise UserError(f"the shards of {directory} disagree on their features; delete "
                        f"{directory.parent.parent} and prepare again")
    _make_dirs(directory)
    spec = json.loads(specs.pop())
    _write_atomic(directory / SPEC_FILE, json.dumps({
        "spec": spec, "count": sum(counts), "files": files, "counts": counts,
        "metadata": {"source": data.source}}))


def _report(summaries: list[dict[str, Any]], shards: int, seconds: float, source: str,
            unit: str) -> None:
    totals = {key: sum(s[key] for s in summaries)
              for key in ("documents", "sentences", "tokens", "bytes")}
    examples = {split: sum(s[split]["count"] for s in summaries) for split in SPLITS}
    size = f" ({totals['bytes'] / 2**20:.1f} MB)" if unit == "MB" else ""
    print(f"prepared {source}{size}: {totals['documents']:,} documents, "
          f"{totals['sentences']:,} sentences, {totals['tokens']:,} tokens -> "
          f"{examples['train']:,} training + {examples['eval']:,} held-out examples in "
          f"{shards} shards in {seconds:.1f} s", flush=True)


def trained_tokenizers(cache_root: Path) -> list[Path]:
    """The sentencepiece models trained into a data cache, sorted."""
    return sorted(Path(cache_root).glob("*/tokenizer-*.model"))


def has_finished_shards(cache_root: Path) -> bool:
    """Whether a preparation under `cache_root` finished any shard (worth keeping on failure)."""
    return any(Path(cache_root).glob("*/shards/*.json"))

