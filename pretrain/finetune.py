"""Fine-tuning and evaluation on GLUE with the one trainer (`objectives.classification`).

`finetune_config` turns (task, starting point, data) into a `classify` run with the paper's
recipe for the starting point's family:
- BERT (Devlin et al. 2019, §4.1 and A.3): sequence length 128, batch 32, 3 epochs, lr 2e-5
  (the paper picks from {5, 4, 3, 2}e-5 on dev), warmup over 10% of the steps then linear
  decay, weight decay 0.01. Encoders narrower than BERT-Base (the compact BERTs of Turc et
  al. 2019, MiniLM): 4 epochs at lr 1e-4, from the grid {3e-4, 1e-4, 5e-5, 3e-5} that the
  google-research/bert README gives for them (2e-5 barely moves a 2-layer, 64-wide model).
- ELECTRA (Clark et al. 2020, Table 7): batch 32, lr 3e-4 (Small) / 1e-4 (Base) / 5e-5
  (Large), layer-wise lr decay 0.8 (0.9 Large), warmup 10%, no weight decay, 3 epochs, 10 for
  RTE and STS-B; the schedule is ELECTRA's own (`optim.schedule=electra_linear`: the linear
  decay over the run multiplied by the warmup ramp, model/optimization.py, which its
  run_finetuning.py uses), not BERT's.
- XLNet (Yang et al. 2019, Appendix A.3, Table 8, whose GLUE column is MNLI): sequence length
  128, lr 2e-5 with linear decay, no weight decay, Adam epsilon 1e-6 (run_classifier.py's flag
  default is 1e-8), layer-wise lr decay 1.0; Table 8's batch 128 for 10K steps is ~3 epochs of
  MNLI, so 3 epochs here, at batch 32 as the zihangdai/xlnet README's STS-B run (4 GPUs x 8;
  it uses lr 5e-5 for XLNet-Large), with warmup over 10% of the steps as there (120 of 1200
  steps). Adam with bias correction and gradient clipping at 1.0 (run_classifier.py: `clip`,
  and `tf.train.AdamOptimizer` when weight_decay is 0, whose epsilon is added before the bias
  correction: `optim.eps_before_bias_correction`); model_utils.py `get_train_op` decays
  linearly from the peak at the end of warmup (`optim.schedule=linear_from_peak`).
- XLM (facebookresearch/XLM README, GLUE with glue-xnli.py): Adam at a constant lr 2.5e-5
  (`--optimizer_e adam,lr=0.000025`, from its sweep {0.5, 2.5, 12.5}e-5), no warmup or weight
  decay, epsilon 1e-8 (torch's Adam), batch 8 (of {4, 8}), inputs `</s> A </s> B </s>`. The
  reference runs 250 "epochs" of 20,000 sentences and keeps the best dev score; here 3 epochs
  of the task, as BERT's.
`glue` runs every task over several seeds and reports the median, as the papers do.
"""

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
from pretext_jax.models.classifier import classifier_config
from pretext_jax.objectives import registry
from pretext_jax.objectives.classification import METHOD as CLASSIFY
from pretext_jax.objectives.classification import as_encoder, layout_of, read_pretrained
from pretext_jax.objectives.registry import FinetuneRecipe
from pretext_jax.pretrain import export
from pretext_jax.pretrain.config import (
    Config,
    as_override,
    config_from_dict,
    make_config,
    read_config_file,
)
from pretext_jax.pretrain.trainer import CONFIG_FILE, Trainer

RESULTS_FILE = "results.json"
TABLE_FILE = "results.md"
GLUE_ORDER = ("cola", "sst2", "mrpc", "stsb", "rte")


def recipe(head: str, hidden_size: int, task: str) -> dict[str, Any]:
    """The paper's fine-tuning hyper-parameters for this family, size and task (see the module
    docstring for their sources); `batch_size` (32), `schedule`, `warmup` (share of the steps,
    0.1) and Adam's `eps` (1e-6) where the family's differ from the defaults."""
    if head == "bert":
        compact = hidden_size < 768
        return {"learning_rate": 1e-4 if compact else 2e-5, "epochs": 4 if compact else 3,
                "layerwise_lr_decay": 1.0, "weight_decay": 0.01}
    if head == "xlnet":
        return {"learning_rate": 2e-5, "epochs": 3, "layerwise_lr_decay": 1.0,
                "weight_decay": 0.0}
    if head == "xlm":
        return {"learning_rate": 2.5e-5, "epochs": 3, "layerwise_lr_decay": 1.0,
                "weight_decay": 0.0, "batch_size": 8, "schedule": "constant", "warmup": 0.0,
                "eps": 1e-8}
    learning_rate = 3e-4 if hidden_size <= 256 else 1e-4 if hidden_size <= 768 else 5e-5
    return {"learning_rate": learning_rate, "epochs": 10 if task in ("rte", "stsb") else 3,
            "layerwise_lr_decay": 0.8 if hidden_size <= 768 else 0.9, "weight_decay": 0.0}


def tokenizer_of(init: str) -> str:
    """The tokenizer a starting point was trained with: a HuggingFace folder's own vocab
    (BERT's `vocab.txt`, XLNet's `spiece.model`), or the one a pretext workdir or model
    directory recorded (`export.find_tokenizer`)."""
    path = Path(init)
    if any((path / name).is_file() for name in ("vocab.txt", "spiece.model", "tokenizer.json")):
        return str(path)
    found = export.find_tokenizer(path)
    if found is None:
        raise UserError(f"no tokenizer found for {init}; pass one with data.tokenizer=...")
    return found


def _as_overrides(values: dict[str, Any]) -> list[str]:
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
    return _as_overrides({f"{section}.{key}": as_override(value)
                          for section, values in settings.items() for key, value in values.items()})


def _encoder_recipe(source: str, encoder: Any, task: glue.GlueTask,
                    overrides: Sequence[str]) -> FinetuneRecipe:
    """`classify` on a Transformer encoder: its family's recipe (`recipe`), the input layout of
    its head and the tokenizer it was trained with (unless `overrides` name one)."""
    model = dataclasses.asdict(classifier_config(encoder, task.num_labels))
    chosen = recipe(model["head"], model["hidden_size"], task.name)
    xlnet = model["head"] == "xlnet"
    values = {"method": CLASSIFY.name, **{f"model.{k}": v for k, v in model.items()},
              # XLNet's relative positions have no length limit.
              "examples.max_seq_length": 128 if xlnet else min(
                  128, model["max_position_embeddings"]),
              "examples.layout": layout_of(model["head"]),
              "train.batch_size": chosen.get("batch_size", 32),
              "optim.learning_rate": chosen["learning_rate"],
              "optim.weight_decay": chosen["weight_decay"],
              "optim.layerwise_lr_decay": chosen["layerwise_lr_decay"],
              "optim.schedule": chosen.get("schedule") or {
                  "electra": "electra_linear", "xlnet": "linear_from_peak"}.get(
                  model["head"], "linear"),
              "optim.bias_correction": True, "optim.eps_before_bias_correction": xlnet,
              "optim.eps": chosen.get("eps", 1e-6)}
    if not any(override.startswith("data.tokenizer=") for override in overrides):
        values["data.tokenizer"] = tokenizer_of(source)  # its casing travels in its folder
    return FinetuneRecipe(values, epochs=chosen["epochs"], warmup=chosen.get("warmup", 0.1))


def _saved_run_config(source: str) -> dict[str, Any]:
    """The run config a pretext workdir saved ({} for model directories and HF folders)."""
    path = Path(source) / CONFIG_FILE
    return export.read_json_object(path) if path.is_file() else {}


def finetune_config(task: str, init: str, data: str, overrides: Sequence[str] = (), *,
                    seed: int = 0, epochs: float | None = None, architecture: str = "",
                    config_file: str | Path | None = None) -> Config:
    """The fine-tuning config for `task` from `init` (empty: a random network shaped like the
    `architecture` checkpoint), data from a GLUE folder or `tfds`: the downstream method that
    claims what `init` holds (`registry.downstream_recipe`: ELMo's scalar mix), else `classify`
    with the encoder family's recipe. A `config_file`'s settings win over the recipe and
    `overrides` (key=value) over both; `epochs` (default: the recipe's) sets `train.steps`."""
    overrides = [*file_overrides(config_file), *overrides]
    spec = glue.glue_task(task)
    source = init or architecture
    if not source:
        raise UserError("give a starting point (--init) or, for a random encoder, the "
                        "checkpoint whose architecture to copy (--architecture)")
    pretrained = read_pretrained(source, export.load_pretrained)
    chosen = (registry.downstream_recipe(pretrained, spec, _saved_run_config(source))
              or _encoder_recipe(source, as_encoder(source, pretrained), spec, overrides))
    values = {**chosen.values, "model.init": init, "examples.task": spec.name,
              "data.source": data, "train.seed": seed, "train.eval_batches": 1}
    draft = make_config(None, [*_as_overrides(values), *overrides])
    rows = len(glue.read_glue(data, spec.name, "train", draft.data.tfds_data_dir or None).labels)
    rows = min(rows, draft.examples.max_train_examples or rows)
    per_epoch = max(1, math.ceil(rows / draft.train.batch_size))
    steps = max(1, math.ceil((chosen.epochs if epochs is None else epochs) * per_epoch))
    schedule = {"train.steps": steps,
                "optim.warmup_steps": max(1, round(chosen.warmup * steps)) if chosen.warmup
                else 0,
                "train.eval_every": per_epoch, "train.checkpoint_every": per_epoch,
                "train.log_every": max(1, min(50, per_epoch))}
    return make_config(None, [*_as_overrides({**values, **schedule}), *overrides])


def _glue_metrics(evaluation: dict[str, float], task: str) -> dict[str, float]:
    names = (*glue.glue_task(task).metrics, "glue_score")
    return {name: evaluation[name] for name in names if name in evaluation}


def _against_baseline(dev: dict[str, float], baseline: dict[str, float]) -> dict[str, Any]:
    """The majority-class baseline beside the dev metrics, and whether the run ended at it (its
    GLUE score no better than the constant predictor's: it predicts one class, or as badly)."""
    return {"majority_baseline": baseline,
            "at_majority_baseline": bool(dev["glue_score"] <= baseline["glue_score"] + 1e-9)}


def finetune(config: Config, workdir: str | Path) -> dict[str, Any]:
    """Trains `config` (a `classify` run) in `workdir`, resuming if it holds one (a finished
    one is only evaluated), and writes the final dev metrics to `<workdir>/results.json`."""
    summary = Trainer(config, workdir).run()
    task = config.examples.task
    # a finished workdir trains no further steps, so nothing was evaluated: evaluate it now
    dev = (_glue_metrics(summary["eval"], task) if summary["eval"]
           else evaluate(workdir)["dev"])
    result = {"task": task, "init": config.model.init, "seed": config.train.seed,
              "steps": summary["step"], "dev": dev,
              **_against_baseline(dev, summary["report"]["majority_baseline"])}
    (Path(workdir) / RESULTS_FILE).write_text(json.dumps(result, indent=2))
    return result


def evaluate(workdir: str | Path) -> dict[str, Any]:
    """Dev metrics of a fine-tuning workdir's latest checkpoint."""
    path = Path(workdir)
    if not (path / CONFIG_FILE).is_file():
        raise UserError(f"{workdir} is not a fine-tuning workdir ({CONFIG_FILE} missing); pass "
                        "the --workdir of run.py finetune")
    config = config_from_dict(export.read_json_object(path / CONFIG_FILE))
    if config.method != CLASSIFY.name and registry.get(config.method).finetunes is None:
        raise UserError(f"{workdir} holds a {config.method} pre-training run; evaluate a "
                        "fine-tuning workdir (run.py finetune)")
    trainer = Trainer(config, path)
    manager = trainer.checkpoint_manager()
    step = manager.latest_step()
    if step is None:
        raise UserError(f"{workdir} has no checkpoint yet; run run.py finetune first")
    state, _ = trainer.restore(manager, step)
    manager.close()
    task = config.examples.task
    dev = _glue_metrics(trainer.evaluate(state), task)
    return {"task": task, "step": step, "dev": dev,
            **_against_baseline(dev, trainer.data.report["majority_baseline"])}


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
