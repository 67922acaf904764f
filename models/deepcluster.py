"""DeepCluster's network (Caron et al. 2018 "Deep Clustering for Unsupervised Learning of
Visual Features"; facebookresearch/deepcluster models/, main.py): a ResNet backbone, optionally
behind the fixed Sobel filter of §4/§5 (`sobel`: a grayscale conversion, then the horizontal
and vertical Sobel derivatives, as the reference's `sobel` layers of models/alexnet.py), and a
linear top layer over `num_clusters` pseudo-classes that is re-initialised at every clustering
(main.py: `model.top_layer` is rebuilt with weights N(0, 0.01) and zero bias each epoch).

The pseudo-label of every training image (`ClusterLabels`, [num_images] int32) is model state:
the trainer checkpoints it with the parameters, so a resumed run reads the same cluster-uniform
order (`objectives.deepcluster`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.resnet import ResNet, ResNetConfig

# The reference's grayscale 1x1 convolution (models/alexnet.py `sobel`: weights filled with
# 1/3, bias 0): the plain mean of the channels, not a luma weighting.
GRAY_MEAN = (1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0)
# The Sobel derivative along the width; its transpose is the one along the height.
SOBEL_X = ((1.0, 0.0, -1.0), (2.0, 0.0, -2.0), (1.0, 0.0, -1.0))
HEAD_INIT_STD = 0.01


class ClusterLabels(nnx.Variable):
    """Each training image's pseudo-label from the last clustering (not a parameter)."""


@dataclasses.dataclass(frozen=True)
class DeepClusterConfig(ResNetConfig):
    num_clusters: int = 10000
    """k of k-means and the top layer's outputs (the paper: 10,000 on ImageNet)."""
    sobel: bool = False
    """Feed the backbone the Sobel derivatives of the grayscale image (the paper: yes)."""
    num_images: int = 0
    """Training images (set from the data): the length of the pseudo-label table."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_clusters < 2:
            raise ValueError(f"num_clusters={self.num_clusters} must be >= 2")

    def backbone_config(self) -> ResNetConfig:
        fields = {f.name for f in dataclasses.fields(ResNetConfig)}
        values = {k: v for k, v in dataclasses.asdict(self).items() if k in fields}
        return ResNetConfig(**{**values, "num_channels": 2 if self.sobel else self.num_channels})


def sobel(images: jax.Array) -> jax.Array:
    """[B, H, W, 3] floats -> [B, H, W, 2]: the channel-mean image's derivatives along the width
    and the height (3x3 Sobel kernels, zero padding 1, as the reference's `sobel` layers)."""
    gray = images @ jnp.asarray(GRAY_MEAN, images.dtype)
    kx = jnp.asarray(SOBEL_X, images.dtype)
    kernel = jnp.stack([kx, kx.T], axis=-1)[:, :, None, :]  # [3, 3, 1, 2], HWIO
    return jax.lax.conv_general_dilated(gray[..., None], kernel, (1, 1), ((1, 1), (1, 1)),
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


class Backbone(nnx.Module):
    """The ResNet, behind the Sobel filter when `config.sobel`: what the kNN monitor, linear
    evaluation and the clustering's features read (`two_view.backbone_features`)."""

    def __init__(self, config: DeepClusterConfig, *, rngs: nnx.Rngs):
        self.sobel = config.sobel
        self.resnet = ResNet(config.backbone_config(), rngs=rngs)

    @property
    def config(self) -> ResNetConfig:
        return self.resnet.config

    def __call__(self, images: jax.Array, *, train: bool) -> jax.Array:
        return self.resnet(sobel(images) if self.sobel else images, train=train)


class DeepCluster(nnx.Module):
    def __init__(self, config: DeepClusterConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.backbone = Backbone(config, rngs=rngs)
        self.head = nnx.Linear(self.backbone.config.features, config.num_clusters,
                               kernel_init=nnx.initializers.normal(HEAD_INIT_STD),
                               bias_init=nnx.initializers.zeros, rngs=rngs)
        self.labels = ClusterLabels(jnp.zeros((config.num_images,), jnp.int32))

    def __call__(self, images: jax.Array, *, train: bool) -> jax.Array:
        """Logits over the pseudo-classes [B, num_clusters]."""
        return self.head(self.backbone(images, train=train).astype(jnp.float32))

    def reinitialise_head(self, key: jax.Array) -> None:
        """A new top layer: weights N(0, 0.01), zero bias (main.py, every clustering)."""
        kernel = self.head.kernel
        kernel.set_value(HEAD_INIT_STD * jax.random.normal(key, kernel.shape, kernel.dtype))
        self.head.bias.set_value(jnp.zeros_like(self.head.bias.get_value()))

    def downstream_model(self) -> Backbone:
        """The encoder linear evaluation and fine-tuning use (the top layer is dropped)."""
        return self.backbone
