"""Contrastive Predictive Coding for raw audio (van den Oord, Li and Vinyals 2018, §2 and §3.1)
in Flax NNX: the strided convolutional encoder g_enc (waveform -> one latent z_t per 160
samples, 10 ms at 16 kHz), the autoregressive GRU g_ar (z_<=t -> context c_t) and one linear
map W_k per prediction step k = 1..K, with which the InfoNCE loss (`objectives/cpc.py`) scores
z_{t+k}^T W_k c_t (eq. 3).

§3.1: "five convolutional layers with strides [5, 4, 2, 2, 2], filter-sizes [10, 8, 4, 4, 4]
and 512 hidden units with ReLU activations", "a GRU RNN with 256 dimensional hidden state",
K = 12 steps. The paper gives neither padding nor normalisation: `conv_paddings` (3, 2, 1, 1, 1)
make a window of 160 n samples exactly n frames (as the widely used reimplementation,
facebookresearch/CPC_audio, pads); `conv_norm` "none" is the paper's plain conv + ReLU,
"layer" adds a LayerNorm over the channels of every frame after each convolution (CPC_audio's
`ChannelNorm`: statistics per frame, none over time, so a batch's padding cannot shift them).
Real frames of a right-padded row (`frame_mask`) are those equal to the utterance's own.

Shape legend: B batch, S samples, T frames (S / 160), C conv channels (z), H context units
(c), K prediction steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.layers import check_dtype

CONV_NORMS = ("none", "layer")
CONV_NORM_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class CPCConfig:
    """The CPC audio network (defaults: the paper's §3.1 model). Negatives and other loss
    settings are the objective's (`objectives.cpc.CPCLossSettings`)."""

    conv_channels: int = 512
    """Channels of every encoder convolution, the width of z_t (paper 512)."""
    conv_kernel_sizes: tuple[int, ...] = (10, 8, 4, 4, 4)
    """Kernel width of each encoder convolution (paper 10, 8, 4, 4, 4)."""
    conv_strides: tuple[int, ...] = (5, 4, 2, 2, 2)
    """Stride of each encoder convolution (paper 5, 4, 2, 2, 2: 160 samples a frame)."""
    conv_paddings: tuple[int, ...] = (3, 2, 1, 1, 1)
    """Zeros on each side of each convolution's input (not in the paper; these make 160 n
    samples exactly n frames, as CPC_audio); all 0 = valid convolutions."""
    conv_norm: str = "none"
    """none: conv + ReLU (the paper); layer: a LayerNorm over each frame's channels between
    every convolution and its ReLU (CPC_audio's ChannelNorm)."""
    context_size: int = 256
    """Hidden units of the GRU g_ar, the width of c_t (paper 256)."""
    prediction_steps: int = 12
    """K, the future frames predicted from every c_t, one W_k each (paper 12)."""
    dtype: str = "float32"
    """Compute dtype: float32, bfloat16 or float16 (parameters stay float32)."""

    def __post_init__(self) -> None:
        for name in ("conv_kernel_sizes", "conv_strides", "conv_paddings"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        if not (len(self.conv_kernel_sizes) == len(self.conv_strides) == len(self.conv_paddings)
                and self.conv_strides):
            raise ValueError("conv_kernel_sizes, conv_strides and conv_paddings must have one "
                             "entry per encoder convolution (CPC: 5 each)")
        if min(*self.conv_kernel_sizes, *self.conv_strides) < 1 or min(self.conv_paddings) < 0:
            raise ValueError("conv_kernel_sizes and conv_strides must be >= 1, conv_paddings "
                             ">= 0")
        if self.conv_norm not in CONV_NORMS:
            raise ValueError(f"conv_norm={self.conv_norm!r} must be one of {CONV_NORMS}")
        for name in ("conv_channels", "context_size", "prediction_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        check_dtype(self)

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def samples_per_frame(self) -> int:
        """The product of the strides (paper: 160 samples, 10 ms at 16 kHz)."""
        return math.prod(self.conv_strides)


def frame_lengths(config: CPCConfig, sample_lengths: jax.Array | int, *,
                  padded_after: bool = False) -> jax.Array | int:
    """Frames the encoder makes of an utterance of `sample_lengths` samples:
    floor((n + 2 p - k) / s) + 1 per convolution. `padded_after`: instead, how many of them
    come out the same when the utterance is followed by the batch's zero padding, where the
    convolutions after the first read the previous one's outputs on that padding (bias, norm
    and ReLU of zeros, not zeros) instead of their own zero padding: floor((n + p - k) / s) + 1
    there (the first convolution reads zeros either way). numpy, jax or int alike."""
    for index, (kernel, stride, padding) in enumerate(zip(
            config.conv_kernel_sizes, config.conv_strides, config.conv_paddings, strict=True)):
        right = padding if index == 0 or not padded_after else 0
        sample_lengths = (sample_lengths + padding + right - kernel) // stride + 1
    return sample_lengths


def frame_mask(config: CPCConfig, attention_mask: jax.Array, num_frames: int) -> jax.Array:
    """[B, S] sample mask (1 = real, right-padded with zeros) -> [B, T] bool: the frames of each
    row that equal those of its utterance alone (all T for a row without padding)."""
    real = attention_mask.astype(jnp.int32).sum(-1)  # [B]
    lengths = jnp.where(real >= attention_mask.shape[1], num_frames,
                        frame_lengths(config, real, padded_after=True))
    return jnp.arange(num_frames)[None, :] < lengths[:, None]


def _replicated(init: nnx.Initializer, rank: int) -> nnx.Initializer:
    return nnx.with_partitioning(init, (None,) * rank)


def symmetric_uniform(bound: float) -> nnx.Initializer:
    """U(-bound, bound): torch.nn.GRU's init with bound 1/sqrt(hidden units)."""

    def init(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype = jnp.float32
             ) -> jax.Array:
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


class ConvLayer(nnx.Module):
    """One encoder block: Conv1d (zero padding `conv_paddings[index]` each side), the optional
    per-frame LayerNorm, ReLU."""

    def __init__(self, config: CPCConfig, index: int, *, rngs: nnx.Rngs):
        channels = config.conv_channels
        padding = config.conv_paddings[index]
        self.conv = nnx.Conv(
            channels if index else 1, channels, kernel_size=(config.conv_kernel_sizes[index],),
            strides=(config.conv_strides[index],), padding=[(padding, padding)],
            dtype=config.compute_dtype,
            kernel_init=_replicated(nnx.initializers.he_normal(), 3),
            bias_init=_replicated(nnx.initializers.zeros_init(), 1), rngs=rngs)
        self.norm = (nnx.LayerNorm(channels, epsilon=CONV_NORM_EPS, use_fast_variance=False,
                                   dtype=config.compute_dtype,
                                   scale_init=_replicated(nnx.initializers.ones_init(), 1),
                                   bias_init=_replicated(nnx.initializers.zeros_init(), 1),
                                   rngs=rngs)
                     if config.conv_norm == "layer" else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        """[B, S_in, C_in] -> [B, S_out, C]."""
        x = self.conv(x)
        if self.norm is not None:
            x = self.norm(x)
        return jax.nn.relu(x)


class GRU(nnx.Module):
    """A one-layer GRU over time, gates as torch.nn.GRU (Cho et al. 2014; r reset, u update,
    n new; sigma the logistic function, * elementwise):

        r_t = sigma(x_t W_xr + b_xr + h_{t-1} W_hr + b_hr)
        u_t = sigma(x_t W_xu + b_xu + h_{t-1} W_hu + b_hu)
        n_t = tanh(x_t W_xn + b_xn + r_t * (h_{t-1} W_hn + b_hn))
        h_t = (1 - u_t) * n_t + u_t * h_{t-1},      h_0 = 0.

    `input` (x W_x + b_x, kernel [I, 3H]) and `hidden` (h W_h + b_h, kernel [H, 3H]) hold the
    r, u, n columns in that order (torch's `weight_ih_l0.T` / `weight_hh_l0.T`, biases
    likewise); init U(-1/sqrt(H), 1/sqrt(H)) as torch. The input projections of every step
    are one matmul before the `jax.lax.scan` over time; the carry stays float32."""

    def __init__(self, input_size: int, hidden_size: int, dtype: jnp.dtype, *,
                 rngs: nnx.Rngs):
        init = symmetric_uniform(1.0 / math.sqrt(hidden_size))
        self.hidden_size, self.dtype = hidden_size, dtype
        self.input, self.hidden = (
            nnx.Linear(size, 3 * hidden_size, dtype=dtype, kernel_init=_replicated(init, 2),
                       bias_init=_replicated(init, 1), rngs=rngs)
            for size in (input_size, hidden_size))

    def __call__(self, x: jax.Array) -> jax.Array:
        """[B, T, I] -> the hidden states h_1..h_T [B, T, H]."""
        inputs = self.input(x).astype(jnp.float32)  # [B, T, 3H]

        def step(h: jax.Array, projected: jax.Array) -> tuple[jax.Array, jax.Array]:
            x_r, x_u, x_n = jnp.split(projected, 3, axis=-1)
            h_r, h_u, h_n = jnp.split(self.hidden(h).astype(jnp.float32), 3, axis=-1)
            reset = jax.nn.sigmoid(x_r + h_r)
            update = jax.nn.sigmoid(x_u + h_u)
            new = jnp.tanh(x_n + reset * h_n)
            h = (1.0 - update) * new + update * h
            return h, h

        initial = jnp.zeros((x.shape[0], self.hidden_size), jnp.float32)
        _, hidden = jax.lax.scan(step, initial, jnp.swapaxes(inputs, 0, 1))  # [T, B, H]
        return jnp.swapaxes(hidden, 0, 1).astype(self.dtype)


class CPCOutput(NamedTuple):
    """`features` z [B, T, C] (g_enc), `context` c [B, T, H] (g_ar), `frames` [B, T] bool
    (real frames of a right-padded batch)."""

    features: jax.Array
    context: jax.Array
    frames: jax.Array


class CPC(nnx.Module):
    """g_enc, g_ar and the prediction maps W_k (`prediction_kernel` [K, H, C], no bias, as
    eq. 3's z^T W_k c); `predictions(context)` gives W_k c_t for every k."""

    def __init__(self, config: CPCConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.conv_layers = nnx.List([ConvLayer(config, i, rngs=rngs)
                                     for i in range(len(config.conv_strides))])
        self.gru = GRU(config.conv_channels, config.context_size, config.compute_dtype,
                       rngs=rngs)
        kernel_init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))
        self.prediction_kernel = nnx.Param(
            kernel_init(rngs.params(), (config.prediction_steps, config.context_size,
                                        config.conv_channels)),
            out_sharding=(None, None, None))

    def encode(self, audio: jax.Array) -> jax.Array:
        """g_enc: [B, S] waveforms -> z [B, T, C]."""
        x = audio.astype(self.config.compute_dtype)[..., None]  # [B, S, 1]
        for conv_layer in self.conv_layers:
            x = conv_layer(x)
        return x

    def predictions(self, context: jax.Array) -> jax.Array:
        """W_k c_t for k = 1..K: [B, T, H] -> [B, T, K, C]."""
        dtype = self.config.compute_dtype
        return jnp.einsum("bth,khc->btkc", context.astype(dtype),
                          self.prediction_kernel[...].astype(dtype))

    def __call__(self, audio: jax.Array, attention_mask: jax.Array | None = None
                 ) -> CPCOutput:
        """[B, S] waveforms (optionally their [B, S] sample mask, 1 = real, right-padded) ->
        z, c and the real frames (`frame_mask`). The GRU is causal, so padding after a row's
        real frames never changes their context vectors either."""
        features = self.encode(audio)
        context = self.gru(features)
        num_frames = features.shape[1]
        frames = (jnp.ones(features.shape[:2], bool) if attention_mask is None
                  else frame_mask(self.config, attention_mask, num_frames))
        return CPCOutput(features=features, context=context, frames=frames)


@dataclasses.dataclass(frozen=True)
class CPCCTCConfig(CPCConfig):
    """CPC's g_enc and g_ar under a linear layer over `vocab_size` output classes (characters
    and the CTC blank `blank_id`); `final_dropout` before that layer."""

    vocab_size: int = 32
    """Output classes (the character vocabulary with its specials)."""
    blank_id: int = 0
    """The CTC blank's class (HF's `pad_token_id`)."""
    final_dropout: float = 0.0
    """Dropout on c_t before the output layer."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.vocab_size < 1 or not 0 <= self.blank_id < self.vocab_size:
            raise ValueError(f"vocab_size={self.vocab_size} must be >= 1 and blank_id="
                             f"{self.blank_id} one of its classes")
        if not 0.0 <= self.final_dropout < 1.0:
            raise ValueError(f"final_dropout={self.final_dropout} must be in [0, 1)")


TRAINABLE = ("all", "context", "head")


class CPCForCTC(nnx.Module):
    """A CPC network (`cpc`: g_enc, g_ar; its prediction maps unused) with a linear layer on
    every context vector c_t (`lm_head`, as CPC §3.1's linear phone classifier on c_t), for CTC
    over characters."""

    def __init__(self, config: CPCCTCConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.cpc = CPC(config, rngs=rngs)
        self.lm_head = nnx.Linear(
            config.context_size, config.vocab_size, dtype=config.compute_dtype,
            kernel_init=_replicated(nnx.initializers.lecun_normal(), 2),
            bias_init=_replicated(nnx.initializers.zeros_init(), 1), rngs=rngs)

    def __call__(self, audio: jax.Array, attention_mask: jax.Array, rng: jax.Array | None = None,
                 trainable: str = "all") -> tuple[jax.Array, jax.Array]:
        """[B, S] waveforms and their sample mask -> (logits [B, T, V] float32, real frames
        [B, T]). `trainable`: which part gradients reach (all; context: the GRU and the output
        layer, g_enc frozen; head: the output layer alone, the linear classifier of frozen
        features); `rng`: final dropout (None = none)."""
        if trainable not in TRAINABLE:
            raise ValueError(f"trainable={trainable!r} must be one of {TRAINABLE}")
        features = self.cpc.encode(audio)
        if trainable != "all":
            features = jax.lax.stop_gradient(features)
        context = self.cpc.gru(features)
        if trainable == "head":
            context = jax.lax.stop_gradient(context)
        if rng is not None and self.config.final_dropout:
            keep = jax.random.bernoulli(rng, 1.0 - self.config.final_dropout, context.shape)
            context = jnp.where(keep, context / (1.0 - self.config.final_dropout), 0.0)
        frames = frame_mask(self.config, attention_mask, features.shape[1])
        return self.lm_head(context).astype(jnp.float32), frames
