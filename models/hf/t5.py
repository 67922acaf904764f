"""T5's HF conversion (transformers models/t5/modeling_t5.py, configuration_t5.py):
`T5ForConditionalGeneration` <-> `models.t5.T5`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pretext_jax.errors import UserError
from pretext_jax.models.hf.conversion import Converter, Tensor, register
from pretext_jax.models.t5 import FEED_FORWARD, PAD_ID, T5, T5Config


def _stack_tensors(stack: str, config: T5Config) -> list[Tensor]:
    """`{stack}.block.{i}.layer.{j}`: 0 = SelfAttention (q, k, v, o) + layer_norm, in the decoder
    1 = EncDecAttention + layer_norm, last = DenseReluDense (`wi` or `wi_0`/`wi_1`, `wo`) +
    layer_norm; the relative bias table of block 0; `final_layer_norm`."""
    block, ours = f"{stack}.block.{{i}}.layer", f"{stack}.layers"
    ff = 2 if stack == "decoder" else 1
    attentions = [("0.SelfAttention", "self_attention")]
    norms = [("0", "self_attention_norm"), (str(ff), "ffn_norm")]
    if stack == "decoder":
        attentions.append(("1.EncDecAttention", "cross_attention"))
        norms.append(("1", "cross_attention_norm"))
    return [
        Tensor(f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
               f"{stack}.relative_attention_bias.embedding"),
        *(Tensor(f"{block}.{hf}.{name}.weight", f"{ours}.{attn}.{name}.kernel", transpose=True)
          for hf, attn in attentions for name in ("q", "k", "v", "o")),
        *(Tensor(f"{block}.{j}.layer_norm.weight", f"{ours}.{norm}.scale") for j, norm in norms),
        *(Tensor(f"{block}.{ff}.DenseReluDense.{name}.weight", f"{ours}.{name}.kernel",
                 transpose=True)
          for name in (("wi_0", "wi_1") if config.gated else ("wi",)) + ("wo",)),
        Tensor(f"{stack}.final_layer_norm.weight", f"{stack}.final_layer_norm.scale"),
    ]


def tensors(config: T5Config) -> tuple[Tensor, ...]:
    """`T5ForConditionalGeneration`: `shared`, `encoder`, `decoder` and, untied (v1.1),
    `lm_head`. HF's `encoder.embed_tokens`/`decoder.embed_tokens` are tied copies of `shared`."""
    head = [] if config.tie_word_embeddings else [
        Tensor("lm_head.weight", "lm_head.kernel", transpose=True)]
    return (Tensor("shared.weight", "shared.embedding"), *_stack_tensors("encoder", config),
            *_stack_tensors("decoder", config), *head)


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> T5Config:
    """`T5Config` -> ours. HF has one `dropout_rate`; it sets both of ours. The LM head is untied
    (v1.1) when `tie_word_embeddings` is false, or, as transformers 5 writes it,
    `scale_decoder_outputs` is false."""
    proj = hf.get("feed_forward_proj", "relu")
    if proj not in FEED_FORWARD:
        raise UserError(f"feed_forward_proj {proj!r} is not supported; use one of "
                        f"{sorted(FEED_FORWARD)}")
    for key in ("pad_token_id", "decoder_start_token_id"):
        if hf.get(key, PAD_ID) not in (PAD_ID, None):
            raise UserError(f"config.json has {key}={hf[key]}; T5 here uses {PAD_ID} for "
                            "padding and as the decoder start token")
    eos = hf.get("eos_token_id", 1)
    decoder_layers = hf.get("num_decoder_layers") or hf["num_layers"]
    return T5Config(**{
        "vocab_size": hf["vocab_size"], "hidden_size": hf["d_model"],
        "num_layers": hf["num_layers"],
        "num_decoder_layers": 0 if decoder_layers == hf["num_layers"] else decoder_layers,
        "num_heads": hf["num_heads"], "head_size": hf["d_kv"], "intermediate_size": hf["d_ff"],
        "feed_forward_proj": proj,
        "relative_attention_num_buckets": hf.get("relative_attention_num_buckets", 32),
        "relative_attention_max_distance": hf.get("relative_attention_max_distance", 128),
        "layer_norm_eps": hf.get("layer_norm_epsilon", 1e-6),
        "hidden_dropout": hf.get("dropout_rate", 0.1),
        "attention_dropout": hf.get("dropout_rate", 0.1),
        "initializer_factor": hf.get("initializer_factor", 1.0),
        "tie_word_embeddings": (hf.get("tie_word_embeddings", True) is not False
                                and hf.get("scale_decoder_outputs", True) is not False),
        "eos_token_id": eos[0] if isinstance(eos, list) else eos,
        **overrides,
    })


def config_to_hf(config: T5Config) -> dict[str, Any]:
    if config.num_languages:
        raise UserError(f"this T5 has language embeddings (num_languages={config.num_languages},"
                        " MASS bilingual), which HF T5 has not; it cannot be exported to HF")
    return {
        "model_type": "t5", "architectures": ["T5ForConditionalGeneration"],
        "vocab_size": config.vocab_size, "d_model": config.hidden_size,
        "d_kv": config.head_size, "d_ff": config.intermediate_size,
        "num_layers": config.num_layers, "num_decoder_layers": config.decoder_layers,
        "num_heads": config.num_heads,
        "relative_attention_num_buckets": config.relative_attention_num_buckets,
        "relative_attention_max_distance": config.relative_attention_max_distance,
        "dropout_rate": config.hidden_dropout, "layer_norm_epsilon": config.layer_norm_eps,
        "initializer_factor": config.initializer_factor,
        "feed_forward_proj": config.feed_forward_proj,
        "tie_word_embeddings": config.tie_word_embeddings, "is_encoder_decoder": True,
        "pad_token_id": PAD_ID, "decoder_start_token_id": PAD_ID,
        "eos_token_id": config.eos_token_id,
    }


register("t5", Converter(
    model_type="t5", model_class=T5, architectures=("T5ForConditionalGeneration",),
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, tensors=tensors, prefix="",
    tied={"encoder.embed_tokens.weight": "shared.weight",
          "decoder.embed_tokens.weight": "shared.weight"},
    # HF's state dict of a tied model holds `lm_head.weight` (= `shared.weight`) too.
    ignored=("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",
             "lm_head.weight"),
))
