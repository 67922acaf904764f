"""`run.py config` documents every key: each field of the data, optim, mesh and train sections
and of a method's model, examples and objective config has an attribute docstring
(`pretrain.config.field_docs`)."""

from __future__ import annotations

import dataclasses

import pytest

from pretext_jax import (
    objectives,  # noqa: F401  (registers the methods)
    run,
)
from pretext_jax.objectives import registry
from pretext_jax.pretrain.config import Config, describe, make_config

SECTIONS = tuple(f"  {name}." for name in ("data", "optim", "mesh", "train", "model",
                                             "examples", "objective"))


def undocumented(text: str) -> list[str]:
    """The keys of a `describe` listing whose doc line (the line after the key) says
    "undocumented" or is missing."""
    lines = text.splitlines()
    missing = []
    for index, line in enumerate(lines):
        if not line.startswith(SECTIONS):
            continue
        doc = lines[index + 1] if index + 1 < len(lines) else ""
        if not doc.startswith("      ") or doc.strip() in ("", "undocumented"):
            missing.append(line.strip())
    return missing


def listed_keys(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(SECTIONS)]


@pytest.mark.parametrize("method", registry.names())
def test_every_method_field_is_documented(method):
    # The class defaults, without make_config's cross-field checks (`method=xlnet` alone is
    # refused: model.reuse_len 0 differs from examples.reuse_len 256).
    text = describe(Config(method=method))
    loss_settings = dataclasses.fields(registry.get(method).objective_config)
    assert {line.split(".")[0].strip() for line in listed_keys(text)} == {
        "data", "optim", "mesh", "train", "model", "examples",
        *(["objective"] if loss_settings else [])}, method
    assert undocumented(text) == [], f"{method}: fields without an attribute docstring"


@pytest.mark.parametrize("preset", registry.preset_names())
def test_every_preset_field_is_documented(preset):
    text = describe(make_config(preset))
    assert listed_keys(text)
    assert undocumented(text) == [], f"preset {preset}: fields without an attribute docstring"


def test_undocumented_is_detected():
    text = "\n".join(["[model]  x.Y", "  model.a=1", "      A doc.", "  model.b=2",
                      "      undocumented", "  examples.c=3"])
    assert undocumented(text) == ["model.b=2", "examples.c=3"]


def test_run_config_prints_value_and_default(capsys):
    assert run.main(["config", "--preset", "bert_tiny", "train.steps=5"]) == 0
    out = capsys.readouterr().out
    assert "  train.steps=5  (default 1000)" in out.splitlines()
    assert "  model.hidden_size=64  (default 768)" in out.splitlines()
    assert undocumented(out) == []


def test_run_config_shows_the_objective_section(capsys):
    assert run.main(["config", "--preset", "electra_tiny", "objective.temperature=2.0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "[objective]  pretext_jax.objectives.electra.ElectraLossSettings" in lines
    assert "  objective.temperature=2.0  (default 1.0)" in lines
    assert "  objective.discriminator_weight=50.0" in lines
    assert not any(line.startswith("  model.temperature") for line in lines)
