"""The checkpoint store of a workdir: save (Orbax, in the background), seal (a CRC-32 per file,
`integrity.seal`), verify and restore onto the mesh, set aside what cannot be restored, and
refuse a checkpoint the disk has no room for.

A checkpoint holds the train state, every process's data position, the unlogged part of the
metrics window and what the run's input files were (`data`), and the run config that wrote it
(`config`), so a resume can check that it continues the same run, on the same files, even when
`config.json` was deleted or replaced; it checks before it restores, prepares or writes
anything (`check_resume`). Orbax's own logging of failures is dropped: they reach the trainer
as exceptions, reported in one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from pretext_jax.errors import UserError
from pretext_jax.models import migration
from pretext_jax.pretrain import integrity, resilience
from pretext_jax.pretrain.config import Config, config_difference
from pretext_jax.pretrain.directories import saved_layout

CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "corrupt_checkpoints"
JSON_FILE = "metadata"  # the file of an Orbax JSON item (`<step>/config/metadata`)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """Everything a step changes: step counter, parameters, other model variables (e.g.
    BatchNorm statistics) and optimizer state."""

    step: jax.Array
    params: Any
    model_state: Any
    opt_state: Any


class CorruptCheckpoint(Exception):
    """A checkpoint whose files differ from their seal or whose values are not finite."""


class _DropOrbaxErrors(logging.Filter):
    """Drops Orbax's error records: each failure of its background threads is logged there with
    a traceback per thread, and reaches the trainer as an exception too (one line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname


def _quiet_orbax_logs() -> None:
    """Installs `_DropOrbaxErrors` on absl's logger (Orbax logs through absl), once."""
    logger = logging.getLogger("absl")
    if not any(isinstance(f, _DropOrbaxErrors) for f in logger.filters):
        logger.addFilter(_DropOrbaxErrors())


def _quiet_abandoned_work() -> None:
    """After a failed Orbax read or write, its abandoned coroutines each print a traceback
    ("Exception ignored in <coroutine ...>") when collected, or a "never awaited" warning at
    exit, hundreds of lines long after the one-line error: drop those (Orbax's coroutines only)
    for the rest of the process."""
    warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited",
                            category=RuntimeWarning)
    previous = sys.unraisablehook
    if getattr(previous, "quiet_orbax", False):
        return

    def hook(unraisable: Any) -> None:
        code = getattr(unraisable.object, "cr_code", None)
        if code is None or "orbax" not in code.co_filename:
            previous(unraisable)

    hook.quiet_orbax = True
    sys.unraisablehook = hook


def _read_saved(directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the run config, the data item) of a checkpoint folder, as its JSON items hold them."""
    config, data = (json.loads((directory / item / JSON_FILE).read_text())
                    for item in ("config", "data"))
    if not (isinstance(config, dict) and isinstance(data, dict)):
        raise ValueError("not JSON objects")
    return config, data


def _check_saved(directory: Path, workdir: Path, config: Config, inputs: dict[str, Any]
                 ) -> dict[str, Any]:
    """The data item of the checkpoint in `directory` after checking that a run of `config`
    reading `inputs` (`prepare.inputs_fingerprint`) wrote it; a UserError naming the first
    setting or input that differs otherwise. Checkpoints written before inputs were recorded
    are checked on their config alone."""
    saved_config, data = _read_saved(directory)
    where = f"the checkpoint at step {directory.name} in {workdir}"
    difference = config_difference(saved_config, config)
    if difference:
        raise UserError(f"{where} was written by a run with another config ({difference}); "
                        "use a new --workdir or the saved settings")
    for setting, (count, digest) in data.get("inputs", {}).items():
        now_count, now_digest = inputs.get(setting, (0, ""))
        if digest != now_digest:
            change = ("the same number, edited or touched since" if count == now_count else
                      f"{count} then, {now_count} now")
            raise UserError(f"{setting} is not what {where} read (its files: {change}); restore "
                            "that data, or start again with a new --workdir")
    return data


def check_resume(workdir: Path, config: Config, inputs: dict[str, Any]) -> None:
    """Checks, before anything is restored, prepared or written, that the newest checkpoint of
    `workdir` whose config and data items are intact (`_check_saved`) continues a run of
    `config` reading `inputs`. Nothing to check without checkpoints."""
    directory = workdir / CHECKPOINT_DIR
    steps = sorted((int(p.name) for p in directory.glob("*") if p.name.isdigit()),
                   reverse=True) if directory.is_dir() else []
    for step in steps:
        folder = directory / str(step)
        if integrity.verify(folder, within=("config", "data")):
            continue  # damaged: the restore sets it aside and falls back
        try:
            _check_saved(folder, workdir, config, inputs)
        except (OSError, ValueError):
            continue
        return


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)
                              if jnp.issubdtype(leaf.dtype, jnp.inexact)] or [jnp.bool_(True)]))


def _checkpoint_path(path: tuple[Any, ...]) -> tuple[Any, ...]:
    """A pytree path as a checkpoint's tree names it (dict keys, field names, list indices),
    with the parameter names of earlier versions replaced (`models.migration`)."""
    return migration.migrate_path(tuple(
        getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path))


def _in_layout(source: Any, layout: Any) -> Any:
    """`layout`'s tree with each leaf replaced by `source`'s leaf of the same path: a restore
    target in a checkpoint's own layout, or restored values in ours."""
    leaves = {_checkpoint_path(path): leaf
              for path, leaf in jax.tree_util.tree_leaves_with_path(source)}
    return jax.tree_util.tree_map_with_path(lambda path, _: leaves[_checkpoint_path(path)],
                                            layout)


class CheckpointStore:
    """The checkpoints of `workdir` for a run of `config` whose state has the shape
    `abstract_state` and the placement `state_sharding` (a `TrainState` of shardings).
    Every process calls `save` and the restores; only the writer process seals and moves
    files."""

    def __init__(self, workdir: Path, config: Config, inputs: dict[str, Any],
                 abstract_state: TrainState, state_sharding: TrainState, *, is_writer: bool):
        """`inputs`: what the run's input files are (`prepare.inputs_fingerprint`), saved in
        every checkpoint and compared on restore."""
        self.workdir, self.config, self.inputs = workdir, config, inputs
        self.directory = workdir / CHECKPOINT_DIR
        self.abstract_state, self.state_sharding = abstract_state, state_sharding
        self.is_writer = is_writer
        self._manager: ocp.CheckpointManager | None = None
        self._unsealed: list[int] = []  # steps saved by this store, not yet sealed

    @property
    def manager(self) -> ocp.CheckpointManager:
        """Orbax's manager of the folder, opened (and the folder created) on first use."""
        if self._manager is None:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.config.train.keep_checkpoints,
                enable_async_checkpointing=True, create=True)
            _quiet_orbax_logs()
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        return self._manager

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def close(self) -> None:
        """Seals what was saved, then closes the manager; when an error is already on its way
        up, a failure here is dropped so that it does not bury the first one."""
        if self._manager is None:
            return
        with contextlib.suppress(Exception) if sys.exc_info()[0] else \
                contextlib.nullcontext():
            try:
                self.seal_saved()
            finally:
                self._manager.close()
                self._manager = None

    # ------------------------------------------------------------------------- saving
    def save(self, state: TrainState, data_state: bytes,
             log_window: dict[str, Any] | None = None) -> None:
        """Writes a checkpoint collectively (every process calls it), with every process's
        data position (`iterators`, in process order; `iterator` is process 0's) and the
        unlogged part of the metrics window (`log_window`, so a resumed run logs the rows an
        uninterrupted one does). Orbax writes it in the background; the previous one is
        sealed first (`seal_saved`)."""
        step = int(jax.device_get(state.step))
        states = resilience.gather_strings(data_state.decode())
        self.seal_saved()
        self._check_space(step, state)
        self._unsealed.append(step)
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave({"iterator": states[0], "iterators": states,
                                        "log_window": log_window or {},
                                        "inputs": self.inputs}),
                config=ocp.args.JsonSave(self.config.to_dict()),
            ))
        except (OSError, ValueError) as error:  # tensorstore reports a full disk as ValueError
            raise self._write_failed(step, error) from None

    def _check_space(self, step: int, state: TrainState) -> None:
        """Refuses to start a checkpoint that the file system has no room for, or into a folder
        that is not writable (Orbax fails part-way, from background threads, whose other
        threads then wait minutes for it): the state's bytes plus 10%."""
        folder = self.directory if self.directory.is_dir() else self.workdir
        if not os.access(folder, os.W_OK | os.X_OK):
            raise UserError(f"the checkpoint of step {step} cannot be written: {folder} is not "
                            "writable; fix its permissions and rerun to resume (earlier "
                            "checkpoints are intact)")
        needed = 1.1 * sum(leaf.nbytes for leaf in jax.tree.leaves(state)) + (1 << 20)
        free = shutil.disk_usage(self.directory if self.directory.is_dir()
                                 else self.workdir).free
        if free < needed:
            raise UserError(f"not enough space for the checkpoint of step {step} in "
                            f"{self.directory}: it needs about {needed / 1e6:.0f} MB, "
                            f"{free / 1e6:.0f} MB are free; free some space and rerun to "
                            "resume (earlier checkpoints are intact)")

    def _write_failed(self, step: int, error: BaseException) -> UserError:
        """A one-line error for a checkpoint that could not be written; its partial files are
        removed so a rerun does not trip on them."""
        _quiet_abandoned_work()
        for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
            shutil.rmtree(partial, ignore_errors=True)
        reason = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        return UserError(f"the checkpoint of step {step} could not be written in "
                         f"{self.directory} ({reason}); fix the file system (space, "
                         "permissions) and rerun to resume from the previous checkpoint")

    def seal_saved(self) -> None:
        """Waits for the checkpoints this store saved to be finished, then seals them
        (`integrity.seal`: a CRC-32 per file, verified on restore)."""
        if not self._unsealed:
            return
        try:
            self.manager.wait_until_finished()
        except (OSError, ValueError) as error:  # the background write failed
            step, self._unsealed = self._unsealed[-1], []
            raise self._write_failed(step, error) from None
        if self.is_writer:
            for step in self._unsealed:
                directory = self.directory / str(step)
                if directory.is_dir():  # not yet removed by keep_checkpoints
                    integrity.seal(directory)
        self._unsealed = []

    # ---------------------------------------------------------------------- restoring
    def restore(self, step: int) -> tuple[TrainState, dict[str, Any]]:
        """Restores onto the mesh (the target tree carries the shardings) after verifying the
        checkpoint's seal and that this run wrote it (`_check_saved`: a UserError otherwise,
        before any array is read); returns the state and the checkpoint's data item with the
        data positions of the processes that wrote it as `iterators` and the unlogged metrics
        window as `log_window`. A damaged checkpoint raises CorruptCheckpoint."""
        folder = self.directory / str(step)
        problem = integrity.verify(folder)
        if problem:
            raise CorruptCheckpoint(problem)
        data = _check_saved(folder, self.workdir, self.config, self.inputs)
        target = jax.tree.map(
            lambda sharding, subtree: jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), subtree),
            self.state_sharding, self.abstract_state,
            is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        # A checkpoint of an earlier version may name parameters differently: it is restored in
        # its own layout and its leaves put where `models.migration` says they now are.
        layout = saved_layout(folder / "state")
        renamed = migration.has_old_names(layout)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_in_layout(target, layout) if renamed else target)))
        state = _in_layout(restored["state"], target) if renamed else restored["state"]
        if not bool(_all_finite(state)):
            raise CorruptCheckpoint("it holds NaN or Inf values")
        return state, {**data, "iterators": data.get("iterators") or [data["iterator"]],
                       "log_window": data.get("log_window") or {}}

    def restore_latest_readable(self) -> tuple[TrainState, dict[str, Any]] | None:
        """The newest checkpoint that restores (`restore`). Unreadable newer ones (truncated or
        corrupt files) are moved to `corrupt_checkpoints/`, with a warning naming what was
        wrong, once an older one has restored; if none restores, nothing is moved. None when
        there is no checkpoint; a checkpoint of another run is a UserError."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        unreadable: list[tuple[int, str]] = []
        for step in steps:
            try:
                restored = self.restore(step)
            except UserError:
                raise
            except Exception as error:  # noqa: BLE001  (any unreadable file: try the previous)
                unreadable.append((step, f"{type(error).__name__}: "
                                         f"{str(error).split('. See ')[0].splitlines()[0]}"))
                _quiet_abandoned_work()
                continue
            for bad, reason in unreadable:
                print(f"warning: checkpoint {bad} in {self.workdir} cannot be restored "
                      f"({reason}); moved to {CORRUPT_DIR}/, resuming from step {step}",
                      file=sys.stderr, flush=True)
                self._set_aside(bad)
            return restored
        if steps:
            raise UserError(f"no checkpoint in {self.directory} can be restored "
                            f"(step {unreadable[0][0]}: {unreadable[0][1][:200]}); start again "
                            "with a new --workdir")
        return None

    def _set_aside(self, step: int) -> None:
        if self.is_writer:
            target = self.workdir / CORRUPT_DIR / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
            target.parent.mkdir(exist_ok=True)
            shutil.move(str(self.directory / str(step)), target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"pretext: checkpoint {step} set aside")
        self.manager.reload()
