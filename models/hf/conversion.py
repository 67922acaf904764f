"""The HuggingFace conversion core: name tables between our parameters and HF state dicts, and
the registry of model families' tables. Pure name and array mapping (numpy): no files, no torch;
`pretrain.hf` reads and writes checkpoint folders with it.

A `Converter` is a config mapping (HF config dict <-> our config) plus a table of `Tensor`s (one
HF tensor name <-> one of our parameter paths). Import and export both walk that table, so the
two directions cannot drift apart. Torch Linear weights are [out, in] (ours [in, out]); our
layers are stacked on a leading axis, HF's are numbered (`encoder.layer.{i}`).

Each model family keeps its table in `models/hf/<family>.py`, which calls `register`;
`models.hf.tables` imports them. Which method a converted model belongs to, and which methods'
models join several HF models, the methods declare (`objectives.registry.Start`).
`to_hf` / `from_hf` convert in memory, choosing the table by our model's class or by
`config.json`'s `model_type` and `architectures`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError

# HF `hidden_act` (transformers activations.py ACT2FN) -> ours (models.layers.ACTIVATIONS).
# `gelu` is the exact erf GELU; `gelu_new`, `gelu_pytorch_tanh` and `gelu_fast` are the tanh
# approximation (the original TensorFlow code's).
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
    is (2, 3, 1, 0)). `shared_layers` > 0 marks one parameter of ours that HF stores once per
    layer (e.g. attention biases that our config shares across layers): it is written to every
    layer and read back only if all copies agree.
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


def masked_lm_head(dense: str, norm: str, bias: str) -> list[Tensor]:
    """A HF masked-LM head (its transform's `dense` and LayerNorm `norm`, and the output `bias`;
    the decoder weight is tied to the word embeddings) <-> our `MaskedLMHead` at `lm_head`."""
    return [*linear(dense, "lm_head.dense"), *layer_norm(norm, "lm_head.layer_norm"),
            Tensor(bias, "lm_head.bias")]


def parameters(model: nnx.Module, tensors: tuple[Tensor, ...]) -> dict[str, nnx.Variable]:
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

    - `model_class`: our model class.
    - `model_type`: HF's `model_type` in `config.json`.
    - `config_from_hf(hf_config, **overrides)` -> our config; `config_to_hf(config)` -> the HF
      config dict (with `model_type` and `architectures`).
    - `architectures`: the HF classes this converter reads and writes (the first is written);
      a `model_type` with several converters (e.g. the parts of a joint model) picks by
      `config.json`'s `architectures`, falling back to its first converter.
    - `marker`: a `config.json` key that this converter's `config_to_hf` writes and that
      selects it on import before `architectures` do, for a model of ours written as another
      model's HF class (UniLM's prefix LM as a `BertForMaskedLM` with its `prefix_lm` settings,
      which must not take over BERT checkpoints of that class); "" for none.
    - `tensors(config)`: the name table for a model of that config, in the HF names of the
      pre-training class (`*ForPreTraining`, `*ForMaskedLM`, ...), i.e. with the base-model
      `prefix` (HF `base_model_prefix` + "."). Checkpoints of the bare base model (`*Model`)
      store names without it.
    - `optional`: HF name prefixes that a checkpoint may lack (pooler, pre-training heads); those
      parameters keep their initial values, with a warning. Anything else missing is an error.
    - `base_architecture`: HF's bare base-model class (`BertModel`), the form `to_hf` writes
      when every tensor outside `prefix` is left out (none was trained); "" for none.
    - `tied`: HF's `_tied_weights_keys` (copy -> source). HF saves only the source; old
      checkpoints may hold the copy instead, or both.
    - `ignored`: HF names that carry no parameter (buffers such as `position_ids`).
    - `buffers(config)`: HF tensors without a parameter of ours that `save` writes anyway so
      that transformers finds every key (BatchNorm's `num_batches_tracked`).
    - `accepts(config)`: whether a model of `model_class` with this config is this converter's
      (one class, several HF layouts: e.g. a classifier with one of several families' heads).
    - `refuses(model)`: why a model of `model_class` has no form in the HF class (a head HF's
      class cannot hold), or None; `to_hf` raises it as a `UserError`.
    - `unheld`: our parameter paths that HF's classes have no place for (HuBERT's pre-training
      head: HF has no `HubertForPreTraining`): `to_hf` always leaves them out, so the export
      is the bare base model; a HF checkpoint never has them (their HF names are `optional`).
    """

    model_type: str
    model_class: type[nnx.Module]
    architectures: tuple[str, ...]
    config_from_hf: Callable[..., Any]
    config_to_hf: Callable[[Any], dict[str, Any]]
    tensors: Callable[[Any], tuple[Tensor, ...]]
    prefix: str
    optional: tuple[str, ...] = ()
    base_architecture: str = ""
    tied: Mapping[str, str] = dataclasses.field(default_factory=dict)
    ignored: tuple[str, ...] = ()
    buffers: Callable[[Any], dict[str, np.ndarray]] = lambda config: {}
    accepts: Callable[[Any], bool] = lambda config: True
    refuses: Callable[[nnx.Module], str | None] = lambda model: None
    unheld: tuple[str, ...] = ()
    marker: str = ""

    def params_to_hf(self, model: nnx.Module,
                     leave_out: Collection[str] = ()) -> dict[str, np.ndarray]:
        """Our parameters -> a flat HF state dict of contiguous float32 numpy arrays, without
        those at the paths `leave_out`."""
        tensors = self.tensors(model.config)
        params, state = parameters(model, tensors), {}
        for tensor in tensors:
            if tensor.ours in leave_out:
                continue
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
        params, used = parameters(model, tensors), set()
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
                            f"missing); pass a complete {self.model_type} checkpoint")
        unused = sorted(n for n in state if n not in used and not n.endswith(self.ignored))
        if unused:
            warnings.warn(f"{source}: ignoring {len(unused)} tensors that "
                          f"{self.model_class.__name__} has no place for: "
                          f"{', '.join(unused[:5])}{', ...' if len(unused) > 5 else ''}",
                          stacklevel=4)
        return missing

    def part_names(self, hf_names: Collection[str]) -> list[str]:
        """The parts (`optional` prefixes, without the dot) that these HF tensor names fall
        under, for messages; a name under none is itself."""
        return sorted({next((p.rstrip(".") for p in self.optional if name.startswith(p)), name)
                       for name in hf_names})

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


# --- The registry ----------------------------------------------------------------------------

_CONVERTERS: dict[str, Converter] = {}
def register(name: str, converter: Converter) -> Converter:
    """Adds a family's converter under `name`. Among converters of one `model_type`, the first
    registered is the one a `config.json` without a known architecture gets."""
    if name in _CONVERTERS:
        raise ValueError(f"a HuggingFace converter {name!r} is already registered")
    _CONVERTERS[name] = converter
    return converter


def converters() -> dict[str, Converter]:
    """The registered converters by name."""
    return dict(_CONVERTERS)


# --- In memory -------------------------------------------------------------------------------

def converter_for(model: nnx.Module) -> Converter:
    """The converter of one of our models (by class, that of the model's own class before a
    base class's, and where a class has several HF layouts, by `accepts`)."""
    matches = [converter for converter in _CONVERTERS.values()
               if isinstance(model, converter.model_class) and converter.accepts(model.config)]
    exact = [converter for converter in matches if type(model) is converter.model_class]
    if exact or matches:
        return (exact or matches)[0]
    raise UserError(f"no HuggingFace conversion for {type(model).__name__}; supported: "
                    f"{sorted(_CONVERTERS)}")


def parts(model: nnx.Module) -> dict[str, nnx.Module] | None:
    """The stand-alone models a joint pre-training model is made of (its `parts()`, e.g. a
    generator and a discriminator), or None for a single model."""
    return model.parts() if hasattr(model, "parts") else None


def part_paths(model: nnx.Module) -> dict[str, dict[str, str]]:
    """Each part of `model` (`parts`; "" for a single model) -> its parameter paths -> the same
    parameter's path in `model` (a parameter two parts share has one)."""
    def flat(module: nnx.Module) -> dict[str, nnx.Variable]:
        state = nnx.state(module, (nnx.Param, nnx.BatchStat))
        return {".".join(str(k) for k in path): v for path, v in nnx.to_flat_state(state)}

    in_model = {id(variable): path for path, variable in flat(model).items()}
    return {name: {path: in_model[id(variable)] for path, variable in flat(part).items()}
            for name, part in (parts(model) or {"": model}).items()}


def to_hf(model: nnx.Module, leave_out: Collection[str] = ()
          ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Our model -> (HF config dict, flat HF state dict of float32 numpy arrays), without the
    parameters at the paths `leave_out` (never trained: transformers reports them missing). A
    model whose tensors outside the base model are all left out is written as the bare base
    model (`Converter.base_architecture`, its tensors without `prefix`) where HF has one."""
    converter = converter_for(model)
    reason = converter.refuses(model)
    if reason is not None:
        raise UserError(reason)
    config = converter.config_to_hf(model.config)
    leave_out = {*leave_out, *converter.unheld}
    state = converter.params_to_hf(model, leave_out)
    if (leave_out and converter.base_architecture and converter.prefix
            and all(name.startswith(converter.prefix) for name in state)):
        config["architectures"] = [converter.base_architecture]
        state = {name.removeprefix(converter.prefix): value for name, value in state.items()}
    return config, state


def converter_and_config(hf_config: Mapping[str, Any], source: str,
                         overrides: Mapping[str, Any]) -> tuple[Converter, Any]:
    """The converter of a HF config dict (by `model_type`, then `architectures`) and our
    config from it with `overrides`; problems are a `UserError` naming `source`."""
    model_type = hf_config.get("model_type")
    if model_type is None:
        raise UserError(f"{source}: config.json has no model_type, so it is not a HuggingFace "
                        "config; pass a transformers checkpoint folder")
    candidates = [c for c in _CONVERTERS.values() if c.model_type == model_type]
    if not candidates:
        raise UserError(f"{source}: model_type {model_type!r} is not supported; convert one "
                        f"of {sorted({c.model_type for c in _CONVERTERS.values()})}")
    architecture = (hf_config.get("architectures") or [""])[0]
    unmarked = [c for c in candidates if not c.marker]
    converter = next((c for c in candidates if c.marker and c.marker in hf_config), None) or next(
        (c for c in unmarked if architecture in c.architectures), unmarked[0])
    try:
        return converter, converter.config_from_hf(hf_config, **overrides)
    except KeyError as e:
        raise UserError(f"{source}: config.json lacks {e}; add it") from None
    except (TypeError, ValueError) as e:
        raise UserError(f"{source}: invalid config ({e}); fix config.json or the overrides "
                        f"{sorted(overrides)}") from None


def build(converter: Converter, config: Any, state: Mapping[str, np.ndarray],
          source: str) -> tuple[nnx.Module, list[str]]:
    """Our model of `config` with the weights of a flat HF state dict, and the paths of the
    parameters the state lacks (`optional` ones), which keep their initial values, with a
    warning naming them."""

    def init() -> nnx.Module:
        return converter.model_class(config, rngs=nnx.Rngs(0))

    model = nnx.eval_shape(init)  # shapes and sharding metadata, no initialisation
    # State outside the table (wav2vec 2.0's update counter) takes its initial value; under
    # jit, XLA drops the unused random initialisation of the parameters.
    untabled = nnx.Not((nnx.Param, nnx.BatchStat))
    if jax.tree.leaves(nnx.state(model, untabled)):
        nnx.update(model, jax.jit(lambda: nnx.state(init(), untabled))())
    missing = converter.params_from_hf(model, state, source)
    if missing:
        tensors = converter.tensors(config)
        initial, params = parameters(init(), tensors), parameters(model, tensors)
        for tensor in missing:
            params[tensor.ours].set_value(initial[tensor.ours].get_value())
        absent = converter.part_names([t.hf for t in missing])
        warnings.warn(f"{source} has no {', '.join(absent)}; they keep their initial values "
                      "(fine for fine-tuning, not for evaluating them)", stacklevel=3)
    return model, [tensor.ours for tensor in missing]


def from_hf(hf_config: Mapping[str, Any], state: Mapping[str, np.ndarray],
            source: str = "the checkpoint", **config_overrides: Any) -> nnx.Module:
    """(HF config dict, flat HF state dict of numpy arrays) -> our model; see
    `pretrain.hf.load`. `source`
    names the checkpoint in messages."""
    converter, config = converter_and_config(hf_config, source, config_overrides)
    return build(converter, config, state, source)[0]
