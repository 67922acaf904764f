"""Transfer in more than one stage, each stage a run of the one trainer in its own folder of
the workdir (so a killed run resumes in the stage it was in, from that stage's checkpoints):

- Within-task continued pre-training, then fine-tuning (`run_two_stage`; Gururangan et al.
  2020 "Don't Stop Pretraining" §4 TAPT; Sun et al. 2019 "How to Fine-Tune BERT for Text
  Classification" §5.1): the checkpoint keeps pre-training with its own method's objective
  (its saved run config: BERT's MLM, ELECTRA's replaced-token detection, ...; for a
  HuggingFace checkpoint, the method that trains its model) on the task's own training text,
  without labels, in `<workdir>/continue`; the result is fine-tuned on the
  task in `<workdir>/finetune` (`pretrain.finetune`).
- MT-DNN (`run_multitask`; Liu et al. 2019 §3-4): the encoder trained on several GLUE tasks at
  once (`objectives.mtdnn`) in `<workdir>/multitask`, then optionally fine-tuned on each task
  alone in `<workdir>/<task>` (§3, "fine-tune the model on each task").

Every refusal (task, starting point, settings, the workdir's earlier plan) is checked before
anything is written."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import glue
from pretext_jax.models.layers import Frozen
from pretext_jax.objectives import registry
from pretext_jax.objectives.mtdnn import MTDNN, MultiTaskExampleConfig, glue_tasks
from pretext_jax.pretrain import directories, hf
from pretext_jax.pretrain.checkpoints import TrainState
from pretext_jax.pretrain.config import Config, as_override, config_from_dict, make_config
from pretext_jax.pretrain.directories import CONFIG_FILE
from pretext_jax.pretrain.finetune import (
    RESULTS_FILE,
    as_overrides,
    file_overrides,
    finetune,
    finetune_config,
    finetune_seeds,
    is_finetuning,
    tokenizer_of,
)
from pretext_jax.pretrain.loading import load_model
from pretext_jax.pretrain.trainer import Trainer

PLAN_FILE = "transfer.json"
CONTINUE, FINETUNE, MULTITASK = "continue", "finetune", "multitask"
CORPUS_FILE = "task_text.txt"
STAGE_PREFIX = "continue."  # overrides for the continued pre-training stage only
EACH_PREFIX = "each."  # overrides for MT-DNN's per-task fine-tuning runs only
TAPT_WARMUP = 0.06  # Gururangan et al. 2020 Appendix B (Table 13): warmup over 6 % of the steps
# MT-DNN §4: Adamax at 5e-5 (AdamW here), batch 32, 5 epochs, linear decay after warmup over
# 0.1 of the steps, task-layer dropout 0.1, gradient-norm clip 1.
MTDNN_SETTINGS = {"optim.learning_rate": 5e-5, "train.batch_size": 32,
                  "model.classifier_dropout": 0.1, "optim.clip_norm": 1.0,
                  "optim.schedule": "linear"}
MTDNN_EPOCHS, MTDNN_WARMUP = 5.0, 0.1


def _check_plan(workdir: Path, plan: dict[str, Any]) -> None:
    """Refuses a workdir that holds another multi-stage run, or another run at all."""
    saved = workdir / PLAN_FILE
    if saved.is_file():
        earlier = directories.read_json_object(saved)
        if earlier != plan:
            changed = sorted(key for key in {*plan, *earlier} if plan.get(key) != earlier.get(key))
            raise UserError(f"--workdir {workdir} holds another transfer run (it differs in "
                            f"{', '.join(changed)}); use a new --workdir or the same options")
    elif workdir.is_dir() and any(workdir.iterdir()):
        raise UserError(f"--workdir {workdir} is not empty and holds no {PLAN_FILE}; a "
                        "multi-stage run needs a new or empty --workdir")


def _write_plan(workdir: Path, plan: dict[str, Any]) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    if not (workdir / PLAN_FILE).is_file():
        (workdir / PLAN_FILE).write_text(json.dumps(plan, indent=2))


@contextlib.contextmanager
def _taken_back_on_refusal(workdir: Path) -> Iterator[None]:
    """A refusal (UserError) inside removes `workdir` if this call made it and no stage has a
    checkpoint yet, so bad input found only once a stage's data is read changes nothing."""
    existed = workdir.exists()
    try:
        yield
    except UserError:
        if not existed and not any(workdir.glob("*/checkpoints/[0-9]*")):
            shutil.rmtree(workdir, ignore_errors=True)
        raise


def _split_overrides(overrides: Sequence[str], prefix: str) -> tuple[list[str], list[str]]:
    """(the overrides prefixed `prefix`, without it: another stage's; the others)."""
    stage = [o[len(prefix):] for o in overrides if o.startswith(prefix)]
    return stage, [o for o in overrides if not o.startswith(prefix)]


# --------------------------------------------------------------- continued pre-training
def continued_config(init: str, corpus: Path, steps: int, overrides: Sequence[str] = ()
                     ) -> Config:
    """The run that continues pre-training `init` with its own method on the text file `corpus`
    for `steps` steps. `init` is a pretext workdir (its saved config) or a HuggingFace
    checkpoint (`hf_pretraining_settings`: TAPT from an HF model, as Gururangan et al. 2020
    continue roberta-base); then that corpus, the checkpoint's own tokenizer, no held-out file
    or cache of the original corpus, a fresh optimizer warmed up over 6 % of the steps (TAPT's
    schedule); `overrides` (key=value) win."""
    if hf.is_checkpoint(init):
        base, file = hf_pretraining_settings(init), None
    else:
        file = Path(init) / CONFIG_FILE
        if not file.is_file():
            raise UserError(f"--continue-steps continues a pretext pre-training run or a "
                            f"HuggingFace checkpoint: {init} has no {CONFIG_FILE} (a model "
                            "directory has no objective to continue); pass its pre-training "
                            "workdir, or drop --continue-steps")
        base = []
        saved = config_from_dict(directories.read_json_object(file))
        if is_finetuning(registry.get(saved.method)) or saved.method == MTDNN:
            raise UserError(f"{init} holds a {saved.method} fine-tuning run; --continue-steps "
                            "continues a pre-trained checkpoint")
    values = {"data.source": corpus, "data.text_format": "auto", "data.eval_source": "",
              "data.cache_dir": "", "data.tokenizer": tokenizer_of(init), "train.steps": steps,
              "optim.warmup_steps": max(1, round(TAPT_WARMUP * steps))}
    config = make_config(None, [*base, *as_overrides(values), *overrides], file=file)
    if any(override.startswith("train.checkpoint_every=") for override in overrides):
        return config
    return dataclasses.replace(config, train=dataclasses.replace(
        config.train, checkpoint_every=min(config.train.checkpoint_every, steps)))


def hf_pretraining_settings(init: str) -> list[str]:
    """The overrides of a run that continues pre-training the HuggingFace checkpoint `init`:
    the method that trains its model (`registry.method_of_model`; BERT for a `BertModel` or
    `BertForPreTraining`, ...) at that method's default settings, the checkpoint's
    architecture. Heads the checkpoint lacks (a bare `BertModel` has no MLM head) start at
    their initial values, with `hf.read`'s warning."""
    model = hf.load(init)
    method = registry.get(hf.method_name(model))
    if is_finetuning(method) or not isinstance(model.config, method.model_config):
        raise UserError(f"{init} holds a {type(model).__name__}, which no pre-training method "
                        "continues; --continue-steps takes a pre-trained checkpoint (e.g. "
                        "BertForPreTraining, RobertaForMaskedLM)")
    return [f"method={method.name}", *(f"model.{key}={as_override(value)}" for key, value in
                                       dataclasses.asdict(model.config).items())]


def task_text(task: registry.DownstreamTask, data: str, config: Config) -> str:
    """The task's training rows the fine-tuning run `config` reads, without labels, as a
    corpus (`DownstreamTask.train_text`): one document per row, its sentence(s) one per line,
    documents apart by a blank line."""
    return "\n\n".join("\n".join(sentences)
                       for sentences in task.train_text(data, config)) + "\n"


class ContinuedPretraining(Trainer):
    """The trainer of the continued pre-training stage: a fresh run starts from the checkpoint
    `source`'s whole pre-training network (heads included; its BatchNorm statistics and frozen
    weights too, as `Trainer.init_state` takes a pre-trained model's) under a fresh optimizer;
    a resumed one from its own checkpoints."""

    def __init__(self, config: Config, workdir: str | Path, source: str):
        self.source = source
        super().__init__(config, workdir)

    def init_state(self) -> TrainState:
        state = super().init_state()
        model = hf.load(self.source) if hf.is_checkpoint(self.source) else load_model(self.source)
        fresh = nnx.merge(self.graphdef, state.params, state.model_state)
        nnx.update(fresh, nnx.state(model, nnx.Any(Frozen, nnx.BatchStat)))
        rest = jax.device_put(nnx.state(fresh, nnx.Not(nnx.Param)),
                              self.state_sharding.model_state)
        params = jax.device_put(nnx.state(model, nnx.Param), self.state_sharding.params)
        return dataclasses.replace(state, params=params, model_state=rest)


def run_two_stage(task: str, init: str, data: str, workdir: str | Path, continue_steps: int,
                  overrides: Sequence[str] = (), *, seeds: Sequence[int] = (0,),
                  epochs: float | None = None, config_file: str | Path | None = None,
                  recipe: str = "") -> dict[str, Any]:
    """Continues pre-training `init` on `task`'s training text for `continue_steps` steps in
    `<workdir>/continue` (`continued_config`; overrides prefixed `continue.` are its), then
    fine-tunes the result on `task` in `<workdir>/finetune` (one seed) or
    `<workdir>/finetune/seed<k>` (`finetune_seeds`), the other overrides applying there.
    A rerun resumes the stage it stopped in. Writes `<workdir>/results.json`."""
    root = Path(workdir)
    stage_overrides, tuning_overrides = _split_overrides(overrides, STAGE_PREFIX)
    spec = registry.downstream_task(task)
    if spec.train_text is None:
        raise UserError(f"--continue-steps continues pre-training on the task's own text, which "
                        f"{spec.name} does not give; fine-tune without it")
    first = root / CONTINUE
    # Every refusal before anything is written: the plan, both stages' configs and folders.
    plan = {"task": spec.name, "init": str(Path(init).absolute()),
            "continue_steps": continue_steps, "data": data}
    _check_plan(root, plan)
    config = continued_config(init, first / CORPUS_FILE, continue_steps, stage_overrides)
    directories.check_workdir(first, config)
    if not any(o.startswith("data.tokenizer=") for o in tuning_overrides):
        # the continued run's tokenizer is the checkpoint's: known before that run exists
        tuning_overrides.append(f"data.tokenizer={config.data.tokenizer}")
    tuning = [finetune_config(task, init, data, tuning_overrides, seed=seed, epochs=epochs,
                              config_file=config_file, recipe=recipe) for seed in seeds]
    for seed, tuned in zip(seeds, tuning, strict=True):
        folder = root / FINETUNE / (f"seed{seed}" if len(seeds) > 1 else "")
        directories.check_workdir(folder, dataclasses.replace(
            tuned, model=dataclasses.replace(tuned.model, init=str(first))))
    with _taken_back_on_refusal(root):
        _write_plan(root, plan)
        first.mkdir(exist_ok=True)
        if not (first / CORPUS_FILE).is_file():
            (first / CORPUS_FILE).write_text(task_text(spec, data, tuning[0]))
        if directories.checkpoint_step(first) != continue_steps:
            summary = ContinuedPretraining(config, first, init).run()
            if summary["stopped_by"]:
                return {"stage": CONTINUE, "step": summary["step"],
                        "stopped_by": summary["stopped_by"]}
    if len(seeds) > 1:
        result = finetune_seeds(task, str(first), data, root / FINETUNE, seeds,
                                tuning_overrides, epochs=epochs, config_file=config_file,
                                recipe=recipe)
    else:
        result = finetune(finetune_config(task, str(first), data, tuning_overrides,
                                          seed=seeds[0], epochs=epochs,
                                          config_file=config_file, recipe=recipe),
                          root / FINETUNE)
    result = {**result, "continued_from": init, "continue_steps": continue_steps}
    (root / RESULTS_FILE).write_text(json.dumps(result, indent=2))
    return result


# --------------------------------------------------------------------------- MT-DNN
def multitask_config(tasks: Sequence[str], init: str, data: str,
                     overrides: Sequence[str] = (), *, seed: int = 0,
                     epochs: float | None = None, architecture: str = "",
                     config_file: str | Path | None = None) -> Config:
    """MT-DNN's run on `tasks` from `init` (empty: random, shaped like `architecture`): the
    encoder family's model and optimizer settings as it fine-tunes the first task
    (`registry.downstream_recipe`), MT-DNN's (§4: `MTDNN_SETTINGS`, 5 epochs, warmup 0.1)
    over them, then the `config_file`'s and `overrides`. An epoch is every task's batches
    once (`input_pipeline.multitask.MultiTaskBatches`)."""
    names = ",".join(glue.glue_task(name).name for name in tasks)
    glue_tasks(MultiTaskExampleConfig(tasks=names))  # two or more, none twice
    single = finetune_config(tasks[0], init, data, seed=seed, architecture=architecture)
    fields = {f.name for f in dataclasses.fields(registry.get(MTDNN).model_config)}
    values = {**{f"model.{k}": v for k, v in dataclasses.asdict(single.model).items()
                 if k in fields and k != "task_labels"},
              **{f"optim.{k}": v for k, v in dataclasses.asdict(single.optim).items()},
              "method": MTDNN, "examples.tasks": names,
              "examples.max_seq_length": single.examples.max_seq_length,
              "examples.layout": single.examples.layout, "data.source": data,
              "data.tokenizer": single.data.tokenizer, "train.seed": seed,
              "train.eval_batches": 1, **MTDNN_SETTINGS}
    everything = [*as_overrides(values), *file_overrides(config_file), *overrides]
    draft = make_config(None, everything)
    per_epoch = sum(math.ceil(_rows(name, data, draft) / draft.train.batch_size)
                    for name in names.split(","))
    steps = max(1, math.ceil((MTDNN_EPOCHS if epochs is None else epochs) * per_epoch))
    schedule = {"train.steps": steps, "optim.warmup_steps": max(1, round(MTDNN_WARMUP * steps)),
                "train.eval_every": per_epoch, "train.checkpoint_every": per_epoch,
                "train.log_every": max(1, min(50, per_epoch))}
    return make_config(None, [*as_overrides(values), *as_overrides(schedule),
                              *file_overrides(config_file), *overrides])


def _rows(task: str, data: str, config: Config) -> int:
    """Training rows of GLUE `task` the run reads (`examples.max_train_examples` per task)."""
    count = len(glue.read_glue(data, task, "train", config.data.tfds_data_dir or None).labels)
    return min(count, config.examples.max_train_examples or count)


def run_multitask(tasks: Sequence[str], init: str, data: str, workdir: str | Path,
                  overrides: Sequence[str] = (), *, seed: int = 0, epochs: float | None = None,
                  architecture: str = "", config_file: str | Path | None = None,
                  finetune_each: bool = False, finetune_epochs: float | None = None
                  ) -> dict[str, Any]:
    """MT-DNN on `tasks` in `<workdir>/multitask` (`multitask_config`), then with
    `finetune_each` every task fine-tuned from the multi-task model in `<workdir>/<task>` (its
    family's recipe, `finetune_epochs` or the recipe's; the overrides prefixed `each.` apply
    there, the others to the multi-task run). A rerun resumes where it stopped.
    Returns and writes `<workdir>/results.json`: the multi-task model's dev metrics per task
    and, with `finetune_each`, each fine-tuned run's."""
    root = Path(workdir)
    plan = {"tasks": [glue.glue_task(t).name for t in tasks], "data": data, "seed": seed,
            "init": str(Path(init).absolute()) if init else ""}
    _check_plan(root, plan)
    each, overrides = _split_overrides(overrides, EACH_PREFIX)
    config = multitask_config(tasks, init, data, overrides, seed=seed, epochs=epochs,
                              architecture=architecture, config_file=config_file)
    directories.check_workdir(root / MULTITASK, config)
    if finetune_each:  # the fine-tuning runs' settings, as they will be from the new model
        for name in plan["tasks"]:
            finetune_config(name, init, data, each, seed=seed, epochs=finetune_epochs,
                            architecture=architecture)
    with _taken_back_on_refusal(root):
        _write_plan(root, plan)
        summary = Trainer(config, root / MULTITASK).run()
    evaluation = summary["eval"] or _evaluate(config, root / MULTITASK)
    result: dict[str, Any] = {"tasks": plan["tasks"], "steps": summary["step"],
                              "multitask": {k: v for k, v in evaluation.items() if k != "loss"},
                              "majority_baseline": summary["report"]["majority_baseline"]}
    if finetune_each:
        result["finetuned"] = {name: finetune(finetune_config(
            name, str(root / MULTITASK), data, each, seed=seed, epochs=finetune_epochs),
            root / name) for name in plan["tasks"]}
    (root / RESULTS_FILE).write_text(json.dumps(result, indent=2))
    return result


def _evaluate(config: Config, workdir: Path) -> dict[str, float]:
    """The held-out metrics of a finished run's latest checkpoint (a rerun trains no step, so
    it evaluates nothing)."""
    trainer = Trainer(config, workdir)
    state, _ = trainer.checkpoints.restore(trainer.checkpoints.latest_step())
    trainer.checkpoints.close()
    return trainer.evaluate(state)
