"""GPT-2: a decoder-only, pre-LayerNorm Transformer language model (Radford et al. 2019, §2.3),
with a key/value cache for generation (`models.generate`).

Reference: openai/gpt-2 src/model.py and HF transformers modeling_gpt2.py (`GPT2LMHeadModel`),
whose weights convert one-to-one (`pretrain/hf.py`). Each block is x + attn(ln_1(x)), then
x + mlp(ln_2(x)); a final `ln_f`; the LM head is the transposed token embedding. The attention
projection is fused (`c_attn`: [hidden, 3 * hidden], queries, keys, values in that order).
GPT-2's init (§2.3, HF `_init_weights`): every weight N(0, 0.02), the two residual output
projections of each block N(0, 0.02 / sqrt(2 * n_layer)), biases 0, LayerNorms 1/0.

Layers are stacked on a leading `layers` axis and run by `run_stacked` (scan or loop, remat),
as the encoder's; parameters carry the same logical sharding names.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.layers import (
    ACTIVATIONS,
    TransformerConfig,
    attention,
    dense,
    dropout,
    embed,
    layer_norm,
    run_stacked,
    split_rng,
    stacked_layers,
    write_slot,
)

# Per-layer keys and values [layers, batch, cache_length, heads, head_dim].
KVCache = tuple[jax.Array, jax.Array]


@dataclasses.dataclass(frozen=True)
class GPTConfig(TransformerConfig):
    """GPT-2's hyper-parameters (HF `GPT2Config` defaults = GPT-2 small): `hidden_act`
    `gelu_tanh` (GPT-2's `gelu`, HF `gelu_new`), LayerNorm epsilon 1e-5, a context of
    `max_position_embeddings` learned positions, dropout 0.1 on the embeddings
    (`embedding_dropout`, HF `embd_pdrop`), on residual branches (`hidden_dropout`,
    `resid_pdrop`) and on attention probabilities (`attention_dropout`, `attn_pdrop`).
    `eos_token_id` is the end-of-text token (None: taken from the tokenizer when training):
    generation stops there by default, and it is HF's `bos_token_id`/`eos_token_id`."""

    vocab_size: int = 50257
    hidden_act: str = "gelu_tanh"
    layer_norm_eps: float = 1e-5
    max_position_embeddings: int = 1024
    """Context length: rows of the learned position table (GPT-2 1024, HF `n_positions`)."""
    embedding_dropout: float = 0.1
    """Dropout on the token + position embeddings (GPT-2 0.1, HF `embd_pdrop`)."""
    eos_token_id: int | None = None
    """End-of-text id, HF `eos_token_id` (GPT-2 50256); None = the tokenizer's, set in training."""

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads


def causal_mask(attention_mask: jax.Array) -> jax.Array:
    """[B, 1, T, T] bool: query i may attend key j iff j <= i and j is not padding."""
    length = attention_mask.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    return causal[None, None] & attention_mask.astype(bool)[:, None, None, :]


class GPTBlock(nnx.Module):
    """One pre-LN block (HF `GPT2Block`): ln_1, fused-qkv causal self-attention, c_proj,
    residual; ln_2, MLP (c_fc, activation, c_proj), residual."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        h, i = config.hidden_size, config.intermediate_size
        normal = nnx.initializers.normal(config.initializer_range)
        residual = nnx.initializers.normal(config.initializer_range
                                           / math.sqrt(2 * config.num_layers))
        self.config = config
        self.ln_1 = layer_norm(config, h, rngs)
        self.c_attn = dense(config, h, 3 * h, ("embed", "heads"), rngs, normal)
        self.attn_proj = dense(config, h, h, ("heads", "embed"), rngs, residual)
        self.ln_2 = layer_norm(config, h, rngs)
        self.c_fc = dense(config, h, i, ("embed", "mlp"), rngs, normal)
        self.mlp_proj = dense(config, i, h, ("mlp", "embed"), rngs, residual)

    def __call__(self, x: jax.Array, mask: jax.Array, rng: jax.Array | None,
                 cache: KVCache | None = None, index: jax.Array | int = 0
                 ) -> tuple[jax.Array, KVCache]:
        """x [B, T, H]; `mask` [B, 1, T, S] (True = may attend). Without `cache`, S = T and
        the block attends over its own keys; with `cache` ([B, S, N, D] keys and values of one
        layer) this step's keys and values are written at `index` and the queries attend over
        the whole cache. Returns the new x and the keys and values attended over."""
        c = self.config
        attn_rng, attn_out_rng, mlp_rng = split_rng(rng, 3)
        heads = (*x.shape[:2], c.num_heads, c.head_size)
        q, k, v = (t.reshape(heads) for t in jnp.split(self.c_attn(self.ln_1(x)), 3, axis=-1))
        if cache is not None:
            k, v = (write_slot(old, new, index) for old, new in zip(cache, (k, v), strict=True))
        context = attention(q, k, v, mask, c.attention_dropout, attn_rng,
                            c.attention_implementation).reshape(x.shape)
        x = x + dropout(self.attn_proj(context), c.hidden_dropout, attn_out_rng)
        y = self.mlp_proj(ACTIVATIONS[c.hidden_act](self.c_fc(self.ln_2(x))))
        return x + dropout(y, c.hidden_dropout, mlp_rng), (k, v)


class GPT(nnx.Module):
    """GPT-2 with its tied LM head (HF `GPT2LMHeadModel`)."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        h = config.hidden_size
        normal = nnx.initializers.normal(config.initializer_range)
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self.wte = embed(config, config.vocab_size, h, ("vocab", "embed"), rngs, normal)
            self.wpe = embed(config, config.max_position_embeddings, h, (None, "embed"), rngs,
                             normal)
            self.layers = stacked_layers(lambda r: GPTBlock(config, rngs=r), config.num_layers,
                                         rngs)
            self.ln_f = layer_norm(config, h, rngs)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None, *,
                 position_ids: jax.Array | None = None, rng: jax.Array | None = None
                 ) -> jax.Array:
        """Next-token logits [B, T, V] (compute dtype). `attention_mask` [B, T] (1 = token)
        hides padded keys on top of the causal mask; `position_ids` default to 0..T-1 (HF
        `GPT2Model`); `rng` enables dropout."""
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        hidden, _ = self.transform(input_ids, causal_mask(attention_mask), position_ids, rng)
        return self.logits(hidden)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """The LM head: hidden states times the transposed token embedding (tied)."""
        return self.wte.attend(hidden)

    def transform(self, input_ids: jax.Array, mask: jax.Array, position_ids: jax.Array | None,
                  rng: jax.Array | None, cache: KVCache | None = None,
                  index: jax.Array | int = 0, keep_kv: bool = False
                  ) -> tuple[jax.Array, KVCache | None]:
        """Embeddings, the blocks and `ln_f` -> (hidden [B, T, H], per-layer keys/values or
        None). `mask` [B, 1, T, S]; `cache` as `GPTBlock`, stacked on a leading layer axis;
        `keep_kv` returns the keys and values (the prompt's, to start a cache)."""
        c = self.config
        if position_ids is None:
            position_ids = jnp.arange(input_ids.shape[1])[None]
        embed_rng, stack_rng = split_rng(rng, 2)
        x = self.wte(input_ids) + self.wpe(position_ids)
        x = dropout(x, c.embedding_dropout, embed_rng)
        keys = None if stack_rng is None else jax.random.split(stack_rng, c.num_layers)

        def apply(block: GPTBlock, h: jax.Array, per_layer):
            key, layer_cache = per_layer
            h, kv = block(h, mask, key, layer_cache, index)
            return h, kv if (keep_kv or layer_cache is not None) else None

        x, kv = run_stacked(self.layers, apply, x, (keys, cache), c)
        return self.ln_f(x), kv

    # ------------------------------------------------------------------ incremental decoding
    def prefill(self, input_ids: jax.Array, attention_mask: jax.Array, cache_length: int
                ) -> tuple[jax.Array, KVCache]:
        """Runs a left-padded prompt [B, P] and returns the logits after its last token
        [B, V] and a cache of `cache_length` >= P slots holding the prompt's keys and values
        in slots 0..P-1. Positions count real tokens only (HF `generate`: cumsum of the mask
        - 1, 0 on padding), so a padded prompt continues as its unpadded self would."""
        positions = jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0)
        hidden, (k, v) = self.transform(input_ids, causal_mask(attention_mask), positions,
                                        None, keep_kv=True)
        pad = ((0, 0), (0, 0), (0, cache_length - input_ids.shape[1]), (0, 0), (0, 0))
        return self.logits(hidden[:, -1]), (jnp.pad(k, pad), jnp.pad(v, pad))

    def decode(self, token: jax.Array, position: jax.Array, cache: KVCache, index: jax.Array,
               key_mask: jax.Array) -> tuple[jax.Array, KVCache]:
        """One new token per row: `token` and `position` [B], written to cache slot `index`;
        `key_mask` [B, S] says which slots hold real tokens (this one included). Returns the
        next-token logits [B, V] and the updated cache."""
        hidden, cache = self.transform(token[:, None], key_mask[:, None, None, :],
                                       position[:, None], None, cache, index)
        return self.logits(hidden[:, 0]), cache
