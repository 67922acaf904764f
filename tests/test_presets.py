"""Every preset resolves to the config pinned in tests/data/presets.json, written from the tree
before the presets moved into their methods' modules and the loss settings (the image methods'
view augmentations included) into the `objective` section (issue 21). The file keeps the layout
of that time (those settings under `model`) and its form: a workdir's config.json held only the
`model` and `examples` keys that the preset set (`config`), beside which the pin holds those two
sections with every field (`model`, `examples`). The presets compare with it in that layout and
form (`pinned_form`), and the pinned configs, as workdirs of that time saved them, read through
`config_from_dict` into today's presets.

Regenerate only when a preset is meant to change: `python tests/test_presets.py`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.objectives import registry
from pretext_jax.pretrain.config import config_from_dict, make_config

PINNED = Path(__file__).resolve().parent / "data" / "presets.json"


def resolved(preset: str) -> dict[str, Any]:
    """The preset's config as a workdir saves it (every field of every section), as JSON
    values."""
    return json.loads(make_config(preset).to_json())


def pinned_form(preset: str) -> dict[str, Any]:
    """The preset as the pin holds it, in the layout before the `objective` section (its keys
    under `model`): the config with the `model` and `examples` keys the preset sets, as
    config.json then held them, beside those two sections with every field."""
    config = resolved(preset)
    declared = json.loads(json.dumps(registry.preset(preset)))
    model, examples = {**config["model"], **config.pop("objective")}, config["examples"]
    config["model"] = {**declared.get("model", {}), **declared.get("objective", {})}
    config["examples"] = declared.get("examples", {})
    return {"config": config, "model": model, "examples": examples}


@pytest.fixture(scope="module")
def pinned() -> dict[str, Any]:
    return json.loads(PINNED.read_text())


def test_the_presets_are_the_pinned_ones(pinned):
    assert registry.preset_names() == sorted(pinned)


@pytest.mark.parametrize("preset", registry.preset_names())
def test_preset_resolves_to_its_pinned_config(preset, pinned):
    assert pinned_form(preset) == pinned[preset]


@pytest.mark.parametrize("preset", registry.preset_names())
def test_pinned_config_in_the_old_layout_loads_as_the_preset(preset, pinned):
    """As config.json held it then (the keys the preset set), and with every field."""
    entry = pinned[preset]
    config = config_from_dict(entry["config"])
    assert config == make_config(preset)
    assert json.loads(config.to_json()) == resolved(preset)
    every_field = {**entry["config"], "model": entry["model"], "examples": entry["examples"]}
    assert config_from_dict(every_field) == config


@pytest.mark.parametrize("preset", registry.preset_names())
def test_preset_keeps_no_objective_setting_under_model(preset):
    """As declared, not as `config_from_dict` reads it (which moves such settings)."""
    tree = registry.preset(preset)
    assert registry.get(tree["method"]).split_model_section(tree.get("model", {}))[1] == {}


def test_a_preset_name_belongs_to_one_method():
    bert = registry.get("bert")
    clash = dataclasses.replace(bert, name="bert_again", presets={"bert_tiny": {}})
    with pytest.raises(ValueError, match="already declared by \\['bert'\\]"):
        registry.register(clash)
    assert "bert_again" not in registry.names()
    assert registry.preset("bert_tiny")["method"] == "bert"


if __name__ == "__main__":
    every = {name: pinned_form(name) for name in registry.preset_names()}
    PINNED.write_text(json.dumps(every, indent=1, sort_keys=True) + "\n")
