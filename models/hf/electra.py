"""ELECTRA's HF conversion (transformers models/electra/modeling_electra.py,
configuration_electra.py): `ElectraForPreTraining` <-> `ElectraDiscriminator`,
`ElectraForMaskedLM` <-> `ElectraGenerator`, `ElectraForSequenceClassification` <-> the
classifier with the electra head; the joint pre-training model is saved as its two parts."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pretext_jax.models.classifier import ClassifierConfig, HeadConfig, TokenClassifier
from pretext_jax.models.electra import ElectraDiscriminator, ElectraGenerator
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.models.hf import classifier as classifier_hf
from pretext_jax.models.hf import encoder as encoder_hf
from pretext_jax.models.hf.conversion import Converter, Tensor, linear, masked_lm_head, register

# Note: HF's generator head always applies the exact GELU (`get_activation("gelu")`), the TF
# reference the config's `hidden_act`; ours follows `hidden_act`, so HF generators with another
# activation than "gelu" differ in that one place. All released ELECTRA models use "gelu".

def discriminator_tensors(config: EncoderConfig) -> tuple[Tensor, ...]:
    """`ElectraForPreTraining`: `electra` (`ElectraModel`) + `discriminator_predictions`
    (`dense`, `dense_prediction`)."""
    return (*encoder_hf.tensors("electra.", config),
            *linear("discriminator_predictions.dense", "rtd_transform"),
            *linear("discriminator_predictions.dense_prediction", "rtd_output"))


def generator_tensors(config: EncoderConfig) -> tuple[Tensor, ...]:
    """`ElectraForMaskedLM`: `electra` + `generator_predictions` (`dense` to embedding_size,
    `LayerNorm`) + `generator_lm_head` (weight tied to the word embeddings, own bias)."""
    return (*encoder_hf.tensors("electra.", config),
            *masked_lm_head("generator_predictions.dense", "generator_predictions.LayerNorm",
                            "generator_lm_head.bias"))


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> EncoderConfig:
    return encoder_hf.config_from_hf(
        hf, **{"embedding_size": hf.get("embedding_size", hf["hidden_size"]), **overrides})


def config_to_hf(architecture: str) -> Callable[[EncoderConfig], dict[str, Any]]:
    def to_hf(config: EncoderConfig) -> dict[str, Any]:
        return {"model_type": "electra", "architectures": [architecture],
                **encoder_hf.config_to_hf(config), "embedding_size": config.embedding_width,
                "tie_word_embeddings": True}
    return to_hf


def classifier_tensors(config: HeadConfig) -> tuple[Tensor, ...]:
    """`ElectraForSequenceClassification`: `electra` + `classifier`
    (`ElectraClassificationHead`: `dense`, `out_proj`)."""
    return (*encoder_hf.tensors("electra.", config), *linear("classifier.dense", "head_dense"),
            *linear("classifier.out_proj", "head_output"))


def tagger_tensors(config: HeadConfig) -> tuple[Tensor, ...]:
    """`ElectraForTokenClassification`: `electra` + `classifier` (one linear layer)."""
    return (*encoder_hf.tensors("electra.", config), *linear("classifier", "head_output"))


register("electra-discriminator", Converter(
    model_type="electra", model_class=ElectraDiscriminator,
    architectures=("ElectraForPreTraining",), config_from_hf=config_from_hf,
    config_to_hf=config_to_hf("ElectraForPreTraining"), tensors=discriminator_tensors,
    prefix="electra.", optional=("discriminator_predictions.",), ignored=encoder_hf.BUFFERS,
    base_architecture="ElectraModel",
))
register("electra-generator", Converter(
    model_type="electra", model_class=ElectraGenerator,
    architectures=("ElectraForMaskedLM",), config_from_hf=config_from_hf,
    config_to_hf=config_to_hf("ElectraForMaskedLM"), tensors=generator_tensors,
    prefix="electra.", optional=("generator_predictions.", "generator_lm_head."),
    tied={"generator_lm_head.weight": "electra.embeddings.word_embeddings.weight"},
    ignored=encoder_hf.BUFFERS,
))
register("electra-classifier", classifier_hf.classifier_converter(
    "electra", "ElectraForSequenceClassification", ClassifierConfig, classifier_tensors,
    config_from_hf, config_to_hf("ElectraForPreTraining"), classifier_hf.dropout_from_hf,
    classifier_hf.dropout_to_hf, prefix="electra.", optional=("classifier.",),
    ignored=encoder_hf.BUFFERS))
register("electra-tagger", classifier_hf.classifier_converter(
    "electra", "ElectraForTokenClassification", ClassifierConfig, tagger_tensors,
    config_from_hf, config_to_hf("ElectraForPreTraining"), classifier_hf.dropout_from_hf,
    classifier_hf.dropout_to_hf, model_class=TokenClassifier, prefix="electra.",
    optional=("classifier.",), ignored=encoder_hf.BUFFERS))
