"""The chaos tests' tools: train in a `resilience_worker.py` process, stop it at a step with a
signal, and read back what a run did (the batch digest of every executed step, its losses, its
final parameters) to compare with an uninterrupted run.

A signal's effect on a process is method-independent (tests/test_resilience.py and
test_resilience_images.py kill real worker processes). What each method must show is that its
whole state (data position, RNG, method state such as memory banks or pseudo-labels) comes back
from the last checkpoint; `abort_and_resume` shows that in the test's process, its compilation
cache warm, stopping a run as a kill does: the steps since the last periodic checkpoint are
lost. `tampered_restore` is its negative control."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import jax
import numpy as np
import pytest

from pretext_jax.pretrain.checkpoints import CheckpointStore, TrainState
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "resilience_worker.py"
# A one-layer BERT on `small_corpus`: 8 steps, checkpoints every 3, a train row every step.
TINY_BERT = {"model.hidden_size": 32, "model.num_layers": 1, "model.num_heads": 2,
             "model.intermediate_size": 64, "model.max_position_embeddings": 64,
             "examples.max_seq_length": 32, "examples.max_predictions_per_seq": 5,
             "data.vocab_size": 60, "train.batch_size": 16, "train.steps": 8,
             "train.log_every": 1, "train.eval_every": 1000, "train.eval_batches": 1,
             "train.checkpoint_every": 3, "train.progress": False, "optim.warmup_steps": 2,
             "optim.learning_rate": 1e-3}

# For comparing one step on different meshes: plain gradient descent at a constant rate 1, so
# new parameters = initial - gradient (a warmup would start at rate 0). Adam would keep only the
# gradient's signs after one step (m / sqrt(v) = g / |g|), hiding a gradient scaled on some
# mesh and amplifying float32 noise in gradients near 0 into visible differences.
GRADIENT_STEP = {"optim.optimizer": "sgd", "optim.momentum": 0.0, "optim.learning_rate": 1.0,
                 "optim.schedule": "constant", "optim.warmup_steps": 0}


def small_corpus(root: Path) -> dict[str, str]:
    """50 documents of 8 template sentences in `root/corpus.txt`; the data settings that read
    it, with a cache in `root/cache` that runs share."""
    sentences = [f"Sentence {i} talks about topic {i % 7} and then some more words." for i in
                 range(400)]
    (root / "corpus.txt").write_text("\n\n".join("\n".join(sentences[i:i + 8])
                                                 for i in range(0, 400, 8)) + "\n")
    return {"data.source": str(root / "corpus.txt"), "data.cache_dir": str(root / "cache")}


def read_log(path: Path) -> list[tuple[int, str]]:
    """(step, digest of its batch) for every step the worker started, in order."""
    if not path.exists():
        return []
    lines = [line.split() for line in path.read_text().splitlines()]
    return [(int(step), digest) for step, digest in lines]


def train_losses(workdir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if row["split"] == "train"}


def launch(preset: str, overrides: dict, workdir: Path, log: Path) -> subprocess.Popen:
    """A worker process (`resilience_worker.py`), compiling its own programs."""
    spec = json.dumps({"preset": preset, "overrides": overrides})
    return subprocess.Popen([sys.executable, str(WORKER), spec, str(workdir), str(log)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(process: subprocess.Popen, log: Path, step: int, timeout_s: float = 600) -> None:
    """Returns once the worker has started `step`. A worker that exits first fails the test
    with its stderr; one still short of it after `timeout_s` is stopped and fails the test with
    every thread's stack (SIGUSR1: the worker's faulthandler) and the steps it started."""
    deadline = time.monotonic() + timeout_s
    while not any(s >= step for s, _ in read_log(log)):
        assert process.poll() is None, process.communicate()[1][-2000:]
        if time.monotonic() > deadline:
            process.send_signal(signal.SIGUSR1)
            time.sleep(2)
            process.kill()
            stacks = process.communicate()[1]
            raise AssertionError(f"the worker did not start step {step} in {timeout_s:.0f} s "
                                 f"(steps started: {[s for s, _ in read_log(log)]}); its "
                                 f"threads:\n{stacks[-6000:]}")
        time.sleep(0.02)


def run_in_process(preset: str, overrides: dict, workdir: Path, log: Path,
                   kill_at: int | None = None, sigterm_at: int | None = None) -> None:
    """The worker's run in this process, whose compilation cache is warm: a reference run, or
    the rerun that finishes an interrupted one (compiled programs are the same in either).
    `kill_at`: raise `resilience_worker.Killed` in place of that step; `sigterm_at`: send this
    process SIGTERM as that step begins."""
    import resilience_worker

    resilience_worker.main(json.dumps({"preset": preset, "overrides": overrides}), str(workdir),
                           str(log), kill_at=kill_at, sigterm_at=sigterm_at)


def interrupt(preset: str, overrides: dict, workdir: Path, log: Path, step: int,
              sig: signal.Signals) -> None:
    """A worker run sent `sig` once it has started `step`: SIGKILL ends it wherever it is;
    SIGTERM lets it finish the step, checkpoint and exit cleanly."""
    process = launch(preset, overrides, workdir, log)
    wait_for_step(process, log, step)
    process.send_signal(sig)
    out, err = process.communicate(timeout=300)
    if sig == signal.SIGTERM:
        assert process.returncode == 0, err[-3000:]
        assert json.loads(out.splitlines()[-1])["stopped_by"] == "SIGTERM"


def abort(preset: str, overrides: dict, workdir: Path, log: Path, step: int) -> None:
    """A run stopped as a kill stops it, in this process: `step` is logged as begun, then
    `resilience_worker.Killed` is raised in its place (`run_in_process(kill_at=step)`). The
    trainer saves nothing on an exception (it seals the checkpoints already written and closes
    their manager), so the newest checkpoint is the last periodic one before `step` (asserted
    here) and the steps after it are lost."""
    import resilience_worker

    with pytest.raises(resilience_worker.Killed):
        run_in_process(preset, overrides, workdir, log, kill_at=step)
    every = make_config(preset, overrides).train.checkpoint_every
    saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and saved[-1] == (step - 1) // every * every, saved


def abort_and_resume(preset: str, overrides: dict, root: Path, step: int) -> tuple[Path, Path]:
    """A run under `root`/w stopped in place of `step` as a kill stops it (`abort`), then
    finished by `run_in_process`, both in this process, its compilation cache warm. Returns its
    (workdir, log)."""
    ours = root / "w", root / "w.log"
    abort(preset, overrides, *ours, step=step)
    run_in_process(preset, overrides, *ours)
    return ours


def stop_and_resume(preset: str, overrides: dict, root: Path, step: int) -> tuple[Path, Path]:
    """A run under `root`/w sent SIGTERM as `step` begins finishes that step, checkpoints it and
    returns (asserted), then `run_in_process` finishes it, both in this process, its compilation
    cache warm. Returns its (workdir, log)."""
    ours = root / "w", root / "w.log"
    run_in_process(preset, overrides, *ours, sigterm_at=step)
    saved = sorted(int(p.name) for p in (ours[0] / "checkpoints").iterdir() if p.name.isdigit())
    assert saved[-1] == step and sorted(dict(read_log(ours[1]))) == list(range(1, step + 1))
    run_in_process(preset, overrides, *ours)
    return ours


@contextlib.contextmanager
def tampered_restore(change: Callable[[TrainState], TrainState]) -> Iterator[None]:
    """Within it, every restored checkpoint's train state is passed through `change`: a
    negative control showing that a resume which lost or altered some state is detected."""
    restore = CheckpointStore.restore_latest_readable

    def tampered(store: CheckpointStore) -> tuple[TrainState, dict] | None:
        restored = restore(store)
        return None if restored is None else (change(restored[0]), restored[1])

    with mock.patch.object(CheckpointStore, "restore_latest_readable", tampered):
        yield


def final_params(preset: str, overrides: dict, workdir: Path) -> dict[str, np.ndarray]:
    """The parameters of the workdir's latest checkpoint, by path."""
    trainer = Trainer(make_config(preset, overrides), workdir)
    state, _ = trainer.checkpoints.restore_latest_readable()
    trainer.checkpoints.close()
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(jax.device_get(state.params))}


def assert_same_training(preset: str, overrides: dict, ours: tuple[Path, Path],
                         theirs: tuple[Path, Path]) -> list[tuple[int, str]]:
    """Runs (workdir, log) `ours` and `theirs` read the same batch at every step (a step redone
    after a kill replaces the lost attempt) and end with the same losses and, bit for bit, the
    same parameters. Returns every step `ours` executed."""
    executed, reference = read_log(ours[1]), read_log(theirs[1])
    accepted = dict(executed)
    assert sorted(accepted) == list(range(1, overrides["train.steps"] + 1))
    assert accepted == dict(reference)
    assert train_losses(ours[0]) == train_losses(theirs[0])
    mine, other = (final_params(preset, overrides, workdir) for workdir, _ in (ours, theirs))
    assert mine.keys() == other.keys()
    assert all(np.array_equal(mine[k], other[k]) for k in other)
    return executed


def flat_params(tree: object) -> dict[str, np.ndarray]:
    """A parameter tree as {path: array} on the host."""
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))}


# One device against the (2, 2, 2) mesh, which shards the batch 4 ways (data x fsdp) and the
# parameters over fsdp and tensor; tests/test_trainer.py adds (8, 1, 1) and (1, 1, 8) for BERT.
MESHES = {"single": ((1, 1, 1), 1), "mixed": ((2, 2, 2), None)}


def mesh_overrides(mesh: tuple[int, int, int]) -> dict[str, int]:
    return {"mesh.data": mesh[0], "mesh.fsdp": mesh[1], "mesh.tensor": mesh[2]}


def assert_same_step_on_every_mesh(trainer_at: Callable[..., Trainer], root: Path,
                                   moved: float = 1e-3) -> dict:
    """One training step (use GRADIENT_STEP) on one device and on the (2, 2, 2) mesh, from the
    first trainer's first batch and the same initial parameters, gives the same mean loss and
    parameters, and moves some parameter by more than `moved`.
    `trainer_at(workdir, mesh, devices)` builds each trainer. Returns the batch."""
    results, batch, initial = {}, None, None
    for name, (mesh, count) in MESHES.items():
        trainer = trainer_at(root / name, mesh, jax.devices()[:count] if count else None)
        batch = next(trainer.data_iterator()) if batch is None else batch
        state = trainer.init_state()
        initial = flat_params(state.params) if initial is None else initial
        state, metrics = trainer.train_step(state, batch)
        results[name] = (float(metrics["loss"][0]) / float(metrics["loss"][1]),
                         flat_params(state.params))
    loss0, params0 = results["single"]
    assert np.isfinite(loss0)
    assert max(np.abs(params0[k] - initial[k]).max() for k in initial) > moved
    for name, (loss, params) in results.items():
        np.testing.assert_allclose(loss, loss0, rtol=1e-5, atol=1e-5, err_msg=name)
        for key, value in params0.items():
            np.testing.assert_allclose(params[key], value, atol=2e-6, rtol=1e-5,
                                       err_msg=f"{name} {key}")
    return batch
