"""A bidirectional encoder run as a sequence-to-sequence prefix LM, with incremental decoding.

The source and the target are one sequence, `[SOS] source [EOS] target [EOS]`, under the
sequence-to-sequence self-attention mask of Dong et al. 2019 §2.2 (Fig. 1): the source
attends to the whole source, the target to the source and to its own tokens up to itself.
Training predicts target tokens replaced by `[MASK]` (the loss is the objective's); decoding
predicts the next token by putting `[MASK]` at the next position, the pseudo-token of
microsoft/unilm unilm-v1 `BertForSeq2SeqDecoder` (src/pytorch_pretrained_bert/modeling.py
1402-1478, 1480-1753), so decoding reads the inputs training read.

Layout: the source block is `[SOS]` + the source record (its tokens and EOS, padded to S), the
target block follows it; token types `source_type_id` / `target_type_id` (UniLM's 4 / 5,
unilm-v1 seq2seq_loader.py 168-169); positions 0 .. n - 1 over the n source tokens and n + k
for target token k, so the padding between the blocks changes nothing (unilm-v1 gives the
decoder's target the positions after the real source, seq2seq_loader.py 381-387).

Incremental decoding follows the protocol of `models.beam_search` (`encode`,
`prefill_decoder`, `decode_step`; `config.decoder_start_token_id`, `config.eos_token_id`):
`encode` runs the source block and returns every layer's input states; `prefill_decoder` turns
them into each layer's keys and values, held as the cache's `cross_keys` / `cross_values` (here
the prefix that the same self-attention reads, not a cross-attention); `decode_step(token,
t, cache)` runs two tokens through the layers, the previous output `token` at target position
t - 1 and `[MASK]` at t: the first attends to the source and the target slots before it and its
keys and values fill slot t - 1, the second attends to those and itself and gives the logits.
unilm-v1 keeps each layer's input states and projects them again at every step; keeping the
projections instead is the same arithmetic. At step 0 there is no previous output: the start
token (EOS, `decoder_start_token_id`) is run but attended by nothing, and its slot is written
again at step 1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.models.encoder import (
    Encoder,
    EncoderConfig,
    EncoderLayer,
    heads_keys_values,
    post_ln_attend,
)
from pretext_jax.models.layers import DecoderCache, MaskedLMHead, run_stacked


@dataclasses.dataclass(frozen=True)
class PrefixLMConfig(EncoderConfig):
    """A BERT-style encoder run as a prefix LM: its special tokens (0 = the tokenizer's, set
    from the data) and the token types of the source and the target."""

    type_vocab_size: int = 6
    """Token types (UniLM's 6: its four LMs' segments, `source_type_id`, `target_type_id`)."""
    sos_token_id: int = 0
    """Starts the source ([CLS]); 0 = the tokenizer's."""
    eos_token_id: int = 0
    """Ends the source and the target ([SEP]) and starts decoding; 0 = the tokenizer's."""
    mask_token_id: int = 0
    """The pseudo-token at predicted positions ([MASK]); 0 = the tokenizer's."""
    pad_token_id: int = 0
    """Padding ([PAD]), which a smoothed target leaves out; 0 = the tokenizer's."""
    source_type_id: int = 4
    """Token type of the source block (UniLM's seq2seq source: 4)."""
    target_type_id: int = 5
    """Token type of the target block (UniLM's seq2seq target: 5)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if max(self.source_type_id, self.target_type_id) >= self.type_vocab_size:
            raise UserError(f"model.type_vocab_size={self.type_vocab_size} has no token type "
                            f"{max(self.source_type_id, self.target_type_id)} for the "
                            "source/target (UniLM's 4/5: start from a `unilm` run, whose "
                            "models have 6)")

    @property
    def decoder_start_token_id(self) -> int:
        """The token `decode_step` is given first (its keys and values are never read)."""
        return self.eos_token_id


def seq2seq_mask(source_mask: jax.Array, target_length: int) -> jax.Array:
    """[B, S + T, S + T] bool: query i may attend to key j, for a source block of `source_mask`
    [B, S] (1 = token) followed by T target positions: source tokens from every query, and
    target keys j <= i from target queries (Dong et al. 2019 §2.2, unilm-v1
    seq2seq_loader.py 269-275)."""
    source = source_mask.astype(bool)
    width = source.shape[1]
    positions = jnp.arange(width + target_length)
    in_target = positions >= width
    causal = in_target[None, :] & in_target[:, None] & (positions[None, :] <= positions[:, None])
    keys = jnp.concatenate([source, jnp.zeros((source.shape[0], target_length), bool)], axis=1)
    return keys[:, None, :] | causal[None]


class PrefixLM(nnx.Module):
    """A BERT encoder and masked-LM head (the parameters of `models.bert.Bert` but the pooler
    and the pair head) run as a sequence-to-sequence prefix LM (module docstring)."""

    def __init__(self, config: PrefixLMConfig, *, rngs: nnx.Rngs):
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self.encoder = Encoder(config, rngs=rngs)
            self.lm_head = MaskedLMHead(config, rngs=rngs)

    def source_block(self, input_ids: jax.Array, attention_mask: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
        """`[SOS]` + the source `input_ids` [B, S] and its mask: ids, mask [B, S + 1]."""
        sos = jnp.full((input_ids.shape[0], 1), self.config.sos_token_id, input_ids.dtype)
        ones = jnp.ones((input_ids.shape[0], 1), attention_mask.dtype)
        return (jnp.concatenate([sos, input_ids], axis=1),
                jnp.concatenate([ones, attention_mask], axis=1))

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array, targets: jax.Array, *,
                 masked_positions: jax.Array | None = None, rng: jax.Array | None = None
                 ) -> jax.Array:
        """The masked-LM logits of the packed sequence: the source `input_ids` [B, S] (1 in
        `attention_mask` = token) and the target block `targets` [B, T] (with its `[MASK]`s
        in place), [B, S + 1 + T, V], or [B, P, V] at `masked_positions` [B, P] (indices into
        the packed sequence); `rng` enables dropout."""
        source, source_mask = self.source_block(input_ids, attention_mask)
        width, length = source.shape[1], targets.shape[1]
        c = self.config
        ids = jnp.concatenate([source, targets], axis=1)
        types = jnp.where(jnp.arange(width + length) < width, c.source_type_id,
                          c.target_type_id)
        types = jnp.broadcast_to(types, ids.shape)
        count = jnp.sum(source_mask.astype(jnp.int32), axis=1, keepdims=True)  # [B, 1]
        positions = jnp.concatenate([jnp.broadcast_to(jnp.arange(width), source.shape),
                                     count + jnp.arange(length)], axis=1)
        hidden = self.encoder(ids, types, seq2seq_mask(source_mask, length), rng, positions)
        return self.lm_head(hidden, self.encoder.embeddings.word_embeddings, masked_positions)

    # -------------------------------------------------------------------- decoding
    def encode(self, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """Every layer's input states of the source block, [B, L, S + 1, H] (the source
        attends only to itself, so these are the full sequence's)."""
        source, source_mask = self.source_block(input_ids, attention_mask)
        types = jnp.full_like(source, self.config.source_type_id)
        x = self.encoder.embed(source, types, None)
        mask = source_mask.astype(bool)[:, None, None, :]

        def apply(layer: EncoderLayer, h: jax.Array, _: None) -> tuple[jax.Array, jax.Array]:
            return layer(h, mask, None), h

        _, inputs = run_stacked(self.encoder.stack.layers, apply, x, None, self.config)
        return jnp.moveaxis(inputs, 0, 1)

    def prefill_decoder(self, encoded: jax.Array, attention_mask: jax.Array, length: int
                        ) -> DecoderCache:
        """The cache for `length` target positions: each layer's keys and values of the
        source block from its input states `encoded` [N, L, S + 1, H], and the source tokens
        (`attention_mask` [N, S], `[SOS]` added)."""
        c = self.config

        def apply(layer: EncoderLayer, carry: jax.Array, h: jax.Array):
            return carry, heads_keys_values(c, (layer.key, layer.value), h)

        _, prefix = run_stacked(self.encoder.stack.layers, apply, jnp.zeros(()),
                                jnp.moveaxis(encoded, 1, 0), c)
        ones = jnp.ones((attention_mask.shape[0], 1), bool)
        return DecoderCache.start(prefix, jnp.concatenate(
            [ones, attention_mask.astype(bool)], axis=1), length)

    def decode_step(self, token: jax.Array, position: jax.Array, cache: DecoderCache
                    ) -> tuple[jax.Array, DecoderCache]:
        """The logits [N, V] of target position `position` with `[MASK]` there and `token`
        [N] at the position before (module docstring), and the cache with `token`'s keys and
        values in slot `position` - 1; equal to `__call__`'s at that `[MASK]`."""
        c = self.config
        rows = token.shape[0]
        count = jnp.sum(cache.cross_mask.astype(jnp.int32), axis=1)  # source tokens [N]
        ids = jnp.stack([token, jnp.full_like(token, c.mask_token_id)], axis=1)  # [N, 2]
        positions = count[:, None] + position + jnp.arange(-1, 1)
        x = self.encoder.embed(ids, jnp.full_like(ids, c.target_type_id), None,
                               jnp.maximum(positions, 0))
        slot = jnp.maximum(position - 1, 0)
        earlier = jnp.arange(cache.length) < position  # target slots 0 .. position - 1
        own = jnp.eye(2, dtype=bool)[:, 1:]  # the [MASK] key: only the [MASK] query
        width = cache.cross_mask.shape[1]
        mask = jnp.concatenate([jnp.broadcast_to(cache.cross_mask[:, None], (rows, 2, width)),
                                jnp.broadcast_to(earlier, (rows, 2, cache.length)),
                                jnp.broadcast_to(own, (rows, 2, 1))], axis=2)[:, None]

        def apply(layer: EncoderLayer, h: jax.Array, per_layer: tuple[jax.Array, ...]):
            keys, values, prefix_keys, prefix_values = per_layer
            new_keys, new_values = heads_keys_values(c, (layer.key, layer.value), h)
            keys = jax.lax.dynamic_update_slice_in_dim(keys, new_keys[:, :1], slot, axis=1)
            values = jax.lax.dynamic_update_slice_in_dim(values, new_values[:, :1], slot, axis=1)
            attended = (jnp.concatenate([prefix_keys, keys, new_keys[:, 1:]], axis=1),
                        jnp.concatenate([prefix_values, values, new_values[:, 1:]], axis=1))
            h = post_ln_attend(c, (layer.query, layer.attention_output),
                               layer.attention_layer_norm, h, attended, mask, None, None)
            return layer.feed_forward(h, None), (keys, values)

        hidden, updated = run_stacked(self.encoder.stack.layers, apply, x, cache.per_layer(), c)
        logits = self.lm_head(hidden[:, 1], self.encoder.embeddings.word_embeddings)
        return logits, cache.updated(updated)

