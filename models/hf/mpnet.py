"""MPNet's HF conversion (transformers models/mpnet/modeling_mpnet.py, configuration_mpnet.py):
`MPNetForMaskedLM` <-> `models.mpnet.MPNet`, `MPNetForSequenceClassification` /
`MPNetForTokenClassification` <-> the classifiers with the mpnet head
(`MPNetForQuestionAnswering`: `hf.span`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pretext_jax.models.classifier import HeadConfig, MPNetClassifierConfig, TokenClassifier
from pretext_jax.models.hf import classifier as classifier_hf
from pretext_jax.models.hf import encoder as encoder_hf
from pretext_jax.models.hf.conversion import (
    OUR_TO_HF_ACTIVATION,
    Converter,
    Tensor,
    layer_norm,
    linear,
    masked_lm_head,
    register,
)
from pretext_jax.models.mpnet import MPNet, MPNetConfig


def encoder_tensors(config: MPNetConfig, ours: str = "") -> tuple[Tensor, ...]:
    """`mpnet` (`MPNetModel` without pooler: `embeddings` without token types,
    `encoder.layer.{i}` with `attention.attn` q/k/v/o, the shared
    `encoder.relative_attention_bias`); `ours` prefixes our names (a head's `transformer.`)."""
    layer, layers = "mpnet.encoder.layer.{i}", f"{ours}layers"
    return (
        Tensor("mpnet.embeddings.word_embeddings.weight", f"{ours}word_embeddings.embedding"),
        Tensor("mpnet.embeddings.position_embeddings.weight",
               f"{ours}position_embeddings.embedding"),
        *layer_norm("mpnet.embeddings.LayerNorm", f"{ours}embedding_layer_norm"),
        Tensor("mpnet.encoder.relative_attention_bias.weight",
               f"{ours}relative_attention_bias.embedding"),
        *linear(f"{layer}.attention.attn.q", f"{layers}.query"),
        *linear(f"{layer}.attention.attn.k", f"{layers}.key"),
        *linear(f"{layer}.attention.attn.v", f"{layers}.value"),
        *linear(f"{layer}.attention.attn.o", f"{layers}.attention_output"),
        *layer_norm(f"{layer}.attention.LayerNorm", f"{layers}.attention_layer_norm"),
        *linear(f"{layer}.intermediate.dense", f"{layers}.intermediate"),
        *linear(f"{layer}.output.dense", f"{layers}.output"),
        *layer_norm(f"{layer}.output.LayerNorm", f"{layers}.output_layer_norm"),
    )


def tensors(config: MPNetConfig) -> tuple[Tensor, ...]:
    """`MPNetForMaskedLM`: `mpnet` (`encoder_tensors`) and `lm_head` (dense, layer_norm,
    decoder tied to the word embeddings, bias)."""
    return (*encoder_tensors(config),
            *masked_lm_head("lm_head.dense", "lm_head.layer_norm", "lm_head.bias"))


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> MPNetConfig:
    """`MPNetConfig` -> ours: BERT's field names without token types, plus the bucket count
    (HF's default layer_norm_eps 1e-12 when absent; the released models say 1e-5)."""
    shared = dataclasses.asdict(encoder_hf.config_from_hf(hf))
    ours = {f.name for f in dataclasses.fields(MPNetConfig)}
    return MPNetConfig(**{
        **{k: v for k, v in shared.items() if k in ours},
        "relative_attention_num_buckets": hf.get("relative_attention_num_buckets", 32),
        **overrides})


def config_to_hf(config: MPNetConfig) -> dict[str, Any]:
    return {
        "model_type": "mpnet", "architectures": ["MPNetForMaskedLM"],
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "intermediate_size": config.intermediate_size,
        "hidden_act": OUR_TO_HF_ACTIVATION[config.hidden_act],
        "hidden_dropout_prob": config.hidden_dropout,
        "attention_probs_dropout_prob": config.attention_dropout,
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range, "layer_norm_eps": config.layer_norm_eps,
        "relative_attention_num_buckets": config.relative_attention_num_buckets,
        "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "tie_word_embeddings": True,
    }


register("mpnet", Converter(
    model_type="mpnet", model_class=MPNet, architectures=("MPNetForMaskedLM",),
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, tensors=tensors, prefix="mpnet.",
    optional=("lm_head.",), base_architecture="MPNetModel",
    tied={"lm_head.decoder.weight": "mpnet.embeddings.word_embeddings.weight",
          "lm_head.decoder.bias": "lm_head.bias"},
    ignored=("embeddings.position_ids",),
))


def classifier_tensors(config: HeadConfig) -> tuple[Tensor, ...]:
    """`MPNetForSequenceClassification`: `mpnet` + `classifier` (`MPNetClassificationHead`:
    `dense`, `out_proj`)."""
    return (*encoder_tensors(config, "transformer."), *linear("classifier.dense", "head_dense"),
            *linear("classifier.out_proj", "head_output"))


def tagger_tensors(config: HeadConfig) -> tuple[Tensor, ...]:
    """`MPNetForTokenClassification`: `mpnet` + `classifier` (one linear layer)."""
    return (*encoder_tensors(config, "transformer."), *linear("classifier", "head_output"))


# HF's MPNet heads drop out at `hidden_dropout_prob`; our `classifier_dropout` travels in
# config.json as `classifier_dropout` (as BERT's), which transformers keeps and does not read.
register("mpnet-classifier", classifier_hf.classifier_converter(
    "mpnet", "MPNetForSequenceClassification", MPNetClassifierConfig, classifier_tensors,
    config_from_hf, config_to_hf, classifier_hf.dropout_from_hf, classifier_hf.dropout_to_hf,
    prefix="mpnet.", optional=("classifier.",), ignored=("embeddings.position_ids",)))
register("mpnet-tagger", classifier_hf.classifier_converter(
    "mpnet", "MPNetForTokenClassification", MPNetClassifierConfig, tagger_tensors,
    config_from_hf, config_to_hf, classifier_hf.dropout_from_hf, classifier_hf.dropout_to_hf,
    model_class=TokenClassifier, prefix="mpnet.", optional=("classifier.",),
    ignored=("embeddings.position_ids",)))
