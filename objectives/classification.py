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

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import glue
from pretext_jax.models.classifier import SequenceClassifier, from_pretrained
from pretext_jax.objectives.common.classifier_recipes import (
    CLASSIFY,
    FinetuneModelConfig,
    check_input_length,
    layout_of,
    load_encoder,
)
from pretext_jax.objectives.common.glue_data import (
    GlueExampleConfig,
    glue_monitor,
    prepare_glue,
)
from pretext_jax.objectives.registry import (
    Batch,
    DownstreamTask,
    Evaluation,
    Method,
    Metrics,
    Resolution,
    Start,
    register,
    register_task,
)


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


def pretrained_classifier(config: FinetuneModelConfig, seed: int,
                          load: Callable[[str], nnx.Module]) -> SequenceClassifier | None:
    """The encoder of `config.init` (read by `load`) under a freshly initialised head (None:
    random init)."""
    if not config.init:
        return None
    encoder = load_encoder(config.init, load, config.head, config.init_layers)
    return from_pretrained(encoder, config, nnx.Rngs(seed))


def build_classifier(config: FinetuneModelConfig, seed: int) -> SequenceClassifier:
    with nnx.use_eager_sharding(False):
        return SequenceClassifier(config, rngs=nnx.Rngs(seed))


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


def glue_train_text(task: glue.GlueTask, data: str, config: Any) -> list[list[str]]:
    """The training rows of GLUE `task` the run reads, each its sentence or sentence pair."""
    rows = glue.read_glue(data, task.name, "train", config.data.tfds_data_dir or None)
    texts_b = rows.texts_b or [""] * len(rows.texts_a)
    count = config.examples.max_train_examples or len(rows.texts_a)
    return [[text for text in pair if text.strip()]
            for pair in zip(rows.texts_a[:count], texts_b[:count], strict=True)]


for _glue_task in glue.GLUE_TASKS.values():  # `run.py finetune --task sst2` ... (`glue` too)
    register_task(DownstreamTask(
        name=_glue_task.name, method=CLASSIFY, num_labels=_glue_task.num_labels,
        train_rows=functools.partial(glue_train_rows, _glue_task),
        metrics=(*_glue_task.metrics, "glue_score"), main_metric="glue_score",
        aliases=(_glue_task.folder,), spec=_glue_task,
        train_text=functools.partial(glue_train_text, _glue_task)))


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
