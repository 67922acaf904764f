"""Scale-out and resilience: 2 processes x 4 devices train as 1 process x 8, kills and
preemption signals change nothing about the result, an unreadable latest checkpoint falls
back to the previous one, non-finite steps stop (or are skipped) with the step named."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import resilience_utils
from resilience_utils import (
    REPO,
    abort_and_resume,
    assert_same_training,
    interrupt,
    read_log,
    run_in_process,
    tampered_restore,
    train_losses,
)

from pretext_jax.pretrain import feed, resilience
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

STEPS = 12
OVERRIDES = {
    "model.hidden_size": 32, "model.num_layers": 1, "model.num_heads": 2,
    "model.intermediate_size": 64, "model.max_position_embeddings": 64,
    "model.hidden_dropout": 0.1, "model.attention_dropout": 0.1,  # the dropout RNG resumes too
    "examples.max_seq_length": 32, "examples.max_predictions_per_seq": 5,
    "examples.dupe_factor": 1, "data.vocab_size": 1000, "train.batch_size": 16,
    "train.steps": STEPS, "train.log_every": 1, "train.eval_every": 1000,
    "train.eval_batches": 1, "train.checkpoint_every": 3, "train.progress": False,
    "optim.warmup_steps": 2, "optim.learning_rate": 1e-3,
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    """One prepared copy of the demo corpus for every run in this module."""
    return str(tmp_path_factory.mktemp("prepared"))


def settings(cache: str, **changes) -> dict:
    return {**OVERRIDES, "data.cache_dir": cache, **changes}


def trainer_for(workdir: Path, cache: str, devices: list | None = None, **changes) -> Trainer:
    return Trainer(make_config("bert_tiny", settings(cache, **changes)), workdir,
                   devices=devices)


def final_params(workdir: Path, cache: str) -> dict[str, np.ndarray]:
    return resilience_utils.final_params("bert_tiny", settings(cache), workdir)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache):
    """The reference: one uninterrupted run (in this process, its compilation cache warm)."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    run_in_process("bert_tiny", settings(cache), directory / "w", directory / "log")
    return directory / "w", directory / "log"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killed_and_restarted_run_equals_an_uninterrupted_one(sig, tmp_path, cache,
                                                              uninterrupted):
    """A worker process sent `sig` at a step, a second worker resuming from what it left sent
    `sig` at a later step, then the rest run in this process (its compilation cache warm): the
    uninterrupted run's batches, losses and parameters."""
    kill_at = sorted(np.random.default_rng(int(sig)).choice(np.arange(2, STEPS), 2,
                                                            replace=False))
    workdir, log = tmp_path / "w", tmp_path / "log"
    for step in kill_at:
        interrupt("bert_tiny", settings(cache), workdir, log, int(step), sig)
    run_in_process("bert_tiny", settings(cache), workdir, log)
    executed = assert_same_training("bert_tiny", settings(cache), (workdir, log), uninterrupted)
    if sig == signal.SIGTERM:
        assert len(executed) == STEPS  # nothing was lost or redone
    else:
        assert len(executed) > STEPS  # kills lost work that was redone


def one_ulp_up(state):
    """The state with every parameter one float32 ulp larger (zeros become the smallest
    subnormal, which the first update may absorb; the other weights carry it to the end)."""
    def up(leaf):
        return jax.device_put(np.nextafter(np.asarray(jax.device_get(leaf)),
                                           np.float32(np.inf)), leaf.sharding)

    return dataclasses.replace(state, params=jax.tree.map(up, state.params))


@pytest.mark.parametrize("tamper", [None, "parameters one ulp off", "data position lost"])
def test_in_process_abort_resumes_exactly_and_detects_a_lost_state(tamper, tmp_path, cache,
                                                                   uninterrupted, monkeypatch):
    """`abort_and_resume`, which the methods' tests use in place of a killed worker: a run
    stopped in place of step 8 resumes from the step-6 checkpoint and ends as the uninterrupted
    run, and a resume that restores the parameters one ulp off (the same batches, other
    parameters), or not the data position (the loader starts its epoch again: other batches),
    fails `assert_same_training`."""
    if tamper == "data position lost":
        monkeypatch.setattr(feed, "resume_position", lambda *args: None)
    with tampered_restore(one_ulp_up) if tamper == "parameters one ulp off" else \
            contextlib.nullcontext():
        ours = abort_and_resume("bert_tiny", settings(cache), tmp_path, step=8)
    if tamper is None:
        executed = assert_same_training("bert_tiny", settings(cache), ours, uninterrupted)
        assert [step for step, _ in executed] == [*range(1, 9), *range(7, STEPS + 1)]
    else:
        with pytest.raises(AssertionError):
            assert_same_training("bert_tiny", settings(cache), ours, uninterrupted)
        same_batches = dict(read_log(ours[1])) == dict(read_log(uninterrupted[1]))
        assert same_batches == (tamper == "parameters one ulp off")


def test_a_deadline_stops_with_a_checkpoint_and_the_rerun_ends_as_uninterrupted(
        tmp_path, cache, uninterrupted):
    """`run(deadline=...)` (a time-boxed GPU job) stops like SIGTERM: after the step that
    passes it, with a checkpoint; the same run again ends with the uninterrupted parameters."""
    workdir = tmp_path / "w"
    stopped = trainer_for(workdir, cache).run(deadline=time.monotonic())
    assert (stopped["step"], stopped["stopped_by"]) == (1, "time limit")
    assert trainer_for(workdir, cache).run()["step"] == STEPS
    reference = final_params(uninterrupted[0], cache)
    for path, value in final_params(workdir, cache).items():
        np.testing.assert_array_equal(value, reference[path], err_msg=path)


def test_unreadable_latest_checkpoint_falls_back_to_the_previous(tmp_path, cache, capfd,
                                                                 uninterrupted):
    reference_dir, _ = uninterrupted
    workdir = tmp_path / "w"
    trainer_for(workdir, cache).run(stop_after=6)
    for data_file in (workdir / "checkpoints" / "6").glob("state/ocdbt.process_0/d/*"):
        data_file.write_bytes(data_file.read_bytes()[:100])  # truncated
    summary = trainer_for(workdir, cache).run()
    assert summary["step"] == STEPS
    err = capfd.readouterr().err
    assert "warning: checkpoint 6" in err and "resuming from step 3" in err
    assert [p.name.split("-")[0] for p in (workdir / "corrupt_checkpoints").iterdir()] == ["6"]
    assert train_losses(workdir) == train_losses(reference_dir)


def poison_step(trainer: Trainer, bad_step: int, record: list) -> None:
    """Makes the loss of `bad_step` NaN (NaN masked-LM weights) and records params after
    every step."""
    step_fn = trainer.train_step

    def poisoned(state, batch):
        if int(jax.device_get(state.step)) + 1 == bad_step:
            batch = {**batch, "masked_lm_weights": np.full_like(batch["masked_lm_weights"],
                                                                np.nan)}
        state, metrics = step_fn(state, batch)
        record.append(jax.device_get(state.params))
        return state, metrics

    trainer.train_step = poisoned


def test_non_finite_step_stops_naming_step_examples_and_checkpoint(tmp_path, cache):
    trainer = trainer_for(tmp_path / "w", cache)
    poison_step(trainer, 5, [])
    with pytest.raises(resilience.NonFiniteStep) as error:
        trainer.run()
    message = str(error.value)
    assert "at step 5 (examples 64-79 of the training stream)" in message
    assert "last good checkpoint is step 3" in message and "on_nonfinite=skip" in message
    assert sorted(int(p.name) for p in (tmp_path / "w" / "checkpoints").iterdir()) == [3]


def test_non_finite_step_is_skipped_and_counted(tmp_path, cache):
    # One device: XLA:CPU's in-process collectives can deadlock on this step when it comes
    # back from the persistent compilation cache (jax 0.10.2); the skip logic is mesh-agnostic.
    trainer = trainer_for(tmp_path / "w", cache, jax.devices()[:1],
                          **{"train.on_nonfinite": "skip", "mesh.data": 1})
    params: list = []
    poison_step(trainer, 5, params)
    summary = trainer.run()
    assert summary["step"] == STEPS and summary["skipped_nonfinite"] == 1
    unchanged = jax.tree.map(np.array_equal, params[3], params[4])  # after steps 4 and 5
    assert all(jax.tree.leaves(unchanged))
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(params[-1]))
    rows = train_losses(tmp_path / "w")
    assert np.isnan(rows[5]) and all(np.isfinite(v) for s, v in rows.items() if s != 5)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def test_two_processes_train_like_one(tmp_path, cache):
    """2 processes x 4 CPU devices (Gloo collectives, loopback coordinator) against one
    process with 8: the same losses and parameters; the checkpoint both wrote is restored and
    continued by a single process, which reads on exactly where the two stopped."""
    workdir = tmp_path / "two"
    port = free_port()
    args = [f"{key}={value}" for key, value in settings(cache).items()]
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    processes = [subprocess.Popen(
        [sys.executable, str(REPO / "run.py"), "--coordinator", f"localhost:{port}",
         "--num-processes", "2", "--process-id", str(index), "pretrain", "--preset",
         "bert_tiny", "--workdir", str(workdir), *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for index in range(2)]
    for process in processes:
        _, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-3000:]

    single = tmp_path / "one"
    trainer_for(single, cache).run()
    two_losses, one_losses = train_losses(workdir), train_losses(single)
    assert sorted(two_losses) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([two_losses[s] for s in sorted(one_losses)],
                               [one_losses[s] for s in sorted(one_losses)], rtol=1e-5)
    two_params, one_params = final_params(workdir, cache), final_params(single, cache)
    for key, value in one_params.items():
        np.testing.assert_allclose(two_params[key], value, atol=1e-5, err_msg=key)

    longer = {"train.steps": STEPS + 3}
    trainer_for(workdir, cache, **longer).run()  # the two-process checkpoint, one process
    trainer_for(single, cache, **longer).run()
    two_losses, one_losses = train_losses(workdir), train_losses(single)
    np.testing.assert_allclose([two_losses[s] for s in range(STEPS + 1, STEPS + 4)],
                               [one_losses[s] for s in range(STEPS + 1, STEPS + 4)], rtol=1e-5)


class _Records:
    """100 integer records for loader-level checks."""

    source = [np.int32(i) for i in range(100)]

    def __len__(self) -> int:
        return 100

    def load_transforms(self) -> list:
        return []


def test_data_state_of_an_older_loader_resumes_and_other_records_are_refused():
    """A Grain state saved when the loader sharded with ShardByJaxProcess resumes at the same
    position; a state of another shuffle seed is still refused."""
    from pretext_jax.input_pipeline.records import make_loader

    reference = iter(make_loader(_Records(), batch_size=4, seed=0))
    for _ in range(3):
        next(reference)
    state = json.loads(reference.get_state())
    state["sampler"] = state["sampler"].replace(
        "shard_options=NoSharding(shard_index=0, shard_count=1, drop_remainder=False)",
        "shard_options=ShardByJaxProcess(shard_index=0, shard_count=1, drop_remainder=True)")
    assert "ShardByJaxProcess" in state["sampler"]
    resumed = iter(make_loader(_Records(), batch_size=4, seed=0))
    resumed.set_state(resilience.data_state_for_this_process([json.dumps(state)],
                                                             resumed.get_state()))
    np.testing.assert_array_equal(next(resumed), next(reference))
    state["sampler"] = state["sampler"].replace("seed=0", "seed=1")
    other = iter(make_loader(_Records(), batch_size=4, seed=0))
    with pytest.raises(ValueError):
        other.set_state(resilience.data_state_for_this_process([json.dumps(state)],
                                                               other.get_state()))


def test_records_are_described_by_content_and_older_descriptions_still_resume(tmp_path):
    """Prepared records are described by their fingerprinted directory and count, not by where
    the cache lies; a data position saved under the description older versions stored (a digest
    of the absolute file paths) resumes; one of other records is refused naming what differs."""
    from pretext_jax.input_pipeline.records import RecordDirectory, make_loader, write_records

    def write(directory: Path, count: int) -> RecordDirectory:
        write_records(({"id": np.int32(i)} for i in range(count)), directory,
                      metadata={"source": "corpus.txt"})
        return RecordDirectory(directory)

    records = write(tmp_path / "cache" / "key1" / "train", 40)
    assert json.loads(repr(records.source)) == {
        "kind": "prepared records", "data.source": "corpus.txt", "records": "key1/train",
        "count": 40}
    shutil.copytree(tmp_path / "cache", tmp_path / "moved")
    assert repr(RecordDirectory(tmp_path / "moved" / "key1" / "train").source) == repr(
        records.source)
    reference = iter(make_loader(records, batch_size=4, seed=1))
    for _ in range(3):
        next(reference)
    state = json.loads(reference.get_state())
    state["data_source"] = records.earlier_descriptions[0]  # as older checkpoints hold it
    assert "hash_of_paths" in state["data_source"]
    resumed = iter(make_loader(records, batch_size=4, seed=1))
    fresh = resumed.get_state()
    saved = resilience.data_state_for_this_process([json.dumps(state)], fresh,
                                                   records.earlier_descriptions)
    assert resilience.data_state_difference(saved, fresh) is None
    resumed.set_state(saved)
    np.testing.assert_array_equal(next(resumed)["id"], next(reference)["id"])
    other = iter(make_loader(write(tmp_path / "cache" / "key2" / "train", 40), batch_size=4,
                             seed=1))
    assert resilience.data_state_difference(reference.get_state(), other.get_state()) == (
        "records: 'key1/train' vs 'key2/train'")
    assert resilience.data_state_difference(
        reference.get_state(), iter(make_loader(records, batch_size=4, seed=2)).get_state()
    ) == "sampler seed: 1 vs 2"
