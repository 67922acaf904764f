"""An objective defined outside the package (docs/examples/smoothed_mlm.py, the example of
docs/add_your_own_objective.md) is registered by `run.py --import` and trains from the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pretext_jax import run

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "docs" / "examples" / "smoothed_mlm.py"


def test_external_objective_trains_from_the_cli(tmp_path):
    workdir = tmp_path / "w"
    result = subprocess.run(
        [sys.executable, str(REPO / "run.py"), "--import", str(EXAMPLE), "pretrain",
         "--preset", "bert_tiny", "--workdir", str(workdir), "method=smoothed_mlm",
         "train.steps=60", "train.log_every=10", "train.eval_every=60",
         "train.checkpoint_every=60", "train.progress=false", "data.vocab_size=1000",
         "examples.max_seq_length=32", "examples.max_predictions_per_seq=5",
         "examples.dupe_factor=1", "train.batch_size=32"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((workdir / "config.json").read_text())["method"] == "smoothed_mlm"
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if row["split"] == "train"]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5, losses
    assert "nsp_loss" not in rows[0]  # the example's loss, not BERT's


def test_missing_plugin_is_a_one_line_error(tmp_path, capsys):
    code = run.main(["--import", str(tmp_path / "nope.py"), "pretrain", "--workdir",
                     str(tmp_path / "w")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "nope.py: no such file" in err and "\n" not in err
    assert run.main(["--import", "no_such_module_xyz", "presets"]) == 2
    assert "no_such_module_xyz" in capsys.readouterr().err
