"""The building blocks that the Transformers here share, in Flax NNX: their common config
fields (`TransformerConfig`) and checks, Linear / LayerNorm / Embed layers with BERT's
initialisation and logical sharding names, dropout, scaled dot-product attention, T5's relative
position buckets, stacked layers run by `nnx.scan` or a loop (`stacked_layers`, `run_stacked`),
and the masked-LM head of BERT, ELECTRA's generator, RoBERTa, ALBERT and MPNet (`MaskedLMHead`).

Reference: google-research/bert modeling.py (`dense_layer_*`, `layer_norm`,
`create_initializer`, `attention_layer`) and HF transformers modeling_bert.py.

Parameters carry logical axis names in their `out_sharding` metadata (`vocab`, `embed`, `heads`,
`mlp`, `layers`, `norm`); `pretrain.mesh` maps those to mesh axes.
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


class UpdateCount(nnx.Variable):
    """A count of training updates that a schedule reads, kept in the model's state (not a
    parameter: the optimizer never sees it; checkpointed and resumed with the model). BYOL: the
    target's EMA updates k; wav2vec 2.0: the updates the Gumbel temperature anneals over."""


class Frozen(nnx.Variable):
    """A pre-trained weight that nothing trains (not a parameter: no gradient, no optimizer
    state; checkpointed with the model's other state). DistilBERT's teacher."""


def params_as(module: nnx.Module, kind: type[nnx.Variable]) -> nnx.Module:
    """`module` (a copy) with every `nnx.Param` turned into a `kind` Variable of the same value
    and sharding metadata; its other state as it is."""
    graphdef, params, rest = nnx.split(nnx.clone(module), nnx.Param, ...)
    params = jax.tree.map(lambda p: kind(p.get_value(), **p.get_metadata()), params,
                          is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, params, rest)


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


# Tables of at most this many rows are read by a one-hot product (see `Embedding`).
ONE_HOT_ROWS = 64


class Embedding(nnx.Embed):
    """`nnx.Embed` whose lookup keeps the gradient exact and fast in mixed precision.

    Rows are gathered from the parameter in its own dtype (float32) and only then cast to the
    compute dtype, so the gradient is a float32 scatter-add: accumulated exactly and with the
    GPU's native atomics. `nnx.Embed` casts the whole table first, and the bfloat16 scatter it
    then needs took 63 ms of a 217 ms BERT-base step on an H200 (bench/gpu_suite, 2026-11-28).
    Tables of at most `ONE_HOT_ROWS` rows (token types, languages, relative-position buckets)
    are read by a one-hot product instead: their gradient is then a matrix product rather than
    a scatter of every position onto a few contended rows (the 2-row token-type table took
    another 62 ms). Both give the rows exactly; `attend` (tied output layers) is unchanged."""

    def __call__(self, inputs: jax.Array) -> jax.Array:
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"embedding inputs must be integers, got {inputs.dtype}")
        table = self.embedding.get_value()
        if self.num_embeddings <= ONE_HOT_ROWS:
            rows = jnp.dot(jax.nn.one_hot(inputs, self.num_embeddings, dtype=table.dtype),
                           table, precision=jax.lax.Precision.HIGHEST)
        else:
            rows = jnp.take(table, inputs, axis=0)
        return rows.astype(self.dtype or table.dtype)


def embed(
    config: TransformerConfig, num: int, features: int, axes: tuple[str | None, str | None],
    rngs: nnx.Rngs, embedding_init: nnx.Initializer | None = None,
) -> Embedding:
    """An embedding table with BERT's truncated-normal(0.02) init (or `embedding_init`)."""
    return Embedding(
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
        if implementation == "cudnn":  # cuDNN takes a mask (as a bias) only at [.., q, k]
            mask = jnp.broadcast_to(mask, (*mask.shape[:2], q.shape[1], k.shape[1]))
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


def write_slot(cache: jax.Array, new: jax.Array, index: jax.Array | int) -> jax.Array:
    """`cache` [B, S, ...] with `new` [B, T, ...] written at slots index .. index + T - 1 (one
    layer's keys or values of incremental decoding)."""
    return jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), index, axis=1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecoderCache:
    """What an encoder-decoder's decoder keeps between the steps of incremental decoding, every
    array stacked on a leading layer axis: the self-attention keys and values of the decoder
    positions so far (`keys`, `values` [L, N, length, heads, head_dim], slot t = position t), the
    cross-attention keys and values of the encoder states, computed once (`cross_keys`,
    `cross_values` [L, N, S, heads, head_dim]) and the encoder positions that are tokens
    (`cross_mask` [N, S] bool). The decoding protocol of `models.beam_search`: a model's
    `prefill_decoder` makes one, its `decode_step` reads and extends it."""

    keys: jax.Array
    values: jax.Array
    cross_keys: jax.Array
    cross_values: jax.Array
    cross_mask: jax.Array

    @classmethod
    def start(cls, cross: tuple[jax.Array, jax.Array], cross_mask: jax.Array, length: int
              ) -> DecoderCache:
        """Empty self-attention slots for `length` positions beside the cross-attention's
        stacked (keys, values) [L, N, S, heads, head_dim]."""
        keys = cross[0]
        empty = jnp.zeros((keys.shape[0], keys.shape[1], length, *keys.shape[3:]), keys.dtype)
        return cls(empty, empty, *cross, cross_mask.astype(bool))

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def per_layer(self) -> tuple[jax.Array, ...]:
        """(keys, values, cross keys, cross values), layer axis first (`run_stacked`'s
        per-layer input)."""
        return self.keys, self.values, self.cross_keys, self.cross_values

    def self_mask(self, position: jax.Array) -> jax.Array:
        """[1, 1, 1, length]: the slots a query at `position` attends to (0 .. position)."""
        return (jnp.arange(self.length) <= position)[None, None, None, :]

    def cross_attention_mask(self) -> jax.Array:
        """[N, 1, 1, S]: the encoder tokens."""
        return self.cross_mask[:, None, None, :]

    def updated(self, keys_values: tuple[jax.Array, jax.Array]) -> DecoderCache:
        return dataclasses.replace(self, keys=keys_values[0], values=keys_values[1])

    def reorder(self, rows: jax.Array) -> DecoderCache:
        """Row i takes row `rows[i]`'s self-attention keys and values (a beam continuing another
        beam's prefix); the cross-attention parts stay, as rows only move within one source's
        beams."""
        return self.updated((self.keys[:, rows], self.values[:, rows]))


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


def per_layer_outputs(layers: nnx.Module, fn: Callable[[Any], Any], config: Any) -> Any:
    """`fn(layer)` of every stacked layer, stacked on a leading layer axis (e.g. each
    decoder layer's cross-attention keys and values of the encoder states)."""
    return run_stacked(layers, lambda layer, carry, _: (carry, fn(layer)), jnp.zeros(()), None,
                       config)[1]


class MaskedLMHead(nnx.Module):
    """The masked-LM head of every model here that has one: dense(hidden -> embedding width),
    activation, LayerNorm, then the tied word-embedding matrix plus a bias (run_pretraining.py
    `get_masked_lm_output`; HF `BertLMPredictionHead` (`cls.predictions`), ELECTRA's
    `generator_predictions` + `generator_lm_head`, `RobertaLMHead`, `AlbertMLMHead`,
    `MPNetLMHead`). `activation` defaults to `hidden_act` (RoBERTa and MPNet: exact GELU)."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs,
                 activation: str | None = None):
        e = config.embedding_width
        self.activation = activation or config.hidden_act
        # Its output meets the tied table's "embed" axis and is sharded so: ("embed", "mlp")
        # gave wrong gradients on a data x fsdp x tensor mesh (XLA; tests/test_models.py).
        self.dense = dense(config, config.hidden_size, e, ("mlp", "embed"), rngs)
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
