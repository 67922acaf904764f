"""XLM's translation model (models/xlm.py `XLMTranslation`, Lample & Conneau 2019 §5.2): the
decoder equals a plain numpy computation of the reference's `TransformerModel(is_encoder=False)`
(causal self-attention, cross-attention + `layer_norm15`, feed-forward, post-LN, zeroed
padding), also with explicit decoder positions and one cross-attention output per language;
initialising from a pretrained XLM copies every pretrained parameter into both sides and leaves
only the cross-attention at its random init; the decoder is causal and the cross-attention reads
only the non-pad source positions."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import random_model
from xlm_numpy import flat, numpy_xlm

from pretext_jax.errors import UserError
from pretext_jax.models.hf.xlm import config_to_hf
from pretext_jax.models.xlm import (
    XLM,
    XLMConfig,
    XLMTranslation,
    XLMTranslationConfig,
    translation_from_pretrained,
)

PAD, EOS = 2, 1
CONFIG = XLMConfig(vocab_size=40, hidden_size=16, num_layers=2, num_heads=2,
                   intermediate_size=64, max_position_embeddings=32, n_langs=3,
                   embed_init_std=0.25, layer_norm_eps=1e-6, pad_token_id=PAD)


def pretrained() -> XLM:
    """A 'pretrained' XLM: random parameters (biases and norms too, so copies are visible)."""
    return random_model(XLM, CONFIG, 7)


def source_batch(seed: int = 0):
    """Source ids [2, 7] (row 1 right-padded after 4 tokens), its mask and language 0, target
    ids [2, 6] starting with </s>, language 1."""
    rng = np.random.default_rng(seed)
    source = rng.integers(4, 40, (2, 7))
    source[1, 4:] = PAD
    target = rng.integers(4, 40, (2, 6))
    target[:, 0] = EOS
    return (jnp.asarray(source), jnp.asarray(source != PAD), jnp.zeros((2, 7), jnp.int32),
            jnp.asarray(target), jnp.ones((2, 6), jnp.int32))


def test_decoder_equals_a_numpy_computation_of_the_reference_decoder():
    model = random_model(
        XLMTranslation, XLMTranslationConfig(**dataclasses.asdict(CONFIG), eos_token_id=EOS), 3)
    source, source_mask, source_langs, target, target_langs = source_batch()
    target = target.at[1, 4:].set(PAD)  # a padded target row too
    encoded = model.encode(source, source_mask, language_ids=source_langs)
    hidden = model.decode(target, encoded, source_mask, language_ids=target_langs)
    expected_hidden, expected_logits = numpy_xlm(
        flat(model.decoder), model.config, np.asarray(target), np.asarray(target_langs),
        np.asarray(target != PAD), causal=True, encoded=np.asarray(encoded, np.float64),
        source_mask=np.asarray(source_mask))
    np.testing.assert_allclose(hidden, expected_hidden, atol=1e-5, rtol=0)
    np.testing.assert_allclose(model.logits(hidden), expected_logits, atol=1e-5, rtol=0)
    # The encoder is the pretrained XLM run bidirectionally (its parity with HF is tested).
    np.testing.assert_allclose(
        encoded, model.encoder(source, source_mask, langs=source_langs).hidden_states, atol=0)
    assert model.config.decoder_start_token_id == EOS and model.config.eos_token_id == EOS
    assert not model.encoder.config.causal and model.decoder.config.causal


def test_decoder_positions_and_per_language_cross_outputs_equal_the_numpy_decoder():
    """`position_ids` and `cross_output_per_language` (three languages, three output blocks):
    each row's cross-attention output is its language's (rows of languages 2 and 1 in one
    batch); another language's block or the default positions give other states."""
    config = XLMTranslationConfig(**{**dataclasses.asdict(CONFIG),
                                     "cross_output_per_language": True}, eos_token_id=EOS)
    model = random_model(XLMTranslation, config, 4)
    assert model.decoder.layers.cross_output.kernel.shape == (2, 16, 48)
    source, source_mask, source_langs, target, _ = source_batch(2)
    target_langs = jnp.asarray([[2] * 6, [1] * 6])
    positions = jnp.asarray([[3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6]])
    encoded = model.encode(source, source_mask, language_ids=source_langs)
    hidden = model.decode(target, encoded, source_mask, language_ids=target_langs,
                          position_ids=positions)

    def expected(languages, positions):
        return numpy_xlm(flat(model.decoder), config, np.asarray(target),
                         np.asarray(target_langs), np.ones(target.shape, bool), causal=True,
                         positions=np.asarray(positions), encoded=np.asarray(encoded, np.float64),
                         source_mask=np.asarray(source_mask), cross_output_language=languages)[0]

    np.testing.assert_allclose(hidden, expected([2, 1], positions), atol=1e-5, rtol=0)
    assert np.abs(hidden - expected([0, 1], positions)).max() > 1e-2
    assert np.abs(hidden - expected([2, 1], np.arange(6)[None])).max() > 1e-2
    with pytest.raises(ValueError, match="needs langs"):
        model.decode(target, encoded, source_mask)


def test_initialisation_copies_the_pretrained_xlm_into_both_sides_but_not_cross_attention():
    source_model = pretrained()
    model = translation_from_pretrained(source_model, EOS, seed=5, hidden_dropout=0.1)
    fresh = XLMTranslation(model.config, rngs=nnx.Rngs(5))
    assert model.config.hidden_dropout == 0.1 and model.config.n_langs == 3
    weights = flat(source_model)
    for side in ("encoder", "decoder"):
        ours, random = flat(getattr(model, side)), flat(getattr(fresh, side))
        for key, value in weights.items():  # every pretrained parameter, exactly
            np.testing.assert_array_equal(ours[key], value, err_msg=f"{side} {key}")
        rest = sorted(key for key in ours if key not in weights)
        # Only the decoder's cross-attention is new, and it keeps the seed's random init.
        assert all(key[1].startswith("cross_") for key in rest) and (
            len(rest) == (10 if side == "decoder" else 0)), rest
        for key in rest:
            np.testing.assert_array_equal(ours[key], random[key], err_msg=key)
    # The copies are values: training one side leaves the pretrained model and the other alone.
    model.decoder.word_embeddings.embedding[...] = 0.0
    assert np.abs(flat(model.encoder)[("word_embeddings", "embedding")]).max() > 0
    assert np.abs(flat(source_model)[("word_embeddings", "embedding")]).max() > 0
    # A causal (CLM) XLM initialises too; its encoder is bidirectional.
    clm = XLM(dataclasses.replace(CONFIG, causal=True), rngs=nnx.Rngs(1))
    assert not translation_from_pretrained(clm, EOS).encoder.config.causal
    with pytest.raises(UserError, match="keep the shapes"):
        translation_from_pretrained(source_model, EOS, hidden_size=32, intermediate_size=128)


def test_decoder_is_causal_and_cross_attention_reads_only_real_source_tokens():
    model = translation_from_pretrained(pretrained(), EOS, seed=1)
    source, source_mask, source_langs, target, target_langs = source_batch(1)
    encoded = model.encode(source, source_mask, language_ids=source_langs)
    decode = lambda t, e: np.asarray(  # noqa: E731
        model.decode(t, e, source_mask, language_ids=target_langs))
    hidden = decode(target, encoded)
    # Later target tokens never change an earlier position's output; an earlier token does.
    for position in range(1, 6):
        changed = decode(target.at[:, position].set((target[:, position] + 1) % 36 + 4),
                         encoded)
        np.testing.assert_allclose(changed[:, :position], hidden[:, :position], atol=1e-6)
        assert np.abs(changed[:, position:] - hidden[:, position:]).max() > 1e-3
    # Encoder states at the padded source positions (row 1, 4:) are never read.
    noise = jnp.asarray(np.random.default_rng(0).normal(size=encoded.shape), encoded.dtype)
    padded = ~source_mask[..., None]
    np.testing.assert_allclose(decode(target, jnp.where(padded, noise, encoded)), hidden,
                               atol=1e-6)
    assert np.abs(decode(target, jnp.where(padded, encoded, noise)) - hidden).max() > 1e-3
    # ... and so the encoder's padded tokens change nothing either.
    other = source.at[1, 4:].set(7)
    np.testing.assert_allclose(
        decode(target, model.encode(other, source_mask, language_ids=source_langs)), hidden,
        atol=1e-6)
    # Dropout runs with an rng (training) and the decoder's language embedding is used.
    assert model.decode(target, encoded, source_mask, rng=jax.random.key(0),
                        language_ids=target_langs).shape == (2, 6, 16)
    assert np.abs(decode(target, encoded) - np.asarray(model.decode(
        target, encoded, source_mask, language_ids=0 * target_langs))).max() > 1e-3


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="causal=True"):
        dataclasses.replace(CONFIG, is_decoder=True)
    with pytest.raises(ValueError, match="per side"):
        XLMTranslationConfig(**{**dataclasses.asdict(CONFIG), "causal": True})
    decoder = XLM(dataclasses.replace(CONFIG, causal=True, is_decoder=True), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="encoded and encoder_mask"):
        decoder(jnp.ones((1, 3), jnp.int32))
    with pytest.raises(UserError, match="no decoder"):
        config_to_hf(decoder.config)
