"""HuggingFace interop: `load(path)` reads a transformers checkpoint folder into our model, and
`save(model, path)` writes one that transformers loads.

Public API:

- `load(path, **config_overrides)`: a HF folder (`config.json` + `model.safetensors`, a sharded
  `model.safetensors.index.json`, or `pytorch_model.bin`) -> our Flax NNX model; a folder of
  `discriminator/` + `generator/` -> the joint ELECTRA model.
- `save(model, path, tokenizer)`: our model -> `config.json` + `model.safetensors` (float32)
  and the tokenizer's HF files (`pretrain.hf_tokenizer`); a joint model -> one such folder per
  part.
- `from_hf(hf_config, state_dict, **config_overrides)` / `to_hf(model)`: the same conversions
  in memory, on a HF config dict and a flat HF state dict of numpy arrays.
- `method_name(model)`: the `objectives.registry` method a converted model belongs to.
- `CONVERTERS`: name -> `Converter` (BERT, ELECTRA discriminator and generator, XLNet,
  RoBERTa, ALBERT, GPT-2, T5, ResNet, and the BERT, ELECTRA and XLNet sequence classifiers),
  chosen on load by `config.json`'s `model_type` and `architectures`. This is the one place in
  `pretrain/` that knows model families by name.

A `Converter` is a config mapping (HF config dict <-> our config) plus a table of `Tensor`s
(one HF tensor name <-> one of our parameter paths). Import and export both walk that table, so
the two directions cannot drift apart. Torch Linear weights are [out, in] (ours [in, out]); our
encoder layers are stacked on a leading axis, HF's are numbered (`encoder.layer.{i}`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.tokenizers import Tokenizer
from pretext_jax.models.albert import Albert, AlbertConfig
from pretext_jax.models.bert import Bert
from pretext_jax.models.classifier import (
    ClassifierConfig,
    HeadConfig,
    SequenceClassifier,
    XLNetClassifierConfig,
)
from pretext_jax.models.electra import ElectraDiscriminator, ElectraGenerator
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.models.gpt import GPT, GPTConfig
from pretext_jax.models.mpnet import MPNet, MPNetConfig
from pretext_jax.models.resnet import DEPTHS, ResNet, ResNetConfig
from pretext_jax.models.roberta import Roberta, RobertaConfig
from pretext_jax.models.t5 import FEED_FORWARD, PAD_ID, T5, T5Config
from pretext_jax.models.xlnet import XLNet, XLNetConfig
from pretext_jax.objectives import registry
from pretext_jax.pretrain import hf_tokenizer
from pretext_jax.pretrain.export import make_readable

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"

# HF `hidden_act` (transformers activations.py ACT2FN) -> ours (models.encoder.ACTIVATIONS).
# `gelu` is the exact erf GELU; `gelu_new`, `gelu_pytorch_tanh` and `gelu_fast` are the tanh
# approximation (the original TF BERT's).
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_fast": "gelu_tanh", "relu": "relu"}
OUR_TO_HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One HF tensor name <-> one of our parameters.

    `hf` is the HF state-dict name; `{i}` in it marks a per-layer tensor, which maps to the slice
    `i` of our stacked parameter (leading `layers` axis). `ours` is our parameter's path in
    `nnx.state(model, nnx.Param)` (or of a BatchNorm statistic), joined by dots. `transpose` is
    set for torch `nn.Linear` weights ([out, in]; our kernels are [in, out]); a tuple gives the
    axis order that turns the HF tensor into ours (torch conv [O, I, H, W] -> ours [H, W, I, O]
    is (2, 3, 1, 0)). `shared_layers` > 0 marks one parameter of
    ours that HF stores once per layer (XLNet's biases with untie_r=false): it is written to
    every layer and read back only if all copies agree.
    """

    hf: str
    ours: str
    transpose: bool | tuple[int, ...] = False
    shared_layers: int = 0

    def to_ours(self, value: np.ndarray) -> np.ndarray:
        if isinstance(self.transpose, tuple):
            return np.transpose(value, self.transpose)
        return value.T if self.transpose else value

    def to_hf(self, value: np.ndarray) -> np.ndarray:
        if isinstance(self.transpose, tuple):
            return np.transpose(value, np.argsort(self.transpose))
        return value.T if self.transpose else value

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The HF shape of one of our shapes."""
        if isinstance(self.transpose, tuple):
            return tuple(shape[i] for i in np.argsort(self.transpose))
        return shape[::-1] if self.transpose else shape

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf

    def hf_names(self, num_layers: int) -> list[str]:
        return [self.hf.format(i=i) for i in range(num_layers)] if self.stacked else [self.hf]


def linear(hf: str, ours: str) -> list[Tensor]:
    """torch `nn.Linear` (`weight` [out, in], `bias`) <-> `nnx.Linear` (`kernel`, `bias`)."""
    return [Tensor(f"{hf}.weight", f"{ours}.kernel", transpose=True),
            Tensor(f"{hf}.bias", f"{ours}.bias")]


def layer_norm(hf: str, ours: str) -> list[Tensor]:
    """torch `nn.LayerNorm` (`weight`, `bias`) <-> `nnx.LayerNorm` (`scale`, `bias`)."""
    return [Tensor(f"{hf}.weight", f"{ours}.scale"), Tensor(f"{hf}.bias", f"{ours}.bias")]


def _params(model: nnx.Module, tensors: tuple[Tensor, ...]) -> dict[str, nnx.Variable]:
    """`model`'s parameters and BatchNorm statistics by dotted path (the Variables themselves,
    so `set_value` writes into the model); checks that the table covers each exactly once."""
    state = nnx.state(model, (nnx.Param, nnx.BatchStat))
    params = {".".join(str(k) for k in path): variable
              for path, variable in nnx.to_flat_state(state)}
    covered = [t.ours for t in tensors]
    if sorted(covered) != sorted(params):
        raise ValueError(f"the HF tensor table of {type(model).__name__} does not match its "
                         f"parameters: uncovered {sorted(set(params) - set(covered))}, unknown "
                         f"{sorted(set(covered) - set(params))}")
    return params


@dataclasses.dataclass(frozen=True)
class Converter:
    """How one model family maps to HuggingFace.

    - `method`, `model_class`: the `objectives.registry` method and our model class.
    - `model_type`: HF's `model_type` in `config.json`.
    - `config_from_hf(hf_config, **overrides)` -> our config; `config_to_hf(config)` -> the HF
      config dict (with `model_type` and `architectures`).
    - `architectures`: the HF classes this converter reads and writes (the first is written);
      a `model_type` with several converters (ELECTRA's discriminator and generator) picks by
      `config.json`'s `architectures`, falling back to its first converter.
    - `tensors(config)`: the name table for a model of that config, in the HF names of the
      pre-training class (e.g. `BertForPreTraining`), i.e. with the base-model `prefix` (HF
      `base_model_prefix` + "."). Checkpoints of the bare base model (e.g. `BertModel`) store
      names without it.
    - `optional`: HF name prefixes that a checkpoint may lack (pooler, pre-training heads); those
      parameters keep their initial values, with a warning. Anything else missing is an error.
    - `tied`: HF's `_tied_weights_keys` (copy -> source). HF saves only the source; old
      checkpoints may hold the copy instead, or both.
    - `ignored`: HF names that carry no parameter (buffers such as `position_ids`).
    - `buffers(config)`: HF tensors without a parameter of ours that `save` writes anyway so
      that transformers finds every key (BatchNorm's `num_batches_tracked`).
    - `accepts(config)`: whether a model of `model_class` with this config is this converter's
      (one class, several HF layouts: the classifier's bert, electra and xlnet heads).
    """

    method: str
    model_type: str
    model_class: type[nnx.Module]
    architectures: tuple[str, ...]
    config_from_hf: Callable[..., Any]
    config_to_hf: Callable[[Any], dict[str, Any]]
    tensors: Callable[[Any], tuple[Tensor, ...]]
    prefix: str
    optional: tuple[str, ...] = ()
    tied: Mapping[str, str] = dataclasses.field(default_factory=dict)
    ignored: tuple[str, ...] = ()
    buffers: Callable[[Any], dict[str, np.ndarray]] = lambda config: {}
    accepts: Callable[[Any], bool] = lambda config: True

    def params_to_hf(self, model: nnx.Module) -> dict[str, np.ndarray]:
        """Our parameters -> a flat HF state dict of contiguous float32 numpy arrays."""
        tensors = self.tensors(model.config)
        params, state = _params(model, tensors), {}
        for tensor in tensors:
            value = np.asarray(params[tensor.ours].get_value(), np.float32)
            slices = ([value] * tensor.shared_layers if tensor.shared_layers
                      else list(value) if tensor.stacked else [value])
            for name, one in zip(tensor.hf_names(len(slices)), slices, strict=True):
                state[name] = np.ascontiguousarray(tensor.to_hf(one))
        return {**state, **self.buffers(model.config)}

    def params_from_hf(self, model: nnx.Module, state: Mapping[str, np.ndarray],
                       source: str = "the checkpoint") -> list[Tensor]:
        """Sets `model`'s parameters from a flat HF state dict; returns the `optional` tensors
        it lacks (left as they are), after warning about tensors that map to nothing.

        Renames TF-era LayerNorm `gamma`/`beta` to `weight`/`bias` (as transformers does on
        load), adds the base-model `prefix` to bare-model checkpoints, and resolves `tied`
        copies (warning when a stored copy differs: our model always ties). Raises `UserError`
        when a required tensor is missing or a shape does not match the model's config.
        """
        state = self._normalize(state, source)
        tensors = self.tensors(model.config)
        params, used = _params(model, tensors), set()
        missing, required = [], []
        for tensor in tensors:
            variable = params[tensor.ours]
            target = variable.get_value()
            per_layer = tensor.stacked and not tensor.shared_layers
            names = tensor.hf_names(tensor.shared_layers or
                                    (target.shape[0] if per_layer else 1))
            absent = [name for name in names if name not in state]
            if absent:
                missing.append(tensor)
                if not tensor.hf.startswith(self.optional):
                    required.extend(absent)
                continue
            expected = target.shape[1:] if per_layer else target.shape
            values = []
            for name in names:
                value = tensor.to_ours(state[name])
                if value.shape != expected:
                    raise UserError(
                        f"{source}: {name} has shape {tuple(state[name].shape)} but config.json "
                        f"implies {tensor.hf_shape(expected)}; fix "
                        "config.json or use the checkpoint it belongs to")
                values.append(np.asarray(value, np.float32))
            used.update(names)
            if any(not np.array_equal(v, values[0]) for v in values[1:]) and not per_layer:
                raise UserError(f"{source}: the per-layer copies of {tensor.hf} differ but our "
                                "config shares one across layers; load it with untie_r=True")
            value = np.stack(values) if per_layer else values[0]
            variable.set_value(jnp.asarray(value, dtype=target.dtype))
        if required:
            raise UserError(f"{source} lacks {required[0]} ({len(required)} required tensors "
                            f"missing); pass a complete {self.method} checkpoint")
        unused = sorted(n for n in state if n not in used and not n.endswith(self.ignored))
        if unused:
            warnings.warn(f"{source}: ignoring {len(unused)} tensors that "
                          f"{self.model_class.__name__} has no place for: "
                          f"{', '.join(unused[:5])}{', ...' if len(unused) > 5 else ''}",
                          stacklevel=4)
        return missing

    def _normalize(self, state: Mapping[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
        renamed = {}
        for name, value in state.items():
            for old, new in ((".gamma", ".weight"), (".beta", ".bias")):
                if name.endswith(old):
                    name = name[: -len(old)] + new
            renamed[name] = value
        if not any(name.startswith(self.prefix) for name in renamed):
            renamed = {self.prefix + name: value for name, value in renamed.items()}
        for copy, original in self.tied.items():
            if copy not in renamed:
                continue
            value = renamed.pop(copy)
            if original not in renamed:
                renamed[original] = value
            elif not np.array_equal(value, renamed[original]):
                warnings.warn(f"{source}: {copy} differs from {original}; our "
                              f"{self.model_class.__name__} ties them and uses {original}",
                              stacklevel=5)
        return renamed


# --- The shared encoder (BertModel / ElectraModel) ----------------------------------------------

def _encoder_tensors(prefix: str, config: EncoderConfig) -> tuple[Tensor, ...]:
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


def _encoder_config_from_hf(hf: Mapping[str, Any], **fields: Any) -> EncoderConfig:
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


def _encoder_config_to_hf(config: EncoderConfig) -> dict[str, Any]:
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


# --- BERT (transformers models/bert/modeling_bert.py, configuration_bert.py) --------------------

def _bert_tensors(config: EncoderConfig) -> tuple[Tensor, ...]:
    """`BertForPreTraining` names: `bert` (`BertModel`: `BertEmbeddings`, `BertEncoder` of
    `BertLayer`s, `BertPooler`) and `cls` (`BertPreTrainingHeads`: `predictions` =
    `BertLMPredictionHead` with its `transform` and `bias`, `seq_relationship`)."""
    return (
        *_encoder_tensors("bert.", config),
        *linear("bert.pooler.dense", "pooler"),
        *linear("cls.predictions.transform.dense", "mlm_transform"),
        *layer_norm("cls.predictions.transform.LayerNorm", "mlm_layer_norm"),
        Tensor("cls.predictions.bias", "mlm_bias"),
        *linear("cls.seq_relationship", "nsp"),
    )


def _bert_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> EncoderConfig:
    if hf.get("embedding_size", hf["hidden_size"]) != hf["hidden_size"]:
        raise UserError("a BERT config.json with embedding_size != hidden_size is not BERT; "
                        "fix config.json")
    return _encoder_config_from_hf(hf, **overrides)


def _bert_config_to_hf(config: EncoderConfig) -> dict[str, Any]:
    return {"model_type": "bert", "architectures": ["BertForPreTraining"],
            **_encoder_config_to_hf(config), "tie_word_embeddings": True}


# --- ELECTRA (transformers models/electra/modeling_electra.py, configuration_electra.py) --------
# Note: HF's generator head always applies the exact GELU (`get_activation("gelu")`), the TF
# reference the config's `hidden_act`; ours follows `hidden_act`, so HF generators with another
# activation than "gelu" differ in that one place. All released ELECTRA models use "gelu".

def _electra_discriminator_tensors(config: EncoderConfig) -> tuple[Tensor, ...]:
    """`ElectraForPreTraining`: `electra` (`ElectraModel`) + `discriminator_predictions`
    (`dense`, `dense_prediction`)."""
    return (*_encoder_tensors("electra.", config),
            *linear("discriminator_predictions.dense", "rtd_transform"),
            *linear("discriminator_predictions.dense_prediction", "rtd_output"))


def _electra_generator_tensors(config: EncoderConfig) -> tuple[Tensor, ...]:
    """`ElectraForMaskedLM`: `electra` + `generator_predictions` (`dense` to embedding_size,
    `LayerNorm`) + `generator_lm_head` (weight tied to the word embeddings, own bias)."""
    return (*_encoder_tensors("electra.", config),
            *linear("generator_predictions.dense", "mlm_transform"),
            *layer_norm("generator_predictions.LayerNorm", "mlm_layer_norm"),
            Tensor("generator_lm_head.bias", "mlm_bias"))


def _electra_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> EncoderConfig:
    return _encoder_config_from_hf(
        hf, **{"embedding_size": hf.get("embedding_size", hf["hidden_size"]), **overrides})


def _electra_config_to_hf(architecture: str) -> Callable[[EncoderConfig], dict[str, Any]]:
    def to_hf(config: EncoderConfig) -> dict[str, Any]:
        return {"model_type": "electra", "architectures": [architecture],
                **_encoder_config_to_hf(config), "embedding_size": config.embedding_width,
                "tie_word_embeddings": True}
    return to_hf


# --- XLNet (transformers models/xlnet/modeling_xlnet.py, configuration_xlnet.py) ---------------

def _xlnet_transformer_tensors(config: XLNetConfig, ours: str = "") -> tuple[Tensor, ...]:
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


def _xlnet_tensors(config: XLNetConfig) -> tuple[Tensor, ...]:
    """`XLNetLMHeadModel`: `transformer` and `lm_loss` (weight tied to the word embedding, own
    bias)."""
    return (*_xlnet_transformer_tensors(config), Tensor("lm_loss.bias", "lm_bias"))


def _xlnet_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> XLNetConfig:
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


def _xlnet_config_to_hf(config: XLNetConfig) -> dict[str, Any]:
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


# --- ResNet (transformers models/resnet/modeling_resnet.py, configuration_resnet.py) -----------

TORCH_CONV = (2, 3, 1, 0)  # torch Conv2d weight [O, I, H, W] -> flax [H, W, I, O]


def _conv_bn(hf: str, ours: str) -> list[Tensor]:
    """HF `ResNetConvLayer`/`ResNetShortCut` (`convolution`, `normalization`) <-> our `ConvBN`."""
    return [Tensor(f"{hf}.convolution.weight", f"{ours}.convolution.kernel", TORCH_CONV),
            Tensor(f"{hf}.normalization.weight", f"{ours}.normalization.scale"),
            Tensor(f"{hf}.normalization.bias", f"{ours}.normalization.bias"),
            Tensor(f"{hf}.normalization.running_mean", f"{ours}.normalization.mean"),
            Tensor(f"{hf}.normalization.running_var", f"{ours}.normalization.var")]


def _resnet_tensors(config: ResNetConfig) -> tuple[Tensor, ...]:
    """`ResNetModel` under the `resnet.` prefix (as in `ResNetForImageClassification`):
    `embedder.embedder`, then `encoder.stages.{s}.layers.{b}` with `shortcut` and `layer.{k}`."""
    tensors = _conv_bn("resnet.embedder.embedder", "stem")
    in_channels = config.stem_width
    for s, (depth, width) in enumerate(zip(config.stage_depths, config.stage_widths,
                                           strict=True)):
        for b in range(depth):
            hf, ours = f"resnet.encoder.stages.{s}.layers.{b}", f"stages.{s}.{b}"
            convs = 2 if config.block == "basic" else 3
            for k in range(convs):
                tensors += _conv_bn(f"{hf}.layer.{k}", f"{ours}.layers.{k}")
            if b == 0 and (in_channels != width or s > 0):
                tensors += _conv_bn(f"{hf}.shortcut", f"{ours}.shortcut")
        in_channels = width
    return tuple(tensors)


def _resnet_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ResNetConfig:
    """A HF `ResNetConfig` of a v1.5 ResNet-18/34/50/101 (any stem width) -> ours."""
    depths = tuple(hf.get("depths", (3, 4, 6, 3)))
    block = hf.get("layer_type", "bottleneck")
    matches = [d for d, (b, stages) in DEPTHS.items() if (b, stages) == (block, depths)]
    config = None
    if (matches and not hf.get("downsample_in_first_stage", False)
            and not hf.get("downsample_in_bottleneck", False)
            and hf.get("hidden_act", "relu") == "relu"):
        config = ResNetConfig(**{"depth": matches[0], "base_width": hf.get("embedding_size", 64),
                                 "num_channels": hf.get("num_channels", 3), **overrides})
    if config is None or list(hf.get("hidden_sizes", config.stage_widths)) != list(
            config.stage_widths):
        raise UserError(f"config.json describes a ResNet ({block}, depths {list(depths)}, "
                        f"hidden_sizes {hf.get('hidden_sizes')}) that is not a v1.5 "
                        f"ResNet-{sorted(DEPTHS)} with stage widths 1, 2, 4, 8 x the stem's "
                        "(x4 for bottlenecks); pass one that is")
    return config


def _resnet_config_to_hf(config: ResNetConfig) -> dict[str, Any]:
    if config.stem != "imagenet":
        raise UserError("HF ResNetModel has only the ImageNet stem; a CIFAR-stem ResNet cannot "
                        "be exported to it (save it as a pretext model directory instead)")
    return {"model_type": "resnet", "architectures": ["ResNetModel"],
            "num_channels": config.num_channels, "embedding_size": config.stem_width,
            "hidden_sizes": list(config.stage_widths), "depths": list(config.stage_depths),
            "layer_type": config.block, "hidden_act": "relu",
            "downsample_in_first_stage": False, "downsample_in_bottleneck": False}


# --- MPNet (transformers models/mpnet/modeling_mpnet.py, configuration_mpnet.py) ---------------

def _mpnet_tensors(config: MPNetConfig) -> tuple[Tensor, ...]:
    """`MPNetForMaskedLM`: `mpnet` (`MPNetModel` without pooler: `embeddings` without token
    types, `encoder.layer.{i}` with `attention.attn` q/k/v/o, the shared
    `encoder.relative_attention_bias`) and `lm_head` (dense, layer_norm, decoder tied to the
    word embeddings, bias)."""
    layer, layers = "mpnet.encoder.layer.{i}", "layers"
    return (
        Tensor("mpnet.embeddings.word_embeddings.weight", "word_embeddings.embedding"),
        Tensor("mpnet.embeddings.position_embeddings.weight", "position_embeddings.embedding"),
        *layer_norm("mpnet.embeddings.LayerNorm", "embedding_layer_norm"),
        Tensor("mpnet.encoder.relative_attention_bias.weight",
               "relative_attention_bias.embedding"),
        *linear(f"{layer}.attention.attn.q", f"{layers}.query"),
        *linear(f"{layer}.attention.attn.k", f"{layers}.key"),
        *linear(f"{layer}.attention.attn.v", f"{layers}.value"),
        *linear(f"{layer}.attention.attn.o", f"{layers}.attention_output"),
        *layer_norm(f"{layer}.attention.LayerNorm", f"{layers}.attention_layer_norm"),
        *linear(f"{layer}.intermediate.dense", f"{layers}.intermediate"),
        *linear(f"{layer}.output.dense", f"{layers}.output"),
        *layer_norm(f"{layer}.output.LayerNorm", f"{layers}.output_layer_norm"),
        *_lm_head_tensors(),
    )


def _lm_head_tensors() -> tuple[Tensor, ...]:
    """HF `RobertaLMHead` / `MPNetLMHead` (`lm_head.dense`, `layer_norm`, `bias`; the decoder
    is tied to the word embeddings) <-> our `MaskedLMHead` at `lm_head`."""
    return (*linear("lm_head.dense", "lm_head.dense"),
            *layer_norm("lm_head.layer_norm", "lm_head.layer_norm"),
            Tensor("lm_head.bias", "lm_head.bias"))


def _mpnet_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> MPNetConfig:
    """`MPNetConfig` -> ours: BERT's field names without token types, plus the bucket count
    (HF's default layer_norm_eps 1e-12 when absent; the released models say 1e-5)."""
    shared = dataclasses.asdict(_encoder_config_from_hf(hf))
    ours = {f.name for f in dataclasses.fields(MPNetConfig)}
    return MPNetConfig(**{
        **{k: v for k, v in shared.items() if k in ours},
        "relative_attention_num_buckets": hf.get("relative_attention_num_buckets", 32),
        **overrides})


def _mpnet_config_to_hf(config: MPNetConfig) -> dict[str, Any]:
    return {
        "model_type": "mpnet", "architectures": ["MPNetForMaskedLM"],
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "intermediate_size": config.intermediate_size,
        "hidden_act": OUR_TO_HF_ACTIVATION[config.hidden_act],
        "hidden_dropout_prob": config.hidden_dropout,
        "attention_probs_dropout_prob": config.attention_dropout,
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range, "layer_norm_eps": config.layer_norm_eps,
        "relative_attention_num_buckets": config.relative_attention_num_buckets,
        "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "tie_word_embeddings": True,
    }


# --- RoBERTa (transformers models/roberta/modeling_roberta.py, configuration_roberta.py) --------

def _roberta_tensors(config: RobertaConfig) -> tuple[Tensor, ...]:
    """`RobertaForMaskedLM`: `roberta` (`RobertaModel` without pooler: BERT's embeddings and
    layers) + `lm_head` (`RobertaLMHead`: `dense`, `layer_norm`, `bias`; decoder tied)."""
    return (*_encoder_tensors("roberta.", config), *_lm_head_tensors())


def _roberta_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> RobertaConfig:
    """HF's `pad_token_id` (1 in the released models) is where positions start counting."""
    fields = {"position_padding_id": hf.get("pad_token_id", 1), **overrides}
    return RobertaConfig(**dataclasses.asdict(_encoder_config_from_hf(hf, **fields)))


def _roberta_config_to_hf(config: RobertaConfig) -> dict[str, Any]:
    return {"model_type": "roberta", "architectures": ["RobertaForMaskedLM"],
            **_encoder_config_to_hf(config), "pad_token_id": config.position_padding_id,
            "tie_word_embeddings": True}


# --- ALBERT (transformers models/albert/modeling_albert.py, configuration_albert.py) -----------

ALBERT_LAYER = "albert.encoder.albert_layer_groups.0.albert_layers.0"


def _albert_tensors(config: AlbertConfig) -> tuple[Tensor, ...]:
    """`AlbertForPreTraining`: `albert` (`AlbertEmbeddings` as BERT's at width E,
    `encoder.embedding_hidden_mapping_in`, the one shared layer of the one layer group,
    `pooler`) + `predictions` (`AlbertMLMHead`: `dense`, `LayerNorm`, `bias`; decoder tied) +
    `sop_classifier.classifier`."""
    layer, ours = ALBERT_LAYER, "encoder.stack.layer"
    embeddings = [t for t in _encoder_tensors("albert.", config)
                  if t.ours.startswith("encoder.embeddings.")]
    return (
        *embeddings,
        *linear("albert.encoder.embedding_hidden_mapping_in", "encoder.embeddings_project"),
        *linear(f"{layer}.attention.query", f"{ours}.query"),
        *linear(f"{layer}.attention.key", f"{ours}.key"),
        *linear(f"{layer}.attention.value", f"{ours}.value"),
        *linear(f"{layer}.attention.dense", f"{ours}.attention_output"),
        *layer_norm(f"{layer}.attention.LayerNorm", f"{ours}.attention_layer_norm"),
        *linear(f"{layer}.ffn", f"{ours}.intermediate"),
        *linear(f"{layer}.ffn_output", f"{ours}.output"),
        *layer_norm(f"{layer}.full_layer_layer_norm", f"{ours}.output_layer_norm"),
        *linear("albert.pooler", "pooler"),
        *linear("predictions.dense", "lm_head.dense"),
        *layer_norm("predictions.LayerNorm", "lm_head.layer_norm"),
        Tensor("predictions.bias", "lm_head.bias"),
        *linear("sop_classifier.classifier", "sop"),
    )


def _albert_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> AlbertConfig:
    """HF `AlbertConfig` (its defaults: gelu_new, no dropout, E = 128) -> ours; only one layer
    group of one layer, i.e. all layers sharing one set of parameters, is supported."""
    groups, inner = hf.get("num_hidden_groups", 1), hf.get("inner_group_num", 1)
    if (groups, inner) != (1, 1):
        raise UserError(f"config.json has num_hidden_groups={groups}, inner_group_num={inner}; "
                        "only 1 and 1 (all layers share one, as every released ALBERT) are "
                        "supported")
    if hf.get("num_labels", 2) != 2:
        raise UserError(f"config.json has num_labels={hf['num_labels']}; the sentence-order "
                        "head has 2")
    hf = {"hidden_act": "gelu_new", "hidden_dropout_prob": 0.0,
          "attention_probs_dropout_prob": 0.0, **hf}
    fields = {"embedding_size": hf.get("embedding_size", 128), **overrides}
    return AlbertConfig(**dataclasses.asdict(_encoder_config_from_hf(hf, **fields)))


def _albert_config_to_hf(config: AlbertConfig) -> dict[str, Any]:
    return {"model_type": "albert", "architectures": ["AlbertForPreTraining"],
            **_encoder_config_to_hf(config), "embedding_size": config.embedding_width,
            "num_hidden_groups": 1, "inner_group_num": 1, "tie_word_embeddings": True}


# --- GPT-2 (transformers models/gpt2/modeling_gpt2.py, configuration_gpt2.py) ------------------

def conv1d(hf: str, ours: str) -> list[Tensor]:
    """transformers `Conv1D` (`weight` [in, out], `bias`) <-> `nnx.Linear`: no transpose."""
    return [Tensor(f"{hf}.weight", f"{ours}.kernel"), Tensor(f"{hf}.bias", f"{ours}.bias")]


def _gpt2_tensors(config: GPTConfig) -> tuple[Tensor, ...]:
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


def _gpt2_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> GPTConfig:
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


def _gpt2_config_to_hf(config: GPTConfig) -> dict[str, Any]:
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


# --- T5 (transformers models/t5/modeling_t5.py, configuration_t5.py) ---------------------------

def _t5_stack_tensors(stack: str, config: T5Config) -> list[Tensor]:
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


def _t5_tensors(config: T5Config) -> tuple[Tensor, ...]:
    """`T5ForConditionalGeneration`: `shared`, `encoder`, `decoder` and, untied (v1.1),
    `lm_head`. HF's `encoder.embed_tokens`/`decoder.embed_tokens` are tied copies of `shared`."""
    head = [] if config.tie_word_embeddings else [
        Tensor("lm_head.weight", "lm_head.kernel", transpose=True)]
    return (Tensor("shared.weight", "shared.embedding"), *_t5_stack_tensors("encoder", config),
            *_t5_stack_tensors("decoder", config), *head)


def _t5_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> T5Config:
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


def _t5_config_to_hf(config: T5Config) -> dict[str, Any]:
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


# --- Sequence classification (Bert/Electra/XLNetForSequenceClassification) ---------------------

def _classifier_tensors(config: HeadConfig) -> tuple[Tensor, ...]:
    """BERT: `bert` + `bert.pooler.dense` + `classifier`; ELECTRA: `electra` + `classifier`
    (`ElectraClassificationHead`: `dense`, `out_proj`); XLNet: `transformer` +
    `sequence_summary.summary` (`XLNetSequenceSummary`'s projection) + `logits_proj`."""
    if config.head == "xlnet":
        return (*_xlnet_transformer_tensors(config, "transformer."),
                *linear("sequence_summary.summary", "head_dense"),
                *linear("logits_proj", "head_output"))
    if config.head == "bert":
        return (*_encoder_tensors("bert.", config), *linear("bert.pooler.dense", "head_dense"),
                *linear("classifier", "head_output"))
    return (*_encoder_tensors("electra.", config), *linear("classifier.dense", "head_dense"),
            *linear("classifier.out_proj", "head_output"))


# HF `XLNetSequenceSummary` settings that are our xlnet head (zihangdai/xlnet run_classifier.py
# summary_type "last", use_summ_proj, a tanh projection to d_model, no dropout before it).
XLNET_SUMMARY = {"summary_type": "last", "summary_use_proj": True, "summary_activation": "tanh",
                 "summary_proj_to_labels": False, "summary_first_dropout": 0.0}


def _xlnet_head_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The xlnet head's fields of an `XLNetForSequenceClassification` config."""
    for key, ours in XLNET_SUMMARY.items():
        if hf.get(key, ours) != ours:
            raise UserError(f"config.json has {key}={hf[key]!r}; only {ours!r} (XLNet's own "
                            "sequence summary) is supported")
    return {"classifier_dropout": hf.get("summary_last_dropout", 0.1)}


def _xlnet_head_to_hf(config: XLNetClassifierConfig) -> dict[str, Any]:
    return {**XLNET_SUMMARY, "summary_last_dropout": config.head_dropout}


def _bert_head_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    dropout = hf.get("classifier_dropout")
    return {"classifier_dropout": -1.0 if dropout is None else dropout}


def _bert_head_to_hf(config: ClassifierConfig) -> dict[str, Any]:
    return {"classifier_dropout": (None if config.classifier_dropout < 0
                                   else config.classifier_dropout)}


def _classifier_converter(
    head: str, architecture: str, config_class: type[HeadConfig],
    encoder_from_hf: Callable[..., Any], encoder_to_hf: Callable[[Any], dict[str, Any]],
    head_from_hf: Callable[[Mapping[str, Any]], dict[str, Any]],
    head_to_hf: Callable[[Any], dict[str, Any]], **fields: Any,
) -> Converter:
    """HF `architecture` (model_type `head`) <-> our `SequenceClassifier` with that head: the
    family's encoder config and tensors plus the labels and the head's own settings."""

    def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> HeadConfig:
        num_labels = hf.get("num_labels") or len(hf.get("id2label") or {0: 0, 1: 1})
        return config_class(**{
            **dataclasses.asdict(encoder_from_hf(hf)), "head": head, "num_labels": num_labels,
            **head_from_hf(hf), **overrides})

    def config_to_hf(config: HeadConfig) -> dict[str, Any]:
        labels = {str(i): f"LABEL_{i}" for i in range(config.num_labels)}
        return {**encoder_to_hf(config), "architectures": [architecture],
                "id2label": labels, "label2id": {v: int(k) for k, v in labels.items()},
                "problem_type": ("regression" if config.num_labels == 1
                                 else "single_label_classification"),
                **head_to_hf(config)}

    return Converter(method="classify", model_type=head, model_class=SequenceClassifier,
                     architectures=(architecture,), config_from_hf=config_from_hf,
                     config_to_hf=config_to_hf, tensors=_classifier_tensors,
                     accepts=lambda config: config.head == head, **fields)


_NO_PARAMETER = ("embeddings.position_ids", "embeddings.token_type_ids")

CONVERTERS: dict[str, Converter] = {
    "bert": Converter(
        method="bert", model_type="bert", model_class=Bert, architectures=("BertForPreTraining",),
        config_from_hf=_bert_config_from_hf, config_to_hf=_bert_config_to_hf,
        tensors=_bert_tensors, prefix="bert.",
        optional=("bert.pooler.", "cls.predictions.", "cls.seq_relationship."),
        tied={"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
              "cls.predictions.decoder.bias": "cls.predictions.bias"},
        ignored=_NO_PARAMETER,
    ),
    "electra-discriminator": Converter(
        method="electra", model_type="electra", model_class=ElectraDiscriminator,
        architectures=("ElectraForPreTraining",), config_from_hf=_electra_config_from_hf,
        config_to_hf=_electra_config_to_hf("ElectraForPreTraining"),
        tensors=_electra_discriminator_tensors, prefix="electra.",
        optional=("discriminator_predictions.",), ignored=_NO_PARAMETER,
    ),
    "electra-generator": Converter(
        method="electra", model_type="electra", model_class=ElectraGenerator,
        architectures=("ElectraForMaskedLM",),
        config_from_hf=_electra_config_from_hf,
        config_to_hf=_electra_config_to_hf("ElectraForMaskedLM"),
        tensors=_electra_generator_tensors, prefix="electra.",
        optional=("generator_predictions.", "generator_lm_head."),
        tied={"generator_lm_head.weight": "electra.embeddings.word_embeddings.weight"},
        ignored=_NO_PARAMETER,
    ),
    "xlnet": Converter(
        method="xlnet", model_type="xlnet", model_class=XLNet,
        architectures=("XLNetLMHeadModel",), config_from_hf=_xlnet_config_from_hf,
        config_to_hf=_xlnet_config_to_hf, tensors=_xlnet_tensors, prefix="transformer.",
        optional=("lm_loss.",),
        tied={"lm_loss.weight": "transformer.word_embedding.weight"},
    ),
    "bert-classifier": _classifier_converter(
        "bert", "BertForSequenceClassification", ClassifierConfig, _bert_config_from_hf,
        _bert_config_to_hf, _bert_head_from_hf, _bert_head_to_hf, prefix="bert.",
        optional=("classifier.",), ignored=_NO_PARAMETER),
    "electra-classifier": _classifier_converter(
        "electra", "ElectraForSequenceClassification", ClassifierConfig, _electra_config_from_hf,
        _electra_config_to_hf("ElectraForPreTraining"), _bert_head_from_hf, _bert_head_to_hf,
        prefix="electra.", optional=("classifier.",), ignored=_NO_PARAMETER),
    "xlnet-classifier": _classifier_converter(
        "xlnet", "XLNetForSequenceClassification", XLNetClassifierConfig, _xlnet_config_from_hf,
        _xlnet_config_to_hf, _xlnet_head_from_hf, _xlnet_head_to_hf, prefix="transformer.",
        optional=("sequence_summary.", "logits_proj.")),
    "mpnet": Converter(
        method="mpnet", model_type="mpnet", model_class=MPNet,
        architectures=("MPNetForMaskedLM",), config_from_hf=_mpnet_config_from_hf,
        config_to_hf=_mpnet_config_to_hf, tensors=_mpnet_tensors, prefix="mpnet.",
        optional=("lm_head.",),
        tied={"lm_head.decoder.weight": "mpnet.embeddings.word_embeddings.weight",
              "lm_head.decoder.bias": "lm_head.bias"},
        ignored=("embeddings.position_ids",),
    ),
    "roberta": Converter(
        method="roberta", model_type="roberta", model_class=Roberta,
        architectures=("RobertaForMaskedLM",), config_from_hf=_roberta_config_from_hf,
        config_to_hf=_roberta_config_to_hf, tensors=_roberta_tensors, prefix="roberta.",
        optional=("lm_head.",),
        tied={"lm_head.decoder.weight": "roberta.embeddings.word_embeddings.weight",
              "lm_head.decoder.bias": "lm_head.bias"},
        ignored=(*_NO_PARAMETER, "pooler.dense.weight", "pooler.dense.bias"),
    ),
    "albert": Converter(
        method="albert", model_type="albert", model_class=Albert,
        architectures=("AlbertForPreTraining",), config_from_hf=_albert_config_from_hf,
        config_to_hf=_albert_config_to_hf, tensors=_albert_tensors, prefix="albert.",
        optional=("albert.pooler.", "predictions.", "sop_classifier."),
        tied={"predictions.decoder.weight": "albert.embeddings.word_embeddings.weight",
              "predictions.decoder.bias": "predictions.bias"},
        ignored=_NO_PARAMETER,
    ),
    "gpt2": Converter(
        method="gpt", model_type="gpt2", model_class=GPT, architectures=("GPT2LMHeadModel",),
        config_from_hf=_gpt2_config_from_hf, config_to_hf=_gpt2_config_to_hf,
        tensors=_gpt2_tensors, prefix="transformer.",
        tied={"lm_head.weight": "transformer.wte.weight"},
        ignored=(".attn.bias", ".attn.masked_bias"),
    ),
    "t5": Converter(
        method="t5", model_type="t5", model_class=T5,
        architectures=("T5ForConditionalGeneration",), config_from_hf=_t5_config_from_hf,
        config_to_hf=_t5_config_to_hf, tensors=_t5_tensors, prefix="",
        tied={"encoder.embed_tokens.weight": "shared.weight",
              "decoder.embed_tokens.weight": "shared.weight"},
        # HF's state dict of a tied model holds `lm_head.weight` (= `shared.weight`) too.
        ignored=("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",
                 "lm_head.weight"),
    ),
    "resnet": Converter(
        method="simclr", model_type="resnet", model_class=ResNet,
        architectures=("ResNetModel", "ResNetForImageClassification"),
        config_from_hf=_resnet_config_from_hf, config_to_hf=_resnet_config_to_hf,
        tensors=_resnet_tensors, prefix="resnet.",
        ignored=("num_batches_tracked", "classifier.1.weight", "classifier.1.bias"),
        buffers=lambda config: {
            t.hf.replace(".running_mean", ".num_batches_tracked"): np.zeros((), np.int64)
            for t in _resnet_tensors(config) if t.hf.endswith(".running_mean")},
    ),
}


# --- In memory -----------------------------------------------------------------------------------

def _converter_for(model: nnx.Module) -> Converter:
    for converter in CONVERTERS.values():
        if isinstance(model, converter.model_class) and converter.accepts(model.config):
            return converter
    raise UserError(f"no HuggingFace conversion for {type(model).__name__}; supported: "
                    f"{sorted(CONVERTERS)}")


def _parts(model: nnx.Module) -> dict[str, nnx.Module] | None:
    """The stand-alone models a joint pre-training model is made of (ELECTRA: discriminator
    and generator), or None for a single model."""
    return model.parts() if hasattr(model, "parts") else None


def method_name(model: nnx.Module) -> str:
    """The `objectives.registry` method a converted model belongs to (for pretext model
    directories)."""
    parts = _parts(model)
    return _converter_for(next(iter(parts.values())) if parts else model).method


def to_hf(model: nnx.Module) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Our model -> (HF config dict, flat HF state dict of float32 numpy arrays)."""
    converter = _converter_for(model)
    return converter.config_to_hf(model.config), converter.params_to_hf(model)


def _config(hf_config: Mapping[str, Any], source: str,
            overrides: Mapping[str, Any]) -> tuple[Converter, Any]:
    model_type = hf_config.get("model_type")
    if model_type is None:
        raise UserError(f"{source}: config.json has no model_type, so it is not a HuggingFace "
                        "config; pass a transformers checkpoint folder")
    candidates = [c for c in CONVERTERS.values() if c.model_type == model_type]
    if not candidates:
        raise UserError(f"{source}: model_type {model_type!r} is not supported; convert one "
                        f"of {sorted({c.model_type for c in CONVERTERS.values()})}")
    architecture = (hf_config.get("architectures") or [""])[0]
    converter = next((c for c in candidates if architecture in c.architectures), candidates[0])
    try:
        return converter, converter.config_from_hf(hf_config, **overrides)
    except KeyError as e:
        raise UserError(f"{source}: config.json lacks {e}; add it") from None
    except (TypeError, ValueError) as e:
        raise UserError(f"{source}: invalid config ({e}); fix config.json or the overrides "
                        f"{sorted(overrides)}") from None


def _build(converter: Converter, config: Any, state: Mapping[str, np.ndarray],
           source: str) -> nnx.Module:
    def init() -> nnx.Module:
        return converter.model_class(config, rngs=nnx.Rngs(0))

    model = nnx.eval_shape(init)  # shapes and sharding metadata, no initialisation
    missing = converter.params_from_hf(model, state, source)
    if missing:
        tensors = converter.tensors(config)
        initial, params = _params(init(), tensors), _params(model, tensors)
        for tensor in missing:
            params[tensor.ours].set_value(initial[tensor.ours].get_value())
        parts = sorted({p.rstrip(".") for p in converter.optional for t in missing
                        if t.hf.startswith(p)})
        warnings.warn(f"{source} has no {', '.join(parts)}; they keep their initial values "
                      "(fine for fine-tuning, not for evaluating them)", stacklevel=3)
    return model


def from_hf(hf_config: Mapping[str, Any], state: Mapping[str, np.ndarray],
            source: str = "the checkpoint", **config_overrides: Any) -> nnx.Module:
    """(HF config dict, flat HF state dict of numpy arrays) -> our model; see `load`. `source`
    names the checkpoint in messages."""
    converter, config = _config(hf_config, source, config_overrides)
    return _build(converter, config, state, source)


# --- Files ---------------------------------------------------------------------------------------

def _read_state_dict(path: Path) -> dict[str, np.ndarray]:
    """The state dict of a HF folder: safetensors (single or sharded), else torch pickles."""
    from safetensors.numpy import load_file  # bfloat16 works: jax registers ml_dtypes

    if (path / SAFETENSORS_FILE).is_file():
        return load_file(path / SAFETENSORS_FILE)
    if (path / SAFETENSORS_INDEX).is_file():
        return {name: value for shard in _shards(path / SAFETENSORS_INDEX)
                for name, value in load_file(path / shard).items()}
    torch_files = ([TORCH_FILE] if (path / TORCH_FILE).is_file()
                   else _shards(path / TORCH_INDEX) if (path / TORCH_INDEX).is_file() else [])
    if not torch_files:
        raise UserError(f"{path} has no {SAFETENSORS_FILE} or {TORCH_FILE}; pass a "
                        "HuggingFace checkpoint folder with its weights")
    try:
        import torch
    except ImportError:
        raise UserError(f"{path / torch_files[0]} needs torch to read; install torch or convert "
                        f"the checkpoint to {SAFETENSORS_FILE}") from None
    state = {}
    for file in torch_files:
        tensors = torch.load(path / file, map_location="cpu", weights_only=True)
        state.update({name: t.float().numpy() for name, t in tensors.items()})
    return state


def _shards(index: Path) -> list[str]:
    return sorted(set(json.loads(index.read_text())["weight_map"].values()))


def load(path: str | Path, **config_overrides: Any) -> nnx.Module:
    """A HuggingFace folder (`config.json` + `model.safetensors`, sharded safetensors, or
    `pytorch_model.bin`, which needs torch) -> our model with its weights, in float32.

    `config_overrides` set fields of our config that HF does not have (`dtype`, `scan_layers`,
    `remat`) or replace mapped ones (e.g. `hidden_dropout`). Both `BertForPreTraining` names
    (`bert.` prefix) and bare `BertModel` names load; a checkpoint without the pooler or the
    pre-training heads (`cls.predictions`, `cls.seq_relationship`) leaves those at their
    initial values, with a warning naming them. HF's tied copies (`cls.predictions.decoder.*`)
    are optional. Bad folders, unknown model types and mismatched shapes raise `UserError`.
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path} is not a directory; pass a HuggingFace checkpoint folder "
                        f"({CONFIG_FILE} + {SAFETENSORS_FILE})")
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        for method, part_names in JOINT_METHODS.items():
            if all((path / name / CONFIG_FILE).is_file() for name in part_names):
                return _load_joint(path, method, part_names, config_overrides)
        raise UserError(f"{path} has no {CONFIG_FILE}; pass a HuggingFace checkpoint folder")
    try:
        hf_config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{config_file} is not valid JSON ({e}); fix or replace it") from None
    if not isinstance(hf_config, dict):
        raise UserError(f"{config_file} is not a JSON object; pass a HuggingFace config")
    converter, config = _config(hf_config, str(path), config_overrides)
    return _build(converter, config, _read_state_dict(path), str(path))


# Pre-training methods whose model joins several HF models, saved as one sub-folder per part.
JOINT_METHODS: dict[str, tuple[str, ...]] = {"electra": ("discriminator", "generator")}


def _load_joint(path: Path, method_name: str, part_names: tuple[str, ...],
                overrides: Mapping[str, Any]) -> nnx.Module:
    """The joint pre-training model from its part folders (e.g. `discriminator/` and
    `generator/` from `google/electra-small-*`): the method's config class derives the joint
    config (`from_parts`), the model copies the parts' weights in (`load_parts`)."""
    parts = {name: load(path / name, **overrides) for name in part_names}
    method = registry.get(method_name)
    try:
        config = method.model_config.from_parts(**{n: m.config for n, m in parts.items()})
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None
    model = nnx.eval_shape(lambda: method.build_model(config, 0))
    model.load_parts(**parts)
    return model


def _is_hf_checkpoint(path: Path) -> bool:
    try:
        return "model_type" in json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError, TypeError):
        return False


# Files of a HF checkpoint that `save` supersedes; anything else there stays (the tokenizer's
# files too, unless a tokenizer is saved).
_WEIGHT_FILES = (CONFIG_FILE, SAFETENSORS_FILE, SAFETENSORS_INDEX, TORCH_FILE, TORCH_INDEX,
                 "tf_model.h5", "flax_model.msgpack")
# The model card that `export.convert` writes beside the model (beside the parts of a joint one).
MODEL_CARD = "README.md"


def _superseded(name: str, tokenizer: bool) -> bool:
    return (name in _WEIGHT_FILES or (tokenizer and name in hf_tokenizer.FILES)
            or (name.startswith(("model-", "pytorch_model-"))
                and name.endswith((".safetensors", ".bin"))))


def _sibling(path: Path, kind: str) -> Path:
    """A fresh hidden name beside `path` (same file system, so renames are atomic)."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.{kind}")


def save(model: nnx.Module, path: str | Path, tokenizer: Tokenizer | None = None) -> Path:
    """Writes `config.json` + `model.safetensors` (float32) that transformers loads, e.g.
    `BertForPreTraining.from_pretrained(path)`, with no missing or unexpected keys, and with a
    `tokenizer` its HF files (`pretrain.hf_tokenizer`: `AutoTokenizer.from_pretrained(path)`
    gives its ids).

    `path` may be new, empty, or an existing HF checkpoint (its weights and config are replaced,
    other files such as the tokenizer's are kept unless a tokenizer is given). A joint model
    (ELECTRA) is written as one checkpoint per part, `path/discriminator` and `path/generator`,
    each with the tokenizer, which `load` reads back. Any other non-empty folder is refused. The
    checkpoint is written into a temporary sibling folder and renamed into place, so a crash
    leaves either the old folder or the new one, never a half-written checkpoint. Files are
    0644 and folders 0755 (readable by others).
    """
    from safetensors.numpy import save_file

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{path} is a file; pass a directory to write the checkpoint into")
    parts = _parts(model)
    if parts:
        others = ([p.name for p in path.glob("*") if p.name not in (*parts, MODEL_CARD)]
                  if path.is_dir() else [])
        if others:
            raise UserError(f"{path} holds {others[0]}, which is not one of the parts "
                            f"{sorted(parts)}; choose a new or empty output directory")
        for name, part in parts.items():
            save(part, path / name, tokenizer)
        path.chmod(0o755)
        return path
    existing = path.is_dir() and any(path.iterdir())
    if existing and not _is_hf_checkpoint(path):
        raise UserError(f"{path} is a non-empty folder that is not a HuggingFace checkpoint; "
                        "choose a new or empty output directory")
    hf_config, state = to_hf(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    stage = _sibling(path, "tmp")
    stage.mkdir()
    try:
        (stage / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
        save_file(state, stage / SAFETENSORS_FILE, metadata={"format": "pt"})
        if tokenizer is not None:
            if "vocab_size" not in hf_config:
                raise UserError(f"a {hf_config['model_type']} model has no vocabulary, so no "
                                "tokenizer; save it without one")
            hf_tokenizer.save(tokenizer, stage, hf_config["model_type"],
                              hf_config["vocab_size"])
        make_readable(stage)
        if not existing:
            if path.is_dir():
                path.rmdir()
            os.replace(stage, path)
            return path
        for item in path.iterdir():
            if not _superseded(item.name, tokenizer is not None):
                copy = shutil.copytree if item.is_dir() else shutil.copy2
                copy(item, stage / item.name)
        old = _sibling(path, "old")
        os.replace(path, old)
        os.replace(stage, path)
        shutil.rmtree(old)
        return path
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
