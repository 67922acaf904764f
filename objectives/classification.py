"""Fine-tuning on sentence(-pair) classification and regression (GLUE), as a method of the one
trainer: cross-entropy on the labels (mean squared error for STS-B's scores) on top of a
pre-trained encoder (google-research/bert run_classifier.py `create_model`; HF
`*ForSequenceClassification`), GLUE's own metrics on the full dev set at every evaluation.

The starting point is `model.init`: a pretext workdir or model directory (BERT, ELECTRA's
discriminator, RoBERTa, ALBERT, MPNet, XLNet or XLM), or a HuggingFace folder of one of them;
empty = random initialisation of the same architecture (the baseline any pre-training has to
beat). RoBERTa and MPNet read fairseq's `<s> A </s></s> B </s>` (`examples.layout=roberta`);
XLNet reads its own input layout (`examples.layout=xlnet`: `A <sep> B <sep> <cls>`, padded on the
left) and classifies from the final <cls> (zihangdai/xlnet run_classifier.py); XLM reads `</s> A
</s> B </s>` (`examples.layout=xlm`) and classifies from the first </s> (XLM
xlm/evaluation/glue.py).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import glue, prepare, tokenizers
from pretext_jax.input_pipeline.prepare import DataConfig, fingerprint, source_fingerprint
from pretext_jax.input_pipeline.records import RecordDirectory, write_records
from pretext_jax.models.classifier import SequenceClassifier, from_pretrained
from pretext_jax.objectives.common.classifier_recipes import (
    CLASSIFY,
    FinetuneModelConfig,
    check_input_length,
    layout_of,
    load_encoder,
)
from pretext_jax.objectives.common.glue_metrics import constant_baseline, task_metrics
from pretext_jax.objectives.registry import (
    Batch,
    DownstreamTask,
    Evaluation,
    Method,
    Metrics,
    PreparedData,
    Resolution,
    Start,
    register,
    register_task,
)


@dataclasses.dataclass(frozen=True)
class GlueExampleConfig:
    """The GLUE `task` (sst2, cola, mrpc, rte, stsb), `max_seq_length` (BERT and XLNet: 128),
    `max_train_examples` (0 = all; the first n training rows, for budgeted runs) and `layout`
    (`input_pipeline.glue.LAYOUTS`: bert, or the roberta / xlnet / xlm head's own)."""

    task: str = "sst2"
    """GLUE task: sst2, cola, mrpc, rte or stsb (folder names such as SST-2 work too)."""
    max_seq_length: int = 128
    """Tokens per example incl. special tokens (BERT and XLNet fine-tune with 128)."""
    max_train_examples: int = 0
    """Train on the first n training rows only; 0 = all."""
    layout: str = "bert"
    """Input layout: bert ([CLS] A [SEP] B [SEP]), roberta (<s> A </s></s> B </s>, types 0),
    xlnet (A <sep> B <sep> <cls>, left-padded) or xlm (</s> A </s> B </s>)."""


def classification_loss(model: SequenceClassifier, batch: Batch, rng: jax.Array | None
                        ) -> tuple[jax.Array, Metrics]:
    """Mean cross-entropy over the batch (num_labels > 1) or mean squared error (1 label)."""
    logits = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                   rng=rng).astype(jnp.float32)
    count = jnp.asarray(logits.shape[0], jnp.float32)
    one = jnp.ones((), jnp.float32)
    if model.config.num_labels == 1:
        loss = jnp.mean(jnp.square(logits[:, 0] - batch["label"].astype(jnp.float32)))
        return loss, {"loss": (loss, one)}
    labels = batch["label"].astype(jnp.int32)
    log_probs = jax.nn.log_softmax(logits)
    loss = -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))
    correct = jnp.sum(jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return loss, {"loss": (loss, one), "accuracy": (correct, count)}


@nnx.jit
def _logits(model: SequenceClassifier, input_ids: jax.Array, token_type_ids: jax.Array,
            attention_mask: jax.Array) -> jax.Array:
    """Evaluation-mode logits; module-level so every evaluation reuses the compiled function."""
    return model(input_ids, token_type_ids, attention_mask)


def predict(model: SequenceClassifier, features: dict[str, np.ndarray],
            batch_size: int = 128) -> np.ndarray:
    """Class ids (or regression values) for every example, in order."""
    outputs = []
    for start in range(0, len(features["input_ids"]), batch_size):
        logits = np.asarray(_logits(model, *(features[k][start:start + batch_size] for k in (
            "input_ids", "token_type_ids", "attention_mask"))))
        outputs.append(logits[:, 0] if model.config.num_labels == 1 else logits.argmax(-1))
    return np.concatenate(outputs)


def glue_monitor(model: SequenceClassifier, data: PreparedData, examples: GlueExampleConfig,
                 objective: Any = None) -> dict[str, float]:
    """GLUE's metrics for the task on the whole dev set (no `objective` setting bears on
    them)."""
    return task_metrics(glue.glue_task(examples.task), predict(model, data.eval),
                        data.eval["label"])


def pretrained_classifier(config: FinetuneModelConfig, seed: int,
                          load: Callable[[str], nnx.Module]) -> SequenceClassifier | None:
    """The encoder of `config.init` (read by `load`) under a freshly initialised head (None:
    random init)."""
    if not config.init:
        return None
    return from_pretrained(load_encoder(config.init, load, config.head), config, nnx.Rngs(seed))


def build_classifier(config: FinetuneModelConfig, seed: int) -> SequenceClassifier:
    with nnx.use_eager_sharding(False):
        return SequenceClassifier(config, rngs=nnx.Rngs(seed))


def _encode(data: DataConfig, examples: GlueExampleConfig, tokenizer: tokenizers.Tokenizer,
            split: str) -> dict[str, np.ndarray]:
    rows = glue.read_glue(data.source, examples.task, split, data.tfds_data_dir or None)
    return glue.encode_glue(rows, tokenizer, examples.max_seq_length, examples.layout)


def prepare_glue(data: DataConfig, examples: GlueExampleConfig, cache_dir: Path,
                 seed: int) -> PreparedData:
    """GLUE train rows -> encoded records (cached under a fingerprint of the files, tokenizer
    and settings); the dev split encoded in memory."""
    task = glue.glue_task(examples.task)
    if not data.tokenizer:
        raise UserError("fine-tuning needs the starting point's tokenizer: set data.tokenizer "
                        "(run.py finetune sets it from --init)")
    tokenizer = prepare.load_tokenizer(data)
    key = fingerprint("glue", task.name, dataclasses.asdict(examples),
                      glue.glue_fingerprint(data.source, task, data.tfds_data_dir or None),
                      source_fingerprint(data.tokenizer), data.lowercase)
    train_dir = Path(cache_dir) / key / "train"
    if not (train_dir / "features.json").is_file():
        train = _encode(data, examples, tokenizer, "train")
        if examples.max_train_examples:
            train = {k: v[:examples.max_train_examples] for k, v in train.items()}
        count = len(train["label"])
        labels, counts = np.unique(train["label"], return_counts=True)
        write_records(({k: v[i] for k, v in train.items()} for i in range(count)), train_dir,
                      metadata={"task": task.name, "source": data.source, "label_counts": {
                          str(label): int(n) for label, n in zip(labels, counts, strict=True)
                          if not task.is_regression}})
    train = RecordDirectory(train_dir)
    dev = _encode(data, examples, tokenizer, "dev")
    baseline = constant_baseline(task, train.metadata["label_counts"], dev["label"])
    return PreparedData(train=train, eval=dev, model_fields={"num_labels": task.num_labels},
                        report={"majority_baseline": baseline}, tokenizer=tokenizer)


def check_glue(model: FinetuneModelConfig, examples: GlueExampleConfig,
               objective: Any = None) -> None:
    """The task exists and suits the head; examples fit the positions (no `objective`)."""
    glue.glue_task(examples.task)
    wanted = layout_of(model.head)
    if examples.layout != wanted:
        raise UserError(f"examples.layout={examples.layout} does not suit model.head="
                        f"{model.head}; use examples.layout={wanted}")
    check_input_length(model, examples.max_seq_length)


def glue_train_rows(task: glue.GlueTask, data: str, config: Any) -> int:
    """Training rows of GLUE `task` in the folder (or TFDS) `data`, as many as the run reads
    (`examples.max_train_examples`)."""
    count = len(glue.read_glue(data, task.name, "train", config.data.tfds_data_dir or None).labels)
    return min(count, config.examples.max_train_examples or count)


for _glue_task in glue.GLUE_TASKS.values():  # `run.py finetune --task sst2` ... (`glue` too)
    register_task(DownstreamTask(
        name=_glue_task.name, method=CLASSIFY, num_labels=_glue_task.num_labels,
        train_rows=functools.partial(glue_train_rows, _glue_task),
        metrics=(*_glue_task.metrics, "glue_score"), main_metric="glue_score",
        aliases=(_glue_task.folder,), spec=_glue_task))


METHOD = register(Method(
    name=CLASSIFY,
    model_config=FinetuneModelConfig,
    example_config=GlueExampleConfig,
    build_model=build_classifier,
    loss=classification_loss,
    prepare=prepare_glue,
    units_per_example=lambda examples: examples.max_seq_length,
    description="Fine-tuning: sentence(-pair) classification/regression (GLUE)",
    resolution=Resolution(check=check_glue),
    evaluation=Evaluation(monitor=glue_monitor),
    start=Start(hf_models=(SequenceClassifier,), pretrained=pretrained_classifier),
))
