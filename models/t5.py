"""T5: the encoder-decoder Transformer of Raffel et al. 2020 (§2.1, §3.1.2) in Flax NNX.

Reference: google-research/text-to-text-transfer-transformer (Mesh TensorFlow) and HF
transformers modeling_t5.py (`T5ForConditionalGeneration`), whose weights convert one-to-one
(`pretrain/hf.py`) and which is the parity oracle (tests/test_t5.py).

What makes it T5 rather than BERT: pre-norm residual blocks whose LayerNorm only rescales
(RMS over the features in float32, no mean subtraction, no bias), no biases anywhere, no
1/sqrt(d) scaling of attention scores (the initialisation absorbs it), and a scalar relative
position bias per head instead of position embeddings: key-query offsets are bucketed
(`models.layers.relative_position_bucket`: bidirectional in the encoder, causal in the
decoder), each stack holds one [buckets, heads] table (HF keeps it in the first block) that
every layer of the stack adds to its self-attention scores, and cross-attention has none. The
feed-forward is `relu` (T5 v1.0) or a gated GELU (`gated-gelu`, v1.1: gelu_new(x wi_0) * x wi_1).
With `tie_word_embeddings` (v1.0) the LM head is the shared embedding applied to the decoder
output rescaled by d_model**-0.5; v1.1 has its own `lm_head`. The attention inner size is
num_heads * head_size, which need not equal hidden_size.

Language embeddings (`num_languages` > 0; not in T5, for MASS's bilingual setting, Song et al.
2019 §3.1, on XLM's `TransformerModel`): one [num_languages, d_model] table, shared by the
encoder and the decoder as the token embedding is, whose row for each token's language
(`language_ids`) is added to the token embedding before the stack's embedding dropout. With
the default 0 there is no table and the model is HF's T5.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.layers import (
    ACTIVATIONS,
    DecoderCache,
    Embedding,
    attention,
    check_execution_fields,
    check_rates,
    dropout,
    embed,
    per_layer_outputs,
    relative_position_bucket,
    run_stacked,
    split_rng,
    stacked_layers,
    write_slot,
)

# HF `feed_forward_proj` -> (our activation, gated). `gated-gelu` is HF's gelu_new, the tanh
# approximation (configuration_t5.py), as the released v1.1 checkpoints were trained with.
FEED_FORWARD = {"relu": ("relu", False), "gelu": ("gelu", False),
                "gated-gelu": ("gelu_tanh", True), "gated-relu": ("relu", True)}
PAD_ID = 0  # T5's padding id, also the decoder's start token


@dataclasses.dataclass(frozen=True)
class T5Config:
    """T5 hyper-parameters (HF `T5Config` names in brackets): hidden_size [d_model],
    num_layers (encoder) and num_decoder_layers (0 = num_layers), num_heads, head_size [d_kv],
    intermediate_size [d_ff], feed_forward_proj (`relu`, `gelu`, `gated-gelu`, `gated-relu`),
    relative_attention_num_buckets / relative_attention_max_distance, layer_norm_eps
    [layer_norm_epsilon], hidden_dropout and attention_dropout [both HF's dropout_rate],
    initializer_factor, tie_word_embeddings. `vocab_size` 0 and `eos_token_id` 0 mean "take
    them from the data" (pre-training fills them in). `dtype` is the compute dtype (parameters
    are float32); `scan_layers`, `remat` and `attention_implementation` as in
    `models.layers.TransformerConfig`."""

    vocab_size: int = 32128
    """Vocabulary incl. sentinels (T5 32128); 0 = the data's (tokenizer + extra_ids)."""
    hidden_size: int = 512
    """Model width, HF `d_model` (T5-Small 512, Base 768)."""
    num_layers: int = 6
    """Encoder layers, and decoder layers unless num_decoder_layers is set (T5-Small 6, Base 12)."""
    num_decoder_layers: int = 0
    """Decoder layers; 0 = num_layers (HF `num_decoder_layers`)."""
    num_heads: int = 8
    """Attention heads (T5-Small 8, Base 12)."""
    head_size: int = 64
    """Width of each head, HF `d_kv` (T5 64); num_heads x head_size need not be hidden_size."""
    intermediate_size: int = 2048
    """Inner width of the feed-forward block, HF `d_ff` (T5-Small 2048, Base 3072)."""
    feed_forward_proj: str = "relu"
    """Feed-forward type: relu (T5 v1.0), gelu, gated-gelu (v1.1, tanh GELU) or gated-relu."""
    relative_attention_num_buckets: int = 32
    """Buckets of the relative position bias (T5 32)."""
    relative_attention_max_distance: int = 128
    """Offset from which all larger offsets share the last bucket (T5 128)."""
    layer_norm_eps: float = 1e-6
    """Epsilon of T5's RMS LayerNorm (HF `layer_norm_epsilon` 1e-6)."""
    hidden_dropout: float = 0.1
    """Dropout on embeddings, residual branches and FFN inner layer (HF `dropout_rate` 0.1)."""
    attention_dropout: float = 0.1
    """Dropout on the attention probabilities (HF uses `dropout_rate` for both, 0.1)."""
    initializer_factor: float = 1.0
    """Multiplier of every init std (HF `initializer_factor` 1.0)."""
    tie_word_embeddings: bool = True
    """LM head = shared embedding on outputs x d_model**-0.5 (v1.0 true; v1.1 false)."""
    eos_token_id: int = 1
    """End-of-sequence id, checked against the data's [SEP] (T5 1); 0 = take the data's."""
    num_languages: int = 0
    """Rows of the language embedding added to the token embeddings (MASS bilingual); 0 = none."""
    dtype: str = "float32"
    """Compute dtype: float32, bfloat16 or float16 (parameters stay float32)."""
    scan_layers: bool = True
    """Run layers under `nnx.scan` (compiled once) or a Python loop; same parameters either way."""
    remat: str = "none"
    """Backprop recompute per layer: none, full, dots (keep x @ W matmuls), dots_saveable (all)."""
    attention_implementation: str = "xla"
    """Kernel of attention without dropout: xla or cudnn (GPU flash, bf16/fp16)."""

    def __post_init__(self) -> None:
        if self.feed_forward_proj not in FEED_FORWARD:
            raise ValueError(f"feed_forward_proj {self.feed_forward_proj!r} must be one of "
                             f"{sorted(FEED_FORWARD)}")
        for name in ("hidden_size", "num_layers", "num_heads", "head_size", "intermediate_size",
                     "relative_attention_num_buckets", "relative_attention_max_distance"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_decoder_layers < 0:
            raise ValueError("num_decoder_layers must be >= 0 (0 = num_layers)")
        if self.num_languages < 0:
            raise ValueError("num_languages must be >= 0 (0 = no language embeddings)")
        check_rates(self, ("hidden_dropout", "attention_dropout"))
        if not self.layer_norm_eps > 0:
            raise ValueError(f"layer_norm_eps={self.layer_norm_eps} must be > 0")
        check_execution_fields(self)

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def decoder_start_token_id(self) -> int:
        """The first decoder input (HF `decoder_start_token_id`): the padding id, as T5's."""
        return PAD_ID

    @property
    def decoder_layers(self) -> int:
        return self.num_decoder_layers or self.num_layers

    @property
    def activation(self) -> str:
        return FEED_FORWARD[self.feed_forward_proj][0]

    @property
    def gated(self) -> bool:
        return FEED_FORWARD[self.feed_forward_proj][1]


def _linear(config: T5Config, in_features: int, out_features: int,
            axes: tuple[str | None, str | None], stddev: float, rngs: nnx.Rngs) -> nnx.Linear:
    """A bias-free Linear with T5's normal(0, stddev) init (HF `_init_weights`, scaled by
    `initializer_factor`)."""
    return nnx.Linear(
        in_features, out_features, use_bias=False, dtype=config.compute_dtype,
        kernel_init=nnx.with_partitioning(
            nnx.initializers.normal(config.initializer_factor * stddev), axes),
        rngs=rngs)


def _rms_norm(config: T5Config, rngs: nnx.Rngs) -> nnx.RMSNorm:
    """T5's LayerNorm: x * rsqrt(mean(x^2) + eps) * scale, statistics in float32."""
    return nnx.RMSNorm(
        config.hidden_size, epsilon=config.layer_norm_eps, dtype=config.compute_dtype,
        scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("norm",)), rngs=rngs)


def _embed(config: T5Config, num: int, features: int, axes: tuple[str | None, str | None],
           stddev: float, rngs: nnx.Rngs) -> Embedding:
    return embed(config, num, features, axes, rngs,
                 nnx.initializers.normal(config.initializer_factor * stddev))


class T5Attention(nnx.Module):
    """Multi-head attention without biases or score scaling (HF `T5Attention`)."""

    def __init__(self, config: T5Config, *, rngs: nnx.Rngs):
        d, inner = config.hidden_size, config.inner_size
        self.config = config
        self.q = _linear(config, d, inner, ("embed", "heads"), (d * config.head_size) ** -0.5,
                         rngs)
        self.k = _linear(config, d, inner, ("embed", "heads"), d ** -0.5, rngs)
        self.v = _linear(config, d, inner, ("embed", "heads"), d ** -0.5, rngs)
        self.o = _linear(config, inner, d, ("heads", "embed"), inner ** -0.5, rngs)

    def keys_values(self, memory: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The keys and values of `memory` [B, S, H], each [B, S, heads, head_size]."""
        c = self.config
        k, v = (proj(memory).reshape(*memory.shape[:2], c.num_heads, c.head_size)
                for proj in (self.k, self.v))
        return k, v

    def __call__(self, x: jax.Array, keys_values: tuple[jax.Array, jax.Array], mask: jax.Array,
                 bias: jax.Array | None, rng: jax.Array | None) -> jax.Array:
        """Queries from `x` [B, T, H] over `keys_values` (see `keys_values`)."""
        c = self.config
        q = self.q(x).reshape(*x.shape[:2], c.num_heads, c.head_size)
        context = attention(q, *keys_values, mask, c.attention_dropout, rng,
                            c.attention_implementation, bias=bias, scale=1.0)
        return self.o(context.reshape(*x.shape[:2], c.inner_size))


class T5Block(nnx.Module):
    """One pre-norm block (HF `T5Block`): self-attention, cross-attention (decoder only) and the
    feed-forward, each as x + dropout(sublayer(norm(x)))."""

    def __init__(self, config: T5Config, decoder: bool, *, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        self.config = config
        self.self_attention_norm = _rms_norm(config, rngs)
        self.self_attention = T5Attention(config, rngs=rngs)
        self.cross_attention_norm = _rms_norm(config, rngs) if decoder else None
        self.cross_attention = T5Attention(config, rngs=rngs) if decoder else None
        self.ffn_norm = _rms_norm(config, rngs)
        if config.gated:
            self.wi_0 = _linear(config, d, f, ("embed", "mlp"), d ** -0.5, rngs)
            self.wi_1 = _linear(config, d, f, ("embed", "mlp"), d ** -0.5, rngs)
        else:
            self.wi = _linear(config, d, f, ("embed", "mlp"), d ** -0.5, rngs)
        self.wo = _linear(config, f, d, ("mlp", "embed"), f ** -0.5, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array, bias: jax.Array,
                 encoded: jax.Array | None, cross_mask: jax.Array | None,
                 rng: jax.Array | None, cache: tuple[jax.Array, ...] | None = None,
                 index: jax.Array | int = 0) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """x [B, T, H] -> (x, the self-attention's keys and values). With `cache` (one layer's
        slice of a `DecoderCache`) this step's keys and values are written at slot `index`,
        the queries attend over all slots, and cross-attention reads the cached keys and values
        of the encoder states instead of `encoded`."""
        c = self.config
        rngs = split_rng(rng, 6)
        h = self.self_attention_norm(x)
        keys_values = self.self_attention.keys_values(h)
        if cache is not None:
            keys_values = tuple(write_slot(old, new, index)
                                for old, new in zip(cache[:2], keys_values, strict=True))
        x = x + dropout(self.self_attention(h, keys_values, mask, bias, rngs[0]),
                        c.hidden_dropout, rngs[1])
        if self.cross_attention is not None:
            h = self.cross_attention_norm(x)
            cross = (cache[2:] if cache is not None
                     else self.cross_attention.keys_values(encoded))
            x = x + dropout(self.cross_attention(h, cross, cross_mask, None, rngs[2]),
                            c.hidden_dropout, rngs[3])
        h = self.ffn_norm(x)
        act = ACTIVATIONS[c.activation]
        inner = act(self.wi_0(h)) * self.wi_1(h) if c.gated else act(self.wi(h))
        y = self.wo(dropout(inner, c.hidden_dropout, rngs[4]))
        return x + dropout(y, c.hidden_dropout, rngs[5]), keys_values


class T5Stack(nnx.Module):
    """The encoder or the decoder (HF `T5Stack`): dropout on the embeddings, the stacked blocks
    (the relative position bias computed once from this stack's table and passed to every
    layer), the final RMS norm and dropout."""

    def __init__(self, config: T5Config, decoder: bool, *, rngs: nnx.Rngs):
        self.config = config
        self.decoder = decoder
        self.num_layers = config.decoder_layers if decoder else config.num_layers
        self.relative_attention_bias = _embed(config, config.relative_attention_num_buckets,
                                              config.num_heads, (None, "heads"),
                                              config.hidden_size ** -0.5, rngs)
        self.layers = stacked_layers(lambda r: T5Block(config, decoder, rngs=r),
                                     self.num_layers, rngs)
        self.final_layer_norm = _rms_norm(config, rngs)

    @property
    def settings(self) -> T5Config:
        """The config with this stack's layer count (what `run_stacked` reads)."""
        return dataclasses.replace(self.config, num_layers=self.num_layers)

    def position_bias(self, queries: jax.Array, keys: jax.Array) -> jax.Array:
        """[1, heads, Q, K]: the table's value for the bucket of each key-query offset
        (`queries` [Q] and `keys` [K] positions)."""
        c = self.config
        buckets = relative_position_bucket(
            keys[None, :] - queries[:, None], bidirectional=not self.decoder,
            num_buckets=c.relative_attention_num_buckets,
            max_distance=c.relative_attention_max_distance)
        return jnp.transpose(self.relative_attention_bias(buckets), (2, 0, 1))[None]

    def __call__(self, x: jax.Array, mask: jax.Array, encoded: jax.Array | None,
                 cross_mask: jax.Array | None, rng: jax.Array | None) -> jax.Array:
        positions = jnp.arange(x.shape[1])
        return self.run(x, mask, self.position_bias(positions, positions), encoded, cross_mask,
                        rng)[0]

    def run(self, x: jax.Array, mask: jax.Array, bias: jax.Array, encoded: jax.Array | None,
            cross_mask: jax.Array | None, rng: jax.Array | None,
            cache: DecoderCache | None = None, index: jax.Array | int = 0
            ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """The embeddings `x` through dropout, the blocks, the final norm and dropout; with
        `cache`, also the blocks' updated self-attention keys and values (see `T5Block`)."""
        c = self.config
        embed_rng, layers_rng, final_rng = split_rng(rng, 3)
        keys = None if layers_rng is None else jax.random.split(layers_rng, self.num_layers)

        def apply(layer: T5Block, h: jax.Array, per_layer):
            key, layer_cache = per_layer
            h, keys_values = layer(h, mask, bias, encoded, cross_mask, key, layer_cache, index)
            return h, None if layer_cache is None else keys_values

        h, keys_values = run_stacked(
            self.layers, apply, dropout(x, c.hidden_dropout, embed_rng),
            (keys, None if cache is None else cache.per_layer()), self.settings)
        return dropout(self.final_layer_norm(h), c.hidden_dropout, final_rng), keys_values

    def cross_keys_values(self, encoded: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Every decoder block's cross-attention keys and values of `encoded`, [L, B, S,
        heads, head_size] each."""
        return per_layer_outputs(self.layers,
                                 lambda layer: layer.cross_attention.keys_values(encoded),
                                 self.settings)

    def step(self, x: jax.Array, position: jax.Array, cache: DecoderCache
             ) -> tuple[jax.Array, DecoderCache]:
        """One decoder position per row: `x` [N, 1, H] embedded at `position` (a scalar, the
        same for every row) attends to the cached positions before it (HF's decoding with
        `past_key_values`: the bias of the last query row) -> ([N, 1, H], the cache)."""
        bias = self.position_bias(jnp.reshape(position, (1,)), jnp.arange(cache.length))
        h, keys_values = self.run(x, cache.self_mask(position), bias, None,
                                  cache.cross_attention_mask(), None, cache, position)
        return h, cache.updated(keys_values)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class T5Output:
    """`encoder_hidden_states` [B, S, H] (after the encoder's final norm), `decoder_hidden_states`
    [B, T, H] and `logits` [B, T, V]."""

    encoder_hidden_states: jax.Array
    decoder_hidden_states: jax.Array
    logits: jax.Array


class T5(nnx.Module):
    """T5 for conditional generation: shared embedding, encoder, decoder, LM head (HF
    `T5ForConditionalGeneration`)."""

    def __init__(self, config: T5Config, *, rngs: nnx.Rngs):
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self.shared = _embed(config, config.vocab_size, config.hidden_size,
                                 ("vocab", "embed"), 1.0, rngs)
            self.encoder = T5Stack(config, decoder=False, rngs=rngs)
            self.decoder = T5Stack(config, decoder=True, rngs=rngs)
            self.lm_head = (None if config.tie_word_embeddings else
                            _linear(config, config.hidden_size, config.vocab_size,
                                    ("embed", "vocab"), 1.0, rngs))
            self.language_embeddings = (
                _embed(config, config.num_languages, config.hidden_size, (None, "embed"), 1.0,
                       rngs) if config.num_languages else None)

    def embed(self, ids: jax.Array, language_ids: jax.Array | None) -> jax.Array:
        """Token embeddings, plus each token's language embedding when the model has them
        (`language_ids` must then be given, and only then)."""
        x = self.shared(ids)
        if (language_ids is None) != (self.language_embeddings is None):
            raise ValueError(f"language_ids must be given exactly when the model has language "
                             f"embeddings (num_languages={self.config.num_languages})")
        if language_ids is None:
            return x
        return x + self.language_embeddings(language_ids)

    def encode(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
               rng: jax.Array | None = None, *, language_ids: jax.Array | None = None
               ) -> jax.Array:
        """Encoder hidden states [B, S, H] (`language_ids` [B, S]: see `embed`)."""
        if attention_mask is None:
            attention_mask = input_ids != PAD_ID
        mask = attention_mask.astype(bool)[:, None, None, :]
        return self.encoder(self.embed(input_ids, language_ids), mask, None, None, rng)

    def decode(self, decoder_input_ids: jax.Array, encoded: jax.Array,
               attention_mask: jax.Array, decoder_attention_mask: jax.Array | None = None,
               rng: jax.Array | None = None, *, language_ids: jax.Array | None = None
               ) -> jax.Array:
        """Decoder hidden states: causal self-attention (and `decoder_attention_mask` over its
        keys, if given) and cross-attention to the non-pad encoder positions (`language_ids`
        [B, T]: the decoder tokens' languages, see `embed`)."""
        length = decoder_input_ids.shape[1]
        mask = jnp.tril(jnp.ones((length, length), bool))[None, None]
        if decoder_attention_mask is not None:
            mask = mask & decoder_attention_mask.astype(bool)[:, None, None, :]
        cross_mask = attention_mask.astype(bool)[:, None, None, :]
        return self.decoder(self.embed(decoder_input_ids, language_ids), mask, encoded,
                            cross_mask, rng)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Tied (v1.0): the shared embedding on hidden * d_model**-0.5; untied: `lm_head`."""
        if self.lm_head is None:
            return self.shared.attend(hidden * self.config.hidden_size ** -0.5)
        return self.lm_head(hidden)

    def prefill_decoder(self, encoded: jax.Array, attention_mask: jax.Array, length: int
                        ) -> DecoderCache:
        """The cache of incremental decoding (`models.beam_search`) for `length` decoder
        positions, with the cross-attention keys and values of `encoded` [N, S, H] at the
        source tokens `attention_mask` [N, S]."""
        return DecoderCache.start(self.decoder.cross_keys_values(encoded), attention_mask,
                                  length)

    def decode_step(self, token: jax.Array, position: jax.Array, cache: DecoderCache, *,
                    language_ids: jax.Array | None = None) -> tuple[jax.Array, DecoderCache]:
        """The next-token logits [N, V] after the decoder input `token` [N] at `position` (its
        language `language_ids` [N] for a model with language embeddings), and the cache with
        its keys and values; equal to `logits(decode(...))` at that position."""
        languages = None if language_ids is None else language_ids[:, None]
        hidden, cache = self.decoder.step(self.embed(token[:, None], languages), position, cache)
        return self.logits(hidden[:, 0]), cache

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        decoder_input_ids: jax.Array | None = None,
        decoder_attention_mask: jax.Array | None = None,
        *,
        rng: jax.Array | None = None,
        language_ids: jax.Array | None = None,
        decoder_language_ids: jax.Array | None = None,
        cross_attention_mask: jax.Array | None = None,
    ) -> T5Output:
        """Teacher-forced forward pass; `attention_mask` defaults to `input_ids != 0`, `rng`
        enables dropout (None = deterministic); the language ids of the encoder and decoder
        tokens only for a model with language embeddings. `cross_attention_mask` [B, S]: the
        encoder positions the decoder may attend to, if fewer than `attention_mask`'s (XLM's
        `enc_mask` in `TransformerModel.fwd`)."""
        if attention_mask is None:
            attention_mask = input_ids != PAD_ID
        encoder_rng, decoder_rng = split_rng(rng, 2)
        encoded = self.encode(input_ids, attention_mask, encoder_rng, language_ids=language_ids)
        if cross_attention_mask is None:
            cross_attention_mask = attention_mask
        decoded = self.decode(decoder_input_ids, encoded, cross_attention_mask,
                              decoder_attention_mask, decoder_rng,
                              language_ids=decoder_language_ids)
        return T5Output(encoder_hidden_states=encoded, decoder_hidden_states=decoded,
                        logits=self.logits(decoded))


def shift_right(targets: jax.Array) -> jax.Array:
    """Decoder inputs for teacher forcing: the targets shifted one to the right, starting with
    the decoder start token (= pad, 0), as HF `_shift_right` and T5's feature converter."""
    return jnp.concatenate(
        [jnp.full((targets.shape[0], 1), PAD_ID, targets.dtype), targets[:, :-1]], axis=1)
