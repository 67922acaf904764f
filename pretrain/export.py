"""Writing pretext model directories (`save_model`) and converting between them and
HuggingFace folders (`convert`, with the tokenizer's HF files and a model card).

The files of workdirs and model directories are `pretrain.directories`'; loading them back into
a model is `pretrain.loading`'s.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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
    checkpoint_step,
    find_tokenizer,
    make_readable,
    read_json_object,
    write_model_json,
    write_tokenizer,
)
from pretext_jax.pretrain.loading import load_model
from pretext_jax.pretrain.metrics import METRICS_FILE


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
