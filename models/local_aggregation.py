"""Local Aggregation's network (Zhuang, Zhai & Yamins 2019 "Local Aggregation for Unsupervised
Learning of Visual Embeddings" §3; neuroailab/LocalAggregation model/instance_model.py
`network_embedding`, `build_targets`, model/memory_bank.py).

A ResNet backbone and a linear layer to `embedding_dim` (the reference's ResNet ends in a dense
layer of 128 outputs, `resnet_model.py` `_NUM_CLASSES`, that the loss L2-normalises), plus two
pieces of state per training image that the trainer checkpoints with the parameters:

- the memory bank (`MemoryBank`, [num_images, embedding_dim], rows sharded over the data axes):
  a running average of each image's normalised embedding, initialised as memory_bank.py does
  (uniform in +-1/sqrt(d/3), not normalised) and updated by `update_memory`;
- the cluster labels of the last `num_clusterings` k-means runs over the bank (`ClusterLabels`,
  [num_clusterings, num_images] int32), -1 until the first clustering (the reference starts
  from each image its own cluster, `build_targets`; here -1 marks the instance-recognition
  warm-up, which never reads them).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.resnet import ResNet, ResNetConfig

NOT_CLUSTERED = -1


class MemoryBank(nnx.Variable):
    """Every training image's running-average embedding (not a parameter)."""


class ClusterLabels(nnx.Variable):
    """Every training image's cluster in each of the last clusterings (not a parameter)."""


@dataclasses.dataclass(frozen=True)
class LocalAggregationConfig(ResNetConfig):
    """The ResNet, its linear embedding to `embedding_dim`, the memory bank of `num_images`
    rows and the labels of `num_clusterings` k-means runs."""

    embedding_dim: int = 128
    """Size of the embedding and of the memory bank's rows (the reference: 128)."""
    num_clusterings: int = 10
    """k-means runs whose clusters make the close neighbours, H (the reference: 10)."""
    num_images: int = 0
    """Training images (set from the data): the rows of the memory bank."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.embedding_dim < 1 or self.num_clusterings < 1 or self.num_images < 0:
            raise ValueError("embedding_dim and num_clusterings must be >= 1, num_images >= 0")


class LocalAggregation(nnx.Module):
    def __init__(self, config: LocalAggregationConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.backbone = ResNet(config.backbone_config(), rngs=rngs)
        self.embedding = nnx.Linear(self.backbone.config.features, config.embedding_dim,
                                    dtype=jnp.dtype(config.dtype), rngs=rngs)
        bound = 1.0 / math.sqrt(config.embedding_dim / 3.0)
        self.memory = MemoryBank(
            jax.random.uniform(rngs.params(), (config.num_images, config.embedding_dim),
                               minval=-bound, maxval=bound),
            out_sharding=("batch", None))
        self.labels = ClusterLabels(jnp.full((config.num_clusterings, config.num_images),
                                             NOT_CLUSTERED, jnp.int32))

    def __call__(self, images: jax.Array, *, train: bool) -> jax.Array:
        """The embeddings (not normalised) [B, embedding_dim] of [0, 1] images."""
        return self.embedding(self.backbone(images, train=train))

    def update_memory(self, index: jax.Array, embeddings: jax.Array, momentum: float) -> None:
        """Rows `index` [B] (distinct) <- normalise(m x row + (1 - m) x the L2-normalised
        embedding) (instance_model.py `updated_new_data_memory`)."""
        memory = self.memory.get_value()
        rows = momentum * memory[index] + (1.0 - momentum) * jax.lax.stop_gradient(embeddings)
        rows = rows / jnp.linalg.norm(rows, axis=1, keepdims=True)
        self.memory.set_value(memory.at[index].set(rows.astype(memory.dtype)))

    def downstream_model(self) -> ResNet:
        """The backbone (the embedding layer is dropped): what linear evaluation uses."""
        return self.backbone
