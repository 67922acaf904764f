"""Loading trained models back, and conversion between pretext and HuggingFace directories.

A pretext *model directory* holds `model.json` (method + resolved model config), `params/`
(an Orbax checkpoint of the parameters) and `state/` for models with other state (BatchNorm
statistics). A pretext *workdir* holds the same `model.json` and
training checkpoints; `load_model` takes either and returns the Flax NNX model.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from input_pipeline.errors import UserError
from objectives import registry

MODEL_FILE = "model.json"


def write_model_json(directory: Path, method: str, model_config: Any) -> None:
    (directory / MODEL_FILE).write_text(json.dumps(
        {"method": method, "model": dataclasses.asdict(model_config)}, indent=2))


def _strip_values(tree: Any) -> Any:
    """Orbax restores nnx Variables as {'value': array}; the pure-dict form drops that level."""
    if isinstance(tree, dict):
        if set(tree) == {"value"}:
            return _strip_values(tree["value"])
        return {k: _strip_values(v) for k, v in tree.items()}
    return tree


def _model_from_state(directory: Path, pure_params: dict[str, Any],
                      pure_rest: dict[str, Any] | None) -> nnx.Module:
    """The model with these parameters and its other state (BatchNorm statistics, XLNet's
    memory); state that was not stored starts at zero."""
    info = json.loads((directory / MODEL_FILE).read_text())
    method = registry.get(info["method"])
    model = nnx.eval_shape(lambda: method.build_model(method.model_config(**info["model"]), 0))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    nnx.replace_by_pure_dict(params, jax.tree.map(np.asarray, _strip_values(pure_params)))
    rest = jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), rest)
    if pure_rest:
        nnx.replace_by_pure_dict(rest, jax.tree.map(np.asarray, _strip_values(pure_rest)))
    return nnx.merge(nnx.graphdef(model), params, rest)


def load_model(path: str | Path, *, downstream: bool = False) -> nnx.Module:
    """The model of a pretext workdir (latest checkpoint) or model directory.

    `downstream=True` returns the part that fine-tuning starts from: ELECTRA's discriminator
    (its `downstream_model()`); models without such a method are returned whole.
    """
    model = _load_pretraining_model(Path(path))
    if downstream and hasattr(model, "downstream_model"):
        return model.downstream_model()
    return model


def _load_pretraining_model(path: Path) -> nnx.Module:
    if not (path / MODEL_FILE).is_file():
        raise UserError(f"{path} is not a pretext workdir or model directory ({MODEL_FILE} "
                        "missing); pass the --workdir of a run or a converted model")
    if (path / "params").is_dir():
        rest = _restore_on_one_device(path / "state") if (path / "state").is_dir() else None
        return _model_from_state(path, _restore_on_one_device(path / "params"), rest)
    manager = ocp.CheckpointManager((path / "checkpoints").resolve())
    step = manager.latest_step()
    manager.close()
    if step is None:
        raise UserError(f"{path} has no checkpoint yet; train first or pass another workdir")
    restored = _restore_on_one_device(path / "checkpoints" / str(step) / "state")
    return _model_from_state(path, restored["params"], restored.get("model_state"))


def _restore_on_one_device(directory: Path) -> Any:
    """An Orbax checkpoint onto this process's first device, whatever mesh wrote it (a model
    trained on 8 devices loads in a shell that has one)."""
    checkpointer = ocp.StandardCheckpointer()
    directory = directory.resolve()
    metadata = checkpointer.metadata(directory)
    metadata = getattr(metadata, "item_metadata", metadata)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device), metadata)
    return checkpointer.restore(directory, target)


def save_model(model: nnx.Module, method: str, path: str | Path) -> Path:
    """Writes a pretext model directory: `model.json`, `params/` and, when the model has any,
    `state/` (BatchNorm statistics, memory). Refuses to overwrite a non-empty folder."""
    path = Path(path)
    if path.exists() and any(path.iterdir()):
        raise UserError(f"{path} exists and is not empty; choose a new output directory")
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_model_json(tmp, method, model.config)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((tmp / "params").resolve(), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    rest = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))
    if jax.tree.leaves(rest):
        checkpointer.wait_until_finished()
        checkpointer.save((tmp / "state").resolve(), rest)
    checkpointer.wait_until_finished()
    if path.exists():
        path.rmdir()
    tmp.rename(path)
    return path


def convert(source: str | Path, target: str | Path, *, to: str) -> Path:
    """`to="hf"`: pretext workdir or model dir -> HuggingFace directory (ELECTRA: one folder per
    part, `discriminator/` and `generator/`); `to="pretext"`: back."""
    from pretrain import hf

    if to == "hf":
        hf.save(load_model(source), target)
        return Path(target)
    model = hf.load(source)
    return save_model(model, hf.method_name(model), target)
