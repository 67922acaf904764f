"""Shortened demos: the tiny BERT beats the majority-token baseline; the image demo prints its
kNN and few-label probe beside the same network untrained, and is sized for a CPU."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from pretext_jax import run
from pretext_jax.objectives import registry
from pretext_jax.pretrain.config import make_config


def test_demo_beats_majority_baseline(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative --workdir, as users type it
    workdir = tmp_path / "demo"
    code = run.main(["demo", "--workdir", "demo", "train.steps=300", "train.eval_every=300",
                     "train.checkpoint_every=300", "train.progress=false"])
    out = capsys.readouterr().out
    assert code == 0
    assert "held-out MLM accuracy" in out and "majority-token baseline" in out
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    evaluation = [r for r in rows if r["split"] == "eval"][-1]
    baseline = float(out.split("majority-token baseline")[1].split()[0])
    assert evaluation["mlm_accuracy"] > baseline + 0.015
    assert (workdir / "curves.png").stat().st_size > 0
    assert any((workdir / "checkpoints").iterdir())
    assert any((workdir / "tensorboard").iterdir())


def test_image_demo_reports_knn_and_probe_beside_the_untrained_network(tmp_path, capsys):
    pytest.importorskip("sklearn", reason="the image demo needs scikit-learn (demo extra)")
    code = run.main(["demo", "--images", "--workdir", str(tmp_path / "images"),
                     "train.steps=4", "train.batch_size=32", "train.eval_every=4",
                     "train.checkpoint_every=4", "train.progress=false"])
    out = capsys.readouterr().out
    assert code == 0
    knn, probe = re.findall(r"held-out (.*) (\d\.\d{3}) vs (\d\.\d{3}) for the same network "
                            r"untrained$", out, re.MULTILINE)
    assert knn[0] == "kNN accuracy of the backbone's features"
    assert probe[0] == ("accuracy of a linear probe on the backbone's features fitted to 10 "
                        "labelled training images per class")
    for _, trained, untrained in (knn, probe):
        assert 0.1 < float(trained) <= 1 and 0.1 < float(untrained) <= 1  # ten digit classes
    assert "full-size" not in out and "warning: estimated" not in out  # sized for a CPU


def test_image_demo_is_sized_for_a_few_minutes_on_a_cpu():
    """The preset the image demo runs (its measured figures: `python -m bench.demo_figures`)."""
    config = make_config(run._demo(argparse.Namespace(images=True))[0])
    assert (config.train.steps, config.train.batch_size) == (200, 256)
    assert (config.model.depth, config.model.base_width, config.objective.image_size) == (
        10, 16, 8)
    assert config.examples.probe_labels_per_class == 10


def test_image_summary_evaluates_the_untrained_network_once():
    calls = []

    def untrained() -> dict[str, float]:
        calls.append(1)
        return {"knn_accuracy": 0.5, "few_label_probe_accuracy": 0.5}

    lines = registry.get("simclr").evaluation.summarize(
        {"knn_accuracy": 0.75, "few_label_probe_accuracy": 0.75}, {"probe_labels_per_class": 10},
        untrained)
    assert len(lines) == 2 and len(calls) == 1
