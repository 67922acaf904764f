"""wav2vec (Schneider, Baevski, Collobert and Auli 2019, §2) in Flax NNX: the convolutional
encoder f (waveform -> one latent z_i per 160 samples at 16 kHz), the causal convolutional
context network g (z_<=i -> c_i) and the per-step projections h_k(c_i) = W_k c_i + b that the
binary contrastive loss (`objectives/wav2vec.py`) scores against z_{i+k}.

Re-stated from fairseq `fairseq/models/wav2vec/wav2vec.py`:
- `ConvFeatureExtractionModel`: per layer (channels, kernel, stride) a Conv1d without bias and
  without padding, a group norm with one group (`Fp32GroupNorm(1, C)`: statistics over the
  channels and the time of each utterance, float32, eps 1e-5, affine per channel), the
  activation; with `skip_connections_feat`, a layer whose input has its channel count adds
  the input, subsampled to its length (`residual[..., ::r // t][..., :t]`), and scales the sum
  by sqrt(`residual_scale`); then `log_compression`: log(|z| + 1).
- `ConvAggegator`: per layer, left padding of kernel - 1 frames (replicating the first frame,
  or zeros with `agg_zero_pad`), a Conv1d with bias (`no_conv_bias` drops it), the group norm,
  the activation; with `skip_connections_agg` the input (through a 1x1 convolution without
  bias where the widths differ) is added and the sum scaled by sqrt(`residual_scale`).
- `Wav2VecPredictionsModel.project_to_steps`: a ConvTranspose2d(C_agg, C_z, (1, K)) on
  c [B, C, T, 1], i.e. one [C_agg, C_z] matrix per step and one bias shared by the K steps.
- `offset` "auto": the encoder's receptive field over its stride, rounded up (3 for the
  paper's encoder); step k = 1..K predicts z_{i + offset + k - 1} from c_i.

Padding (fairseq has none: it crops every batch to its shortest utterance): a right-padded
row's real frames (`frame_mask`) are those the unpadded convolutions compute from real samples
only, and the group norms take their statistics over real frames only, so the real frames of a
padded row equal the utterance's own. Not ported: the GRU aggregator, `project_features`, the
vq-wav2vec quantisers and the dropouts (all off in the paper's recipe).

Shape legend: B batch, S samples, T frames, C encoder channels (z), A context channels (c),
K prediction steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.layers import check_dtype

GROUP_NORM_EPS = 1e-5  # torch.nn.GroupNorm's
ACTIVATIONS = ("relu", "gelu")
AGGREGATOR_PADDINGS = ("replicate", "zeros")


@dataclasses.dataclass(frozen=True)
class Wav2VecConfig:
    """The wav2vec network; defaults: wav2vec large as fairseq's examples/wav2vec/README.md
    trains it (7 encoder layers, the last two 1x1, a 12-layer context network of kernels
    2..13, skip connections, residual scale 0.5, log compression, K = 12)."""

    conv_channels: tuple[int, ...] = (512,) * 7
    """Output channels of each encoder convolution (fairseq `conv_feature_layers` dim)."""
    conv_kernel_sizes: tuple[int, ...] = (10, 8, 4, 4, 4, 1, 1)
    """Kernel width of each encoder convolution (paper §2: 10, 8, 4, 4, 4; large adds two 1x1)."""
    conv_strides: tuple[int, ...] = (5, 4, 2, 2, 2, 1, 1)
    """Stride of each encoder convolution (5, 4, 2, 2, 2: 160 samples a frame)."""
    aggregator_channels: tuple[int, ...] = (512,) * 12
    """Output channels of each context-network layer (fairseq `conv_aggregator_layers` dim)."""
    aggregator_kernel_sizes: tuple[int, ...] = tuple(range(2, 14))
    """Kernel width of each context-network layer (large: 2..13; the paper's base: nine of 3)."""
    skip_connections_feat: bool = False
    """Residual connections in the encoder where a layer keeps its channel count (fairseq off)."""
    skip_connections_agg: bool = True
    """Residual connections in the context network (fairseq `skip_connections_agg`, on)."""
    residual_scale: float = 0.5
    """The sum of a residual connection is scaled by sqrt(this) (fairseq 0.5)."""
    log_compression: bool = True
    """log(|z| + 1) after the encoder (fairseq `log_compression`, on)."""
    aggregator_bias: bool = True
    """Biases in the context network's convolutions (fairseq `no_conv_bias` off)."""
    aggregator_padding: str = "replicate"
    """The causal left padding of the context network: replicate the first frame (fairseq's
    ReplicationPad1d) or zeros (`agg_zero_pad`)."""
    group_norm_affine: bool = True
    """A scale and bias per channel after each group norm (fairseq `non_affine_group_norm` off)."""
    activation: str = "relu"
    """relu (fairseq's default) or gelu."""
    prediction_steps: int = 12
    """K, the projections h_k, one per step ahead (paper 12)."""
    offset: int = -1
    """Frames between a context c_i and the target of step 1; -1 = fairseq's "auto" (the
    encoder's receptive field over its stride, rounded up: 3 for the paper's encoder)."""
    dtype: str = "float32"
    """Compute dtype: float32, bfloat16 or float16 (parameters and norms stay float32)."""

    def __post_init__(self) -> None:
        for name in ("conv_channels", "conv_kernel_sizes", "conv_strides",
                     "aggregator_channels", "aggregator_kernel_sizes"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        if not (len(self.conv_channels) == len(self.conv_kernel_sizes)
                == len(self.conv_strides) >= 1):
            raise ValueError("conv_channels, conv_kernel_sizes and conv_strides must have one "
                             "entry per encoder convolution (wav2vec large: 7 each)")
        if len(self.aggregator_channels) != len(self.aggregator_kernel_sizes):
            raise ValueError("aggregator_channels and aggregator_kernel_sizes must have one "
                             "entry per context-network layer (wav2vec large: 12 each)")
        if min(*self.conv_channels, *self.conv_kernel_sizes, *self.conv_strides,
               *self.aggregator_channels, *self.aggregator_kernel_sizes, 1) < 1:
            raise ValueError("every channel count, kernel size and stride must be >= 1")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r} must be one of {ACTIVATIONS}")
        if self.aggregator_padding not in AGGREGATOR_PADDINGS:
            raise ValueError(f"aggregator_padding={self.aggregator_padding!r} must be one of "
                             f"{AGGREGATOR_PADDINGS}")
        if self.residual_scale <= 0.0:
            raise ValueError(f"residual_scale={self.residual_scale} must be > 0 (fairseq 0.5)")
        if self.prediction_steps < 1:
            raise ValueError(f"prediction_steps={self.prediction_steps} must be >= 1")
        if self.offset < -1:
            raise ValueError(f"offset={self.offset} must be >= 0, or -1 for fairseq's auto")
        check_dtype(self)

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def samples_per_frame(self) -> int:
        """The product of the encoder's strides (160 for the paper's)."""
        return math.prod(self.conv_strides)

    @property
    def context_size(self) -> int:
        """The width of c: the last context layer's channels (the encoder's without one)."""
        return (self.aggregator_channels or self.conv_channels)[-1]

    @property
    def step_offset(self) -> int:
        """The offset in frames, fairseq's "auto" worked out: the receptive field r and the
        jump j accumulate over the encoder (r += (k - 1) j, j *= s), offset = ceil(r / j)."""
        if self.offset >= 0:
            return self.offset
        field, jump = 1, 1
        for kernel, stride in zip(self.conv_kernel_sizes, self.conv_strides, strict=True):
            field += (kernel - 1) * jump
            jump *= stride
        return math.ceil(field / jump)


def frame_lengths(config: Wav2VecConfig, sample_lengths: jax.Array | int) -> jax.Array | int:
    """Frames the encoder's unpadded convolutions make of `sample_lengths` samples:
    floor((n - k) / s) + 1 per layer (numpy, jax or int; <= 0 = none)."""
    for kernel, stride in zip(config.conv_kernel_sizes, config.conv_strides, strict=True):
        sample_lengths = (sample_lengths - kernel) // stride + 1
    return sample_lengths


def group_norm(x: jax.Array, frames: jax.Array | None, scale: nnx.Param | None,
               bias: nnx.Param | None) -> jax.Array:
    """GroupNorm with one group over [B, T, C] in float32: each utterance's mean and (biased)
    variance over all its channels and real frames (`frames` [B, T] bool; None = all), then
    the per-channel scale and bias."""
    x32 = x.astype(jnp.float32)
    weights = (jnp.ones(x.shape[:2], jnp.float32) if frames is None
               else frames.astype(jnp.float32))[..., None]  # [B, T, 1]
    count = jnp.maximum(jnp.sum(weights, axis=(1, 2)), 1.0) * x.shape[-1]  # [B]
    mean = jnp.sum(x32 * weights, axis=(1, 2)) / count
    centred = x32 - mean[:, None, None]
    variance = jnp.sum(jnp.square(centred) * weights, axis=(1, 2)) / count
    y = centred * jax.lax.rsqrt(variance + GROUP_NORM_EPS)[:, None, None]
    if scale is not None:
        y = y * scale[...] + bias[...]
    return y.astype(x.dtype)


def _replicated(init: nnx.Initializer, rank: int) -> nnx.Initializer:
    return nnx.with_partitioning(init, (None,) * rank)


class ConvBlock(nnx.Module):
    """Conv1d (no padding here: the context network pads before), the one-group norm over real
    frames, the activation."""

    def __init__(self, config: Wav2VecConfig, in_channels: int, out_channels: int, kernel: int,
                 stride: int, use_bias: bool, *, rngs: nnx.Rngs):
        self.activation = config.activation
        self.conv = nnx.Conv(in_channels, out_channels, kernel_size=(kernel,), strides=(stride,),
                             padding="VALID", use_bias=use_bias, dtype=config.compute_dtype,
                             kernel_init=_replicated(nnx.initializers.he_normal(), 3),
                             bias_init=_replicated(nnx.initializers.zeros_init(), 1), rngs=rngs)
        if config.group_norm_affine:
            self.norm_scale = nnx.Param(jnp.ones((out_channels,)), out_sharding=(None,))
            self.norm_bias = nnx.Param(jnp.zeros((out_channels,)), out_sharding=(None,))
        else:
            self.norm_scale = self.norm_bias = None

    def __call__(self, x: jax.Array, frames: jax.Array | None) -> jax.Array:
        """[B, S_in, C_in] -> [B, S_out, C_out]; `frames` [B, S_out] the real outputs."""
        x = group_norm(self.conv(x), frames, self.norm_scale, self.norm_bias)
        return jax.nn.relu(x) if self.activation == "relu" else jax.nn.gelu(x, approximate=False)


class Wav2VecOutput(NamedTuple):
    """`features` z [B, T, C] (encoder), `context` c [B, T, A] (context network), `frames`
    [B, T] bool (real frames of a right-padded batch)."""

    features: jax.Array
    context: jax.Array
    frames: jax.Array


class Wav2Vec(nnx.Module):
    """The encoder, the context network, and the step projections (`projection_kernel`
    [K, A, C], `projection_bias` [C]); `predictions(context)` gives h_k(c_i) for every k."""

    def __init__(self, config: Wav2VecConfig, *, rngs: nnx.Rngs):
        self.config = config
        inputs = (1, *config.conv_channels[:-1])
        self.conv_layers = nnx.List([
            ConvBlock(config, n_in, n_out, kernel, stride, False, rngs=rngs)
            for n_in, n_out, kernel, stride in zip(inputs, config.conv_channels,
                                                   config.conv_kernel_sizes,
                                                   config.conv_strides, strict=True)])
        inputs = (config.conv_channels[-1], *config.aggregator_channels[:-1])
        self.aggregator_layers = nnx.List([
            ConvBlock(config, n_in, n_out, kernel, 1, config.aggregator_bias, rngs=rngs)
            for n_in, n_out, kernel in zip(inputs, config.aggregator_channels,
                                           config.aggregator_kernel_sizes, strict=True)])
        self.residual_projections = nnx.List([
            nnx.Linear(n_in, n_out, use_bias=False, dtype=config.compute_dtype,
                       kernel_init=_replicated(nnx.initializers.lecun_normal(), 2), rngs=rngs)
            if n_in != n_out and config.skip_connections_agg else None
            for n_in, n_out in zip(inputs, config.aggregator_channels, strict=True)])
        kernel_init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))
        self.projection_kernel = nnx.Param(
            kernel_init(rngs.params(), (config.prediction_steps, config.context_size,
                                        config.conv_channels[-1])),
            out_sharding=(None, None, None))
        self.projection_bias = nnx.Param(jnp.zeros((config.conv_channels[-1],)),
                                         out_sharding=(None,))

    def encode(self, audio: jax.Array, sample_lengths: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array | None]:
        """The encoder: [B, S] waveforms (and each row's real sample count, None = all) ->
        z [B, T, C] and its real frames [B, T] (None without lengths)."""
        config = self.config
        x = audio.astype(config.compute_dtype)[..., None]  # [B, S, 1]
        lengths, frames = sample_lengths, None
        scale = math.sqrt(config.residual_scale)
        for layer, kernel, stride in zip(self.conv_layers, config.conv_kernel_sizes,
                                         config.conv_strides, strict=True):
            residual = x
            num_out = (x.shape[1] - kernel) // stride + 1
            if lengths is not None:
                lengths = (lengths - kernel) // stride + 1
                frames = jnp.arange(num_out)[None, :] < lengths[:, None]
            x = layer(x, frames)
            if config.skip_connections_feat and x.shape[-1] == residual.shape[-1]:
                step = residual.shape[1] // x.shape[1]
                x = (x + residual[:, ::step][:, :x.shape[1]]) * scale
        if config.log_compression:
            x = jnp.log1p(jnp.abs(x))
        return x, frames

    def aggregate(self, features: jax.Array, frames: jax.Array | None) -> jax.Array:
        """The context network: z [B, T, C] -> c [B, T, A], causal (c_i reads z_<=i)."""
        config = self.config
        x = features
        scale = math.sqrt(config.residual_scale)
        for layer, projection, kernel in zip(self.aggregator_layers, self.residual_projections,
                                             config.aggregator_kernel_sizes, strict=True):
            residual = x
            mode = "edge" if config.aggregator_padding == "replicate" else "constant"
            x = layer(jnp.pad(x, ((0, 0), (kernel - 1, 0), (0, 0)), mode=mode), frames)
            if config.skip_connections_agg:
                x = (x + (residual if projection is None else projection(residual))) * scale
        return x

    def predictions(self, context: jax.Array) -> jax.Array:
        """h_k(c_i) = W_k c_i + b for k = 1..K: [B, T, A] -> [B, T, K, C]."""
        dtype = self.config.compute_dtype
        projected = jnp.einsum("bta,kac->btkc", context.astype(dtype),
                               self.projection_kernel[...].astype(dtype))
        return projected + self.projection_bias[...].astype(dtype)

    def __call__(self, audio: jax.Array, attention_mask: jax.Array | None = None
                 ) -> Wav2VecOutput:
        """[B, S] waveforms (optionally their [B, S] sample mask, 1 = real, right-padded) ->
        z, c and the real frames."""
        lengths = (None if attention_mask is None
                   else attention_mask.astype(jnp.int32).sum(-1))
        features, frames = self.encode(audio, lengths)
        context = self.aggregate(features, frames)
        if frames is None:
            frames = jnp.ones(features.shape[:2], bool)
        return Wav2VecOutput(features=features, context=context, frames=frames)
