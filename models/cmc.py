"""CMC's network (Tian, Krishnan & Isola 2019 "Contrastive Multiview Coding" §3-4;
HobbitLong/CMC models/resnet.py `MyResNetsCMC`, dataset.py `RGB2Lab`, train_CMC.py).

An RGB image becomes two views, its lightness L and its colour ab in CIE L*a*b* (`rgb_to_lab`,
`lab_views`), each encoded by its own ResNet (`LabEncoders`: `l_encoder` on 1 channel,
`ab_encoder` on 2; the reference's `l_to_ab` and `ab_to_l`), then by its own linear layer to
`projection_dim` (the reference's `fc` to `feat_dim` 128; the loss L2-normalises it as its
`Normalize(2)`). The reference's `resnet50v1` gives each view a ResNet of half the width
(`width=0.5`), so that the two together are as wide as one ResNet: here the width of each half
is `base_width` (the CMC presets halve the usual one). Its stem keeps 64 channels at any
width; ours scales with `base_width`. What linear evaluation reads is both encoders' pooled
features concatenated (LinearProbing.py: `torch.cat((feat_l, feat_ab), dim=1)`), from RGB in
[0, 1]: the Lab split is part of the backbone, so any RGB evaluation (the kNN monitor, the
CIFAR-10 bench) uses it unchanged.

Each view keeps a memory bank of every training image's embedding (`MemoryBank`, [num_images,
projection_dim], model state: checkpointed with the parameters, rows sharded over the data
axes), initialised as NCEAverage.py does (uniform in +-1/sqrt(d/3)) and updated by
`update_memory`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.resnet import ResNet, ResNetConfig

# sRGB (D65) -> CIE XYZ and the D65 2-degree white point, as skimage.color (`xyz_from_rgb`,
# `_illuminants["D65"]["2"]`), which dataset.py's `RGB2Lab` calls.
XYZ_FROM_RGB = ((0.412453, 0.357580, 0.180423),
                (0.212671, 0.715160, 0.072169),
                (0.019334, 0.119193, 0.950227))
D65_WHITE = (0.95047, 1.0, 1.08883)
# train_CMC.py `get_train_loader`: L in [0, 100] and a, b over sRGB's gamut ([-86.183, 98.233],
# [-107.857, 94.478]) mapped to [-1, 1] by Normalize(mean, std) with these means and stds.
LAB_MEAN = (50.0, (-86.183 + 98.233) / 2, (-107.857 + 94.478) / 2)
LAB_STD = (50.0, (86.183 + 98.233) / 2, (107.857 + 94.478) / 2)


class MemoryBank(nnx.Variable):
    """One view's memory of every training image's embedding (not a parameter)."""


@dataclasses.dataclass(frozen=True)
class CMCConfig(ResNetConfig):
    """Two ResNets of this config's shape (one per view, `base_width` each: the reference's
    half-width `v1` networks at half the usual value), their linear projections to
    `projection_dim`, and the memory banks of `num_images` rows."""

    projection_dim: int = 128
    """Size of each view's embedding, the memory banks' width (CMC `feat_dim` 128)."""
    num_images: int = 0
    """Training images (set from the data): the rows of each memory bank."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.projection_dim < 1 or self.num_images < 0:
            raise ValueError("projection_dim must be >= 1 and num_images >= 0")

    def view_config(self, channels: int) -> ResNetConfig:
        """The ResNet of a view with `channels` input channels (L: 1, ab: 2)."""
        return dataclasses.replace(self.backbone_config(), num_channels=channels)


def srgb_to_linear(rgb: jax.Array) -> jax.Array:
    """The sRGB transfer function undone (IEC 61966-2-1, as skimage `rgb2xyz`)."""
    return jnp.where(rgb > 0.04045, ((rgb + 0.055) / 1.055) ** 2.4, rgb / 12.92)


def rgb_to_lab(rgb: jax.Array) -> jax.Array:
    """CIE L*a*b* (D65, 2 degrees) of sRGB values in [0, 1], [..., 3] -> [..., 3] with L in
    [0, 100]: linear RGB, then XYZ, then f(t) = t^(1/3) above (6/29)^3 = 0.008856 and 7.787 t
    + 16/116 below, L = 116 f(Y) - 16, a = 500 (f(X) - f(Y)), b = 200 (f(Y) - f(Z)); the
    formula of skimage.color.rgb2lab."""
    xyz = srgb_to_linear(rgb.astype(jnp.float32)) @ jnp.asarray(XYZ_FROM_RGB).T
    t = xyz / jnp.asarray(D65_WHITE)
    f = jnp.where(t > 0.008856, jnp.cbrt(t), 7.787 * t + 16.0 / 116.0)
    fx, fy, fz = f[..., 0], f[..., 1], f[..., 2]
    return jnp.stack([116.0 * fy - 16.0, 500.0 * (fx - fy), 200.0 * (fy - fz)], axis=-1)


def lab_views(rgb: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[B, H, W, 3] RGB in [0, 1] -> the normalised views L [B, H, W, 1] and ab [B, H, W, 2]
    (each channel (value - LAB_MEAN) / LAB_STD, in [-1, 1] over sRGB's gamut)."""
    lab = (rgb_to_lab(rgb) - jnp.asarray(LAB_MEAN)) / jnp.asarray(LAB_STD)
    return lab[..., :1], lab[..., 1:]


class LabEncoders(nnx.Module):
    """The backbone: `l_encoder` on L, `ab_encoder` on ab, from RGB images."""

    def __init__(self, config: CMCConfig, *, rngs: nnx.Rngs):
        self.l_encoder = ResNet(config.view_config(1), rngs=rngs)
        self.ab_encoder = ResNet(config.view_config(2), rngs=rngs)

    @property
    def features(self) -> int:
        """Width of the concatenated features."""
        return self.l_encoder.config.features + self.ab_encoder.config.features

    def encode(self, rgb: jax.Array, *, train: bool) -> tuple[jax.Array, jax.Array]:
        """Each view's pooled features ([B, F], [B, F]) of RGB images in [0, 1]."""
        l_view, ab_view = lab_views(rgb)
        return self.l_encoder(l_view, train=train), self.ab_encoder(ab_view, train=train)

    def __call__(self, rgb: jax.Array, *, train: bool) -> jax.Array:
        """Both views' features concatenated [B, 2F]: what linear evaluation uses."""
        return jnp.concatenate(self.encode(rgb, train=train), axis=-1)


class CMC(nnx.Module):
    def __init__(self, config: CMCConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.backbone = LabEncoders(config, rngs=rngs)
        width = config.backbone_config().features
        dtype = jnp.dtype(config.dtype)
        self.l_projection = nnx.Linear(width, config.projection_dim, dtype=dtype, rngs=rngs)
        self.ab_projection = nnx.Linear(width, config.projection_dim, dtype=dtype, rngs=rngs)
        bound = 1.0 / math.sqrt(config.projection_dim / 3.0)
        shape = (config.num_images, config.projection_dim)
        self.memory_l, self.memory_ab = (
            MemoryBank(jax.random.uniform(rngs.params(), shape, minval=-bound, maxval=bound),
                       out_sharding=("batch", None)) for _ in range(2))

    def __call__(self, rgb: jax.Array, *, train: bool) -> tuple[jax.Array, jax.Array]:
        """The two views' projections (not normalised) [B, projection_dim] each."""
        l_features, ab_features = self.backbone.encode(rgb, train=train)
        return self.l_projection(l_features), self.ab_projection(ab_features)

    def update_memory(self, index: jax.Array, l_embeddings: jax.Array,
                      ab_embeddings: jax.Array, momentum: float) -> None:
        """Rows `index` [B] (distinct) of each bank <- normalise(m x row + (1 - m) x the view's
        L2-normalised embedding) (NCEAverage.py, after the scores)."""
        for bank, new in ((self.memory_l, l_embeddings), (self.memory_ab, ab_embeddings)):
            memory = bank.get_value()
            rows = momentum * memory[index] + (1.0 - momentum) * jax.lax.stop_gradient(new)
            rows = rows / jnp.linalg.norm(rows, axis=1, keepdims=True)
            bank.set_value(memory.at[index].set(rows.astype(memory.dtype)))

    def downstream_model(self) -> LabEncoders:
        """Both encoders (RGB in, concatenated features out): what linear evaluation uses."""
        return self.backbone
