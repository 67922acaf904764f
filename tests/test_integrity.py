"""Integrity under faults (issue 19): damaged metric files, numbers out of range, CLI flags;
sealed checkpoints, no non-finite checkpoint, the checkpoint's config compared on resume, one
training process per workdir."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from resilience_utils import TINY_BERT, small_corpus

from pretext_jax import (
    objectives,  # noqa: F401  (registers the methods)
    run,
)
from pretext_jax.errors import UserError
from pretext_jax.models.bert import Bert
from pretext_jax.pretrain import integrity
from pretext_jax.pretrain.config import RANGES, make_config
from pretext_jax.pretrain.metrics import read_rows, truncate_after
from pretext_jax.pretrain.trainer import Trainer


def test_damaged_metrics_tail_is_trimmed_with_a_warning(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": step, "split": "train", "loss": 1.0 / step} for step in (1, 2, 3, 4)]
    path.write_bytes(b"".join(json.dumps(row).encode() + b"\n" for row in rows)
                     + b'{"step": 5, "spl\xff\xfe\n\n[1, 2]\n{"step": 6, "lo')
    truncate_after(path, 3)
    assert read_rows(path) == (rows[:3], 0)
    assert "dropped 3 damaged line(s)" in capsys.readouterr().err
    before = path.read_bytes()
    truncate_after(path, 3)  # nothing to drop: the file is left as it is, silently
    assert path.read_bytes() == before and capsys.readouterr().err == ""


@pytest.mark.parametrize("override,message", [
    ("optim.learning_rate=-1", "[0, inf)"), ("optim.warmup_steps=-5", "[0, inf)"),
    ("optim.learning_rate=nan", "finite"), ("optim.b2=1", "[0, 1)"),
    ("train.eval_batches=0", "[1, inf)"), ("train.keep_checkpoints=0", "[1, inf)"),
    ("model.dtype=float8", "bfloat16"), ("mesh.data=0", "at least 1 device"),
    ("model.hidden_dropout=inf", "finite"), ("data.worker_count=-1", ">= 0"),
    ("optim.layerwise_lr_decay=0", "(0, 1]"),
    ("model.hidden_size=-64", ">= 1"), ("model.num_heads=0", ">= 1"),
    ("model.attention_dropout=1.5", "[0, 1)"), ("model.layer_norm_eps=-1", "> 0"),
])
def test_numbers_out_of_range_are_refused_naming_the_range(override, message):
    with pytest.raises(UserError) as error:
        make_config("bert_tiny", [override])
    key = override.split("=")[0]
    assert key.split(".")[1] in str(error.value) and message in str(error.value)
    assert key in str(error.value) or f"{key.split('.')[0]}.*" in str(error.value)


def test_every_range_names_a_real_key():
    config = make_config("bert_tiny").to_dict()
    for key in RANGES:
        section, name = key.split(".")
        assert name in config[section], key


@pytest.mark.parametrize("args,message", [
    (["glue", "--init", "x", "--workdir", "w", "--seeds", "0"], "--seeds: '0' must be"),
    (["finetune", "--task", "sst2", "--init", "x", "--workdir", "w", "--epochs", "nan"],
     "(0, inf)"),
    (["finetune", "--task", "sst2", "--init", "x", "--workdir", "w", "--epochs", "inf"],
     "finite"),
    (["glue", "--init", "x", "--workdir", "w", "--learning-rates", "1e-3,-1"], "'-1'"),
    (["generate", "--workdir", "w", "--prompt", "a", "--top-p", "1.5"], "(0, 1]"),
    (["pretrain", "--workdir", ""], "empty path"),
    (["pretrain", "--workdir", "w", "--num-processes", "0"], "--num-processes"),
])
def test_bad_flags_are_one_line_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run.main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: run.py") and message in err and "--help" in err, err


def test_bad_process_environment_is_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    assert run.main(["pretrain", "--workdir", str(tmp_path / "w")]) == 2
    assert not (tmp_path / "w").exists()
    assert "JAX_NUM_PROCESSES='two'" in capsys.readouterr().err


# ------------------------------------------------------------------ the trainer under faults
STEPS = TINY_BERT["train.steps"]
SMALL = TINY_BERT


@pytest.fixture(scope="module")
def corpus_and_cache(tmp_path_factory) -> tuple[str, str]:
    data = small_corpus(tmp_path_factory.mktemp("integrity"))
    return data["data.source"], data["data.cache_dir"]


def trainer_at(workdir: Path, corpus_and_cache: tuple[str, str], **changes) -> Trainer:
    corpus, cache = corpus_and_cache
    return Trainer(make_config("bert_tiny", {**SMALL, "data.source": corpus,
                                             "data.cache_dir": cache, **changes}), workdir)


def params_of(summary: dict) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(jax.device_get(summary["state"].params))]


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def uninterrupted(corpus_and_cache, tmp_path_factory) -> list[np.ndarray]:
    return params_of(trainer_at(tmp_path_factory.mktemp("ref") / "w", corpus_and_cache).run())


def test_byte_flipped_checkpoint_is_set_aside_and_the_run_ends_identical(
        tmp_path, corpus_and_cache, uninterrupted, capfd):
    workdir = tmp_path / "w"
    trainer_at(workdir, corpus_and_cache).run(stop_after=6)
    assert integrity.is_sealed(workdir / "checkpoints" / "6")
    data = max((p for p in (workdir / "checkpoints" / "6" / "state").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    middle = len(raw) // 2
    raw[middle:middle + 8] = bytes(b ^ 0xFF for b in raw[middle:middle + 8])  # same length
    data.write_bytes(bytes(raw))
    summary = trainer_at(workdir, corpus_and_cache).run()
    err = capfd.readouterr().err
    assert "warning: checkpoint 6" in err and data.name in err and "CRC-32" in err, err
    assert "resuming from step 3" in err
    assert [p.name.split("-")[0] for p in (workdir / "corrupt_checkpoints").iterdir()] == ["6"]
    assert summary["step"] == STEPS
    for ours, reference in zip(params_of(summary), uninterrupted, strict=True):
        np.testing.assert_array_equal(ours, reference)


def test_no_checkpoint_ever_holds_non_finite_values(tmp_path, corpus_and_cache):
    """A learning rate so large that the first update overflows (loss and gradients finite;
    BERT's Adam without bias correction moves by 3.16 x lr at step 1): `stop` ends before any
    checkpoint, `skip` leaves the parameters as they were."""
    huge = {"optim.learning_rate": 2e38, "optim.warmup_steps": 0,
            "optim.bias_correction": False}
    with pytest.raises(UserError, match="updated parameters at step 1"):
        trainer_at(tmp_path / "stop", corpus_and_cache, **huge).run()
    assert not list((tmp_path / "stop" / "checkpoints").glob("[0-9]*"))
    trainer = trainer_at(tmp_path / "skip", corpus_and_cache, **huge,
                         **{"train.on_nonfinite": "skip"})
    initial = [np.asarray(leaf) for leaf in jax.tree.leaves(jax.device_get(
        trainer.init_state().params))]
    summary = trainer.run()
    assert summary["skipped_nonfinite"] == STEPS
    for ours, start in zip(params_of(summary), initial, strict=True):
        np.testing.assert_array_equal(ours, start)


def test_the_checkpoint_config_is_the_one_compared(tmp_path, corpus_and_cache):
    workdir = tmp_path / "w"
    trainer_at(workdir, corpus_and_cache).run(stop_after=3)
    (workdir / "config.json").unlink()
    before = snapshot(workdir)
    with pytest.raises(UserError, match="checkpoint at step 3 .* another config .*learning_rate"):
        trainer_at(workdir, corpus_and_cache, **{"optim.learning_rate": 5e-4}).run()
    assert snapshot(workdir) == before  # nothing written by the refused run
    summary = trainer_at(workdir, corpus_and_cache).run()  # the same settings resume
    assert summary["step"] == STEPS and (workdir / "config.json").is_file()


def test_checkpoints_that_are_not_a_folder_are_an_error(tmp_path, corpus_and_cache):
    workdir = tmp_path / "w"
    workdir.mkdir()
    (workdir / "checkpoints").write_text("not a folder")
    with pytest.raises(UserError, match="checkpoints is not a folder"):
        trainer_at(workdir, corpus_and_cache).run()
    assert sorted(p.name for p in workdir.iterdir()) == ["checkpoints"]


def test_a_second_training_process_is_refused_naming_the_first(tmp_path, corpus_and_cache):
    workdir = tmp_path / "w"
    workdir.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from pretext_jax.pretrain.integrity import WorkdirLock; "
         "lock = WorkdirLock(Path(sys.argv[1])); "
         "lock.acquire(); lock.record_owner(); print('locked', flush=True); time.sleep(60)",
         str(workdir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match=f"in use by process {holder.pid} on "):
            trainer_at(workdir, corpus_and_cache).run()
        assert not (workdir / "checkpoints").exists() and not (workdir / "config.json").exists()
    finally:
        holder.kill()
        holder.wait()
    assert trainer_at(workdir, corpus_and_cache, **{"train.steps": 1}).run()["step"] == 1


def resumes_identically(workdir: Path, corpus_and_cache, uninterrupted) -> None:
    assert integrity.verify(workdir / "checkpoints" / "3") is None  # intact
    assert not list((workdir / "checkpoints").glob("*tmp*"))  # nothing left to trip on
    summary = trainer_at(workdir, corpus_and_cache).run()
    assert summary["step"] == STEPS
    for ours, reference in zip(params_of(summary), uninterrupted, strict=True):
        np.testing.assert_array_equal(ours, reference)


def test_failed_checkpoint_write_is_one_error_and_leaves_nothing_behind(
        tmp_path, corpus_and_cache, uninterrupted, monkeypatch):
    """A write error from Orbax (tensorstore reports a full disk as a ValueError) after it
    created its temporary folder."""
    import orbax.checkpoint as ocp

    workdir = tmp_path / "w"
    trainer_at(workdir, corpus_and_cache).run(stop_after=3)
    original = ocp.CheckpointManager.save

    def full_disk(manager, step, *args, **kwargs):
        (workdir / "checkpoints" / f"{step}.orbax-checkpoint-tmp-1" / "state").mkdir(
            parents=True)
        raise ValueError("RESOURCE_EXHAUSTED: Error writing \"params\" in OCDBT database: "
                         "No space left on device")

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
    with pytest.raises(UserError, match="checkpoint of step 6 could not be written .*"
                                        "RESOURCE_EXHAUSTED.*rerun to resume"):
        trainer_at(workdir, corpus_and_cache).run()
    monkeypatch.setattr(ocp.CheckpointManager, "save", original)
    resumes_identically(workdir, corpus_and_cache, uninterrupted)


def test_full_file_system_stops_before_the_checkpoint(tmp_path, corpus_and_cache,
                                                      uninterrupted):
    """A real full disk: a small tmpfs (needs permission to mount one; skipped otherwise)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root); the injected error above "
                    "covers the write path")
    try:
        workdir = mount / "w"
        trainer_at(workdir, corpus_and_cache).run(stop_after=3)
        filler = mount / "filler"
        stats = os.statvfs(mount)
        filler.write_bytes(bytes(stats.f_bavail * stats.f_frsize - (64 << 10)))
        with pytest.raises(UserError, match="not enough space for the checkpoint of step 6"):
            trainer_at(workdir, corpus_and_cache).run()
        filler.unlink()
        resumes_identically(workdir, corpus_and_cache, uninterrupted)
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def logged_rows(workdir: Path) -> list[dict]:
    rows, damaged = read_rows(workdir / "metrics.jsonl")
    assert damaged == 0
    return [{k: v for k, v in row.items() if not k.endswith("_per_s")} for row in rows]


def test_metrics_after_a_stop_equal_an_uninterrupted_runs(tmp_path, corpus_and_cache):
    """Logging every 4 steps, checkpoints every 3, stopped at 6: the window 5-8 is half
    before the stop; its row must still be the uninterrupted run's."""
    every = {"train.log_every": 4, "train.eval_every": 4}
    reference = tmp_path / "reference"
    trainer_at(reference, corpus_and_cache, **every).run()
    workdir = tmp_path / "w"
    trainer_at(workdir, corpus_and_cache, **every).run(stop_after=6)
    trainer_at(workdir, corpus_and_cache, **every).run()
    assert logged_rows(workdir) == logged_rows(reference)
    assert [row["step"] for row in logged_rows(workdir) if row["split"] == "train"] == [4, 8]


def test_a_very_long_line_prepares_like_any_other(tmp_path):
    """A 3 MB line (one 500,000-word sentence) inside a normal corpus: tokenised and cut to the
    sequence length in linear time (`truncate_seq_pair` counts removals, then slices)."""
    from pretext_jax.pretrain.trainer import prepare_data

    rng = np.random.default_rng(0)
    words = [f"word{i}" for i in range(300)]
    normal = "\n\n".join("\n".join(" ".join(rng.choice(words, 12)) + " ." for _ in range(6))
                         for _ in range(40))
    long_line = " ".join(rng.choice(words, 500_000)) + " ."
    (tmp_path / "corpus.txt").write_text(normal + "\n\n" + long_line + "\n\n" + normal + "\n")
    config = make_config("bert_tiny", {**SMALL, "data.source": str(tmp_path / "corpus.txt"),
                                       "data.held_out_fraction": 0.1, "data.vocab_size": 40})
    data = prepare_data(config, tmp_path / "w")
    lengths = data.train.examples(range(len(data.train)))["input_ids"].shape
    assert len(data.train) > 0 and lengths[1] == config.examples.max_seq_length


def test_a_moved_workdir_resumes_exactly(tmp_path, corpus_and_cache, uninterrupted):
    """Records prepared inside the workdir (`<workdir>/data`), the workdir renamed and moved
    to another folder between stop and resume: nothing in it names its old path."""
    first = tmp_path / "here" / "run"
    trainer_at(first, corpus_and_cache, **{"data.cache_dir": ""}).run(stop_after=3)
    moved = tmp_path / "elsewhere" / "renamed"
    moved.parent.mkdir()
    shutil.move(first, moved)
    summary = trainer_at(moved, corpus_and_cache, **{"data.cache_dir": ""}).run()
    assert summary["step"] == STEPS and not (tmp_path / "here" / "run").exists()
    for ours, reference in zip(params_of(summary), uninterrupted, strict=True):
        np.testing.assert_array_equal(ours, reference)


def test_two_pretrain_processes_on_one_workdir(tmp_path, corpus_and_cache):
    """A second `run.py pretrain` on a workdir in use is refused with one line naming the
    first, which finishes unharmed (every row logged once); a reader loads the workdir beside
    it."""
    from pretext_jax.pretrain.loading import load_model

    corpus, cache = corpus_and_cache
    workdir = tmp_path / "w"
    steps = 60
    command = [sys.executable, str(Path(run.__file__)), "pretrain", "--workdir", str(workdir),
               "--data", corpus, *(f"{k}={v}" for k, v in {
                   **SMALL, "data.cache_dir": cache, "train.steps": steps,
                   "train.checkpoint_every": 10, "train.log_every": 10}.items())]
    first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        for _ in range(600):  # the owner is recorded once the first run's checks passed
            if (workdir / integrity.OWNER_FILE).is_file() or first.poll() is not None:
                break
            time.sleep(0.2)
        second = subprocess.run(command, capture_output=True, text=True, timeout=300)
        while not (workdir / "checkpoints" / "20").is_dir() and first.poll() is None:
            time.sleep(0.2)
        # a reader (eval, convert, generate) beside the running job sees finished checkpoints
        assert isinstance(load_model(workdir), Bert) and first.poll() is None
    finally:
        first_err = first.communicate(timeout=600)[1]
    assert first.returncode == 0, first_err[-2000:]
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr[-2000:]
    assert f"in use by process {first.pid} on " in second.stderr
    rows = [row["step"] for row in read_rows(workdir / "metrics.jsonl")[0]
            if row["split"] == "train"]
    assert rows == list(range(10, steps + 1, 10))


def test_loading_a_workdir_verifies_its_latest_checkpoint(tmp_path, corpus_and_cache):
    from pretext_jax.pretrain.loading import load_model

    workdir = tmp_path / "w"
    summary = trainer_at(workdir, corpus_and_cache).run(stop_after=3)
    loaded = nnx.to_pure_dict(nnx.state(load_model(workdir), nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, loaded,
                 nnx.to_pure_dict(jax.device_get(summary["state"].params)))
    (data,) = [p for p in (workdir / "checkpoints" / "3" / "state").rglob("*") if p.is_file()
               and p.stat().st_size > 1000][:1]
    raw = data.read_bytes()
    data.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))  # one bit of the last byte
    with pytest.raises(UserError, match="step 3\\) is damaged .*CRC-32"):
        load_model(workdir)


# Ctrl-C as in a terminal, whatever this process inherited: a shell starts background jobs with
# SIGINT ignored, and Python leaves an inherited SIG_IGN alone (as it should: run.py must not
# undo nohup or `&`), so the child restores Python's handler itself before running run.py.
WITH_CTRL_C = ("import runpy, signal, sys; "
               "signal.signal(signal.SIGINT, signal.default_int_handler); "
               "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


DROPPED_CTRL_C = """
import gc, signal, sys, time
from pretext_jax import run

signal.signal(signal.SIGINT, signal.default_int_handler)
if sys.argv[1] == "without the hook":
    run._interrupt_again_if_dropped = lambda previous_hook: previous_hook

def ctrl_c_inside_the_collector(phase, info):  # as if SIGINT landed in jax's gc callback
    if phase == "start" and not gc.callbacks.remove(ctrl_c_inside_the_collector):
        raise KeyboardInterrupt

def command(argv):
    try:
        gc.callbacks.append(ctrl_c_inside_the_collector)
        gc.collect()
        time.sleep(20)
        return 0
    except KeyboardInterrupt:
        return 130

run._main = command
sys.exit(run.main([]))
"""


@pytest.mark.parametrize("hook", ["with the hook", "without the hook"])
def test_ctrl_c_dropped_in_a_gc_callback_still_interrupts(hook):
    """Python prints and drops a KeyboardInterrupt raised in a garbage-collector callback (CI
    once saw `prepare` finish with exit 0 after a Ctrl-C landed in jax's); the CLI's
    unraisable hook interrupts the main thread again. Control: without it the command runs on."""
    started = time.monotonic()
    process = subprocess.run([sys.executable, "-c", DROPPED_CTRL_C, hook], capture_output=True,
                             text=True, timeout=60)
    if hook == "with the hook":
        assert process.returncode == 130 and time.monotonic() - started < 15, process.stderr
        assert "KeyboardInterrupt" not in process.stderr
    else:
        assert process.returncode == 0 and "KeyboardInterrupt" in process.stderr


def test_ctrl_c_while_sentencepiece_reads_the_sentences_stays_an_interruption(tmp_path):
    """A KeyboardInterrupt raised in the sentence iterator sentencepiece reads (its C++ side
    returns it as a RuntimeError "INTERNAL: KeyboardInterrupt") comes back out as a
    KeyboardInterrupt, not as a bad-input UserError."""
    from pretext_jax.input_pipeline.tokenizers import SentencePieceTokenizer

    def sentences():
        for i in range(2000):
            if i == 1000:
                raise KeyboardInterrupt
            yield f"sentence number {i} about topic {i % 13} and more words"

    with pytest.raises(KeyboardInterrupt):
        SentencePieceTokenizer.train(sentences(), tmp_path / "tok", vocab_size=60)
    assert not list(tmp_path.iterdir())


def test_ctrl_c_during_tokenizer_training_is_an_interruption(tmp_path):
    """SIGINT while sentencepiece trains: exit 130 and "interrupted", never a bad-input
    message, and no tokenizer left half-written."""
    rng = np.random.default_rng(0)
    words = np.array(["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 12)))
                      for _ in range(40_000)])
    lines = [" ".join(row) + " ." for row in rng.choice(words, (8000, 15))]
    (tmp_path / "corpus.txt").write_text("\n\n".join(
        "\n".join(lines[i:i + 8]) for i in range(0, 8000, 8)) + "\n")
    process = subprocess.Popen(
        [sys.executable, "-c", WITH_CTRL_C, str(Path(run.__file__)), "prepare", "--workdir",
         str(tmp_path / "w"), "--data", str(tmp_path / "corpus.txt"), "data.vocab_size=8000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in process.stdout:
        if line.startswith("training a sentencepiece tokenizer"):
            time.sleep(0.3)  # early in the ~1.4 s training
            process.send_signal(signal.SIGINT)
            break
    _, err = process.communicate(timeout=300)
    assert process.returncode == 130 and err.strip().endswith("interrupted"), err[-2000:]
    assert "sentencepiece training failed" not in err and "Traceback" not in err
    assert not list((tmp_path / "w").rglob("tokenizer-*.model"))
