"""XLM's HF conversion (transformers models/xlm/modeling_xlm.py, configuration_xlm.py):
`XLMWithLMHeadModel` <-> `models.xlm.XLM`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.models.classifier import HeadConfig, TokenClassifier, XLMClassifierConfig
from pretext_jax.models.hf import classifier as classifier_hf
from pretext_jax.models.hf.conversion import Converter, Tensor, layer_norm, linear, register
from pretext_jax.models.xlm import XLM, XLMConfig, sinusoidal_positions

POSITIONS = "transformer.position_embeddings.weight"


def transformer_tensors(config: XLMConfig, ours: str = "") -> tuple[Tensor, ...]:
    """HF `XLMModel` (`transformer.`): `embeddings`, `position_embeddings` (a tensor of ours
    unless sinusoidal), `lang_embeddings` (n_langs > 1 and use_lang_emb), `layer_norm_emb`, per
    layer `attentions.{i}` q/k/v/out_lin, `layer_norm1.{i}`, `ffns.{i}` lin1/lin2,
    `layer_norm2.{i}`; `ours` prefixes our names (the classifier's `transformer.`)."""
    layers = f"{ours}layers"
    positions = ([] if config.sinusoidal_embeddings
                 else [Tensor(POSITIONS, f"{ours}position_embeddings.embedding")])
    langs = ([Tensor("transformer.lang_embeddings.weight", f"{ours}lang_embeddings.embedding")]
             if config.has_lang_embeddings else [])
    return (
        Tensor("transformer.embeddings.weight", f"{ours}word_embeddings.embedding"),
        *positions,
        *langs,
        *layer_norm("transformer.layer_norm_emb", f"{ours}embedding_layer_norm"),
        *linear("transformer.attentions.{i}.q_lin", f"{layers}.query"),
        *linear("transformer.attentions.{i}.k_lin", f"{layers}.key"),
        *linear("transformer.attentions.{i}.v_lin", f"{layers}.value"),
        *linear("transformer.attentions.{i}.out_lin", f"{layers}.attention_output"),
        *layer_norm("transformer.layer_norm1.{i}", f"{layers}.attention_layer_norm"),
        *linear("transformer.ffns.{i}.lin1", f"{layers}.intermediate"),
        *linear("transformer.ffns.{i}.lin2", f"{layers}.output"),
        *layer_norm("transformer.layer_norm2.{i}", f"{layers}.output_layer_norm"),
    )


def tensors(config: XLMConfig) -> tuple[Tensor, ...]:
    """`XLMWithLMHeadModel`: `transformer` and `pred_layer.proj` (weight tied to the token
    embeddings, bias)."""
    return (*transformer_tensors(config), Tensor("pred_layer.proj.bias", "output_bias"))


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> XLMConfig:
    """`XLMConfig` -> ours (HF's class defaults where a field is absent; `n_words` and
    `pad_index` are older names of `vocab_size` and `pad_token_id`)."""
    if hf.get("asm", False):
        raise UserError("XLM's adaptive softmax (asm=True) is not supported; use a checkpoint "
                        "with asm=false")
    dim = hf.get("emb_dim", 2048)
    return XLMConfig(**{
        "vocab_size": hf.get("vocab_size", hf.get("n_words", 30145)), "hidden_size": dim,
        "num_layers": hf.get("n_layers", 12), "num_heads": hf.get("n_heads", 16),
        "intermediate_size": 4 * dim,
        "hidden_act": "gelu" if hf.get("gelu_activation", True) else "relu",
        "layer_norm_eps": hf.get("layer_norm_eps", 1e-12),
        "hidden_dropout": hf.get("dropout", 0.1),
        "attention_dropout": hf.get("attention_dropout", 0.1),
        "initializer_range": hf.get("init_std", 0.02),
        "embed_init_std": hf.get("embed_init_std", 2048 ** -0.5),
        "max_position_embeddings": hf.get("max_position_embeddings", 512),
        "n_langs": hf.get("n_langs", 1), "use_lang_emb": hf.get("use_lang_emb", True),
        "sinusoidal_embeddings": hf.get("sinusoidal_embeddings", False),
        "causal": hf.get("causal", False),
        "pad_token_id": hf.get("pad_token_id", hf.get("pad_index", 2)),
        **overrides})


def config_to_hf(config: XLMConfig) -> dict[str, Any]:
    if config.is_decoder:
        raise UserError("HF's XLM has no decoder with cross-attention; export the pretrained "
                        "XLM, not a translation model's decoder")
    return {
        "model_type": "xlm", "architectures": ["XLMWithLMHeadModel"],
        "vocab_size": config.vocab_size, "emb_dim": config.hidden_size,
        "n_layers": config.num_layers, "n_heads": config.num_heads,
        "gelu_activation": config.hidden_act == "gelu", "layer_norm_eps": config.layer_norm_eps,
        "dropout": config.hidden_dropout, "attention_dropout": config.attention_dropout,
        "init_std": config.initializer_range, "embed_init_std": config.embed_init_std,
        "max_position_embeddings": config.max_position_embeddings, "n_langs": config.n_langs,
        "use_lang_emb": config.use_lang_emb,
        "sinusoidal_embeddings": config.sinusoidal_embeddings, "causal": config.causal,
        "asm": False, "is_encoder": True, "pad_token_id": config.pad_token_id,
        "tie_word_embeddings": True,
    }


def buffers(config: XLMConfig) -> dict[str, np.ndarray]:
    """Fixed sinusoidal positions are no parameter of ours, but HF stores the table."""
    if not config.sinusoidal_embeddings:
        return {}
    return {POSITIONS: sinusoidal_positions(config.max_position_embeddings, config.hidden_size)}


class XLMConverter(Converter):
    """Reads a sinusoidal model's stored position table only to check that it holds the
    fixed sinusoids (HF trains it; the reference freezes it)."""

    def params_from_hf(self, model: nnx.Module, state: Mapping[str, np.ndarray],
                       source: str = "the checkpoint") -> list[Tensor]:
        state = self._normalize(state, source)
        stored = state.pop(POSITIONS, None) if model.config.sinusoidal_embeddings else None
        fixed = buffers(model.config).get(POSITIONS)
        if stored is not None and (stored.shape != fixed.shape
                                   or not np.allclose(stored, fixed, atol=1e-6)):
            raise UserError(f"{source}: {POSITIONS} is not the fixed sinusoidal table (trained "
                            "since); load it with sinusoidal_embeddings=False")
        return super().params_from_hf(model, state, source)


register("xlm", XLMConverter(
    model_type="xlm", model_class=XLM, architectures=("XLMWithLMHeadModel",),
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, tensors=tensors,
    prefix="transformer.", optional=("pred_layer.",),
    tied={"pred_layer.proj.weight": "transformer.embeddings.weight"},
    ignored=("position_ids",), buffers=buffers,
))


# HF `XLMSequenceSummary` settings that are our xlm head (XLM's GLUE/XNLI `proj`: dropout, then a
# linear layer to the labels, on the first position).
XLM_SUMMARY = {"summary_type": "first", "summary_use_proj": True, "summary_activation": None,
               "summary_proj_to_labels": True}


def head_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The xlm head's fields of an `XLMForSequenceClassification` config."""
    for key, ours in XLM_SUMMARY.items():
        if hf.get(key, ours) != ours:
            raise UserError(f"config.json has {key}={hf[key]!r}; only {ours!r} (XLM's own "
                            "sequence summary) is supported")
    if hf.get("summary_last_dropout", 0.0):
        raise UserError("config.json has summary_last_dropout; XLM's head has no dropout after "
                        "its projection: remove it")
    return {"classifier_dropout": hf.get("summary_first_dropout", 0.1)}


def head_to_hf(config: XLMClassifierConfig) -> dict[str, Any]:
    return {**XLM_SUMMARY, "summary_first_dropout": config.head_dropout}


def classifier_tensors(config: XLMClassifierConfig) -> tuple[Tensor, ...]:
    """`XLMForSequenceClassification`: `transformer` + `sequence_summary.summary` (the
    projection to the labels)."""
    return (*transformer_tensors(config, "transformer."),
            *linear("sequence_summary.summary", "head_output"))


def classifier_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> XLMConfig:
    """The encoder's fields; a classifier is bidirectional (XLM's GLUE/XNLI `causal=False`)."""
    return config_from_hf(hf, **{"causal": False, **overrides})


register("xlm-classifier", classifier_hf.classifier_converter(
    "xlm", "XLMForSequenceClassification", XLMClassifierConfig, classifier_tensors,
    classifier_config_from_hf, config_to_hf, head_from_hf, head_to_hf,
    converter_class=XLMConverter, prefix="transformer.", optional=("sequence_summary.",),
    ignored=("position_ids",), buffers=buffers))


def tagger_tensors(config: HeadConfig) -> tuple[Tensor, ...]:
    """`XLMForTokenClassification`: `transformer` + `classifier` (after dropout at the
    model's `dropout`, our hidden dropout: `classifier_dropout=-1`)."""
    return (*transformer_tensors(config, "transformer."), *linear("classifier", "head_output"))


register("xlm-tagger", classifier_hf.classifier_converter(
    "xlm", "XLMForTokenClassification", XLMClassifierConfig, tagger_tensors,
    classifier_config_from_hf, config_to_hf, lambda hf: {"classifier_dropout": -1.0},
    lambda config: {}, converter_class=XLMConverter, model_class=TokenClassifier,
    prefix="transformer.", optional=("classifier.",), ignored=("position_ids",),
    buffers=buffers))
