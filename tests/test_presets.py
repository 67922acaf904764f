"""Every preset resolves to the config pinned in tests/data/presets.json, written from the tree
before the presets moved into their methods' modules and the loss settings (the image methods'
view augmentations included) into the `objective` section (issue 21). The file keeps the layout
of that time (those settings under `model`): the presets compare with it in that layout
(`old_layout`), and the pinned configs, as workdirs of that time saved them, read through
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
    """The preset's config (as saved in a workdir) and its model, examples and objective configs
    with every field, as JSON values."""
    config = make_config(preset)
    return json.loads(json.dumps({
        "config": config.to_dict(),
        "model": dataclasses.asdict(config.model_config()),
        "examples": dataclasses.asdict(config.example_config()),
        "objective": dataclasses.asdict(config.objective_config()),
    }))


def old_layout(tree: dict[str, Any]) -> dict[str, Any]:
    """`resolved`'s tree in the layout before the `objective` section: its keys under `model`."""
    config = dict(tree["config"])
    config["model"] = {**config["model"], **config.pop("objective")}
    return {"config": config, "model": {**tree["model"], **tree["objective"]},
            "examples": tree["examples"]}


@pytest.fixture(scope="module")
def pinned() -> dict[str, Any]:
    return json.loads(PINNED.read_text())


def test_the_presets_are_the_pinned_ones(pinned):
    assert registry.preset_names() == sorted(pinned)


@pytest.mark.parametrize("preset", registry.preset_names())
def test_preset_resolves_to_its_pinned_config(preset, pinned):
    assert old_layout(resolved(preset)) == pinned[preset]


@pytest.mark.parametrize("preset", registry.preset_names())
def test_pinned_config_in_the_old_layout_loads_as_the_preset(preset, pinned):
    config = config_from_dict(pinned[preset]["config"])
    assert config == make_config(preset)
    assert json.loads(json.dumps(config.to_dict())) == resolved(preset)["config"]


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
    every = {name: old_layout(resolved(name)) for name in registry.preset_names()}
    PINNED.write_text(json.dumps(every, indent=1, sort_keys=True) + "\n")
