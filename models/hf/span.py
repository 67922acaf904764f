"""The HF conversion of span extractors: `BertForQuestionAnswering` and
`ElectraForQuestionAnswering` (transformers modeling_bert.py / modeling_electra.py: the base
model + `qa_outputs`) <-> `models.span.SpanExtractor` with the bert or electra head."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from pretext_jax.models.classifier import ClassifierConfig
from pretext_jax.models.hf import bert as bert_hf
from pretext_jax.models.hf import classifier as classifier_hf
from pretext_jax.models.hf import electra as electra_hf
from pretext_jax.models.hf import encoder as encoder_hf
from pretext_jax.models.hf.conversion import Converter, Tensor, linear, register
from pretext_jax.models.span import SpanExtractor


def span_converter(head: str, architecture: str, prefix: str,
                   encoder_from_hf: Callable[..., Any],
                   encoder_to_hf: Callable[[Any], dict[str, Any]]) -> Converter:
    """HF `architecture` (model_type `head`, base model under `prefix`) <-> our
    `SpanExtractor` whose config has that head."""

    def tensors(config: ClassifierConfig) -> tuple[Tensor, ...]:
        return (*encoder_hf.tensors(prefix, config), *linear("qa_outputs", "qa_outputs"))

    def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ClassifierConfig:
        return ClassifierConfig(**{**dataclasses.asdict(encoder_from_hf(hf)), "head": head,
                                   "num_labels": 2, **classifier_hf.dropout_from_hf(hf),
                                   **overrides})

    def config_to_hf(config: ClassifierConfig) -> dict[str, Any]:
        return {**encoder_to_hf(config), "architectures": [architecture], "num_labels": 2,
                **classifier_hf.dropout_to_hf(config)}

    return Converter(model_type=head, model_class=SpanExtractor, architectures=(architecture,),
                     config_from_hf=config_from_hf, config_to_hf=config_to_hf, tensors=tensors,
                     prefix=prefix, optional=("qa_outputs.",), ignored=encoder_hf.BUFFERS,
                     accepts=lambda config: config.head == head)


register("bert-span", span_converter("bert", "BertForQuestionAnswering", "bert.",
                                     bert_hf.config_from_hf, bert_hf.config_to_hf))
register("electra-span", span_converter(
    "electra", "ElectraForQuestionAnswering", "electra.", electra_hf.config_from_hf,
    electra_hf.config_to_hf("ElectraForPreTraining")))
