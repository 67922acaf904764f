"""Every preset resolves to the config pinned in tests/data/presets.json, written from the tree
before the presets moved into their methods' modules (issue 21). The file keeps the layout of
that time (loss settings under `model`), so it also checks that configs saved then still load:
read through `config_from_dict` it equals the preset resolved today.

Regenerate only when a preset is meant to change: `python tests/test_presets.py`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.objectives import registry
from pretext_jax.pretrain.config import make_config

PINNED = Path(__file__).resolve().parent / "data" / "presets.json"


def resolved(preset: str) -> dict[str, Any]:
    """The preset's config (as saved in a workdir) and its model and examples configs with every
    field, as JSON values."""
    config = make_config(preset)
    return json.loads(json.dumps({
        "config": config.to_dict(),
        "model": dataclasses.asdict(config.model_config()),
        "examples": dataclasses.asdict(config.example_config()),
    }))


@pytest.fixture(scope="module")
def pinned() -> dict[str, Any]:
    return json.loads(PINNED.read_text())


def test_the_presets_are_the_pinned_ones(pinned):
    assert registry.preset_names() == sorted(pinned)


@pytest.mark.parametrize("preset", registry.preset_names())
def test_preset_resolves_to_its_pinned_config(preset, pinned):
    assert resolved(preset) == pinned[preset]


def test_a_preset_name_belongs_to_one_method():
    bert = registry.get("bert")
    clash = dataclasses.replace(bert, name="bert_again", presets={"bert_tiny": {}})
    with pytest.raises(ValueError, match="already declared by \\['bert'\\]"):
        registry.register(clash)
    assert "bert_again" not in registry.names()
    assert registry.preset("bert_tiny")["method"] == "bert"


if __name__ == "__main__":
    every = {name: resolved(name) for name in registry.preset_names()}
    PINNED.write_text(json.dumps(every, indent=1, sort_keys=True) + "\n")
