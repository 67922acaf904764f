"""XLM: parity with HF `XLMWithLMHeadModel` (padded batches with language ids, bidirectional
and causal, learned and sinusoidal positions) through the HF import code, and the round trip
pretext -> HF folder -> pretext."""

from __future__ import annotations

import dataclasses
import json
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import assert_same_params, perturbed, random_params

from pretext_jax.errors import UserError
from pretext_jax.models.xlm import XLM, XLMConfig, sinusoidal_positions
from pretext_jax.pretrain import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PAD = 2  # XLM's dictionary: <s> 0, </s> 1, <pad> 2
HF_CONFIG = dict(vocab_size=61, emb_dim=32, n_layers=2, n_heads=4, max_position_embeddings=40,
                 n_langs=2, use_lang_emb=True, layer_norm_eps=1e-6, pad_token_id=PAD)
# HF variants: bidirectional (MLM/TLM), causal (CLM), and fixed sinusoidal positions with ReLU.
VARIANTS = {"mlm": {}, "clm": {"causal": True},
            "sinusoidal_relu": {"sinusoidal_embeddings": True, "gelu_activation": False}}


def hf_model(seed: int, **config):
    torch.manual_seed(seed)
    model = transformers.XLMWithLMHeadModel(transformers.XLMConfig(**config))
    positions = model.transformer.position_embeddings.weight.detach().clone()
    model = perturbed(model, seed)
    if config.get("sinusoidal_embeddings"):  # perturbed moved HF's fixed table too: restore it
        with torch.no_grad():
            model.transformer.position_embeddings.weight.copy_(positions)
    return model


def xlm_batch(vocab_size: int, seed: int):
    """[3, 17] ids (never the padding id among the tokens) right-padded with it, the mask, and
    language ids 0/1 (two languages in one row, as TLM's pairs)."""
    rng = np.random.default_rng(seed)
    mask = np.ones((3, 17), np.int64)
    mask[1, 11:] = 0
    mask[2, 5:] = 0
    ids = np.where(mask == 1, rng.integers(PAD + 1, vocab_size, (3, 17)), PAD)
    langs = rng.integers(0, 2, (3, 17))
    return ids, mask, langs


def hf_outputs(model, ids, mask, langs, positions=None):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    langs=torch.tensor(langs), output_hidden_states=True,
                    position_ids=None if positions is None else torch.tensor(positions))
    return out.hidden_states[-1].numpy(), out.logits.numpy()


@nnx.jit
def forward(model: XLM, ids, mask, langs, positions=None, masked_positions=None):
    return model(ids, mask, langs=langs, position_ids=positions, masked_positions=masked_positions)


def our_outputs(model, ids, mask, langs, positions=None):
    out = forward(model, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(langs),
                  None if positions is None else jnp.asarray(positions))
    return np.asarray(out.hidden_states), np.asarray(out.logits)


def assert_close(ours, theirs, atol=1e-5):
    """Every position, padding included (zeroed hidden states, bias-only logits in both)."""
    for name, a, b in zip(("hidden_states", "logits"), ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, atol=atol, rtol=0, err_msg=name)


@pytest.mark.usefixtures("deterministic_torch")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parity_with_hf_xlm_with_lm_head(variant, tmp_path):
    config = {**HF_CONFIG, **VARIANTS[variant]}
    reference = hf_model(len(variant), **config)
    reference.save_pretrained(tmp_path)
    ids, mask, langs = xlm_batch(config["vocab_size"], len(variant))
    expected = hf_outputs(reference, ids, mask, langs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a complete checkpoint loads without any warning
        model = hf.load(tmp_path)
    assert isinstance(model, XLM) and model.lang_embeddings is not None
    assert model.config.causal == config.get("causal", False)
    assert (model.position_embeddings is None) == config.get("sinusoidal_embeddings", False)
    if model.position_embeddings is None:  # our table is HF's `create_sinusoidal_embeddings`
        np.testing.assert_allclose(sinusoidal_positions(40, 32),
                                   reference.transformer.position_embeddings.weight.detach(),
                                   atol=1e-7, rtol=0)
    assert_close(our_outputs(model, ids, mask, langs), expected)
    # TLM restarts the positions for the translation: explicit position ids agree too.
    positions = np.concatenate([np.arange(9), np.arange(8)])[None].repeat(3, 0)
    assert_close(our_outputs(model, ids, mask, langs, positions),
                 hf_outputs(reference, ids, mask, langs, positions))
    picked = np.array([[1, 4, 9], [0, 2, 3], [7, 8, 16]])
    gathered = forward(model, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(langs),
                       masked_positions=jnp.asarray(picked)).logits
    np.testing.assert_allclose(gathered, np.take_along_axis(expected[1], picked[..., None], 1),
                               atol=1e-5, rtol=0)
    # Without a mask, padding is where the ids are the padding id (HF's lengths).
    default = model(jnp.asarray(ids), langs=jnp.asarray(langs))
    np.testing.assert_allclose(default.logits, expected[1], atol=1e-5, rtol=0)
    looped = hf.load(tmp_path, scan_layers=False, remat="full")
    assert_close(our_outputs(looped, ids, mask, langs), expected)


@pytest.mark.usefixtures("deterministic_torch")
@pytest.mark.parametrize("variant", ["mlm", "sinusoidal_relu_clm"])
def test_our_model_round_trips_through_transformers(variant, tmp_path):
    config = XLMConfig(vocab_size=50, hidden_size=24, num_layers=2, num_heads=3,
                       intermediate_size=96, max_position_embeddings=24, n_langs=2,
                       layer_norm_eps=1e-7, hidden_dropout=0.2, embed_init_std=0.1,
                       pad_token_id=PAD)
    if variant != "mlm":
        config = dataclasses.replace(config, sinusoidal_embeddings=True, hidden_act="relu",
                                     causal=True)
    ours = random_params(nnx.eval_shape(lambda: XLM(config, rngs=nnx.Rngs(0))), 0)
    hf.save(ours, tmp_path / "exported")
    hf_config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert hf_config["architectures"] == ["XLMWithLMHeadModel"] and hf_config["n_langs"] == 2
    reloaded, info = transformers.XLMWithLMHeadModel.from_pretrained(
        tmp_path / "exported", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    assert reloaded.config.causal == config.causal
    ids, mask, langs = xlm_batch(50, 4)
    assert_close(hf_outputs(reloaded.eval(), ids, mask, langs),
                 our_outputs(ours, ids, mask, langs))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = hf.load(tmp_path / "exported")
    assert back.config == ours.config
    assert_same_params(back, ours)


@pytest.mark.usefixtures("deterministic_torch")
def test_bad_checkpoints_and_configs_are_refused(tmp_path):
    config = {**HF_CONFIG, "sinusoidal_embeddings": True}
    torch.manual_seed(0)
    # The stored table of a sinusoidal model was trained away from the sinusoids: refused, and
    # it loads as learned positions, with HF's outputs.
    reference = perturbed(transformers.XLMWithLMHeadModel(transformers.XLMConfig(**config)), 0)
    reference.save_pretrained(tmp_path / "trained")
    with pytest.raises(UserError, match="sinusoidal_embeddings=False"):
        hf.load(tmp_path / "trained")
    model = hf.load(tmp_path / "trained", sinusoidal_embeddings=False)
    ids, mask, langs = xlm_batch(config["vocab_size"], 1)
    assert_close(our_outputs(model, ids, mask, langs), hf_outputs(reference, ids, mask, langs))
    saved = json.loads((tmp_path / "trained" / "config.json").read_text())
    (tmp_path / "trained" / "config.json").write_text(json.dumps({**saved, "asm": True}))
    with pytest.raises(UserError, match="adaptive softmax"):
        hf.load(tmp_path / "trained")
    with pytest.raises(ValueError, match="intermediate_size=128"):
        XLMConfig(hidden_size=32, num_heads=4, intermediate_size=64)
