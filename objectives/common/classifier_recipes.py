"""The transformer classifier's fine-tuning runs (methods `classify` and `tag`), shared by the
families whose encoders they fine-tune: the model config and the pre-trained encoder both
methods start from (`FinetuneModelConfig`, `load_encoder`); each family says its paper's
settings (`ClassifierSettings`) and declares them as its `registry.Start.finetunes` through
`claims_encoders`, so that `run.py finetune` / `glue` give a BERT, ELECTRA, XLNet or XLM
checkpoint its own paper's recipe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.models.classifier import (
    HEADS,
    ClassifierConfig,
    Pretrained,
    XLMClassifierConfig,
    XLNetClassifierConfig,
    classifier_config,
)
from pretext_jax.objectives import registry
from pretext_jax.objectives.registry import DownstreamTask, FinetuneRecipe

CLASSIFY = "classify"  # the transformer classifier's method (objectives/classification.py)


@dataclasses.dataclass(frozen=True)
class ClassifierSettings:
    """A family's fine-tuning hyper-parameters for one encoder size and task."""

    learning_rate: float
    epochs: float
    weight_decay: float
    layerwise_lr_decay: float = 1.0
    schedule: str = "linear"
    batch_size: int = 32
    warmup: float = 0.1  # share of the steps
    eps: float = 1e-6  # Adam's epsilon
    eps_before_bias_correction: bool = False
    max_seq_length: int = 0  # 0: the task's input length


@dataclasses.dataclass(frozen=True)
class FinetuneModelConfig(ClassifierConfig, XLNetClassifierConfig, XLMClassifierConfig):
    """Any classifier (`ClassifierConfig` for the bert/electra heads, `XLNetClassifierConfig`
    for xlnet, `XLMClassifierConfig` for xlm; the other families' fields are unused) and
    `init`, where its encoder comes from."""

    heads: ClassVar[tuple[str, ...]] = HEADS
    head: str = "bert"
    init: str = ""
    """Start from: a pretext workdir/model dir or HF BERT/ELECTRA/XLNet/XLM folder; '' = random."""

    @property
    def is_xlm(self) -> bool:
        return self.head == "xlm"


def read_pretrained(init: str, load: Callable[[str], nnx.Module]) -> nnx.Module:
    """The model of `init`, a pretext workdir/model directory or a HuggingFace folder, read by
    `load` (the trainer's checkpoint loader, `pretrain.loading.load_pretrained`: the checkpoint
    formats live with the trainer)."""
    if not Path(init).is_dir():
        raise UserError(f"model.init={init} is not a directory; pass a pretext workdir, a "
                        "model directory or a HuggingFace BERT/ELECTRA/XLNet/XLM folder")
    return load(init)


def as_encoder(init: str, model: nnx.Module) -> Pretrained:
    """`init`'s model as this classifier's encoder: BERT, an ELECTRA discriminator, XLNet or XLM
    (or a fine-tuned classifier, whose encoder is reused)."""
    if not isinstance(model, Pretrained):
        raise UserError(f"{init} holds a {type(model).__name__}; this classifier starts from "
                        "BERT, an ELECTRA discriminator, XLNet or XLM (`run.py finetune --init "
                        f"{init}` picks the method that fine-tunes what it holds, if any)")
    return model


def load_encoder(init: str, load: Callable[[str], nnx.Module]) -> Pretrained:
    """The pre-trained encoder to start from (`read_pretrained`, `as_encoder`)."""
    return as_encoder(init, read_pretrained(init, load))


def layout_of(head: str) -> str:
    """The GLUE input layout a head reads (`input_pipeline.glue.LAYOUTS`)."""
    return head if head in ("xlnet", "xlm") else "bert"


def claims_encoders(head: str, settings: Callable[[int, str], ClassifierSettings]
                    ) -> Callable[[Any, DownstreamTask, Mapping[str, Any]],
                                  FinetuneRecipe | None]:
    """A `Start.finetunes` that claims the pre-trained encoders (and fine-tuned classifiers)
    whose classifier head is `head`, fine-tuned by the task's method (`classify` for GLUE,
    `span` for SQuAD, where that method's model config lists the head in its `heads`)
    with `settings(hidden_size, task name)`, the family's recipe, at the task's input length
    (else 128), and the tokenizer the encoder was trained with."""

    def finetunes(model: Any, task: DownstreamTask, source_config: Mapping[str, Any]
                  ) -> FinetuneRecipe | None:
        del source_config
        if not isinstance(model, Pretrained):
            return None
        config = classifier_config(model, task.num_labels)
        if config.head != head or head not in getattr(
                registry.get(task.method).model_config, "heads", ()):
            return None  # not this family's, or the task's method has no head for it (or none
            # at all: summarisation's encoder-decoders)
        fields = dataclasses.asdict(config)
        chosen = settings(fields["hidden_size"], task.name)
        length = chosen.max_seq_length or task.max_seq_length or 128
        if head != "xlnet":  # XLNet's relative positions: no limit
            length = min(length, fields["max_position_embeddings"])
        values = {"method": task.method, **{f"model.{k}": v for k, v in fields.items()},
                  "examples.max_seq_length": length,
                  "examples.layout": layout_of(head),
                  "train.batch_size": chosen.batch_size,
                  "optim.learning_rate": chosen.learning_rate,
                  "optim.weight_decay": chosen.weight_decay,
                  "optim.layerwise_lr_decay": chosen.layerwise_lr_decay,
                  "optim.schedule": chosen.schedule, "optim.bias_correction": True,
                  "optim.eps_before_bias_correction": chosen.eps_before_bias_correction,
                  "optim.eps": chosen.eps}
        return FinetuneRecipe(values, epochs=chosen.epochs, warmup=chosen.warmup,
                              tokenizer_from_init=True)

    return finetunes
