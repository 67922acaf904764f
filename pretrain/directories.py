"""The files of pretext workdirs and model directories, read and written without building a model.

A *model directory* holds `model.json` (method + resolved model config; a workdir's also the
resolved objective settings, for the record), `params/` (an Orbax checkpoint of the
parameters), `state/` for models with other state (BatchNorm statistics) and `tokenizer/` for
text models (the files `load_tokenizer` reads). A *workdir* holds the same `model.json` and
`tokenizer/`, its run config `config.json` and training checkpoints under
`checkpoints/<step>/`. `pretrain.loading` builds models from these files, `pretrain.export`
writes model directories and converts them.

Outputs that must appear whole (a model directory, a HuggingFace folder) are written through
`staged`: one hidden staging folder beside the target, renamed into place last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import itertools
import json
import logging
import os
import re
import shutil
import signal
import uuid
from collections.abc import Iterator
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
SOURCE_KEY = "source"  # model.json's record of a model converted from HF (`write_model_json`)
# Tests set it to k: the process kills itself (SIGKILL) at the k-th step of a staged write.
KILL_AT_WRITE = "PRETEXT_KILL_AT_WRITE"
_writes = itertools.count(1)


def write_model_json(directory: Path, method: str, model_config: Any,
                     objective: Any = None, source: dict[str, Any] | None = None) -> None:
    """`directory/model.json`: the method, its model config, (when it has any fields) the
    objective settings and, for a model converted from elsewhere, `source`: where it came from
    (`name`, `license`, `folder`) and `untrained`, the paths of parameters the source lacked,
    which hold initial values."""
    info: dict[str, Any] = {"method": method, "model": dataclasses.asdict(model_config)}
    if objective is not None and dataclasses.fields(objective):
        info["objective"] = dataclasses.asdict(objective)
    if source is not None:
        info[SOURCE_KEY] = source
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


def step_written() -> None:
    """Marks one more step of a staged write done. With `PRETEXT_KILL_AT_WRITE=k` set (tests)
    the k-th kills this process outright, no cleanup of any kind, as SIGKILL or a power loss
    would."""
    kill_at = os.environ.get(KILL_AT_WRITE)
    if kill_at and next(_writes) == int(kill_at):
        os.kill(os.getpid(), signal.SIGKILL)


def _lock(folder: Path, wait: bool = False) -> int | None:
    """An exclusive `flock` on `folder`, its writer's mark for as long as that process lives
    (the OS drops it when the process dies, however it dies); None when another holds it."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def is_leftover(name: str, output: str) -> bool:
    """Whether `name` is a staging folder of an output named `output`, or its previous content
    moved aside (`staged`'s hidden names, `.<output>.<hex>.tmp` / `.old`)."""
    return re.fullmatch(rf"\.{re.escape(output)}\.[0-9a-f]{{12,32}}\.(tmp|old)", name) is not None


def _clean_leftovers(target: Path) -> None:
    """What writers of `target` that died mid-write left beside it: their staging folders
    (`.<name>.<hex>.tmp`) are removed; a previous `target` they had moved aside
    (`.<name>.<hex>.old`) is put back when `target` is missing, else removed. Leftovers of a
    live writer (it holds their lock) are left alone."""
    leftovers = sorted((p for p in target.parent.glob(f".{target.name}.*")
                        if is_leftover(p.name, target.name) and p.is_dir()),
                       key=lambda p: p.suffix != ".old")  # put a previous output back first
    for leftover in leftovers:
        fd = _lock(leftover)
        if fd is None:
            continue
        try:
            if leftover.suffix == ".old" and not target.exists():
                os.replace(leftover, target)
            else:
                shutil.rmtree(leftover)
        finally:
            os.close(fd)


@contextlib.contextmanager
def staged(target: Path) -> Iterator[Path]:
    """An empty staging folder for everything `target` will hold, beside it (same file system)
    and locked by this process (`_lock`). When the block ends without an error the folder, made
    readable by others, is renamed to `target` in one step (an existing `target` is moved aside
    first and removed after), so `target` is the old output or the new one, whole, or absent,
    never partial, however the process ends; on an error it is removed. What a killed writer
    left is cleaned first (`_clean_leftovers`)."""
    target = Path(target).resolve()  # a symlinked output is replaced where it points
    target.parent.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(target)
    stage = target.with_name(f".{target.name}.{uuid.uuid4().hex[:16]}.tmp")
    stage.mkdir()
    fd = _lock(stage)
    try:
        yield stage
        make_readable(stage)
        step_written()
        if target.is_dir() and any(target.iterdir()):
            _replace(stage, target)
        else:
            os.replace(stage, target)  # onto nothing or an empty folder
        step_written()
    finally:
        shutil.rmtree(stage, ignore_errors=True)  # nothing left there after the rename
        if fd is not None:
            os.close(fd)


def _replace(stage: Path, target: Path) -> None:
    """Puts `stage` in place of the non-empty folder `target`, which is moved aside (locked, so
    that a writer that finds it there leaves it) and removed."""
    fd = _lock(target, wait=True)
    aside = target.with_name(f".{target.name}.{uuid.uuid4().hex[:16]}.old")
    try:
        os.replace(target, aside)
        step_written()
        try:
            os.replace(stage, target)
        except BaseException:
            os.replace(aside, target)
            raise
        step_written()
        shutil.rmtree(aside)
    finally:
        if fd is not None:
            os.close(fd)


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


def take_back(workdir: Path, before: set[Path], existed: bool, keep: Path) -> None:
    """After bad input (an unreadable image, a file system that refuses the checkpoint)
    stopped a run before the workdir held any checkpoint: removes what the run added to
    `workdir` (`before`: its entries when the run took it; `existed`: whether it was there),
    `keep` (the data cache: prepared records are reused by the rerun) excepted, so nothing
    half-made is left behind. (A non-finite step is not taken back: its metrics show how the
    loss diverged.)"""
    for path in set(workdir.iterdir()) - before - {keep}:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if not existed and not any(workdir.iterdir()):
        workdir.rmdir()
