"""ProphetNet's HF conversion (transformers models/prophetnet/modeling_prophetnet.py,
configuration_prophetnet.py): `ProphetNetForConditionalGeneration` <-> `models.prophetnet.
ProphetNet`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pretext_jax.errors import UserError
from pretext_jax.models.hf.conversion import (
    HF_ACTIVATIONS,
    OUR_TO_HF_ACTIVATION,
    Converter,
    Tensor,
    layer_norm,
    linear,
    register,
)
from pretext_jax.models.prophetnet import PAD_ID, ProphetNet, ProphetNetConfig

PREFIX = "prophetnet."


def _layer_tensors(stack: str, decoder: bool) -> list[Tensor]:
    """`{stack}.layers.{i}`: self_attn (q/k/v/out projections, in the decoder also
    relative_pos_embeddings) + self_attn_layer_norm, in the decoder cross_attn +
    cross_attn_layer_norm, feed_forward (intermediate, output) + feed_forward_layer_norm."""
    hf, ours = f"{PREFIX}{stack}.layers.{{i}}", f"{stack}.layers"
    attentions = ["self_attn", "cross_attn"] if decoder else ["self_attn"]
    projections = ["query_proj", "key_proj", "value_proj", "out_proj"]
    return [
        *(t for a in attentions for p in projections
          for t in linear(f"{hf}.{a}.{p}", f"{ours}.{a}.{p}")),
        *(linear(f"{hf}.self_attn.relative_pos_embeddings",
                 f"{ours}.self_attn.relative_pos_embeddings") if decoder else []),
        *(t for a in attentions
          for t in layer_norm(f"{hf}.{a}_layer_norm", f"{ours}.{a}_layer_norm")),
        *linear(f"{hf}.feed_forward.intermediate", f"{ours}.feed_forward.intermediate"),
        *linear(f"{hf}.feed_forward.output", f"{ours}.feed_forward.output"),
        *layer_norm(f"{hf}.feed_forward_layer_norm", f"{ours}.feed_forward_layer_norm"),
    ]


def tensors(config: ProphetNetConfig) -> tuple[Tensor, ...]:
    """`ProphetNetForConditionalGeneration`: `prophetnet.word_embeddings` (also the encoder's
    and decoder's `word_embeddings` and `lm_head`, tied), per stack `position_embeddings` and
    `embeddings_layer_norm`, the decoder's `ngram_embeddings`, and the layers."""
    del config
    stacks = []
    for stack in ("encoder", "decoder"):
        stacks += [Tensor(f"{PREFIX}{stack}.position_embeddings.weight",
                          f"{stack}.position_embeddings.embedding"),
                   *layer_norm(f"{PREFIX}{stack}.embeddings_layer_norm",
                               f"{stack}.embeddings_layer_norm"),
                   *_layer_tensors(stack, decoder=stack == "decoder")]
    return (Tensor(f"{PREFIX}word_embeddings.weight", "word_embeddings.embedding"),
            Tensor(f"{PREFIX}decoder.ngram_embeddings.weight",
                   "decoder.ngram_embeddings.embedding"),
            *stacks)


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ProphetNetConfig:
    """`ProphetNetConfig` -> ours (HF's class defaults where a field is absent). HF's loss
    settings (`eps`, `disable_ngram_loss`) are the objective's here and are not read."""
    if hf.get("pad_token_id", PAD_ID) != PAD_ID:
        raise UserError(f"config.json has pad_token_id={hf['pad_token_id']}; ProphetNet here "
                        f"counts positions from pad id {PAD_ID}, as the released checkpoints")
    if hf.get("tie_word_embeddings", True) is False or hf.get("add_cross_attention",
                                                               True) is False:
        raise UserError("only ProphetNet with tied word embeddings and cross-attention (HF's "
                        "defaults) converts; use such a checkpoint")
    act = hf.get("activation_function", "gelu")
    if act not in HF_ACTIVATIONS:
        raise UserError(f"activation_function {act!r} is not supported; use one of "
                        f"{sorted(HF_ACTIVATIONS)}")
    eos = hf.get("eos_token_id", 2)
    return ProphetNetConfig(**{
        "vocab_size": hf.get("vocab_size", 30522), "hidden_size": hf.get("hidden_size", 1024),
        "num_encoder_layers": hf.get("num_encoder_layers", 12),
        "num_decoder_layers": hf.get("num_decoder_layers", 12),
        "num_encoder_attention_heads": hf.get("num_encoder_attention_heads", 16),
        "num_decoder_attention_heads": hf.get("num_decoder_attention_heads", 16),
        "encoder_ffn_dim": hf.get("encoder_ffn_dim", 4096),
        "decoder_ffn_dim": hf.get("decoder_ffn_dim", 4096),
        "hidden_act": HF_ACTIVATIONS[act],
        "max_position_embeddings": hf.get("max_position_embeddings", 512),
        "ngram": hf.get("ngram", 2), "num_buckets": hf.get("num_buckets", 32),
        "relative_max_distance": hf.get("relative_max_distance", 128),
        "hidden_dropout": hf.get("dropout", 0.1),
        "attention_dropout": hf.get("attention_dropout", 0.1),
        "activation_dropout": hf.get("activation_dropout", 0.1),
        "init_std": hf.get("init_std", 0.02),
        "decoder_start_token_id": hf.get("decoder_start_token_id", 0),
        "eos_token_id": eos[0] if isinstance(eos, list) else eos,
        **overrides,
    })


def config_to_hf(config: ProphetNetConfig) -> dict[str, Any]:
    return {
        "model_type": "prophetnet", "architectures": ["ProphetNetForConditionalGeneration"],
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_encoder_layers": config.num_encoder_layers,
        "num_decoder_layers": config.num_decoder_layers,
        "num_encoder_attention_heads": config.num_encoder_attention_heads,
        "num_decoder_attention_heads": config.num_decoder_attention_heads,
        "encoder_ffn_dim": config.encoder_ffn_dim, "decoder_ffn_dim": config.decoder_ffn_dim,
        "activation_function": OUR_TO_HF_ACTIVATION[config.hidden_act],
        "max_position_embeddings": config.max_position_embeddings, "ngram": config.ngram,
        "num_buckets": config.num_buckets, "relative_max_distance": config.relative_max_distance,
        "dropout": config.hidden_dropout, "attention_dropout": config.attention_dropout,
        "activation_dropout": config.activation_dropout, "init_std": config.init_std,
        "is_encoder_decoder": True, "add_cross_attention": True, "tie_word_embeddings": True,
        "pad_token_id": PAD_ID, "decoder_start_token_id": config.decoder_start_token_id,
        "eos_token_id": config.eos_token_id,
    }


register("prophetnet", Converter(
    model_type="prophetnet", model_class=ProphetNet,
    architectures=("ProphetNetForConditionalGeneration",),
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, tensors=tensors, prefix=PREFIX,
    tied={f"{PREFIX}encoder.word_embeddings.weight": f"{PREFIX}word_embeddings.weight",
          f"{PREFIX}decoder.word_embeddings.weight": f"{PREFIX}word_embeddings.weight",
          "lm_head.weight": f"{PREFIX}word_embeddings.weight"},
))
