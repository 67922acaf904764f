"""MPNet: a post-LN Transformer with a shared relative position bias, run plainly or as MPNet's
two-stream self-attention for masked and permuted pre-training (Song et al. 2020, §2.2-2.3).

Reference: microsoft/MPNet pretraining/fairseq/models/masked_permutation_net.py
(`compute_mpnet`, `encode_emb`, `encode_relative_emb`, `encode_two_stream_attn`,
`two_stream_self_attention`, `make_query_and_content_mask`) for the two-stream path; HF
transformers modeling_mpnet.py (`MPNetForMaskedLM`) for the plain one, its parity oracle.

Both call modes use the same layers. Every row is one Transformer query: the plain forward
attends from all T rows to all T; the two-stream forward appends the query stream's rows to the
content stream's and attends from all of them to the content rows only, with MPNet's masks, so
each layer's projections, LayerNorms and FFN are shared by the two streams exactly as in
`encode_two_stream_attn`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.models.encoder import EncoderLayer
from pretext_jax.models.layers import (
    ACTIVATIONS,
    MaskedLMHead,
    TransformerConfig,
    attention,
    dropout,
    embed,
    layer_norm,
    relative_position_bucket,
    run_stacked,
    split_rng,
    stacked_layers,
)

# Position ids start after fairseq's padding index 1 (RoBERTa's layout, HF `padding_idx`):
# position p of a sentence is embedding row p + 2, padding is row 1.
PADDING_POSITION = 1
POSITION_OFFSET = PADDING_POSITION + 1


@dataclasses.dataclass(frozen=True)
class MPNetConfig(TransformerConfig):
    """MPNet hyper-parameters (HF `MPNetConfig` names where they differ: num_layers
    [num_hidden_layers], num_heads [num_attention_heads], hidden_dropout [hidden_dropout_prob],
    attention_dropout [attention_probs_dropout_prob]). `max_position_embeddings` counts the two
    rows before the first position (mpnet-base: 514 for 512 tokens). `layer_norm_eps` 1e-5 is
    fairseq's (the released model's). HF buckets relative positions into 32 whatever the
    config says, so `relative_attention_num_buckets` is fixed at 32."""

    vocab_size: int = 30527
    layer_norm_eps: float = 1e-5
    max_position_embeddings: int = 514
    """Position table rows incl. the 2 before the first position (mpnet-base 514 for 512 tokens)."""
    relative_attention_num_buckets: int = 32
    """Buckets of the shared relative position bias; must be 32 (HF MPNet always uses 32)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.relative_attention_num_buckets != 32:
            raise ValueError("relative_attention_num_buckets must be 32 (HF MPNet always "
                             "buckets into 32)")
        if self.max_position_embeddings <= POSITION_OFFSET:
            raise ValueError(f"max_position_embeddings must exceed {POSITION_OFFSET}")

    @property
    def max_length(self) -> int:
        """The longest sequence the position table holds."""
        return self.max_position_embeddings - POSITION_OFFSET


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MPNetOutput:
    """`hidden_states`: the last layer's rows, [B, T, H] (two-stream: the content stream,
    [B, n + b, H]); `query_states`: the query stream's, [B, b, H] (None in the plain forward);
    `logits`: the LM head on the query stream (two-stream) or on every row (plain)."""

    hidden_states: jax.Array
    query_states: jax.Array | None
    logits: jax.Array


def two_stream_visibility(length: int, pred_size: int) -> np.ndarray:
    """[n + 2b, n + b] bool, True = row may attend to column, for n = `length` tokens of which
    the last b = `pred_size` of the factorisation order are predicted (Song et al. 2020 Fig. 2-3;
    `make_query_and_content_mask`). Columns (the content stream) are laid out as the paper draws
    them: [n - b non-predicted tokens | b [MASK]s at the predicted positions | the b predicted
    tokens], rows as the columns followed by the b query-stream rows. Predicted item i (in
    factorisation order) is the i-th mask and the i-th predicted token.

    - non-predicted tokens and masks see the non-predicted tokens and all masks;
    - predicted token i (content) sees the non-predicted tokens, predicted tokens j <= i and
      the masks j > i;
    - query i sees the non-predicted tokens, predicted tokens j < i and the masks j >= i (its
      own position and those still to predict: position compensation).
    """
    n, b = length, pred_size
    row = np.arange(n + 2 * b)[:, None]
    col = np.arange(n + b)[None, :]
    row_item = np.where(row >= n + b, row - n - b, row - n)  # i for predicted/query rows
    is_predicted_row = (row >= n) & (row < n + b)
    is_query_row = row >= n + b
    mask_col, token_col = col - (n - b), col - n  # j for mask / predicted-token columns
    sees_mask = np.where(is_predicted_row, mask_col > row_item,
                         np.where(is_query_row, mask_col >= row_item, True))
    sees_token = ((is_predicted_row & (token_col <= row_item))
                  | (is_query_row & (token_col < row_item)))
    return (col < n - b) | ((col < n) & (col >= n - b) & sees_mask) | ((col >= n) & sees_token)


class MPNetLayer(EncoderLayer):
    """HF `MPNetLayer` (attention.attn q/k/v/o + LayerNorm, intermediate, output + LayerNorm):
    BERT's post-LN block with the relative position bias added to the scores. Keys and values
    come from the first `num_keys` rows (the content stream); every row is a query."""

    def __call__(self, x: jax.Array, mask: jax.Array, bias: jax.Array, num_keys: int,
                 rng: jax.Array | None) -> jax.Array:
        c = self.config
        attn_rng, attn_out_rng, mlp_rng = split_rng(rng, 3)

        def heads(t: jax.Array) -> jax.Array:
            return t.reshape(*t.shape[:2], c.num_heads, c.hidden_size // c.num_heads)

        keys_in = x[:, :num_keys]
        context = attention(heads(self.query(x)), heads(self.key(keys_in)),
                            heads(self.value(keys_in)), mask, c.attention_dropout, attn_rng,
                            c.attention_implementation, bias=bias).reshape(x.shape)
        x = self.attention_layer_norm(
            x + dropout(self.attention_output(context), c.hidden_dropout, attn_out_rng))
        y = self.output(ACTIVATIONS[c.hidden_act](self.intermediate(x)))
        return self.output_layer_norm(x + dropout(y, c.hidden_dropout, mlp_rng))


class MPNet(nnx.Module):
    """MPNet with its LM head (HF `MPNetForMaskedLM`): word + absolute position embeddings
    (no token types), LayerNorm, dropout; stacked `MPNetLayer`s sharing one relative position
    bias table; dense, GELU, LayerNorm and the tied word embedding + bias. `with_lm_head=False`
    leaves the LM head out (HF `MPNetModel` without its pooler), for a fine-tuning head on top
    of `encode`."""

    def __init__(self, config: MPNetConfig, *, rngs: nnx.Rngs, with_lm_head: bool = True):
        h = config.hidden_size
        self.config = config
        with nnx.use_eager_sharding(False):
            self.word_embeddings = embed(config, config.vocab_size, h, ("vocab", "embed"), rngs)
            self.position_embeddings = embed(config, config.max_position_embeddings, h,
                                             (None, "embed"), rngs)
            self.embedding_layer_norm = layer_norm(config, h, rngs)
            self.relative_attention_bias = embed(config, config.relative_attention_num_buckets,
                                                 config.num_heads, (None, None), rngs)
            self.layers = stacked_layers(lambda r: MPNetLayer(config, rngs=r),
                                         config.num_layers, rngs)
            self.lm_head = (MaskedLMHead(config, rngs=rngs, activation="gelu") if with_lm_head
                            else None)

    def position_bias(self, query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
        """[B, heads, Tq, Tk] learned bias of the bucketed `key - query` offsets
        (`compute_position_bias` / `encode_relative_emb`)."""
        buckets = relative_position_bucket(
            key_positions[:, None, :] - query_positions[:, :, None],
            num_buckets=self.config.relative_attention_num_buckets)
        return jnp.moveaxis(self.relative_attention_bias(buckets), -1, 1)

    def lm_logits(self, hidden: jax.Array) -> jax.Array:
        """HF `MPNetLMHead`: dense, exact GELU, LayerNorm, tied decoder + bias."""
        return self.lm_head(hidden, self.word_embeddings)

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        position_ids: jax.Array | None = None,
        pred_size: int = 0,
        rng: jax.Array | None = None,
    ) -> MPNetOutput:
        """The plain forward (`pred_size=0`) or the two-stream one.

        Plain: `input_ids` [B, T]; without `position_ids`, positions count the real tokens of
        `attention_mask` (1 = token; padding gets the padding row) and the relative bias uses
        0..T-1 (HF `compute_position_bias`). HF's `create_position_ids_from_input_ids` finds
        padding as id 1 (mpnet-base's <pad>) instead; the two agree whenever padding is what
        the mask marks, and ours does not depend on the tokenizer's padding id.

        Two-stream (`pred_size` = b > 0, static): `input_ids` and `position_ids` [B, n + b] are
        the content stream laid out as `two_stream_visibility` says: the permuted
        non-predicted tokens, the (80/10/10-corrupted) [MASK]s and the predicted tokens, each
        with its original position (`position_ids`, 0-based). The query stream starts from
        the mask rows (same tokens, same positions, as the reference feeds them twice), and the
        relative bias follows the permuted positions (`encode_relative_emb`). `position_ids`
        are 0-based positions (embedding row p + 2, fairseq's `encode_emb`); `attention_mask`
        (1 = token) hides padding keys in both modes. `rng` enables dropout.
        """
        length = input_ids.shape[1]
        hidden = self._layers(input_ids, attention_mask, position_ids, pred_size, rng)
        if not pred_size:
            return MPNetOutput(hidden_states=hidden, query_states=None,
                               logits=self.lm_logits(hidden))
        query = hidden[:, length:]
        return MPNetOutput(hidden_states=hidden[:, :length], query_states=query,
                           logits=self.lm_logits(query))

    def encode(self, input_ids: jax.Array, attention_mask: jax.Array | None = None, *,
               rng: jax.Array | None = None) -> jax.Array:
        """The plain forward's last hidden states [B, T, H] without the LM head (HF
        `MPNetModel`'s `last_hidden_state`), positions from `attention_mask` as `__call__`'s."""
        return self._layers(input_ids, attention_mask, None, 0, rng)

    def _layers(self, input_ids: jax.Array, attention_mask: jax.Array | None,
                position_ids: jax.Array | None, pred_size: int, rng: jax.Array | None
                ) -> jax.Array:
        """The last layer's rows (two-stream: the content stream's, then the query stream's)."""
        c = self.config
        length = input_ids.shape[1]
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        key_mask = attention_mask.astype(bool)
        if pred_size:
            if position_ids is None:
                raise ValueError("the two-stream forward needs position_ids")
            n = length - pred_size
            masks = slice(n - pred_size, n)
            input_ids = jnp.concatenate([input_ids, input_ids[:, masks]], axis=1)
            position_ids = jnp.concatenate([position_ids, position_ids[:, masks]], axis=1)
            visible = jnp.asarray(two_stream_visibility(n, pred_size))
            mask = visible[None, None] & key_mask[:, None, None, :]
            bias = self.position_bias(position_ids, position_ids[:, :length])
            rows = position_ids + POSITION_OFFSET
        else:
            mask = key_mask[:, None, None, :]
            if position_ids is None:
                counts = jnp.cumsum(attention_mask, axis=1) * attention_mask
                rows = counts + PADDING_POSITION
                steps = jnp.arange(length)[None]
                bias = self.position_bias(steps, steps)
            else:
                rows = position_ids + POSITION_OFFSET
                bias = self.position_bias(position_ids, position_ids)
        embed_rng, layers_rng = split_rng(rng, 2)
        x = self.word_embeddings(input_ids) + self.position_embeddings(rows)
        x = dropout(self.embedding_layer_norm(x), c.hidden_dropout, embed_rng)
        keys = None if layers_rng is None else jax.random.split(layers_rng, c.num_layers)

        def apply(layer: MPNetLayer, h: jax.Array, key: jax.Array | None):
            return layer(h, mask, bias, length, key), None

        return run_stacked(self.layers, apply, x, keys, c)[0]
