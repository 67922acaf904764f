"""Integrity under faults (issue 19): damaged metric files, numbers out of range, CLI flags."""

from __future__ import annotations

import json

import pytest

import objectives  # noqa: F401  (registers the methods)
import run
from input_pipeline.errors import UserError
from pretrain.config import RANGES, make_config
from pretrain.metrics import read_rows, truncate_after


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
])
def test_numbers_out_of_range_are_refused_naming_the_range(override, message):
    with pytest.raises(UserError) as error:
        make_config("bert_tiny", [override])
    assert override.split("=")[0] in str(error.value) and message in str(error.value)


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
