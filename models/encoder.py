"""The shared Transformer encoder (BERT-style, post-LayerNorm) in Flax NNX.

Reference: google-research/bert modeling.py (`embedding_postprocessor`, `transformer_model`) and
HF transformers modeling_bert.py, whose weights convert one-to-one (see `pretrain/hf.py`).
Used by BERT, ELECTRA, RoBERTa (`position_padding_id`: positions counted over non-padding
tokens) and ALBERT (`shared_layers`: one layer applied `num_layers` times).

Parameters carry logical axis names in their `out_sharding` metadata (`vocab`, `embed`, `heads`,
`mlp`, `layers`, `norm`); `pretrain.mesh` maps those to mesh axes. Layers are stored stacked
(leading `layers` axis) whether they run under `nnx.scan` or a Python loop, so checkpoints and
conversions do not depend on that flag; a shared layer is stored once, without that axis.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_saveable": jax.checkpoint_policies.checkpoint_dots,
}

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """The hyper-parameters every Transformer here shares; names follow BERT's
    `bert_config.json` where possible.

    `hidden_act='gelu'` is the exact erf GELU (HF transformers); the TF reference used the tanh
    approximation, available as `gelu_tanh`. `remat` is `none`, `full`, `dots` or `dots_saveable`.
    Parameters are float32; `dtype` is the compute dtype. `attention_implementation` is what
    `jax.nn.dot_product_attention` runs where attention has no dropout: `xla` (any backend) or
    `cudnn` (GPU flash attention; needs a bfloat16/float16 `dtype`).
    """

    vocab_size: int = 30522
    """Word-embedding rows (BERT uncased 30522); 0 = the tokenizer's, set when pre-training."""
    hidden_size: int = 768
    """Width of the hidden states (BERT-Base 768; HF `hidden_size`, XLNet `d_model`)."""
    num_layers: int = 12
    """Transformer layers (BERT-Base 12; ALBERT: applications of its one shared layer)."""
    num_heads: int = 12
    """Attention heads; must divide hidden_size (BERT-Base 12)."""
    intermediate_size: int = 3072
    """Inner width of the feed-forward block (BERT-Base 3072 = 4 x hidden)."""
    hidden_act: str = "gelu"
    """Feed-forward activation: gelu (exact erf), gelu_tanh (HF `gelu_new`) or relu."""
    layer_norm_eps: float = 1e-12
    """LayerNorm epsilon (BERT 1e-12; fairseq and GPT-2 1e-5; HF `layer_norm_eps`)."""
    hidden_dropout: float = 0.1
    """Dropout on residual branches and (not GPT-2's) embeddings (HF `hidden_dropout_prob` 0.1)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities (BERT `attention_probs_dropout_prob` 0.1)."""
    initializer_range: float = 0.02
    """Std of the random weight init (0.02 in BERT, GPT-2 and XLNet)."""
    dtype: str = "float32"
    """Compute dtype: float32, bfloat16 or float16 (parameters stay float32)."""
    scan_layers: bool = True
    """Run layers under `nnx.scan` (compiled once) or a Python loop; same parameters either way."""
    remat: str = "none"
    """Backprop recompute per layer: none, full, dots (keep x @ W matmuls), dots_saveable (all)."""
    attention_implementation: str = "xla"
    """Kernel of attention without dropout: xla or cudnn (GPU flash, bf16/fp16); unused by XLNet."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        check_rates(self, ("hidden_dropout", "attention_dropout"))
        if not (self.layer_norm_eps > 0 and self.initializer_range >= 0):
            raise ValueError(f"layer_norm_eps={self.layer_norm_eps} must be > 0 and "
                             f"initializer_range={self.initializer_range} >= 0")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {sorted(ACTIVATIONS)}")
        check_execution_fields(self)

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def embedding_width(self) -> int:
        """The word-embedding width (the hidden size unless a family factorises it)."""
        return self.hidden_size


def check_rates(config: Any, names: tuple[str, ...]) -> None:
    """Probabilities such as dropout rates must lie in [0, 1)."""
    for name in names:
        if not 0.0 <= getattr(config, name) < 1.0:
            raise ValueError(f"{name}={getattr(config, name)} must be in [0, 1)")


COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


def check_dtype(config: Any, allowed: tuple[str, ...] = COMPUTE_DTYPES) -> None:
    """The compute `dtype` must be one of `allowed` (parameters stay float32)."""
    if config.dtype not in allowed:
        raise ValueError(f"dtype={config.dtype!r} is not a compute dtype; use one of "
                         f"{', '.join(allowed)}")


def check_execution_fields(config: Any) -> None:
    """Validates `remat`, `attention_implementation` and `dtype` (shared by every model
    config that has them, e.g. T5's, which is not a TransformerConfig)."""
    check_dtype(config)
    if config.remat != "none" and config.remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be 'none' or one of {sorted(REMAT_POLICIES)}")
    if config.attention_implementation not in ("xla", "cudnn"):
        raise ValueError("attention_implementation must be 'xla' or 'cudnn'")
    if config.attention_implementation == "cudnn" and config.dtype not in ("bfloat16",
                                                                          "float16"):
        raise ValueError("attention_implementation='cudnn' needs dtype bfloat16 or "
                         "float16; set model.dtype=bfloat16")


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
    """Token-type (segment) ids in the embedding table (BERT 2, RoBERTa 1)."""
    position_padding_id: int = -1
    """-1: positions 0..T-1 (BERT); p >= 0: padding id p, real tokens from p + 1 (RoBERTa)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.embedding_size < 0:
            raise ValueError(f"embedding_size {self.embedding_size} must be >= 0 (0 = hidden_size)")

    @property
    def embedding_width(self) -> int:
        return self.embedding_size or self.hidden_size


def dense(
    config: TransformerConfig, in_features: int, out_features: int,
    axes: tuple[str | None, str | None], rngs: nnx.Rngs,
    kernel_init: nnx.Initializer | None = None,
) -> nnx.Linear:
    """A Linear layer with BERT's truncated-normal(0.02) init (or `kernel_init`) and logical
    sharding names."""
    return nnx.Linear(
        in_features,
        out_features,
        dtype=config.compute_dtype,
        kernel_init=nnx.with_partitioning(
            kernel_init or nnx.initializers.truncated_normal(config.initializer_range), axes
        ),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (axes[1],)),
        rngs=rngs,
    )


def layer_norm(config: TransformerConfig, features: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    """LayerNorm with BERT's epsilon; statistics are computed in float32 by Flax."""
    return nnx.LayerNorm(
        features,
        epsilon=config.layer_norm_eps,
        dtype=config.compute_dtype,
        scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("norm",)),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("norm",)),
        rngs=rngs,
    )


def embed(
    config: TransformerConfig, num: int, features: int, axes: tuple[str | None, str | None],
    rngs: nnx.Rngs, embedding_init: nnx.Initializer | None = None,
) -> nnx.Embed:
    """An embedding table with BERT's truncated-normal(0.02) init (or `embedding_init`)."""
    return nnx.Embed(
        num,
        features,
        dtype=config.compute_dtype,
        embedding_init=nnx.with_partitioning(
            embedding_init or nnx.initializers.truncated_normal(config.initializer_range), axes
        ),
        rngs=rngs,
    )


def dropout(x: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
    """Inverted dropout; `rng=None` means deterministic (evaluation)."""
    if rng is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x)).astype(x.dtype)


def split_rng(rng: jax.Array | None, num: int) -> list[jax.Array | None]:
    return [None] * num if rng is None else list(jax.random.split(rng, num))


def relative_position_bucket(relative_position: jax.Array, bidirectional: bool = True,
                             num_buckets: int = 32, max_distance: int = 128) -> jax.Array:
    """T5's bucketing of `key - query` offsets (Raffel et al. 2020 §2.1; transformers
    modeling_t5.py `_relative_position_bucket`, which MPNet's `relative_position_bucket` equals):
    half the buckets (bidirectional) hold keys after the query; within a half, offsets below
    num_buckets / 4 get a bucket each, larger ones share log-spaced buckets up to
    `max_distance`. Unidirectional (a decoder) keeps only keys at or before the query."""
    buckets = jnp.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).astype(relative_position.dtype) * num_buckets
        distance = jnp.abs(relative_position)
    else:
        distance = -jnp.minimum(relative_position, 0)
    max_exact = num_buckets // 2
    scaled = (jnp.log(distance.astype(jnp.float32) / max_exact) / jnp.log(max_distance / max_exact)
              * (num_buckets - max_exact))
    large = jnp.minimum(max_exact + scaled.astype(relative_position.dtype), num_buckets - 1)
    return buckets + jnp.where(distance < max_exact, distance, large)


class Embeddings(nnx.Module):
    """Word + position + token-type embeddings, LayerNorm, dropout (modeling.py
    `embedding_lookup` + `embedding_postprocessor`)."""

    def __init__(self, config: EncoderConfig, *, rngs: nnx.Rngs):
        h = config.embedding_width
        self.config = config
        self.word_embeddings = embed(config, config.vocab_size, h, ("vocab", "embed"), rngs)
        self.position_embeddings = embed(config, config.max_position_embeddings, h,
                                         (None, "embed"), rngs)
        self.token_type_embeddings = embed(config, config.type_vocab_size, h, (None, "embed"),
                                           rngs)
        self.layer_norm = layer_norm(config, h, rngs)

    def __call__(
        self, input_ids: jax.Array, token_type_ids: jax.Array, rng: jax.Array | None
    ) -> jax.Array:
        padding_id = self.config.position_padding_id
        if padding_id < 0:
            seq_len = input_ids.shape[1]
            positions = self.position_embeddings.embedding[:seq_len][None].astype(
                self.config.compute_dtype)
        else:
            positions = self.position_embeddings(padded_position_ids(input_ids, padding_id))
        x = (
            self.word_embeddings(input_ids)
            + positions
            + self.token_type_embeddings(token_type_ids)
        )
        return dropout(self.layer_norm(x), self.config.hidden_dropout, rng)


def padded_position_ids(input_ids: jax.Array, padding_id: int) -> jax.Array:
    """RoBERTa's position ids (see `EncoderConfig.position_padding_id`): padding_id + the
    running count of non-padding tokens, and padding_id itself at padding tokens."""
    real = (input_ids != padding_id).astype(jnp.int32)
    return jnp.cumsum(real, axis=1) * real + padding_id


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, dropout_rate: float,
    rng: jax.Array | None, implementation: str = "xla", *, bias: jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Scaled dot-product attention over [batch, seq, heads, head_dim].

    `bias` [batch or 1, heads, q, k] is added to the scaled scores (T5's relative position
    bias); `scale` replaces 1/sqrt(head_dim) (T5: 1.0, no scaling).

    Without attention-probability dropout it goes through `jax.nn.dot_product_attention` with
    `implementation` (`cudnn`: flash attention on GPU). BERT's reference applies dropout to the
    probabilities
    (attention_probs_dropout_prob 0.1), which no fused kernel offers, so that case takes the
    explicit einsum path with a float32 softmax. Masked keys get the dtype's lowest value, as HF.
    """
    if rng is None or dropout_rate == 0.0:
        return jax.nn.dot_product_attention(
            q, k, v, bias=None if bias is None else bias.astype(q.dtype), mask=mask,
            scale=scale, implementation=implementation)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = dropout(jax.nn.softmax(logits, axis=-1), dropout_rate, rng).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


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

    def __call__(self, x: jax.Array, mask: jax.Array, rng: jax.Array | None) -> jax.Array:
        c = self.config
        attn_rng, attn_out_rng, mlp_rng = split_rng(rng, 3)
        heads = (*x.shape[:2], c.num_heads, c.hidden_size // c.num_heads)
        q, k, v = (proj(x).reshape(heads) for proj in (self.query, self.key, self.value))
        context = attention(q, k, v, mask, c.attention_dropout, attn_rng,
                            c.attention_implementation).reshape(x.shape)
        attn = dropout(self.attention_output(context), c.hidden_dropout, attn_out_rng)
        x = self.attention_layer_norm(x + attn)
        y = self.output(ACTIVATIONS[c.hidden_act](self.intermediate(x)))
        return self.output_layer_norm(x + dropout(y, c.hidden_dropout, mlp_rng))


def stacked_layers(make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int,
                   rngs: nnx.Rngs) -> nnx.Module:
    """`num_layers` copies of a layer with their parameters stacked on a leading `layers` axis
    (one module whose Variables are [num_layers, ...]), each initialised with its own key."""

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(layer_rngs: nnx.Rngs) -> nnx.Module:
        return make_layer(layer_rngs)

    return create(rngs)


def run_stacked(layers: nnx.Module, apply: Callable[..., tuple[Any, Any]], carry: Any,
                per_layer: Any, config: Any, shared: bool = False) -> tuple[Any, Any]:
    """Runs `apply(layer, carry, per_layer[i]) -> (carry, output)` over stacked layers by
    `nnx.scan` (`config.scan_layers`) or a Python loop, under `config.remat`. `per_layer` is a
    pytree (or None) with a leading layer axis; the outputs come back stacked the same way.
    `shared`: `layers` is ONE layer applied `config.num_layers` times (ALBERT's cross-layer
    sharing, Lan et al. 2020 §3.1); its gradient sums over the applications."""
    if config.remat != "none":
        apply = nnx.remat(apply, policy=REMAT_POLICIES[config.remat])
    if config.scan_layers:
        scan = nnx.scan(apply, in_axes=(None if shared else 0, nnx.Carry, 0),
                        out_axes=(nnx.Carry, 0), length=config.num_layers if shared else None)
        return scan(layers, carry, per_layer)
    graphdef, state = nnx.split(layers)
    outputs = []
    for i in range(config.num_layers):
        layer = (layers if shared
                 else nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)))
        carry, output = apply(layer, carry, jax.tree.map(lambda a, i=i: a[i], per_layer))
        outputs.append(output)
    return carry, jax.tree.map(lambda *xs: jnp.stack(xs), *outputs)


class EncoderStack(nnx.Module):
    """`num_layers` EncoderLayers with stacked parameters (`layers`), or with `shared` one
    EncoderLayer (`layer`) applied `num_layers` times; run by `nnx.scan` or a Python loop."""

    def __init__(self, config: EncoderConfig, *, rngs: nnx.Rngs, shared: bool = False):
        self.config = config
        self.shared = shared
        if shared:
            self.layer = EncoderLayer(config, rngs=rngs)
        else:
            self.layers = stacked_layers(lambda r: EncoderLayer(config, rngs=r),
                                         config.num_layers, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array, rng: jax.Array | None) -> jax.Array:
        keys = None if rng is None else jax.random.split(rng, self.config.num_layers)

        def apply(layer: EncoderLayer, h: jax.Array, key: jax.Array | None):
            return layer(h, mask, key), None

        layers = self.layer if self.shared else self.layers
        return run_stacked(layers, apply, x, keys, self.config, shared=self.shared)[0]


class Encoder(nnx.Module):
    """Embeddings (+ projection when `embedding_size` != `hidden_size`) + encoder stack; returns
    the last hidden states [batch, seq, hidden].

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
        self.embeddings_project = (
            dense(config, config.embedding_width, config.hidden_size, ("embed", "mlp"), rngs)
            if config.embedding_width != config.hidden_size else None)
        self.stack = EncoderStack(config, rngs=rngs, shared=shared_layers)

    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        rng: jax.Array | None = None,
    ) -> jax.Array:
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        embed_rng, stack_rng = split_rng(rng, 2)
        x = self.embeddings(input_ids, token_type_ids, embed_rng)
        if self.embeddings_project is not None:
            x = self.embeddings_project(x)
        key_mask = attention_mask.astype(bool)[:, None, None, :]
        return self.stack(x, key_mask, stack_rng)


class MaskedLMHead(nnx.Module):
    """A masked-LM head: dense(hidden -> embedding width), activation, LayerNorm, then the tied
    word-embedding matrix plus a bias (HF `RobertaLMHead`, `AlbertMLMHead`; BERT's
    `cls.predictions` at embedding width = hidden). `activation` defaults to `hidden_act`."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs,
                 activation: str | None = None):
        e = config.embedding_width
        self.activation = activation or config.hidden_act
        self.dense = dense(config, config.hidden_size, e, ("embed", "mlp"), rngs)
        self.layer_norm = layer_norm(config, e, rngs)
        self.bias = nnx.Param(jnp.zeros((config.vocab_size,)), out_sharding=("vocab",))

    def __call__(self, hidden: jax.Array, word_embeddings: nnx.Embed,
                 masked_positions: jax.Array | None = None) -> jax.Array:
        """Logits [B, T, V], or [B, P, V] at `masked_positions` [B, P] (gathered before the
        vocabulary projection, as run_pretraining.py `gather_indexes`)."""
        if masked_positions is not None:
            hidden = jnp.take_along_axis(hidden, masked_positions[..., None], axis=1)
        x = self.layer_norm(ACTIVATIONS[self.activation](self.dense(hidden)))
        logits = word_embeddings.attend(x)
        return logits + self.bias[...].astype(logits.dtype)
