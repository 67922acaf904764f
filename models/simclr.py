"""SimCLR's network: a ResNet backbone and the projection head g (Chen et al. 2020 §2.1, B.9;
google-research/simclr tf2/model.py `ProjectionHead`, tf2/resnet.py).

The head has `projection_layers` dense layers without bias, each followed by BatchNorm; the
hidden ones keep the input width and add ReLU, the last maps to `projection_dim` and its
BatchNorm has no offset (`LinearLayer(use_bias=False, use_bn=True)`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.resnet import ResNet, ResNetConfig


@dataclasses.dataclass(frozen=True)
class SimCLRConfig(ResNetConfig):
    projection_dim: int = 128
    """Output width of the projection head, the z of the loss (SimCLR 128)."""
    projection_layers: int = 3
    """Dense + BatchNorm layers in the projection head (SimCLR tf2 `num_proj_layers` 3)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.projection_layers < 1 or self.projection_dim < 1:
            raise ValueError("projection_layers and projection_dim must be >= 1")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SimCLROutput:
    """`features` h [B, F] (what linear evaluation and fine-tuning use) and `projections`
    z [B, projection_dim] (what the contrastive loss sees)."""

    features: jax.Array
    projections: jax.Array


class ProjectionLayer(nnx.Module):
    def __init__(self, config: SimCLRConfig, in_features: int, out_features: int, last: bool,
                 *, rngs: nnx.Rngs):
        self.last = last
        self.dense = nnx.Linear(in_features, out_features, use_bias=False,
                                dtype=jnp.dtype(config.dtype), rngs=rngs)
        self.normalization = nnx.BatchNorm(
            out_features, use_bias=not last, momentum=config.batch_norm_momentum,
            epsilon=config.batch_norm_epsilon, dtype=jnp.dtype(config.dtype), rngs=rngs)

    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = self.normalization(self.dense(x), use_running_average=not train)
        return x if self.last else jax.nn.relu(x)


class SimCLR(nnx.Module):
    def __init__(self, config: SimCLRConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.backbone = ResNet(config.backbone_config(), rngs=rngs)
        width = self.backbone.config.features
        self.head = nnx.List([
            ProjectionLayer(config, width, config.projection_dim if last else width, last,
                            rngs=rngs)
            for last in (i == config.projection_layers - 1
                         for i in range(config.projection_layers))])

    def __call__(self, images: jax.Array, *, train: bool) -> SimCLROutput:
        features = self.backbone(images, train=train)
        x = features
        for layer in self.head:
            x = layer(x, train)
        return SimCLROutput(features=features, projections=x)

    def downstream_model(self, projection_layers: int = 0) -> ResNet | ProjectedBackbone:
        """The encoder f that linear evaluation and fine-tuning use (the head is dropped), or
        with `projection_layers` > 0 f followed by that many of the head's first layers, as
        SimCLR v2 fine-tunes from the first (Chen et al. 2020c §2; tf2 `--ft_proj_selector`)."""
        if projection_layers == 0:
            return self.backbone
        if not 0 < projection_layers <= len(self.head):
            raise ValueError(f"projection_layers={projection_layers}: the head has "
                             f"{len(self.head)} layers")
        return ProjectedBackbone(self.backbone, list(self.head)[:projection_layers])


class ProjectedBackbone(nnx.Module):
    """The backbone followed by the first layers of its projection head (dense, BatchNorm,
    ReLU each): the network SimCLR v2 fine-tunes."""

    def __init__(self, backbone: ResNet, layers: list[ProjectionLayer]):
        self.backbone = backbone
        self.layers = nnx.List(layers)

    def __call__(self, images: jax.Array, *, train: bool) -> jax.Array:
        x = self.backbone(images, train=train)
        for layer in self.layers:
            x = layer(x, train)
        return x
