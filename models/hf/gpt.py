"""GPT-2's HF conversion (transformers models/gpt2/modeling_gpt2.py, configuration_gpt2.py):
`GPT2LMHeadModel` <-> `models.gpt.GPT`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pretext_jax.errors import UserError
from pretext_jax.models.gpt import GPT, GPTConfig
from pretext_jax.models.hf.conversion import (
    HF_ACTIVATIONS,
    OUR_TO_HF_ACTIVATION,
    Converter,
    Tensor,
    layer_norm,
    register,
)


def conv1d(hf: str, ours: str) -> list[Tensor]:
    """transformers `Conv1D` (`weight` [in, out], `bias`) <-> `nnx.Linear`: no transpose."""
    return [Tensor(f"{hf}.weight", f"{ours}.kernel"), Tensor(f"{hf}.bias", f"{ours}.bias")]


def tensors(config: GPTConfig) -> tuple[Tensor, ...]:
    """`GPT2LMHeadModel`: `transformer` (`wte`, `wpe`, `h.{i}` = `GPT2Block`s of `ln_1`,
    `attn.c_attn`, `attn.c_proj`, `ln_2`, `mlp.c_fc`, `mlp.c_proj`; `ln_f`); `lm_head.weight`
    is tied to `wte`."""
    layer = "transformer.h.{i}"
    return (
        Tensor("transformer.wte.weight", "wte.embedding"),
        Tensor("transformer.wpe.weight", "wpe.embedding"),
        *layer_norm(f"{layer}.ln_1", "layers.ln_1"),
        *conv1d(f"{layer}.attn.c_attn", "layers.c_attn"),
        *conv1d(f"{layer}.attn.c_proj", "layers.attn_proj"),
        *layer_norm(f"{layer}.ln_2", "layers.ln_2"),
        *conv1d(f"{layer}.mlp.c_fc", "layers.c_fc"),
        *conv1d(f"{layer}.mlp.c_proj", "layers.mlp_proj"),
        *layer_norm("transformer.ln_f", "ln_f"),
    )


# GPT2Config switches whose non-default values change the computation in ways we do not have.
GPT2_FIXED = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
              "add_cross_attention": False}


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> GPTConfig:
    """`GPT2Config` (n_embd, n_layer, n_head, n_inner = 4 n_embd when null, n_positions,
    activation_function, *_pdrop, layer_norm_epsilon, eos_token_id: GPT2Config's 50256 when
    absent, None when outside the vocabulary) -> ours. `reorder_and_upcast_attn` only changes
    HF's eager numerics and is ignored."""
    for key, value in GPT2_FIXED.items():
        if hf.get(key, value) != value:
            raise UserError(f"config.json has {key}={hf[key]!r}; only {value!r} (GPT-2's) is "
                            "supported")
    act, eos = hf.get("activation_function", "gelu_new"), hf.get("eos_token_id", 50256)
    if act not in HF_ACTIVATIONS:
        raise UserError(f"activation_function {act!r} is not supported; use one of "
                        f"{sorted(HF_ACTIVATIONS)}")
    return GPTConfig(**{
        "vocab_size": hf["vocab_size"], "hidden_size": hf["n_embd"],
        "num_layers": hf["n_layer"], "num_heads": hf["n_head"],
        "intermediate_size": hf.get("n_inner") or 4 * hf["n_embd"],
        "max_position_embeddings": hf["n_positions"], "hidden_act": HF_ACTIVATIONS[act],
        "layer_norm_eps": hf.get("layer_norm_epsilon", 1e-5),
        "hidden_dropout": hf.get("resid_pdrop", 0.1),
        "embedding_dropout": hf.get("embd_pdrop", 0.1),
        "attention_dropout": hf.get("attn_pdrop", 0.1),
        "initializer_range": hf.get("initializer_range", 0.02),
        "eos_token_id": eos if isinstance(eos, int) and 0 <= eos < hf["vocab_size"] else None,
        **overrides,
    })


def config_to_hf(config: GPTConfig) -> dict[str, Any]:
    return {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
        "vocab_size": config.vocab_size, "n_embd": config.hidden_size,
        "n_layer": config.num_layers, "n_head": config.num_heads,
        "n_inner": config.intermediate_size, "n_positions": config.max_position_embeddings,
        "activation_function": OUR_TO_HF_ACTIVATION[config.hidden_act],
        "layer_norm_epsilon": config.layer_norm_eps, "resid_pdrop": config.hidden_dropout,
        "embd_pdrop": config.embedding_dropout, "attn_pdrop": config.attention_dropout,
        "initializer_range": config.initializer_range, "tie_word_embeddings": True,
        "bos_token_id": config.eos_token_id, "eos_token_id": config.eos_token_id,
    }


register("gpt2", Converter(
    model_type="gpt2", model_class=GPT, architectures=("GPT2LMHeadModel",),
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, tensors=tensors,
    prefix="transformer.", tied={"lm_head.weight": "transformer.wte.weight"},
    ignored=(".attn.bias", ".attn.masked_bias"),
))
