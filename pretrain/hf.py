"""HuggingFace interop: `load(path)` reads a transformers checkpoint folder into our model, and
`save(model, path)` writes one that transformers loads. Both directions use the same table of
names, so import and export cannot drift apart.

This is the one place in `pretrain/` that knows model families by name: `CONVERTERS` maps a
HF `model_type` to a converter (BERT now; ELECTRA and XLNet add entries).

Names follow HF transformers modeling_bert.py (`BertForPreTraining`): torch Linear weights are
[out, in] (ours [in, out]); our encoder layers are stacked on a leading axis.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from input_pipeline.errors import UserError
from models.bert import Bert
from models.encoder import EncoderConfig

HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_fast": "gelu_tanh", "relu": "relu"}
OUR_TO_HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One HF tensor <-> one of our parameters. `path` is our parameter's path (dots), `layer`
    the HF name pattern with `{i}` for stacked encoder layers, `transpose` for Linear kernels."""

    hf: str
    ours: str
    transpose: bool = False
    stacked: bool = False


def _linear(hf: str, ours: str, stacked: bool = False) -> list[Tensor]:
    return [Tensor(f"{hf}.weight", f"{ours}.kernel", True, stacked),
            Tensor(f"{hf}.bias", f"{ours}.bias", False, stacked)]


def _norm(hf: str, ours: str, stacked: bool = False) -> list[Tensor]:
    return [Tensor(f"{hf}.weight", f"{ours}.scale", False, stacked),
            Tensor(f"{hf}.bias", f"{ours}.bias", False, stacked)]


def _bert_tensors() -> list[Tensor]:
    layer, ours = "bert.encoder.layer.{i}", "encoder.stack.layers"
    tensors = [
        Tensor("bert.embeddings.word_embeddings.weight",
               "encoder.embeddings.word_embeddings.embedding"),
        Tensor("bert.embeddings.position_embeddings.weight",
               "encoder.embeddings.position_embeddings.embedding"),
        Tensor("bert.embeddings.token_type_embeddings.weight",
               "encoder.embeddings.token_type_embeddings.embedding"),
        *_norm("bert.embeddings.LayerNorm", "encoder.embeddings.layer_norm"),
        *_linear(f"{layer}.attention.self.query", f"{ours}.query", True),
        *_linear(f"{layer}.attention.self.key", f"{ours}.key", True),
        *_linear(f"{layer}.attention.self.value", f"{ours}.value", True),
        *_linear(f"{layer}.attention.output.dense", f"{ours}.attention_output", True),
        *_norm(f"{layer}.attention.output.LayerNorm", f"{ours}.attention_layer_norm", True),
        *_linear(f"{layer}.intermediate.dense", f"{ours}.intermediate", True),
        *_linear(f"{layer}.output.dense", f"{ours}.output", True),
        *_norm(f"{layer}.output.LayerNorm", f"{ours}.output_layer_norm", True),
        *_linear("bert.pooler.dense", "pooler"),
        *_linear("cls.predictions.transform.dense", "mlm_transform"),
        *_norm("cls.predictions.transform.LayerNorm", "mlm_layer_norm"),
        Tensor("cls.predictions.bias", "mlm_bias"),
        *_linear("cls.seq_relationship", "nsp"),
    ]
    return tensors


def _bert_config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    act = hf.get("hidden_act", "gelu")
    if act not in HF_ACTIVATIONS:
        raise UserError(f"hidden_act {act!r} is not supported; use one of "
                        f"{sorted(HF_ACTIVATIONS)}")
    return dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf["max_position_embeddings"],
        type_vocab_size=hf.get("type_vocab_size", 2), hidden_act=HF_ACTIVATIONS[act],
        layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
        initializer_range=hf.get("initializer_range", 0.02),
    )


def _bert_config_to_hf(config: EncoderConfig) -> dict[str, Any]:
    return {
        "model_type": "bert", "architectures": ["BertForPreTraining"],
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_position_embeddings,
        "type_vocab_size": config.type_vocab_size,
        "hidden_act": OUR_TO_HF_ACTIVATION[config.hidden_act],
        "layer_norm_eps": config.layer_norm_eps, "hidden_dropout_prob": config.hidden_dropout,
        "attention_probs_dropout_prob": config.attention_dropout,
        "initializer_range": config.initializer_range, "pad_token_id": 0,
        "tie_word_embeddings": True,
    }


@dataclasses.dataclass(frozen=True)
class Converter:
    """How one model family maps to HF: its model class, config mapping and tensor table.
    `prefix` is the base-model prefix HF drops in bare-model checkpoints (`bert.`)."""

    method: str
    model_class: type
    config_from_hf: Callable[[dict[str, Any]], dict[str, Any]]
    config_to_hf: Callable[[Any], dict[str, Any]]
    tensors: Callable[[], list[Tensor]]
    prefix: str
    # HF names that may be absent because they are tied to another tensor.
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)


CONVERTERS: dict[str, Converter] = {
    "bert": Converter(
        method="bert", model_class=Bert, config_from_hf=_bert_config_from_hf,
        config_to_hf=_bert_config_to_hf, tensors=_bert_tensors, prefix="bert.",
        aliases={"cls.predictions.bias": "cls.predictions.decoder.bias"},
    ),
}


def _converter_for(model: nnx.Module) -> tuple[str, Converter]:
    for model_type, converter in CONVERTERS.items():
        if isinstance(model, converter.model_class):
            return model_type, converter
    raise UserError(f"no HuggingFace conversion for {type(model).__name__}; supported: "
                    f"{sorted(CONVERTERS)}")


def method_name(model: nnx.Module) -> str:
    """The registry method a converted model belongs to (for pretext model directories)."""
    return _converter_for(model)[1].method


def _read_state_dict(path: Path) -> dict[str, np.ndarray]:
    safetensors_file, torch_file = path / "model.safetensors", path / "pytorch_model.bin"
    if safetensors_file.is_file():
        from safetensors.numpy import load_file

        return load_file(str(safetensors_file))
    if torch_file.is_file():
        try:
            import torch
        except ImportError:
            raise UserError(f"{torch_file} needs torch to read; install torch or convert the "
                            "checkpoint to model.safetensors") from None
        state = torch.load(torch_file, map_location="cpu", weights_only=True)
        return {k: v.float().numpy() for k, v in state.items()}
    raise UserError(f"{path} has no model.safetensors or pytorch_model.bin; pass a "
                    "HuggingFace checkpoint folder")


def _params_by_path(model: nnx.Module) -> dict[str, nnx.Variable]:
    params = nnx.state(model, nnx.Param)
    return {".".join(str(k) for k in path): variable
            for path, variable in nnx.to_flat_state(params)}


def load(path: str | Path, **config_overrides: Any) -> nnx.Module:
    """A HuggingFace folder (config.json + model.safetensors or pytorch_model.bin) -> our model.

    `config_overrides` set fields of our config that HF does not have (dtype, scan_layers,
    remat). Checkpoints of the bare model (no `bert.` prefix, no pre-training heads) load the
    encoder and pooler; the missing heads keep their initial values, with a warning.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UserError(f"{path} has no config.json; pass a HuggingFace checkpoint folder")
    hf_config = json.loads(config_file.read_text())
    model_type = hf_config.get("model_type")
    if model_type not in CONVERTERS:
        raise UserError(f"model_type {model_type!r} in {config_file} is not supported; "
                        f"supported: {sorted(CONVERTERS)}")
    converter = CONVERTERS[model_type]
    config = EncoderConfig(**{**converter.config_from_hf(hf_config), **config_overrides})
    state = _read_state_dict(path)
    if not any(k.startswith(converter.prefix) for k in state):
        state = {converter.prefix + k: v for k, v in state.items()}
    for name, alias in converter.aliases.items():
        if name not in state and alias in state:
            state[name] = state[alias]
    model = converter.model_class(config, rngs=nnx.Rngs(0))
    params = _params_by_path(model)
    missing = []
    for tensor in converter.tensors():
        layers = config.num_layers if tensor.stacked else 1
        names = [tensor.hf.format(i=i) for i in range(layers)]
        if any(name not in state for name in names):
            missing.append(tensor.hf)
            continue
        values = [state[name].T if tensor.transpose else state[name] for name in names]
        value = np.stack(values) if tensor.stacked else values[0]
        variable = params[tensor.ours]
        if value.shape != variable.get_value().shape:
            raise UserError(f"{names[0]} has shape {value.shape}, expected "
                            f"{variable.get_value().shape[tensor.stacked:]} from config.json; "
                            "the weights do not match the config")
        variable.set_value(np.asarray(value, np.float32))
    encoder_missing = [m for m in missing if m.startswith(converter.prefix)]
    if encoder_missing:
        raise UserError(f"{path} lacks {encoder_missing[0]} (and {len(encoder_missing) - 1} "
                        "more encoder tensors); the checkpoint is not a complete "
                        f"{model_type} model")
    if missing:
        warnings.warn(f"{path} has no {', '.join(sorted(missing))}; those heads keep their "
                      "initial values", stacklevel=2)
    return model


def to_state_dict(model: nnx.Module) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(HF config dict, HF state dict of float32 numpy arrays) for our model."""
    _, converter = _converter_for(model)
    params = _params_by_path(model)
    state = {}
    for tensor in converter.tensors():
        value = np.asarray(params[tensor.ours].get_value(), np.float32)
        slices = list(value) if tensor.stacked else [value]
        for i, one in enumerate(slices):
            state[tensor.hf.format(i=i)] = np.ascontiguousarray(one.T if tensor.transpose
                                                                else one)
    return converter.config_to_hf(model.config), state


def save(model: nnx.Module, path: str | Path) -> Path:
    """Writes `config.json` + `model.safetensors` that transformers loads (e.g.
    `BertForPreTraining.from_pretrained(path)`). Refuses a non-empty folder that is not a HF
    checkpoint; writes into a temporary sibling and renames, so no half checkpoint remains."""
    from safetensors.numpy import save_file

    path = Path(path)
    if path.exists() and any(path.iterdir()) and not (path / "config.json").is_file():
        raise UserError(f"{path} is a non-empty folder that is not a HuggingFace checkpoint; "
                        "choose a new output directory")
    config, state = to_state_dict(model)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return path
