"""Loading trained models back, and conversion between pretext and HuggingFace directories.

A pretext *model directory* holds `model.json` (method + resolved model config; a workdir's also
the resolved objective settings, for the record), `params/`
(an Orbax checkpoint of the parameters), `state/` for models with other state (BatchNorm
statistics) and `tokenizer/` for text models (the files `load_tokenizer` reads). A pretext
*workdir* holds the same `model.json` and `tokenizer/` and training checkpoints; `load_model`
takes either and returns the Flax NNX model, `find_tokenizer` its tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import prepare
from pretext_jax.input_pipeline.tokenizers import Tokenizer, load_tokenizer
from pretext_jax.models import migration
from pretext_jax.objectives import registry
from pretext_jax.pretrain import integrity

MODEL_FILE = "model.json"
TOKENIZER_DIR = "tokenizer"
CONFIG_FILE = "config.json"  # a workdir's run config (pretrain.trainer)


def write_model_json(directory: Path, method: str, model_config: Any,
                     objective: Any = None) -> None:
    info = {"method": method, "model": dataclasses.asdict(model_config)}
    if objective is not None and dataclasses.fields(objective):
        info["objective"] = dataclasses.asdict(objective)
    (directory / MODEL_FILE).write_text(json.dumps(info, indent=2))


def make_readable(root: Path) -> None:
    """Files 0644 and folders 0755 under `root` and itself (Orbax and tempfile make some 0600 /
    0700), so that a model written for others can be read by them."""
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)


def write_tokenizer(directory: Path, tokenizer: Tokenizer) -> None:
    """Records `tokenizer` in `directory/tokenizer/` (the files `load_tokenizer` reads back as
    it), unless one is recorded already; written under a temporary name, then renamed."""
    target = directory / TOKENIZER_DIR
    if target.exists():
        return
    stage = directory / f".{TOKENIZER_DIR}.{uuid.uuid4().hex[:12]}.tmp"
    stage.mkdir()
    try:
        tokenizer.save(stage)
        make_readable(stage)
        os.replace(stage, target)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def find_tokenizer(path: str | Path) -> str | None:
    """The tokenizer of a pretext workdir or model directory: its `tokenizer/` folder; for a
    workdir from before tokenizers were recorded, its config's `data.tokenizer`, else the
    sentencepiece model trained into its data cache if there is exactly one. None otherwise."""
    path = Path(path)
    if (path / TOKENIZER_DIR).is_dir():
        return str(path / TOKENIZER_DIR)
    if not (path / CONFIG_FILE).is_file():
        return None
    data = read_json_object(path / CONFIG_FILE).get("data", {})
    if data.get("tokenizer"):
        return data["tokenizer"]
    trained = prepare.trained_tokenizers(Path(data.get("cache_dir") or path / "data"))
    return str(trained[0]) if len(trained) == 1 else None


def read_json_object(path: Path) -> dict[str, Any]:
    """A workdir's JSON file (config.json, model.json) as a dict, or a one-line UserError."""
    try:
        value = json.loads(path.read_text())
        if not isinstance(value, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as error:
        raise UserError(f"{path} is not readable ({str(error)[:80]}); restore it (every "
                        "checkpoint holds a copy of the config under config/) or use a new "
                        "--workdir") from None
    return value


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
    memory); state that was not stored starts at zero. Parameters stored under the names of an
    earlier version are renamed (`models.migration`)."""
    info = read_json_object(directory / MODEL_FILE)
    method = registry.get(info["method"])
    # Written before the objective section existed, `model` may hold loss settings too.
    model_config = method.model_config(**method.split_model_section(info["model"])[0])
    model = nnx.eval_shape(lambda: method.build_model(model_config, 0))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    pure_params = migration.migrate(_strip_values(pure_params))
    nnx.replace_by_pure_dict(params, jax.tree.map(np.asarray, pure_params))
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


def load_pretrained(path: str | Path) -> nnx.Module:
    """What a run starts from (`objectives.registry.Start.pretrained`'s loader): the
    downstream model of a pretext workdir or model directory (`load_model`), or the model of
    a HuggingFace folder (`hf.load`)."""
    from pretext_jax.pretrain import hf

    path = Path(path)
    return load_model(path, downstream=True) if (path / MODEL_FILE).is_file() else hf.load(path)


def _load_pretraining_model(path: Path) -> nnx.Module:
    if not (path / MODEL_FILE).is_file():
        raise UserError(f"{path} is not a pretext workdir or model directory ({MODEL_FILE} "
                        "missing); pass the --workdir of a run or a converted model")
    if (path / "params").is_dir():
        rest = _restore_on_one_device(path / "state") if (path / "state").is_dir() else None
        return _model_from_state(path, _restore_on_one_device(path / "params"), rest)
    step = checkpoint_step(path)
    if step is None:
        raise UserError(f"{path} has no checkpoint yet; train first or pass another workdir")
    problem = integrity.verify(path / "checkpoints" / str(step))
    if problem:
        raise UserError(f"the latest checkpoint of {path} (step {step}) is damaged ({problem}); "
                        "resume the run (it sets damaged checkpoints aside) and load it again")
    restored = _restore_on_one_device(path / "checkpoints" / str(step) / "state")
    return _model_from_state(path, restored["params"], restored.get("model_state"))


def checkpoint_step(workdir: Path) -> int | None:
    """The step of a workdir's latest checkpoint (None: none yet)."""
    manager = ocp.CheckpointManager((workdir / "checkpoints").resolve())
    step = manager.latest_step()
    manager.close()
    return step


def _restore_on_one_device(directory: Path) -> Any:
    """An Orbax checkpoint onto this process's first device, whatever mesh wrote it (a model
    trained on 8 devices loads in a shell that has one)."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device),
        saved_layout(directory))
    return ocp.StandardCheckpointer().restore(directory.resolve(), target)


def saved_layout(directory: Path) -> Any:
    """The tree an Orbax item folder (e.g. `<step>/state`) holds, as nested dicts and lists of
    array metadata (shape, dtype), read without loading any array."""
    # An item folder has no step-level `_CHECKPOINT_METADATA`; Orbax logs a warning about it on
    # every load that says nothing wrong.
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        metadata = ocp.StandardCheckpointer().metadata(directory.resolve())
    finally:
        absl_logger.setLevel(level)
    metadata = getattr(metadata, "item_metadata", metadata)
    return getattr(metadata, "tree", metadata)


def save_model(model: nnx.Module, method: str, path: str | Path,
               tokenizer: Tokenizer | None = None) -> Path:
    """Writes a pretext model directory: `model.json`, `params/`, when the model has any
    `state/` (BatchNorm statistics, memory), and `tokenizer/` when one is given. Refuses to
    overwrite a non-empty folder. Files are 0644 and folders 0755 (readable by others)."""
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
    if tokenizer is not None:
        write_tokenizer(tmp, tokenizer)
    make_readable(tmp)
    if path.exists():
        path.rmdir()
    tmp.rename(path)
    return path


def convert(source: str | Path, target: str | Path, *, to: str,
            tokenizer: str | None = None) -> Path:
    """`to="hf"`: pretext workdir or model dir -> HuggingFace directory (ELECTRA: one folder per
    part, `discriminator/` and `generator/`) with the tokenizer's HF files (`find_tokenizer`'s,
    or the `tokenizer` spec given) and a model card, `README.md`; `to="pretext"`: back, with
    the HF folder's tokenizer when pretext reads it (or the `tokenizer` given)."""
    from pretext_jax.pretrain import hf

    source, target = Path(source), Path(target)
    if to == "hf":
        model = load_model(source)
        found = _export_tokenizer(source, target, model, tokenizer)
        hf.save(model, target, found)
        card = target / hf.MODEL_CARD
        card.write_text(model_card(source, target, model, found))
        card.chmod(0o644)
        return target
    model = hf.load(source)
    return save_model(model, hf.method_name(model), target,
                      _hf_tokenizer(source, target, model, tokenizer))


def _has_vocabulary(model: nnx.Module) -> bool:
    """Text models have one (and a tokenizer); image models do not."""
    return getattr(model.config, "vocab_size", None) is not None


def _export_tokenizer(source: Path, target: Path, model: nnx.Module,
                      spec: str | None) -> Tokenizer | None:
    """The tokenizer to export with `model`: none for models without a vocabulary (images);
    else `spec` or the recorded one, and when there is none a line saying so."""
    if not _has_vocabulary(model):
        return None
    spec = spec or find_tokenizer(source)
    if spec is None:
        print(f"no tokenizer recorded in {source} (nor exactly one in its data cache), so "
              f"{target} has none; rerun with --tokenizer PATH to add the run's tokenizer")
        return None
    return load_tokenizer(spec)


def _hf_tokenizer(source: Path, target: Path, model: nnx.Module,
                  spec: str | None) -> Tokenizer | None:
    """The tokenizer of a HF folder's text model: `spec`, else the folder's (or its first part
    folder's) when pretext reads it, else none and a line saying so."""

    if not _has_vocabulary(model):
        return None
    if spec:
        return load_tokenizer(spec)
    parts = [source / name for names in registry.joint_methods().values() for name in names]
    for folder in (source, *parts):
        try:
            return load_tokenizer(folder)
        except UserError:
            continue
    print(f"no tokenizer that pretext reads in {source}, so {target} has none; rerun with "
          "--tokenizer PATH to add one")
    return None


# HF config entries that describe a model's size, in the order a model card lists them.
SIZE_KEYS = ("hidden_size", "d_model", "n_embd", "embedding_size", "num_hidden_layers",
             "num_layers", "n_layer", "num_attention_heads", "num_heads", "n_head",
             "intermediate_size", "d_ff", "d_inner", "vocab_size", "max_position_embeddings",
             "n_positions", "depths", "hidden_sizes")


def model_card(source: Path, target: Path, model: nnx.Module,
               tokenizer: Tokenizer | None) -> str:
    """The `README.md` of a HF export: method, architecture and size, data, tokenizer, steps
    trained and the latest held-out evaluation, all read from the workdir (a model directory
    records no training details)."""
    from pretext_jax.pretrain import hf, hf_tokenizer
    from pretext_jax.pretrain.metrics import METRICS_FILE

    method = read_json_object(source / MODEL_FILE)["method"]
    params = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    folders = ([target] if (target / hf.CONFIG_FILE).is_file()
               else sorted(p.parent for p in target.glob(f"*/{hf.CONFIG_FILE}")))
    lines = [f"# {target.name}", "", f"A `{method}` model trained with pretext, converted from "
             f"`{source}` by `run.py convert --to hf`.", "", f"- Method: `{method}`"]
    usage = ["", "```python", "import transformers", ""]
    if tokenizer is not None:
        usage.append(f'tokenizer = transformers.AutoTokenizer.from_pretrained("{folders[0]}")')
    for folder in folders:
        config = json.loads((folder / hf.CONFIG_FILE).read_text())
        architecture = config["architectures"][0]
        part = "" if folder == target else f"`{folder.name}/`: "
        sizes = ", ".join(f"{key} {config[key]}" for key in SIZE_KEYS if key in config)
        lines.append(f"- Model: {part}`{architecture}` ({sizes})")
        usage.append(f"{'model' if folder == target else folder.name} = "
                     f'transformers.{architecture}.from_pretrained("{folder}")')
    lines.append(f"- Parameters: {params:,}")
    run = read_json_object(source / CONFIG_FILE) if (source / CONFIG_FILE).is_file() else None
    step = checkpoint_step(source) if (source / "checkpoints").is_dir() else None
    if run is not None:
        data = run["data"]
        held_out = (f"held-out text `{data['eval_source']}`" if data.get("eval_source") else
                    f"{data['held_out_fraction']:.0%} of its documents held out")
        lines.append(f"- Data: `{data['source']}`, {held_out}")
    lines.append("- Tokenizer: " + (hf_tokenizer.describe(tokenizer) if tokenizer else "none"))
    if run is not None and step is not None:
        train = run["train"]
        lines.append(f"- Training: {step:,} steps (of {train['steps']:,} configured), batch "
                     f"{train['batch_size']:,}, seed {train['seed']}")
    else:
        lines.append("- Training: not recorded (converted from a pretext model directory)")
    rows = []
    if (source / METRICS_FILE).is_file():
        rows = [json.loads(line) for line in (source / METRICS_FILE).read_text().splitlines()
                if line.strip()]
    evaluations = [row for row in rows if row.get("split") == "eval"
                   and (step is None or row["step"] <= step)]
    if evaluations:
        last = evaluations[-1]
        values = ", ".join(f"{key} {value:.4g}" for key, value in last.items()
                           if key not in ("step", "split"))
        lines.append(f"- Held-out evaluation at step {last['step']:,}: {values}")
    else:
        lines.append("- Held-out evaluation: none recorded")
    return "\n".join([*lines, *usage, "```", ""])
