"""XLNet's HF conversion (transformers models/xlnet/modeling_xlnet.py, configuration_xlnet.py):
`XLNetLMHeadModel` <-> `models.xlnet.XLNet`, `XLNetForSequenceClassification` <-> the classifier
with the xlnet head."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pretext_jax.errors import UserError
from pretext_jax.models.classifier import HeadConfig, TokenClassifier, XLNetClassifierConfig
from pretext_jax.models.hf import classifier as classifier_hf
from pretext_jax.models.hf.conversion import (
    HF_ACTIVATIONS,
    OUR_TO_HF_ACTIVATION,
    Converter,
    Tensor,
    layer_norm,
    linear,
    register,
)
from pretext_jax.models.xlnet import XLNet, XLNetConfig


def transformer_tensors(config: XLNetConfig, ours: str = "") -> tuple[Tensor, ...]:
    """`transformer` (`XLNetModel`: `word_embedding`, `mask_emb`, layers of `rel_attn` (q, k,
    v, o, r [d_model, n_head, d_head], r_w/r_r/r_s biases, `seg_embed`, `layer_norm`) and `ff`)
    <-> our `XLNetModel` at `ours` (a dotted prefix)."""
    layer, layers = "transformer.layer.{i}", f"{ours}layers"
    shared = 0 if config.untie_r else config.num_layers
    return (
        Tensor("transformer.word_embedding.weight", f"{ours}word_embedding.embedding"),
        Tensor("transformer.mask_emb", f"{ours}mask_emb"),
        *(Tensor(f"{layer}.rel_attn.{name}", f"{layers}.{name}")
          for name in ("q", "k", "v", "o", "r", "seg_embed")),
        *(Tensor(f"{layer}.rel_attn.{name}", f"{ours}{name}", shared_layers=shared)
          for name in ("r_w_bias", "r_r_bias", "r_s_bias")),
        *layer_norm(f"{layer}.rel_attn.layer_norm", f"{layers}.attention_layer_norm"),
        *linear(f"{layer}.ff.layer_1", f"{layers}.intermediate"),
        *linear(f"{layer}.ff.layer_2", f"{layers}.output"),
        *layer_norm(f"{layer}.ff.layer_norm", f"{layers}.output_layer_norm"),
    )


def tensors(config: XLNetConfig) -> tuple[Tensor, ...]:
    """`XLNetLMHeadModel`: `transformer` and `lm_loss` (weight tied to the word embedding, own
    bias)."""
    return (*transformer_tensors(config), Tensor("lm_loss.bias", "lm_bias"))


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> XLNetConfig:
    """`XLNetConfig` -> ours. HF has one `dropout` for hidden states and attention
    probabilities; it sets both of ours. HF checkpoints store the r-biases per layer, so they
    load with untie_r=True unless overridden."""
    act = hf.get("ff_activation", "gelu")
    if act not in HF_ACTIVATIONS:
        raise UserError(f"ff_activation {act!r} is not supported; use one of "
                        f"{sorted(HF_ACTIVATIONS)}")
    if hf.get("d_head", hf["d_model"] // hf["n_head"]) * hf["n_head"] != hf["d_model"]:
        raise UserError("config.json: d_head * n_head must equal d_model; fix config.json")
    return XLNetConfig(**{
        "vocab_size": hf["vocab_size"], "hidden_size": hf["d_model"],
        "num_layers": hf["n_layer"], "num_heads": hf["n_head"],
        "intermediate_size": hf["d_inner"], "hidden_act": HF_ACTIVATIONS[act],
        "attn_type": hf.get("attn_type", "bi"), "bi_data": hf.get("bi_data", False),
        "clamp_len": hf.get("clamp_len", -1), "same_length": hf.get("same_length", False),
        "mem_len": hf.get("mem_len") or 0, "reuse_len": hf.get("reuse_len") or 0,
        "untie_r": True, "layer_norm_eps": hf.get("layer_norm_eps", 1e-12),
        "hidden_dropout": hf.get("dropout", 0.1), "attention_dropout": hf.get("dropout", 0.1),
        "initializer_range": hf.get("initializer_range", 0.02),
        **overrides,
    })


def config_to_hf(config: XLNetConfig) -> dict[str, Any]:
    return {
        "model_type": "xlnet", "architectures": ["XLNetLMHeadModel"],
        "vocab_size": config.vocab_size, "d_model": config.hidden_size,
        "n_layer": config.num_layers, "n_head": config.num_heads, "d_head": config.head_size,
        "d_inner": config.intermediate_size,
        "ff_activation": OUR_TO_HF_ACTIVATION[config.hidden_act],
        "untie_r": config.untie_r, "attn_type": config.attn_type, "bi_data": config.bi_data,
        "clamp_len": config.clamp_len, "same_length": config.same_length,
        "mem_len": config.mem_len or None, "reuse_len": config.reuse_len or None,
        "layer_norm_eps": config.layer_norm_eps, "dropout": config.hidden_dropout,
        "initializer_range": config.initializer_range, "tie_word_embeddings": True,
    }


# HF `XLNetSequenceSummary` settings that are our xlnet head (zihangdai/xlnet run_classifier.py
# summary_type "last", use_summ_proj, a tanh projection to d_model, no dropout before it).
XLNET_SUMMARY = {"summary_type": "last", "summary_use_proj": True, "summary_activation": "tanh",
                 "summary_proj_to_labels": False, "summary_first_dropout": 0.0}


def head_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The xlnet head's fields of an `XLNetForSequenceClassification` config."""
    for key, ours in XLNET_SUMMARY.items():
        if hf.get(key, ours) != ours:
            raise UserError(f"config.json has {key}={hf[key]!r}; only {ours!r} (XLNet's own "
                            "sequence summary) is supported")
    return {"classifier_dropout": hf.get("summary_last_dropout", 0.1)}


def head_to_hf(config: XLNetClassifierConfig) -> dict[str, Any]:
    return {**XLNET_SUMMARY, "summary_last_dropout": config.head_dropout}


def classifier_tensors(config: HeadConfig) -> tuple[Tensor, ...]:
    """`XLNetForSequenceClassification`: `transformer` + `sequence_summary.summary`
    (`XLNetSequenceSummary`'s projection) + `logits_proj`."""
    return (*transformer_tensors(config, "transformer."),
            *linear("sequence_summary.summary", "head_dense"),
            *linear("logits_proj", "head_output"))


register("xlnet", Converter(
    model_type="xlnet", model_class=XLNet, architectures=("XLNetLMHeadModel",),
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, tensors=tensors,
    prefix="transformer.", optional=("lm_loss.",), base_architecture="XLNetModel",
    tied={"lm_loss.weight": "transformer.word_embedding.weight"},
))
register("xlnet-classifier", classifier_hf.classifier_converter(
    "xlnet", "XLNetForSequenceClassification", XLNetClassifierConfig, classifier_tensors,
    config_from_hf, config_to_hf, head_from_hf, head_to_hf, prefix="transformer.",
    optional=("sequence_summary.", "logits_proj.")))


def tagger_tensors(config: HeadConfig) -> tuple[Tensor, ...]:
    """`XLNetForTokenClassification`: `transformer` + `classifier` (no dropout before it, so
    none is read from or written to the config)."""
    return (*transformer_tensors(config, "transformer."), *linear("classifier", "head_output"))


register("xlnet-tagger", classifier_hf.classifier_converter(
    "xlnet", "XLNetForTokenClassification", XLNetClassifierConfig, tagger_tensors,
    config_from_hf, config_to_hf, lambda hf: {"classifier_dropout": 0.0}, lambda config: {},
    model_class=TokenClassifier, prefix="transformer.", optional=("classifier.",)))
