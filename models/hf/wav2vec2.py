"""wav2vec 2.0's HF conversion (transformers models/wav2vec2/modeling_wav2vec2.py,
configuration_wav2vec2.py): `Wav2Vec2ForPreTraining` (e.g. facebook/wav2vec2-base) <->
`models.wav2vec2.Wav2Vec2`; bare `Wav2Vec2Model` checkpoints load too, their quantiser and
heads left at their initial values.

The position convolution's weight normalisation is stored as torch's parametrisation names
(`parametrizations.weight.original0` = the gain g, `original1` = the direction v), which this
transformers writes; checkpoints saved before torch's parametrisations (the released
facebook/wav2vec2-* ones) name them `weight_g` / `weight_v` and are read under either name.
"""

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
from pretext_jax.models.wav2vec2 import (
    SpeechEncoderConfig,
    Wav2Vec2,
    Wav2Vec2Config,
    Wav2Vec2CTCConfig,
    Wav2Vec2ForCTC,
)

TORCH_CONV1D = (2, 1, 0)  # torch Conv1d weight [O, I, K] -> flax [K, I, O]


def weight_norm_aliases(prefix: str) -> dict[str, str]:
    """Pre-parametrisation names of the weight-normalised position convolution under the base
    model's `prefix` -> current names (a `Converter`'s `tied` renames them on load)."""
    conv = f"{prefix}encoder.pos_conv_embed.conv"
    return {f"{conv}.weight_g": f"{conv}.parametrizations.weight.original0",
            f"{conv}.weight_v": f"{conv}.parametrizations.weight.original1"}


WEIGHT_NORM_ALIASES = weight_norm_aliases("wav2vec2.")


def _conv_layer(config: SpeechEncoderConfig, index: int, prefix: str) -> list[Tensor]:
    hf, ours = f"{prefix}feature_extractor.conv_layers.{index}", f"conv_layers.{index}"
    tensors = [Tensor(f"{hf}.conv.weight", f"{ours}.conv.kernel", TORCH_CONV1D)]
    if config.conv_bias:
        tensors.append(Tensor(f"{hf}.conv.bias", f"{ours}.conv.bias"))
    if config.conv_norm == "layer" or index == 0:
        tensors += layer_norm(f"{hf}.layer_norm", f"{ours}.norm")
    return tensors


def body_tensors(config: SpeechEncoderConfig, prefix: str = "wav2vec2.") -> tuple[Tensor, ...]:
    """`Wav2Vec2Model` (and `HubertModel`, the same modules) under `prefix`:
    `feature_extractor.conv_layers.{i}`, `feature_projection` (its `layer_norm` where
    `config.normalizes_features`), `masked_spec_embed`, `encoder` with `pos_conv_embed`,
    `layer_norm` and `layers.{i}`."""
    layer, ours = f"{prefix}encoder.layers.{{i}}", "encoder.layers"
    position_conv = f"{prefix}encoder.pos_conv_embed.conv"
    return (
        *(t for i in range(len(config.conv_channels)) for t in _conv_layer(config, i, prefix)),
        *(layer_norm(f"{prefix}feature_projection.layer_norm", "feature_layer_norm")
          if config.normalizes_features else ()),
        *linear(f"{prefix}feature_projection.projection", "feature_projection"),
        Tensor(f"{prefix}masked_spec_embed", "masked_spec_embed"),
        Tensor(f"{position_conv}.parametrizations.weight.original0",
               "encoder.position_conv.weight_g", TORCH_CONV1D),
        Tensor(f"{position_conv}.parametrizations.weight.original1",
               "encoder.position_conv.weight_v", TORCH_CONV1D),
        Tensor(f"{position_conv}.bias", "encoder.position_conv.bias"),
        *layer_norm(f"{prefix}encoder.layer_norm", "encoder.layer_norm"),
        *linear(f"{layer}.attention.q_proj", f"{ours}.query"),
        *linear(f"{layer}.attention.k_proj", f"{ours}.key"),
        *linear(f"{layer}.attention.v_proj", f"{ours}.value"),
        *linear(f"{layer}.attention.out_proj", f"{ours}.attention_output"),
        *layer_norm(f"{layer}.layer_norm", f"{ours}.attention_layer_norm"),
        *linear(f"{layer}.feed_forward.intermediate_dense", f"{ours}.intermediate"),
        *linear(f"{layer}.feed_forward.output_dense", f"{ours}.output"),
        *layer_norm(f"{layer}.final_layer_norm", f"{ours}.output_layer_norm"),
    )


def tensors(config: Wav2Vec2Config) -> tuple[Tensor, ...]:
    """`Wav2Vec2ForPreTraining`: the body (`body_tensors`), `quantizer` (`weight_proj`,
    `codevectors`), `project_hid`, `project_q`."""
    return (
        *body_tensors(config),
        *linear("quantizer.weight_proj", "quantizer.weight_proj"),
        Tensor("quantizer.codevectors", "quantizer.codevectors"),
        *linear("project_hid", "project_hid"),
        *linear("project_q", "project_q"),
    )


def ctc_tensors(config: Wav2Vec2CTCConfig, prefix: str = "wav2vec2.") -> tuple[Tensor, ...]:
    """`Wav2Vec2ForCTC` (`HubertForCTC` under `hubert.`): the body and `lm_head`, the output
    layer over the vocabulary."""
    return (*body_tensors(config, prefix), *linear("lm_head", "lm_head"))


def encoder_fields_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The `SpeechEncoderConfig` fields of a HF `Wav2Vec2Config` or `HubertConfig` dict (HF's
    defaults where a field is absent); refuses what the network here has no form of (another
    activation, the adapter)."""
    for field, ours in (("hidden_act", "hidden_act"),
                        ("feat_extract_activation", "the feature encoder's activation")):
        if HF_ACTIVATIONS.get(hf.get(field, "gelu")) != "gelu":
            raise UserError(f"{field} {hf.get(field)!r} is not supported ({ours} is the exact "
                            f"GELU here); use a {hf.get('model_type')} checkpoint with 'gelu'")
    if hf.get("add_adapter", False):
        raise UserError("config.json has add_adapter=true; the adapter is not supported, "
                        "convert a checkpoint without it")
    return {
        "conv_channels": tuple(hf.get("conv_dim", (512,) * 7)),
        "conv_kernel_sizes": tuple(hf.get("conv_kernel", (10, 3, 3, 3, 3, 2, 2))),
        "conv_strides": tuple(hf.get("conv_stride", (5, 2, 2, 2, 2, 2, 2))),
        "conv_bias": hf.get("conv_bias", False),
        "conv_norm": hf.get("feat_extract_norm", "group"),
        "hidden_size": hf.get("hidden_size", 768),
        "num_layers": hf.get("num_hidden_layers", 12),
        "num_heads": hf.get("num_attention_heads", 12),
        "intermediate_size": hf.get("intermediate_size", 3072),
        "layer_norm_eps": hf.get("layer_norm_eps", 1e-5),
        "pre_layer_norm": hf.get("do_stable_layer_norm", False),
        "position_conv_kernel": hf.get("num_conv_pos_embeddings", 128),
        "position_conv_groups": hf.get("num_conv_pos_embedding_groups", 16),
        "hidden_dropout": hf.get("hidden_dropout", 0.1),
        "attention_dropout": hf.get("attention_dropout", 0.1),
        "activation_dropout": hf.get("activation_dropout", 0.1),
        "feature_projection_dropout": hf.get("feat_proj_dropout", 0.0),
        "layerdrop": hf.get("layerdrop", 0.1),
        "initializer_range": hf.get("initializer_range", 0.02),
    }


def encoder_fields_to_hf(config: SpeechEncoderConfig) -> dict[str, Any]:
    """`encoder_fields_from_hf`'s way back: the shared network's HF config entries.
    `mask_time_prob` > 0 makes HF build `masked_spec_embed`; the masking values written are
    HF's defaults, not ours."""
    return {
        "conv_dim": list(config.conv_channels), "conv_kernel": list(config.conv_kernel_sizes),
        "conv_stride": list(config.conv_strides), "conv_bias": config.conv_bias,
        "num_feat_extract_layers": len(config.conv_channels),
        "feat_extract_norm": config.conv_norm,
        "feat_extract_activation": OUR_TO_HF_ACTIVATION[config.hidden_act],
        "hidden_act": OUR_TO_HF_ACTIVATION[config.hidden_act],
        "hidden_size": config.hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "intermediate_size": config.intermediate_size,
        "layer_norm_eps": config.layer_norm_eps, "do_stable_layer_norm": config.pre_layer_norm,
        "num_conv_pos_embeddings": config.position_conv_kernel,
        "num_conv_pos_embedding_groups": config.position_conv_groups,
        "hidden_dropout": config.hidden_dropout, "attention_dropout": config.attention_dropout,
        "activation_dropout": config.activation_dropout,
        "feat_proj_dropout": config.feature_projection_dropout,
        "layerdrop": config.layerdrop, "initializer_range": config.initializer_range,
        "mask_time_prob": 0.05, "add_adapter": False,
    }


def config_from_hf(hf: Mapping[str, Any], config_class: type[Wav2Vec2Config] = Wav2Vec2Config,
                   **overrides: Any) -> Wav2Vec2Config:
    """A HF `Wav2Vec2Config` -> ours (HF's defaults where a field is absent); the adapter, the
    CTC and classification heads' fields and the masking and loss settings are not the
    network's and are ignored."""
    return config_class(**{
        **encoder_fields_from_hf(hf),
        "num_codevector_groups": hf.get("num_codevector_groups", 2),
        "codevectors_per_group": hf.get("num_codevectors_per_group", 320),
        "codevector_dim": hf.get("codevector_dim", 256),
        "projection_dim": hf.get("proj_codevector_dim", 256),
        "quantizer_input_dropout": hf.get("feat_quantizer_dropout", 0.0),
        **overrides,
    })


def config_to_hf(config: Wav2Vec2Config) -> dict[str, Any]:
    """Ours -> a HF `Wav2Vec2Config` dict (`encoder_fields_to_hf` and the quantiser's)."""
    return {
        "model_type": "wav2vec2", "architectures": ["Wav2Vec2ForPreTraining"],
        **encoder_fields_to_hf(config),
        "num_codevector_groups": config.num_codevector_groups,
        "num_codevectors_per_group": config.codevectors_per_group,
        "codevector_dim": config.codevector_dim, "proj_codevector_dim": config.projection_dim,
        "feat_quantizer_dropout": config.quantizer_input_dropout,
    }


register("wav2vec2", Converter(
    model_type="wav2vec2", model_class=Wav2Vec2,
    architectures=("Wav2Vec2ForPreTraining", "Wav2Vec2Model"),
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, tensors=tensors,
    prefix="wav2vec2.",
    optional=("wav2vec2.masked_spec_embed", "quantizer.", "project_hid.", "project_q."),
    # Not tied weights: `tied` renames the old weight-norm names (copy -> source) on load.
    tied=WEIGHT_NORM_ALIASES,
))


def ctc_config_from_hf(hf: Mapping[str, Any],
                       config_class: type[Wav2Vec2CTCConfig] = Wav2Vec2CTCConfig,
                       **overrides: Any) -> Wav2Vec2CTCConfig:
    """A HF `Wav2Vec2ForCTC` (or `HubertForCTC`, with HuBERT's `config_class`) config -> ours:
    the network's fields, `vocab_size`, the blank (`pad_token_id`) and `final_dropout` (HF's
    defaults where absent). HF's CTC loss settings (`ctc_loss_reduction`, `ctc_zero_infinity`)
    and masking probabilities are the fine-tuning run's, not the network's, and are
    ignored."""
    return config_from_hf(hf, config_class, **{
        "vocab_size": hf.get("vocab_size", 32), "blank_id": hf.get("pad_token_id", 0),
        "final_dropout": hf.get("final_dropout", 0.1), **overrides})


def ctc_head_to_hf(config: Wav2Vec2CTCConfig) -> dict[str, Any]:
    """The CTC head's HF config entries (`Wav2Vec2ForCTC`'s and `HubertForCTC`'s; HF's mean
    CTC reduction written, ours is the fine-tuning run's setting)."""
    return {"vocab_size": config.vocab_size, "pad_token_id": config.blank_id,
            "final_dropout": config.final_dropout, "ctc_loss_reduction": "mean"}


def ctc_config_to_hf(config: Wav2Vec2CTCConfig) -> dict[str, Any]:
    """Ours -> a HF `Wav2Vec2ForCTC` config dict."""
    return {**config_to_hf(config), "architectures": ["Wav2Vec2ForCTC"],
            **ctc_head_to_hf(config)}


register("wav2vec2_ctc", Converter(
    model_type="wav2vec2", model_class=Wav2Vec2ForCTC, architectures=("Wav2Vec2ForCTC",),
    config_from_hf=ctc_config_from_hf, config_to_hf=ctc_config_to_hf, tensors=ctc_tensors,
    prefix="wav2vec2.", optional=("wav2vec2.masked_spec_embed",), tied=WEIGHT_NORM_ALIASES,
))
