"""The files of pretext workdirs and model directories, read and written without building a model.

A *model directory* holds `model.json` (method + resolved model config; a workdir's also the
resolved objective settings, for the record), `params/` (an Orbax checkpoint of the
parameters), `state/` for models with other state (BatchNorm statistics) and `tokenizer/` for
text models (the files `load_tokenizer` reads). A *workdir* holds the same `model.json` and
`tokenizer/`, its run config `config.json` and training checkpoints under
`checkpoints/<step>/`. `pretrain.loading` builds models from these files, `pretrain.export`
writes model directories and converts them.
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

import orbax.checkpoint as ocp

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import prepare
from pretext_jax.input_pipeline.tokenizers import Tokenizer
from pretext_jax.pretrain.config import Config, config_difference

MODEL_FILE = "model.json"
TOKENIZER_DIR = "tokenizer"
CONFIG_FILE = "config.json"  # a workdir's run config (pretrain.trainer)


def write_model_json(directory: Path, method: str, model_config: Any,
                     objective: Any = None) -> None:
    """`directory/model.json`: the method, its model config and (when it has any fields) the
    objective settings."""
    info = {"method": method, "model": dataclasses.asdict(model_config)}
    if objective is not None and dataclasses.fields(objective):
        info["objective"] = dataclasses.asdict(objective)
    (directory / MODEL_FILE).write_text(json.dumps(info, indent=2))


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


def checkpoint_step(workdir: Path) -> int | None:
    """The step of a workdir's latest checkpoint (None: none yet)."""
    manager = ocp.CheckpointManager((workdir / "checkpoints").resolve())
    step = manager.latest_step()
    manager.close()
    return step


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


def check_workdir(workdir: Path, config: Config) -> None:
    """Refuses a `--workdir` that is a file, whose `checkpoints` is not a folder, or that holds
    a run of another config (settings that may change on resume excepted)."""
    saved = workdir / CONFIG_FILE
    if workdir.exists() and not workdir.is_dir():
        raise UserError(f"--workdir {workdir} is a file; name a folder for the run")
    checkpoints = workdir / "checkpoints"
    if checkpoints.exists() and not checkpoints.is_dir():
        raise UserError(f"{checkpoints} is not a folder; move it away (a run keeps its "
                        "checkpoints there) or use a new --workdir")
    if not saved.is_file():
        return
    difference = config_difference(read_json_object(saved), config)
    if difference:
        raise UserError(f"workdir {workdir} holds a run with another config ({difference}); "
                        "use a new --workdir or the saved settings")


def check_writable(workdir: Path) -> None:
    """Refuses a workdir, or its `checkpoints` folder, that this process cannot write: checked
    before anything is written (a read-only `checkpoints` otherwise fails at the first
    checkpoint, in Orbax's background threads). A workdir still to be made needs a writable
    parent."""
    existing = workdir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    for path in (existing, workdir / "checkpoints"):
        if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
            raise UserError(f"{path} is not writable by this process; fix its permissions "
                            f"(e.g. chmod u+w {path}) or use another --workdir")


def record_run(workdir: Path, config: Config, model_config: Any, objective: Any,
               tokenizer: Tokenizer | None) -> None:
    """Writes what a workdir says about its run: `config.json`, `model.json` (the resolved
    model config and objective settings) and, for a text method, its tokenizer
    (`find_tokenizer`)."""
    (workdir / CONFIG_FILE).write_text(config.to_json())
    write_model_json(workdir, config.method, model_config, objective)
    if tokenizer is not None:
        write_tokenizer(workdir, tokenizer)
