"""A resolved, typed run config: every section of a `Config` is a dataclass instance (the
method's `model`, `examples` and `objective` those it registers), the dict form is for files
only and reads back equal, configs written by earlier versions still load, and the method of a
config that names none is the registry's default."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.objectives import registry
from pretext_jax.pretrain.config import (
    Config,
    MeshConfig,
    OptimConfig,
    TrainConfig,
    config_from_dict,
    make_config,
)


@pytest.mark.parametrize("preset", registry.preset_names())
def test_every_section_is_a_dataclass_of_its_type(preset):
    config = make_config(preset)
    method = registry.get(config.method)
    assert {section: type(getattr(config, section)) for section in (
        "model", "examples", "objective", "data", "optim", "mesh", "train")} == {
        "model": method.model_config, "examples": method.example_config,
        "objective": method.objective_config, "data": DataConfig, "optim": OptimConfig,
        "mesh": MeshConfig, "train": TrainConfig}


@pytest.mark.parametrize("preset", registry.preset_names())
def test_the_dict_form_reads_back_equal(preset):
    config = make_config(preset)
    assert config_from_dict(config.to_dict()) == config
    assert config_from_dict(json.loads(config.to_json())) == config  # tuples as JSON lists
    for section in ("model", "examples", "objective"):  # every field, not only the preset's
        assert config.to_dict()[section] == dataclasses.asdict(getattr(config, section))


def test_an_old_config_dict_loads():
    """A loss setting under `model` (before the `objective` section) and fields missing (added
    since it was saved, so they take their defaults) read into today's config."""
    config = make_config("electra_tiny", ["objective.temperature=2.0"])
    old = config.to_dict()
    old["model"]["temperature"] = old["objective"].pop("temperature")
    defaults = {f.name: f.default for f in dataclasses.fields(config.model)}
    assert config.model.scan_layers == defaults["scan_layers"]
    del old["model"]["scan_layers"], old["optim"]["layerwise_lr_decay"]
    assert config_from_dict(old) == config
    assert config_from_dict({"method": "electra", "model": {"temperature": 2.0}}).objective == (
        dataclasses.replace(config.objective, temperature=2.0))


def test_a_section_of_another_type_is_refused():
    config = make_config("bert_tiny")
    with pytest.raises(TypeError, match="Config.model of method 'bert' must be EncoderConfig, "
                                        "not dict"):
        dataclasses.replace(config, model={"hidden_size": 32})
    with pytest.raises(TypeError, match="Config.examples of method 'gpt'"):
        dataclasses.replace(config, method="gpt", model=None, objective=None)
    assert Config(method="gpt").model == registry.get("gpt").model_config()


def test_an_invalid_method_section_is_a_user_error():
    with pytest.raises(UserError, match=r"invalid model config \(model\.\*\)"):
        config_from_dict({"method": "bert", "model": {"dtype": "float8"}})


def test_the_default_method_is_the_registrys(monkeypatch):
    assert registry.default_method() == "bert"
    assert Config().method == make_config(None).method == config_from_dict({}).method == "bert"
    monkeypatch.setattr(registry, "_default_method", "gpt")
    assert Config().method == make_config(None).method == config_from_dict({}).method == "gpt"
    assert type(Config().model) is registry.get("gpt").model_config


def test_no_default_method_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(registry, "_default_method", None)
    with pytest.raises(UserError, match="no default method is declared yet"):
        registry.default_method()
    with pytest.raises(UserError, match="import pretext_jax.objectives"):
        Config()
    assert config_from_dict({"method": "gpt"}).method == "gpt"  # a named method needs none


def test_one_registered_method_is_the_default():
    with pytest.raises(ValueError, match="'bert' is already the default"):
        registry.declare_default(registry.get("gpt"))
    stranger = dataclasses.replace(registry.get("gpt"), name="unregistered")
    with pytest.raises(ValueError, match="register method 'unregistered' before"):
        registry.declare_default(stranger)
    assert registry.declare_default(registry.get("bert")) is registry.get("bert")
