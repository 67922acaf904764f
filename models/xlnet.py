"""XLNet: Transformer-XL relative attention with two streams and recurrence memory.

Reference: zihangdai/xlnet modeling.py (`transformer_xl`, `two_stream_rel_attn`,
`rel_multihead_attn`, `rel_attn_core`, `rel_shift`, `relative_positional_encoding`,
`_cache_mem`, `_create_mask`) and Yang et al. 2019 §2.3-2.4; HF transformers modeling_xlnet.py
(`XLNetLMHeadModel`) has the same computation and is the parity oracle.

Tensors are batch-major here ([B, T, ...]; the TF code is time-major). `perm_mask[b, i, j] = 1`
means position i may not attend to j; `target_mapping[b, k, j] = 1` means the k-th prediction
is at position j. With `target_mapping` both streams run: the content stream h (sees itself)
and the query stream g (starts from `mask_emb`, never sees its own content); the outputs and
logits are then the query stream's at the targets. `XLNetModel` is the transformer alone (HF
`XLNetModel`), which `XLNet` (the LM head) and the sequence classifier (`models.classifier`) build
on. Shape comments use the letters of `XLNetModel`'s legend.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.layers import (
    ACTIVATIONS,
    TransformerConfig,
    dense,
    dropout,
    embed,
    layer_norm,
    run_stacked,
    split_rng,
    stacked_layers,
)


@dataclasses.dataclass(frozen=True)
class XLNetConfig(TransformerConfig):
    """XLNet hyper-parameters (HF `XLNetConfig` names in brackets): hidden_size [d_model],
    num_layers [n_layer], num_heads [n_head] (head size hidden_size // num_heads [d_head]),
    intermediate_size [d_inner], hidden_act [ff_activation], hidden_dropout [dropout],
    attention_dropout [dropatt, the TF reference's; HF uses `dropout` for both].

    `attn_type` `bi` (XLNet) or `uni`; `bi_data` gives the second half of the batch reversed
    relative positions (pre-training only; the batch must be even); `clamp_len` > 0 clamps
    relative distances; `same_length` (uni only) gives every query the same key span. `mem_len`
    hidden states per layer are kept as memory (0 = keep all that are passed in), of which only
    the first `reuse_len` positions of each new segment are cached (0 = all). `untie_r` gives
    every layer its own r_w/r_r/r_s biases (the released models do). `memory_batch_size` > 0
    (with `mem_len` > 0) gives the model a `memory` [L, B, mem_len, H] that pre-training carries
    from step to step (state, not a parameter; train_gpu.py passes `mems` along the same way).
    """

    vocab_size: int = 32000
    attn_type: str = "bi"
    """Attention pattern: bi (XLNet pre-training, bidirectional) or uni (causal)."""
    bi_data: bool = False
    """Reverse the relative positions of the batch's second half (XLNet); = examples.bi_data."""
    clamp_len: int = -1
    """Clamp relative distances to +-clamp_len; <= 0 = no clamping (XLNet -1)."""
    same_length: bool = False
    """With attn_type uni: every query attends over the same number of keys."""
    mem_len: int = 0
    """Hidden states per layer kept as memory (XLNet 384); 0 = none carried between steps."""
    reuse_len: int = 0
    """Leading tokens per segment cached into memory (XLNet 256, 0 = all); = examples.reuse_len."""
    untie_r: bool = True
    """Each layer has its own r_w/r_r/r_s attention biases (true in the released models)."""
    memory_batch_size: int = 0
    """Rows of the memory carried between steps; 0 = examples.num_streams, set when training."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attn_type not in ("bi", "uni"):
            raise ValueError(f"attn_type {self.attn_type!r} must be 'bi' or 'uni'")
        if min(self.mem_len, self.reuse_len, self.memory_batch_size) < 0:
            raise ValueError("mem_len, reuse_len and memory_batch_size must be >= 0")

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads



@jax.tree_util.register_dataclass
@dataclasses.dataclass
class XLNetOutput:
    """`hidden_states`: the last layer's output [B, T, H], or the query stream's [B, P, H] when
    `target_mapping` is given (HF `last_hidden_state`); `lm_logits` [B, T or P, V]; `new_mems`
    [L, B, M, H] (None when memory is off)."""

    hidden_states: jax.Array
    lm_logits: jax.Array
    new_mems: jax.Array | None


def normal_parameter(config: TransformerConfig, shape: tuple[int, ...],
                     axes: tuple[str | None, ...], rngs: nnx.Rngs) -> nnx.Param:
    init = nnx.initializers.normal(config.initializer_range)
    return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=axes)


def rel_shift(scores: jax.Array, key_len: int) -> jax.Array:
    """[B, N, Tq, R] scores against relative positions klen..-qlen+1 -> [B, N, Tq, Tk] against
    absolute key positions (modeling.py `rel_shift`, batch-major as HF `rel_shift_bnij`)."""
    b, n, q, r = scores.shape
    shifted = scores.reshape(b, n, r, q)[:, :, 1:, :].reshape(b, n, q, r - 1)
    return shifted[..., :key_len]


def sinusoid(positions: jax.Array, hidden_size: int) -> jax.Array:
    """[R] relative positions -> [R, H] = [sin(p / 10000^(2i/H)), cos(...)]."""
    inv_freq = 1.0 / (10000 ** (jnp.arange(0, hidden_size, 2.0) / hidden_size))
    angles = positions[:, None] * inv_freq[None]
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def relative_positions(config: XLNetConfig, query_len: int, key_len: int,
                       batch: int) -> jax.Array:
    """[B, klen + qlen, H] sinusoid embeddings of the distances klen, ..., -qlen + 1 (`bi`;
    `uni` stops at 0), clamped by `clamp_len`; with `bi_data` the second half of the batch gets
    the negated (reversed) distances (modeling.py `relative_positional_encoding`)."""
    end = -query_len if config.attn_type == "bi" else -1
    forward = jnp.arange(key_len, end, -1, dtype=jnp.float32)
    if config.clamp_len > 0:
        forward = jnp.clip(forward, -config.clamp_len, config.clamp_len)
    if not config.bi_data:
        return jnp.broadcast_to(sinusoid(forward, config.hidden_size),
                                (batch, len(forward), config.hidden_size))
    if batch % 2:
        raise ValueError(f"bi_data needs an even batch, got {batch}")
    backward = jnp.arange(-key_len, -end, 1, dtype=jnp.float32)
    if config.clamp_len > 0:
        backward = jnp.clip(backward, -config.clamp_len, config.clamp_len)
    halves = [jnp.broadcast_to(sinusoid(p, config.hidden_size)[None],
                               (batch // 2, len(p), config.hidden_size))
              for p in (forward, backward)]
    return jnp.concatenate(halves, axis=0)


@dataclasses.dataclass
class AttentionInputs:
    """What every layer's attention needs besides the hidden states (built once per call)."""

    positions: jax.Array  # [B, R, H] relative position embeddings
    segments: jax.Array | None  # [B, Tq, Tk, 2] one-hot "different segment"
    content_mask: jax.Array | None  # [B, Tq, Tk] 1 = blocked, for h
    query_mask: jax.Array | None  # [B, Tq, Tk] 1 = blocked, for g
    target_mapping: jax.Array | None  # [B, P, Tq]
    target_positions: jax.Array | None  # [B, P] query rows of the query stream


def query_rows(x: jax.Array | None, positions: jax.Array | None) -> jax.Array | None:
    """Rows `positions` [B, P] of a per-query array [B, Tq, ...] (all rows when None)."""
    if x is None or positions is None:
        return x
    index = positions.reshape(*positions.shape, *([1] * (x.ndim - 2)))
    return jnp.take_along_axis(x, index, axis=1)


def shifted_rows(scores: jax.Array, positions: jax.Array, query_len: int,
                 key_len: int) -> jax.Array:
    """`rel_shift` for queries at rows `positions` [B, P] only: [B, N, P, R] scores against
    the relative positions -> [B, N, P, Tk]. Row i of the shifted matrix, key j, is column
    j + query_len - i of the unshifted one."""
    columns = jnp.arange(key_len)[None, None, :] + query_len - positions[:, :, None]
    return jnp.take_along_axis(scores, columns[:, None], axis=-1)


class XLNetLayer(nnx.Module):
    """Relative multi-head attention (shared by both streams) + position-wise FFN.
    `segments=False` leaves out the segment embedding (Transformer-XL has none)."""

    def __init__(self, config: XLNetConfig, *, rngs: nnx.Rngs, segments: bool = True):
        h, n, d = config.hidden_size, config.num_heads, config.head_size
        self.config = config
        for name in ("q", "k", "v", "o", "r"):
            setattr(self, name, normal_parameter(config, (h, n, d), ("embed", "heads", None),
                                                 rngs))
        if segments:
            self.seg_embed = normal_parameter(config, (2, n, d), (None, "heads", None), rngs)
        self.attention_layer_norm = layer_norm(config, h, rngs)
        self.intermediate = dense(config, h, config.intermediate_size, ("embed", "mlp"), rngs)
        self.output = dense(config, config.intermediate_size, h, ("mlp", "embed"), rngs)
        self.output_layer_norm = layer_norm(config, h, rngs)

    def project(self, x: jax.Array, name: str) -> jax.Array:
        weight = getattr(self, name)[...].astype(self.config.compute_dtype)
        return jnp.einsum("bih,hnd->bind", x, weight)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, k_r: jax.Array,
               biases: dict[str, jax.Array], inputs: AttentionInputs, mask: jax.Array | None,
               rng: jax.Array | None, rows: jax.Array | None = None) -> jax.Array:
        """modeling.py `rel_attn_core`: content + position (rel-shifted) + segment scores.
        `rows` [B, P]: `q` holds only those query rows (the query stream at its targets)."""
        c = self.config
        content = jnp.einsum("bind,bjnd->bnij", q + biases["r_w_bias"], k)
        position = jnp.einsum("bind,bjnd->bnij", q + biases["r_r_bias"], k_r)
        if rows is None:
            position = rel_shift(position, k.shape[1])
        else:
            query_len = k_r.shape[1] - k.shape[1]
            position = shifted_rows(position, rows, query_len, k.shape[1])
        scores = content + position
        segments = query_rows(inputs.segments, rows)
        if segments is not None:
            seg = jnp.einsum("bind,snd->bins", q + biases["r_s_bias"],
                             self.seg_embed[...].astype(q.dtype))
            scores = scores + jnp.einsum("bijs,bins->bnij", segments.astype(q.dtype), seg)
        scores = scores.astype(jnp.float32) * (c.head_size ** -0.5)
        if mask is not None:
            scores = scores - 1e30 * mask[:, None].astype(jnp.float32)
        probs = dropout(jax.nn.softmax(scores, axis=-1), c.attention_dropout, rng)
        return jnp.einsum("bnij,bjnd->bind", probs.astype(v.dtype), v)

    def post_attention(self, residual: jax.Array, context: jax.Array,
                       rng: jax.Array | None) -> jax.Array:
        out = jnp.einsum("bind,hnd->bih", context,
                         self.o[...].astype(self.config.compute_dtype))
        return self.attention_layer_norm(dropout(out, self.config.hidden_dropout, rng) + residual)

    def feed_forward(self, x: jax.Array, rng: jax.Array | None) -> jax.Array:
        c = self.config
        inner_rng, out_rng = split_rng(rng, 2)
        y = dropout(ACTIVATIONS[c.hidden_act](self.intermediate(x)), c.hidden_dropout, inner_rng)
        y = dropout(self.output(y), c.hidden_dropout, out_rng)
        return self.output_layer_norm(y + x)

    def __call__(self, h: jax.Array, g: jax.Array | None, mem: jax.Array | None,
                 biases: dict[str, jax.Array], inputs: AttentionInputs,
                 rng: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
        """One layer on the content stream `h` [B, T, H] and, if given, the query stream `g`
        [B, P, H] (or [B, T, H] without targets), attending over [memory `mem` [B, M, H]; h]
        (shapes: `XLNetModel`'s legend)."""
        keys = split_rng(rng, 6)
        context_in = h if mem is None else jnp.concatenate([mem.astype(h.dtype), h],
                                                           axis=1)  # [B, K, H]
        k, v = self.project(context_in, "k"), self.project(context_in, "v")  # [B, K, N, D]
        k_r = self.project(inputs.positions.astype(h.dtype), "r")  # [B, R, N, D]
        attended = self.attend(self.project(h, "q"), k, v, k_r, biases, inputs,
                               inputs.content_mask, keys[0])  # [B, T, N, D]
        new_h = self.feed_forward(self.post_attention(h, attended, keys[1]),
                                  keys[2])  # [B, T, H]
        if g is None:
            return new_h, None
        q_g = self.project(g, "q")  # [B, P, N, D]
        if inputs.target_positions is not None:
            attended_g = self.attend(q_g, k, v, k_r, biases, inputs,
                                     query_rows(inputs.query_mask, inputs.target_positions),
                                     keys[3], rows=inputs.target_positions)
        elif inputs.target_mapping is not None:
            mapping = inputs.target_mapping.astype(q_g.dtype)
            q_g = jnp.einsum("bmnd,bml->blnd", q_g, mapping)
            attended_g = self.attend(q_g, k, v, k_r, biases, inputs, inputs.query_mask, keys[3])
            attended_g = jnp.einsum("blnd,bml->bmnd", attended_g, mapping)
        else:
            attended_g = self.attend(q_g, k, v, k_r, biases, inputs, inputs.query_mask, keys[3])
        return new_h, self.feed_forward(self.post_attention(g, attended_g, keys[4]), keys[5])


BIAS_NAMES = ("r_w_bias", "r_r_bias", "r_s_bias")


class Memory(nnx.Variable):
    """Recurrence memory carried between training steps: model state, not a parameter."""


class XLNetModel(nnx.Module):
    """The XLNet transformer (HF `XLNetModel`): word embedding, `mask_emb` for the query stream,
    the r-biases and stacked layers; `encode` returns the last hidden states.

    Shapes in this module (modeling.py `transformer_xl`'s names in brackets): B batch size,
    T segment length [qlen], M memory length [mlen], K = M + T keys [klen], R relative
    positions (K + T for `bi`, K for `uni`), P predicted positions [num_predict], H hidden size
    [d_model], N attention heads [n_head], D head size [d_head], F inner size [d_inner],
    L layers, V vocabulary.
    """

    def __init__(self, config: XLNetConfig, *, rngs: nnx.Rngs):
        n, d = config.num_heads, config.head_size
        self.config = config
        with nnx.use_eager_sharding(False):
            self.word_embedding = embed(config, config.vocab_size, config.hidden_size,
                                        ("vocab", "embed"), rngs)
            self.mask_emb = normal_parameter(config, (1, 1, config.hidden_size),
                                             (None, None, "embed"), rngs)
            bias_shape = (config.num_layers, n, d) if config.untie_r else (n, d)
            bias_axes = ("layers", "heads", None) if config.untie_r else ("heads", None)
            for name in BIAS_NAMES:
                setattr(self, name, normal_parameter(config, bias_shape, bias_axes, rngs))
            self.layers = stacked_layers(lambda r: XLNetLayer(config, rngs=r),
                                         config.num_layers, rngs)
            if config.memory_batch_size and config.mem_len:
                self.memory = Memory(
                    jnp.zeros((config.num_layers, config.memory_batch_size, config.mem_len,
                               config.hidden_size), jnp.float32),
                    out_sharding=("layers", "batch", None, "embed"))

    def _masks(self, batch: int, query_len: int, mem_len: int,
               attention_mask: jax.Array | None, perm_mask: jax.Array | None
               ) -> tuple[jax.Array | None, jax.Array | None]:
        """(content-stream mask, query-stream mask), 1 = blocked, [B, Tq, Tk]
        (modeling.py `transformer_xl`: causal mask for `uni`, padding + perm_mask, memory
        always visible; the content stream also sees itself)."""
        c = self.config
        blocked = None
        if c.attn_type == "uni":
            rows = jnp.arange(query_len)[:, None]
            cols = jnp.arange(query_len + mem_len)[None, :]
            causal = cols > rows + mem_len
            if c.same_length:
                causal = causal | (cols < rows)
            blocked = jnp.broadcast_to(causal, (batch, query_len, query_len + mem_len))
        data = None
        if attention_mask is not None:
            data = jnp.broadcast_to((1 - attention_mask)[:, None, :].astype(jnp.float32),
                                    (batch, query_len, query_len))
        if perm_mask is not None:
            data = perm_mask.astype(jnp.float32) + (0.0 if data is None else data)
        if data is not None:
            data = jnp.pad(data, ((0, 0), (0, 0), (mem_len, 0))) > 0
            blocked = data if blocked is None else blocked | data
        if blocked is None:
            return None, None
        itself = jnp.pad(jnp.eye(query_len, dtype=bool), ((0, 0), (mem_len, 0)))
        return (blocked & ~itself[None]).astype(jnp.float32), blocked.astype(jnp.float32)

    def _segments(self, token_type_ids: jax.Array | None, mem_len: int) -> jax.Array | None:
        """One-hot [B, Tq, Tk, 2] of "i and j are in different segments" (memory = segment 0)."""
        if token_type_ids is None:
            return None
        keys = jnp.pad(token_type_ids, ((0, 0), (mem_len, 0)))
        different = (token_type_ids[:, :, None] != keys[:, None, :]).astype(jnp.int32)
        return jax.nn.one_hot(different, 2, dtype=jnp.float32)

    def _cache(self, h: jax.Array, mem: jax.Array | None) -> jax.Array:
        """modeling.py `_cache_mem`: the first `reuse_len` new positions appended to the old
        memory, the last `mem_len` kept, without gradient."""
        c = self.config
        new = h[:, : c.reuse_len] if c.reuse_len > 0 else h
        if mem is not None:
            new = jnp.concatenate([mem.astype(new.dtype), new], axis=1)
        if c.mem_len > 0:
            new = new[:, -c.mem_len:]
        return jax.lax.stop_gradient(new.astype(jnp.float32))

    def encode(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        *,
        perm_mask: jax.Array | None = None,
        target_mapping: jax.Array | None = None,
        target_positions: jax.Array | None = None,
        mems: jax.Array | None = None,
        use_mems: bool = False,
        rng: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """(hidden states, new memory): the last layer's content stream [B, T, H] (the query
        stream's [B, P, H] with `target_mapping` or `target_positions`) after dropout, and the
        new `mems` [L, B, M, H] (None without `use_mems`). `mems` are the previous segment's
        cached states (`new_mems` of the last call); `attention_mask` is 1 for real tokens
        (HF's; the TF code's `input_mask` is its complement). `rng` enables dropout.

        `target_positions` [B, P] (int) is the one-hot special case of `target_mapping`
        (`one_hot(target_positions, T)`): the query stream then attends from those P rows only
        instead of all T (pre-training predicts 85 of 512), with the same result on every
        target."""
        if target_mapping is not None and target_positions is not None:
            raise ValueError("give target_mapping or target_positions, not both")
        c = self.config
        batch, query_len = input_ids.shape  # B, T
        mem_len = 0 if mems is None else mems.shape[2]  # M; mems [L, B, M, H]
        content_mask, query_mask = self._masks(batch, query_len, mem_len, attention_mask,
                                               perm_mask)  # [B, T, K] each, or None
        embed_rng, query_rng, position_rng, layers_rng, out_rng = split_rng(rng, 5)
        h = dropout(self.word_embedding(input_ids), c.hidden_dropout, embed_rng)  # [B, T, H]
        g = None
        targets = target_mapping if target_mapping is not None else target_positions
        if targets is not None:  # [B, P, T] or [B, P]
            g = jnp.broadcast_to(self.mask_emb[...].astype(c.compute_dtype),
                                 (batch, targets.shape[1], c.hidden_size))  # [B, P, H]
            g = dropout(g, c.hidden_dropout, query_rng)
        positions = relative_positions(c, query_len, query_len + mem_len, batch)  # [B, R, H]
        inputs = AttentionInputs(
            positions=dropout(positions, c.hidden_dropout, position_rng),
            segments=self._segments(token_type_ids, mem_len),  # [B, T, K, 2] or None
            content_mask=content_mask, query_mask=query_mask, target_mapping=target_mapping,
            target_positions=target_positions)
        biases = {name: getattr(self, name)[...].astype(c.compute_dtype)  # [L, N, D] (or [N, D])
                  for name in BIAS_NAMES}
        if not c.untie_r:
            biases = {k: jnp.broadcast_to(v, (c.num_layers, *v.shape))  # [L, N, D]
                      for k, v in biases.items()}
        keys = None if layers_rng is None else jax.random.split(layers_rng, c.num_layers)

        def apply(layer: XLNetLayer, carry, per_layer):
            h, g = carry  # [B, T, H], [B, P, H] or None
            mem, layer_biases, key = per_layer  # [B, M, H] or None, {name: [N, D]}, key
            new_mem = self._cache(h, mem) if use_mems else None  # [B, M', H]
            return layer(h, g, mem, layer_biases, inputs, key), new_mem

        (h, g), new_mems = run_stacked(self.layers, apply, (h, g), (mems, biases, keys),
                                       c)  # new_mems [L, B, M', H] or None
        return dropout(h if g is None else g, c.hidden_dropout, out_rng), new_mems


class XLNet(XLNetModel):
    """XLNet with its LM head (HF `XLNetLMHeadModel`): logits through the tied word embedding
    plus a bias."""

    def __init__(self, config: XLNetConfig, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        with nnx.use_eager_sharding(False):
            self.lm_bias = nnx.Param(jnp.zeros((config.vocab_size,)), out_sharding=("vocab",))

    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        **kwargs: Any,
    ) -> XLNetOutput:
        """`XLNetModel.encode` (same arguments) and the LM logits of its hidden states."""
        hidden, new_mems = self.encode(input_ids, token_type_ids, attention_mask,
                                       **kwargs)  # [B, T or P, H]
        logits = self.word_embedding.attend(hidden)  # [B, T or P, V]
        return XLNetOutput(hidden_states=hidden,
                           lm_logits=logits + self.lm_bias[...].astype(logits.dtype),
                           new_mems=new_mems)
