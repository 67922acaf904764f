"""The HF conversion of span extractors: `BertForQuestionAnswering`,
`ElectraForQuestionAnswering`, `RobertaForQuestionAnswering`, `AlbertForQuestionAnswering`,
`MPNetForQuestionAnswering`, `XLNetForQuestionAnsweringSimple` and
`XLMForQuestionAnsweringSimple` (transformers modeling_<family>.py: the base model without its
pooler + `qa_outputs`) <-> `models.span.SpanExtractor` with that family's head (not its
`AnswerableSpanExtractor` form: HF has no answerability classifier); and
`XLNetForQuestionAnswering` (`start_logits`, `end_logits`, `answer_class`) <->
`models.span.BeamSpanExtractor`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from pretext_jax.models.classifier import (
    ClassifierConfig,
    HeadConfig,
    MPNetClassifierConfig,
    XLMClassifierConfig,
    XLNetClassifierConfig,
)
from pretext_jax.models.hf import albert as albert_hf
from pretext_jax.models.hf import bert as bert_hf
from pretext_jax.models.hf import classifier as classifier_hf
from pretext_jax.models.hf import electra as electra_hf
from pretext_jax.models.hf import encoder as encoder_hf
from pretext_jax.models.hf import mpnet as mpnet_hf
from pretext_jax.models.hf import roberta as roberta_hf
from pretext_jax.models.hf import xlm as xlm_hf
from pretext_jax.models.hf import xlnet as xlnet_hf
from pretext_jax.models.hf.conversion import Converter, Tensor, layer_norm, linear, register
from pretext_jax.models.span import (
    AnswerableSpanExtractor,
    BeamSpanExtractor,
    SpanExtractor,
    XLNetBeamConfig,
)


def _no_answerability_head(model: Any) -> str | None:
    """HF's `*ForQuestionAnswering` hold no answerability classifier (RoBERTa §5.2)."""
    if isinstance(model, AnswerableSpanExtractor):
        return ("HF's *ForQuestionAnswering have no place for the answerability classifier of "
                "model.span_head=answerable; fine-tune with model.span_head=simple to export")
    return None


def span_converter(head: str, architecture: str, prefix: str, config_class: type[HeadConfig],
                   encoder_tensors: Callable[[Any], tuple[Tensor, ...]],
                   encoder_from_hf: Callable[..., Any],
                   encoder_to_hf: Callable[[Any], dict[str, Any]], *,
                   converter_class: type[Converter] = Converter,
                   ignored: tuple[str, ...] = encoder_hf.BUFFERS, **fields: Any) -> Converter:
    """HF `architecture` (model_type `head`, base model under `prefix`, its tensors
    `encoder_tensors`) <-> our `SpanExtractor` whose `config_class` config has that head;
    `fields` are the other `Converter` fields of a `converter_class`."""

    def tensors(config: HeadConfig) -> tuple[Tensor, ...]:
        return (*encoder_tensors(config), *linear("qa_outputs", "qa_outputs"))

    def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> HeadConfig:
        return config_class(**{**dataclasses.asdict(encoder_from_hf(hf)), "head": head,
                               "num_labels": 2, **classifier_hf.dropout_from_hf(hf),
                               **overrides})

    def config_to_hf(config: HeadConfig) -> dict[str, Any]:
        return {**encoder_to_hf(config), "architectures": [architecture], "num_labels": 2,
                **classifier_hf.dropout_to_hf(config)}

    return converter_class(
        model_type=head, model_class=SpanExtractor, architectures=(architecture,),
        config_from_hf=config_from_hf, config_to_hf=config_to_hf, tensors=tensors,
        prefix=prefix, optional=("qa_outputs.",), ignored=ignored,
        accepts=lambda config: config.head == head, refuses=_no_answerability_head, **fields)


def _encoder_tensors(prefix: str) -> Callable[[ClassifierConfig], tuple[Tensor, ...]]:
    return lambda config: encoder_hf.tensors(prefix, config)


register("bert-span", span_converter(
    "bert", "BertForQuestionAnswering", "bert.", ClassifierConfig, _encoder_tensors("bert."),
    bert_hf.config_from_hf, bert_hf.config_to_hf))
register("electra-span", span_converter(
    "electra", "ElectraForQuestionAnswering", "electra.", ClassifierConfig,
    _encoder_tensors("electra."), electra_hf.config_from_hf,
    electra_hf.config_to_hf("ElectraForPreTraining")))
register("roberta-span", span_converter(
    "roberta", "RobertaForQuestionAnswering", "roberta.", ClassifierConfig,
    roberta_hf.encoder_tensors, roberta_hf.config_from_hf, roberta_hf.config_to_hf))
register("albert-span", span_converter(
    "albert", "AlbertForQuestionAnswering", "albert.", ClassifierConfig,
    albert_hf.encoder_tensors, albert_hf.config_from_hf, albert_hf.config_to_hf))
register("mpnet-span", span_converter(
    "mpnet", "MPNetForQuestionAnswering", "mpnet.", MPNetClassifierConfig,
    lambda config: mpnet_hf.encoder_tensors(config, "transformer."), mpnet_hf.config_from_hf,
    mpnet_hf.config_to_hf, ignored=("embeddings.position_ids",)))
register("xlnet-span", span_converter(
    "xlnet", "XLNetForQuestionAnsweringSimple", "transformer.", XLNetClassifierConfig,
    lambda config: xlnet_hf.transformer_tensors(config, "transformer."),
    xlnet_hf.config_from_hf, xlnet_hf.config_to_hf))
register("xlm-span", span_converter(
    "xlm", "XLMForQuestionAnsweringSimple", "transformer.", XLMClassifierConfig,
    lambda config: xlm_hf.transformer_tensors(config, "transformer."),
    xlm_hf.classifier_config_from_hf, xlm_hf.config_to_hf, converter_class=xlm_hf.XLMConverter,
    ignored=("position_ids",), buffers=xlm_hf.buffers))


def _beam_tensors(config: XLNetBeamConfig) -> tuple[Tensor, ...]:
    """`XLNetForQuestionAnswering`: `transformer`, `start_logits.dense`, `end_logits` (dense_0,
    LayerNorm, dense_1), `answer_class` (dense_0, dense_1 without bias)."""
    return (*xlnet_hf.transformer_tensors(config, "transformer."),
            *linear("start_logits.dense", "start_dense"),
            *linear("end_logits.dense_0", "end_dense_0"),
            *layer_norm("end_logits.LayerNorm", "end_norm"),
            *linear("end_logits.dense_1", "end_dense_1"),
            *linear("answer_class.dense_0", "answer_dense_0"),
            Tensor("answer_class.dense_1.weight", "answer_dense_1.kernel", transpose=True))


def _beam_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> XLNetBeamConfig:
    return XLNetBeamConfig(**{
        **dataclasses.asdict(xlnet_hf.config_from_hf(hf)), "head": "xlnet", "num_labels": 2,
        **classifier_hf.dropout_from_hf(hf), "start_n_top": hf.get("start_n_top", 5),
        "end_n_top": hf.get("end_n_top", 5), **overrides})


def _beam_config_to_hf(config: XLNetBeamConfig) -> dict[str, Any]:
    return {**xlnet_hf.config_to_hf(config), "architectures": ["XLNetForQuestionAnswering"],
            "start_n_top": config.start_n_top, "end_n_top": config.end_n_top,
            **classifier_hf.dropout_to_hf(config)}


register("xlnet-beam-span", Converter(
    model_type="xlnet", model_class=BeamSpanExtractor,
    architectures=("XLNetForQuestionAnswering",), config_from_hf=_beam_config_from_hf,
    config_to_hf=_beam_config_to_hf, tensors=_beam_tensors, prefix="transformer.",
    optional=("start_logits.", "end_logits.", "answer_class."), ignored=encoder_hf.BUFFERS,
    accepts=lambda config: config.head == "xlnet"))  # ALBERT's beam head has no HF class
