"""The shared Transformer encoder (BERT-style, post-LayerNorm) in Flax NNX.

Reference: google-research/bert modeling.py (`embedding_postprocessor`, `transformer_model`) and
HF transformers modeling_bert.py, whose weights convert one-to-one (`models/hf/encoder.py`).
Used by BERT, ELECTRA, RoBERTa (`position_padding_id`: positions counted over non-padding
tokens) and ALBERT (`shared_layers`: one layer applied `num_layers` times). LayerDrop (Fan et
al. 2020, fairseq modules/layer_drop.py `LayerDropModuleList`) skips whole layers in training
(`layerdrop`); `layers_to_keep` prunes a trained stack when it is loaded (`keep_layers`).

Parameters carry logical axis names in their `out_sharding` metadata (`vocab`, `embed`, `heads`,
`mlp`, `layers`, `norm`); `pretrain.mesh` maps those to mesh axes. Layers are stored stacked
(leading `layers` axis) whether they run under `nnx.scan` or a Python loop, so checkpoints and
conversions do not depend on that flag; a shared layer is stored once, without that axis.
Shape comments use the letters of `Encoder`'s legend.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.models.layers import (
    ACTIVATIONS,
    TransformerConfig,
    attention,
    check_rates,
    dense,
    dropout,
    embed,
    layer_norm,
    run_stacked,
    split_rng,
    stacked_layers,
)


@dataclasses.dataclass(frozen=True)
class EncoderConfig(TransformerConfig):
    """The BERT-style encoder: learned absolute positions and token types.

    `embedding_size` 0 means `hidden_size`; another width gets a learned projection to the hidden
    size after the embedding LayerNorm (ELECTRA, Clark et al. 2020 §3.2; HF `embeddings_project`).

    `position_padding_id` -1 gives BERT's positions 0..T-1. An id p >= 0 gives RoBERTa's
    (fairseq `utils.make_positions`, HF `create_position_ids_from_input_ids`): tokens equal to p
    are padding and sit at position p, every other token at p + 1 + the number of non-padding
    tokens before it, so positions up to p + T must exist.
    """

    embedding_size: int = 0
    """Embedding width; 0 = hidden_size, else projected to it (ALBERT, ELECTRA-Small 128)."""
    max_position_embeddings: int = 512
    """Rows of the learned position table (BERT 512; RoBERTa 514 = 512 + padding id + 1)."""
    type_vocab_size: int = 2
    """Token-type (segment) ids in the embedding table (BERT 2, RoBERTa 1; DistilBERT 0: none)."""
    position_padding_id: int = -1
    """-1: positions 0..T-1 (BERT); p >= 0: padding id p, real tokens from p + 1 (RoBERTa)."""
    task_type_vocab_size: int = 0
    """Task-type embeddings (HF ErnieConfig use_task_id: ERNIE 2.0); 0 = none (BERT, ERNIE 1.0)."""
    adapter_size: int = 0
    """Bottleneck of the adapters in every layer (Houlsby et al. 2019: 8, 64 or 256); 0 = none."""
    layerdrop: float = 0.0
    """LayerDrop (Fan et al. 2020 §3): in training each layer is skipped for the whole batch
    with this probability, drawn per layer per step; evaluation runs every layer. 0 = off."""
    layers_to_keep: str = ""
    """Layers a trained model keeps when loaded, e.g. "0,2,4" (Fan et al. 2020 §4, fairseq
    `encoder_layers_to_keep`): the loaded model holds only those, renumbered. '' = all."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.embedding_size < 0:
            raise ValueError(f"embedding_size {self.embedding_size} must be >= 0 (0 = hidden_size)")
        if self.type_vocab_size < 0:
            raise ValueError(f"type_vocab_size {self.type_vocab_size} must be >= 0 (0 = no "
                             "token-type embeddings)")
        if self.task_type_vocab_size < 0:
            raise ValueError(f"task_type_vocab_size {self.task_type_vocab_size} must be >= 0 "
                             "(0 = no task-type embeddings)")
        if self.adapter_size < 0:
            raise ValueError(f"adapter_size {self.adapter_size} must be >= 0 (0 = no adapters)")
        check_rates(self, ("layerdrop",))
        kept_layers(self)

    @property
    def embedding_width(self) -> int:
        return self.embedding_size or self.hidden_size


class Embeddings(nnx.Module):
    """Word + position + token-type embeddings, LayerNorm, dropout (modeling.py
    `embedding_lookup` + `embedding_postprocessor`); with `task_type_vocab_size`, plus the
    embedding of task 0 at every position (HF `ErnieEmbeddings` without `task_type_ids`); with
    `type_vocab_size` 0, no token-type table (HF DistilBERT `Embeddings`)."""

    def __init__(self, config: EncoderConfig, *, rngs: nnx.Rngs):
        h = config.embedding_width
        self.config = config
        self.word_embeddings = embed(config, config.vocab_size, h, ("vocab", "embed"), rngs)
        self.position_embeddings = embed(config, config.max_position_embeddings, h,
                                         (None, "embed"), rngs)
        self.token_type_embeddings = (
            embed(config, config.type_vocab_size, h, (None, "embed"), rngs)
            if config.type_vocab_size else None)
        self.task_type_embeddings = (
            embed(config, config.task_type_vocab_size, h, (None, "embed"), rngs)
            if config.task_type_vocab_size else None)
        self.layer_norm = layer_norm(config, h, rngs)

    def __call__(
        self, input_ids: jax.Array, token_type_ids: jax.Array, rng: jax.Array | None,
        position_ids: jax.Array | None = None,
    ) -> jax.Array:
        """`input_ids`, `token_type_ids` [B, T] -> embeddings [B, T, E]; `position_ids` [B, T]
        replaces the config's positions (a prefix LM's target after a padded source)."""
        padding_id = self.config.position_padding_id
        if position_ids is not None:
            positions = self.position_embeddings(position_ids)  # [B, T, E]
        elif padding_id < 0:
            seq_len = input_ids.shape[1]
            positions = self.position_embeddings.embedding[:seq_len][None].astype(
                self.config.compute_dtype)  # [1, T, E]
        else:
            positions = self.position_embeddings(
                padded_position_ids(input_ids, padding_id))  # [B, T, E]
        x = self.word_embeddings(input_ids) + positions  # [B, T, E]
        if self.token_type_embeddings is not None:
            x = x + self.token_type_embeddings(token_type_ids)  # [B, T, E]
        if self.task_type_embeddings is not None:
            x = x + self.task_type_embeddings.embedding[0].astype(x.dtype)  # task 0: [E]
        return dropout(self.layer_norm(x), self.config.hidden_dropout, rng)  # [B, T, E]


def padded_position_ids(input_ids: jax.Array, padding_id: int) -> jax.Array:
    """RoBERTa's position ids (see `EncoderConfig.position_padding_id`): padding_id + the
    running count of non-padding tokens, and padding_id itself at padding tokens."""
    real = (input_ids != padding_id).astype(jnp.int32)
    return jnp.cumsum(real, axis=1) * real + padding_id


ADAPTER_INIT_SCALE = 1e-3
"""Std of the adapters' truncated-normal weights (adapter-bert modeling.py
`feedforward_adapter`'s `init_scale`): near zero, so each adapter starts near the identity."""


class Adapter(nnx.Module):
    """Houlsby et al. 2019 §2.1's bottleneck adapter: x + up(gelu(down(x))), [B, T, H] ->
    [B, T, H] (adapter-bert modeling.py `feedforward_adapter`: weights truncated normal with std
    1e-3 at +-2 std, zero biases, tanh-approximated GELU as that file's `gelu`)."""

    def __init__(self, config: EncoderConfig, *, rngs: nnx.Rngs):
        h, m = config.hidden_size, config.adapter_size
        init = nnx.initializers.truncated_normal(ADAPTER_INIT_SCALE)
        self.down = dense(config, h, m, ("embed", None), rngs, kernel_init=init)
        self.up = dense(config, m, h, (None, "embed"), rngs, kernel_init=init)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.up(jax.nn.gelu(self.down(x), approximate=True))


class EncoderLayer(nnx.Module):
    """One post-LN block: self-attention + residual + LayerNorm, GELU MLP + residual + LayerNorm."""

    def __init__(self, config: EncoderConfig, *, rngs: nnx.Rngs):
        h, i = config.hidden_size, config.intermediate_size
        self.config = config
        self.query = dense(config, h, h, ("embed", "heads"), rngs)
        self.key = dense(config, h, h, ("embed", "heads"), rngs)
        self.value = dense(config, h, h, ("embed", "heads"), rngs)
        self.attention_output = dense(config, h, h, ("heads", "embed"), rngs)
        self.attention_layer_norm = layer_norm(config, h, rngs)
        self.intermediate = dense(config, h, i, ("embed", "mlp"), rngs)
        self.output = dense(config, i, h, ("mlp", "embed"), rngs)
        self.output_layer_norm = layer_norm(config, h, rngs)
        # Houlsby et al. 2019 Figure 2: an adapter after each sub-layer's output projection
        # (and its dropout), before the residual sum and LayerNorm; the layers of MPNet, XLM and
        # wav2vec 2.0 reuse this one on configs without adapters
        self.attention_adapter, self.output_adapter = (
            (Adapter(config, rngs=rngs), Adapter(config, rngs=rngs))
            if getattr(config, "adapter_size", 0) else (None, None))

    def __call__(self, x: jax.Array, mask: jax.Array, rng: jax.Array | None) -> jax.Array:
        """`x` [B, T, H], `mask` [B, 1, 1, T] or per query [B, 1, T, T] (True = key may be
        attended) -> [B, T, H]."""
        attn_rng, attn_out_rng, mlp_rng = split_rng(rng, 3)
        x = post_ln_attention(self.config, (self.query, self.key, self.value,
                                            self.attention_output), self.attention_layer_norm,
                              x, x, mask, attn_rng, attn_out_rng, self.attention_adapter)
        return self.feed_forward(x, mlp_rng)

    def attention_scores(self, x: jax.Array) -> jax.Array:
        """The scaled dot products q.k / sqrt(D) [B, N, T, T] of this layer's self-attention
        on `x` [B, T, H], before any mask or softmax (TinyBERT transformer/modeling.py
        `BertSelfAttention`'s `attention_scores` less its additive mask)."""
        size = (self.config.num_heads, self.config.hidden_size // self.config.num_heads)
        q = self.query(x).reshape(*x.shape[:2], *size)  # [B, T, N, D]
        k = self.key(x).reshape(*x.shape[:2], *size)  # [B, T, N, D]
        return jnp.einsum("bqhd,bkhd->bhqk", q, k) * size[1] ** -0.5  # [B, N, T, T]

    def feed_forward(self, x: jax.Array, rng: jax.Array | None) -> jax.Array:
        """The MLP block: LayerNorm(x + dropout(output(act(intermediate(x))))), [B, T, H]."""
        c = self.config
        y = self.output(ACTIVATIONS[c.hidden_act](self.intermediate(x)))  # [B, T, F] -> [B, T, H]
        y = dropout(y, c.hidden_dropout, rng)
        if self.output_adapter is not None:
            y = self.output_adapter(y)
        return self.output_layer_norm(x + y)  # [B, T, H]


def post_ln_attention(config: TransformerConfig, projections: tuple[nnx.Linear, ...],
                      norm: nnx.LayerNorm, x: jax.Array, kv: jax.Array, mask: jax.Array,
                      attn_rng: jax.Array | None, out_rng: jax.Array | None,
                      adapter: Adapter | None = None) -> jax.Array:
    """One post-LN attention block: LayerNorm(x + dropout(out(attention(q(x), k(kv), v(kv))))).
    `projections` = (query, key, value, output); `x` [B, T, H] queries, `kv` [B, S, H] keys and
    values (x itself for self-attention, the encoder's states for cross-attention), `mask`
    [B, 1, 1 or T, S] -> [B, T, H]; `adapter` (if any) applies to the dropped-out output."""
    query, key, value, output = projections
    return post_ln_attend(config, (query, output), norm, x,
                          heads_keys_values(config, (key, value), kv), mask, attn_rng, out_rng,
                          adapter)


def heads_keys_values(config: TransformerConfig, projections: tuple[nnx.Linear, nnx.Linear],
                      kv: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The (key, value) `projections` of `kv` [B, S, H], each split into heads [B, S, N, D]."""
    size = (config.num_heads, config.hidden_size // config.num_heads)  # (N, D)
    key, value = projections
    return key(kv).reshape(*kv.shape[:2], *size), value(kv).reshape(*kv.shape[:2], *size)


def post_ln_attend(config: TransformerConfig, projections: tuple[nnx.Linear, nnx.Linear],
                   norm: nnx.LayerNorm, x: jax.Array, keys_values: tuple[jax.Array, jax.Array],
                   mask: jax.Array, attn_rng: jax.Array | None, out_rng: jax.Array | None,
                   adapter: Adapter | None = None) -> jax.Array:
    """`post_ln_attention` over given keys and values [B, S, N, D] (a decoder's cache);
    `projections` = (query, output)."""
    c = config
    query, output = projections
    q = query(x).reshape(*x.shape[:2], c.num_heads, c.hidden_size // c.num_heads)  # [B, T, N, D]
    context = attention(q, *keys_values, mask, c.attention_dropout, attn_rng,
                        c.attention_implementation).reshape(x.shape)  # [B, T, H]
    y = dropout(output(context), c.hidden_dropout, out_rng)  # [B, T, H]
    return norm(x + (y if adapter is None else adapter(y)))  # [B, T, H]


class EncoderStack(nnx.Module):
    """`num_layers` EncoderLayers with stacked parameters (`layers`), or with `shared` one
    EncoderLayer (`layer`) applied `num_layers` times; run by `nnx.scan` or a Python loop."""

    def __init__(self, config: EncoderConfig, *, rngs: nnx.Rngs, shared: bool = False):
        if config.layers_to_keep:
            raise UserError(f"model.layers_to_keep={config.layers_to_keep} prunes a trained "
                            "model as it is loaded (run.py convert --layers-to-keep, "
                            "pretrain.loading.load_model); a new network has all its layers: "
                            "set model.layers_to_keep=''")
        self.config = config
        self.shared = shared
        if shared:
            self.layer = EncoderLayer(config, rngs=rngs)
        else:
            self.layers = stacked_layers(lambda r: EncoderLayer(config, rngs=r),
                                         config.num_layers, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array, rng: jax.Array | None) -> jax.Array:
        """`x` [B, T, H] through the L layers -> [B, T, H]; `mask` [B, 1, 1 or T, T]. With
        `rng` and `layerdrop` p > 0, layer i is skipped (its input passed on) when
        `layers_dropped`'s draw says so; its dropout key is the same either way."""
        keys = None if rng is None else jax.random.split(rng, self.config.num_layers)  # [L, 2]
        dropped = layers_dropped(rng, self.config)  # [L] bool, or None: every layer runs

        def apply(layer: EncoderLayer, h: jax.Array, per_layer: tuple[jax.Array | None, ...]):
            key, skip = per_layer
            if skip is None:
                return layer(h, mask, key), None
            # a cond, not a select: a skipped layer costs no compute (the predicate is one
            # replicated scalar, so every device takes the same branch)
            return jax.lax.cond(skip, lambda h: h, lambda h: layer(h, mask, key), h), None

        layers = self.layer if self.shared else self.layers
        return run_stacked(layers, apply, x, (keys, dropped), self.config,
                           shared=self.shared)[0]

    def trace(self, x: jax.Array, mask: jax.Array, rng: jax.Array | None
              ) -> tuple[jax.Array, jax.Array]:
        """`__call__` that also returns what each layer saw: every layer's output [L, B, T, H]
        and its attention scores [L, B, N, T, T] (`EncoderLayer.attention_scores` of its input;
        TinyBERT's layer distillation, Jiao et al. 2020 §3.1)."""
        keys = None if rng is None else jax.random.split(rng, self.config.num_layers)  # [L, 2]

        def apply(layer: EncoderLayer, h: jax.Array, key: jax.Array | None):
            scores = layer.attention_scores(h)
            h = layer(h, mask, key)
            return h, (h, scores)

        layers = self.layer if self.shared else self.layers
        return run_stacked(layers, apply, x, keys, self.config, shared=self.shared)[1]


LAYERDROP_STREAM = 0x4C44
"""Folded into a step's stack key for LayerDrop's draws, so the layers' own dropout keys (split
from the stack key) are those of the same step without LayerDrop."""


def layers_dropped(rng: jax.Array | None, config: EncoderConfig) -> jax.Array | None:
    """Which of the L layers this step skips [L] bool: u_i ~ U[0, 1) independent per layer,
    skipped when u_i < p (fairseq `LayerDropModuleList` keeps layer i when u_i > p); None in
    evaluation (no `rng`) or when `layerdrop` is 0."""
    if rng is None or not getattr(config, "layerdrop", 0.0):
        return None
    draws = jax.random.uniform(jax.random.fold_in(rng, LAYERDROP_STREAM), (config.num_layers,))
    return draws < config.layerdrop


def kept_layers(config: EncoderConfig) -> tuple[int, ...]:
    """`layers_to_keep` as sorted layer indices (fairseq checkpoint_utils.py `prune_state_dict`
    sorts them too), () when it is ''; refuses anything but distinct indices in
    [0, num_layers)."""
    spec = config.layers_to_keep.strip()
    if not spec:
        return ()
    try:
        keep = [int(part) for part in spec.split(",")]
    except ValueError:
        raise ValueError(f"layers_to_keep={spec!r} must be comma-separated layer indices, e.g. "
                         "0,2,4") from None
    outside = [i for i in keep if not 0 <= i < config.num_layers]
    if outside:
        raise ValueError(f"layers_to_keep={spec!r}: {outside} outside the {config.num_layers} "
                         f"layers; use indices 0..{config.num_layers - 1}")
    if len(set(keep)) != len(keep):
        raise ValueError(f"layers_to_keep={spec!r} names a layer more than once; list each once")
    return tuple(sorted(keep))


def keep_layers(params: dict[str, Any], keep: tuple[int, ...]) -> dict[str, Any]:
    """The pure-dict `params` of a model with every EncoderStack's stacked layers cut to `keep`
    (renumbered 0..len(keep) - 1, as fairseq `prune_state_dict`), the rest as they are; a
    ValueError when they hold no such stack."""
    cuts = []

    def cut(tree: Any, in_stack: bool) -> Any:
        if not isinstance(tree, dict):
            return tree
        if in_stack and "layers" in tree:
            cuts.append(True)
            return {**tree, "layers": jax.tree.map(lambda a: a[np.asarray(keep)], tree["layers"])}
        return {name: cut(value, name == "stack") for name, value in tree.items()}

    pruned = cut(params, False)
    if not cuts:
        raise ValueError("layers_to_keep prunes the stacked layers of models/encoder.py's "
                         "encoder, which this model does not have; set layers_to_keep=''")
    return pruned


class Encoder(nnx.Module):
    """Embeddings (+ projection when `embedding_size` != `hidden_size`) + encoder stack; returns
    the last hidden states [B, T, H].

    Shapes in this module (letters as google-research/bert modeling.py `transformer_model`):
    B batch size, T sequence length (queries and keys alike), E embedding width
    (`embedding_width`), H hidden size, N attention heads, D head size (H / N), F intermediate
    (feed-forward) size, L layers.

    `embeddings` lets two encoders share one `Embeddings` module (ELECTRA's generator and
    discriminator): NNX keeps a single copy of its parameters, which receives the gradients of
    both users. Its width must equal this config's `embedding_width`. `shared_layers`: one
    layer's parameters serve every layer (ALBERT).
    """

    def __init__(self, config: EncoderConfig, *, rngs: nnx.Rngs,
                 embeddings: Embeddings | None = None, shared_layers: bool = False):
        self.config = config
        if embeddings is not None and embeddings.config.embedding_width != config.embedding_width:
            raise ValueError(f"shared embeddings have width {embeddings.config.embedding_width}, "
                             f"this encoder expects embedding_size {config.embedding_width}")
        self.embeddings = embeddings if embeddings is not None else Embeddings(config, rngs=rngs)
        # Its output is the hidden width, sharded as every hidden ("embed"; ("embed", "mlp")
        # is the pattern that gave the masked-LM head wrong gradients, MaskedLMHead).
        self.embeddings_project = (
            dense(config, config.embedding_width, config.hidden_size, ("mlp", "embed"), rngs)
            if config.embedding_width != config.hidden_size else None)
        self.stack = EncoderStack(config, rngs=rngs, shared=shared_layers)

    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        rng: jax.Array | None = None,
        position_ids: jax.Array | None = None,
    ) -> jax.Array:
        """`input_ids`, `token_type_ids` [B, T] -> [B, T, H]. `attention_mask` [B, T] (1 = token)
        masks keys; [B, T, T] (1 = query i may attend to key j) sets each query's keys (UniLM's
        self-attention masks, Dong et al. 2019 §2.2). `position_ids` [B, T]: see `Embeddings`."""
        return self.stack(*self.stack_inputs(input_ids, token_type_ids, attention_mask, rng,
                                             position_ids))  # [B, T, H]

    def stack_inputs(
        self, input_ids: jax.Array, token_type_ids: jax.Array | None,
        attention_mask: jax.Array | None, rng: jax.Array | None,
        position_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """`__call__`'s arguments -> the stack's: the embeddings [B, T, H], the boolean mask
        [B, 1, 1 or T, T] and the stack's dropout key."""
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        embed_rng, stack_rng = split_rng(rng, 2)
        x = self.embed(input_ids, token_type_ids, embed_rng, position_ids)  # [B, T, H]
        mask = attention_mask.astype(bool)
        mask = mask[:, None, None, :] if mask.ndim == 2 else mask[:, None]  # [B, 1, 1 or T, T]
        return x, mask, stack_rng

    def embed(self, input_ids: jax.Array, token_type_ids: jax.Array, rng: jax.Array | None,
              position_ids: jax.Array | None = None) -> jax.Array:
        """The stack's input [B, T, H]: `Embeddings`, then the projection if any."""
        x = self.embeddings(input_ids, token_type_ids, rng, position_ids)  # [B, T, E]
        if self.embeddings_project is not None:
            x = self.embeddings_project(x)  # [B, T, H]
        return x

