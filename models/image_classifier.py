"""An image backbone under a linear classifier: what semi-supervised fine-tuning trains (SimCLR,
Chen et al. 2020 §B.5; google-research/simclr `model.py` `SupervisedHead`).

The backbone is any module called as `backbone(images, train=...)` that returns features
[B, F] (a ResNet, AMDIM's encoder, CMC's two encoders, DeepCluster's Sobel + ResNet), so one
head serves every image method's downstream model. The head starts at zero, as the reference's
`--zero_init_logits_layer` (every class equally likely at the first step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def feature_width(backbone: nnx.Module, image_size: int) -> int:
    """F of the backbone's [B, F] features of `image_size` x `image_size` RGB images, found by
    tracing one image through it (no arithmetic runs)."""
    graphdef, state = nnx.split(backbone)

    def features(state: nnx.State) -> jax.Array:
        images = jnp.zeros((1, image_size, image_size, 3), jnp.float32)
        return nnx.merge(graphdef, state)(images, train=False)

    return int(jax.eval_shape(features, state).shape[-1])


class ImageClassifier(nnx.Module):
    """`backbone` (taking [B, S, S, 3] floats in [0, 1]) -> linear layer -> logits
    [B, num_classes] in float32."""

    def __init__(self, backbone: nnx.Module, image_size: int, num_classes: int, *,
                 rngs: nnx.Rngs):
        self.backbone = backbone
        self.head = nnx.Linear(feature_width(backbone, image_size), num_classes,
                               kernel_init=nnx.initializers.zeros, rngs=rngs)

    def __call__(self, images: jax.Array, *, train: bool) -> jax.Array:
        return self.head(self.backbone(images, train=train).astype(jnp.float32))
