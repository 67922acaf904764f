"""Model details not covered by the HF parity tests: both attention paths agree, bfloat16
compute stays close to float32 with float32 parameters, dropout is active only with an RNG,
the masked-LM head's gradients do not depend on the mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pretext_jax.models.bert import Bert
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.models.layers import attention
from pretext_jax.pretrain import mesh as mesh_lib

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
        plain.embedding[...] = table.embedding[...]
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


def test_masked_lm_gradients_are_the_same_on_a_data_fsdp_tensor_mesh():
    """BERT's MLM + NSP gradients (masked positions gathered, the tied table) on the (2, 2, 2)
    mesh, parameters placed by the rules, equal the single-device ones (a batch of 8: 2 rows a
    device). With the head's dense sharded ("embed", "mlp") (its output dimension on `tensor`
    while the tied table's embedding dimension is on `fsdp` and its vocabulary on `tensor`),
    XLA (jax 0.10.2, both partitioners) returned gradients wrong by as much as their own size:
    `jnp.sum(((h @ k) @ e.T) ** 2)` differentiated in `k` and `h`, with k on P("fsdp", "tensor"),
    e on P("tensor", "fsdp") and h's batch on data x fsdp, shows it alone."""
    config = EncoderConfig(**{**SMALL, "embedding_size": 16}, hidden_dropout=0.0,
                           attention_dropout=0.0)
    model = Bert(config, rngs=nnx.Rngs(0))
    keys = jax.random.split(jax.random.key(1), 4)
    ids = jax.random.randint(keys[0], (8, 16), 0, 96)
    positions = jax.random.randint(keys[1], (8, 4), 0, 16)
    labels = jax.random.randint(keys[2], (8, 4), 0, 96)
    next_sentence = jax.random.randint(keys[3], (8,), 0, 2)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, ids, positions, labels, next_sentence):
        out = nnx.merge(graphdef, params, rest)(ids, masked_positions=positions)
        mlm = jax.nn.log_softmax(out.mlm_logits.astype(jnp.float32))
        nsp = jax.nn.log_softmax(out.nsp_logits.astype(jnp.float32))
        return -(jnp.mean(jnp.take_along_axis(mlm, labels[..., None], -1))
                 + jnp.mean(jnp.take_along_axis(nsp, next_sentence[:, None], -1)))

    gradients = jax.jit(jax.grad(loss))
    single = gradients(params, ids, positions, labels, next_sentence)
    mesh = mesh_lib.make_mesh(2, 2, 2)
    placed = jax.device_put(params, mesh_lib.state_shardings(params, mesh))
    batch = jax.device_put((ids, positions, labels, next_sentence), mesh_lib.batch_sharding(mesh))
    assert tuple(placed["lm_head"]["dense"]["kernel"][...].sharding.spec) == ("tensor", "fsdp")
    mixed = gradients(placed, *batch)
    for (path, expected), got in zip(jax.tree_util.tree_leaves_with_path(single),
                                     jax.tree_util.tree_leaves(mixed), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-4,
                                   atol=1e-6, err_msg=jax.tree_util.keystr(path))
