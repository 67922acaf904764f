"""HF names of the shared encoder (transformers modeling_bert.py `BertModel`, modeling_electra.py
`ElectraModel`: embeddings and `encoder.layer.{i}`) <-> our `models.encoder.Encoder`, and the
`BertConfig` fields it shares with the families built on it (`bert_hf`, `electra_hf`,
`roberta_hf`, `albert_hf`, `mpnet_hf`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pretext_jax.errors import UserError
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.models.hf.conversion import (
    HF_ACTIVATIONS,
    OUR_TO_HF_ACTIVATION,
    Tensor,
    layer_norm,
    linear,
)

# HF buffers of the BERT-style embeddings that hold no parameter.
BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")


def tensors(prefix: str, config: EncoderConfig) -> tuple[Tensor, ...]:
    """`{prefix}embeddings` (+ `{prefix}embeddings_project` when embedding_size != hidden_size,
    as HF `ElectraModel`) and `{prefix}encoder.layer.{i}` <-> our `Encoder` at `encoder`."""
    layer, ours = f"{prefix}encoder.layer.{{i}}", "encoder.stack.layers"
    project = (linear(f"{prefix}embeddings_project", "encoder.embeddings_project")
               if config.embedding_width != config.hidden_size else [])
    return (
        Tensor(f"{prefix}embeddings.word_embeddings.weight",
               "encoder.embeddings.word_embeddings.embedding"),
        Tensor(f"{prefix}embeddings.position_embeddings.weight",
               "encoder.embeddings.position_embeddings.embedding"),
        Tensor(f"{prefix}embeddings.token_type_embeddings.weight",
               "encoder.embeddings.token_type_embeddings.embedding"),
        *layer_norm(f"{prefix}embeddings.LayerNorm", "encoder.embeddings.layer_norm"),
        *project,
        *linear(f"{layer}.attention.self.query", f"{ours}.query"),
        *linear(f"{layer}.attention.self.key", f"{ours}.key"),
        *linear(f"{layer}.attention.self.value", f"{ours}.value"),
        *linear(f"{layer}.attention.output.dense", f"{ours}.attention_output"),
        *layer_norm(f"{layer}.attention.output.LayerNorm", f"{ours}.attention_layer_norm"),
        *linear(f"{layer}.intermediate.dense", f"{ours}.intermediate"),
        *linear(f"{layer}.output.dense", f"{ours}.output"),
        *layer_norm(f"{layer}.output.LayerNorm", f"{ours}.output_layer_norm"),
    )


def config_from_hf(hf: Mapping[str, Any], **fields: Any) -> EncoderConfig:
    """`BertConfig`/`ElectraConfig` fields -> `EncoderConfig`; `fields` add family fields and
    the caller's overrides of our own (dtype, ...)."""
    act = hf.get("hidden_act", "gelu")
    if act not in HF_ACTIVATIONS:
        raise UserError(f"hidden_act {act!r} is not supported; use one of "
                        f"{sorted(HF_ACTIVATIONS)}")
    position = hf.get("position_embedding_type", "absolute")
    if position != "absolute":
        raise UserError(f"position_embedding_type {position!r} is not supported; only "
                        "'absolute' (BERT's learned position embeddings) is")
    return EncoderConfig(**{
        "vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"], "num_heads": hf["num_attention_heads"],
        "intermediate_size": hf["intermediate_size"],
        "max_position_embeddings": hf["max_position_embeddings"],
        "type_vocab_size": hf.get("type_vocab_size", 2), "hidden_act": HF_ACTIVATIONS[act],
        "layer_norm_eps": hf.get("layer_norm_eps", 1e-12),
        "hidden_dropout": hf.get("hidden_dropout_prob", 0.1),
        "attention_dropout": hf.get("attention_probs_dropout_prob", 0.1),
        "initializer_range": hf.get("initializer_range", 0.02),
        **fields,
    })


def config_to_hf(config: EncoderConfig) -> dict[str, Any]:
    return {
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_position_embeddings,
        "type_vocab_size": config.type_vocab_size,
        "hidden_act": OUR_TO_HF_ACTIVATION[config.hidden_act],
        "layer_norm_eps": config.layer_norm_eps, "hidden_dropout_prob": config.hidden_dropout,
        "attention_probs_dropout_prob": config.attention_dropout,
        "initializer_range": config.initializer_range, "pad_token_id": 0,
    }

