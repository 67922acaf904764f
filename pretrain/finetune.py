"""Fine-tuning and evaluation on downstream tasks (GLUE's, and every task a downstream method
registers, `registry.register_task`) with the one trainer.

`finetune_config` turns (task, starting point, data) into the run of the downstream method
that claims what the starting point holds (`registry.downstream_recipe`): each family declares
its paper's recipe as its `Start.finetunes` (BERT, ELECTRA, RoBERTa, ALBERT, MPNet, XLNet and
XLM fine-tune under the task's method, `classify` for GLUE,
`objectives.common.classifier_recipes`; an ELMo biLM under its scalar mix). `glue` runs every
GLUE task over several seeds and reports the median, as the papers do."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import glue
from pretext_jax.objectives import registry
from pretext_jax.objectives.common.classifier_recipes import as_encoder, read_pretrained
from pretext_jax.pretrain import directories
from pretext_jax.pretrain.config import (
    Config,
    as_override,
    config_from_dict,
    make_config,
    read_config_file,
)
from pretext_jax.pretrain.directories import CONFIG_FILE
from pretext_jax.pretrain.loading import load_pretrained
from pretext_jax.pretrain.trainer import Trainer

RESULTS_FILE = "results.json"
TABLE_FILE = "results.md"
SUBSET_FILE = "label_subset.json"
GLUE_ORDER = ("cola", "sst2", "mrpc", "stsb", "rte")


def tokenizer_of(init: str) -> str:
    """The tokenizer a starting point was trained with: a HuggingFace folder's own vocab
    (BERT's `vocab.txt`, XLNet's `spiece.model`, RoBERTa's `vocab.json`), or the one a pretext
    workdir or model directory recorded (`directories.find_tokenizer`)."""
    path = Path(init)
    if any((path / name).is_file() for name in ("vocab.txt", "spiece.model", "vocab.json",
                                                 "tokenizer.json")):
        return str(path)
    found = directories.find_tokenizer(path)
    if found is None:
        raise UserError(f"no tokenizer found for {init}; pass one with data.tokenizer=...")
    return found


def as_overrides(values: dict[str, Any]) -> list[str]:
    """`{key: value}` as the `key=value` overrides `make_config` reads."""
    return [f"{key}={value}" for key, value in values.items()]


def file_overrides(path: str | Path | None) -> list[str]:
    """A `--config FILE`'s settings as `section.key=value` overrides for fine-tuning, whose
    method and recipe come from the task and the starting point (so no `preset`/`method`)."""
    if path is None:
        return []
    settings = read_config_file(path)
    if {"preset", "method"} & set(settings):
        raise UserError(f"--config {path}: fine-tuning takes its method and recipe from --task "
                        "and --init; remove preset/method from the file")
    return as_overrides({f"{section}.{key}": as_override(value)
                          for section, values in settings.items() for key, value in values.items()})


def _saved_run_config(source: str) -> dict[str, Any]:
    """The run config a pretext workdir saved; of a model directory only the method its
    model.json names; {} for HF folders."""
    path = Path(source) / CONFIG_FILE
    if path.is_file():
        return directories.read_json_object(path)
    model_file = Path(source) / directories.MODEL_FILE
    if model_file.is_file():
        return {"method": directories.read_json_object(model_file).get("method", "")}
    return {}


def chosen_recipe(recipe: registry.FinetuneRecipe, name: str) -> registry.FinetuneRecipe:
    """`recipe` with the preset `name` of its method layered over its values, the preset's
    `train.steps` and `optim.warmup_steps` its updates (`FinetuneRecipe.recipes` lists the
    presets it may choose: wav2vec 2.0's per labelled-data size)."""
    method = recipe.values["method"]
    if name not in recipe.recipes:
        choices = ", ".join(recipe.recipes) or "none: it has a single recipe"
        raise UserError(f"--recipe {name}: the {method} run from this starting point takes one "
                        f"of its recipes ({choices})")
    preset = registry.preset(name)
    values = {f"{section}.{key}": value for section, settings in preset.items()
              if section != "method" for key, value in settings.items()}
    return dataclasses.replace(recipe, values={**recipe.values, **values},
                               steps=preset["train"]["steps"],
                               warmup_steps=preset["optim"]["warmup_steps"], warmup=0.0)


def finetune_config(task: str, init: str, data: str, overrides: Sequence[str] = (), *,
                    seed: int = 0, epochs: float | None = None, architecture: str = "",
                    config_file: str | Path | None = None, recipe: str = "") -> Config:
    """The fine-tuning config for `task` (`registry.downstream_task`) from `init` (empty: a
    random network shaped like the `architecture` checkpoint), data as the task reads it (GLUE:
    a GLUE folder or `tfds`): the downstream method that claims what `init` holds on that task
    (`registry.downstream_recipe`: ELMo's scalar mix, or the task's method with the encoder
    family's recipe), or the recipe preset `recipe` of that method (`chosen_recipe`). A
    `config_file`'s settings win over the recipe and `overrides` (key=value) over both;
    `epochs` (default: the recipe's) sets `train.steps`."""
    overrides = [*file_overrides(config_file), *overrides]
    spec = registry.downstream_task(task)
    source = init or architecture
    if not source:
        raise UserError("give a starting point (--init) or, for a random encoder, the "
                        "checkpoint whose architecture to copy (--architecture)")
    layers = [o.split("=", 1)[1] for o in overrides if o.startswith("model.init_layers=")]
    pretrained = read_pretrained(source, load_pretrained, layers[-1] if layers else "")
    chosen = registry.downstream_recipe(pretrained, spec,
                                        {**_saved_run_config(source), "source": source})
    if chosen is None:  # no family claims it: say what the classifier starts from
        as_encoder(source, pretrained)
        raise UserError(f"no method fine-tunes the {type(pretrained).__name__} in {source}")
    if recipe:
        chosen = chosen_recipe(chosen, recipe)
    values = {**chosen.values, "model.init": init, "examples.task": spec.name,
              "data.source": data, "train.seed": seed, "train.eval_batches": 1}
    if chosen.tokenizer_from_init and not any(
            override.startswith("data.tokenizer=") for override in overrides):
        values["data.tokenizer"] = tokenizer_of(source)  # its casing travels in its folder
    draft = make_config(None, [*as_overrides(values), *overrides])
    rows = spec.train_rows(data, draft)
    per_epoch = max(1, math.ceil(rows / draft.train.batch_size))
    if chosen.steps and epochs is None:
        steps = chosen.steps
    else:
        if epochs is None:
            epochs = chosen.epochs if chosen.epochs_of is None else chosen.epochs_of(draft)
        steps = max(1, math.ceil(epochs * per_epoch))
    schedule = {"train.steps": steps,
                "optim.warmup_steps": max(1, round(chosen.warmup * steps)) if chosen.warmup
                else chosen.warmup_steps,
                "train.eval_every": per_epoch, "train.checkpoint_every": per_epoch,
                "train.log_every": max(1, min(50, per_epoch))}
    return make_config(None, [*as_overrides({**values, **schedule}), *overrides])


def _task_metrics(evaluation: dict[str, float], task: str) -> dict[str, float]:
    names = registry.downstream_task(task).metrics
    return {name: evaluation[name] for name in names if name in evaluation}


def _against_baseline(dev: dict[str, float], report: dict[str, Any], task: str
                      ) -> dict[str, Any]:
    """The task's trivial baseline (GLUE: the majority class; CTC: the empty transcript) beside
    the dev metrics, and whether the run ended at it (its main metric no better than the
    trivial predictor's: it predicts one class, or as badly)."""
    spec = registry.downstream_task(task)
    baseline = report[spec.baseline]
    gain = dev[spec.main_metric] - baseline[spec.main_metric]
    return {spec.baseline: baseline, f"at_{spec.baseline}": bool(
        (-gain if spec.lower_is_better else gain) <= 1e-9)}


def finetune(config: Config, workdir: str | Path) -> dict[str, Any]:
    """Trains `config` (a downstream run) in `workdir`, resuming if it holds one (a finished
    one is only evaluated), and writes the final dev metrics and the trained and total
    parameter counts to `<workdir>/results.json` (and a run on a subset of the labels lists it
    in `label_subset.json`)."""
    trainer = Trainer(config, workdir)
    if "label_subset" in trainer.data.report:  # the labelled images a run trains on
        Path(workdir).mkdir(parents=True, exist_ok=True)
        (Path(workdir) / SUBSET_FILE).write_text(json.dumps(trainer.data.report["label_subset"]))
    summary = trainer.run()
    task = config.examples.task
    # a finished workdir trains no further steps, so nothing was evaluated: evaluate it now
    dev = (_task_metrics(summary["eval"], task) if summary["eval"]
           else evaluate(workdir)["dev"])
    result = {"task": task, "init": config.model.init, "seed": config.train.seed,
              "steps": summary["step"], "parameters": summary["parameters"], "dev": dev,
              **_against_baseline(dev, summary["report"], task)}
    (Path(workdir) / RESULTS_FILE).write_text(json.dumps(result, indent=2))
    return result


def finetune_seeds(task: str, init: str, data: str, workdir: str | Path, seeds: Sequence[int],
                   overrides: Sequence[str] = (), *, epochs: float | None = None,
                   architecture: str = "", config_file: str | Path | None = None,
                   recipe: str = "") -> dict[str, Any]:
    """`finetune` once per seed, each in `<workdir>/seed<k>` (an interrupted sweep resumes),
    and each dev metric's median over the seeds, as the papers report SQuAD, CoNLL and GLUE
    (BERT §4, RoBERTa §5: the median of five runs). Returns the result of one run's form with
    the medians as `dev` (steps and baseline those of the first seed's run), the runs' own dev
    metrics as `runs`, and writes it to `<workdir>/results.json`."""
    root = Path(workdir)
    outcomes = [finetune(finetune_config(task, init, data, overrides, seed=seed, epochs=epochs,
                                         architecture=architecture, config_file=config_file,
                                         recipe=recipe),
                         root / f"seed{seed}") for seed in seeds]
    runs = [outcome["dev"] for outcome in outcomes]
    median = {metric: float(np.median([run[metric] for run in runs])) for metric in runs[0]}
    first = {key: value for key, value in outcomes[0].items() if key != "seed"}
    result = {**first, "seeds": list(seeds), "dev": median, "runs": runs,
              **_against_baseline(median, outcomes[0], task)}
    root.mkdir(parents=True, exist_ok=True)
    (root / RESULTS_FILE).write_text(json.dumps(result, indent=2))
    return result


def is_finetuning(method: registry.Method) -> bool:
    """Whether `method` fine-tunes on a downstream task: it starts from a pre-trained model and
    its examples name the task (`classify`, ELMo's scalar mix, ...)."""
    return method.start.pretrained is not None and "task" in {
        f.name for f in dataclasses.fields(method.example_config)}


def evaluate(workdir: str | Path) -> dict[str, Any]:
    """Dev metrics of a fine-tuning workdir's latest checkpoint."""
    path = Path(workdir)
    if not (path / CONFIG_FILE).is_file():
        raise UserError(f"{workdir} is not a fine-tuning workdir ({CONFIG_FILE} missing); pass "
                        "the --workdir of run.py finetune")
    config = config_from_dict(directories.read_json_object(path / CONFIG_FILE))
    if not is_finetuning(registry.get(config.method)):
        raise UserError(f"{workdir} holds a {config.method} run, not one task's fine-tuning; "
                        "evaluate the --workdir of run.py finetune --task TASK")
    trainer = Trainer(config, path)
    step = trainer.checkpoints.latest_step()
    if step is None:
        raise UserError(f"{workdir} has no checkpoint yet; run run.py finetune first")
    state, _ = trainer.checkpoints.restore(step)
    trainer.checkpoints.close()
    task = config.examples.task
    dev = _task_metrics(trainer.evaluate(state), task)
    return {"task": task, "step": step, "dev": dev,
            **_against_baseline(dev, trainer.data.report, task)}


def run_glue(init: str, data: str, workdir: str | Path, *, tasks: Sequence[str] = GLUE_ORDER,
             seeds: Sequence[int] = (0,), overrides: Sequence[str] = (),
             architecture: str = "", epochs: float | None = None,
             learning_rates: Sequence[float] = ()) -> dict[str, Any]:
    """Fine-tunes every task with every seed (one workdir each, so an interrupted sweep
    resumes) and reports each metric's median over seeds. With `learning_rates`, every rate
    is run and each task reports the one whose median GLUE score on dev is best, as BERT §4.1
    selects its rate (empty: the recipe's rate). Writes `results.json` and a markdown table
    `results.md` to `workdir`."""
    root = Path(workdir)
    results: dict[str, Any] = {}
    for task in tasks:
        name = glue.glue_task(task).name
        by_rate = {}
        for rate in learning_rates or (None,):
            chosen = [] if rate is None else [f"optim.learning_rate={rate}"]
            folder = root / name if rate is None else root / name / f"lr{rate:g}"
            outcomes = [finetune(finetune_config(task, init, data, [*overrides, *chosen],
                                                 seed=seed, epochs=epochs,
                                                 architecture=architecture),
                                 folder / f"seed{seed}") for seed in seeds]
            runs = [outcome["dev"] for outcome in outcomes]
            by_rate[rate] = {"median": {metric: float(np.median([r[metric] for r in runs]))
                                        for metric in runs[0]}, "runs": runs,
                             "majority_baseline": outcomes[0]["majority_baseline"],
                             "runs_at_majority_baseline": sum(
                                 outcome["at_majority_baseline"] for outcome in outcomes)}
        best = max(by_rate, key=lambda rate: by_rate[rate]["median"]["glue_score"])
        results[task] = {**by_rate[best], **({"learning_rate": best,
                                              "by_learning_rate": {f"{r:g}": v["median"]
                                                                   for r, v in by_rate.items()}}
                                             if best is not None else {})}
    root.mkdir(parents=True, exist_ok=True)
    (root / RESULTS_FILE).write_text(json.dumps(
        {"init": init or f"random ({architecture})", "seeds": list(seeds),
         "learning_rates": list(learning_rates), "tasks": results}, indent=2))
    (root / TABLE_FILE).write_text(glue_table({init or "random": results}))
    return results


def glue_table(columns: dict[str, dict[str, Any]]) -> str:
    """A markdown table: one row per task metric (medians), one column per starting point, the
    majority-class baseline beside them, and the GLUE average of the per-task scores; a cell
    whose runs all ended at the baseline is marked `(b)`."""
    names = list(columns)
    tasks = [t for t in GLUE_ORDER if any(t in results for results in columns.values())]
    baselines = {t: next((columns[n][t]["majority_baseline"] for n in names
                          if "majority_baseline" in columns[n].get(t, {})), None) for t in tasks}

    def stuck(results: dict[str, Any]) -> bool:
        return results.get("runs_at_majority_baseline", 0) == len(results["runs"])

    def cell(name: str, task: str, metric: str) -> str:
        if task not in columns[name]:
            return "-"
        results = columns[name][task]
        return f"{results['median'][metric]:.3f}" + (" (b)" if stuck(results) else "")

    lines = ["| task | metric | " + " | ".join(names) + " | majority class |",
             "| --- | --- |" + " --- |" * (len(names) + 1)]
    for task in tasks:
        for metric in glue.glue_task(task).metrics:
            baseline = f"{baselines[task][metric]:.3f}" if baselines[task] else "-"
            lines.append(f"| {task} | {metric} | " + " | ".join(
                cell(n, task, metric) for n in names) + f" | {baseline} |")
    averages = [np.mean([columns[n][t]["median"]["glue_score"] for t in tasks if t in columns[n]])
                for n in names]
    known = [b["glue_score"] for b in baselines.values() if b]
    baseline_average = f"{np.mean(known):.3f}" if len(known) == len(tasks) else "-"
    lines.append("| average | glue_score | " + " | ".join(f"{a:.3f}" for a in averages)
                 + f" | {baseline_average} |")
    if any(stuck(columns[n][t]) for n in names for t in tasks if t in columns[n]):
        lines.append("\n(b): every run of that cell ended at the majority-class baseline (it "
                     "predicts one class); try another learning rate or more epochs.")
    return "\n".join(lines) + "\n"
