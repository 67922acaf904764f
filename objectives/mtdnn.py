"""MT-DNN (Liu et al. 2019, "Multi-Task Deep Neural Networks for Natural Language
Understanding", §3-4): one pre-trained encoder shared by several GLUE tasks, one output layer
per task (`models.classifier.MultiHeadClassifier`), each mini-batch from one task with the
tasks in proportion to their size (Algorithm 1; `input_pipeline.multitask.MultiTaskBatches`,
namisan/mt-dnn mt_dnn/batcher.py `MultiTaskBatchSampler`), cross-entropy for classification
and mean squared error for regression (STS-B) (§3.1, mt_dnn/loss.py `CeCriterion`,
`MseCriterion`). `run.py finetune --task sst2,mrpc,...` trains it and may then fine-tune each
task from it (`pretrain.transfer`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import glue, prepare
from pretext_jax.input_pipeline.multitask import MultiTaskBatches
from pretext_jax.input_pipeline.prepare import DataConfig, fingerprint, tokenizer_identity
from pretext_jax.input_pipeline.records import RecordDirectory, write_records
from pretext_jax.models.classifier import MultiHeadClassifier, MultiHeadConfig, from_pretrained
from pretext_jax.objectives.common.classifier_recipes import (
    ADAPTER_HEADS,
    check_input_length,
    layout_of,
    load_encoder,
)
from pretext_jax.objectives.common.glue_metrics import constant_baseline, task_metrics
from pretext_jax.objectives.registry import (
    Batch,
    Evaluation,
    Method,
    Metrics,
    PreparedData,
    Resolution,
    Start,
    per_step_source,
    register,
    summary_of,
)

MTDNN = "mtdnn"


@dataclasses.dataclass(frozen=True)
class MultiTaskExampleConfig:
    """The GLUE `tasks` trained together (comma-separated, at least two), each task's input
    as `classify` reads it (`max_seq_length`, `layout`) and `max_train_examples` (per task)."""

    tasks: str = "sst2,mrpc"
    """GLUE tasks, comma-separated (sst2, cola, mrpc, rte, stsb); a task's output layer is its
    place in this list."""
    max_seq_length: int = 128
    """Tokens per example incl. special tokens (MT-DNN §4: 512; BERT's GLUE runs 128)."""
    max_train_examples: int = 0
    """Train on each task's first n training rows only; 0 = all."""
    layout: str = "bert"
    """Input layout (`input_pipeline.glue.LAYOUTS`) of the head's family."""


@dataclasses.dataclass(frozen=True)
class MultiTaskModelConfig(MultiHeadConfig):
    """The multi-task classifier (`MultiHeadConfig`) and `init`, where its encoder comes
    from."""

    heads: ClassVar[tuple[str, ...]] = ADAPTER_HEADS + ("albert",)
    init: str = ""
    """Start from: a pretext workdir/model dir or HF folder of a head's family; '' = random."""
    init_layers: str = ""
    """Keep only these layers of `init`'s encoder (`FinetuneModelConfig.init_layers`)."""


def glue_tasks(examples: MultiTaskExampleConfig) -> list[glue.GlueTask]:
    """The tasks of `examples.tasks`, in order: at least two, none twice."""
    tasks = [glue.glue_task(name.strip()) for name in examples.tasks.split(",") if name.strip()]
    names = [task.name for task in tasks]
    if len(tasks) < 2 or len(set(names)) != len(names):
        raise UserError(f"examples.tasks={examples.tasks!r}: multi-task training takes two or "
                        "more different GLUE tasks, e.g. sst2,mrpc")
    return tasks


def multitask_loss(model: MultiHeadClassifier, batch: Batch, rng: jax.Array | None
                   ) -> tuple[jax.Array, Metrics]:
    """Each row's loss under its task's output layer (`batch["task"]`): cross-entropy over the
    task's classes, or the squared error of a regression; their mean over the batch. Only the
    rows' tasks' layers get a gradient."""
    logits = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                   rng=rng).astype(jnp.float32)
    labels = batch["label"].astype(jnp.float32)
    task = batch["task"].astype(jnp.int32)
    losses, correct = [], []
    for index, count in enumerate(model.config.task_labels):
        if count == 1:
            losses.append(jnp.square(logits[:, index, 0] - labels))
            correct.append(jnp.zeros_like(labels))
            continue
        classes = jnp.clip(labels.astype(jnp.int32), 0, count - 1)  # other tasks' labels too
        log_probs = jax.nn.log_softmax(logits[:, index, :count])
        losses.append(-jnp.take_along_axis(log_probs, classes[:, None], axis=1)[:, 0])
        correct.append((jnp.argmax(log_probs, axis=-1) == classes).astype(jnp.float32))
    mine = task[:, None] == jnp.arange(len(model.config.task_labels))  # [B, tasks]
    loss = jnp.mean(jnp.sum(jnp.where(mine, jnp.stack(losses, axis=1), 0.0), axis=1))
    classified = jnp.asarray([count > 1 for count in model.config.task_labels])[task]
    accuracy = (jnp.sum(jnp.where(mine, jnp.stack(correct, axis=1), 0.0)),
                jnp.sum(classified.astype(jnp.float32)))
    return loss, {"loss": (loss, jnp.ones((), jnp.float32)), "accuracy": accuracy}


@nnx.jit
def _logits(model: MultiHeadClassifier, input_ids: jax.Array, token_type_ids: jax.Array,
            attention_mask: jax.Array) -> jax.Array:
    """Evaluation-mode logits of every task [B, tasks, labels]."""
    return model(input_ids, token_type_ids, attention_mask)


def multitask_monitor(model: MultiHeadClassifier, data: PreparedData,
                      examples: MultiTaskExampleConfig, objective: Any = None
                      ) -> dict[str, float]:
    """Each task's GLUE metrics on its whole dev set under its own output layer
    (`<task>_<metric>`), and `glue_score`, the mean of the tasks' scores (no `objective`)."""
    results: dict[str, float] = {}
    dev = data.eval
    for index, task in enumerate(glue_tasks(examples)):
        rows = np.flatnonzero(dev["task"] == index)
        outputs = np.concatenate([np.asarray(_logits(model, *(
            dev[key][rows[start:start + 128]]
            for key in ("input_ids", "token_type_ids", "attention_mask"))))[:, index]
            for start in range(0, len(rows), 128)])
        predictions = (outputs[:, 0] if task.is_regression
                       else outputs[:, :task.num_labels].argmax(-1))
        labels = dev["label"][rows]
        scores = task_metrics(task, predictions, labels if task.is_regression
                              else labels.astype(np.int32))
        results.update({f"{task.name}_{name}": value for name, value in scores.items()})
    results["glue_score"] = float(np.mean([results[f"{task.name}_glue_score"]
                                           for task in glue_tasks(examples)]))
    return results


def pretrained_multitask(config: MultiTaskModelConfig, seed: int, load: Any
                         ) -> MultiHeadClassifier | None:
    """The encoder of `config.init` (read by `load`) under fresh output layers (None: random
    init), as `classify` starts (BERT's pooler kept, `from_pretrained`)."""
    if not config.init:
        return None
    encoder = load_encoder(config.init, load, config.head, config.init_layers)
    return from_pretrained(encoder, config, nnx.Rngs(seed), MultiHeadClassifier)


def build_multitask(config: MultiTaskModelConfig, seed: int) -> MultiHeadClassifier:
    with nnx.use_eager_sharding(False):
        return MultiHeadClassifier(config, rngs=nnx.Rngs(seed))


def _split(data: DataConfig, examples: MultiTaskExampleConfig, tokenizer: Any, split: str,
           index: int, task: glue.GlueTask) -> dict[str, np.ndarray]:
    """One task's split encoded as `classify` encodes it, with its `task` index and the label
    as float32 (class ids and scores in one column)."""
    rows = glue.read_glue(data.source, task.name, split, data.tfds_data_dir or None)
    encoded = glue.encode_glue(rows, tokenizer, examples.max_seq_length, examples.layout)
    if split == "train" and examples.max_train_examples:
        encoded = {k: v[:examples.max_train_examples] for k, v in encoded.items()}
    count = len(encoded["label"])
    return {**encoded, "label": encoded["label"].astype(np.float32),
            "task": np.full(count, index, np.int32)}


def _joined(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}


def prepare_multitask(data: DataConfig, examples: MultiTaskExampleConfig, cache_dir: Path,
                      seed: int) -> PreparedData:
    """Every task's training rows, one task after another, as records (cached under a
    fingerprint of the files, tokenizer and settings), read by MT-DNN's schedule
    (`MultiTaskBatches`); the dev sets joined in memory; each task's majority-class baseline."""
    tasks = glue_tasks(examples)
    if not data.tokenizer:
        raise UserError("multi-task training needs the starting point's tokenizer: set "
                        "data.tokenizer (run.py finetune sets it from --init)")
    tokenizer = prepare.load_tokenizer(data)
    key = fingerprint(MTDNN, dataclasses.asdict(examples), *tokenizer_identity(data),
                      [glue.glue_fingerprint(data.source, task, data.tfds_data_dir or None)
                       for task in tasks])
    train_dir = Path(cache_dir) / key / "train"
    if not (train_dir / "features.json").is_file():
        parts = [_split(data, examples, tokenizer, "train", i, t) for i, t in enumerate(tasks)]
        train = _joined(parts)
        counts = [dict(zip(*(x.tolist() for x in np.unique(part["label"], return_counts=True)),
                           strict=True)) for part in parts]
        write_records(({k: v[i] for k, v in train.items()} for i in range(len(train["task"]))),
                      train_dir, metadata={"source": data.source,
                                           "sizes": [len(part["task"]) for part in parts],
                                           "label_counts": [{str(int(label)): n for label, n
                                                             in c.items()} for c in counts]})
    records = RecordDirectory(train_dir)
    sizes = records.metadata["sizes"]
    if min(sizes) == 0:
        raise UserError(f"a task of {examples.tasks} has no training rows ({sizes})")
    dev = _joined([_split(data, examples, tokenizer, "dev", i, t) for i, t in enumerate(tasks)])
    baseline = {}
    for index, task in enumerate(tasks):
        labels = dev["label"][dev["task"] == index]
        scores = constant_baseline(task, records.metadata["label_counts"][index], labels if
                                   task.is_regression else labels.astype(np.int32))
        baseline.update({f"{task.name}_{name}": value for name, value in scores.items()})
    baseline["glue_score"] = float(np.mean([baseline[f"{t.name}_glue_score"] for t in tasks]))
    schedule = MultiTaskBatches(records, sizes, seed)
    return PreparedData(train=schedule, segments=per_step_source(schedule.for_global_batch),
                        eval=dev, model_fields={"task_labels": tuple(t.num_labels for t in tasks)},
                        report={"majority_baseline": baseline}, tokenizer=tokenizer)


def check_multitask(model: MultiTaskModelConfig, examples: MultiTaskExampleConfig,
                    objective: Any = None) -> None:
    """The tasks exist (two or more); the layout suits the head; examples fit the positions;
    one output layer per task (no `objective`)."""
    tasks = glue_tasks(examples)
    wanted = layout_of(model.head)
    if examples.layout != wanted:
        raise UserError(f"examples.layout={examples.layout} does not suit model.head="
                        f"{model.head}; use examples.layout={wanted}")
    if model.task_labels and len(model.task_labels) != len(tasks):
        raise UserError(f"model.task_labels={model.task_labels} has {len(model.task_labels)} "
                        f"layers for {len(tasks)} tasks; leave it unset to take it from the data")
    check_input_length(model, examples.max_seq_length)


METHOD = register(Method(
    name=MTDNN,
    model_config=MultiTaskModelConfig,
    example_config=MultiTaskExampleConfig,
    build_model=build_multitask,
    loss=multitask_loss,
    prepare=prepare_multitask,
    units_per_example=lambda examples: examples.max_seq_length,
    description="MT-DNN: multi-task fine-tuning on several GLUE tasks (one head per task)",
    resolution=Resolution(check=check_multitask),
    evaluation=Evaluation(monitor=multitask_monitor,
                          summarize=summary_of(metrics=("loss", "glue_score"))),
    start=Start(pretrained=pretrained_multitask),
))
