"""Long phases between steps show progress on a terminal (feature banks, kNN, probes, k-means),
and a run says before it gets far when it will be long: a note for a full-size network on CPU,
the estimate after step 2."""

from __future__ import annotations

import io
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from pretext_jax import progress, run
from pretext_jax.objectives.common.clustering import kmeans
from pretext_jax.objectives.common.evaluation import (
    extract_features,
    knn_accuracy,
    linear_probe_accuracy,
)
from pretext_jax.pretrain import metrics
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.metrics import MetricWriter, full_size_note, long_run_warning
from pretext_jax.pretrain.trainer import Trainer


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def terminal(monkeypatch):
    """A terminal as stderr (once the test runs: pytest's capture replaces stderr between
    setup and call), bars shown at once."""
    screen = Terminal()
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    progress.set_enabled(True)  # as no run has said otherwise

    def on_stderr() -> Terminal:
        monkeypatch.setattr(sys, "stderr", screen)
        return screen

    yield on_stderr
    progress.set_enabled(True)


def test_progress_shows_on_a_terminal_only_and_when_enabled(terminal):
    terminal = terminal()
    assert list(progress.progress(range(3), "phase")) == [0, 1, 2]
    assert "phase:" in terminal.getvalue() and "0/3" in terminal.getvalue()
    not_a_terminal = io.StringIO()
    assert list(progress.progress(range(3), "phase", file=not_a_terminal)) == [0, 1, 2]
    assert not_a_terminal.getvalue() == ""
    progress.set_enabled(False)
    hidden = Terminal()
    assert list(progress.progress(range(3), "phase", file=hidden)) == [0, 1, 2]
    assert hidden.getvalue() == ""


def test_progress_waits_before_showing_a_short_phase(monkeypatch):
    screen = Terminal()
    assert list(progress.progress(range(3), "quick", file=screen)) == [0, 1, 2]
    assert screen.getvalue() == ""  # done within DELAY_S


@pytest.mark.parametrize("phase,name", [
    (lambda: extract_features(lambda x: x * 2, np.ones((10, 2), np.float32), batch_size=4,
                              description="bank"), "bank"),
    (lambda: knn_accuracy(np.eye(4), np.arange(4), np.eye(4), np.arange(4), 4, k=1, chunk=2),
     "kNN"),
    (lambda: linear_probe_accuracy(np.eye(4), np.arange(4), np.eye(4), np.arange(4), 4,
                                   steps=3), "linear probe"),
    (lambda: kmeans(np.arange(20, dtype=np.float32).reshape(10, 2), 2, 3, 0), "k-means"),
])
def test_long_phases_show_progress(terminal, phase, name):
    terminal = terminal()
    phase()
    assert name in terminal.getvalue()


def test_train_progress_false_hides_the_phases(tmp_path, terminal):
    terminal = terminal()
    MetricWriter(tmp_path, total_steps=1, start_step=0, enabled=True, progress=False).close()
    extract_features(lambda x: x, jnp.ones((4, 2)), batch_size=2)
    assert terminal.getvalue() == ""


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setattr(metrics.jax, "default_backend", lambda: "cpu")


def test_a_long_run_is_estimated_after_step_2(tmp_path, monkeypatch, capsys, cpu):
    ticks = iter([100.0, 136.0])  # step 2 begins at 100 s and ends at 136 s
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    writer = MetricWriter(tmp_path, total_steps=1002, start_step=0, enabled=True,
                          progress=False)
    writer.advance(1)
    assert capsys.readouterr().out == ""  # step 1 compiles: not timed
    writer.advance(1)
    assert capsys.readouterr().out.startswith(
        "warning: estimated 10.0 h for the 1,000 steps left at 36 s/step (step 2, after "
        "compilation) on this machine (cpu)")
    writer.advance(1)  # said once
    writer.close()
    assert capsys.readouterr().out == ""


def test_only_long_runs_and_full_size_networks_on_cpu_are_announced(cpu):
    assert long_run_warning(3.6, 1000) is None
    assert "3 days" in long_run_warning(3.6, 72000)
    assert full_size_note(360_000) is None  # simclr_digits
    assert "11.8 M parameters" in full_size_note(11_760_000)  # simclr_cifar10


def test_run_py_notes_a_full_size_network_before_training(tmp_path, monkeypatch, capsys, cpu):
    pytest.importorskip("sklearn", reason="the digits need scikit-learn (demo extra)")
    monkeypatch.setattr(Trainer, "run", lambda self: {})  # the note comes before training
    config = make_config("simclr_digits", ["model.depth=18", "model.base_width=64"])
    run._pretrain(config, str(tmp_path / "run"))
    assert capsys.readouterr().out.startswith("note: this network has 11.8 M parameters")
