"""Model details not covered by the HF parity tests: both attention paths agree, bfloat16
compute stays close to float32 with float32 parameters, dropout is active only with an RNG."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pretext_jax.models.bert import Bert
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.models.layers import attention

SMALL = dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
             max_position_embeddings=32)


def test_einsum_attention_equals_dot_product_attention():
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (2, 7, 4, 8)) for key in keys)
    mask = jnp.asarray([[1] * 7, [1] * 4 + [0] * 3], bool)[:, None, None, :]
    fused = attention(q, k, v, mask, 0.0, None)
    # A dropout rate so small that nothing is dropped takes the explicit einsum path.
    explicit = attention(q, k, v, mask, 1e-12, jax.random.key(1))
    np.testing.assert_allclose(explicit, fused, atol=1e-5)


def test_bfloat16_compute_with_float32_params():
    ids = jax.random.randint(jax.random.key(2), (2, 16), 0, 96)
    f32 = Bert(EncoderConfig(**SMALL), rngs=nnx.Rngs(0))
    bf16 = Bert(EncoderConfig(**SMALL, dtype="bfloat16"), rngs=nnx.Rngs(0))
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(bf16, nnx.Param)))
    out16, out32 = bf16(ids), f32(ids)
    assert out16.hidden_states.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out16.mlm_logits, np.float32),
                               np.asarray(out32.mlm_logits), atol=0.1)


def test_dropout_only_with_rng():
    model = Bert(EncoderConfig(**SMALL), rngs=nnx.Rngs(0))
    ids = jnp.arange(32).reshape(2, 16)
    a, b = model(ids).hidden_states, model(ids).hidden_states
    np.testing.assert_array_equal(a, b)
    c = model(ids, rng=jax.random.key(0)).hidden_states
    d = model(ids, rng=jax.random.key(0)).hidden_states
    e = model(ids, rng=jax.random.key(1)).hidden_states
    np.testing.assert_array_equal(c, d)
    assert not np.allclose(c, a) and not np.allclose(c, e)


def test_attention_implementation_is_checked():
    with pytest.raises(ValueError, match="'xla' or 'cudnn'"):
        EncoderConfig(attention_implementation="flash")
    with pytest.raises(ValueError, match="model.dtype=bfloat16"):
        EncoderConfig(attention_implementation="cudnn")
    assert EncoderConfig(attention_implementation="cudnn", dtype="bfloat16").dtype == "bfloat16"


def test_embedding_gradients_are_float32_and_small_tables_are_not_scattered():
    """In bfloat16 compute the embedding rows are gathered from the float32 table and then
    cast, so the gradient is a float32 scatter-add (a bfloat16 one took 63 ms of a 217 ms
    BERT-base step on an H200); the 2-row token-type table is read by a one-hot product, with
    no scatter at all. The rows are the ones `nnx.Embed` gives, exactly."""
    ids = jax.random.randint(jax.random.key(3), (2, 16), 0, 96)
    types = (jnp.arange(16) >= 9).astype(jnp.int32)[None].repeat(2, 0)
    model = Bert(EncoderConfig(**SMALL, dtype="bfloat16"), rngs=nnx.Rngs(0))
    embeddings = model.encoder.embeddings
    for table, inputs in ((embeddings.word_embeddings, ids),
                          (embeddings.token_type_embeddings, types)):
        plain = nnx.Embed(table.num_embeddings, table.features, dtype=jnp.bfloat16,
                          rngs=nnx.Rngs(0))
        plain.embedding.value = table.embedding.value
        np.testing.assert_array_equal(np.asarray(table(inputs), np.float32),
                                      np.asarray(plain(inputs), np.float32))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        out = nnx.merge(graphdef, params, rest)(ids, token_type_ids=types)
        return jnp.sum(out.mlm_logits.astype(jnp.float32) ** 2)

    program = jax.jit(jax.grad(loss)).lower(params).as_text(dialect="hlo")
    scatters = [line.split("=")[1].split()[0] for line in program.splitlines()
                if " scatter(" in line]
    assert scatters == ["f32[96,32]{1,0}"], scatters  # the word embeddings' gradient only
