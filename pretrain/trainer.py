"""The one trainer: sharded state, a jit-compiled step with donation, evaluation, checkpoints.

It knows no method by name: the registry supplies the model, loss and data. Determinism: the
dropout RNG of step s is fold_in(key(seed), s) and the data order is Grain's (seeded, index
based), so a resumed run reproduces an uninterrupted one exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import prepare
from pretext_jax.input_pipeline.records import make_loader
from pretext_jax.models import migration
from pretext_jax.objectives import registry
from pretext_jax.pretrain import integrity, resilience
from pretext_jax.pretrain import mesh as mesh_lib
from pretext_jax.pretrain.config import Config, config_from_dict, parse_profile_steps
from pretext_jax.pretrain.export import (
    CONFIG_FILE,
    load_pretrained,
    read_json_object,
    saved_layout,
    write_model_json,
    write_tokenizer,
)
from pretext_jax.pretrain.metrics import MetricWriter, plot_curves, reduce_metrics
from pretext_jax.pretrain.optim import learning_rate_schedule, make_optimizer

# Settings that may change when a run is resumed; everything else must match the saved run.
RESUMABLE_KEYS = {"steps", "log_every", "eval_every", "eval_batches", "checkpoint_every",
                  "keep_checkpoints", "progress", "on_nonfinite", "profile_steps", "prefetch"}
CORRUPT_DIR = "corrupt_checkpoints"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """Everything a step changes: step counter, parameters, other model variables (e.g.
    BatchNorm statistics) and optimizer state."""

    step: jax.Array
    params: Any
    model_state: Any
    opt_state: Any


def _quiet_failed_reads() -> None:
    """After a failed Orbax restore, its abandoned read coroutines each print a traceback
    ("Exception ignored in <coroutine ...>") when collected, hundreds of lines per unreadable
    checkpoint, long after the one-line warning: drop those (Orbax's coroutines only) for the
    rest of the process."""
    previous = sys.unraisablehook
    if getattr(previous, "quiet_orbax", False):
        return

    def hook(unraisable: Any) -> None:
        code = getattr(unraisable.object, "cr_code", None)
        if code is None or "orbax" not in code.co_filename:
            previous(unraisable)

    hook.quiet_orbax = True
    sys.unraisablehook = hook


PROFILE_DIR = "profile"


class Profile:
    """A `jax.profiler` trace of the steps `train.profile_steps` names (`a:b`, inclusive) into
    `<workdir>/profile/` (open it with TensorBoard's profile plugin or Perfetto); the device
    work of step b is waited for before the trace stops."""

    def __init__(self, steps: str, directory: Path, writer: MetricWriter):
        self.first, self.last = parse_profile_steps(steps) if steps else (0, -1)
        self.directory, self.writer, self.active = directory, writer, False

    def before(self, step: int) -> None:
        if step == self.first:
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int, metrics: Any) -> None:
        if self.active and step >= self.last:
            jax.block_until_ready(metrics)
            self.close()
            self.writer.print(f"profile of steps {self.first}-{self.last} in {self.directory}")

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


class CorruptCheckpoint(Exception):
    """A checkpoint whose files differ from their seal or whose values are not finite."""


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


def _config_difference(saved: dict[str, Any], wanted: dict[str, Any]) -> str | None:
    for section, values in wanted.items():
        if not isinstance(values, dict):
            if saved.get(section) != values:
                return f"{section}: {saved.get(section)!r} vs {values!r}"
            continue
        for key, value in values.items():
            if section == "train" and key in RESUMABLE_KEYS:
                continue
            if saved.get(section, {}).get(key) != value:
                return f"{section}.{key}: {saved.get(section, {}).get(key)!r} vs {value!r}"
    return None


def data_cache(config: Config, workdir: str | Path) -> Path:
    """Where prepared records live: `data.cache_dir`, else `<workdir>/data`."""
    return Path(config.data.cache_dir) if config.data.cache_dir else Path(workdir) / "data"


def prepare_data(config: Config, workdir: str | Path) -> registry.PreparedData:
    """The method's data preparation alone (`run.py prepare`): the records that `pretrain` with
    the same config and workdir (or `data.cache_dir`) then reuses; nothing else is written."""
    method = registry.get(config.method)
    return method.prepare(config.data, config.examples, data_cache(config, workdir),
                          config.train.seed)


class Trainer:
    """Builds everything for `config` in `workdir`; `run()` trains (resuming if possible).

    Nothing is written to `workdir` until the config, mesh, batch layout and data have been
    validated, so bad input never changes an existing workdir.
    """

    def __init__(self, config: Config, workdir: str | Path, *, devices: list[Any] | None = None,
                 data: registry.PreparedData | None = None):
        """`data` replaces the method's preparation (records made elsewhere; benchmarks pass
        no records and feed `train_step` themselves)."""
        self.config = config
        self.workdir = Path(workdir).absolute()  # Orbax needs absolute paths
        self.method = registry.get(config.method)
        self.mesh = mesh_lib.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor,
                                       devices)
        self._check_batch_layout()
        self._check_existing_workdir()
        self.example_config = config.examples
        cache = data_cache(config, self.workdir)
        created = [p for p in (self.workdir, cache) if not p.exists()]
        prepared = data is not None
        try:
            self.data = data or self._prepare(cache)
            prepared = True
            self._check_data_layout()
            self.model_config = self._resolve_model_config()
            self.objective = self._resolve_objective()
            if self.method.complete_data is not None:
                self.data = self.method.complete_data(self.data, self.model_config,
                                                      self.objective)
        except BaseException:
            # A preparation that stopped part-way keeps its finished shards for the rerun.
            if prepared or not prepare.has_finished_shards(cache):
                for path in created:  # leave the file system as it was
                    shutil.rmtree(path, ignore_errors=True)
            raise
        self.is_writer = jax.process_index() == 0
        self._unsealed: list[int] = []  # steps saved by this trainer, not yet sealed
        # Many fake CPU devices on few cores can time out XLA's collectives when steps are
        # queued without waiting (ARCHITECTURE.md, "Facts"); CPU gains nothing from queueing.
        self.sync_every_step = jax.default_backend() == "cpu"
        self._build()

    def _prepare(self, cache: Path) -> registry.PreparedData:
        """The method's data preparation, called by every process at once: text corpora are
        prepared in shards spread over the processes (`prepare.prepare_text`), and records
        written by several processes at once are renamed atomically (`records.write_records`)."""
        return self.method.prepare(self.config.data, self.example_config, cache,
                                   self.config.train.seed)

    # ----------------------------------------------------------------------- validation
    def _check_batch_layout(self) -> None:
        t, o = self.config.train, self.config.optim
        shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        micro = t.batch_size // o.grad_accum_steps
        if micro % shards:
            raise UserError(
                f"global batch {t.batch_size} / grad_accum_steps {o.grad_accum_steps} = {micro} "
                f"is not divisible by the data axes (data*fsdp = {shards}); use a multiple of "
                f"{shards * o.grad_accum_steps} for train.batch_size or change mesh.*")
        if t.batch_size % jax.process_count():
            raise UserError(f"train.batch_size={t.batch_size} is not divisible by the "
                            f"{jax.process_count()} processes")

    def _check_data_layout(self) -> None:
        """Records laid out as consecutive batches (XLNet's memory) fix the batch: the global
        batch must be that layout's, one micro-batch, one process (rows are not yet split
        across processes in that layout)."""
        layout = self.data.batch_layout
        if not layout:
            return
        t, o = self.config.train, self.config.optim
        if t.batch_size != layout:
            raise UserError(f"train.batch_size={t.batch_size} must equal the records' batch "
                            f"layout ({layout} streams); set both to the same value")
        if o.grad_accum_steps != 1 or jax.process_count() != 1:
            raise UserError("records laid out for recurrence memory need optim.grad_accum_steps"
                            "=1 and a single process; use a smaller batch or more devices")

    def _check_existing_workdir(self) -> None:
        saved = self.workdir / CONFIG_FILE
        if self.workdir.exists() and not self.workdir.is_dir():
            raise UserError(f"--workdir {self.workdir} is a file; name a folder for the run")
        checkpoints = self.workdir / "checkpoints"
        if checkpoints.exists() and not checkpoints.is_dir():
            raise UserError(f"{checkpoints} is not a folder; move it away (a run keeps its "
                            "checkpoints there) or use a new --workdir")
        if not saved.is_file():
            return
        difference = self._difference_from(read_json_object(saved))
        if difference:
            raise UserError(f"workdir {self.workdir} holds a run with another config "
                            f"({difference}); use a new --workdir or the saved settings")

    def _difference_from(self, recorded: dict[str, Any]) -> str | None:
        """The first setting in which a recorded config differs from this run's (settings that
        may change on resume excepted). Read through the config types, so fields added since
        it was saved take their defaults; a config not valid in this version is compared as
        written (so it differs). Both sides as JSON values: a tuple in a preset is the list
        that config.json holds."""
        with contextlib.suppress(UserError, TypeError):
            recorded = config_from_dict(recorded).to_dict()
        return _config_difference(json.loads(json.dumps(recorded)),
                                  json.loads(self.config.to_json()))

    def _checked_log_window(self, manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
        """Checks that the config saved inside the checkpoint is this run's too (`config.json`
        can be deleted or replaced; the checkpoint's copy cannot without breaking its seal) and
        returns the checkpoint's unlogged metrics window (empty for older checkpoints)."""
        restored = manager.restore(step, args=ocp.args.Composite(
            config=ocp.args.JsonRestore(), data=ocp.args.JsonRestore()))
        difference = self._difference_from(restored["config"])
        if difference:
            raise UserError(f"the checkpoint at step {step} in {self.workdir} was written by a "
                            f"run with another config ({difference}); use a new --workdir or "
                            "the saved settings")
        return restored["data"].get("log_window") or {}

    def _window_sums(self, saved: dict[str, list[float]]) -> Any:
        """Metric sums of a saved log window as replicated float32 scalars on the mesh (the
        float32 values survive JSON exactly, so the sums continue bit for bit)."""
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return {name: tuple(jax.device_put(np.float32(v), replicated) for v in pair)
                for name, pair in saved.items()}

    def _resolve_model_config(self) -> Any:
        model_config = self.config.model
        updates = {}
        for name, value in self.data.model_fields.items():
            current = getattr(model_config, name)
            if current in (0, None):
                updates[name] = value
            elif current != value:
                raise UserError(
                    f"model.{name}={current} does not match the data ({name}={value}, e.g. the "
                    f"tokenizer's vocabulary); set model.{name}=0 to take it from the data or "
                    "use a matching tokenizer")
        return dataclasses.replace(model_config, **updates)

    def _resolve_objective(self) -> Any:
        """The loss's settings (`config.objective`), with what the method derives from the run's
        settings filled in (`Method.run_settings`)."""
        objective = self.config.objective
        if self.method.run_settings is not None:
            objective = self.method.run_settings(objective, self.config)
        return objective

    # ------------------------------------------------------------------------ building
    def _build(self) -> None:
        self.loss_fn = self.method.bind_loss(self.objective)
        total_steps = self.config.train.steps
        self.tx = make_optimizer(self.config.optim, total_steps)
        self.schedule = learning_rate_schedule(self.config.optim, total_steps)
        seed = self.config.train.seed
        abstract_model = nnx.eval_shape(lambda: self.method.build_model(self.model_config, seed))
        self.graphdef, abstract_params, abstract_rest = nnx.split(abstract_model, nnx.Param, ...)
        param_shardings = mesh_lib.state_shardings(abstract_params, self.mesh)
        rest_shardings = mesh_lib.state_shardings(abstract_rest, self.mesh)
        abstract_opt = jax.eval_shape(self.tx.init, abstract_params)
        opt_shardings = self._opt_shardings(abstract_opt, param_shardings)
        replicated = mesh_lib.replicated(self.mesh)
        self.state_sharding = TrainState(step=replicated, params=param_shardings,
                                         model_state=rest_shardings, opt_state=opt_shardings)
        self.abstract_state = TrainState(
            step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params,
            model_state=abstract_rest, opt_state=abstract_opt)
        self.batch_sharding = mesh_lib.batch_sharding(self.mesh)
        metric_sharding = replicated
        self._init = jax.jit(self._init_state, out_shardings=self.state_sharding)
        self._train_step = jax.jit(
            self._step, in_shardings=(self.state_sharding, self.batch_sharding),
            out_shardings=(self.state_sharding, metric_sharding), donate_argnums=(0,))
        self._eval_step = jax.jit(
            self._evaluate, in_shardings=(self.state_sharding, self.batch_sharding),
            out_shardings=metric_sharding)

    def _opt_shardings(self, abstract_opt: Any, param_shardings: Any) -> Any:
        """Optimizer moments are sharded like the parameters they belong to."""
        replicated = mesh_lib.replicated(self.mesh)
        by_shape: dict[tuple[str, ...], Any] = {}
        for path, sharding in jax.tree_util.tree_leaves_with_path(param_shardings):
            by_shape[tuple(str(k) for k in path)] = sharding

        def pick(path: tuple[Any, ...], leaf: Any) -> Any:
            keys = tuple(str(k) for k in path)
            if keys and keys[-1] == ".value":  # the Variable's own node, not a parameter name
                keys = keys[:-1]
            for n in range(len(keys)):
                if keys[n:] in by_shape and np.ndim(leaf) > 0:
                    return by_shape[keys[n:]]
            return replicated

        return jax.tree_util.tree_map_with_path(pick, abstract_opt)

    def _init_state(self) -> TrainState:
        model = self.method.build_model(self.model_config, self.config.train.seed)
        _, params, rest = nnx.split(model, nnx.Param, ...)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=rest,
                          opt_state=self.tx.init(params))

    def init_state(self) -> TrainState:
        """Fresh, sharded train state (jit-compiled init: parameters are created in place),
        with the method's pre-trained parameters put in place of the random ones and the
        variables the data decides (`PreparedData.model_variables`) set."""
        state = self._with_data_variables(self._init())
        model = (self.method.pretrained(self.model_config, self.config.train.seed,
                                        load_pretrained)
                 if self.method.pretrained else None)
        if model is None:
            return state
        params = jax.device_put(nnx.state(model, nnx.Param), self.state_sharding.params)
        return dataclasses.replace(state, params=params)

    def _with_data_variables(self, state: TrainState) -> TrainState:
        """`state` with the model variables named in `PreparedData.model_variables` set to the
        data's values, placed as the variables are."""
        values = self.data.model_variables
        if not values:
            return state
        is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        names = {getattr(path[0], "key", None) for path, _ in
                 jax.tree_util.tree_flatten_with_path(state.model_state, is_variable)[0]}
        if set(values) - names:
            raise ValueError(f"the model has no variables {sorted(set(values) - names)}")

        def put(path: tuple[Any, ...], leaf: Any, sharding: Any) -> Any:
            name = getattr(path[0], "key", None)
            if name not in values:
                return leaf
            value = np.asarray(values[name], leaf.get_value().dtype)
            if value.shape != leaf.get_value().shape:
                raise ValueError(f"the data's {name} has shape {value.shape}, the model's "
                                 f"{leaf.get_value().shape}")
            return leaf.replace(jax.device_put(value, sharding))

        return dataclasses.replace(state, model_state=jax.tree_util.tree_map_with_path(
            put, state.model_state, self.state_sharding.model_state, is_leaf=is_variable))

    # --------------------------------------------------------------------------- steps
    def _loss(self, params: Any, model_state: Any, batch: Any, rng: jax.Array | None):
        model = nnx.merge(self.graphdef, params, model_state, copy=True)
        loss, metrics = self.loss_fn(model, batch, rng)
        return loss, (metrics, nnx.state(model, nnx.Not(nnx.Param)))

    def _step(self, state: TrainState, batch: Any) -> tuple[TrainState, Any]:
        """One optimizer step; with grad_accum_steps > 1 the batch is split into micro-batches
        whose gradients and metric sums are accumulated in a scan before the update."""
        accum = self.config.optim.grad_accum_steps
        rng = jax.random.fold_in(jax.random.key(self.config.train.seed), state.step)
        grad_fn = jax.grad(self._loss, has_aux=True)
        if accum == 1:
            grads, (metrics, model_state) = grad_fn(state.params, state.model_state, batch, rng)
        else:
            micro = jax.tree.map(
                lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch)

            def body(carry, inputs):
                grads_sum, metrics_sum, model_state = carry
                index, micro_batch = inputs
                grads, (metrics, model_state) = grad_fn(
                    state.params, model_state, micro_batch, jax.random.fold_in(rng, index))
                return (jax.tree.map(jnp.add, grads_sum, grads),
                        jax.tree.map(jnp.add, metrics_sum, metrics), model_state), None

            zero_grads = jax.tree.map(jnp.zeros_like, state.params)
            first_metrics = jax.eval_shape(
                lambda: grad_fn(state.params, state.model_state,
                                jax.tree.map(lambda x: x[0], micro), rng)[1][0])
            zero_metrics = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), first_metrics)
            (grads, metrics, model_state), _ = jax.lax.scan(
                body, (zero_grads, zero_metrics, state.model_state),
                (jnp.arange(accum), micro))
            grads = jax.tree.map(lambda g: g / accum, grads)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics)
        one = jnp.ones((), jnp.float32)
        grad_norm = optax.tree.norm(grads)
        # The updated state too: an update can overflow where loss and gradients did not, and
        # no checkpoint may hold NaN/Inf.
        updated_finite = jnp.all(jnp.stack([
            jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves((params, opt_state,
                                                                      model_state))
            if jnp.issubdtype(leaf.dtype, jnp.inexact)]))
        loss_finite = jnp.isfinite(metrics["loss"][0]) & updated_finite
        finite = loss_finite & jnp.isfinite(grad_norm)
        metrics["grad_norm"] = (grad_norm, one)
        metrics["nonfinite_steps"] = (1.0 - finite.astype(jnp.float32), one)

        if self.config.train.on_nonfinite == "skip":
            # A skipped step changes nothing but the step counter (its batch is consumed); what
            # the forward pass updates (BatchNorm statistics, XLNet's memory) follows its loss.
            # With `stop` no select is compiled: the run ends before anything is saved.
            def keep(new: Any, old: Any, ok: jax.Array) -> Any:
                return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)

            params = keep(params, state.params, finite)
            opt_state = keep(opt_state, state.opt_state, finite)
            model_state = keep(model_state, state.model_state, loss_finite)
        return TrainState(step=state.step + 1, params=params, model_state=model_state,
                          opt_state=opt_state), metrics

    def model_of(self, state: TrainState) -> nnx.Module:
        """The model holding `state`'s parameters and variables (a copy)."""
        return nnx.merge(self.graphdef, state.params, state.model_state, copy=True)

    def _evaluate(self, state: TrainState, batch: Any) -> Any:
        _, (metrics, _) = self._loss(state.params, state.model_state, batch, None)
        return metrics

    def to_global(self, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Process-local numpy batch -> global jax.Arrays sharded over the data axes."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v)
                for k, v in local_batch.items()}

    def train_step(self, state: TrainState, local_batch: dict[str, np.ndarray]):
        return self._train_step(state, self.to_global(local_batch))

    def evaluate(self, state: TrainState) -> dict[str, float]:
        """Metrics over the held-out set (at most eval_batches batches, exact sums)."""
        records = self.data.eval
        count = len(next(iter(records.values())))
        shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"] * jax.process_count()
        batch = min(self.config.train.batch_size, count) // shards * shards
        if batch == 0:
            raise UserError(f"the held-out set has {count} examples, fewer than the {shards} "
                            "data shards; raise data.held_out_fraction or give more text")
        sums = None
        per_process = batch // jax.process_count()
        start_offset = jax.process_index() * per_process
        for start in range(0, min(count // batch, self.config.train.eval_batches) * batch, batch):
            lo = start + start_offset
            local = {k: v[lo:lo + per_process] for k, v in records.items()}
            metrics = self._eval_step(state, self.to_global(local))
            sums = metrics if sums is None else jax.tree.map(jnp.add, sums, metrics)
        results = reduce_metrics(jax.device_get(sums))
        if self.method.monitor is not None:
            results.update(self.method.monitor(self.model_of(state), self.data,
                                               self.example_config, self.objective))
        return results

    # --------------------------------------------------------------------- checkpoints
    def checkpoint_manager(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.config.train.keep_checkpoints, enable_async_checkpointing=True,
            create=True)
        return ocp.CheckpointManager(self.workdir / "checkpoints", options=options)

    def save(self, manager: ocp.CheckpointManager, state: TrainState, data_state: bytes,
             log_window: dict[str, Any] | None = None) -> None:
        """Writes a checkpoint collectively (every process calls it), with every process's
        data position (`iterators`, in process order; `iterator` is process 0's) and the
        unlogged part of the metrics window (`log_window`, so a resumed run logs the rows an
        uninterrupted one does). Orbax writes it in the background; the previous one is
        sealed first (`seal_saved`)."""
        step = int(jax.device_get(state.step))
        states = resilience.gather_strings(data_state.decode())
        self.seal_saved(manager)
        self._check_space(step, state)
        self._unsealed.append(step)
        try:
            manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave({"iterator": states[0], "iterators": states,
                                        "log_window": log_window or {}}),
                config=ocp.args.JsonSave(self.config.to_dict()),
            ))
        except (OSError, ValueError) as error:  # tensorstore reports a full disk as ValueError
            raise self._write_failed(step, error) from None

    def _check_space(self, step: int, state: TrainState) -> None:
        """Refuses to start a checkpoint that the file system has no room for (Orbax fails
        part-way, from background threads, when it runs out): the state's bytes plus 10%."""
        directory = self.workdir / "checkpoints"
        needed = 1.1 * sum(leaf.nbytes for leaf in jax.tree.leaves(state)) + (1 << 20)
        free = shutil.disk_usage(directory if directory.is_dir() else self.workdir).free
        if free < needed:
            raise UserError(f"not enough space for the checkpoint of step {step} in {directory}:"
                            f" it needs about {needed / 1e6:.0f} MB, {free / 1e6:.0f} MB are "
                            "free; free some space and rerun to resume (earlier checkpoints "
                            "are intact)")

    def _write_failed(self, step: int, error: BaseException) -> UserError:
        """A one-line error for a checkpoint that could not be written; its partial files are
        removed so a rerun does not trip on them."""
        for partial in (self.workdir / "checkpoints").glob(f"{step}.orbax-checkpoint-tmp*"):
            shutil.rmtree(partial, ignore_errors=True)
        reason = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        return UserError(f"the checkpoint of step {step} could not be written in "
                         f"{self.workdir / 'checkpoints'} ({reason}); fix the file system (space,"
                         " permissions) and rerun to resume from the previous checkpoint")

    def seal_saved(self, manager: ocp.CheckpointManager) -> None:
        """Waits for the checkpoints this trainer saved to be finished, then seals them
        (`integrity.seal`: a CRC-32 per file, verified on restore)."""
        if not self._unsealed:
            return
        try:
            manager.wait_until_finished()
        except (OSError, ValueError) as error:  # the background write failed
            step, self._unsealed = self._unsealed[-1], []
            raise self._write_failed(step, error) from None
        if self.is_writer:
            for step in self._unsealed:
                directory = self.workdir / "checkpoints" / str(step)
                if directory.is_dir():  # not yet removed by keep_checkpoints
                    integrity.seal(directory)
        self._unsealed = []

    def restore(self, manager: ocp.CheckpointManager, step: int) -> tuple[TrainState, list[str]]:
        """Restores onto this trainer's mesh (the target tree carries the shardings) after
        verifying the checkpoint's seal; returns the state and the data positions of the
        processes that wrote it. A damaged checkpoint raises CorruptCheckpoint."""
        problem = integrity.verify(self.workdir / "checkpoints" / str(step))
        if problem:
            raise CorruptCheckpoint(problem)
        target = jax.tree.map(
            lambda sharding, subtree: jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), subtree),
            self.state_sharding, self.abstract_state,
            is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        # A checkpoint of an earlier version may name parameters differently: it is restored in
        # its own layout and its leaves put where `models.migration` says they now are.
        layout = saved_layout(self.workdir / "checkpoints" / str(step) / "state")
        renamed = migration.has_old_names(layout)
        restored = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_in_layout(target, layout) if renamed else target),
            data=ocp.args.JsonRestore(),
        ))
        state = _in_layout(restored["state"], target) if renamed else restored["state"]
        if not bool(_all_finite(state)):
            raise CorruptCheckpoint("it holds NaN or Inf values")
        data = restored["data"]
        return state, data.get("iterators") or [data["iterator"]]

    def restore_latest_readable(self, manager: ocp.CheckpointManager
                                ) -> tuple[TrainState, list[str]] | None:
        """The newest checkpoint that restores. Unreadable newer ones (truncated or corrupt
        files) are moved to `corrupt_checkpoints/`, with a warning naming what was wrong, once
        an older one has restored; if none restores, nothing is moved. None when there is no
        checkpoint."""
        steps = sorted(manager.all_steps(), reverse=True)
        unreadable: list[tuple[int, str]] = []
        for step in steps:
            try:
                restored = self.restore(manager, step)
            except Exception as error:  # noqa: BLE001  (any unreadable file: try the previous)
                unreadable.append((step, f"{type(error).__name__}: "
                                         f"{str(error).split('. See ')[0].splitlines()[0]}"))
                _quiet_failed_reads()
                continue
            for bad, reason in unreadable:
                print(f"warning: checkpoint {bad} in {self.workdir} cannot be restored "
                      f"({reason}); moved to {CORRUPT_DIR}/, resuming from step {step}",
                      file=sys.stderr, flush=True)
                self._set_aside(manager, bad)
            return restored
        if steps:
            raise UserError(f"no checkpoint in {self.workdir / 'checkpoints'} can be restored "
                            f"(step {unreadable[0][0]}: {unreadable[0][1][:200]}); start again "
                            "with a new --workdir")
        return None

    def _set_aside(self, manager: ocp.CheckpointManager, step: int) -> None:
        if self.is_writer:
            target = self.workdir / CORRUPT_DIR / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
            target.parent.mkdir(exist_ok=True)
            shutil.move(str(self.workdir / "checkpoints" / str(step)), target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"pretext: checkpoint {step} set aside")
        manager.reload()

    # ---------------------------------------------------------------------------- loop
    def data_iterator(self, state: TrainState | None = None, round_index: int = 0) -> Any:
        """The training loader; for a method trained in rounds (`registry.Rounds`), round
        `round_index`'s records as `state` decides them, read in order."""
        per_process = self.config.train.batch_size // jax.process_count()
        source, shuffle = self.data.train, not self.data.batch_layout
        if self.data.step_source is not None:  # the source orders its steps itself
            source, shuffle = self.data.step_source(self.config.train.batch_size), False
        if self.method.rounds is not None:
            source, shuffle = self.method.rounds.source(
                self.model_of(state), self.data, self.objective, self.config.train.seed,
                round_index, self.config.train.batch_size), False
        loader = make_loader(
            source, batch_size=per_process, seed=self.config.train.seed, shuffle=shuffle,
            transforms=self.data.transforms, worker_count=self.config.data.worker_count)
        return iter(loader)

    def round_starts(self, step: int) -> bool:
        """Whether a method trained in rounds begins one before `step` (1-based)."""
        rounds = self.method.rounds
        return rounds is not None and (step - 1) % rounds.every(self.objective) == 0

    def begin_round(self, state: TrainState, round_index: int) -> tuple[TrainState, Any]:
        """`registry.Rounds.begin` on the model of `state` (on the host), its optimizer state
        zeroed for the submodules it names; the new state on the mesh and the round's loader."""
        model = self.model_of(state)
        restart = self.method.rounds.begin(model, self.data, self.example_config,
                                           self.objective, self.config.train.seed, round_index)
        _, params, rest = nnx.split(model, nnx.Param, ...)

        def top_name(path: tuple[Any, ...]) -> Any:
            return next((k.key for k in path if isinstance(k, jax.tree_util.DictKey)), None)

        opt_state = jax.tree_util.tree_map_with_path(
            lambda path, leaf: jnp.zeros_like(leaf) if top_name(path) in restart else leaf,
            state.opt_state)
        state = TrainState(
            step=state.step, params=jax.device_put(params, self.state_sharding.params),
            model_state=jax.device_put(rest, self.state_sharding.model_state),
            opt_state=jax.device_put(opt_state, self.state_sharding.opt_state))
        return state, self.data_iterator(state, round_index)

    def _resume_data(self, iterator: Any, data_states: list[str], step: int) -> None:
        """Puts the loader where the checkpoint's was; records that are not the checkpoint's
        (other data, or the same files changed) are a UserError naming what differs."""
        fresh = iterator.get_state()
        saved = resilience.data_state_for_this_process(
            data_states, fresh, getattr(self.data.train, "earlier_descriptions", ()))
        changed = resilience.data_state_difference(saved, fresh)
        try:
            if changed is None:
                iterator.set_state(saved)
        except ValueError as error:  # Grain refuses for a reason not described above
            changed = str(error).splitlines()[0]
        if changed is not None:
            raise UserError(f"the checkpoint at step {step} in {self.workdir} was written while "
                            f"reading other data records ({changed}); restore that data or use "
                            "a new --workdir")

    def run(self, stop_after: int | None = None) -> dict[str, Any]:
        """Trains to `train.steps`, resuming from the latest checkpoint in the workdir.

        `stop_after` ends this call early at that step (with a checkpoint), as a preemption
        would; the schedule still spans `train.steps`. Returns a summary: final step, last
        train/eval metrics, and where things were written.
        """
        self.workdir.mkdir(parents=True, exist_ok=True)
        lock = integrity.WorkdirLock(self.workdir)
        if self.is_writer:  # one training job per workdir; its other processes write nothing
            lock.acquire()
        try:
            return self._train(lock, stop_after)
        finally:
            lock.release()

    def _train(self, lock: integrity.WorkdirLock, stop_after: int | None) -> dict[str, Any]:
        """`run` under the workdir lock. Nothing is written to the workdir before the resume
        checks (config, checkpoint, data position) have passed."""
        t = self.config.train
        self._check_existing_workdir()  # again: another run may have written it meanwhile
        manager = self.checkpoint_manager()
        restored = self.restore_latest_readable(manager)
        latest = None
        log_window: dict[str, Any] = {}
        iterator = None  # a method in rounds gets its loader when (or inside) a round begins
        rounds = self.method.rounds
        if restored is not None:
            state, data_states = restored
            latest = int(jax.device_get(state.step))
            log_window = self._checked_log_window(manager, latest)
            if not self.round_starts(latest + 1):
                iterator = self.data_iterator(
                    state, latest // rounds.every(self.objective) if rounds else 0)
                self._resume_data(iterator, data_states, latest)
        else:
            state = self.init_state()
            if rounds is None:
                iterator = self.data_iterator()
        if self.is_writer:  # the checks passed: this run owns the workdir now
            lock.record_owner()
            (self.workdir / CONFIG_FILE).write_text(self.config.to_json())
            write_model_json(self.workdir, self.method.name, self.model_config, self.objective)
            if self.data.tokenizer is not None:  # the text methods' (`export.find_tokenizer`)
                write_tokenizer(self.workdir, self.data.tokenizer)
        start = int(jax.device_get(state.step))
        writer = MetricWriter(self.workdir, total_steps=t.steps, start_step=start,
                              enabled=self.is_writer, progress=t.progress)
        if latest is not None:
            writer.print(f"resumed from step {start} in {self.workdir}")
        units = self.method.units_per_example(self.example_config) * t.batch_size
        last_train: dict[str, float] = {}
        last_eval: dict[str, float] = {}
        # The logging window: metric sums and steps since the last train row (continued from
        # the checkpoint); `timed` steps since `timer` started, for throughput only.
        sums = self._window_sums(log_window["sums"]) if log_window.get("sums") else None
        window = log_window.get("steps", 0)
        skipped = log_window.get("skipped", 0)
        timer, timed = time.perf_counter(), 0
        watch = resilience.PreemptionWatch()
        flags: list[tuple[int, jax.Array]] = []  # (step, non-finite flag) not yet looked at
        stopped_by = None
        profile = Profile(t.profile_steps, self.workdir / PROFILE_DIR, writer)
        try:
            end = t.steps if stop_after is None else min(stop_after, t.steps)
            # Batch s + 1 is read (Grain: records, transforms, host crops) while the devices
            # run step s, which is dispatched asynchronously (`train.prefetch`);
            # `trained_position` is the data position after the batches trained so far, which
            # is what a checkpoint keeps.
            trained_position = iterator.get_state() if iterator is not None else None
            if start < end and not self.round_starts(start + 1):
                batch, position = next(iterator), iterator.get_state()
            for step in range(start + 1, end + 1):
                if self.round_starts(step):  # a new round: its state and its loader
                    state, iterator = self.begin_round(
                        state, (step - 1) // rounds.every(self.objective))
                    batch, position = next(iterator), iterator.get_state()
                profile.before(step)
                state, metrics = self.train_step(state, batch)
                trained_position = position
                if step < end and not self.round_starts(step + 1):
                    if not t.prefetch:
                        jax.block_until_ready(metrics)
                    batch, position = next(iterator), iterator.get_state()
                if self.sync_every_step:
                    jax.block_until_ready(metrics)
                profile.after(step, metrics)
                flags.append((step, metrics["nonfinite_steps"][0]))
                sums = metrics if sums is None else jax.tree.map(jnp.add, sums, metrics)
                window += 1
                timed += 1
                preempted = watch.should_stop(step)
                due = (step % t.log_every == 0 or step % t.eval_every == 0 or step == end
                       or step % t.checkpoint_every == 0 or preempted)
                if due:  # one host read per boundary, not per step
                    skipped += self._check_finite(flags, manager)
                    flags = []
                if step % t.log_every == 0 or step == t.steps:
                    last_train = reduce_metrics(jax.device_get(sums))
                    elapsed = time.perf_counter() - timer
                    last_train["steps_per_s"] = timed / elapsed
                    last_train[f"{self.method.unit}_per_s"] = timed * units / elapsed
                    last_train["learning_rate"] = float(self.schedule(step - 1))
                    last_train["skipped_nonfinite_total"] = float(skipped)
                    writer.write(step, "train", last_train)
                    sums, window, timer, timed = None, 0, time.perf_counter(), 0
                writer.advance(1)
                if step % t.eval_every == 0 or step == t.steps:
                    last_eval = self.evaluate(state)
                    writer.write(step, "eval", last_eval)
                if step % t.checkpoint_every == 0 or step == end or preempted:
                    self.save(manager, state, trained_position, {
                        "steps": window, "skipped": skipped,
                        "sums": {name: [float(v) for v in pair] for name, pair in
                                 jax.device_get(sums).items()} if sums is not None else {}})
                if preempted:
                    stopped_by = watch.received
                    writer.print(f"{stopped_by}: stopped after step {step} with a checkpoint; "
                                 "run the same command again to resume")
                    break
        finally:
            watch.close()
            profile.close()
            try:
                self.seal_saved(manager)
            finally:  # a failed write was reported above; closing must not bury it
                with contextlib.suppress(Exception) if sys.exc_info()[0] else \
                        contextlib.nullcontext():
                    manager.close()
                    writer.close()
        curves = plot_curves(self.workdir) if self.is_writer else None
        return {"step": int(jax.device_get(state.step)), "train": last_train, "eval": last_eval,
                "report": self.data.report, "workdir": str(self.workdir),
                "curves": str(curves) if curves else None, "state": state,
                "stopped_by": stopped_by, "skipped_nonfinite": skipped}

    def _check_finite(self, flags: list[tuple[int, jax.Array]],
                      manager: ocp.CheckpointManager) -> int:
        """The number of non-finite steps among `flags`; with `train.on_nonfinite=stop` the
        first one raises NonFiniteStep naming the step, its examples in the data stream and
        the last checkpoint (nothing after it is saved)."""
        bad = [step for step, flag in zip((s for s, _ in flags),
                                          jax.device_get([f for _, f in flags]), strict=True)
               if flag > 0]
        if not bad or self.config.train.on_nonfinite == "skip":
            return len(bad)
        step, batch = bad[0], self.config.train.batch_size
        last = manager.latest_step()
        raise resilience.NonFiniteStep(
            f"non-finite loss, gradients or updated parameters at step {step} (examples "
            f"{(step - 1) * batch}-{step * batch - 1} of the training stream); the last good "
            "checkpoint is "
            f"{'step ' + str(last) if last is not None else 'none'} in "
            f"{self.workdir / 'checkpoints'}; lower optim.learning_rate, check that data, or "
            "set train.on_nonfinite=skip to skip such steps")

