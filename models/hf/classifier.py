"""The HF conversion of sequence classifiers (`*ForSequenceClassification`) <-> our
`models.classifier.SequenceClassifier`, and of token classifiers (`*ForTokenClassification`) <->
`TokenClassifier`: a family's encoder table plus its head, the labels and the head's settings.
Each family registers its own (`bert_hf`, `electra_hf`, `xlnet_hf`, `xlm_hf`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from pretext_jax.models.classifier import HeadConfig, SequenceClassifier, TokenClassifier
from pretext_jax.models.hf.conversion import Converter, Tensor


def dropout_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """HF `classifier_dropout` (None: the hidden dropout) -> ours (< 0: the same)."""
    dropout = hf.get("classifier_dropout")
    return {"classifier_dropout": -1.0 if dropout is None else dropout}


def dropout_to_hf(config: HeadConfig) -> dict[str, Any]:
    return {"classifier_dropout": (None if config.classifier_dropout < 0
                                   else config.classifier_dropout)}


def classifier_converter(
    head: str, architecture: str, config_class: type[HeadConfig],
    tensors: Callable[[Any], tuple[Tensor, ...]],
    encoder_from_hf: Callable[..., Any], encoder_to_hf: Callable[[Any], dict[str, Any]],
    head_from_hf: Callable[[Mapping[str, Any]], dict[str, Any]],
    head_to_hf: Callable[[Any], dict[str, Any]], *,
    converter_class: type[Converter] = Converter,
    model_class: type[SequenceClassifier | TokenClassifier] = SequenceClassifier, **fields: Any,
) -> Converter:
    """HF `architecture` (model_type `head`) <-> our `SequenceClassifier` with that head: the
    family's encoder config and `tensors` plus the labels and the head's own settings
    (`head_from_hf`, `head_to_hf`); `fields` are the other `Converter` fields, of a
    `converter_class` (a family's subclass, e.g. XLM's check of sinusoidal positions).
    `model_class=TokenClassifier` with a `*ForTokenClassification` architecture: the token
    classifier (one label per position)."""

    def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> HeadConfig:
        num_labels = hf.get("num_labels") or len(hf.get("id2label") or {0: 0, 1: 1})
        return config_class(**{
            **dataclasses.asdict(encoder_from_hf(hf)), "head": head, "num_labels": num_labels,
            **head_from_hf(hf), **overrides})

    def config_to_hf(config: HeadConfig) -> dict[str, Any]:
        labels = {str(i): f"LABEL_{i}" for i in range(config.num_labels)}
        return {**encoder_to_hf(config), "architectures": [architecture],
                "id2label": labels, "label2id": {v: int(k) for k, v in labels.items()},
                **({} if model_class is TokenClassifier else {"problem_type": (
                    "regression" if config.num_labels == 1
                    else "single_label_classification")}),
                **head_to_hf(config)}

    return converter_class(
        model_type=head, model_class=model_class,
        architectures=(architecture,), config_from_hf=config_from_hf, config_to_hf=config_to_hf,
        tensors=tensors, accepts=lambda config: config.head == head, **fields)
