"""BERT's HF conversion (transformers models/bert/modeling_bert.py, configuration_bert.py):
`BertForPreTraining` <-> `models.bert.Bert`, `BertForSequenceClassification` <-> the classifier
with the bert head, and `BertForMaskedLM` <-> UniLM's prefix LM (`models.prefix_lm.PrefixLM`,
a BERT encoder and masked-LM head: HF has no UniLM class; its seq2seq attention is HF BERT's
with a [B, 1, S, S] attention mask)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pretext_jax.errors import UserError
from pretext_jax.models.bert import Bert
from pretext_jax.models.classifier import ClassifierConfig, HeadConfig, TokenClassifier
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.models.hf import classifier as classifier_hf
from pretext_jax.models.hf import encoder as encoder_hf
from pretext_jax.models.hf.conversion import Converter, Tensor, linear, masked_lm_head, register
from pretext_jax.models.prefix_lm import PrefixLM, PrefixLMConfig


def tensors(config: EncoderConfig, prefix: str = "bert.") -> tuple[Tensor, ...]:
    """`BertForPreTraining` names: `bert` (`BertModel`: `BertEmbeddings`, `BertEncoder` of
    `BertLayer`s, `BertPooler`) and `cls` (`BertPreTrainingHeads`: `predictions` =
    `BertLMPredictionHead` with its `transform` and `bias`, `seq_relationship`); `prefix`
    names the base model (`ErnieForPreTraining`: "ernie.")."""
    return (
        *encoder_hf.tensors(prefix, config),
        *linear(f"{prefix}pooler.dense", "pooler"),
        *masked_lm_head("cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm",
                        "cls.predictions.bias"),
        *linear("cls.seq_relationship", "nsp"),
    )


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> EncoderConfig:
    if hf.get("embedding_size", hf["hidden_size"]) != hf["hidden_size"]:
        raise UserError("a BERT config.json with embedding_size != hidden_size is not BERT; "
                        "fix config.json")
    return encoder_hf.config_from_hf(hf, **overrides)


def config_to_hf(config: EncoderConfig) -> dict[str, Any]:
    return {"model_type": "bert", "architectures": ["BertForPreTraining"],
            **encoder_hf.config_to_hf(config), "tie_word_embeddings": True}


def classifier_tensors(config: HeadConfig) -> tuple[Tensor, ...]:
    """`BertForSequenceClassification`: `bert` + `bert.pooler.dense` + `classifier`."""
    return (*encoder_hf.tensors("bert.", config), *linear("bert.pooler.dense", "head_dense"),
            *linear("classifier", "head_output"))


def tagger_tensors(config: HeadConfig) -> tuple[Tensor, ...]:
    """`BertForTokenClassification`: `bert` (no pooler) + `classifier`."""
    return (*encoder_hf.tensors("bert.", config), *linear("classifier", "head_output"))


# The prefix LM's own settings, kept in config.json under this key (BertConfig keeps unknown
# keys): their presence makes an import a PrefixLM, not a BERT (`Converter.marker`).
PREFIX_LM_KEY = "prefix_lm"
PREFIX_LM_FIELDS = ("sos_token_id", "eos_token_id", "mask_token_id", "pad_token_id",
                    "source_type_id", "target_type_id")


def prefix_lm_tensors(config: EncoderConfig) -> tuple[Tensor, ...]:
    """`BertForMaskedLM`: `bert` (no pooler) and `cls.predictions`."""
    return (*encoder_hf.tensors("bert.", config),
            *masked_lm_head("cls.predictions.transform.dense",
                            "cls.predictions.transform.LayerNorm", "cls.predictions.bias"))


def prefix_lm_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> PrefixLMConfig:
    encoder = config_from_hf(hf)
    return PrefixLMConfig(**{f.name: getattr(encoder, f.name)
                             for f in dataclasses.fields(encoder)},
                          **{**hf[PREFIX_LM_KEY], **overrides})


def prefix_lm_config_to_hf(config: PrefixLMConfig) -> dict[str, Any]:
    return {**config_to_hf(config), "architectures": ["BertForMaskedLM"],
            PREFIX_LM_KEY: {name: getattr(config, name) for name in PREFIX_LM_FIELDS}}


def three_way_sentence_head(model: Bert) -> str | None:
    """StructBERT's next / previous / random head has no place in `BertForPreTraining`."""
    classes = model.nsp.kernel.shape[-1]
    return None if classes == 2 else (
        f"this BERT model's sentence head has {classes} classes (StructBERT's next / previous "
        "/ random) and HF BertForPreTraining's has 2, so it has no HF form; keep it as a "
        "pretext workdir")


register("bert", Converter(
    model_type="bert", model_class=Bert, architectures=("BertForPreTraining",),
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, tensors=tensors, prefix="bert.",
    optional=("bert.pooler.", "cls.predictions.", "cls.seq_relationship."),
    base_architecture="BertModel",
    tied={"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
          "cls.predictions.decoder.bias": "cls.predictions.bias"},
    ignored=encoder_hf.BUFFERS, refuses=three_way_sentence_head,
))
register("bert-prefix-lm", Converter(
    model_type="bert", model_class=PrefixLM, architectures=("BertForMaskedLM",),
    config_from_hf=prefix_lm_config_from_hf, config_to_hf=prefix_lm_config_to_hf,
    tensors=prefix_lm_tensors, prefix="bert.", marker=PREFIX_LM_KEY,
    tied={"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
          "cls.predictions.decoder.bias": "cls.predictions.bias"},
    ignored=encoder_hf.BUFFERS,
))
register("bert-classifier", classifier_hf.classifier_converter(
    "bert", "BertForSequenceClassification", ClassifierConfig, classifier_tensors,
    config_from_hf, config_to_hf, classifier_hf.dropout_from_hf, classifier_hf.dropout_to_hf,
    prefix="bert.", optional=("classifier.",), ignored=encoder_hf.BUFFERS))
register("bert-tagger", classifier_hf.classifier_converter(
    "bert", "BertForTokenClassification", ClassifierConfig, tagger_tensors, config_from_hf,
    config_to_hf, classifier_hf.dropout_from_hf, classifier_hf.dropout_to_hf,
    model_class=TokenClassifier, prefix="bert.", optional=("classifier.",),
    ignored=encoder_hf.BUFFERS))
