"""RoBERTa's HF conversion (transformers models/roberta/modeling_roberta.py,
configuration_roberta.py): `RobertaForMaskedLM` <-> `models.roberta.Roberta`,
`RobertaForSequenceClassification` / `RobertaForTokenClassification` <-> the classifiers with
the roberta head (`RobertaForQuestionAnswering`: `hf.span`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pretext_jax.models.classifier import ClassifierConfig, HeadConfig, TokenClassifier
from pretext_jax.models.hf import classifier as classifier_hf
from pretext_jax.models.hf import encoder as encoder_hf
from pretext_jax.models.hf.conversion import Converter, Tensor, linear, masked_lm_head, register
from pretext_jax.models.roberta import Roberta, RobertaConfig


def tensors(config: RobertaConfig) -> tuple[Tensor, ...]:
    """`RobertaForMaskedLM`: `roberta` (`RobertaModel` without pooler: BERT's embeddings and
    layers) + `lm_head` (`RobertaLMHead`: `dense`, `layer_norm`, `bias`; decoder tied)."""
    return (*encoder_hf.tensors("roberta.", config),
            *masked_lm_head("lm_head.dense", "lm_head.layer_norm", "lm_head.bias"))


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> RobertaConfig:
    """HF's `pad_token_id` (1 in the released models) is where positions start counting."""
    fields = {"position_padding_id": hf.get("pad_token_id", 1), **overrides}
    return RobertaConfig(**dataclasses.asdict(encoder_hf.config_from_hf(hf, **fields)))


def config_to_hf(config: RobertaConfig) -> dict[str, Any]:
    return {"model_type": "roberta", "architectures": ["RobertaForMaskedLM"],
            **encoder_hf.config_to_hf(config), "pad_token_id": config.position_padding_id,
            "tie_word_embeddings": True}


register("roberta", Converter(
    model_type="roberta", model_class=Roberta,
    architectures=("RobertaForMaskedLM",), config_from_hf=config_from_hf,
    config_to_hf=config_to_hf, tensors=tensors, prefix="roberta.", optional=("lm_head.",),
    base_architecture="RobertaModel",
    tied={"lm_head.decoder.weight": "roberta.embeddings.word_embeddings.weight",
          "lm_head.decoder.bias": "lm_head.bias"},
    ignored=(*encoder_hf.BUFFERS, "pooler.dense.weight", "pooler.dense.bias"),
))


def encoder_tensors(config: HeadConfig) -> tuple[Tensor, ...]:
    """`roberta` without its pooler (`add_pooling_layer=False`, as every RoBERTa head has it)."""
    return encoder_hf.tensors("roberta.", config)


def classifier_tensors(config: HeadConfig) -> tuple[Tensor, ...]:
    """`RobertaForSequenceClassification`: `roberta` + `classifier`
    (`RobertaClassificationHead`: `dense`, `out_proj`)."""
    return (*encoder_tensors(config), *linear("classifier.dense", "head_dense"),
            *linear("classifier.out_proj", "head_output"))


def tagger_tensors(config: HeadConfig) -> tuple[Tensor, ...]:
    """`RobertaForTokenClassification`: `roberta` + `classifier` (one linear layer)."""
    return (*encoder_tensors(config), *linear("classifier", "head_output"))


register("roberta-classifier", classifier_hf.classifier_converter(
    "roberta", "RobertaForSequenceClassification", ClassifierConfig, classifier_tensors,
    config_from_hf, config_to_hf, classifier_hf.dropout_from_hf, classifier_hf.dropout_to_hf,
    prefix="roberta.", optional=("classifier.",), ignored=encoder_hf.BUFFERS))
register("roberta-tagger", classifier_hf.classifier_converter(
    "roberta", "RobertaForTokenClassification", ClassifierConfig, tagger_tensors,
    config_from_hf, config_to_hf, classifier_hf.dropout_from_hf, classifier_hf.dropout_to_hf,
    model_class=TokenClassifier, prefix="roberta.", optional=("classifier.",),
    ignored=encoder_hf.BUFFERS))
