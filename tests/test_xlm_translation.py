"""XLM's translation model (models/xlm.py `XLMTranslation`, Lample & Conneau 2019 §5.2): the
decoder equals a plain numpy computation of the reference's `TransformerModel(is_encoder=False)`
(causal self-attention, cross-attention + `layer_norm15`, feed-forward, post-LN, zeroed
padding); initialising from a pretrained XLM copies every pretrained parameter into both sides
and leaves only the cross-attention at its random init; the decoder is causal and the
cross-attention reads only the non-pad source positions."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import random_model

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


def flat(module: nnx.Module) -> dict[tuple, np.ndarray]:
    return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


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


# --------------------------------------------------------------- a numpy XLM decoder
def layer_norm(x, p, eps):
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def linear(x, p):
    return x @ p["kernel"] + p["bias"]


def multi_head(x, kv, q, k, v, o, allowed, heads):
    """Softmax(q k^T / sqrt(d)) v per head over the `allowed` [B, T, S] keys, then `o`."""
    b, t, h = x.shape
    split = lambda y: y.reshape(b, -1, heads, h // heads).transpose(0, 2, 1, 3)  # noqa: E731
    scores = split(linear(x, q)) @ split(linear(kv, k)).transpose(0, 1, 3, 2) / math.sqrt(
        h // heads)
    scores = np.where(allowed[:, None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return linear((weights @ split(linear(kv, v))).transpose(0, 2, 1, 3).reshape(b, t, h), o)


def numpy_decoder(params, config, ids, langs, encoded, source_mask):
    """The reference's decoder `fwd(causal=True, src_enc, src_len)` in numpy: (token + position
    + language) embeddings, LayerNorm, zero padding; per layer self-attention -> + -> LN1,
    encoder attention -> + -> LN15, FFN (GELU) -> + -> LN2, zero padding; then the tied
    prediction layer."""
    tree: dict = {}
    for path, value in params.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = np.asarray(value, np.float64)
    eps, heads = config.layer_norm_eps, config.num_heads
    mask = ids != config.pad_token_id
    length = ids.shape[1]
    x = (tree["word_embeddings"]["embedding"][ids]
         + tree["position_embeddings"]["embedding"][np.arange(length)][None]
         + tree["lang_embeddings"]["embedding"][langs])
    x = layer_norm(x, tree["embedding_layer_norm"], eps) * mask[..., None]
    causal = np.tril(np.ones((length, length), bool))[None] & mask[:, None, :]
    cross = np.broadcast_to(source_mask[:, None, :], (len(ids), length, source_mask.shape[1]))
    gelu = np.vectorize(lambda v: 0.5 * v * (1 + math.erf(v / math.sqrt(2))))
    for i in range(config.num_layers):
        p = jax.tree.map(lambda a, i=i: a[i], tree["layers"])
        x = layer_norm(x + multi_head(x, x, p["query"], p["key"], p["value"],
                                      p["attention_output"], causal, heads),
                       p["attention_layer_norm"], eps)
        x = layer_norm(x + multi_head(x, encoded, p["cross_query"], p["cross_key"],
                                      p["cross_value"], p["cross_output"], cross, heads),
                       p["cross_layer_norm"], eps)
        x = layer_norm(x + linear(gelu(linear(x, p["intermediate"])), p["output"]),
                       p["output_layer_norm"], eps) * mask[..., None]
    return x, x @ tree["word_embeddings"]["embedding"].T + tree["output_bias"]


def test_decoder_equals_a_numpy_computation_of_the_reference_decoder():
    model = random_model(
        XLMTranslation, XLMTranslationConfig(**dataclasses.asdict(CONFIG), eos_token_id=EOS), 3)
    source, source_mask, source_langs, target, target_langs = source_batch()
    target = target.at[1, 4:].set(PAD)  # a padded target row too
    encoded = model.encode(source, source_mask, language_ids=source_langs)
    hidden = model.decode(target, encoded, source_mask, language_ids=target_langs)
    expected_hidden, expected_logits = numpy_decoder(
        flat(model.decoder), model.config, np.asarray(target), np.asarray(target_langs),
        np.asarray(encoded, np.float64), np.asarray(source_mask))
    np.testing.assert_allclose(hidden, expected_hidden, atol=1e-5, rtol=0)
    np.testing.assert_allclose(model.logits(hidden), expected_logits, atol=1e-5, rtol=0)
    # The encoder is the pretrained XLM run bidirectionally (its parity with HF is tested).
    np.testing.assert_allclose(
        encoded, model.encoder(source, source_mask, langs=source_langs).hidden_states, atol=0)
    assert model.config.decoder_start_token_id == EOS and model.config.eos_token_id == EOS
    assert not model.encoder.config.causal and model.decoder.config.causal


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
