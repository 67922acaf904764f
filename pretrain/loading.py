"""Loading trained models back: `load_model` builds the Flax NNX model of a pretext workdir
(its latest checkpoint, verified first) or model directory (`pretrain.directories`), on this
process's first device whatever mesh wrote it; `load_pretrained` is what a run starts from, a
pretext directory's downstream model or a HuggingFace folder's model (`pretrain.hf`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.models import migration
from pretext_jax.models.encoder import keep_layers, kept_layers
from pretext_jax.objectives import registry
from pretext_jax.pretrain import hf, integrity
from pretext_jax.pretrain.directories import (
    MODEL_FILE,
    checkpoint_step,
    read_json_object,
    saved_layout,
)


def load_model(path: str | Path, *, downstream: bool = False, layers_to_keep: str = "",
               **choices: Any) -> nnx.Module:
    """The model of a pretext workdir (latest checkpoint) or model directory.

    `downstream=True` returns the part that fine-tuning starts from: ELECTRA's discriminator
    (its `downstream_model(**choices)`, e.g. SimCLR's `projection_layers`); models without
    such a method are returned whole. `layers_to_keep` (e.g. "0,2"; '' = all) prunes the
    encoder of models/encoder.py to those layers (LayerDrop, Fan et al. 2020 §4; fairseq
    `prune_state_dict`): the model holds only them, renumbered, and its config's `num_layers`
    is their count.
    """
    model = _load_pretraining_model(Path(path), layers_to_keep)
    if downstream and hasattr(model, "downstream_model"):
        return model.downstream_model(**choices)
    return model


def load_pretrained(path: str | Path, **choices: Any) -> nnx.Module:
    """What a run starts from (`objectives.registry.Method.pretrained`'s loader): the
    downstream model of a pretext workdir or model directory (`load_model`, with `choices` for
    its `downstream_model` and `layers_to_keep`), or the model of a HuggingFace folder
    (`hf.load`)."""
    path = Path(path)
    if (path / MODEL_FILE).is_file():
        return load_model(path, downstream=True, **choices)
    if choices.get("layers_to_keep"):
        raise UserError(f"{path} is a HuggingFace folder; pruning its layers (model.init_layers) "
                        f"takes a pretext model: run.py convert {path} DIR --to pretext, then "
                        "--init DIR")
    if choices:
        raise UserError(f"{path} is a HuggingFace folder; {sorted(choices)} choose parts of a "
                        "pretext model only")
    return hf.load(path)


def _load_pretraining_model(path: Path, layers_to_keep: str = "") -> nnx.Module:
    if not (path / MODEL_FILE).is_file():
        raise UserError(f"{path} is not a pretext workdir or model directory ({MODEL_FILE} "
                        "missing); pass the --workdir of a run or a converted model")
    if (path / "params").is_dir():
        rest = restore_on_one_device(path / "state") if (path / "state").is_dir() else None
        return _model_from_state(path, restore_on_one_device(path / "params"), rest,
                                 layers_to_keep)
    step = checkpoint_step(path)
    if step is None:
        raise UserError(f"{path} has no checkpoint yet; train first or pass another workdir")
    problem = integrity.verify(path / "checkpoints" / str(step))
    if problem:
        raise UserError(f"the latest checkpoint of {path} (step {step}) is damaged ({problem}); "
                        "resume the run (it sets damaged checkpoints aside) and load it again")
    restored = restore_on_one_device(path / "checkpoints" / str(step) / "state")
    return _model_from_state(path, restored["params"], restored.get("model_state"),
                             layers_to_keep)


def restore_on_one_device(directory: Path) -> Any:
    """An Orbax checkpoint onto this process's first device, whatever mesh wrote it (a model
    trained on 8 devices loads in a shell that has one)."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device),
        saved_layout(directory))
    return ocp.StandardCheckpointer().restore(directory.resolve(), target)


def _strip_values(tree: Any) -> Any:
    """Orbax restores nnx Variables as {'value': array}; the pure-dict form drops that level."""
    if isinstance(tree, dict):
        if set(tree) == {"value"}:
            return _strip_values(tree["value"])
        return {k: _strip_values(v) for k, v in tree.items()}
    return tree


def _model_from_state(directory: Path, pure_params: dict[str, Any],
                      pure_rest: dict[str, Any] | None, layers_to_keep: str = "") -> nnx.Module:
    """The model with these parameters and its other state (BatchNorm statistics, XLNet's
    memory); state that was not stored starts at zero. Parameters stored under the names of an
    earlier version are renamed (`models.migration`). `layers_to_keep`: see `load_model`."""
    info = read_json_object(directory / MODEL_FILE)
    method = registry.get(info["method"])
    # Written before the objective section existed, `model` may hold loss settings too.
    model_section = method.split_model_section(info["model"])[0]
    if layers_to_keep:
        if "layers_to_keep" not in {f.name for f in dataclasses.fields(method.model_config)}:
            raise UserError(f"{directory} holds a {info['method']} model; layers_to_keep "
                            "prunes the layers of models/encoder.py's encoder (BERT, RoBERTa, "
                            "ELECTRA, DistilBERT, ...) only")
        model_section = {**model_section, "layers_to_keep": layers_to_keep}
    try:
        model_config = method.model_config(**model_section)
    except ValueError as error:
        raise UserError(f"{directory}: {error}") from None
    keep = kept_layers(model_config) if layers_to_keep else ()
    if keep:
        model_config = dataclasses.replace(model_config, num_layers=len(keep), layers_to_keep="")
    model = nnx.eval_shape(lambda: method.build_model(model_config, 0))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    pure_params = migration.migrate(_strip_values(pure_params))
    if keep:
        try:
            pure_params = keep_layers(pure_params, keep)
        except ValueError as error:
            raise UserError(f"{directory}: {error}") from None
    nnx.replace_by_pure_dict(params, jax.tree.map(np.asarray, pure_params))
    rest = jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), rest)
    if pure_rest:
        nnx.replace_by_pure_dict(rest, jax.tree.map(np.asarray, _strip_values(pure_rest)))
    return nnx.merge(nnx.graphdef(model), params, rest)
