"""Writing pretext model directories (`save_model`) and converting between them and
HuggingFace folders (`convert`, with the tokenizer's HF files and a model card).

The files of workdirs and model directories are `pretrain.directories`'; loading them back into
a model is `pretrain.loading`'s. Every output is written whole or not at all
(`directories.staged`), after everything that can refuse it has been checked.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.tokenizers import Tokenizer, load_tokenizer
from pretext_jax.objectives import registry
from pretext_jax.pretrain import hf, hf_tokenizer
from pretext_jax.pretrain.directories import (
    CONFIG_FILE,
    MODEL_FILE,
    SOURCE_KEY,
    checkpoint_step,
    find_tokenizer,
    read_json_object,
    staged,
    step_written,
    write_model_json,
    write_tokenizer,
)
from pretext_jax.pretrain.loading import load_model
from pretext_jax.pretrain.metrics import METRICS_FILE


def save_model(model: nnx.Module, method: str, path: str | Path,
               tokenizer: Tokenizer | None = None, source: dict[str, Any] | None = None
               ) -> Path:
    """Writes a pretext model directory: `model.json` (with `source`, for a model converted
    from elsewhere: `write_model_json`), `params/`, when the model has any `state/` (BatchNorm
    statistics, memory), and `tokenizer/` when one is given; all or nothing
    (`directories.staged`). Refuses to overwrite a non-empty folder. Files are 0644 and
    folders 0755 (readable by others)."""
    path = Path(path)
    _check_new_folder(path)
    with staged(path) as stage:
        write_model_json(stage, method, model.config, source=source)
        step_written()
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save((stage / "params").resolve(),
                          nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        checkpointer.wait_until_finished()
        step_written()
        rest = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))
        if jax.tree.leaves(rest):
            checkpointer.save((stage / "state").resolve(), rest)
            checkpointer.wait_until_finished()
            step_written()
        if tokenizer is not None:
            write_tokenizer(stage, tokenizer)
            step_written()
    return path


def _check_new_folder(path: Path) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UserError(f"{path} exists and is not an empty folder; choose a new output "
                        "directory")


def convert(source: str | Path, target: str | Path, *, to: str,
            tokenizer: str | None = None, layers_to_keep: str = "") -> Path:
    """`to="hf"`: pretext workdir or model dir -> HuggingFace directory (ELECTRA: one folder per
    part, `discriminator/` and `generator/`) with the tokenizer's HF files (`find_tokenizer`'s,
    or the `tokenizer` spec given) and a model card, `README.md`; parameters that a model
    converted from HF lacked there and never trained since are left out. `to="pretext"`: back,
    with the HF folder's tokenizer when pretext reads it (or the `tokenizer` given), its name
    and licence, and which parameters it lacked, in `model.json`. Either way all or nothing:
    every refusal comes before the first file is written, and a killed convert leaves no
    partial output (`directories.staged`). `layers_to_keep` (to HF only): export the encoder
    pruned to those layers (`loading.load_model`), a smaller HF model."""
    source, target = Path(source), Path(target)
    if to == "hf":
        model = load_model(source, layers_to_keep=layers_to_keep)
        origin = read_json_object(source / MODEL_FILE).get(SOURCE_KEY)
        found = _export_tokenizer(source, target, model, tokenizer)
        converted = hf.checkpoints(model, (origin or {}).get("untrained", ()))
        return hf.write(converted, target, found,
                        model_card(source, target, model, found, converted, origin))
    if layers_to_keep:
        raise UserError("--layers-to-keep prunes a pretext model as it is exported (--to hf); "
                        "convert to pretext first, then export with it")
    _check_new_folder(target)
    model, untrained = hf.read(source)
    return save_model(model, hf.method_name(model), target,
                      _hf_tokenizer(source, target, model, tokenizer),
                      {**hf.source_of(source), "untrained": untrained})


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


def model_card(source: Path, target: Path, model: nnx.Module, tokenizer: Tokenizer | None,
               converted: Mapping[str, hf.Checkpoint], origin: Mapping[str, Any] | None) -> str:
    """The `README.md` of a HF export: method, architecture and size, data, tokenizer, steps
    trained and the latest held-out evaluation, all read from the workdir (a model directory
    records no training details); for a model converted from HF (`origin`, model.json's
    `source`), its name as the title, its licence in the front matter, and what was left out."""
    method = read_json_object(source / MODEL_FILE)["method"]
    untrained = set((origin or {}).get("untrained", ()))
    params = sum(int(np.prod(leaf.shape)) for path, leaf in nnx.to_flat_state(
        nnx.state(model, nnx.Param)) if ".".join(map(str, path)) not in untrained)
    if origin:
        licence = origin.get("license")
        lines = [*(["---", f"license: {licence}", "---", ""] if licence else []),
                 f"# {origin['name']}", "", f"`{origin['name']}`, a `{method}` model converted "
                 f"from the HuggingFace folder `{origin['folder']}` to pretext (`{source}`) and "
                 "back by `run.py convert`, with no training in between.", "",
                 f"- Source: `{origin['name']}`, licence "
                 f"{f'`{licence}`' if licence else 'not stated there (check its terms)'}"]
    else:
        lines = [f"# {target.name}", "", f"A `{method}` model trained with pretext, converted "
                 f"from `{source}` by `run.py convert --to hf`.", ""]
    lines.append(f"- Method: `{method}`")
    usage = ["", "```python", "import transformers", ""]
    if tokenizer is not None:
        usage.append(f'tokenizer = transformers.AutoTokenizer.from_pretrained("{target}")')
    for name, checkpoint in converted.items():
        config = checkpoint.config
        architecture = config["architectures"][0]
        part = f"`{name}/`: " if name else ""
        sizes = ", ".join(f"{key} {config[key]}" for key in SIZE_KEYS if key in config)
        lines.append(f"- Model: {part}`{architecture}` ({sizes})")
        if checkpoint.left_out:
            left_out = ", ".join(f"`{n}`" for n in checkpoint.left_out)
            lines.append(f"- Not exported: {part}{left_out} (neither in the source nor trained, "
                         "so transformers reports them missing)")
        usage.append(f"{name or 'model'} = "
                     f'transformers.{architecture}.from_pretrained("{target / name}")')
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
    elif origin:
        lines.append("- Training: none since it was converted from HuggingFace")
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
