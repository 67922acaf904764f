"""HuBERT's HF conversion (transformers models/hubert/modeling_hubert.py,
configuration_hubert.py): `HubertModel` (e.g. facebook/hubert-base-ls960) <-> the body of
`models.hubert.Hubert`, through wav2vec 2.0's table of the same modules
(`models.hf.wav2vec2.body_tensors` under the `hubert.` prefix, HF `base_model_prefix`).

HF has no pre-training head for HuBERT, so ours (`final_proj`, `label_embeddings`; fairseq's
names in the table) is `unheld`: an export writes the bare `HubertModel`, and an import leaves
the head at its initial values (with the warning that names it). `HubertForCTC` (e.g.
facebook/hubert-large-ls960-ft) <-> `models.hubert.HubertForCTC`: the same body and `lm_head`,
wav2vec 2.0's CTC table (`models.hf.wav2vec2.ctc_tensors`) under `hubert.`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pretext_jax.errors import UserError
from pretext_jax.models.hf.conversion import Converter, Tensor, linear, register
from pretext_jax.models.hf.wav2vec2 import (
    body_tensors,
    ctc_config_from_hf,
    ctc_head_to_hf,
    ctc_tensors,
    encoder_fields_from_hf,
    encoder_fields_to_hf,
    weight_norm_aliases,
)
from pretext_jax.models.hubert import Hubert, HubertConfig, HubertCTCConfig, HubertForCTC

PREFIX = "hubert."
HEAD = ("final_proj.", "label_embs_concat")


def tensors(config: HubertConfig) -> tuple[Tensor, ...]:
    """`HubertModel` under `hubert.`, then the pre-training head under fairseq's names
    (`final_proj`, `label_embs_concat`), which no HF checkpoint holds."""
    return (*body_tensors(config, PREFIX), *linear("final_proj", "final_proj"),
            Tensor("label_embs_concat", "label_embeddings"))


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> HubertConfig:
    """A HF `HubertConfig` -> ours (HF's defaults where a field is absent); the CTC and
    classification heads' fields and the masking settings are ignored; the head's sizes are
    ours (HF has no head), from `overrides` or the defaults."""
    return HubertConfig(**{**encoder_fields_from_hf(hf), **_hubert_fields_from_hf(hf),
                           **overrides})


def _hubert_fields_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """What HuBERT's network adds to the shared encoder's fields; refuses the batch-normalised
    position convolution, which the network here has no form of."""
    if hf.get("conv_pos_batch_norm", False):
        raise UserError("config.json has conv_pos_batch_norm=true (a batch-normalised position "
                        "convolution); only the weight-normalised one is supported, convert a "
                        "checkpoint without it")
    return {"feature_projection_layer_norm": hf.get("feat_proj_layer_norm", True)}


def config_to_hf(config: HubertConfig) -> dict[str, Any]:
    """Ours -> a HF `HubertConfig` dict (the head's sizes have no HF field)."""
    return {"model_type": "hubert", "architectures": ["HubertModel"],
            **encoder_fields_to_hf(config),
            "feat_proj_layer_norm": config.feature_projection_layer_norm,
            "conv_pos_batch_norm": False}


register("hubert", Converter(
    model_type="hubert", model_class=Hubert, architectures=("HubertModel",),
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, tensors=tensors, prefix=PREFIX,
    optional=(f"{PREFIX}masked_spec_embed", *HEAD), base_architecture="HubertModel",
    # Not tied weights: `tied` renames the old weight-norm names (copy -> source) on load.
    tied=weight_norm_aliases(PREFIX),
    unheld=("final_proj.kernel", "final_proj.bias", "label_embeddings"),
))


def ctc_config_from_hf_hubert(hf: Mapping[str, Any], **overrides: Any) -> HubertCTCConfig:
    """A HF `HubertForCTC` config -> ours (`models.hf.wav2vec2.ctc_config_from_hf` with
    HuBERT's `feat_proj_layer_norm`)."""
    return ctc_config_from_hf(hf, HubertCTCConfig, **{**_hubert_fields_from_hf(hf), **overrides})


def ctc_config_to_hf_hubert(config: HubertCTCConfig) -> dict[str, Any]:
    """Ours -> a HF `HubertForCTC` config dict."""
    return {**config_to_hf(config), "architectures": ["HubertForCTC"], **ctc_head_to_hf(config)}


register("hubert_ctc", Converter(
    model_type="hubert", model_class=HubertForCTC, architectures=("HubertForCTC",),
    config_from_hf=ctc_config_from_hf_hubert, config_to_hf=ctc_config_to_hf_hubert,
    tensors=lambda config: ctc_tensors(config, PREFIX), prefix=PREFIX,
    optional=(f"{PREFIX}masked_spec_embed",), tied=weight_norm_aliases(PREFIX),
))
