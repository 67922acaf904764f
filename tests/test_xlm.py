"""XLM: parity with HF `XLMWithLMHeadModel` (padded batches with language ids, bidirectional
and causal, learned and sinusoidal positions) through the HF import code, and the round trip
pretext -> HF folder -> pretext."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from parity_utils import (
    MASKED_POSITIONS,
    XLM_LM,
    assert_close,
    assert_gathered,
    converted,
    perturbed,
    random_model,
)

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


@pytest.mark.usefixtures("deterministic_torch")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parity_with_hf_xlm_with_lm_head(variant, tmp_path):
    config = {**HF_CONFIG, **VARIANTS[variant]}
    reference = XLM_LM.reference(len(variant), **config)
    model = converted(reference, tmp_path)
    assert isinstance(model, XLM) and model.lang_embeddings is not None
    assert model.config.causal == config.get("causal", False)
    assert (model.position_embeddings is None) == config.get("sinusoidal_embeddings", False)
    if model.position_embeddings is None:  # our table is HF's `create_sinusoidal_embeddings`
        np.testing.assert_allclose(sinusoidal_positions(40, 32),
                                   reference.transformer.position_embeddings.weight.detach(),
                                   atol=1e-7, rtol=0)
    ids, mask, langs = xlm_batch(config["vocab_size"], len(variant))
    expected = XLM_LM.assert_parity(model, reference, ids, mask, langs)
    # TLM restarts the positions for the translation: explicit position ids agree too.
    positions = np.concatenate([np.arange(9), np.arange(8)])[None].repeat(3, 0)
    XLM_LM.assert_parity(model, reference, ids, mask, langs, positions)
    gathered = model(jnp.asarray(ids), jnp.asarray(mask), langs=jnp.asarray(langs),
                     masked_positions=jnp.asarray(MASKED_POSITIONS)).logits
    assert_gathered(gathered, expected["logits"])
    # Without a mask, padding is where the ids are the padding id (HF's lengths).
    default = model(jnp.asarray(ids), langs=jnp.asarray(langs))
    np.testing.assert_allclose(default.logits, expected["logits"], atol=1e-5, rtol=0)
    looped = hf.load(tmp_path, scan_layers=False, remat="full")
    assert_close(XLM_LM.our_outputs(looped, ids, mask, langs), expected)


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
    ours = random_model(XLM, config, 0)
    reloaded, hf_config = XLM_LM.round_trip(ours, tmp_path / "exported", *xlm_batch(50, 4))
    assert hf_config["n_langs"] == 2 and reloaded.config.causal == config.causal


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
    XLM_LM.assert_parity(model, reference, ids, mask, langs)
    saved = json.loads((tmp_path / "trained" / "config.json").read_text())
    (tmp_path / "trained" / "config.json").write_text(json.dumps({**saved, "asm": True}))
    with pytest.raises(UserError, match="adaptive softmax"):
        hf.load(tmp_path / "trained")
    with pytest.raises(ValueError, match="intermediate_size=128"):
        XLMConfig(hidden_size=32, num_heads=4, intermediate_size=64)
