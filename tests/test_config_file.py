"""`--config FILE`: YAML or a Python `get_config()`, layered preset < file < overrides; bad files
are one-line errors naming the file and the key; `run.py config --config F` shows the merge."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretext_jax import (
    objectives,  # noqa: F401  (registers the methods)
    run,
)
from pretext_jax.errors import UserError
from pretext_jax.objectives import registry
from pretext_jax.pretrain.config import make_config

EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"
YAML = """\
preset: bert_tiny
optim:
  learning_rate: 1e-4     # YAML reads this as a string; the float field parses it
  warmup_steps: 7
train:
  steps: 12
  batch_size: 16
"""
PYTHON = '''"""python run.py pretrain --config experiment.py --workdir runs/x"""


def get_config():
    return {"preset": "bert_tiny", "optim": {"learning_rate": 1e-4, "warmup_steps": 7},
            "train": {"steps": 12, "batch_size": 16}}
'''


@pytest.fixture(params=["yaml", "py"])
def config_file(request, tmp_path) -> Path:
    path = tmp_path / f"experiment.{request.param}"
    path.write_text(YAML if request.param == "yaml" else PYTHON)
    return path


def test_file_is_layered_over_its_preset_and_under_overrides(config_file):
    config = make_config(None, ["train.steps=5"], file=config_file)
    assert config.method == "bert"
    assert config.optim.learning_rate == 1e-4 and isinstance(config.optim.learning_rate, float)
    assert config.optim.warmup_steps == 7 and config.train.batch_size == 16
    assert config.train.steps == 5  # the override wins over the file
    tiny = registry.preset("bert_tiny")
    assert config.model.hidden_size == tiny["model"]["hidden_size"]  # from the preset
    assert config.train.log_every == tiny["train"]["log_every"]


def test_a_preset_on_the_command_line_replaces_the_files(tmp_path):
    path = tmp_path / "e.yaml"
    path.write_text("preset: bert_tiny\ntrain:\n  steps: 12\n")
    config = make_config("electra_tiny", [], file=path)
    assert config.method == "electra" and config.train.steps == 12


def test_a_file_without_preset_starts_from_the_defaults(tmp_path):
    path = tmp_path / "e.yaml"
    path.write_text("method: gpt\nmodel:\n  hidden_size: 32\n  num_layers: 1\n"
                    "  num_heads: 2\n  intermediate_size: 64\ntrain:\n  steps: 3\n")
    config = make_config(None, [], file=path)
    assert config.method == "gpt" and config.model.hidden_size == 32
    assert config.train.steps == 3 and config.optim.learning_rate == 1e-4  # the default


@pytest.mark.parametrize("name,text,message", [
    ("bad.yaml", "train: [1, 2\n", "not valid YAML"),
    ("list.yaml", "- 1\n- 2\n", "mapping of sections"),
    ("section.yaml", "trian:\n  steps: 3\n", "'trian'"),
    ("key.yaml", "preset: bert_tiny\ntrain:\n  stepz: 3\n", "train.stepz"),
    ("value.yaml", "preset: bert_tiny\ntrain:\n  steps: many\n", "train.steps"),
    ("type.yaml", "preset: bert_tiny\ntrain:\n  prefetch: 3\n", "train.prefetch"),
    ("flat.yaml", "train: 3\n", "section train"),
    ("model.yaml", "preset: bert_tiny\nmodel:\n  hidden_sise: 3\n", "model.hidden_sise"),
    ("none.py", "x = 1\n", "get_config"),
    ("list.py", "def get_config():\n    return [1]\n", "mapping of sections"),
    ("raises.py", "def get_config():\n    return 1 / 0\n", "ZeroDivisionError"),
    ("syntax.py", "def get_config(:\n", "SyntaxError"),
])
def test_bad_files_are_one_line_errors_naming_file_and_key(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(UserError) as error:
        make_config(None, [], file=path)
    assert str(path) in str(error.value) and message in str(error.value)
    assert "\n" not in str(error.value)


def test_missing_file_is_a_one_line_cli_error(tmp_path, capsys):
    code = run.main(["config", "--config", str(tmp_path / "nope.yaml")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "nope.yaml: no such file" in err and "\n" not in err


def test_config_command_shows_the_merged_result(config_file, capsys):
    assert run.main(["config", "--config", str(config_file), "train.steps=5"]) == 0
    out = capsys.readouterr().out
    assert "method=bert" in out and "optim.learning_rate=0.0001" in out
    assert "optim.warmup_steps=7" in out and "train.steps=5" in out
    assert "train.batch_size=16" in out


@pytest.mark.parametrize("name", ["experiment.yaml", "experiment.py"])
def test_documented_examples_load_alike(name):
    config = make_config(None, [], file=EXAMPLES / name)
    assert config == make_config(None, [], file=EXAMPLES / "experiment.yaml")
    assert config.train.steps == 300 and config.optim.learning_rate == 1e-3
