"""A shortened `python run.py`: the demo's tiny BERT beats the majority-token baseline."""

from __future__ import annotations

import json

import pytest

from pretext_jax import run


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


def test_image_demo_reports_knn_beside_the_untrained_network(tmp_path, capsys):
    pytest.importorskip("sklearn", reason="the image demo needs scikit-learn (demo extra)")
    code = run.main(["demo", "--images", "--workdir", str(tmp_path / "images"),
                     "train.steps=4", "train.batch_size=32", "train.eval_every=4",
                     "train.checkpoint_every=4", "train.progress=false"])
    out = capsys.readouterr().out
    assert code == 0
    line = next(row for row in out.splitlines() if "kNN accuracy" in row)
    trained, untrained = (float(word) for word in line.split() if word[0].isdigit())
    assert 0.1 < trained <= 1 and 0.1 < untrained <= 1  # ten digit classes
    assert line.endswith("for the same network untrained")
