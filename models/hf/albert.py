"""ALBERT's HF conversion (transformers models/albert/modeling_albert.py,
configuration_albert.py): `AlbertForPreTraining` <-> `models.albert.Albert`,
`AlbertForSequenceClassification` / `AlbertForTokenClassification` <-> the classifiers with the
albert head (`AlbertForQuestionAnswering`: `hf.span`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pretext_jax.errors import UserError
from pretext_jax.models.albert import Albert, AlbertConfig
from pretext_jax.models.classifier import ClassifierConfig, HeadConfig, TokenClassifier
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.models.hf import classifier as classifier_hf
from pretext_jax.models.hf import encoder as encoder_hf
from pretext_jax.models.hf.conversion import (
    Converter,
    Tensor,
    layer_norm,
    linear,
    masked_lm_head,
    register,
)

ALBERT_LAYER = "albert.encoder.albert_layer_groups.0.albert_layers.0"


def encoder_tensors(config: EncoderConfig) -> tuple[Tensor, ...]:
    """`albert` without its pooler: `AlbertEmbeddings` as BERT's at width E,
    `encoder.embedding_hidden_mapping_in`, the one shared layer of the one layer group."""
    layer, ours = ALBERT_LAYER, "encoder.stack.layer"
    embeddings = [t for t in encoder_hf.tensors("albert.", config)
                  if t.ours.startswith("encoder.embeddings.")]
    return (
        *embeddings,
        *linear("albert.encoder.embedding_hidden_mapping_in", "encoder.embeddings_project"),
        *linear(f"{layer}.attention.query", f"{ours}.query"),
        *linear(f"{layer}.attention.key", f"{ours}.key"),
        *linear(f"{layer}.attention.value", f"{ours}.value"),
        *linear(f"{layer}.attention.dense", f"{ours}.attention_output"),
        *layer_norm(f"{layer}.attention.LayerNorm", f"{ours}.attention_layer_norm"),
        *linear(f"{layer}.ffn", f"{ours}.intermediate"),
        *linear(f"{layer}.ffn_output", f"{ours}.output"),
        *layer_norm(f"{layer}.full_layer_layer_norm", f"{ours}.output_layer_norm"),
    )


def tensors(config: AlbertConfig) -> tuple[Tensor, ...]:
    """`AlbertForPreTraining`: `albert` (`encoder_tensors`, `pooler`) + `predictions`
    (`AlbertMLMHead`: `dense`, `LayerNorm`, `bias`; decoder tied) +
    `sop_classifier.classifier`."""
    return (
        *encoder_tensors(config),
        *linear("albert.pooler", "pooler"),
        *masked_lm_head("predictions.dense", "predictions.LayerNorm", "predictions.bias"),
        *linear("sop_classifier.classifier", "sop"),
    )


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> AlbertConfig:
    """HF `AlbertConfig` (its defaults: gelu_new, no dropout, E = 128) -> ours; only one layer
    group of one layer, i.e. all layers sharing one set of parameters, is supported."""
    groups, inner = hf.get("num_hidden_groups", 1), hf.get("inner_group_num", 1)
    if (groups, inner) != (1, 1):
        raise UserError(f"config.json has num_hidden_groups={groups}, inner_group_num={inner}; "
                        "only 1 and 1 (all layers share one, as every released ALBERT) are "
                        "supported")
    hf = {"hidden_act": "gelu_new", "hidden_dropout_prob": 0.0,
          "attention_probs_dropout_prob": 0.0, **hf}
    fields = {"embedding_size": hf.get("embedding_size", 128), **overrides}
    return AlbertConfig(**dataclasses.asdict(encoder_hf.config_from_hf(hf, **fields)))


def pretraining_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> AlbertConfig:
    """`config_from_hf` of an `AlbertForPreTraining`, whose sentence-order head has 2 labels."""
    if hf.get("num_labels", 2) != 2:
        raise UserError(f"config.json has num_labels={hf['num_labels']}; the sentence-order "
                        "head has 2")
    return config_from_hf(hf, **overrides)


def config_to_hf(config: AlbertConfig) -> dict[str, Any]:
    return {"model_type": "albert", "architectures": ["AlbertForPreTraining"],
            **encoder_hf.config_to_hf(config), "embedding_size": config.embedding_width,
            "num_hidden_groups": 1, "inner_group_num": 1, "tie_word_embeddings": True}


register("albert", Converter(
    model_type="albert", model_class=Albert,
    architectures=("AlbertForPreTraining",), config_from_hf=pretraining_config_from_hf,
    config_to_hf=config_to_hf, tensors=tensors, prefix="albert.",
    optional=("albert.pooler.", "predictions.", "sop_classifier."),
    base_architecture="AlbertModel",
    tied={"predictions.decoder.weight": "albert.embeddings.word_embeddings.weight",
          "predictions.decoder.bias": "predictions.bias"},
    ignored=encoder_hf.BUFFERS,
))


def dropout_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """HF `classifier_dropout_prob` (default 0.1; None, for the token classifier: the hidden
    dropout) -> our `classifier_dropout` (< 0: the same)."""
    dropout = hf.get("classifier_dropout_prob", 0.1)
    return {"classifier_dropout": -1.0 if dropout is None else dropout}


def dropout_to_hf(config: HeadConfig) -> dict[str, Any]:
    """The head's dropout as a number (`AlbertForSequenceClassification` takes no None)."""
    return {"classifier_dropout_prob": config.head_dropout}


def classifier_tensors(config: HeadConfig) -> tuple[Tensor, ...]:
    """`AlbertForSequenceClassification`: `albert` + `albert.pooler` + `classifier`."""
    return (*encoder_tensors(config), *linear("albert.pooler", "head_dense"),
            *linear("classifier", "head_output"))


def tagger_tensors(config: HeadConfig) -> tuple[Tensor, ...]:
    """`AlbertForTokenClassification`: `albert` (no pooler) + `classifier`."""
    return (*encoder_tensors(config), *linear("classifier", "head_output"))


register("albert-classifier", classifier_hf.classifier_converter(
    "albert", "AlbertForSequenceClassification", ClassifierConfig, classifier_tensors,
    config_from_hf, config_to_hf, dropout_from_hf, dropout_to_hf, prefix="albert.",
    optional=("classifier.",), ignored=encoder_hf.BUFFERS))
register("albert-tagger", classifier_hf.classifier_converter(
    "albert", "AlbertForTokenClassification", ClassifierConfig, tagger_tensors,
    config_from_hf, config_to_hf, dropout_from_hf, dropout_to_hf,
    model_class=TokenClassifier, prefix="albert.", optional=("classifier.",),
    ignored=encoder_hf.BUFFERS))
