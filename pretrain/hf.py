"""HuggingFace interop: `load(path)` reads a transformers checkpoint folder into our model, and
`save(model, path)` writes one that transformers loads.

Public API:

- `load(path, **config_overrides)`: a HF folder (`config.json` + `model.safetensors`, a sharded
  `model.safetensors.index.json`, or `pytorch_model.bin`) -> our Flax NNX model; a folder of one
  sub-folder per part (a method's `Start.hf_parts`) -> the joint pre-training model.
- `save(model, path, tokenizer)`: our model -> `config.json` + `model.safetensors` (float32)
  and the tokenizer's HF files (`pretrain.hf_tokenizer`); a joint model -> one such folder per
  part.
- `from_hf(hf_config, state_dict, **config_overrides)` / `to_hf(model)`: the same conversions
  in memory, on a HF config dict and a flat HF state dict of numpy arrays.
- `method_name(model)`: the `objectives.registry` method a converted model belongs to
  (`registry.method_of_model`).

This module knows files only. The name tables (which HF tensor is which parameter of ours, and
the config mapping) are the model families' own, in `models/hf/<family>.py`, registered with
`models.hf.conversion`, which picks one by our model's class or by `config.json`'s `model_type` and
`architectures`.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.tokenizers import Tokenizer
from pretext_jax.models.hf import conversion  # noqa: F401  (hf_tables registers them)
from pretext_jax.models.hf import tables as hf_tables  # noqa: F401  (hf_tables registers them)
from pretext_jax.models.hf.conversion import from_hf, to_hf
from pretext_jax.objectives import registry
from pretext_jax.pretrain import hf_tokenizer
from pretext_jax.pretrain.directories import make_readable

__all__ = ["CONFIG_FILE", "MODEL_CARD", "from_hf", "load", "method_name", "save", "to_hf"]

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"

method_name = registry.method_of_model


# --- Files ---------------------------------------------------------------------------------------

def _read_state_dict(path: Path) -> dict[str, np.ndarray]:
    """The state dict of a HF folder: safetensors (single or sharded), else torch pickles."""
    from safetensors.numpy import load_file  # bfloat16 works: jax registers ml_dtypes

    if (path / SAFETENSORS_FILE).is_file():
        return load_file(path / SAFETENSORS_FILE)
    if (path / SAFETENSORS_INDEX).is_file():
        return {name: value for shard in _shards(path / SAFETENSORS_INDEX)
                for name, value in load_file(path / shard).items()}
    torch_files = ([TORCH_FILE] if (path / TORCH_FILE).is_file()
                   else _shards(path / TORCH_INDEX) if (path / TORCH_INDEX).is_file() else [])
    if not torch_files:
        raise UserError(f"{path} has no {SAFETENSORS_FILE} or {TORCH_FILE}; pass a "
                        "HuggingFace checkpoint folder with its weights")
    try:
        import torch
    except ImportError:
        raise UserError(f"{path / torch_files[0]} needs torch to read; install torch or convert "
                        f"the checkpoint to {SAFETENSORS_FILE}") from None
    state = {}
    for file in torch_files:
        tensors = torch.load(path / file, map_location="cpu", weights_only=True)
        state.update({name: t.float().numpy() for name, t in tensors.items()})
    return state


def _shards(index: Path) -> list[str]:
    return sorted(set(json.loads(index.read_text())["weight_map"].values()))


def load(path: str | Path, **config_overrides: Any) -> nnx.Module:
    """A HuggingFace folder (`config.json` + `model.safetensors`, sharded safetensors, or
    `pytorch_model.bin`, which needs torch) -> our model with its weights, in float32.

    `config_overrides` set fields of our config that HF does not have (`dtype`, `scan_layers`,
    `remat`) or replace mapped ones (e.g. `hidden_dropout`). Both pre-training class names
    (`*ForPreTraining`, with the base model's prefix) and bare base-model names (`*Model`) load;
    a checkpoint without the pooler or the pre-training heads leaves those at their initial
    values, with a warning naming them. HF's tied copies (e.g. the decoder tied to the word
    embeddings) are optional. Bad folders, unknown model types and mismatched shapes raise
    `UserError`.
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path} is not a directory; pass a HuggingFace checkpoint folder "
                        f"({CONFIG_FILE} + {SAFETENSORS_FILE})")
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        for method, part_names in registry.joint_methods().items():
            if all((path / name / CONFIG_FILE).is_file() for name in part_names):
                return _load_joint(path, method, part_names, config_overrides)
        raise UserError(f"{path} has no {CONFIG_FILE}; pass a HuggingFace checkpoint folder")
    try:
        hf_config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{config_file} is not valid JSON ({e}); fix or replace it") from None
    if not isinstance(hf_config, dict):
        raise UserError(f"{config_file} is not a JSON object; pass a HuggingFace config")
    converter, config = conversion.converter_and_config(hf_config, str(path), config_overrides)
    return conversion.build(converter, config, _read_state_dict(path), str(path))


def _load_joint(path: Path, joint_method: str, part_names: tuple[str, ...],
                overrides: Mapping[str, Any]) -> nnx.Module:
    """The joint pre-training model from its part folders (`part_names`, e.g. two released
    checkpoints saved side by side): the method's config class derives the joint config
    (`from_parts`), the model copies the parts' weights in (`load_parts`)."""
    parts = {name: load(path / name, **overrides) for name in part_names}
    method = registry.get(joint_method)
    try:
        config = method.model_config.from_parts(**{n: m.config for n, m in parts.items()})
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None
    model = nnx.eval_shape(lambda: method.build_model(config, 0))
    model.load_parts(**parts)
    return model


def _is_hf_checkpoint(path: Path) -> bool:
    try:
        return "model_type" in json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError, TypeError):
        return False


# Files of a HF checkpoint that `save` supersedes; anything else there stays (the tokenizer's
# files too, unless a tokenizer is saved).
_WEIGHT_FILES = (CONFIG_FILE, SAFETENSORS_FILE, SAFETENSORS_INDEX, TORCH_FILE, TORCH_INDEX,
                 "tf_model.h5", "flax_model.msgpack")
# The model card that `export.convert` writes beside the model (beside the parts of a joint one).
MODEL_CARD = "README.md"


def _superseded(name: str, tokenizer: bool) -> bool:
    return (name in _WEIGHT_FILES or (tokenizer and name in hf_tokenizer.FILES)
            or (name.startswith(("model-", "pytorch_model-"))
                and name.endswith((".safetensors", ".bin"))))


def _sibling(path: Path, kind: str) -> Path:
    """A fresh hidden name beside `path` (same file system, so renames are atomic)."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.{kind}")


def save(model: nnx.Module, path: str | Path, tokenizer: Tokenizer | None = None) -> Path:
    """Writes `config.json` + `model.safetensors` (float32) that transformers loads, e.g.
    `*ForPreTraining.from_pretrained(path)`, with no missing or unexpected keys, and with a
    `tokenizer` its HF files (`pretrain.hf_tokenizer`: `AutoTokenizer.from_pretrained(path)`
    gives its ids).

    `path` may be new, empty, or an existing HF checkpoint (its weights and config are replaced,
    other files such as the tokenizer's are kept unless a tokenizer is given). A joint model
    (one with `parts()`) is written as one checkpoint per part, `path/<part>`, each with the
    tokenizer, which `load` reads back. Any other non-empty folder is refused. The
    checkpoint is written into a temporary sibling folder and renamed into place, so a crash
    leaves either the old folder or the new one, never a half-written checkpoint. Files are
    0644 and folders 0755 (readable by others).
    """
    from safetensors.numpy import save_file

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{path} is a file; pass a directory to write the checkpoint into")
    parts = conversion.parts(model)
    if parts:
        others = ([p.name for p in path.glob("*") if p.name not in (*parts, MODEL_CARD)]
                  if path.is_dir() else [])
        if others:
            raise UserError(f"{path} holds {others[0]}, which is not one of the parts "
                            f"{sorted(parts)}; choose a new or empty output directory")
        for name, part in parts.items():
            save(part, path / name, tokenizer)
        path.chmod(0o755)
        return path
    existing = path.is_dir() and any(path.iterdir())
    if existing and not _is_hf_checkpoint(path):
        raise UserError(f"{path} is a non-empty folder that is not a HuggingFace checkpoint; "
                        "choose a new or empty output directory")
    hf_config, state = to_hf(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    stage = _sibling(path, "tmp")
    stage.mkdir()
    try:
        (stage / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
        save_file(state, stage / SAFETENSORS_FILE, metadata={"format": "pt"})
        if tokenizer is not None:
            if "vocab_size" not in hf_config:
                raise UserError(f"a {hf_config['model_type']} model has no vocabulary, so no "
                                "tokenizer; save it without one")
            hf_tokenizer.save(tokenizer, stage, hf_config["model_type"],
                              hf_config["vocab_size"])
        make_readable(stage)
        if not existing:
            if path.is_dir():
                path.rmdir()
            os.replace(stage, path)
            return path
        for item in path.iterdir():
            if not _superseded(item.name, tokenizer is not None):
                copy = shutil.copytree if item.is_dir() else shutil.copy2
                copy(item, stage / item.name)
        old = _sibling(path, "old")
        os.replace(path, old)
        os.replace(stage, path)
        shutil.rmtree(old)
        return path
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
