"""The one trainer: sharded state, a jit-compiled step with donation, evaluation, the loop.

It knows no method by name: the registry supplies the model, loss and data, and the method's
data says which records feed each step (`registry.PreparedData.segments`, read by
`pretrain.feed`); checkpoints are `pretrain.checkpoints`'. Determinism: the dropout RNG of step
s is fold_in(key(seed), s) and the data order is Grain's (seeded, index based), so a resumed
run reproduces an uninterrupted one exactly.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import prepare
from pretext_jax.models.layers import Frozen
from pretext_jax.objectives import registry
from pretext_jax.pretrain import directories, integrity, optim, resilience
from pretext_jax.pretrain import mesh as mesh_lib
from pretext_jax.pretrain.checkpoints import (
    CheckpointStore,
    CorruptCheckpoint,  # noqa: F401  (part of the trainer's interface)
    TrainState,
    check_resume,
)
from pretext_jax.pretrain.config import Config
from pretext_jax.pretrain.feed import StepFeed, open_loader, records_in_device_memory
from pretext_jax.pretrain.loading import load_pretrained
from pretext_jax.pretrain.metrics import MetricWriter, plot_curves, reduce_metrics
from pretext_jax.pretrain.profiling import PROFILE_DIR, Profile
from pretext_jax.pretrain.step import gather_rows, update_step


def data_cache(config: Config, workdir: str | Path) -> Path:
    """Where prepared records live: `data.cache_dir`, else `<workdir>/data`."""
    return Path(config.data.cache_dir) if config.data.cache_dir else Path(workdir) / "data"


def check_before_writing(config: Config, workdir: Path, read_inputs: bool = True
                         ) -> dict[str, Any]:
    """The checks a run passes before it prepares or writes anything: the workdir
    (`directories.check_workdir`) and, when it holds checkpoints, that they continue this config
    on the same input files (`checkpoints.check_resume`). Returns the inputs' fingerprint
    (`prepare.inputs_fingerprint`) that the checkpoints save; {} with `read_inputs` false (a
    run given its data, which reads none of `config.data`'s files)."""
    directories.check_workdir(workdir, config)
    inputs = prepare.inputs_fingerprint(config.data) if read_inputs else {}
    check_resume(workdir, config, inputs)
    return inputs


def prepare_data(config: Config, workdir: str | Path) -> registry.PreparedData:
    """The method's data preparation alone (`run.py prepare`): the records that `pretrain` with
    the same config and workdir (or `data.cache_dir`) then reuses; nothing else is written, and
    nothing at all for a workdir that `pretrain` would refuse (`check_before_writing`)."""
    check_before_writing(config, Path(workdir).absolute())
    method = registry.get(config.method)
    return method.prepare(config.data, config.examples, data_cache(config, workdir),
                          config.train.seed)


class Trainer:
    """Builds everything for `config` in `workdir`; `run()` trains (resuming if possible).

    Nothing is written to `workdir` until the config, mesh, batch layout, the workdir and its
    checkpoints (`check_before_writing`, then `run`'s `check_writable`) and data have been
    validated, so bad input never changes an existing workdir; a run stopped by bad input
    before its first checkpoint takes back what it wrote (`run`).
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
        mesh_lib.check_batch(self.mesh, config.train.batch_size, config.optim.grad_accum_steps)
        # The config the data's segments see: the mesh's resolved sizes (batches within a token
        # budget size their rows by them, `registry.row_multiple`).
        self.run_config = dataclasses.replace(config, mesh=dataclasses.replace(
            config.mesh, **{axis: self.mesh.shape[axis] for axis in mesh_lib.MESH_AXES}))
        self.inputs = check_before_writing(config, self.workdir, read_inputs=data is None)
        self.example_config = config.examples
        cache = data_cache(config, self.workdir)
        created = [p for p in (self.workdir, cache) if not p.exists()]
        prepared = data is not None
        try:
            self.data = data or self._prepare(cache)
            prepared = True
            self.model_config = self._resolve_model_config()
            self.objective = self._resolve_objective()
            resolution = self.method.resolution
            if resolution.complete_data is not None:
                self.data = resolution.complete_data(self.data, self.model_config,
                                                     self.objective, load_pretrained)
            self.data.segment(1, self.run_config)  # a layout that refuses this batch says so now
            self.rows = None  # every training record, when they live in device memory
            if config.train.records_in_device_memory:
                self.data, self.rows = records_in_device_memory(self.data)
        except BaseException:
            # A preparation that stopped part-way keeps its finished shards for the rerun.
            if prepared or not prepare.has_finished_shards(cache):
                for path in created:  # leave the file system as it was
                    shutil.rmtree(path, ignore_errors=True)
            raise
        self.is_writer = jax.process_index() == 0
        self.per_process_batch = config.train.batch_size // jax.process_count()
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
        settings filled in (`Resolution.run_settings`)."""
        objective = self.config.objective
        if self.method.resolution.run_settings is not None:
            objective = self.method.resolution.run_settings(objective, self.config)
        return objective

    # ------------------------------------------------------------------------ building
    def _build(self) -> None:
        self.loss_fn = self.method.bind_loss(self.objective)
        total_steps = self.config.train.steps
        labels = optim.adapter_labels if getattr(self.model_config, "adapter_size", 0) else None
        self.tx = optim.make_optimizer(self.config.optim, total_steps, labels)
        self.schedule = optim.learning_rate_schedule(self.config.optim, total_steps)
        seed = self.config.train.seed
        abstract_model = nnx.eval_shape(lambda: self.method.build_model(self.model_config, seed))
        self.graphdef, abstract_params, abstract_rest = nnx.split(abstract_model, nnx.Param, ...)
        self.parameters = optim.trained_parameters(abstract_params, labels)
        param_shardings = mesh_lib.state_shardings(abstract_params, self.mesh)
        rest_shardings = mesh_lib.state_shardings(abstract_rest, self.mesh)
        abstract_opt = jax.eval_shape(self.tx.init, abstract_params)
        opt_shardings = mesh_lib.optimizer_shardings(abstract_opt, param_shardings, self.mesh)
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
        if self.rows is not None:
            self.rows = jax.device_put(self.rows, replicated)
            self._gather = jax.jit(gather_rows, out_shardings=self.batch_sharding)
        self.checkpoints = CheckpointStore(self.workdir, self.config, self.inputs,
                                           self.abstract_state, self.state_sharding,
                                           is_writer=self.is_writer)

    def _init_state(self) -> TrainState:
        model = self.method.build_model(self.model_config, self.config.train.seed)
        _, params, rest = nnx.split(model, nnx.Param, ...)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=rest,
                          opt_state=self.tx.init(params))

    def init_state(self) -> TrainState:
        """Fresh, sharded train state (jit-compiled init: parameters are created in place),
        with the method's pre-trained parameters, BatchNorm statistics and `Frozen` weights (a
        teacher) put in place of the random ones and the variables the data decides
        (`PreparedData.model_variables`) set."""
        state = self._with_data_variables(self._init())
        pretrained = self.method.start.pretrained
        model = (pretrained(self.model_config, self.config.train.seed, load_pretrained)
                 if pretrained else None)
        if model is None:
            return state
        fresh = nnx.merge(self.graphdef, state.params, state.model_state)
        nnx.update(fresh, nnx.state(model, nnx.Any(Frozen, nnx.BatchStat)))
        rest = jax.device_put(nnx.state(fresh, nnx.Not(nnx.Param)), self.state_sharding.model_state)
        params = jax.device_put(nnx.state(model, nnx.Param), self.state_sharding.params)
        return dataclasses.replace(state, params=params, model_state=rest)

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
        """One optimizer step (`pretrain.step.update_step`) of the method's loss."""
        return update_step(state, batch, loss=self._loss, tx=self.tx,
                           seed=self.config.train.seed, accum=self.config.optim.grad_accum_steps,
                           skip_nonfinite=self.config.train.on_nonfinite == "skip")

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
        batch = self.to_global(local_batch)
        if self.rows is not None:  # record indices: the records are gathered on the device
            batch = self._gather(self.rows, batch)
        return self._train_step(state, batch)

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
        monitor = self.method.evaluation.monitor
        if monitor is not None:
            results.update(monitor(self.model_of(state), self.data, self.example_config,
                                   self.objective))
        return results

    # ---------------------------------------------------------------------------- data
    def data_iterator(self, state: TrainState | None = None, step: int = 1) -> Any:
        """The loader of the segment that holds `step`, from that segment's start, as the
        model of `state` (default: a fresh one) finds it (its `begin` not run)."""
        segment = self.data.segment(step, self.run_config)
        model = self.model_of(state if state is not None else self.init_state())
        return open_loader(self.data, segment, model, self.run_config, self.per_process_batch)

    def begin_segment(self, state: TrainState, segment: registry.Segment) -> TrainState:
        """`segment.begin` on the model of `state` (on the host), the optimizer state zeroed for
        the submodules it names; the new state on the mesh (DeepCluster: a new round)."""
        model = self.model_of(state)
        restart = segment.begin(model)
        _, params, rest = nnx.split(model, nnx.Param, ...)

        def top_name(path: tuple[Any, ...]) -> Any:
            return next((k.key for k in path if isinstance(k, jax.tree_util.DictKey)), None)

        opt_state = jax.tree_util.tree_map_with_path(
            lambda path, leaf: jnp.zeros_like(leaf) if top_name(path) in restart else leaf,
            state.opt_state)
        return TrainState(
            step=state.step, params=jax.device_put(params, self.state_sharding.params),
            model_state=jax.device_put(rest, self.state_sharding.model_state),
            opt_state=jax.device_put(opt_state, self.state_sharding.opt_state))

    # ---------------------------------------------------------------------------- loop
    def run(self, stop_after: int | None = None, deadline: float | None = None
            ) -> dict[str, Any]:
        """Trains to `train.steps`, resuming from the latest checkpoint in the workdir.

        `stop_after` ends this call early at that step (with a checkpoint), as a preemption
        would; the schedule still spans `train.steps`. `deadline` (a `time.monotonic()` value;
        one process only) likewise ends it after the first step begun past it, so a
        time-boxed job stops with a checkpoint. Returns a summary: final step, last train/eval
        metrics, where things were written, and `stopped_by` (the signal, "time limit" or None).
        """
        if deadline is not None and jax.process_count() > 1:
            raise ValueError("run(deadline=...) is for one process: each process's clock "
                             "would stop it at a different step")
        directories.check_writable(self.workdir)  # only training writes (eval reads)
        existed = self.workdir.is_dir()
        self.workdir.mkdir(parents=True, exist_ok=True)
        lock = integrity.WorkdirLock(self.workdir)
        if self.is_writer:  # one training job per workdir; its other processes write nothing
            lock.acquire()
        before = set(self.workdir.iterdir())
        try:
            return self._train(lock, stop_after, deadline)
        except UserError as error:
            # bad input before the first checkpoint: take back what the run wrote
            if (self.is_writer and not isinstance(error, resilience.NonFiniteStep)
                    and not any(p.name.isdigit() for p in self.checkpoints.directory.glob("*"))):
                directories.take_back(self.workdir, before, existed,
                                      keep=data_cache(self.config, self.workdir))
            raise
        finally:
            lock.release()

    def _start(self, lock: integrity.WorkdirLock) -> tuple[TrainState, StepFeed, dict[str, Any]]:
        """(the state to continue from, the feed positioned for its next step, the unlogged
        metrics window): the latest readable checkpoint or a fresh state. Nothing is written to
        the workdir before the resume checks (config, checkpoint, data position) have passed."""
        # Again: another run may have written the workdir meanwhile.
        directories.check_workdir(self.workdir, self.config)
        feed = StepFeed(self.data, self.run_config, self.per_process_batch, self.model_of,
                        self.begin_segment)
        restored = self.checkpoints.restore_latest_readable()
        log_window: dict[str, Any] = {}
        if restored is not None:
            state, saved = restored
            latest = int(jax.device_get(state.step))
            log_window = saved["log_window"]
            feed.resume(state, latest + 1, saved["iterators"],
                        f"the checkpoint at step {latest} in {self.workdir}")
        else:
            state = self.init_state()
        if self.is_writer:  # the checks passed: this run owns the workdir now
            lock.record_owner()
            directories.record_run(self.workdir, self.config, self.model_config,
                                   self.objective, self.data.tokenizer)
        return state, feed, log_window

    def _train(self, lock: integrity.WorkdirLock, stop_after: int | None,
               deadline: float | None) -> dict[str, Any]:
        """`run` under the workdir lock."""
        t = self.config.train
        state, feed, log_window = self._start(lock)
        start = int(jax.device_get(state.step))
        writer = MetricWriter(self.workdir, total_steps=t.steps, start_step=start,
                              enabled=self.is_writer, progress=t.progress)
        if start:  # restored from a checkpoint
            writer.print(f"resumed from step {start} in {self.workdir}")
        if self.parameters["trained"] < self.parameters["total"]:
            writer.print(f"training {self.parameters['trained']:,} of "
                         f"{self.parameters['total']:,} parameters (the rest frozen)")
        units = self.method.units_per_example(self.example_config) * t.batch_size
        last_train: dict[str, float] = {}
        last_eval: dict[str, float] = {}
        # The logging window: metric sums and steps since the last train row (continued from
        # the checkpoint); `timed` steps since `timer` started, for throughput only.
        sums = self._window_sums(log_window["sums"]) if log_window.get("sums") else None
        window = log_window.get("steps", 0)
        skipped = log_window.get("skipped", 0)
        timer, timed, timed_units = time.perf_counter(), 0, 0
        watch = resilience.PreemptionWatch()
        flags: list[tuple[int, jax.Array]] = []  # (step, non-finite flag) not yet looked at
        stopped_by = None
        profile = Profile(t.profile_steps, self.workdir / PROFILE_DIR, writer,
                          settle=self.checkpoints.seal_saved)
        try:
            end = t.steps if stop_after is None else min(stop_after, t.steps)
            for step in range(start + 1, end + 1):
                state, batch = feed.batch(state, step)
                profile.before(step)
                # Batches within a token budget count their real tokens (`feed.units`).
                timed_units += units if feed.units is None else feed.units
                state, metrics = self.train_step(state, batch)
                if step < end:  # batch s + 1 is read while the devices run step s
                    if not t.prefetch:
                        jax.block_until_ready(metrics)
                    feed.read_ahead(step + 1)
                if self.sync_every_step:
                    jax.block_until_ready(metrics)
                profile.after(step, metrics)
                flags.append((step, metrics["nonfinite_steps"][0]))
                sums = metrics if sums is None else jax.tree.map(jnp.add, sums, metrics)
                window += 1
                timed += 1
                preempted = watch.should_stop(step) or (
                    deadline is not None and time.monotonic() >= deadline)
                if (step % t.log_every == 0 or step % t.eval_every == 0 or step == end
                        or step % t.checkpoint_every == 0 or preempted):
                    skipped += self._check_finite(flags, feed.segment)  # one read per boundary
                    flags = []
                if step % t.log_every == 0 or step == t.steps:
                    last_train = reduce_metrics(jax.device_get(sums))
                    elapsed = time.perf_counter() - timer
                    last_train["steps_per_s"] = timed / elapsed
                    last_train[f"{self.method.unit}_per_s"] = timed_units / elapsed
                    last_train["learning_rate"] = float(self.schedule(step - 1))
                    last_train["skipped_nonfinite_total"] = float(skipped)
                    writer.write(step, "train", last_train)
                    sums, window, timer, timed = None, 0, time.perf_counter(), 0
                    timed_units = 0
                writer.advance(1)
                if step % t.eval_every == 0 or step == t.steps:
                    last_eval = self.evaluate(state)
                    writer.write(step, "eval", last_eval)
                if step % t.checkpoint_every == 0 or step == end or preempted:
                    self.checkpoints.save(state, feed.position, {
                        "steps": window, "skipped": skipped,
                        "sums": {name: [float(v) for v in pair] for name, pair in
                                 jax.device_get(sums).items()} if sums is not None else {}})
                if preempted:
                    stopped_by = watch.received or "time limit"
                    writer.print(f"{stopped_by}: stopped after step {step} with a checkpoint; "
                                 "run the same command again to resume")
                    break
        finally:
            watch.close()
            profile.close()
            try:
                self.checkpoints.close()
            finally:
                writer.close()
        curves = plot_curves(self.workdir) if self.is_writer else None
        return {"step": int(jax.device_get(state.step)), "train": last_train, "eval": last_eval,
                "report": self.data.report, "workdir": str(self.workdir),
                "parameters": self.parameters, "curves": str(curves) if curves else None,
                "state": state, "stopped_by": stopped_by, "skipped_nonfinite": skipped}

    def _check_finite(self, flags: list[tuple[int, jax.Array]],
                      segment: registry.Segment | None) -> int:
        """The number of non-finite steps among `flags`; with `train.on_nonfinite=stop` the
        first one raises NonFiniteStep naming the step, its examples in the data stream (its
        batch's place where `segment` reads whole batches of varying rows) and the last
        checkpoint (nothing after it is saved)."""
        bad = [step for step, flag in zip((s for s, _ in flags),
                                          jax.device_get([f for _, f in flags]), strict=True)
               if flag > 0]
        if not bad or self.config.train.on_nonfinite == "skip":
            return len(bad)
        step, batch = bad[0], self.config.train.batch_size
        last = self.checkpoints.latest_step()
        where = (f"batch {step - 1} of the training stream, counted from 0"
                 if segment is not None and segment.whole_batches else
                 f"examples {(step - 1) * batch}-{step * batch - 1} of the training stream")
        raise resilience.NonFiniteStep(
            f"non-finite loss, gradients or updated parameters at step {step} ({where}); "
            "the last good "
            "checkpoint is "
            f"{'step ' + str(last) if last is not None else 'none'} in "
            f"{self.workdir / 'checkpoints'}; lower optim.learning_rate, check that data, or "
            "set train.on_nonfinite=skip to skip such steps")

