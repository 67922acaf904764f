"""Refusals come before writing (issue 35): a resume compares the checkpoint's own config and
input files before it restores, prepares or writes anything; a checkpoints folder that cannot
be written is refused before Orbax starts (one line, as a process too); a fresh run stopped by
bad input takes back what it wrote; Orbax's own error logs are dropped."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import orbax.checkpoint as ocp
import pytest
from resilience_utils import REPO, TINY_BERT, small_corpus

from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.errors import UserError
from pretext_jax.pretrain import checkpoints
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer, prepare_data


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return small_corpus(tmp_path_factory.mktemp("refusals"))["data.source"]


def settings(corpus: str, **changes) -> dict:
    """TINY_BERT on `corpus`, its records prepared inside the workdir (`<workdir>/data`)."""
    return {**TINY_BERT, "data.source": corpus, **changes}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, corpus) -> Path:
    """A workdir stopped at step 3 (copied by each test)."""
    workdir = tmp_path_factory.mktemp("stopped") / "w"
    Trainer(make_config("bert_tiny", settings(corpus)), workdir).run(stop_after=3)
    return workdir


def copy_of(stopped: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(stopped, tmp_path / "w", symlinks=True))


def test_a_resume_compares_the_checkpoints_config_first(tmp_path, corpus, stopped, capfd,
                                                        monkeypatch):
    """config.json gone: another model size is refused naming the field, before any array is
    restored; another preset before its records are prepared into the workdir, by `pretrain`
    and `prepare` alike."""
    workdir = copy_of(stopped, tmp_path)
    (workdir / "config.json").unlink()
    before = snapshot(workdir)

    def no_restore(*args, **kwargs):
        raise AssertionError("restored before the config was compared")

    monkeypatch.setattr(ocp.CheckpointManager, "restore", no_restore)
    with pytest.raises(UserError, match=r"^the checkpoint at step 3 in .* was written by a run "
                                        r"with another config \(model.hidden_size: 32 vs 48\); "
                                        "use a new --workdir or the saved settings$"):
        Trainer(make_config("bert_tiny", settings(corpus, **{"model.hidden_size": 48})),
                workdir).run()
    electra = make_config("electra_tiny", settings(corpus, **{"model.embedding_size": 16}))
    for refused in (lambda: Trainer(electra, workdir), lambda: prepare_data(electra, workdir)):
        with pytest.raises(UserError, match="checkpoint at step 3 .* another config"):
            refused()
    assert snapshot(workdir) == before
    assert "Event loop is closed" not in capfd.readouterr().err


def test_an_edited_corpus_is_refused_before_anything_is_prepared(tmp_path, corpus, stopped):
    workdir = copy_of(stopped, tmp_path)
    before = snapshot(workdir)
    path = Path(corpus)
    text, times = path.read_text(), path.stat()
    path.write_text(text + "\nOne more sentence at the end.\n")
    try:
        with pytest.raises(UserError, match=r"^data.source is not what the checkpoint at step 3 "
                                            r"in .* read \(its files: the same number, edited or "
                                            r"touched since\); restore that data, or start "
                                            "again with a new --workdir$"):
            Trainer(make_config("bert_tiny", settings(corpus)), workdir)
        assert snapshot(workdir) == before  # no records of the edited corpus in <workdir>/data
    finally:
        path.write_text(text)
        os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert Trainer(make_config("bert_tiny", settings(corpus)), workdir).run()["step"] == 8


def test_a_checkpoints_folder_that_turns_read_only_stops_before_orbax(tmp_path, corpus,
                                                                      monkeypatch):
    """Writable when the run starts, not at its first checkpoint: one error before Orbax
    starts a save, and the fresh run takes back what it wrote (no checkpoint to resume)."""
    trainer = Trainer(make_config("bert_tiny", settings(corpus)), tmp_path / "w")
    started = []
    monkeypatch.setattr(ocp.CheckpointManager, "save", lambda *a, **k: started.append(a))
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path).name != "checkpoints")
    with pytest.raises(UserError, match=r"^the checkpoint of step 3 cannot be written: .*w/"
                                        "checkpoints is not writable; fix its permissions"):
        trainer.run()
    assert not started
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["data"]  # records kept


def obeying_permissions(folder: Path) -> list[str]:
    """A command prefix under which `folder`'s permissions hold: none for a normal user; for
    root, setpriv without the capabilities that override them (skipped where that fails)."""
    if os.geteuid() != 0:
        return []
    prefix = [shutil.which("setpriv") or "setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    try:
        probe = subprocess.run([*prefix, "touch", str(folder / "probe")], capture_output=True)
    except FileNotFoundError:
        pytest.skip("root without setpriv: a read-only folder cannot be made")
    if probe.returncode == 0:
        pytest.skip("root's permission override cannot be dropped here")
    return prefix


def test_a_read_only_checkpoints_folder_is_one_short_error(tmp_path, corpus, stopped):
    """`run.py pretrain` as its own process resuming into a read-only `checkpoints/`: under 20
    lines in all (no Orbax logging, no tracebacks, no minutes waiting for Orbax's threads), the
    last one ours, nothing written."""
    workdir = copy_of(stopped, tmp_path)
    (workdir / "checkpoints").chmod(0o555)
    before = snapshot(workdir)
    try:
        prefix = obeying_permissions(workdir / "checkpoints")
        result = subprocess.run(
            [*prefix, sys.executable, str(REPO / "run.py"), "pretrain", "--preset", "bert_tiny",
             "--workdir", str(workdir),
             *(f"{key}={value}" for key, value in settings(corpus).items())],
            capture_output=True, text=True, cwd=tmp_path, timeout=240)
    finally:
        (workdir / "checkpoints").chmod(0o755)
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 2 and len(lines) < 20, "\n".join(lines[-40:])
    assert lines[-1] == (f"error: {workdir / 'checkpoints'} is not writable by this process; "
                         f"fix its permissions (e.g. chmod u+w {workdir / 'checkpoints'}) or "
                         "use another --workdir")
    assert snapshot(workdir) == before


def test_orbax_error_logs_are_dropped_once_a_store_is_open(tmp_path):
    """Orbax logs each failed background thread with a traceback before the error reaches the
    trainer; those records are dropped, others kept."""
    store = checkpoints.CheckpointStore(tmp_path, make_config("bert_tiny"), {}, None, None,
                                        is_writer=True)
    assert store.latest_step() is None  # opens Orbax's manager
    store.close()
    logger, seen = logging.getLogger("absl"), []
    handler = logging.Handler()
    handler.emit = seen.append
    logger.addHandler(handler)
    try:
        for path in (f"/x/orbax{os.sep}checkpoint/future.py", "/x/other.py"):
            logger.handle(logger.makeRecord("absl", logging.ERROR, path, 1, "failed", (), None))
    finally:
        logger.removeHandler(handler)
    assert [record.pathname for record in seen] == ["/x/other.py"]
