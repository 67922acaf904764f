"""ProphetNet: the encoder-decoder with future n-gram prediction and n-stream self-attention of
Qi et al. 2020 ("ProphetNet: Predicting Future N-gram for Sequence-to-Sequence Pre-training",
§2.1-2.3) in Flax NNX.

Reference: microsoft/ProphetNet (fairseq, `ngram_s2s_model.py`, `ngram_multihead_attention.py`)
and HF transformers modeling_prophetnet.py (`ProphetNetForConditionalGeneration`), whose weights
convert one-to-one (`models.hf.prophetnet`) and which is the parity oracle
(tests/test_prophetnet.py).

The encoder is a post-LN Transformer with learned positions (1 .. S, as HF counts them from the
padding id 0 + 1) and a LayerNorm on the embeddings. The decoder runs 1 + ngram streams side by
side through the same layers (§2.2): the main stream (token + position embedding, causal
self-attention over the main stream, as a plain Transformer decoder) and `ngram` predicting
streams, whose inputs are only an n-gram embedding plus the position of the token they stand for
(t + 1; HF gives stream s the n-gram row s - 1 mod ngram). Predicting stream s at position t
attends to the main stream at positions 0 .. t - s (and always position 0) and to itself, never
to other streams or other positions of its own stream, so it predicts token t from the tokens
before t - s + 1: stream 0 is next-token prediction, stream s looks s + 1 tokens ahead of the
main stream's context. Self-attention adds a relative position bias that depends on the query:
a Linear of the query's hidden state gives one value per (bucket, head), picked by T5's causal
bucket of the key-query offset (for a predicting stream, the offset from its position t + 1;
its own key counts as offset 0). Cross-attention and the feed-forward run on every stream.

HF's full-sequence forward (transformers `ProphetNetNgramSelfAttention.
get_predict_relative_pos_embeddings`) reads the predicting streams' bias table with its rows
[T, ngram, heads] taken as [ngram, heads, T], unlike the reference's `ngram_relative_logits`
and HF's own one-token decoding (T = 1), which agree with each other and with this module;
tests/test_prophetnet.py checks the streams against both.

The main stream has no head of its own in pre-training: every prediction comes from the
predicting streams (the reference's decoder returns only them; HF's `logits` are stream 0's).
`logits(hidden)` is the tied output projection. For greedy generation, `decode` returns stream
0 (main stream and first predicting stream only, the other streams dropped, §2.3: they do not
change stream 0), which is what HF and the reference decode with.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.models.layers import (
    ACTIVATIONS,
    DecoderCache,
    attention,
    check_execution_fields,
    check_rates,
    dense,
    dropout,
    embed,
    layer_norm,
    per_layer_outputs,
    relative_position_bucket,
    run_stacked,
    split_rng,
    stacked_layers,
    write_slot,
)

PAD_ID = 0  # HF ProphetNet's pad id; positions count from it (1 .. T)


@dataclasses.dataclass(frozen=True)
class ProphetNetConfig:
    """ProphetNet hyper-parameters, named as HF `ProphetNetConfig` except `hidden_dropout` (HF
    `dropout`) and `hidden_act` (HF `activation_function`). `vocab_size` 0 and `eos_token_id` 0
    mean "take them from the data" (pre-training fills them in). The loss's settings (HF `eps`,
    `disable_ngram_loss`) are the objective's (`objectives.prophetnet`)."""

    vocab_size: int = 30522
    """Vocabulary (ProphetNet-En 30,522, BERT's uncased WordPiece); 0 = the tokenizer's."""
    hidden_size: int = 1024
    """Model width (ProphetNet-large 1024)."""
    num_encoder_layers: int = 12
    """Encoder layers (ProphetNet 12)."""
    num_decoder_layers: int = 12
    """Decoder layers (ProphetNet 12)."""
    num_encoder_attention_heads: int = 16
    """Encoder attention heads; must divide hidden_size (ProphetNet-large 16)."""
    num_decoder_attention_heads: int = 16
    """Decoder attention heads; must divide hidden_size (ProphetNet-large 16)."""
    encoder_ffn_dim: int = 4096
    """Inner width of the encoder's feed-forward blocks (ProphetNet-large 4096)."""
    decoder_ffn_dim: int = 4096
    """Inner width of the decoder's feed-forward blocks (ProphetNet-large 4096)."""
    hidden_act: str = "gelu"
    """Feed-forward activation: gelu (exact, HF `gelu`), gelu_tanh or relu."""
    max_position_embeddings: int = 512
    """Learned positions; sequences may have at most this minus 2 tokens (ProphetNet 512)."""
    ngram: int = 2
    """Predicting streams: tokens predicted ahead at each position (the paper's n = 2)."""
    num_buckets: int = 32
    """Buckets of the decoder's relative position bias (ProphetNet 32)."""
    relative_max_distance: int = 128
    """Offset from which all larger offsets share the last bucket (ProphetNet 128)."""
    hidden_dropout: float = 0.1
    """Dropout on embeddings and residual branches (HF `dropout` 0.1)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities (HF `attention_dropout` 0.1)."""
    activation_dropout: float = 0.1
    """Dropout inside the feed-forward block, after the activation (HF 0.1)."""
    init_std: float = 0.02
    """Std of the normal init of every weight (HF `init_std` 0.02)."""
    decoder_start_token_id: int = 0
    """First decoder input when generating (HF default 0 = pad, as MASS's decoder start here)."""
    eos_token_id: int = 2
    """End-of-sequence id (HF 2; the data's [SEP] in pre-training); 0 = take the data's."""
    dtype: str = "float32"
    """Compute dtype: float32, bfloat16 or float16 (parameters stay float32)."""
    scan_layers: bool = True
    """Run layers under `nnx.scan` (compiled once) or a Python loop; same parameters either way."""
    remat: str = "none"
    """Backprop recompute per layer: none, full, dots (keep x @ W matmuls), dots_saveable (all)."""
    attention_implementation: str = "xla"
    """Kernel of attention without dropout: xla or cudnn (GPU flash, bf16/fp16)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_encoder_layers", "num_decoder_layers",
                     "num_encoder_attention_heads", "num_decoder_attention_heads",
                     "encoder_ffn_dim", "decoder_ffn_dim", "ngram", "num_buckets",
                     "relative_max_distance"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("num_encoder_attention_heads", "num_decoder_attention_heads"):
            if self.hidden_size % getattr(self, name):
                raise ValueError(f"hidden_size {self.hidden_size} is not divisible by "
                                 f"{name} {getattr(self, name)}")
        if self.max_position_embeddings < 3:
            raise ValueError("max_position_embeddings must be >= 3")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {sorted(ACTIVATIONS)}")
        check_rates(self, ("hidden_dropout", "attention_dropout", "activation_dropout"))
        check_execution_fields(self)

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def layer_norm_eps(self) -> float:
        """torch's LayerNorm default, which HF ProphetNet and fairseq use (no config field)."""
        return 1e-5

    @property
    def max_length(self) -> int:
        """The longest encoder or decoder input: positions run 1 .. T and, for the predicting
        streams, 2 .. T + 1, all below max_position_embeddings."""
        return self.max_position_embeddings - 2


def _normal(config: ProphetNetConfig) -> nnx.Initializer:
    return nnx.initializers.normal(config.init_std)


class Attention(nnx.Module):
    """Multi-head attention with biased projections (HF `ProphetNetAttention`); with
    `relative=True` also the query-dependent relative position bias of the decoder's n-stream
    self-attention (HF `ProphetNetNgramSelfAttention.relative_pos_embeddings`)."""

    def __init__(self, config: ProphetNetConfig, num_heads: int, relative: bool, *,
                 rngs: nnx.Rngs):
        d = config.hidden_size
        self.config, self.num_heads = config, num_heads
        init = _normal(config)
        self.query_proj = dense(config, d, d, ("embed", "heads"), rngs, init)
        self.key_proj = dense(config, d, d, ("embed", "heads"), rngs, init)
        self.value_proj = dense(config, d, d, ("embed", "heads"), rngs, init)
        self.out_proj = dense(config, d, d, ("heads", "embed"), rngs, init)
        self.relative_pos_embeddings = (
            dense(config, d, config.num_buckets * num_heads, ("embed", None), rngs, init)
            if relative else None)

    def keys_values(self, memory: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The keys and values of `memory` [B, K, H], [B, K, heads, head_dim] each."""
        k, v = (proj(memory).reshape(*memory.shape[:2], self.num_heads, -1)
                for proj in (self.key_proj, self.value_proj))
        return k, v

    def __call__(self, x: jax.Array, keys_values: tuple[jax.Array, jax.Array],
                 mask: jax.Array, buckets: jax.Array | None, rng: jax.Array | None
                 ) -> jax.Array:
        """`x` [B, Q, H] attends to the `keys_values` of K positions (see `keys_values`)
        where `mask` [B or 1, 1, Q, K]; `buckets` [Q, K] selects each score's relative bias
        (decoder self-attention)."""
        c, heads = self.config, self.num_heads
        attention_rng, output_rng = split_rng(rng, 2)
        q = self.query_proj(x).reshape(*x.shape[:2], heads, -1)
        k, v = keys_values
        bias = None
        if buckets is not None:
            table = self.relative_pos_embeddings(x).reshape(*x.shape[:2], c.num_buckets, heads)
            rows = jnp.arange(x.shape[1])[:, None]
            bias = jnp.transpose(table[:, rows, buckets], (0, 3, 1, 2))  # [B, heads, Q, K]
        context = attention(q, k, v, mask, c.attention_dropout, attention_rng,
                            c.attention_implementation, bias=bias)
        return dropout(self.out_proj(context.reshape(x.shape)), c.hidden_dropout, output_rng)


class FeedForward(nnx.Module):
    """intermediate -> activation -> dropout -> output -> dropout (HF `ProphetNetFeedForward`)."""

    def __init__(self, config: ProphetNetConfig, inner: int, *, rngs: nnx.Rngs):
        self.config = config
        self.intermediate = dense(config, config.hidden_size, inner, ("embed", "mlp"), rngs,
                                  _normal(config))
        self.output = dense(config, inner, config.hidden_size, ("mlp", "embed"), rngs,
                            _normal(config))

    def __call__(self, x: jax.Array, rng: jax.Array | None) -> jax.Array:
        c = self.config
        inner_rng, output_rng = split_rng(rng, 2)
        h = dropout(ACTIVATIONS[c.hidden_act](self.intermediate(x)), c.activation_dropout,
                    inner_rng)
        return dropout(self.output(h), c.hidden_dropout, output_rng)


class Layer(nnx.Module):
    """One post-LN layer: self-attention, cross-attention (decoder), feed-forward, each as
    LayerNorm(x + sublayer(x)) (HF `ProphetNetEncoderLayer` / `ProphetNetDecoderLayer`)."""

    def __init__(self, config: ProphetNetConfig, decoder: bool, *, rngs: nnx.Rngs):
        heads = config.num_decoder_attention_heads if decoder else \
            config.num_encoder_attention_heads
        d = config.hidden_size
        self.self_attn = Attention(config, heads, relative=decoder, rngs=rngs)
        self.self_attn_layer_norm = layer_norm(config, d, rngs)
        self.cross_attn = Attention(config, heads, False, rngs=rngs) if decoder else None
        self.cross_attn_layer_norm = layer_norm(config, d, rngs) if decoder else None
        self.feed_forward = FeedForward(
            config, config.decoder_ffn_dim if decoder else config.encoder_ffn_dim, rngs=rngs)
        self.feed_forward_layer_norm = layer_norm(config, d, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array, buckets: jax.Array | None,
                 encoded: jax.Array | None, cross_mask: jax.Array | None,
                 rng: jax.Array | None, cache: tuple[jax.Array, ...] | None = None,
                 index: jax.Array | int = 0) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """x [B, Q, H] -> (x, the self-attention's keys and values). With `cache` (one layer's
        slice of a `DecoderCache`; incremental decoding, `Decoder.step`) x holds one main
        stream position and its predicting stream 0: the main stream's keys and values are
        written at slot `index` (and returned), the predicting stream's are appended after
        the cached slots for its own query, and cross-attention reads the cached keys and
        values of the encoder states."""
        rngs = split_rng(rng, 3)
        keys_values = self.self_attn.keys_values(x)
        attended = keys_values
        if cache is not None:
            keys_values = tuple(write_slot(old, new[:, :1], index)
                                for old, new in zip(cache[:2], keys_values, strict=True))
            attended = tuple(jnp.concatenate([main, new[:, 1:]], axis=1)
                             for main, new in zip(keys_values, attended, strict=True))
        x = self.self_attn_layer_norm(x + self.self_attn(x, attended, mask, buckets, rngs[0]))
        if self.cross_attn is not None:
            cross = cache[2:] if cache is not None else self.cross_attn.keys_values(encoded)
            x = self.cross_attn_layer_norm(
                x + self.cross_attn(x, cross, cross_mask, None, rngs[1]))
        return self.feed_forward_layer_norm(x + self.feed_forward(x, rngs[2])), keys_values


def _settings(num_layers: int, config: ProphetNetConfig) -> types.SimpleNamespace:
    """What `run_stacked` reads, for one stack."""
    return types.SimpleNamespace(num_layers=num_layers, scan_layers=config.scan_layers,
                                 remat=config.remat)


def _run_layers(layers: nnx.Module, x: jax.Array, num_layers: int, config: ProphetNetConfig,
                rng: jax.Array | None, mask: jax.Array, buckets: jax.Array | None = None,
                encoded: jax.Array | None = None, cross_mask: jax.Array | None = None,
                cache: DecoderCache | None = None, index: jax.Array | int = 0
                ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """The layers over x; with `cache`, also their updated self-attention keys and values."""
    keys = None if rng is None else jax.random.split(rng, num_layers)

    def apply(layer: Layer, h: jax.Array, per_layer):
        key, layer_cache = per_layer
        h, keys_values = layer(h, mask, buckets, encoded, cross_mask, key, layer_cache, index)
        return h, None if layer_cache is None else keys_values

    return run_stacked(layers, apply, x, (keys, None if cache is None else cache.per_layer()),
                       _settings(num_layers, config))


def positions(length: int, config: ProphetNetConfig) -> jax.Array:
    """HF's position ids of a length-`length` input: 1 .. length (pad id 0 + 1 onwards),
    capped at the last row."""
    return jnp.minimum(jnp.arange(1, length + 1) + PAD_ID, config.max_position_embeddings - 1)


def stream_layout(length: int, streams: Sequence[int], relative_max_distance: int,
                  num_buckets: int) -> tuple[np.ndarray, jax.Array]:
    """The decoder's self-attention over the main stream followed by the predicting `streams`
    (each `length` positions): (allowed [Q, Q] bool, relative buckets [Q, Q]) with Q = (1 +
    len(streams)) x length (HF `prepare_attention_mask`, `ngram_attention_bias`,
    `compute_all_stream_relative_buckets`).

    Main query t: main keys 0 .. t, bucket of offset k - t. Predicting stream s, query t: main
    keys k <= t - s or k = 0, bucket of k - (t + 1); its own key t, bucket of offset 0 (HF's
    buffered buckets give it offset +1, which the causal bucketing maps to the same bucket 0).
    """
    t = np.arange(length)
    n = 1 + len(streams)
    allowed = np.zeros((n, length, n, length), bool)
    offsets = np.zeros((n, length, n, length), np.int32)
    allowed[0, :, 0, :] = t[None, :] <= t[:, None]
    offsets[0, :, 0, :] = t[None, :] - t[:, None]
    for a, s in enumerate(streams, start=1):
        allowed[a, :, 0, :] = (t[None, :] <= t[:, None] - s) | (t[None, :] == 0)
        offsets[a, :, 0, :] = t[None, :] - t[:, None] - 1
        allowed[a, :, a, :] = np.eye(length, dtype=bool)
    total = n * length
    buckets = relative_position_bucket(jnp.asarray(offsets.reshape(total, total)),
                                       bidirectional=False, num_buckets=num_buckets,
                                       max_distance=relative_max_distance)
    return allowed.reshape(total, total), buckets


class Encoder(nnx.Module):
    """Token + learned position embeddings, LayerNorm, dropout, post-LN layers (HF
    `ProphetNetEncoder`; the word embeddings are the model's shared table)."""

    def __init__(self, config: ProphetNetConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.position_embeddings = embed(config, config.max_position_embeddings,
                                         config.hidden_size, (None, "embed"), rngs,
                                         _normal(config))
        self.embeddings_layer_norm = layer_norm(config, config.hidden_size, rngs)
        self.layers = stacked_layers(lambda r: Layer(config, False, rngs=r),
                                     config.num_encoder_layers, rngs)

    def __call__(self, embedded: jax.Array, mask: jax.Array, rng: jax.Array | None
                 ) -> jax.Array:
        c = self.config
        embed_rng, layers_rng = split_rng(rng, 2)
        x = embedded + self.position_embeddings(positions(embedded.shape[1], c))
        x = dropout(self.embeddings_layer_norm(x), c.hidden_dropout, embed_rng)
        return _run_layers(self.layers, x, c.num_encoder_layers, c, layers_rng, mask)[0]


class Decoder(nnx.Module):
    """The n-stream decoder (HF `ProphetNetDecoder`): main and predicting streams embedded,
    concatenated along the sequence, LayerNorm, dropout, then the layers with the streams'
    attention layout (`stream_layout`)."""

    def __init__(self, config: ProphetNetConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.position_embeddings = embed(config, config.max_position_embeddings,
                                         config.hidden_size, (None, "embed"), rngs,
                                         _normal(config))
        self.ngram_embeddings = embed(config, config.ngram, config.hidden_size, (None, "embed"),
                                      rngs, _normal(config))
        self.embeddings_layer_norm = layer_norm(config, config.hidden_size, rngs)
        self.layers = stacked_layers(lambda r: Layer(config, True, rngs=r),
                                     config.num_decoder_layers, rngs)

    def __call__(self, embedded: jax.Array, encoded: jax.Array, cross_mask: jax.Array,
                 key_mask: jax.Array | None, streams: Sequence[int], rng: jax.Array | None
                 ) -> jax.Array:
        """[B, 1 + len(streams), T, H]: the main stream, then the predicting `streams`."""
        c = self.config
        batch, length, _ = embedded.shape
        embed_rng, layers_rng = split_rng(rng, 2)
        x = dropout(self.embed_streams(embedded, positions(length, c), streams),
                    c.hidden_dropout, embed_rng)
        allowed, buckets = stream_layout(length, streams, c.relative_max_distance,
                                         c.num_buckets)
        mask = jnp.asarray(allowed)[None, None]
        if key_mask is not None:  # padding of the main stream's keys (HF: not its own keys)
            main_keys = jnp.arange(x.shape[1]) < length
            keep = jnp.tile(key_mask.astype(bool), (1, 1 + len(streams))) | ~main_keys
            mask = mask & keep[:, None, None, :]
        x = _run_layers(self.layers, x, c.num_decoder_layers, c, layers_rng, mask, buckets,
                        encoded, cross_mask)[0]
        return x.reshape(batch, 1 + len(streams), length, -1)

    def embed_streams(self, embedded: jax.Array, main_positions: jax.Array,
                      streams: Sequence[int]) -> jax.Array:
        """The main stream (`embedded` [B, T, H] plus its positions `main_positions` [T]) and
        the predicting `streams` (n-gram row (s - 1) mod ngram plus the next position),
        concatenated along the sequence and layer-normed, [B, (1 + len(streams)) T, H]."""
        c = self.config
        main = embedded + self.position_embeddings(main_positions)
        ahead = self.position_embeddings(
            jnp.minimum(main_positions + 1, c.max_position_embeddings - 1))
        predicting = [jnp.broadcast_to(self.ngram_embeddings.embedding[(s - 1) % c.ngram]
                                       + ahead, main.shape).astype(main.dtype)
                      for s in streams]
        return self.embeddings_layer_norm(jnp.concatenate([main, *predicting], axis=1))

    def step(self, embedded: jax.Array, position: jax.Array, cache: DecoderCache
             ) -> tuple[jax.Array, DecoderCache]:
        """One decoder position per row (HF's decoding with `past_key_values`): the main stream
        `embedded` [N, 1, H] at `position` (a scalar) and predicting stream 0 beside it. The
        main query attends to the cached main positions 0 .. position (bucket of k - t); stream
        0's to the same keys (bucket of k - t - 1) and to itself (bucket 0), as in
        `stream_layout`. Returns stream 0's hidden state [N, H] and the cache."""
        c = self.config
        main_positions = jnp.minimum(jnp.reshape(position, (1,)) + 1 + PAD_ID,
                                     c.max_position_embeddings - 1)
        x = self.embed_streams(embedded, main_positions, (0,))  # [N, 2, H]
        slots = jnp.arange(cache.length)
        seen = slots <= position
        mask = jnp.stack([jnp.append(seen, False), jnp.append(seen, True)])[None, None]
        buckets = relative_position_bucket(
            slots[None, :] - position - jnp.arange(2)[:, None], bidirectional=False,
            num_buckets=c.num_buckets, max_distance=c.relative_max_distance)
        buckets = jnp.concatenate([buckets, jnp.zeros((2, 1), buckets.dtype)], axis=1)
        x, keys_values = _run_layers(self.layers, x, c.num_decoder_layers, c, None, mask,
                                     buckets, None, cache.cross_attention_mask(), cache,
                                     position)
        return x[:, 1], cache.updated(keys_values)

    def cross_keys_values(self, encoded: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Every layer's cross-attention keys and values of `encoded`, [L, B, S, heads,
        head_dim] each."""
        return per_layer_outputs(self.layers, lambda layer: layer.cross_attn.keys_values(encoded),
                                 _settings(self.config.num_decoder_layers, self.config))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ProphetNetOutput:
    """`encoder_hidden_states` [B, S, H]; the decoder's main stream `decoder_hidden_states`
    [B, T, H] and its `logits` [B, T, V] (no loss trains them); the predicting streams'
    `ngram_hidden_states` [B, ngram, T, H] and `ngram_logits` [B, ngram, T, V]
    (`ngram_logits[:, 0]` is HF's `logits`, `[:, 1:]` its `logits_ngram`)."""

    encoder_hidden_states: jax.Array
    decoder_hidden_states: jax.Array
    logits: jax.Array
    ngram_hidden_states: jax.Array
    ngram_logits: jax.Array


class ProphetNet(nnx.Module):
    """ProphetNet for conditional generation: shared word embeddings, encoder, n-stream decoder,
    the output projection tied to the word embeddings (HF `ProphetNetForConditionalGeneration`,
    whose `lm_head` is tied to `prophetnet.word_embeddings`)."""

    def __init__(self, config: ProphetNetConfig, *, rngs: nnx.Rngs):
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self.word_embeddings = embed(config, config.vocab_size, config.hidden_size,
                                         ("vocab", "embed"), rngs, _normal(config))
            self.encoder = Encoder(config, rngs=rngs)
            self.decoder = Decoder(config, rngs=rngs)

    def encode(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
               rng: jax.Array | None = None) -> jax.Array:
        """Encoder hidden states [B, S, H]; `attention_mask` defaults to `input_ids != 0`."""
        if attention_mask is None:
            attention_mask = input_ids != PAD_ID
        mask = attention_mask.astype(bool)[:, None, None, :]
        return self.encoder(self.word_embeddings(input_ids), mask, rng)

    def decode_streams(self, decoder_input_ids: jax.Array, encoded: jax.Array,
                       attention_mask: jax.Array, decoder_attention_mask: jax.Array | None = None,
                       rng: jax.Array | None = None, streams: Sequence[int] | None = None
                       ) -> jax.Array:
        """[B, 1 + len(streams), T, H]: the main stream and the predicting `streams` (default
        all `ngram`) after the last layer, cross-attending to the non-pad encoder positions."""
        streams = tuple(range(self.config.ngram)) if streams is None else tuple(streams)
        cross_mask = attention_mask.astype(bool)[:, None, None, :]
        return self.decoder(self.word_embeddings(decoder_input_ids), encoded, cross_mask,
                            decoder_attention_mask, streams, rng)

    def decode(self, decoder_input_ids: jax.Array, encoded: jax.Array,
               attention_mask: jax.Array, decoder_attention_mask: jax.Array | None = None,
               rng: jax.Array | None = None) -> jax.Array:
        """The next-token stream for generation, [B, T, H]: predicting stream 0, computed with
        the main stream only beside it (causal: position t sees decoder inputs 0 .. t)."""
        return self.decode_streams(decoder_input_ids, encoded, attention_mask,
                                   decoder_attention_mask, rng, streams=(0,))[:, 1]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """The output projection, tied to the word embeddings (no bias)."""
        return self.word_embeddings.attend(hidden)

    def prefill_decoder(self, encoded: jax.Array, attention_mask: jax.Array, length: int
                        ) -> DecoderCache:
        """The cache of incremental decoding (`models.beam_search`): the main stream's keys
        and values for `length` positions, and the cross-attention keys and values of
        `encoded` [N, S, H] at the source tokens `attention_mask` [N, S]."""
        return DecoderCache.start(self.decoder.cross_keys_values(encoded), attention_mask,
                                  length)

    def decode_step(self, token: jax.Array, position: jax.Array, cache: DecoderCache
                    ) -> tuple[jax.Array, DecoderCache]:
        """The next-token logits [N, V] (stream 0) after the decoder input `token` [N] at
        `position`, and the cache with the main stream's keys and values; equal to
        `logits(decode(...))` at that position."""
        hidden, cache = self.decoder.step(self.word_embeddings(token[:, None]), position, cache)
        return self.logits(hidden), cache

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        decoder_input_ids: jax.Array | None = None,
        decoder_attention_mask: jax.Array | None = None,
        *,
        rng: jax.Array | None = None,
    ) -> ProphetNetOutput:
        """Teacher-forced forward pass of every stream; `rng` enables dropout (None =
        deterministic)."""
        if attention_mask is None:
            attention_mask = input_ids != PAD_ID
        encoder_rng, decoder_rng = split_rng(rng, 2)
        encoded = self.encode(input_ids, attention_mask, encoder_rng)
        decoded = self.decode_streams(decoder_input_ids, encoded, attention_mask,
                                      decoder_attention_mask, decoder_rng)
        return ProphetNetOutput(
            encoder_hidden_states=encoded, decoder_hidden_states=decoded[:, 0],
            logits=self.logits(decoded[:, 0]), ngram_hidden_states=decoded[:, 1:],
            ngram_logits=self.logits(decoded[:, 1:]))
