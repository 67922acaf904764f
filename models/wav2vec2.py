"""wav2vec 2.0 (Baevski et al. 2020) in Flax NNX: the convolutional feature encoder over raw
audio, the feature projection, the Transformer context network with its grouped convolutional
position embedding, the learned mask vector, the Gumbel product quantiser and the two heads that
project context and quantised vectors into the space of the contrastive task.

Reference: fairseq `models/wav2vec/wav2vec2.py` (`Wav2Vec2Model`) and HF transformers
modeling_wav2vec2.py (`Wav2Vec2ForPreTraining`), whose weights convert one-to-one
(`models/hf/wav2vec2.py`) and which is the parity oracle (tests/test_wav2vec2.py). The losses
built on these outputs (contrastive, diversity, feature penalty) and the host-side span masks
and negatives are in `objectives/wav2vec2.py`.

Paper sections: §2 (feature encoder, context network, quantisation module), §3.1 (masking:
masked frames' projected features are replaced by one learned vector before the Transformer),
§3.2 (objective). `conv_norm="group"` is the BASE model's feature encoder (group norm with one
group per channel after the first convolution only), `"layer"` the LARGE/LV-60 one (layer norm
after every convolution); `pre_layer_norm` is HF's `do_stable_layer_norm` (pre-LN blocks and a
final LayerNorm, as the LV-60 checkpoints).

Shape comments use the letters of `Wav2Vec2`'s legend.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.models.encoder import EncoderLayer
from pretext_jax.models.layers import (
    ACTIVATIONS,
    UpdateCount,
    attention,
    check_execution_fields,
    check_rates,
    dense,
    dropout,
    layer_norm,
    run_stacked,
    split_rng,
    stacked_layers,
)

CONV_NORMS = ("group", "layer")
CONV_NORM_EPS = 1e-5  # torch GroupNorm / LayerNorm default inside the feature encoder


@dataclasses.dataclass(frozen=True)
class SpeechEncoderConfig:
    """The network wav2vec 2.0 and HuBERT share (HF `Wav2Vec2Model` and `HubertModel` are the
    same modules): the convolutional feature encoder, the feature projection and the
    Transformer context network (defaults: BASE, fairseq `wav2vec2_base_librispeech` and
    `hubert_base_librispeech`; HF `Wav2Vec2Config` names in brackets where they differ).
    Masking and loss settings (mask probability and span, negatives, temperatures, loss
    weights) are the objectives', not here. `dtype` is the compute dtype (parameters stay
    float32); `scan_layers`, `remat` and `attention_implementation` as in
    `models.layers.TransformerConfig`."""

    conv_channels: tuple[int, ...] = (512,) * 7
    """Output channels of each feature-encoder convolution [conv_dim]."""
    conv_kernel_sizes: tuple[int, ...] = (10, 3, 3, 3, 3, 2, 2)
    """Kernel width of each feature-encoder convolution [conv_kernel]."""
    conv_strides: tuple[int, ...] = (5, 2, 2, 2, 2, 2, 2)
    """Stride of each feature-encoder convolution [conv_stride]; BASE: 320 samples a frame."""
    conv_bias: bool = False
    """Whether the feature-encoder convolutions have biases (BASE and LARGE: no)."""
    conv_norm: str = "group"
    """group: per-channel group norm after conv 0 only (BASE); layer: LayerNorm after every conv
    (LARGE/LV-60) [feat_extract_norm]."""
    hidden_size: int = 768
    """Width of the context network (BASE 768, LARGE 1024)."""
    num_layers: int = 12
    """Transformer blocks (BASE 12, LARGE 24) [num_hidden_layers]."""
    num_heads: int = 12
    """Attention heads; must divide hidden_size [num_attention_heads]."""
    intermediate_size: int = 3072
    """Inner width of the feed-forward block (BASE 3072)."""
    hidden_act: str = "gelu"
    """Activation of the feed-forward blocks, the convolutions and the position convolution
    (exact erf GELU, as fairseq and HF)."""
    layer_norm_eps: float = 1e-5
    """Epsilon of the feature projection's and the Transformer's LayerNorms."""
    pre_layer_norm: bool = False
    """Pre-LN blocks plus a final LayerNorm (LV-60 "stable layer norm") instead of post-LN
    [do_stable_layer_norm]."""
    position_conv_kernel: int = 128
    """Kernel width of the convolutional position embedding [num_conv_pos_embeddings]."""
    position_conv_groups: int = 16
    """Groups of that convolution; must divide hidden_size [num_conv_pos_embedding_groups]."""
    hidden_dropout: float = 0.1
    """Dropout on residual branches and after the position embedding (fairseq `dropout`)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities."""
    activation_dropout: float = 0.0
    """Dropout after the feed-forward activation (fairseq BASE 0.0)."""
    feature_projection_dropout: float = 0.1
    """Dropout on the projected features before masking (fairseq `dropout_input`)
    [feat_proj_dropout]."""
    layerdrop: float = 0.05
    """Probability of skipping each Transformer block while training (fairseq BASE 0.05)."""
    initializer_range: float = 0.02
    """Std of the Transformer's and heads' random init (HF 0.02)."""
    dtype: str = "float32"
    """Compute dtype: float32, bfloat16 or float16 (parameters stay float32)."""
    scan_layers: bool = True
    """Run blocks under `nnx.scan` (compiled once) or a Python loop; same parameters either way."""
    remat: str = "none"
    """Backprop recompute per block: none, full, dots or dots_saveable."""
    attention_implementation: str = "xla"
    """Kernel of attention without dropout: xla or cudnn (GPU flash, bf16/fp16)."""

    def __post_init__(self) -> None:
        for name in ("conv_channels", "conv_kernel_sizes", "conv_strides"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        if not (len(self.conv_channels) == len(self.conv_kernel_sizes) == len(self.conv_strides)
                and self.conv_channels):
            raise ValueError("conv_channels, conv_kernel_sizes and conv_strides must have one "
                             "entry per feature-encoder convolution (BASE: 7 each)")
        if min(*self.conv_channels, *self.conv_kernel_sizes, *self.conv_strides) < 1:
            raise ValueError("conv_channels, conv_kernel_sizes and conv_strides must be >= 1")
        if self.conv_norm not in CONV_NORMS:
            raise ValueError(f"conv_norm={self.conv_norm!r} must be one of {CONV_NORMS}")
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size",
                     "position_conv_kernel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name, divisor in (("num_heads", self.num_heads),
                              ("position_conv_groups", self.position_conv_groups)):
            if divisor < 1 or self.hidden_size % divisor:
                raise ValueError(f"hidden_size {self.hidden_size} is not divisible by {name} "
                                 f"{divisor}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {sorted(ACTIVATIONS)}")
        check_rates(self, ("hidden_dropout", "attention_dropout", "activation_dropout",
                           "feature_projection_dropout", "layerdrop"))
        if not (self.layer_norm_eps > 0 and self.initializer_range >= 0):
            raise ValueError(f"layer_norm_eps={self.layer_norm_eps} must be > 0 and "
                             f"initializer_range={self.initializer_range} >= 0")
        check_execution_fields(self)

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def normalizes_features(self) -> bool:
        """Whether a LayerNorm comes between the feature encoder and the projection (always in
        wav2vec 2.0; HuBERT's `feature_projection_layer_norm`)."""
        return True

    @property
    def samples_per_frame(self) -> int:
        """The product of the strides (BASE: 320 samples, 20 ms at 16 kHz)."""
        return math.prod(self.conv_strides)


@dataclasses.dataclass(frozen=True)
class Wav2Vec2Config(SpeechEncoderConfig):
    """The wav2vec 2.0 network: the shared encoder (`SpeechEncoderConfig`) and the quantiser
    and the two projections of the contrastive task (defaults: BASE, fairseq
    `wav2vec2_base_librispeech`; HF `Wav2Vec2Config` names in brackets where they differ)."""

    num_codevector_groups: int = 2
    """G, codebooks of the product quantiser (paper: G = 2)."""
    codevectors_per_group: int = 320
    """V, entries per codebook (paper: V = 320) [num_codevectors_per_group]."""
    codevector_dim: int = 256
    """Width of a quantised vector, G codebook entries of codevector_dim / G concatenated."""
    projection_dim: int = 256
    """Width of the space where context and quantised vectors are compared
    [proj_codevector_dim] (fairseq `final_dim`)."""
    quantizer_input_dropout: float = 0.1
    """Dropout on the features the quantiser reads (fairseq `dropout_features`)
    [feat_quantizer_dropout]."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_codevector_groups", "codevectors_per_group", "codevector_dim",
                     "projection_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.codevector_dim % self.num_codevector_groups:
            raise ValueError(f"codevector_dim {self.codevector_dim} is not divisible by "
                             f"num_codevector_groups {self.num_codevector_groups}")
        check_rates(self, ("quantizer_input_dropout",))

    @property
    def num_codevectors(self) -> int:
        """G x V, the quantiser's logits per frame."""
        return self.num_codevector_groups * self.codevectors_per_group


def feature_lengths(config: SpeechEncoderConfig, sample_lengths: np.ndarray | jax.Array | int
                    ) -> np.ndarray | jax.Array | int:
    """Frames the feature encoder makes of `sample_lengths` samples: floor((n - k) / s) + 1 per
    convolution (HF `_get_feat_extract_output_lengths`); numpy, jax or int alike."""
    for kernel, stride in zip(config.conv_kernel_sizes, config.conv_strides, strict=True):
        sample_lengths = (sample_lengths - kernel) // stride + 1
    return sample_lengths


def frame_mask(config: SpeechEncoderConfig, attention_mask: jax.Array, num_frames: int
               ) -> jax.Array:
    """[B, S] sample mask (1 = real, right-padded) -> [B, T] frame mask: the first
    `feature_lengths(sum of the row)` frames are real (HF `_get_feature_vector_attention_mask`)."""
    lengths = feature_lengths(config, attention_mask.astype(jnp.int32).sum(-1))  # [B]
    return jnp.arange(num_frames)[None, :] < lengths[:, None]  # [B, T]


def symmetric_uniform(bound: float) -> nnx.Initializer:
    """U(-bound, bound) (torch `nn.Linear`'s default with bound 1/sqrt(fan_in), which HF keeps
    for the feature projection)."""

    def init(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype = jnp.float32
             ) -> jax.Array:
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def scale_gradient(x: jax.Array, scale: float) -> jax.Array:
    """The identity whose gradient is multiplied by `scale` (fairseq `GradMultiply`, used with
    `feature_grad_mult` 0.1 on the feature encoder's output)."""
    return x


def _scale_gradient_forward(x: jax.Array, scale: float) -> tuple[jax.Array, None]:
    return x, None


def _scale_gradient_backward(scale: float, _: None, gradient: jax.Array
                             ) -> tuple[jax.Array]:
    return (gradient * jnp.asarray(scale, gradient.dtype),)


scale_gradient.defvjp(_scale_gradient_forward, _scale_gradient_backward)


class ConvLayer(nnx.Module):
    """One feature-encoder block: Conv1d (valid padding), an optional norm, GELU (HF
    `Wav2Vec2{NoLayerNorm,GroupNorm,LayerNorm}ConvLayer`)."""

    def __init__(self, config: SpeechEncoderConfig, index: int, *, rngs: nnx.Rngs):
        in_channels = config.conv_channels[index - 1] if index else 1
        channels = config.conv_channels[index]
        self.config = config
        self.conv = nnx.Conv(
            in_channels, channels, kernel_size=(config.conv_kernel_sizes[index],),
            strides=(config.conv_strides[index],), padding="VALID", use_bias=config.conv_bias,
            dtype=config.compute_dtype,
            kernel_init=nnx.with_partitioning(nnx.initializers.he_normal(), (None, None, None)),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (None,)),
            rngs=rngs)
        norm_params = {
            "scale_init": nnx.with_partitioning(nnx.initializers.ones_init(), ("norm",)),
            "bias_init": nnx.with_partitioning(nnx.initializers.zeros_init(), ("norm",))}
        if config.conv_norm == "layer":
            self.norm = nnx.LayerNorm(channels, epsilon=CONV_NORM_EPS, use_fast_variance=False,
                                      dtype=config.compute_dtype, rngs=rngs, **norm_params)
        elif index == 0:  # group norm, one group per channel: statistics over time
            self.norm = nnx.GroupNorm(channels, num_groups=channels, epsilon=CONV_NORM_EPS,
                                      use_fast_variance=False, dtype=config.compute_dtype,
                                      rngs=rngs, **norm_params)
        else:
            self.norm = None

    def __call__(self, x: jax.Array, lengths: jax.Array | None = None) -> jax.Array:
        """[B, S_in, C_in] -> [B, S_out, C_out]. `lengths` [B] (real input samples per row;
        None: every sample): the group norm's statistics over each row's real outputs only."""
        x = self.conv(x)
        if isinstance(self.norm, nnx.GroupNorm) and lengths is not None:
            c = self.config  # the group norm follows the first convolution only
            real = (lengths - c.conv_kernel_sizes[0]) // c.conv_strides[0] + 1  # [B]
            real_frames = jnp.arange(x.shape[1])[None, :, None] < real[:, None, None]
            x = self.norm(x, mask=jnp.broadcast_to(real_frames, x.shape))
        elif self.norm is not None:
            x = self.norm(x)
        return ACTIVATIONS[self.config.hidden_act](x)


class PositionConv(nnx.Module):
    """The convolutional relative position embedding (§2 "Contextualized representations"): a
    grouped Conv1d over time (kernel `position_conv_kernel`, `position_conv_groups` groups,
    "same" padding, the last output dropped when the kernel is even) under weight normalisation
    over the kernel axis, then GELU. Stored as HF stores it (`weight_g`: one gain per kernel
    tap, `weight_v`: the direction), so w[k] = weight_g[k] * weight_v[k] / ||weight_v[k]||."""

    def __init__(self, config: SpeechEncoderConfig, *, rngs: nnx.Rngs):
        k, h = config.position_conv_kernel, config.hidden_size
        self.config = config
        # fairseq (wav2vec2.py `TransformerEncoder`): normal(0, sqrt(4 (1 - dropout) / (k h)))
        # before weight_norm, whose gain starts at ||v||; `dropout` is fairseq's, hidden_dropout.
        std = math.sqrt(4.0 * (1.0 - config.hidden_dropout) / (k * h))
        v = jax.random.normal(rngs.params(), (k, h // config.position_conv_groups, h)) * std
        self.weight_v = nnx.Param(v, out_sharding=(None, None, "embed"))  # [k, H/groups, H]
        self.weight_g = nnx.Param(jnp.sqrt(jnp.sum(v * v, axis=(1, 2), keepdims=True)),
                                  out_sharding=(None, None, None))  # [k, 1, 1]
        self.bias = nnx.Param(jnp.zeros((h,)), out_sharding=("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        """[B, T, H] -> [B, T, H]."""
        c = self.config
        v = self.weight_v[...]
        kernel = self.weight_g[...] * v * jax.lax.rsqrt(jnp.sum(v * v, axis=(1, 2),
                                                                keepdims=True))
        pad = c.position_conv_kernel // 2
        # One dense convolution per group (group g: channels [g*w, (g+1)*w) in and out), the
        # same sums as one with feature_group_count=groups, whose kernel gradient (a
        # batch_group_count convolution) XLA's SPMD partitioner gets wrong when the batch is
        # sharded over some mesh axes and replicated over others (e.g. mesh (2, 2, 2)): it
        # all-reduces the per-shard sums over every device, so the gradient comes out times the
        # replication (x2). Dense convolutions partition like matmuls, and keep the batch
        # sharded where the grouped one gathers it (openxla/xla#47945).
        w = c.hidden_size // c.position_conv_groups
        kernel = kernel.astype(x.dtype)
        y = jnp.concatenate([jax.lax.conv_general_dilated(
            x[..., g * w:(g + 1) * w], kernel[..., g * w:(g + 1) * w], window_strides=(1,),
            padding=[(pad, pad)], dimension_numbers=("NWC", "WIO", "NWC"))
            for g in range(c.position_conv_groups)], axis=-1)
        y = y + self.bias[...].astype(y.dtype)  # [B, T (+1 if k is even), H]
        return ACTIVATIONS[c.hidden_act](y[:, :x.shape[1]])


class Wav2Vec2Layer(EncoderLayer):
    """One Transformer block with the shared encoder block's parameters (`EncoderLayer`):
    post-LN (BASE, LARGE) or pre-LN (`pre_layer_norm`), dropout after the feed-forward
    activation too (HF `Wav2Vec2EncoderLayer[StableLayerNorm]`)."""

    def _attend(self, x: jax.Array, mask: jax.Array, rngs: list[jax.Array | None]
                ) -> jax.Array:
        c = self.config
        heads = (*x.shape[:2], c.num_heads, c.hidden_size // c.num_heads)  # (B, T, N, D)
        q, k, v = (proj(x).reshape(heads) for proj in (self.query, self.key, self.value))
        context = attention(q, k, v, mask, c.attention_dropout, rngs[0],
                            c.attention_implementation).reshape(x.shape)  # [B, T, H]
        return dropout(self.attention_output(context), c.hidden_dropout, rngs[1])  # [B, T, H]

    def _feed_forward(self, x: jax.Array, rngs: list[jax.Array | None]) -> jax.Array:
        c = self.config
        y = dropout(ACTIVATIONS[c.hidden_act](self.intermediate(x)), c.activation_dropout,
                    rngs[2])  # [B, T, F]
        return dropout(self.output(y), c.hidden_dropout, rngs[3])  # [B, T, H]

    def __call__(self, x: jax.Array, mask: jax.Array, rng: jax.Array | None) -> jax.Array:
        """`x` [B, T, H], `mask` [B, 1, 1, T] (True = key may be attended) -> [B, T, H]."""
        rngs = split_rng(rng, 4)
        if self.config.pre_layer_norm:
            x = x + self._attend(self.attention_layer_norm(x), mask, rngs)
            return x + self._feed_forward(self.output_layer_norm(x), rngs)
        x = self.attention_layer_norm(x + self._attend(x, mask, rngs))
        return self.output_layer_norm(x + self._feed_forward(x, rngs))


class Wav2Vec2Encoder(nnx.Module):
    """The context network (HF `Wav2Vec2Encoder[StableLayerNorm]`): padded frames zeroed, plus
    the position convolution, LayerNorm (post-LN) or nothing (pre-LN, whose LayerNorm comes
    after the last block), dropout, then the blocks with LayerDrop while training."""

    def __init__(self, config: SpeechEncoderConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.position_conv = PositionConv(config, rngs=rngs)
        self.layer_norm = layer_norm(config, config.hidden_size, rngs)
        self.layers = stacked_layers(lambda r: Wav2Vec2Layer(config, rngs=r), config.num_layers,
                                     rngs)

    def __call__(self, x: jax.Array, frames: jax.Array, rng: jax.Array | None, *,
                 all_hidden_states: bool = False, groups: int = 1
                 ) -> tuple[jax.Array, jax.Array | None]:
        """`x` [B, T, H], `frames` [B, T] (True = real frame) -> the output [B, T, H] and, with
        `all_hidden_states`, the first block's input and every block's output stacked
        [L+1, B, T, H] (else None; see `Wav2Vec2.hidden_states`). Pre-LN's final LayerNorm is in
        the output only. LayerDrop draws its skips per group of B / `groups` consecutive rows,
        as each GPU draws its own in fairseq (`TransformerEncoder.extract_features`)."""
        c = self.config
        dropout_rng, layer_rng, skip_rng = split_rng(rng, 3)
        x = jnp.where(frames[..., None], x, jnp.zeros_like(x))
        x = x + self.position_conv(x)
        if not c.pre_layer_norm:
            x = self.layer_norm(x)
        x = dropout(x, c.hidden_dropout, dropout_rng)
        key_mask = frames[:, None, None, :]  # [B, 1, 1, T]
        if rng is None:
            per_layer = None
        else:
            per_layer = (jax.random.split(layer_rng, c.num_layers),  # [L, 2]
                         jax.random.bernoulli(skip_rng, c.layerdrop,
                                              (c.num_layers, groups)))  # [L, groups]

        def apply(layer: Wav2Vec2Layer, h: jax.Array, layer_input):
            if layer_input is None:
                h = layer(h, key_mask, None)
            else:
                key, skip = layer_input
                skip = jnp.repeat(skip, h.shape[0] // groups)[:, None, None]  # [B, 1, 1]
                h = jnp.where(skip, h, layer(h, key_mask, key))
            return h, h if all_hidden_states else None

        first = x
        x, outputs = run_stacked(self.layers, apply, x, per_layer, c)  # outputs [L, B, T, H]
        hidden_states = jnp.concatenate([first[None], outputs]) if all_hidden_states else None
        return (self.layer_norm(x) if c.pre_layer_norm else x), hidden_states


def codebook_perplexity(probs: jax.Array, mask: jax.Array | None, groups: int = 1
                        ) -> jax.Array:
    """Per group of B / `groups` consecutive rows, the sum over codebooks of exp(entropy of
    the codebook usage averaged over the group's frames of `mask` (all frames when None)):
    `probs` [B, T, G, V] -> [groups] (HF `_compute_perplexity` for one group; fairseq's
    `prob_perplexity` is one GPU's batch, a group; the diversity loss of §3.2 drives it
    towards G x V)."""
    probs = probs.astype(jnp.float32)
    probs = probs.reshape(groups, -1, *probs.shape[1:])  # [groups, B / groups, T, G, V]
    if mask is None:
        marginal = jnp.mean(probs, axis=(1, 2))  # [groups, G, V]
    else:
        weights = mask.astype(jnp.float32).reshape(groups, -1, mask.shape[-1], 1, 1)
        marginal = (jnp.sum(probs * weights, axis=(1, 2))
                    / jnp.maximum(jnp.sum(weights, axis=(1, 2)), 1.0))
    entropy = -jnp.sum(jax.scipy.special.xlogy(marginal, marginal), axis=-1)  # [groups, G]
    return jnp.sum(jnp.exp(entropy), axis=-1)


class GumbelQuantizer(nnx.Module):
    """The product quantiser (§2 "Quantization module"): logits for G codebooks of V entries;
    training picks one entry per codebook by hard Gumbel-softmax with the straight-through
    gradient of the soft sample (Jang et al. 2016), evaluation by argmax; the picked entries,
    concatenated, are the quantised vector. The perplexity is that of the soft probabilities
    (training) or of the picks (evaluation) over the masked frames, as HF
    `Wav2Vec2GumbelVectorQuantizer`."""

    def __init__(self, config: Wav2Vec2Config, *, rngs: nnx.Rngs):
        g, v = config.num_codevector_groups, config.codevectors_per_group
        self.config = config
        self.weight_proj = dense(config, config.conv_channels[-1], g * v, (None, None), rngs,
                                 kernel_init=nnx.initializers.normal(1.0))
        self.codevectors = nnx.Param(  # [1, G*V, Q/G], as HF's
            jax.random.uniform(rngs.params(), (1, g * v, config.codevector_dim // g)),
            out_sharding=(None, None, None))

    def __call__(self, features: jax.Array, mask: jax.Array | None, rng: jax.Array | None,
                 temperature: float | jax.Array, groups: int = 1
                 ) -> tuple[jax.Array, jax.Array]:
        """`features` [B, T, C], `mask` [B, T] (the masked frames) -> quantised [B, T, Q] and
        the perplexity of each of `groups` groups of rows [groups] (`codebook_perplexity`);
        `rng` None = evaluation (argmax, no noise)."""
        c = self.config
        g, v = c.num_codevector_groups, c.codevectors_per_group
        logits = self.weight_proj(features).astype(jnp.float32)
        logits = logits.reshape(*logits.shape[:2], g, v)  # [B, T, G, V]
        if rng is None:
            probs = jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)
            perplexity = codebook_perplexity(probs, mask, groups)
        else:
            soft = jax.nn.softmax((logits + jax.random.gumbel(rng, logits.shape)) / temperature)
            hard = jax.nn.one_hot(jnp.argmax(soft, axis=-1), v, dtype=jnp.float32)
            # Straight-through: the forward value is exactly `hard` (soft - soft is exactly 0;
            # torch's hard - soft + soft is not), so frames with the same codes get identical
            # quantised vectors, which the loss's distractor check compares exactly.
            probs = hard + (soft - jax.lax.stop_gradient(soft))
            perplexity = codebook_perplexity(jax.nn.softmax(logits), mask, groups)
        codebooks = self.codevectors[...].reshape(g, v, -1)  # [G, V, Q/G]
        quantized = jnp.einsum("btgv,gvq->btgq", probs.astype(c.compute_dtype),
                               codebooks.astype(c.compute_dtype))  # [B, T, G, Q/G]
        return quantized.reshape(*quantized.shape[:2], -1), perplexity  # [B, T, Q]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Wav2Vec2Output:
    """What the pre-training losses read (HF `Wav2Vec2ForPreTrainingOutput` names):

    - `last_hidden_state` [B, T, H]: the context network's output c_t.
    - `projected_states` [B, T, P]: `project_hid`(c_t), compared with the targets.
    - `projected_quantized_states` [B, T, P]: `project_q`(q_t), the targets and distractors.
    - `codevector_perplexity` [groups]: per group of consecutive rows (one group: HF's
      scalar), see `GumbelQuantizer`.
    - `conv_features` [B, T, C]: the feature encoder's output before its LayerNorm (after the
      gradient scaling), whose mean square is fairseq's feature penalty.
    - `frames` [B, T]: True at real (not padding) frames.
    """

    last_hidden_state: jax.Array
    projected_states: jax.Array
    projected_quantized_states: jax.Array
    codevector_perplexity: jax.Array
    conv_features: jax.Array
    frames: jax.Array


class Wav2Vec2Body(nnx.Module):
    """The network under every wav2vec 2.0 and HuBERT head (HF `Wav2Vec2Model`, `HubertModel`):
    the feature encoder, its LayerNorm (none where `config.normalizes_features` is False), the
    feature projection, the mask vector and the context network. The heads
    subclass it, so its parameters keep the same paths in every model (a pre-trained body moves
    into a fine-tuned one as it is). Shapes as in `Wav2Vec2`'s legend."""

    def __init__(self, config: SpeechEncoderConfig, *, rngs: nnx.Rngs):
        c, h = config.conv_channels[-1], config.hidden_size
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self.conv_layers = nnx.List([ConvLayer(config, i, rngs=rngs)
                                         for i in range(len(config.conv_channels))])
            self.feature_layer_norm = (layer_norm(config, c, rngs)
                                       if config.normalizes_features else None)
            self.feature_projection = dense(config, c, h, (None, "embed"), rngs,
                                            kernel_init=symmetric_uniform(1.0 / math.sqrt(c)))
            self.masked_spec_embed = nnx.Param(jax.random.uniform(rngs.params(), (h,)),
                                               out_sharding=("embed",))
            self.encoder = Wav2Vec2Encoder(config, rngs=rngs)

    def extract_features(self, input_values: jax.Array, lengths: jax.Array | None = None
                         ) -> jax.Array:
        """The feature encoder: waveform [B, S] -> conv features [B, T, C]. `lengths` [B]: each
        row's real samples, whose group norm then leaves the padding out, so a padded row's
        real frames equal the utterance's alone (None: statistics over the whole row, as HF)."""
        x = input_values.astype(self.config.compute_dtype)[..., None]  # [B, S, 1]
        for conv_layer in self.conv_layers:
            x = conv_layer(x, lengths)
            lengths = None  # the group norm is the first block's only
        return x  # [B, T, C]

    def _encoder_inputs(
        self, input_values: jax.Array, attention_mask: jax.Array | None,
        rng: jax.Array | None, feature_gradient_scale: float = 1.0, alone: bool = False,
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """The feature encoder, its LayerNorm and the projection with its dropout (HF
        `Wav2Vec2FeatureProjection`): conv features [B, T, C] (after the gradient scaling),
        frames [B, T] (True = real), normed features [B, T, C], projected features [B, T, H].
        `alone`: each row's group norm over its real samples (`extract_features`)."""
        c = self.config
        lengths = (attention_mask.astype(jnp.int32).sum(-1)
                   if alone and attention_mask is not None else None)
        features = self.extract_features(input_values, lengths)  # [B, T, C]
        if feature_gradient_scale == 0.0:  # frozen: no backward pass through the convolutions
            features = jax.lax.stop_gradient(features)
        elif feature_gradient_scale != 1.0:
            features = scale_gradient(features, feature_gradient_scale)
        frames = (jnp.ones(features.shape[:2], bool) if attention_mask is None
                  else frame_mask(c, attention_mask, features.shape[1]))  # [B, T]
        normed = (features if self.feature_layer_norm is None
                  else self.feature_layer_norm(features))  # [B, T, C]
        hidden = dropout(self.feature_projection(normed), c.feature_projection_dropout,
                         rng)  # [B, T, H]
        return features, frames, normed, hidden

    def mask_frames(self, hidden: jax.Array, mask_time_indices: jax.Array) -> jax.Array:
        """Projected features [B, T, H] with the frames where `mask_time_indices` [B, T] is
        True replaced by the learned `masked_spec_embed` (paper §3.1)."""
        return jnp.where(mask_time_indices.astype(bool)[..., None],
                         self.masked_spec_embed[...].astype(hidden.dtype), hidden)

    def hidden_states(self, input_values: jax.Array, attention_mask: jax.Array | None = None,
                      *, alone: bool = False) -> tuple[jax.Array, jax.Array]:
        """Every layer's hidden states for frozen-feature probes, in evaluation mode (no
        dropout, LayerDrop or masking), as HF `Wav2Vec2Model(..., output_hidden_states=True)
        .hidden_states` (transformers 5 modeling_wav2vec2.py): `input_values` [B, S] and
        `attention_mask` [B, S] as in `__call__` -> (hidden states [L+1, B, T, H], frames
        [B, T], True = real frame). Entry 0 is the first block's input: projected features with
        padded frames zeroed plus the position convolution, then the encoder's LayerNorm when
        post-LN (BASE) and none when pre-LN; entry i the i-th block's output, so the last is
        `last_hidden_state` when post-LN and the last block's output before the final LayerNorm
        when pre-LN (transformers 5 records the blocks' outputs, `capture_outputs(
        tie_last_hidden_states=False)`; transformers 4 appended the final LayerNorm's output
        instead). Padded frames hold no meaningful values. `alone`: a padded row's real frames
        equal the utterance's run alone (the group norm leaves the padding out)."""
        _, frames, _, hidden = self._encoder_inputs(input_values, attention_mask, None,
                                                    alone=alone)
        return self.encoder(hidden, frames, None, all_hidden_states=True)[1], frames


class Wav2Vec2(Wav2Vec2Body):
    """wav2vec 2.0 for pre-training (HF `Wav2Vec2ForPreTraining`): waveform -> conv features ->
    LayerNorm -> (a) projection, dropout, masked frames replaced by `masked_spec_embed`, the
    context network, `project_hid`; (b) dropout, the quantiser, `project_q`.

    Shapes in this module: B batch size, S waveform samples, T frames (`feature_lengths`(S)),
    C feature-encoder channels (the last of `conv_channels`), H hidden size, N attention heads,
    D head size (H / N), F intermediate size, L layers, G codebooks, V entries per codebook,
    Q codevector_dim, P projection_dim.
    """

    def __init__(self, config: Wav2Vec2Config, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        h = config.hidden_size
        with nnx.use_eager_sharding(False):
            self.quantizer = GumbelQuantizer(config, rngs=rngs)
            self.project_hid = dense(config, h, config.projection_dim, ("embed", None), rngs)
            self.project_q = dense(config, config.codevector_dim, config.projection_dim,
                                   (None, None), rngs)
            # Training updates so far, which the Gumbel temperature anneals over (fairseq
            # `num_updates`); the pre-training loss advances it (objectives/wav2vec2.py).
            self.updates = UpdateCount(jnp.zeros((), jnp.int32))

    def __call__(
        self,
        input_values: jax.Array,
        attention_mask: jax.Array | None = None,
        mask_time_indices: jax.Array | None = None,
        rng: jax.Array | None = None,
        *,
        gumbel_temperature: float | jax.Array = 2.0,
        feature_gradient_scale: float = 1.0,
        groups: int = 1,
    ) -> Wav2Vec2Output:
        """`input_values` [B, S] waveforms (right-padded), `attention_mask` [B, S] (1 = real
        sample; None = all real), `mask_time_indices` [B, T] (True = frame masked for the
        contrastive task; None = none). `rng` None = evaluation: no dropout or LayerDrop, argmax
        quantisation. `gumbel_temperature` is the Gumbel-softmax temperature while training;
        `feature_gradient_scale` multiplies the gradient reaching the feature encoder (fairseq
        `feature_grad_mult`). `groups` splits the batch into that many groups of consecutive
        rows, as fairseq's GPUs split theirs: each has its own LayerDrop draws and codebook
        perplexity; B must be a multiple of it."""
        c = self.config
        projection_rng, quantizer_dropout_rng, gumbel_rng, encoder_rng = split_rng(rng, 4)
        features, frames, normed, hidden = self._encoder_inputs(
            input_values, attention_mask, projection_rng, feature_gradient_scale)
        if mask_time_indices is not None:
            mask_time_indices = mask_time_indices.astype(bool)
            hidden = self.mask_frames(hidden, mask_time_indices)
        last_hidden_state = self.encoder(hidden, frames, encoder_rng,
                                         groups=groups)[0]  # [B, T, H]
        quantized, perplexity = self.quantizer(
            dropout(normed, c.quantizer_input_dropout, quantizer_dropout_rng),
            mask_time_indices, gumbel_rng, gumbel_temperature, groups)  # [B, T, Q]
        return Wav2Vec2Output(
            last_hidden_state=last_hidden_state,
            projected_states=self.project_hid(last_hidden_state),  # [B, T, P]
            projected_quantized_states=self.project_q(quantized),  # [B, T, P]
            codevector_perplexity=perplexity, conv_features=features, frames=frames)



@dataclasses.dataclass(frozen=True)
class Wav2Vec2CTCConfig(Wav2Vec2Config):
    """wav2vec 2.0 fine-tuned for speech recognition (paper §4, HF `Wav2Vec2ForCTC`): the
    network's fields plus the character vocabulary's size, the CTC blank and the dropout
    before the output layer. The quantiser's fields are kept (a pre-trained config passes as
    it is) but build nothing."""

    vocab_size: int = 32
    """Output classes: the characters, the word delimiter "|" and the specials (HF
    `vocab_size`)."""
    blank_id: int = 0
    """The CTC blank, which is the vocabulary's <pad> as in fairseq and HF [pad_token_id]."""
    final_dropout: float = 0.0
    """Dropout on the context network's output before the output layer (fairseq
    `final_dropout`, 0.0 in its fine-tuning configs; HF's default is 0.1)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.blank_id < self.vocab_size:
            raise ValueError(f"blank_id {self.blank_id} must be a class of vocab_size "
                             f"{self.vocab_size}")
        check_rates(self, ("final_dropout",))


class Wav2Vec2ForCTC(Wav2Vec2Body):
    """The body, dropout and a linear layer to the vocabulary (HF `Wav2Vec2ForCTC`, fairseq
    `Wav2VecCtc` of wav2vec2_asr.py): waveform [B, S] -> per-frame logits [B, T, V], V =
    `vocab_size`. The CTC loss and decoding are the objectives' (objectives/common/ctc.py)."""

    def __init__(self, config: Wav2Vec2CTCConfig, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        with nnx.use_eager_sharding(False):
            self.lm_head = dense(config, config.hidden_size, config.vocab_size,
                                 ("embed", None), rngs)
            # Fine-tuning updates so far: the context network stays frozen for the first ones
            # (fairseq `freeze_finetune_updates`); the CTC fine-tuning loss advances it.
            self.updates = UpdateCount(jnp.zeros((), jnp.int32))

    def __call__(
        self,
        input_values: jax.Array,
        attention_mask: jax.Array | None = None,
        mask_time_indices: jax.Array | None = None,
        mask_channel_indices: jax.Array | None = None,
        rng: jax.Array | None = None,
        *,
        frozen_context: bool | jax.Array = False,
    ) -> tuple[jax.Array, jax.Array]:
        """`input_values`, `attention_mask` and `mask_time_indices` as `Wav2Vec2`'s;
        `mask_channel_indices` [B, H] (True = that channel of the projected features is zeroed
        in every frame, fairseq's `mask_channel_prob`, HF's `mask_feature_prob`); `rng` None =
        evaluation. `frozen_context` stops the gradient into everything below the output layer
        (fairseq `freeze_finetune_updates`: the first updates train the output layer only).
        The feature encoder is always frozen, as the paper's fine-tuning (fairseq
        `feature_grad_mult` 0.0). -> (logits [B, T, V] float32, frames [B, T] True = real)."""
        c = self.config
        projection_rng, encoder_rng, final_rng = split_rng(rng, 3)
        _, frames, _, hidden = self._encoder_inputs(input_values, attention_mask,
                                                    projection_rng, 0.0)
        if mask_time_indices is not None:
            hidden = self.mask_frames(hidden, mask_time_indices)
        if mask_channel_indices is not None:
            hidden = jnp.where(mask_channel_indices.astype(bool)[:, None, :], 0, hidden)
        states = self.encoder(hidden, frames, encoder_rng)[0]  # [B, T, H]
        states = jnp.where(frozen_context, jax.lax.stop_gradient(states), states)
        states = dropout(states, c.final_dropout, final_rng)
        return self.lm_head(states).astype(jnp.float32), frames  # [B, T, V]


def with_body_of(pretrained: Wav2Vec2Body, model: Wav2Vec2Body) -> Wav2Vec2Body:
    """`model` with `pretrained`'s body parameters (feature encoder, projection, mask vector,
    context network; same paths in every head) and its own head: a pre-trained or another
    fine-tuned network as the start of fine-tuning (paper §4: the output layer is new). The
    two bodies must have the same shapes."""
    def flat(module: nnx.Module) -> dict[str, nnx.Variable]:
        return {".".join(map(str, path)): variable for path, variable
                in nnx.to_flat_state(nnx.state(module, nnx.Param))}

    ours, theirs = flat(model), flat(pretrained)
    body = flat(nnx.eval_shape(lambda: Wav2Vec2Body(model.config, rngs=nnx.Rngs(0))))
    for path in body:
        if theirs[path].get_value().shape != ours[path].get_value().shape:
            raise ValueError(f"the pre-trained {path} has shape {theirs[path].get_value().shape}"
                             f", the model's config asks for {ours[path].get_value().shape}")
        ours[path].set_value(theirs[path].get_value())
    return model
