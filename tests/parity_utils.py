"""Helpers shared by the HF parity tests: inputs, perturbed HF models, parameter comparison."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx


def padded_inputs(vocab_size: int, type_vocab_size: int, seed: int = 0):
    """[3, 17] ids with padding at the end of two rows and non-trivial token types."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, size=(3, 17))
    types = rng.integers(0, type_vocab_size, size=(3, 17))
    mask = np.ones((3, 17), np.int64)
    mask[1, 11:] = 0
    mask[2, 5:] = 0
    return ids, types, mask


def perturbed(model, seed: int):
    """`model` in eval mode with every tensor moved off HF's init (which zeroes biases and sets
    LayerNorms to identity), so a swapped or untransposed tensor shows up in the outputs."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
    return model.eval()


def torch_forward(model, ids, types, mask, **kwargs):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), token_type_ids=torch.tensor(types),
                     attention_mask=torch.tensor(mask), **kwargs)


def random_params(model: nnx.Module, seed: int) -> nnx.Module:
    """Sets every parameter of `model` (e.g. from `nnx.eval_shape`) to N(0, 0.2^2) values."""
    rng = np.random.default_rng(seed)
    for _, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = variable.get_value().shape
        variable.set_value(jnp.asarray(0.2 * rng.standard_normal(shape), jnp.float32))
    return model


def assert_same_params(a: nnx.Module, b: nnx.Module) -> None:
    flat_a = nnx.to_flat_state(nnx.state(a, nnx.Param))
    flat_b = dict(nnx.to_flat_state(nnx.state(b, nnx.Param)))
    assert len(flat_a) == len(flat_b)
    for path, variable in flat_a:
        np.testing.assert_array_equal(variable.get_value(), flat_b[path].get_value(),
                                      err_msg=str(path))


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
