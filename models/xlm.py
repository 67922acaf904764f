"""XLM: the cross-lingual Transformer of Lample & Conneau 2019 (§3), one post-LN encoder with
token, position and language embeddings and a prediction layer tied to the token embeddings,
run bidirectionally (MLM, TLM) or causally (CLM).

Reference: facebookresearch/XLM src/model/transformer.py (`TransformerModel.fwd`,
`PredLayer`, `create_sinusoidal_embeddings`) and HF transformers modeling_xlm.py
(`XLMWithLMHeadModel`, the parity oracle): embeddings = token + position (+ language), then
LayerNorm and dropout; each layer is self-attention, dropout, residual, LayerNorm, then the
feed-forward block (4 x hidden, GELU or ReLU), dropout, residual, LayerNorm; padded positions
are zeroed after the embeddings and after every layer; the prediction layer is the transposed
token embedding plus a bias (no transform in between, unlike BERT's head). Its layers are the
shared `EncoderLayer` (same post-LN block), stacked and run by `run_stacked`.

Translation (§5.2): `is_decoder` adds the reference's cross-attention to each layer
(`XLMDecoderLayer`), `XLMTranslation` pairs an XLM encoder with such a decoder behind the
encode / decode / logits interface of greedy decoding, and `translation_from_pretrained`
starts both from one pretrained XLM (reference: `build_model` with `--reload_model`). The
decoder takes explicit `position_ids` (a decoder that reads a fragment of a sentence at the
fragment's positions in it) and, with `cross_output_per_language`, one cross-attention output
projection per language (microsoft/MASS MASS-unsupNMT/src/model/transformer.py,
`MultiHeadAttention(n_langs=...)` under `attention_setting` v1, its default).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.models.encoder import EncoderLayer, heads_keys_values, post_ln_attend
from pretext_jax.models.gpt import causal_mask
from pretext_jax.models.layers import (
    DecoderCache,
    TransformerConfig,
    dense,
    dropout,
    embed,
    layer_norm,
    per_layer_outputs,
    run_stacked,
    split_rng,
    stacked_layers,
    write_slot,
)


@dataclasses.dataclass(frozen=True)
class XLMConfig(TransformerConfig):
    """XLM's hyper-parameters (HF `XLMConfig` defaults; HF names where they differ:
    hidden_size [emb_dim], num_layers [n_layers], num_heads [n_heads], hidden_dropout
    [dropout], vocab_size [n_words], initializer_range [init_std], pad_token_id [pad_index]).
    The feed-forward width is 4 x hidden_size and the activation exact GELU or ReLU, as in
    the reference (`hidden_dim = 4 * dim`, `gelu_activation`)."""

    vocab_size: int = 30145
    hidden_size: int = 2048
    num_heads: int = 16
    intermediate_size: int = 8192
    max_position_embeddings: int = 512
    """Rows of the position table (XLM `N_MAX_POSITIONS` 512)."""
    n_langs: int = 1
    """Languages; a language embedding exists when n_langs > 1 and `use_lang_emb` (0 = the
    data's, when pre-training)."""
    use_lang_emb: bool = True
    """Add a learned language embedding to every token (§3.3; HF `use_lang_emb`)."""
    sinusoidal_embeddings: bool = False
    """Fixed sinusoidal positions (the reference's option; not a parameter) instead of learned."""
    causal: bool = False
    """Left-to-right attention (the CLM objective, §3.1); False = bidirectional (MLM, TLM)."""
    is_decoder: bool = False
    """A translation decoder (§5.2; the reference's `TransformerModel(is_encoder=False)`): each
    layer adds cross-attention to the encoder's states (`encoder_attn`, `layer_norm15`) between
    its causal self-attention and its feed-forward block. Needs `causal`."""
    cross_output_per_language: bool = False
    """A decoder's cross-attention has one output projection per language (n_langs of them,
    when the model has language embeddings), each row using its language's (the largest
    language id of the row, as the reference's `langs.max()` of a one-language batch); False =
    one projection, as facebookresearch/XLM."""
    embed_init_std: float = 2048 ** -0.5
    """Std of the embedding init, N(0, dim ** -0.5) in the reference (HF `embed_init_std`)."""
    pad_token_id: int = 2
    """The padding id (XLM's dictionary: 2); the attention mask defaults to ids != it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.is_xlm:
            return
        if self.intermediate_size != 4 * self.hidden_size:
            raise ValueError(f"XLM's feed-forward is 4 x hidden_size; set intermediate_size="
                             f"{4 * self.hidden_size} (not {self.intermediate_size})")
        if self.hidden_act not in ("gelu", "relu"):
            raise ValueError(f"XLM's activation is gelu or relu, not {self.hidden_act!r}")
        if self.n_langs < 0 or self.max_position_embeddings < 1 or self.embed_init_std < 0:
            raise ValueError("n_langs must be >= 0 (0 = from the data), max_position_embeddings "
                             ">= 1 and embed_init_std >= 0")
        if self.is_decoder and not self.causal:
            raise ValueError("an XLM decoder (is_decoder) is causal; set causal=True")

    @property
    def has_lang_embeddings(self) -> bool:
        return self.n_langs > 1 and self.use_lang_emb

    @property
    def cross_outputs(self) -> int:
        """The decoder's cross-attention output projections: one per language with
        `cross_output_per_language` (and language embeddings), else one."""
        return self.n_langs if self.cross_output_per_language and self.has_lang_embeddings else 1

    @property
    def is_xlm(self) -> bool:
        """Whether these fields describe an XLM, so that XLM's checks apply (a config holding
        several families' fields, as fine-tuning's, tells by its head)."""
        return True


def sinusoidal_positions(num: int, dim: int) -> np.ndarray:
    """[num, dim] float32: row p, column j is sin (even j) or cos (odd j) of
    p / 10000 ** (2 * (j // 2) / dim) (`create_sinusoidal_embeddings`, interleaved)."""
    angles = (np.arange(num)[:, None]
              / np.power(10000, 2 * (np.arange(dim)[None] // 2) / dim))
    return np.where(np.arange(dim)[None] % 2 == 0, np.sin(angles), np.cos(angles)).astype(
        np.float32)


class XLMDecoderLayer(EncoderLayer):
    """A decoder layer of the reference's `TransformerModel(is_encoder=False)`: causal
    self-attention, LayerNorm (`layer_norm1`); cross-attention to the encoder (`encoder_attn`),
    LayerNorm (`layer_norm15`); feed-forward, LayerNorm (`layer_norm2`); post-LN each, dropout on
    every block's output. The self-attention and feed-forward parameters are named as the
    encoder's `EncoderLayer`, so a pretrained XLM's load into it one to one. With
    `config.cross_outputs` = n > 1, `cross_output` holds the n languages' projections side by
    side ([H, n H]: language l's is columns l H .. (l + 1) H)."""

    def __init__(self, config: XLMConfig, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        h = config.hidden_size
        self.cross_query = dense(config, h, h, ("embed", "heads"), rngs)
        self.cross_key = dense(config, h, h, ("embed", "heads"), rngs)
        self.cross_value = dense(config, h, h, ("embed", "heads"), rngs)
        self.cross_output = dense(config, h, config.cross_outputs * h, ("heads", "embed"), rngs)
        self.cross_layer_norm = layer_norm(config, h, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array,  # type: ignore[override]
                 encoded: jax.Array | None, cross_mask: jax.Array, rng: jax.Array | None,
                 language: jax.Array | None = None, cache: tuple[jax.Array, ...] | None = None,
                 index: jax.Array | int = 0) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """`x` [B, T, H] with its causal `mask` [B, 1, T, T]; `encoded` [B, S, H] with
        `cross_mask` [B, 1, 1, S] (True = a source token); `language` [B], each row's language
        (needed with several cross-attention outputs) -> ([B, T, H], the self-attention's keys
        and values). With `cache` (one layer's slice of a `DecoderCache`), this step's keys and
        values go to slot `index` and cross-attention reads the cached ones of the encoder
        states."""
        c = self.config
        rngs = split_rng(rng, 5)
        keys_values = heads_keys_values(c, (self.key, self.value), x)
        if cache is not None:
            keys_values = tuple(write_slot(old, new, index)
                                for old, new in zip(cache[:2], keys_values, strict=True))
        x = post_ln_attend(c, (self.query, self.attention_output), self.attention_layer_norm, x,
                           keys_values, mask, rngs[0], rngs[1])

        def cross_output(context: jax.Array) -> jax.Array:  # [B, T, H] -> [B, T, H]
            out = self.cross_output(context)
            if c.cross_outputs == 1:
                return out
            out = out.reshape(*context.shape[:2], c.cross_outputs, c.hidden_size)
            return jnp.take_along_axis(out, language[:, None, None, None], axis=2)[:, :, 0]

        cross = cache[2:] if cache is not None else self.cross_keys_values(encoded)
        x = post_ln_attend(c, (self.cross_query, cross_output), self.cross_layer_norm, x,
                           cross, cross_mask, rngs[2], rngs[3])
        return self.feed_forward(x, rngs[4]), keys_values

    def cross_keys_values(self, encoded: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The cross-attention's keys and values of `encoded` [B, S, H], [B, S, N, D] each."""
        return heads_keys_values(self.config, (self.cross_key, self.cross_value), encoded)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class XLMOutput:
    """`hidden_states` [B, T, H] (zero at padding) and `logits` [B, T, V] (or [B, P, V] at
    `masked_positions`)."""

    hidden_states: jax.Array
    logits: jax.Array


class XLM(nnx.Module):
    """XLM with its prediction layer (HF `XLMWithLMHeadModel` without adaptive softmax);
    `with_output=False` leaves the prediction layer's bias out (the reference's `with_output`;
    HF `XLMModel`), for a classifier on top."""

    def __init__(self, config: XLMConfig, *, rngs: nnx.Rngs, with_output: bool = True):
        h = config.hidden_size
        normal = nnx.initializers.normal(config.embed_init_std)
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self.word_embeddings = embed(config, config.vocab_size, h, ("vocab", "embed"), rngs,
                                         normal)
            self.position_embeddings = (
                None if config.sinusoidal_embeddings
                else embed(config, config.max_position_embeddings, h, (None, "embed"), rngs,
                           normal))
            self.lang_embeddings = (embed(config, config.n_langs, h, (None, "embed"), rngs,
                                          normal)
                                    if config.has_lang_embeddings else None)
            self.embedding_layer_norm = layer_norm(config, h, rngs)
            layer = XLMDecoderLayer if config.is_decoder else EncoderLayer
            self.layers = stacked_layers(lambda r: layer(config, rngs=r), config.num_layers,
                                         rngs)
            self.output_bias = (nnx.Param(jnp.zeros((config.vocab_size,)),
                                          out_sharding=("vocab",)) if with_output else None)

    def position_table(self, position_ids: jax.Array) -> jax.Array:
        """The position embeddings of `position_ids` [B or 1, T] -> [B or 1, T, H]."""
        if self.position_embeddings is not None:
            return self.position_embeddings(position_ids)
        table = sinusoidal_positions(self.config.max_position_embeddings, self.config.hidden_size)
        return jnp.asarray(table, self.config.compute_dtype)[position_ids]

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        langs: jax.Array | None = None,
        position_ids: jax.Array | None = None,
        masked_positions: jax.Array | None = None,
        encoded: jax.Array | None = None,
        encoder_mask: jax.Array | None = None,
        rng: jax.Array | None = None,
    ) -> XLMOutput:
        """`hidden` and the prediction layer's `logits` (see `hidden`; `masked_positions`
        [B, P] gathers rows before the vocabulary projection)."""
        hidden = self.hidden(input_ids, attention_mask, langs=langs, position_ids=position_ids,
                             encoded=encoded, encoder_mask=encoder_mask, rng=rng)
        return XLMOutput(hidden_states=hidden, logits=self.logits(hidden, masked_positions))

    def hidden(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        langs: jax.Array | None = None,
        position_ids: jax.Array | None = None,
        encoded: jax.Array | None = None,
        encoder_mask: jax.Array | None = None,
        rng: jax.Array | None = None,
        inputs_embeds: jax.Array | None = None,
    ) -> jax.Array:
        """`input_ids` [B, T]; `attention_mask` [B, T] (1 = token; default: ids !=
        `pad_token_id`, as HF's lengths for right-padded rows); `langs` [B, T] language ids
        (none added when None, as HF); `position_ids` [B, T] (default 0..T-1; TLM restarts
        them for the translation, §3.3). With `causal`, a query sees the non-padding keys at
        or before it (HF's causal mask ignores padding; the two agree on right-padded rows).
        Returns the last hidden states [B, T, H], zero at padding. A decoder
        (`is_decoder`) cross-attends to `encoded` [B, S, H] at the keys where `encoder_mask`
        [B, S] is 1 (the reference's `src_enc`, `src_len`). `rng` enables dropout (None =
        deterministic). `inputs_embeds` [B, T, H] replaces the token embeddings of `input_ids`
        (whose shape and default mask still apply)."""
        c = self.config
        if c.is_decoder != (encoded is not None) or (encoded is None) != (encoder_mask is None):
            raise ValueError("a decoder (is_decoder) takes encoded and encoder_mask, an encoder "
                             "neither")
        length = input_ids.shape[1]
        if position_ids is None:
            if length > c.max_position_embeddings:
                raise UserError(f"{length} tokens exceed model.max_position_embeddings="
                                f"{c.max_position_embeddings}; raise it or shorten the examples")
            position_ids = jnp.arange(length)[None]
        if attention_mask is None:
            attention_mask = input_ids != c.pad_token_id
        token_mask = attention_mask.astype(bool)
        mask = causal_mask(token_mask) if c.causal else token_mask[:, None, None, :]
        keep = token_mask[..., None].astype(c.compute_dtype)  # [B, T, 1]
        embed_rng, layers_rng = split_rng(rng, 2)
        x = dropout(self.embed(input_ids, position_ids, langs, inputs_embeds), c.hidden_dropout,
                    embed_rng) * keep
        keys = None if layers_rng is None else jax.random.split(layers_rng, c.num_layers)

        cross_mask = None if encoder_mask is None else encoder_mask.astype(bool)[:, None, None, :]
        language = self.cross_output_language(langs)

        def apply(layer: EncoderLayer, h: jax.Array, key: jax.Array | None):
            if c.is_decoder:
                return layer(h, mask, encoded, cross_mask, key, language)[0] * keep, None
            return layer(h, mask, key) * keep, None

        return run_stacked(self.layers, apply, x, keys, c)[0]  # [B, T, H]

    def embed(self, input_ids: jax.Array, position_ids: jax.Array, langs: jax.Array | None,
              inputs_embeds: jax.Array | None = None) -> jax.Array:
        """Token (or `inputs_embeds`) + position (+ language) embeddings, then the embedding
        LayerNorm, [B, T, H]."""
        tokens = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        x = tokens + self.position_table(position_ids)
        if langs is not None and self.lang_embeddings is not None:
            x = x + self.lang_embeddings(langs)
        return self.embedding_layer_norm(x)

    def cross_keys_values(self, encoded: jax.Array) -> tuple[jax.Array, jax.Array]:
        """A decoder's cross-attention keys and values of `encoded` [B, S, H] in every layer,
        [L, B, S, N, D] each."""
        return per_layer_outputs(self.layers, lambda layer: layer.cross_keys_values(encoded),
                                 self.config)

    def cross_output_language(self, langs: jax.Array | None) -> jax.Array | None:
        """Each row's language [B] choosing its cross-attention output (the reference's
        `langs.max()`), or None with one output."""
        if not (self.config.is_decoder and self.config.cross_outputs > 1):
            return None
        if langs is None:
            raise ValueError("a decoder with one cross-attention output per language "
                             "(cross_output_per_language) needs langs")
        return jnp.max(langs, axis=1)  # [B]

    def step(self, input_ids: jax.Array, position: jax.Array, cache: DecoderCache,
             langs: jax.Array | None = None) -> tuple[jax.Array, DecoderCache]:
        """A decoder's next position for every row: `input_ids` [N, 1] at `position` (a scalar)
        attending to the cached positions before it and to the encoder states -> (hidden
        [N, 1, H], the cache). Every decoded token counts as a token (as HF's generation,
        which passes no decoder mask)."""
        x = self.embed(input_ids, jnp.reshape(position, (1, 1)), langs)
        mask, cross_mask = cache.self_mask(position), cache.cross_attention_mask()
        language = self.cross_output_language(langs)

        def apply(layer: XLMDecoderLayer, h: jax.Array, layer_cache: tuple[jax.Array, ...]):
            return layer(h, mask, None, cross_mask, None, language, layer_cache, position)

        h, keys_values = run_stacked(self.layers, apply, x, cache.per_layer(), self.config)
        return h, cache.updated(keys_values)

    def logits(self, hidden: jax.Array, masked_positions: jax.Array | None = None) -> jax.Array:
        """The prediction layer (`PredLayer`): hidden [B, T, H] (rows `masked_positions`
        [B, P] of it) times the transposed token embedding, plus a bias."""
        if masked_positions is not None:
            hidden = jnp.take_along_axis(hidden, masked_positions[..., None], axis=1)
        logits = self.word_embeddings.attend(hidden)
        return logits + self.output_bias[...].astype(logits.dtype)


@dataclasses.dataclass(frozen=True)
class XLMTranslationConfig(XLMConfig):
    """An XLM encoder-decoder for translation (§5.2): both sides take every `XLMConfig` field
    but `causal` and `is_decoder` (the encoder is bidirectional, the decoder causal with
    cross-attention); `eos_token_id` is the reference's `eos_index`, which also starts every
    decoder input (`decoder_start_token_id`, XLM's `generate`: `generated[0] = eos_index`)."""

    eos_token_id: int = 1
    """End of sentence (XLM's dictionary: 1); pretext's tokenizers' `eos_id`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.causal or self.is_decoder:
            raise ValueError("an XLMTranslationConfig sets causal and is_decoder per side; "
                             "leave both False")

    @property
    def decoder_start_token_id(self) -> int:
        return self.eos_token_id

    def side(self, decoder: bool) -> XLMConfig:
        """The encoder's (`decoder` False) or the decoder's config."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(XLMConfig)}
        return XLMConfig(**{**fields, "causal": decoder, "is_decoder": decoder})


class XLMTranslation(nnx.Module):
    """The reference's translation model (facebookresearch/XLM `build_model` for MT): an XLM
    encoder and an XLM decoder (`is_decoder`), each with its own token, position and language
    embeddings and its prediction layer tied to its token embeddings; the decoder's predicts the
    target. Driven by `encode` / `decode` / `logits` (the T5 interface greedy decoding uses),
    with per-token `language_ids` when the model has language embeddings."""

    def __init__(self, config: XLMTranslationConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.encoder = XLM(config.side(decoder=False), rngs=rngs)
        self.decoder = XLM(config.side(decoder=True), rngs=rngs)

    def encode(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
               rng: jax.Array | None = None, *, language_ids: jax.Array | None = None
               ) -> jax.Array:
        """`input_ids` [B, S] (mask default: ids != pad), `language_ids` [B, S] -> [B, S, H],
        zero at padding (the reference's `encoder('fwd', causal=False)`)."""
        return self.encoder.hidden(input_ids, attention_mask, langs=language_ids, rng=rng)

    def decode(self, decoder_input_ids: jax.Array, encoded: jax.Array, attention_mask: jax.Array,
               decoder_attention_mask: jax.Array | None = None, rng: jax.Array | None = None,
               *, language_ids: jax.Array | None = None,
               position_ids: jax.Array | None = None) -> jax.Array:
        """Decoder states [B, T, H] of `decoder_input_ids` [B, T] (first token
        `decoder_start_token_id`; mask default: ids != pad), causal, attending to the `encoded`
        [B, S, H] source positions where `attention_mask` [B, S] is 1; `position_ids` [B, T]
        (default 0 .. T - 1) are the decoder tokens' positions (the reference decoder's
        `positions`)."""
        return self.decoder.hidden(decoder_input_ids, decoder_attention_mask, langs=language_ids,
                                   position_ids=position_ids, encoded=encoded,
                                   encoder_mask=attention_mask, rng=rng)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[B, T, H] -> [B, T, V]: the decoder's prediction layer (tied to its embeddings)."""
        return self.decoder.logits(hidden)

    def prefill_decoder(self, encoded: jax.Array, attention_mask: jax.Array, length: int
                        ) -> DecoderCache:
        """The cache of incremental decoding (`models.beam_search`) for `length` decoder
        positions, with the cross-attention keys and values of `encoded` [N, S, H] at the
        source tokens `attention_mask` [N, S]."""
        limit = self.config.max_position_embeddings
        if length > limit:
            raise UserError(f"decoding {length} positions exceeds model.max_position_embeddings="
                            f"{limit}; lower the number of new tokens")
        return DecoderCache.start(self.decoder.cross_keys_values(encoded), attention_mask,
                                  length)

    def decode_step(self, token: jax.Array, position: jax.Array, cache: DecoderCache, *,
                    language_ids: jax.Array | None = None) -> tuple[jax.Array, DecoderCache]:
        """The next-token logits [N, V] after the decoder input `token` [N] at `position`
        (language `language_ids` [N]) and the extended cache; equal to `logits(decode(...))`
        at that position when every decoder input counts as a token."""
        languages = None if language_ids is None else language_ids[:, None]
        hidden, cache = self.decoder.step(token[:, None], position, cache, languages)
        return self.logits(hidden[:, 0]), cache


def translation_from_pretrained(pretrained: XLM, eos_token_id: int, *, seed: int = 0,
                                **overrides: Any) -> XLMTranslation:
    """An `XLMTranslation` whose encoder and decoder both start from the pretrained XLM's
    parameters (§5.2, "we initialize both encoder and decoder with a pretrained XLM"; the
    reference's `--reload_model 'mlm.pth,mlm.pth'`; see `load_both_sides`). `overrides` change
    config fields that leave the parameters' shapes alone (e.g. dropout); a causal (CLM) XLM
    gives a bidirectional encoder."""
    fields = {f.name: getattr(pretrained.config, f.name)
              for f in dataclasses.fields(XLMConfig)}
    config = XLMTranslationConfig(**{**fields, "causal": False, "is_decoder": False,
                                     "eos_token_id": eos_token_id, **overrides})
    model = XLMTranslation(config, rngs=nnx.Rngs(seed))
    load_both_sides(model, pretrained)
    return model


def load_both_sides(model: XLMTranslation, pretrained: XLM) -> None:
    """Copies every parameter of `pretrained` into the encoder and the decoder of `model`; the
    decoder's cross-attention (`encoder_attn`, `layer_norm15`, absent from the pretrained
    model) keeps its random init, as the reference's reload does."""
    params = dict(nnx.to_flat_state(nnx.state(pretrained, nnx.Param)))
    for side in (model.encoder, model.decoder):
        own = dict(nnx.to_flat_state(nnx.state(side, nnx.Param)))
        if not params.keys() <= own.keys() or any(
                own[k][...].shape != params[k][...].shape for k in params):
            raise UserError("the pretrained XLM's parameters do not fit the translation model; "
                            "change only settings that keep the shapes")
        nnx.update(side, nnx.from_flat_state(params))
