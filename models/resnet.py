"""ResNet v1.5 backbones (He et al. 2016; the stride on the 3x3 convolution of a bottleneck, as
torchvision and HF transformers `ResNetModel`, the parity oracle) with an ImageNet stem (7x7/2
convolution + 3x3/2 max-pool) or a CIFAR stem (3x3/1 convolution, no pool; SimCLR Appendix
B.9), a width multiplier, and the SimCLR projection head.

Images are NHWC. BatchNorm uses torch's defaults (epsilon 1e-5, momentum 0.1, i.e. Flax 0.9).
Under `jit` with a batch sharded over the mesh, BatchNorm's mean and variance are those of the
global batch (XLA reduces across devices), which is SimCLR's global BN without any axis name.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.layers import COMPUTE_DTYPES, check_dtype

# Blocks and stage depths of the standard sizes (torchvision / HF `ResNetConfig`), and
# ResNet-10 (one basic block a stage) for test-sized models.
DEPTHS = {10: ("basic", (1, 1, 1, 1)), 18: ("basic", (2, 2, 2, 2)), 34: ("basic", (3, 4, 6, 3)),
          50: ("bottleneck", (3, 4, 6, 3)), 101: ("bottleneck", (3, 4, 23, 3))}
BOTTLENECK_EXPANSION = 4


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """`depth` 10/18/34/50/101, `stem` `imagenet` or `cifar`, `width_multiplier` scales every
    channel count: the stem has base_width x w channels, the stages base_width x w x (1, 2, 4,
    8), times 4 for bottlenecks (`base_width` is 64 in every standard ResNet; smaller values
    make test-sized models). `dtype` is the compute dtype (parameters stay float32)."""

    depth: int = 50
    """ResNet depth: 10, 18 or 34 (basic blocks), 50 or 101 (bottlenecks); SimCLR etc.: 50."""
    stem: str = "imagenet"
    """Stem: imagenet (7x7/2 conv + 3x3/2 max-pool) or cifar (3x3/1 conv, no pool; SimCLR B.9)."""
    width_multiplier: int = 1
    """Multiplier of every channel count (SimCLR ResNet-50 1x, 2x, 4x)."""
    base_width: int = 64
    """Stem channels at multiplier 1 (64 in every standard ResNet; less for test models)."""
    num_channels: int = 3
    """Channels of the input images (3: RGB)."""
    batch_norm_momentum: float = 0.9
    """BatchNorm running-average decay, Flax's convention (0.9 = torch momentum 0.1)."""
    batch_norm_epsilon: float = 1e-5
    """BatchNorm epsilon (torch and SimCLR 1e-5)."""
    dtype: str = "float32"
    """Compute dtype: float32, bfloat16 or float16 (parameters stay float32)."""

    def __post_init__(self) -> None:
        check_dtype(self, (*COMPUTE_DTYPES, "float64"))  # float64: the HF parity test
        if self.depth not in DEPTHS:
            raise ValueError(f"depth {self.depth} must be one of {sorted(DEPTHS)}")
        if self.stem not in ("imagenet", "cifar"):
            raise ValueError(f"stem {self.stem!r} must be 'imagenet' or 'cifar'")
        if self.width_multiplier < 1 or self.base_width < 1:
            raise ValueError("width_multiplier and base_width must be >= 1")

    def backbone_config(self) -> ResNetConfig:
        """The ResNet fields of this config (a subclass adds head fields): what `ResNet` takes."""
        return ResNetConfig(**{f.name: getattr(self, f.name)
                               for f in dataclasses.fields(ResNetConfig)})

    @property
    def block(self) -> str:
        return DEPTHS[self.depth][0]

    @property
    def stage_depths(self) -> tuple[int, ...]:
        return DEPTHS[self.depth][1]

    @property
    def stem_width(self) -> int:
        return self.base_width * self.width_multiplier

    @property
    def stage_widths(self) -> tuple[int, ...]:
        """Output channels of each stage."""
        expansion = BOTTLENECK_EXPANSION if self.block == "bottleneck" else 1
        return tuple(self.stem_width * expansion * m for m in (1, 2, 4, 8))

    @property
    def features(self) -> int:
        return self.stage_widths[-1]


class ConvBN(nnx.Module):
    """Convolution without bias (torch padding kernel // 2 on both sides) + BatchNorm
    (HF `ResNetConvLayer` without its activation)."""

    def __init__(self, config: ResNetConfig, in_channels: int, out_channels: int, kernel: int,
                 stride: int, *, rngs: nnx.Rngs):
        pad = kernel // 2
        self.convolution = nnx.Conv(
            in_channels, out_channels, (kernel, kernel), strides=stride,
            padding=((pad, pad), (pad, pad)), use_bias=False, dtype=jnp.dtype(config.dtype),
            kernel_init=nnx.initializers.variance_scaling(2.0, "fan_out", "normal"), rngs=rngs)
        self.normalization = nnx.BatchNorm(
            out_channels, momentum=config.batch_norm_momentum,
            epsilon=config.batch_norm_epsilon, dtype=jnp.dtype(config.dtype), rngs=rngs)

    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        return self.normalization(self.convolution(x), use_running_average=not train)


class ResidualBlock(nnx.Module):
    """Basic (two 3x3) or bottleneck (1x1, 3x3 with the stride, 1x1 to 4x) block with a
    projection shortcut when the shape changes; ReLU after the sum."""

    def __init__(self, config: ResNetConfig, in_channels: int, out_channels: int, stride: int,
                 *, rngs: nnx.Rngs):
        if config.block == "basic":
            shapes = [(in_channels, out_channels, 3, stride), (out_channels, out_channels, 3, 1)]
        else:
            inner = out_channels // BOTTLENECK_EXPANSION
            shapes = [(in_channels, inner, 1, 1), (inner, inner, 3, stride),
                      (inner, out_channels, 1, 1)]
        self.layers = nnx.List([ConvBN(config, *shape, rngs=rngs) for shape in shapes])
        self.shortcut = (ConvBN(config, in_channels, out_channels, 1, stride, rngs=rngs)
                         if in_channels != out_channels or stride != 1 else None)

    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        residual = x if self.shortcut is None else self.shortcut(x, train)
        for index, layer in enumerate(self.layers):
            x = layer(x, train)
            if index < len(self.layers) - 1:
                x = jax.nn.relu(x)
        return jax.nn.relu(x + residual)


def build_stages(config: ResNetConfig, first: int, *, rngs: nnx.Rngs) -> nnx.List:
    """Stages `first`.. of the ResNet (0-based; each a list of blocks, the first block of every
    stage but stage 0 with stride 2), taking the previous stage's output (or the stem's)."""
    stages = []
    in_channels = config.stage_widths[first - 1] if first else config.stem_width
    for index in range(first, len(config.stage_depths)):
        width = config.stage_widths[index]
        stages.append(nnx.List([
            ResidualBlock(config, in_channels if b == 0 else width, width,
                          2 if index > 0 and b == 0 else 1, rngs=rngs)
            for b in range(config.stage_depths[index])]))
        in_channels = width
    return nnx.List(stages)


class ResNet(nnx.Module):
    """The backbone: stem, four stages, global average pool -> [B, features]."""

    def __init__(self, config: ResNetConfig, *, rngs: nnx.Rngs):
        self.config = config
        kernel, stride = (7, 2) if config.stem == "imagenet" else (3, 1)
        self.stem = ConvBN(config, config.num_channels, config.stem_width, kernel, stride,
                           rngs=rngs)
        self.stages = build_stages(config, 0, rngs=rngs)

    def stage_maps(self, images: jax.Array, *, train: bool) -> list[jax.Array]:
        """[B, H, W, C] images (normalised floats) -> every stage's output map, first to last
        (CIFAR stem, 32 px: 32, 16, 8 and 4 pixels a side)."""
        x = jax.nn.relu(self.stem(images.astype(jnp.dtype(self.config.dtype)), train))
        if self.config.stem == "imagenet":
            x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        maps = []
        for stage in self.stages:
            for block in stage:
                x = block(x, train)
            maps.append(x)
        return maps

    def feature_map(self, images: jax.Array, *, train: bool) -> jax.Array:
        """[B, H, W, C] images (normalised floats) -> the last stage's [B, h, w, features]."""
        return self.stage_maps(images, train=train)[-1]

    def __call__(self, images: jax.Array, *, train: bool) -> jax.Array:
        return self.feature_map(images, train=train).mean(axis=(1, 2))
