"""DistilBERT's HF conversion (transformers models/distilbert/modeling_distilbert.py,
configuration_distilbert.py): `DistilBertForMaskedLM` <-> `models.distilbert.DistilBert`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pretext_jax.errors import UserError
from pretext_jax.models.distilbert import DistilBert, DistilBertConfig
from pretext_jax.models.hf.conversion import (
    HF_ACTIVATIONS,
    OUR_TO_HF_ACTIVATION,
    Converter,
    Tensor,
    layer_norm,
    linear,
    masked_lm_head,
    register,
)


def tensors(config: DistilBertConfig) -> tuple[Tensor, ...]:
    """`DistilBertForMaskedLM`: `distilbert` (`Embeddings`: word and position tables and
    `LayerNorm`; `transformer.layer.{i}`: `attention.{q,k,v,out}_lin`, `sa_layer_norm`,
    `ffn.lin1`, `ffn.lin2`, `output_layer_norm`) and the head `vocab_transform`,
    `vocab_layer_norm`, `vocab_projector` (its weight tied to the word embeddings)."""
    del config  # one layout for every size
    layer, ours = "distilbert.transformer.layer.{i}", "encoder.stack.layers"
    return (
        Tensor("distilbert.embeddings.word_embeddings.weight",
               "encoder.embeddings.word_embeddings.embedding"),
        Tensor("distilbert.embeddings.position_embeddings.weight",
               "encoder.embeddings.position_embeddings.embedding"),
        *layer_norm("distilbert.embeddings.LayerNorm", "encoder.embeddings.layer_norm"),
        *linear(f"{layer}.attention.q_lin", f"{ours}.query"),
        *linear(f"{layer}.attention.k_lin", f"{ours}.key"),
        *linear(f"{layer}.attention.v_lin", f"{ours}.value"),
        *linear(f"{layer}.attention.out_lin", f"{ours}.attention_output"),
        *layer_norm(f"{layer}.sa_layer_norm", f"{ours}.attention_layer_norm"),
        *linear(f"{layer}.ffn.lin1", f"{ours}.intermediate"),
        *linear(f"{layer}.ffn.lin2", f"{ours}.output"),
        *layer_norm(f"{layer}.output_layer_norm", f"{ours}.output_layer_norm"),
        *masked_lm_head("vocab_transform", "vocab_layer_norm", "vocab_projector.bias"),
    )


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> DistilBertConfig:
    """`DistilBertConfig` -> ours; sinusoidal position tables are refused (ours are learned)."""
    if hf.get("sinusoidal_pos_embds", False):
        raise UserError("sinusoidal_pos_embds=true is not supported; only learned position "
                        "embeddings (DistilBERT's released models) are")
    act = hf.get("activation", "gelu")
    if act not in HF_ACTIVATIONS:
        raise UserError(f"activation {act!r} is not supported; use one of "
                        f"{sorted(HF_ACTIVATIONS)}")
    return DistilBertConfig(**{
        "vocab_size": hf["vocab_size"], "hidden_size": hf["dim"], "num_layers": hf["n_layers"],
        "num_heads": hf["n_heads"], "intermediate_size": hf["hidden_dim"],
        "max_position_embeddings": hf["max_position_embeddings"],
        "hidden_act": HF_ACTIVATIONS[act], "hidden_dropout": hf.get("dropout", 0.1),
        "attention_dropout": hf.get("attention_dropout", 0.1),
        "initializer_range": hf.get("initializer_range", 0.02), **overrides,
    })


def config_to_hf(config: DistilBertConfig) -> dict[str, Any]:
    return {"model_type": "distilbert", "architectures": ["DistilBertForMaskedLM"],
            "vocab_size": config.vocab_size, "dim": config.hidden_size,
            "n_layers": config.num_layers, "n_heads": config.num_heads,
            "hidden_dim": config.intermediate_size,
            "max_position_embeddings": config.max_position_embeddings,
            "sinusoidal_pos_embds": False, "activation": OUR_TO_HF_ACTIVATION[config.hidden_act],
            "dropout": config.hidden_dropout, "attention_dropout": config.attention_dropout,
            "initializer_range": config.initializer_range, "pad_token_id": 0,
            "tie_word_embeddings": True}


register("distilbert", Converter(
    model_type="distilbert", model_class=DistilBert, architectures=("DistilBertForMaskedLM",),
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, tensors=tensors,
    prefix="distilbert.", optional=("vocab_transform.", "vocab_layer_norm.", "vocab_projector."),
    base_architecture="DistilBertModel",
    tied={"vocab_projector.weight": "distilbert.embeddings.word_embeddings.weight"},
    ignored=("embeddings.position_ids",),
))
