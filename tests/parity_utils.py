"""The one harness of the HF parity tests.

A parity test builds a transformers model from a small config at random init, moved off HF's
init (`hf_reference`; float32, the test takes the `deterministic_torch` fixture), converts it
through the project's conversion code (`converted`: the folder `save_pretrained` writes, read by
`pretrain.hf.load`, which `--init` and `run.py convert` run too), runs both on the same inputs
(`Parity`) and compares every named output within `PARITY_ATOL` (`assert_close`). The way back,
`Parity.round_trip`: our random model (`random_model`) written by `pretrain.hf.save`, read by
transformers with every tensor placed, computing our outputs, and read back by
`pretrain.hf.load` as the same config and parameters (`assert_loads_back`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.pretrain import hf

PARITY_ATOL = 1e-5


def padded_inputs(vocab_size: int, type_vocab_size: int, seed: int = 0):
    """[3, 17] ids with padding at the end of two rows and non-trivial token types."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, size=(3, 17))
    types = rng.integers(0, type_vocab_size, size=(3, 17))
    mask = np.ones((3, 17), np.int64)
    mask[1, 11:] = 0
    mask[2, 5:] = 0
    return ids, types, mask


def family_inputs(family: str, vocab_size: int, seed: int = 0):
    """`padded_inputs` as a family's fine-tuning heads read them: token types 0/1 (BERT,
    ELECTRA, ALBERT), all 0 (RoBERTa's one type; MPNet has none), MPNet padded with HF's
    padding id 1 and no token 1 among the rest (HF finds MPNet's positions from the ids, ours
    from the mask)."""
    ids, types, mask = padded_inputs(vocab_size, 2, seed)
    if family in ("roberta", "mpnet"):
        types = np.zeros_like(types)
    if family == "mpnet":
        ids = np.where(mask == 1, np.where(ids == 1, 3, ids), 1)
    return ids, types, mask


def perturbed(model, seed: int, *, scale: float = 0.1):
    """`model` in eval mode with every tensor moved by N(0, scale^2) off HF's init (which
    zeroes biases and sets LayerNorms to identity), so a swapped or untransposed tensor shows up
    in the outputs."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return model.eval()


# Tensors that transformers computes from the config instead of learning them: the config field
# that asks for one, and the end of its name (XLM's sinusoidal position table).
COMPUTED_TENSORS = {"sinusoidal_embeddings": "transformer.position_embeddings.weight"}


def hf_reference(architecture: str, seed: int, /, *, scale: float = 0.1, **config: Any):
    """transformers' `architecture` (e.g. "BertForPreTraining") of its config class with
    `config`, initialised under torch seed `seed` and `perturbed` by it (`scale`), in eval mode.
    Output embeddings that `config` unties (transformers 5 ties them at init regardless) are
    untied first; `COMPUTED_TENSORS` keep their computed values."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model_class = getattr(transformers, architecture)
    model = model_class(model_class.config_class(**config))
    if not config.get("tie_word_embeddings", True):
        output = model.get_output_embeddings()
        output.weight = torch.nn.Parameter(output.weight.detach().clone())
    fixed = {name: p.detach().clone() for name, p in model.named_parameters()
             if any(config.get(field) and name.endswith(suffix)
                    for field, suffix in COMPUTED_TENSORS.items())}
    model = perturbed(model, seed, scale=scale)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in fixed:
                p.copy_(fixed[name])
    return model


def load_without_warnings(folder: Path, **overrides: Any) -> nnx.Module:
    """`pretrain.hf.load(folder, **overrides)`, which must not warn (as a complete checkpoint
    loads)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return hf.load(folder, **overrides)


def converted(reference, folder: Path, **overrides: Any) -> nnx.Module:
    """`reference` saved by `save_pretrained` into `folder` and read by `pretrain.hf.load`
    (with `overrides`) without any warning."""
    reference.save_pretrained(folder)
    return load_without_warnings(folder, **overrides)


def random_params(model: nnx.Module, seed: int) -> nnx.Module:
    """Sets every parameter of `model` (e.g. from `nnx.eval_shape`) to N(0, 0.2^2) values."""
    rng = np.random.default_rng(seed)
    for _, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = variable.get_value().shape
        variable.set_value(jnp.asarray(0.2 * rng.standard_normal(shape), jnp.float32))
    return model


def random_model(model_class: type[nnx.Module], config: Any, seed: int) -> nnx.Module:
    """`model_class(config)` with every parameter random (`random_params`) and its other state
    (BatchNorm statistics, counters) zero; shapes from `nnx.eval_shape`, no init cost."""
    model = random_params(nnx.eval_shape(lambda: model_class(config, rngs=nnx.Rngs(0))), seed)
    for _, variable in nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.Param))):
        shape = variable.get_value()
        variable.set_value(jnp.zeros(shape.shape, shape.dtype))
    return model


def assert_same_params(a: nnx.Module, b: nnx.Module) -> None:
    flat_a = nnx.to_flat_state(nnx.state(a, nnx.Param))
    flat_b = dict(nnx.to_flat_state(nnx.state(b, nnx.Param)))
    assert len(flat_a) == len(flat_b)
    for path, variable in flat_a:
        np.testing.assert_array_equal(variable.get_value(), flat_b[path].get_value(),
                                      err_msg=str(path))


def assert_loads_back(model: nnx.Module, folder: Path, **overrides: Any) -> nnx.Module:
    """`pretrain.hf.load(folder, **overrides)` reads `model`'s export back without any warning,
    with the same config and parameters; the model read."""
    back = load_without_warnings(folder, **overrides)
    assert back.config == model.config
    assert_same_params(back, model)
    return back


def assert_close(ours: Mapping[str, Any], theirs: Mapping[str, Any],
                 atol: float = PARITY_ATOL, *, rtol: float = 0.0) -> None:
    """The same named outputs on both sides, each within `atol` (+ `rtol` |theirs|)."""
    assert set(ours) == set(theirs), sorted(set(ours) ^ set(theirs))
    for name, expected in theirs.items():
        np.testing.assert_allclose(ours[name], expected, atol=atol, rtol=rtol, err_msg=name)


# Positions of a [3, 17] batch where a masked-LM head is read (`masked_positions`).
MASKED_POSITIONS = np.array([[1, 4, 9], [0, 2, 3], [7, 8, 16]])


def assert_gathered(logits: Any, full_logits: np.ndarray,
                    positions: np.ndarray = MASKED_POSITIONS) -> None:
    """A head's [B, P, V] `logits` at `positions` within `PARITY_ATOL` of the full [B, T, V]
    logits gathered there."""
    np.testing.assert_allclose(logits, np.take_along_axis(full_logits, positions[..., None], 1),
                               atol=PARITY_ATOL, rtol=0)


@functools.cache
def _jitted(forward: Callable[..., Any]) -> Callable[..., Any]:
    return nnx.jit(forward)


@dataclasses.dataclass(frozen=True)
class Parity:
    """How transformers' `architecture` and our model run side by side: `theirs(hf_model,
    *inputs)` (torch tensors, under `no_grad`) and `ours(model, *inputs)` (jax arrays, jitted)
    return the compared outputs by name. Inputs are numpy arrays, or trees of them (None
    passes as None). `rtol` adds a relative tolerance (deep convolutional nets, whose float32
    results differ by summation order at that level)."""

    architecture: str
    theirs: Callable[..., Mapping[str, Any]]
    ours: Callable[..., Mapping[str, Any]]
    rtol: float = 0.0

    def reference(self, seed: int, **config: Any):
        """`hf_reference` of this architecture."""
        return hf_reference(self.architecture, seed, **config)

    def hf_outputs(self, model, *inputs: Any) -> dict[str, np.ndarray]:
        import torch

        with torch.no_grad():
            out = self.theirs(model, *jax.tree.map(torch.as_tensor, inputs))
        return {name: value.numpy() for name, value in out.items()}

    def our_outputs(self, model: nnx.Module, *inputs: Any) -> dict[str, np.ndarray]:
        out = _jitted(self.ours)(model, *jax.tree.map(jnp.asarray, inputs))
        return {name: np.asarray(value) for name, value in out.items()}

    def assert_parity(self, model: nnx.Module, reference, *inputs: Any,
                      atol: float = PARITY_ATOL) -> dict[str, np.ndarray]:
        """Our outputs within `atol` of the reference's on `inputs`; the reference's."""
        expected = self.hf_outputs(reference, *inputs)
        assert_close(self.our_outputs(model, *inputs), expected, atol, rtol=self.rtol)
        return expected

    def round_trip(self, model: nnx.Module, folder: Path, *inputs: Any,
                   **overrides: Any) -> tuple[Any, dict[str, Any]]:
        """`model` exported by `pretrain.hf.save` into `folder` as this architecture, read by
        transformers with no missing, unexpected or mismatched tensor, computing our outputs
        on `inputs`, and read back by `pretrain.hf.load(folder, **overrides)` as `model`
        (`assert_loads_back`). (The transformers model in eval mode, the saved config.json.)"""
        import transformers

        hf.save(model, folder)
        saved = json.loads((folder / hf.CONFIG_FILE).read_text())
        assert saved["architectures"] == [self.architecture], saved["architectures"]
        reloaded, info = getattr(transformers, self.architecture).from_pretrained(
            folder, output_loading_info=True)
        assert not any(info.values()), info
        self.assert_parity(model, reloaded.eval(), *inputs)
        assert_loads_back(model, folder, **overrides)
        return reloaded, saved


# transformers' name of each sentence-pair head's logits: next sentence, sentence order
HF_PAIR_LOGITS = {"nsp": "seq_relationship_logits", "sop": "sop_logits"}


def _hf_encoder_pretraining(pair_head: str, model, ids, types, mask) -> dict[str, Any]:
    out = model(input_ids=ids, token_type_ids=types, attention_mask=mask,
                output_hidden_states=True)
    return {"hidden_states": out.hidden_states[-1], "mlm_logits": out.prediction_logits,
            f"{pair_head}_logits": getattr(out, HF_PAIR_LOGITS[pair_head])}


def _our_encoder_pretraining(pair_head: str, model, ids, types, mask) -> dict[str, Any]:
    out = model(ids, types, mask)
    return {"hidden_states": out.hidden_states, "mlm_logits": out.mlm_logits,
            f"{pair_head}_logits": getattr(out, f"{pair_head}_logits")}


def encoder_pretraining(architecture: str, pair_head: str = "nsp") -> Parity:
    """`Parity` of a BERT-style `*ForPreTraining` on (ids, token types, mask): the final hidden
    states, the masked-LM logits and the sentence-pair head's (`HF_PAIR_LOGITS`)."""
    return Parity(architecture, functools.partial(_hf_encoder_pretraining, pair_head),
                  functools.partial(_our_encoder_pretraining, pair_head))


def _hf_classifier(model, ids, types, mask) -> dict[str, Any]:
    return {"logits": model(input_ids=ids, token_type_ids=types, attention_mask=mask).logits}


def _hf_classifier_without_types(model, ids, types, mask) -> dict[str, Any]:
    # XLM: HF adds token type ids as word embeddings, XLM's reference has none; MPNet has none
    del types
    return {"logits": model(input_ids=ids, attention_mask=mask).logits}


def _our_classifier(model, ids, types, mask) -> dict[str, Any]:
    return {"logits": model(ids, types, mask)}


def classifier_parity(architecture: str) -> Parity:
    """`Parity` of HF's `architecture` (a `*ForSequenceClassification` or
    `*ForTokenClassification`) and our `SequenceClassifier` or `TokenClassifier` on (ids, token
    types, mask): the logits."""
    theirs = (_hf_classifier_without_types if architecture.startswith(("XLMFor", "MPNetFor"))
              else _hf_classifier)
    return Parity(architecture, theirs, _our_classifier)



def _hf_xlm_lm(model, ids, mask, langs, positions=None) -> dict[str, Any]:
    out = model(input_ids=ids, attention_mask=mask, langs=langs, position_ids=positions,
                output_hidden_states=True)
    return {"hidden_states": out.hidden_states[-1], "logits": out.logits}


def _our_xlm_lm(model, ids, mask, langs, positions=None) -> dict[str, Any]:
    out = model(ids, mask, langs=langs, position_ids=positions)
    return {"hidden_states": out.hidden_states, "logits": out.logits}


# HF's `XLMWithLMHeadModel` and our `XLM` on (ids, mask or None: padding where the ids are the
# padding id, language ids, position ids or None): every position, padding included.
XLM_LM = Parity("XLMWithLMHeadModel", _hf_xlm_lm, _our_xlm_lm)


def _hf_xlnet_lm(model, batch, mems=None) -> dict[str, Any]:
    import torch

    out = model(**batch, mems=None if mems is None else [m.transpose(0, 1) for m in mems],
                use_mems=True)
    return {"lm_logits": out.logits,
            "new_mems": torch.stack([m.transpose(0, 1) for m in out.mems])}


def _our_xlnet_lm(model, batch, mems=None) -> dict[str, Any]:
    out = model(**batch, mems=mems, use_mems=True)
    return {"lm_logits": out.lm_logits, "new_mems": out.new_mems}


# HF's `XLNetLMHeadModel` and our `XLNet` on (a batch of HF's input names, the memory or None):
# the logits and the next segment's memory, [layers, B, mem_len, d] on both sides (HF's own is
# a list of [mem_len, B, d]).
XLNET_LM = Parity("XLNetLMHeadModel", _hf_xlnet_lm, _our_xlnet_lm)


def xlnet_spiece(folder, sentences: list[str], vocab_size: int):
    """`folder/spiece.model`: a sentencepiece model laid out as a released XLNet vocabulary
    (<unk> 0, <s> 1, </s> 2, <cls> 3, <sep> 4, <pad> 5, <mask> 6, <eod> 7, <eop> 8), trained as
    the zihangdai/xlnet README's `spm_train` command does (those control and user-defined
    symbols, unigram)."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_prefix=str(folder / "spiece"),
        vocab_size=vocab_size, model_type="unigram",
        control_symbols=["<cls>", "<sep>", "<pad>", "<mask>", "<eod>"],
        user_defined_symbols=["<eop>"], num_threads=1, minloglevel=2, hard_vocab_limit=False)
    return folder / "spiece.model"
