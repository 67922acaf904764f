"""ERNIE's HF conversion (transformers models/ernie/modeling_ernie.py, configuration_ernie.py):
`ErnieForPreTraining` <-> `models.bert.Ernie`. The names are `BertForPreTraining`'s under the
prefix `ernie.`, plus `ernie.embeddings.task_type_embeddings` when the config has `use_task_id`
(our `EncoderConfig.task_type_vocab_size` > 0)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pretext_jax.models.bert import Ernie
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.models.hf import bert as bert_hf
from pretext_jax.models.hf import encoder as encoder_hf
from pretext_jax.models.hf.conversion import Converter, Tensor, register

PREFIX = "ernie."


def tensors(config: EncoderConfig) -> tuple[Tensor, ...]:
    task = ((Tensor(f"{PREFIX}embeddings.task_type_embeddings.weight",
                    "encoder.embeddings.task_type_embeddings.embedding"),)
            if config.task_type_vocab_size else ())
    return (*bert_hf.tensors(config, PREFIX), *task)


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> EncoderConfig:
    tasks = hf.get("task_type_vocab_size", 3) if hf.get("use_task_id", False) else 0
    return bert_hf.config_from_hf(hf, **{"task_type_vocab_size": tasks, **overrides})


def config_to_hf(config: EncoderConfig) -> dict[str, Any]:
    tasks = config.task_type_vocab_size
    return {**bert_hf.config_to_hf(config), "model_type": "ernie",
            "architectures": ["ErnieForPreTraining"], "use_task_id": bool(tasks),
            "task_type_vocab_size": tasks or 3}


register("ernie", Converter(
    model_type="ernie", model_class=Ernie, architectures=("ErnieForPreTraining",),
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, tensors=tensors, prefix=PREFIX,
    optional=(f"{PREFIX}pooler.", "cls.predictions.", "cls.seq_relationship."),
    base_architecture="ErnieModel",
    tied={"cls.predictions.decoder.weight": f"{PREFIX}embeddings.word_embeddings.weight",
          "cls.predictions.decoder.bias": "cls.predictions.bias"},
    ignored=encoder_hf.BUFFERS,
))
