"""The chaos tests' tools: train in a `resilience_worker.py` process, stop it at a step with a
signal, and read back what a run did (the batch digest of every executed step, its losses, its
final parameters) to compare with an uninterrupted run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

from pretrain.config import make_config
from pretrain.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "resilience_worker.py"


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
    spec = json.dumps({"preset": preset, "overrides": overrides})
    return subprocess.Popen([sys.executable, str(WORKER), spec, str(workdir), str(log)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(process: subprocess.Popen, log: Path, step: int) -> None:
    deadline = time.monotonic() + 300
    while not any(s >= step for s, _ in read_log(log)):
        assert process.poll() is None, process.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "the worker did not reach the step in time"
        time.sleep(0.02)


def run_to_the_end(preset: str, overrides: dict, workdir: Path, log: Path) -> None:
    """One worker run that trains (or resumes) to `train.steps`."""
    process = launch(preset, overrides, workdir, log)
    _, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]


def run_in_process(preset: str, overrides: dict, workdir: Path, log: Path) -> None:
    """The worker's run in this process, whose compilation cache is warm: a reference run, or
    the rerun that finishes an interrupted one (compiled programs are the same in either)."""
    import resilience_worker

    resilience_worker.main(json.dumps({"preset": preset, "overrides": overrides}), str(workdir),
                           str(log))


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


def final_params(preset: str, overrides: dict, workdir: Path) -> dict[str, np.ndarray]:
    """The parameters of the workdir's latest checkpoint, by path."""
    trainer = Trainer(make_config(preset, overrides), workdir)
    manager = trainer.checkpoint_manager()
    state, _ = trainer.restore_latest_readable(manager)
    manager.close()
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
