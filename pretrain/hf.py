"""HuggingFace interop: `load(path)` reads a transformers checkpoint folder into our model, and
`save(model, path)` writes one that transformers loads.

Public API:

- `load(path, **config_overrides)`: a HF folder (`config.json` + `model.safetensors`, a sharded
  `model.safetensors.index.json`, or `pytorch_model.bin`) -> our Flax NNX model; a folder of one
  sub-folder per part (a method's `Start.hf_parts`) -> the joint pre-training model. `read`
  also gives the paths of the parameters the folder lacked, `source_of` its name and licence,
  `is_checkpoint` whether a folder holds one.
- `save(model, path, tokenizer)`: our model -> `config.json` + `model.safetensors` (float32)
  and the tokenizer's HF files (`pretrain.hf_tokenizer`); a joint model -> one such folder per
  part. `checkpoints` + `write` are its two halves: the conversion in memory (leaving out
  parameters never trained) and the files, all or nothing, with a model card.
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

import contextlib
import dataclasses
import json
import shutil
from collections.abc import Collection, Mapping
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
from pretext_jax.pretrain.directories import is_leftover, staged, step_written

__all__ = ["CONFIG_FILE", "MODEL_CARD", "Checkpoint", "checkpoints", "from_hf", "is_checkpoint",
           "load", "method_name", "read", "save", "source_of", "to_hf", "write"]

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
    """`read`'s model."""
    return read(path, **config_overrides)[0]


def read(path: str | Path, **config_overrides: Any) -> tuple[nnx.Module, list[str]]:
    """A HuggingFace folder (`config.json` + `model.safetensors`, sharded safetensors, or
    `pytorch_model.bin`, which needs torch) -> our model with its weights, in float32.

    `config_overrides` set fields of our config that HF does not have (`dtype`, `scan_layers`,
    `remat`) or replace mapped ones (e.g. `hidden_dropout`). Both pre-training class names
    (`*ForPreTraining`, with the base model's prefix) and bare base-model names (`*Model`) load;
    a checkpoint without the pooler or the pre-training heads leaves those at their initial
    values, with a warning naming them, and their paths are returned beside the model (they
    hold no trained weights). HF's tied copies (e.g. the decoder tied to the word
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
                overrides: Mapping[str, Any]) -> tuple[nnx.Module, list[str]]:
    """The joint pre-training model from its part folders (`part_names`, e.g. two released
    checkpoints saved side by side): the method's config class derives the joint config
    (`from_parts`), the model copies the parts' weights in (`load_parts`)."""
    parts = {name: read(path / name, **overrides) for name in part_names}
    method = registry.get(joint_method)
    try:
        config = method.model_config.from_parts(**{n: m.config for n, (m, _) in parts.items()})
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None
    model = nnx.eval_shape(lambda: method.build_model(config, 0))
    model.load_parts(**{name: part for name, (part, _) in parts.items()})
    paths = conversion.part_paths(model)
    return model, sorted({paths[name][path] for name, (_, lacking) in parts.items()
                          for path in lacking})


def source_of(path: str | Path) -> dict[str, str]:
    """Where a HF folder comes from, as its files say: `name` (the hub id of a hub-cache
    snapshot, `models--<org>--<name>/snapshots/<hash>`, else its model card's title, else the
    folder's name), `license` (the card's front matter; absent when it states none) and
    `folder` (absolute)."""
    import yaml

    path = Path(path).resolve()
    text = (path / MODEL_CARD).read_text(errors="replace") if (path / MODEL_CARD).is_file() else ""
    front: Any = {}
    end = text.find("\n---", 3) if text.startswith("---") else -1
    if end > 0:
        with contextlib.suppress(yaml.YAMLError):
            front = yaml.safe_load(text[3:end])
        text = text[end + 4:]
    front = front if isinstance(front, dict) else {}
    hub = next((part.removeprefix("models--").replace("--", "/") for part in path.parts
                if part.startswith("models--")), None)
    title = next((line[2:].strip() for line in text.splitlines() if line.startswith("# ")), None)
    found = {"name": hub or title or path.name, "folder": str(path)}
    licence = front.get("license_name" if front.get("license") == "other" else "license")
    if licence:
        found["license"] = str(licence)
    return found


def is_checkpoint(path: str | Path) -> bool:
    """Whether `path` holds a HuggingFace checkpoint (a `config.json` with a `model_type`)."""
    try:
        return "model_type" in json.loads((Path(path) / CONFIG_FILE).read_text())
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


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One HF checkpoint folder's content: `config` (config.json), `state` (the tensors) and
    `left_out`, the parts (HF names) not written because they were never trained."""

    config: dict[str, Any]
    state: dict[str, np.ndarray]
    left_out: tuple[str, ...] = ()


def checkpoints(model: nnx.Module, untrained: Collection[str] = ()) -> dict[str, Checkpoint]:
    """`model` as HF checkpoints, by part name for a joint model (its `parts()`), else one
    named "". Parameters at the paths `untrained` (of `model`: neither trained nor imported) are
    left out (`to_hf`). What HF cannot hold is refused here, before anything is written."""
    if getattr(getattr(model, "config", None), "adapter_size", 0):
        raise UserError("HF's Bert/Electra/Roberta models have no adapter layers: a model with "
                        "model.adapter_size > 0 cannot be exported to HF; keep it in pretext form")
    parts = conversion.parts(model) or {"": model}
    found = {}
    for name, paths in conversion.part_paths(model).items():
        leave_out = {path for path, in_model in paths.items() if in_model in untrained}
        config, state = to_hf(parts[name], leave_out)
        converter = conversion.converter_for(parts[name])
        left_out = [t.hf for t in converter.tensors(parts[name].config) if t.ours in leave_out]
        found[name] = Checkpoint(config, state, tuple(converter.part_names(left_out)))
    return found


def _check_output(path: Path, parts: Collection[str], tokenizer: Tokenizer | None,
                  configs: Collection[dict[str, Any]]) -> None:
    """Refuses what `write` cannot do, before it writes anything: an output that is a file,
    or a non-empty folder other than a HF checkpoint (for a joint model: a folder of its part
    checkpoints and a model card), or a tokenizer that is not the model's."""
    if path.exists() and not path.is_dir():
        raise UserError(f"{path} is a file; pass a directory to write the checkpoint into")
    folders = [path] if parts == {""} else [path / name for name in parts]
    if path.is_dir() and parts != {""}:
        others = [p.name for p in path.iterdir() if p.name not in (*parts, MODEL_CARD)
                  and not any(is_leftover(p.name, name) for name in parts)]
        if others:
            raise UserError(f"{path} holds {others[0]}, which is not one of the parts "
                            f"{sorted(parts)}; choose a new or empty output directory")
    for folder in folders:
        if folder.exists() and not folder.is_dir():
            raise UserError(f"{folder} is a file; pass a directory to write the checkpoint into")
        if folder.is_dir() and any(folder.iterdir()) and not is_checkpoint(folder):
            raise UserError(f"{folder} is a non-empty folder that is not a HuggingFace "
                            "checkpoint; choose a new or empty output directory")
    for config in configs if tokenizer is not None else ():
        if "vocab_size" not in config:
            raise UserError(f"a {config['model_type']} model has no vocabulary, so no "
                            "tokenizer; save it without one")
        hf_tokenizer.check(tokenizer, config["model_type"], config["vocab_size"])


def write(parts: Mapping[str, Checkpoint], path: str | Path, tokenizer: Tokenizer | None = None,
          card: str | None = None) -> Path:
    """Writes the `checkpoints` `parts` into `path` (a joint model's as `path/<part>`), each with
    `config.json`, `model.safetensors` and the tokenizer's HF files, and `card` as
    `path/README.md`: all or nothing (`directories.staged`: one staging folder renamed into
    place last, so a kill at any moment leaves the old output or the new one, or none).

    `path` may be new, empty, or an existing HF checkpoint (of each part, for a joint model):
    its weights and config are replaced, its other files (the tokenizer's, unless a tokenizer
    is given) kept. Anything else is refused (`_check_output`) before a file is written. Files
    are 0644 and folders 0755 (readable by others).
    """
    from safetensors.numpy import save_file

    path = Path(path)
    _check_output(path, set(parts), tokenizer, [c.config for c in parts.values()])
    with staged(path) as stage:
        kept = [(path, stage)] if set(parts) == {""} else [(path / n, stage / n) for n in parts]
        for old, new in kept:
            new.mkdir(exist_ok=True)
            for item in old.iterdir() if old.is_dir() else ():
                if not _superseded(item.name, tokenizer is not None):
                    copy = shutil.copytree if item.is_dir() else shutil.copy2
                    copy(item, new / item.name)
        if set(parts) != {""} and card is None and (path / MODEL_CARD).is_file():
            shutil.copy2(path / MODEL_CARD, stage / MODEL_CARD)
        for name, checkpoint in parts.items():
            folder = stage / name
            (folder / CONFIG_FILE).write_text(json.dumps(checkpoint.config, indent=2) + "\n")
            step_written()
            save_file(checkpoint.state, folder / SAFETENSORS_FILE, metadata={"format": "pt"})
            step_written()
            if tokenizer is not None:
                hf_tokenizer.save(tokenizer, folder, checkpoint.config["model_type"],
                                  checkpoint.config["vocab_size"])
                step_written()
        if card is not None:
            (stage / MODEL_CARD).write_text(card)
            step_written()
    return path


def save(model: nnx.Module, path: str | Path, tokenizer: Tokenizer | None = None) -> Path:
    """Writes `model` as a HF checkpoint that transformers loads, e.g.
    `*ForPreTraining.from_pretrained(path)`, with no missing or unexpected keys (a joint model,
    one with `parts()`, as one checkpoint per part, `path/<part>`, which `load` reads back), and
    with a `tokenizer` its HF files (`pretrain.hf_tokenizer`: `AutoTokenizer.from_pretrained`
    gives its ids); see `write`."""
    return write(checkpoints(model), path, tokenizer)
