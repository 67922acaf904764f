"""The networks of the mutual-information methods: Deep InfoMax (Hjelm et al. 2019) and AMDIM
(Bachman, Hjelm & Buchwalter 2019). Images are NHWC; 1x1 convolutions are dense layers on the
channel axis.

- `MIProjection`: the residual 1x1 embedding both references put on a feature map (or a vector)
  before the dot-product scores: rdevon/DIM cortex_DIM/nn_modules/mi_networks.py
  `MI1x1ConvNet` (1x1 conv -> BatchNorm -> ReLU -> 1x1 conv with bias, plus a near-identity
  linear shortcut, then LayerNorm) and amdim-public model.py `FakeRKHSConvNet` (the same with
  the hidden BatchNorm optional, the second conv without bias and zero-initialised, a shortcut
  with bias, BatchNorm on the output).
- `DIM`: the encoder is our ResNet (its paper's CIFAR encoder is a DCGAN-style 3-layer convnet,
  cortex_DIM/configs/convnets.py `_basic32x32`, or a ResNet, configs/resnets.py); the local
  map M is the output of stage `local_stage` (CIFAR stem, 32 px, stage 3: 8x8, the size of the
  paper's 32x32 local map), the global vector Y = fc (BatchNorm, ReLU) -> linear to
  `global_dim` on the pooled last stage (the paper's fc 1024 -> Y 64). Local DIM embeds M and
  Y with `MIProjection`s to `mi_units` (models/dim.py `LocalDIM`); global DIM embeds M with a
  fresh copy of the encoder's remaining stages + pool + linear and Y with a linear layer, both
  to `mi_units` (models/dim.py `GlobalDIM` copies the encoder's remaining layers).
- `AMDIM`: amdim-public model.py `Encoder` for 32-pixel images, layer for layer (`ndf`,
  `n_rkhs`, `n_depth`, `use_bn`), giving the 7x7, 5x5 and 1x1 maps, and the `FakeRKHSConvNet`
  embeddings of the 7x7 and 5x5 maps; the 1x1 map (after its BatchNorm) is the global feature,
  what evaluation uses.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.layers import COMPUTE_DTYPES, check_dtype
from pretext_jax.models.momentum import MLP
from pretext_jax.models.resnet import ResNet, ResNetConfig, build_stages

# torch's default init of Conv2d/Linear weights (kaiming_uniform_ with a = sqrt(5)).
TORCH_DEFAULT_INIT = nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def near_identity_init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32
                       ) -> jax.Array:
    """A [in, out] kernel uniform in (-0.01, 0.01) with ones on the diagonal when out >= in
    (both references' shortcut init, "like identity if possible"); else torch's default."""
    fan_in, fan_out = shape
    if fan_out < fan_in:
        return TORCH_DEFAULT_INIT(key, shape, dtype)
    kernel = jax.random.uniform(key, shape, dtype, -0.01, 0.01)
    return kernel.at[jnp.arange(fan_in), jnp.arange(fan_in)].set(1.0)


def batch_norm(config: Any, features: int, rngs: nnx.Rngs) -> nnx.BatchNorm:
    return nnx.BatchNorm(features, momentum=config.batch_norm_momentum,
                         epsilon=config.batch_norm_epsilon, dtype=jnp.dtype(config.dtype),
                         rngs=rngs)


class MIProjection(nnx.Module):
    """shortcut(x) + W2 relu(norm(W1 x)), then the output norm (module docstring); `amdim`
    picks `FakeRKHSConvNet`'s variant, else DIM's `MI1x1ConvNet`. `hidden_batch_norm` is
    AMDIM's `use_bn` (DIM always normalises the hidden layer)."""

    def __init__(self, config: Any, in_features: int, out_features: int, *, amdim: bool,
                 hidden_batch_norm: bool = True, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.amdim = amdim
        self.hidden = nnx.Linear(in_features, out_features, use_bias=False, dtype=dtype,
                                 kernel_init=TORCH_DEFAULT_INIT, rngs=rngs)
        self.hidden_norm = (batch_norm(config, out_features, rngs)
                            if hidden_batch_norm or not amdim else None)
        self.output = nnx.Linear(
            out_features, out_features, use_bias=not amdim, dtype=dtype,
            kernel_init=nnx.initializers.zeros if amdim else TORCH_DEFAULT_INIT, rngs=rngs)
        self.shortcut = nnx.Linear(in_features, out_features, use_bias=amdim, dtype=dtype,
                                   kernel_init=near_identity_init, rngs=rngs)
        self.output_norm = (batch_norm(config, out_features, rngs) if amdim
                            else nnx.LayerNorm(out_features, epsilon=1e-5, dtype=dtype,
                                               rngs=rngs))

    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        h = self.hidden(x)
        if self.hidden_norm is not None:
            h = self.hidden_norm(h, use_running_average=not train)
        h = self.output(jax.nn.relu(h)) + self.shortcut(x)
        if self.amdim:
            return self.output_norm(h, use_running_average=not train)
        return self.output_norm(h)


# ------------------------------------------------------------------------------ Deep InfoMax

@dataclasses.dataclass(frozen=True)
class DIMConfig(ResNetConfig):
    local_stage: int = 3
    """ResNet stage (1-4) whose output is the local map M (CIFAR stem, 32 px: 3 gives 8x8)."""
    hidden_dim: int = 1024
    """Width of the fc layer before Y, and of global DIM's (DIM _basic32x32: 1024)."""
    global_dim: int = 64
    """Width of the global feature Y (DIM: 64)."""
    mi_units: int = 2048
    """Width of the embeddings the scores are dot products of (DIM `mi_units` 2048)."""
    global_mi: bool = True
    """Build global DIM's networks (needed by objective.global_weight > 0; DIM(L): false)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.local_stage <= 4:
            raise ValueError(f"local_stage={self.local_stage} must be in 1..4")
        if min(self.hidden_dim, self.global_dim, self.mi_units) < 1:
            raise ValueError("hidden_dim, global_dim and mi_units must be >= 1")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DIMOutput:
    """`local` [B, h, w, mi_units] and `global_` [B, mi_units]: local DIM's embeddings of M
    and Y; `global_map`, `global_vector` [B, mi_units]: global DIM's (None unless asked)."""

    local: jax.Array
    global_: jax.Array
    global_map: jax.Array | None = None
    global_vector: jax.Array | None = None


class DIM(nnx.Module):
    def __init__(self, config: DIMConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.backbone = ResNet(config.backbone_config(), rngs=rngs)
        widths = self.backbone.config.stage_widths
        self.global_head = MLP(config, widths[-1], config.hidden_dim, config.global_dim,
                               batch_norm=True, output_bias=True, rngs=rngs)
        self.local_mi = MIProjection(config, widths[config.local_stage - 1], config.mi_units,
                                     amdim=False, rngs=rngs)
        self.global_mi = MIProjection(config, config.global_dim, config.mi_units, amdim=False,
                                      rngs=rngs)
        # Global DIM: a copy of the stages after M, pooled, to mi_units; Y to mi_units.
        built = config.global_mi
        self.map_stages = (build_stages(config.backbone_config(), config.local_stage, rngs=rngs)
                           if built else None)
        self.map_output = (nnx.Linear(widths[-1], config.mi_units,
                                      dtype=jnp.dtype(config.dtype), rngs=rngs)
                           if built else None)
        self.vector_output = (nnx.Linear(config.global_dim, config.mi_units,
                                         dtype=jnp.dtype(config.dtype), rngs=rngs)
                              if built else None)

    def __call__(self, images: jax.Array, *, train: bool, global_dim: bool = False
                 ) -> DIMOutput:
        """[B, S, S, 3] images -> `DIMOutput` (global DIM's embeddings if `global_dim`, which
        needs `config.global_mi`)."""
        maps = self.backbone.stage_maps(images, train=train)
        local_map = maps[self.config.local_stage - 1]
        y = self.global_head(maps[-1].mean(axis=(1, 2)), train)
        output = DIMOutput(local=self.local_mi(local_map, train),
                           global_=self.global_mi(y, train))
        if global_dim:
            x = local_map
            for stage in self.map_stages:
                for block in stage:
                    x = block(x, train)
            output.global_map = self.map_output(x.mean(axis=(1, 2)))
            output.global_vector = self.vector_output(y)
        return output

    def downstream_model(self) -> ResNet:
        return self.backbone


# ------------------------------------------------------------------------------------ AMDIM

@dataclasses.dataclass(frozen=True)
class AMDIMConfig:
    """amdim-public train.py's encoder flags; the encoder is its 32x32 one (model.py)."""

    ndf: int = 128
    """Base width: the stages have ndf, 2 ndf and 4 ndf channels (train.py default 128)."""
    n_rkhs: int = 1024
    """Width of the 1x1 global feature and of the embeddings (train.py default 1024)."""
    n_depth: int = 3
    """Residual layers per block (the first strided, the others 1x1; train.py default 3)."""
    use_bn: bool = False
    """BatchNorm inside the blocks and embedding hidden layers (train.py default 0: off)."""
    num_channels: int = 3
    """Channels of the input images (3: RGB)."""
    batch_norm_momentum: float = 0.9
    """BatchNorm running-average decay, Flax's convention (0.9 = torch momentum 0.1)."""
    batch_norm_epsilon: float = 1e-5
    """BatchNorm epsilon (torch 1e-5)."""
    dtype: str = "float32"
    """Compute dtype: float32, bfloat16 or float16 (the reference's --amp; params float32)."""

    def __post_init__(self) -> None:
        check_dtype(self, COMPUTE_DTYPES)
        if min(self.ndf, self.n_rkhs, self.n_depth, self.num_channels) < 1:
            raise ValueError("ndf, n_rkhs, n_depth and num_channels must be >= 1")
        if self.n_rkhs < 4 * self.ndf:
            raise ValueError(f"n_rkhs={self.n_rkhs} must be >= 4 ndf = {4 * self.ndf} "
                             "(the last residual layer widens, model.py ConvResNxN)")


class ResidualLayer(nnx.Module):
    """model.py `ConvResNxN`: conv (width, stride, valid padding, no bias) -> [BatchNorm] ->
    ReLU -> 1x1 conv (zero-initialised, fixup-style) plus an average-pool shortcut of the same
    window, zero-padded to the wider output; no activation after the sum."""

    def __init__(self, config: AMDIMConfig, n_in: int, n_out: int, width: int, stride: int,
                 *, rngs: nnx.Rngs):
        if n_out < n_in:
            raise ValueError(f"a residual layer cannot narrow {n_in} -> {n_out} channels")
        dtype = jnp.dtype(config.dtype)
        self.width, self.stride, self.pad = width, stride, n_out - n_in
        self.conv = nnx.Conv(n_in, n_out, (width, width), strides=stride, padding="VALID",
                             use_bias=False, dtype=dtype, kernel_init=TORCH_DEFAULT_INIT,
                             rngs=rngs)
        self.norm = batch_norm(config, n_out, rngs) if config.use_bn else None
        self.mix = nnx.Linear(n_out, n_out, use_bias=False, dtype=dtype,
                              kernel_init=nnx.initializers.zeros, rngs=rngs)

    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        h = self.conv(x)
        if self.norm is not None:
            h = self.norm(h, use_running_average=not train)
        shortcut = nnx.avg_pool(x, (self.width, self.width), strides=(self.stride,) * 2,
                                padding="VALID")
        shortcut = jnp.pad(shortcut, ((0, 0), (0, 0), (0, 0), (0, self.pad)))
        return self.mix(jax.nn.relu(h)) + shortcut


def residual_block(config: AMDIMConfig, n_in: int, n_out: int, width: int, stride: int,
                   rngs: nnx.Rngs) -> nnx.List:
    """model.py `ConvResBlock`: one strided layer, then n_depth - 1 1x1 layers."""
    return nnx.List([ResidualLayer(config, n_in, n_out, width, stride, rngs=rngs)]
                    + [ResidualLayer(config, n_out, n_out, 1, 1, rngs=rngs)
                       for _ in range(config.n_depth - 1)])


class AMDIMEncoder(nnx.Module):
    """model.py `Encoder(encoder_size=32)`: on a 32x32 input, conv 3x3 (bias, ReLU) -> 30,
    1x1 layer -> 30, block 4/2 -> 14, block 2/2 -> 7 (the 7x7 features, after an optional
    BatchNorm), block 3/1 -> 5 (the 5x5 features), block 3/1 -> 3, layer 3/1 to n_rkhs -> 1,
    BatchNorm (the 1x1 global feature)."""

    SIZE = 32  # input side the layer layout is for

    def __init__(self, config: AMDIMConfig, *, rngs: nnx.Rngs):
        self.config = config
        ndf = config.ndf
        self.stem = nnx.Conv(config.num_channels, ndf, (3, 3), padding="VALID",
                             dtype=jnp.dtype(config.dtype), kernel_init=TORCH_DEFAULT_INIT,
                             rngs=rngs)
        self.to_7 = nnx.List([
            ResidualLayer(config, ndf, ndf, 1, 1, rngs=rngs),
            *residual_block(config, ndf, 2 * ndf, 4, 2, rngs),
            *residual_block(config, 2 * ndf, 4 * ndf, 2, 2, rngs)])
        self.norm_7 = batch_norm(config, 4 * ndf, rngs) if config.use_bn else None
        self.to_5 = residual_block(config, 4 * ndf, 4 * ndf, 3, 1, rngs)
        self.to_1 = nnx.List([*residual_block(config, 4 * ndf, 4 * ndf, 3, 1, rngs),
                              ResidualLayer(config, 4 * ndf, config.n_rkhs, 3, 1, rngs=rngs)])
        self.norm_1 = batch_norm(config, config.n_rkhs, rngs)

    def scales(self, images: jax.Array, *, train: bool
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """[B, 32, 32, C] -> the 1x1 feature [B, n_rkhs], the 5x5 and 7x7 maps [B, s, s,
        4 ndf]."""
        x = jax.nn.relu(self.stem(images.astype(jnp.dtype(self.config.dtype))))
        for layer in self.to_7:
            x = layer(x, train)
        if self.norm_7 is not None:
            x = self.norm_7(x, use_running_average=not train)
        seven = x
        for layer in self.to_5:
            x = layer(x, train)
        five = x
        for layer in self.to_1:
            x = layer(x, train)
        one = self.norm_1(x, use_running_average=not train)
        return one.reshape(one.shape[0], -1), five, seven

    def __call__(self, images: jax.Array, *, train: bool) -> jax.Array:
        """The global feature [B, n_rkhs] (what amdim-public's evaluation classifiers read)."""
        return self.scales(images, train=train)[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AMDIMOutput:
    """The embeddings: `r1` [B, n_rkhs] (the global feature), `r5` [B, 5, 5, n_rkhs] and `r7`
    [B, 7, 7, n_rkhs]."""

    r1: jax.Array
    r5: jax.Array
    r7: jax.Array


class AMDIM(nnx.Module):
    def __init__(self, config: AMDIMConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.backbone = AMDIMEncoder(config, rngs=rngs)
        self.rkhs_5, self.rkhs_7 = (
            MIProjection(config, 4 * config.ndf, config.n_rkhs, amdim=True,
                         hidden_batch_norm=config.use_bn, rngs=rngs) for _ in range(2))

    def __call__(self, images: jax.Array, *, train: bool) -> AMDIMOutput:
        one, five, seven = self.backbone.scales(images, train=train)
        return AMDIMOutput(r1=one, r5=self.rkhs_5(five, train), r7=self.rkhs_7(seven, train))

    def downstream_model(self) -> AMDIMEncoder:
        return self.backbone

