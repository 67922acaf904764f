"""GLUE data for the methods that train on a GLUE task (fine-tuning `classify`, TinyBERT's
task distillation): the example settings, the records and the dev-set metrics."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import glue, prepare, tokenizers
from pretext_jax.input_pipeline.prepare import DataConfig, fingerprint, tokenizer_identity
from pretext_jax.input_pipeline.records import RecordDirectory, write_records
from pretext_jax.models.classifier import SequenceClassifier
from pretext_jax.objectives.common.glue_metrics import constant_baseline, task_metrics
from pretext_jax.objectives.registry import PreparedData


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
                      *tokenizer_identity(data))
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
