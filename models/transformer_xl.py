"""Transformer-XL (Dai et al. 2019): a causal Transformer LM with segment-level recurrence and
relative positional encodings.

Reference: kimiyoung/transformer-xl pytorch/mem_transformer.py (`MemTransformerLM` with
`attn_type=0`, `RelPartialLearnableMultiHeadAttn`, `RelPartialLearnableDecoderLayer`,
`PositionwiseFF`, `AdaptiveEmbedding` with `div_val=1` and no cutoffs, `_update_mems`) and
§3.2-3.3 of the paper. The layers are XLNet's (`models.xlnet.XLNetLayer` without the segment
embedding: the same relative attention, A + B + C + D of §3.3 with r_w_bias = u and
r_r_bias = v, post-LN, ReLU feed-forward); around them:

- the word embedding times sqrt(d_model) (`AdaptiveEmbedding.emb_scale`), dropout on it and on
  the sinusoid position embeddings of the distances K - 1 .. 0 (`pos_seq`, clamped to
  `clamp_len`), r_w_bias / r_r_bias shared by every layer;
- the memory: per layer, the layer's input over the previous segment(s), `mems` [L, B, M, H],
  prepended to the keys and values (no gradient). The reference's memory grows from empty
  (`init_mems`) to `mem_len`; here it is always M slots, of which the last `memory_length[b]`
  are filled and the rest are masked out, which gives the same attention exactly (a blocked key
  has probability 0, and the relative distance of every filled key is the reference's);
- `_update_mems` (with `ext_len` 0): the last M states of [memory; this segment's layer
  inputs]. The reference keeps L + 1 states (the last layer's output too) but reads only L
  (its call passes `mlen, qlen` for the parameters `qlen, mlen`, which only matters with
  `ext_len` > 0);
- the causal mask over [memory; segment] (`dec_attn_mask`), or with `same_length` the one that
  gives every query the same number of keys, as `_forward` computes it from `mlen`;
- the output: dropout, then logits through the tied embedding plus a bias (the softmax of
  `ProjectedAdaptiveLogSoftmax` without cutoffs: a full softmax).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.layers import (
    TransformerConfig,
    dropout,
    embed,
    run_stacked,
    split_rng,
    stacked_layers,
)
from pretext_jax.models.xlnet import (
    AttentionInputs,
    Memory,
    XLNetLayer,
    normal_parameter,
    sinusoid,
)


@dataclasses.dataclass(frozen=True)
class TransformerXLConfig(TransformerConfig):
    """mem_transformer.py `MemTransformerLM` hyper-parameters (its names in brackets):
    hidden_size [d_model], num_layers [n_layer], num_heads [n_head] (head size hidden_size //
    num_heads [d_head]), intermediate_size [d_inner], hidden_dropout [dropout],
    attention_dropout [dropatt]. `memory_batch_size` > 0 (with `mem_len` > 0) gives the model a
    `memory` [L, B, mem_len, H] that training carries from step to step (train.py passes `mems`
    from batch to batch the same way)."""

    vocab_size: int = 32000
    hidden_act: str = "relu"
    """Feed-forward activation (mem_transformer.py `PositionwiseFF`: ReLU)."""
    layer_norm_eps: float = 1e-5
    """LayerNorm epsilon (torch's nn.LayerNorm default, 1e-5)."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (`dropatt`; run_wt103_base.sh 0.0)."""
    mem_len: int = 150
    """Hidden states per layer kept as memory in training (`mem_len`; WT103 base 150)."""
    clamp_len: int = -1
    """Distances above clamp_len use clamp_len's encoding in training; <= 0 = none (-1)."""
    same_length: bool = False
    """Every query attends over the same number of keys in training (train.py default off)."""
    memory_batch_size: int = 0
    """Rows of the memory carried between steps; 0 = examples.num_streams, set when training."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if min(self.mem_len, self.memory_batch_size) < 0:
            raise ValueError("mem_len and memory_batch_size must be >= 0")

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TransformerXLOutput:
    """`hidden_states` [B, T, H] (after the output dropout), `logits` [B, T, V], `new_mems`
    [L, B, M, H] (None without memory)."""

    hidden_states: jax.Array
    logits: jax.Array
    new_mems: jax.Array | None


def attention_mask(query_len: int, memory_slots: int, memory_length: jax.Array,
                   same_length: bool) -> jax.Array:
    """[B, T, M + T] float, 1 = blocked, over the keys [memory slots; segment] of rows whose last
    `memory_length` [B] slots are filled (mem_transformer.py `_forward`'s `dec_attn_mask` with
    mlen = memory_length, each key index j' here being the reference's j = j' - (M - mlen)):
    empty slots, the future (j > i + mlen), and with `same_length` the keys j <= i - s, where
    s = M - mlen if mlen + T > M else T (the reference's `mask_shift_len`)."""
    rows = jnp.arange(query_len)[None, :, None]  # i
    cols = jnp.arange(memory_slots + query_len)[None, None, :]  # j'
    empty = memory_slots - memory_length[:, None, None]  # M - mlen
    blocked = (cols < empty) | (cols > rows + memory_slots)
    if same_length:
        shift = jnp.where(memory_length + query_len > memory_slots,
                          memory_slots - memory_length, query_len)[:, None, None]
        blocked = blocked | (cols - empty <= rows - shift)
    return blocked.astype(jnp.float32)


def relative_encodings(key_len: int, clamp_len: int, hidden_size: int) -> jax.Array:
    """[K + 1, H] sinusoid encodings of the distances K, ..., 0, clamped to `clamp_len` when
    > 0 (`pos_seq` runs K - 1 .. 0; the leading K is what `xlnet.rel_shift` drops)."""
    distances = jnp.arange(key_len, -1, -1, dtype=jnp.float32)
    if clamp_len > 0:
        distances = jnp.minimum(distances, clamp_len)
    return sinusoid(distances, hidden_size)


class TransformerXL(nnx.Module):
    """`MemTransformerLM` (full softmax, tied output embedding): `__call__` reads a segment
    [B, T] with an optional memory and returns the logits and the new memory.

    Shapes: B batch size, T segment length [qlen], M memory slots [mem_len], K = M + T keys
    [klen], H hidden size [d_model], N heads [n_head], D head size [d_head], L layers, V
    vocabulary."""

    def __init__(self, config: TransformerXLConfig, *, rngs: nnx.Rngs):
        n, d = config.num_heads, config.head_size
        self.config = config
        with nnx.use_eager_sharding(False):
            self.word_embedding = embed(config, config.vocab_size, config.hidden_size,
                                        ("vocab", "embed"), rngs)
            self.r_w_bias = normal_parameter(config, (n, d), ("heads", None), rngs)
            self.r_r_bias = normal_parameter(config, (n, d), ("heads", None), rngs)
            self.layers = stacked_layers(lambda r: XLNetLayer(config, rngs=r, segments=False),
                                         config.num_layers, rngs)
            self.lm_bias = nnx.Param(jnp.zeros((config.vocab_size,)), out_sharding=("vocab",))
            if config.memory_batch_size and config.mem_len:
                self.memory = Memory(
                    jnp.zeros((config.num_layers, config.memory_batch_size, config.mem_len,
                               config.hidden_size), jnp.float32),
                    out_sharding=("layers", "batch", None, "embed"))

    def __call__(
        self,
        input_ids: jax.Array,
        *,
        mems: jax.Array | None = None,
        memory_length: jax.Array | None = None,
        clamp_len: int | None = None,
        same_length: bool | None = None,
        rng: jax.Array | None = None,
    ) -> TransformerXLOutput:
        """Logits of `input_ids` [B, T] after the memory `mems` [L, B, M, H] (None: none), of
        which the last `memory_length` [B] slots per row are filled (None: all); the new memory
        has the same M slots. `clamp_len` and `same_length` default to the config's (evaluation
        sets its own). `rng` enables dropout."""
        c = self.config
        clamp_len = c.clamp_len if clamp_len is None else clamp_len
        same_length = c.same_length if same_length is None else same_length
        batch, query_len = input_ids.shape  # B, T
        slots = 0 if mems is None else mems.shape[2]  # M
        if memory_length is None:
            memory_length = jnp.full((batch,), slots, jnp.int32)
        embed_rng, position_rng, layers_rng, out_rng = split_rng(rng, 4)
        h = self.word_embedding(input_ids) * jnp.asarray(c.hidden_size ** 0.5, c.compute_dtype)
        h = dropout(h, c.hidden_dropout, embed_rng)  # [B, T, H]
        positions = dropout(relative_encodings(slots + query_len, clamp_len, c.hidden_size),
                            c.hidden_dropout, position_rng)  # [K + 1, H], one mask for all rows
        inputs = AttentionInputs(
            positions=jnp.broadcast_to(positions, (batch, *positions.shape)),
            segments=None,
            content_mask=attention_mask(query_len, slots, memory_length, same_length),
            query_mask=None, target_mapping=None, target_positions=None)
        biases = {"r_w_bias": self.r_w_bias[...].astype(c.compute_dtype),
                  "r_r_bias": self.r_r_bias[...].astype(c.compute_dtype)}  # [N, D]
        keys = None if layers_rng is None else jax.random.split(layers_rng, c.num_layers)

        def apply(layer: XLNetLayer, h: jax.Array, per_layer):
            mem, key = per_layer  # [B, M, H] or None
            new_mem = None
            if mem is not None:  # `_update_mems`: the last M of [memory; layer input]
                new_mem = jax.lax.stop_gradient(
                    jnp.concatenate([mem, h.astype(mem.dtype)], axis=1)[:, -slots:])
            return layer(h, None, mem, biases, inputs, key)[0], new_mem

        h, new_mems = run_stacked(self.layers, apply, h, (mems, keys), c)
        h = dropout(h, c.hidden_dropout, out_rng)
        logits = self.word_embedding.attend(h)
        return TransformerXLOutput(hidden_states=h,
                                   logits=logits + self.lm_bias[...].astype(logits.dtype),
                                   new_mems=new_mems)
