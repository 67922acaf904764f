"""Networks of the image pretext tasks that classify a transformation: a ResNet backbone (what
linear evaluation and fine-tuning keep, `downstream_model`) and a classifier head.

- `RotationNet` (Gidaris et al. 2018, RotNet): backbone -> global average pool -> a linear
  4-way layer, as the classifier after the NIN's last block in gidariss/FeatureLearningRotNet
  architectures/NetworkInNetwork.py (our ResNets stand in for the paper's NIN).
- `JigsawNet` (Noroozi & Favaro 2016, the context-free network, Figure 3): the same backbone on
  each of the 9 tiles (shared weights), a per-tile fc6 + ReLU (`tile_features`, 1024), the 9
  tile vectors concatenated in their shuffled order, fc7 + ReLU (`hidden_dim`, 4096) and fc8
  over the permutation set (`num_permutations`, 1000). The CFN's AlexNet branch, and the
  dropout after its fully connected layers, are replaced by our ResNet with BatchNorm.
- `ContextNet` (Doersch et al. 2015, Figure 3; cdoersch/deepcontext train.py:54-82): the same
  backbone on both patches of a pair (shared weights), a per-patch fc6 (`patch_features`, 4096)
  with BatchNorm and ReLU, the two concatenated (first patch first), fc7 (`hidden_dim`, 4096)
  with BatchNorm and ReLU, fc8 (`hidden_dim`) with ReLU and fc9 over the 8 relative positions.
  As train.py:29-36, the head's BatchNorm has no scale or shift; the AlexNet tower is replaced by
  our ResNet.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.momentum import MLP
from pretext_jax.models.resnet import ResNet, ResNetConfig

ROTATIONS = 4
PAIR_CLASSES = 8  # the second patch's place among the first one's 8 neighbours


class RotationNet(nnx.Module):
    def __init__(self, config: ResNetConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.backbone = ResNet(config.backbone_config(), rngs=rngs)
        self.head = nnx.Linear(self.backbone.config.features, ROTATIONS,
                               dtype=jnp.dtype(config.dtype), rngs=rngs)

    def __call__(self, images: jax.Array, *, train: bool) -> jax.Array:
        """[N, S, S, 3] images -> rotation logits [N, 4]."""
        return self.head(self.backbone(images, train=train))

    def downstream_model(self) -> ResNet:
        return self.backbone


@dataclasses.dataclass(frozen=True)
class JigsawConfig(ResNetConfig):
    num_permutations: int = 1000
    """Classes of the puzzle: permutations in the set (Noroozi & Favaro 1000)."""
    permutation_seed: int = 0
    """Seed of the set's first permutation (Algorithm 1); the set is a function of both."""
    tile_features: int = 1024
    """Width of each tile's fc6 (CFN 1024)."""
    hidden_dim: int = 4096
    """Width of fc7 over the 9 concatenated tile vectors (CFN 4096)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 2 <= self.num_permutations <= 362880:
            raise ValueError(f"num_permutations={self.num_permutations} must be in 2..9! "
                             "(the paper: 1000)")
        if self.tile_features < 1 or self.hidden_dim < 1:
            raise ValueError("tile_features and hidden_dim must be >= 1")


class JigsawNet(nnx.Module):
    def __init__(self, config: JigsawConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.backbone = ResNet(config.backbone_config(), rngs=rngs)
        self.tile = nnx.Linear(self.backbone.config.features, config.tile_features,
                               dtype=jnp.dtype(config.dtype), rngs=rngs)
        self.classifier = MLP(config, 9 * config.tile_features, config.hidden_dim,
                              config.num_permutations, batch_norm=False, output_bias=True,
                              rngs=rngs)

    def __call__(self, tiles: jax.Array, *, train: bool) -> jax.Array:
        """Shuffled tiles [B, 9, t, t, 3] -> logits over the permutation set [B, classes]."""
        batch, count = tiles.shape[:2]
        features = self.backbone(tiles.reshape(batch * count, *tiles.shape[2:]), train=train)
        per_tile = jax.nn.relu(self.tile(features))
        return self.classifier(per_tile.reshape(batch, -1), train)

    def downstream_model(self) -> ResNet:
        return self.backbone


@dataclasses.dataclass(frozen=True)
class ContextConfig(ResNetConfig):
    patch_features: int = 4096
    """Width of each patch's fc6 (train.py:65: 4096)."""
    hidden_dim: int = 4096
    """Width of fc7 over the two concatenated patch vectors and of fc8 (train.py:78-79: 4096)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.patch_features < 1 or self.hidden_dim < 1:
            raise ValueError("patch_features and hidden_dim must be >= 1 (the paper: 4096)")


class ContextNet(nnx.Module):
    def __init__(self, config: ContextConfig, *, rngs: nnx.Rngs):
        self.config = config
        dtype = jnp.dtype(config.dtype)

        def plain_norm(features: int) -> nnx.BatchNorm:  # train.py:29-36: no scale or shift
            return nnx.BatchNorm(features, use_scale=False, use_bias=False,
                                 momentum=config.batch_norm_momentum,
                                 epsilon=config.batch_norm_epsilon, dtype=dtype, rngs=rngs)

        self.backbone = ResNet(config.backbone_config(), rngs=rngs)
        self.patch = nnx.Linear(self.backbone.config.features, config.patch_features,
                                dtype=dtype, rngs=rngs)
        self.patch_norm = plain_norm(config.patch_features)
        self.pair = nnx.Linear(2 * config.patch_features, config.hidden_dim, dtype=dtype,
                               rngs=rngs)
        self.pair_norm = plain_norm(config.hidden_dim)
        self.classifier = MLP(config, config.hidden_dim, config.hidden_dim, PAIR_CLASSES,
                              batch_norm=False, output_bias=True, rngs=rngs)

    def __call__(self, pairs: jax.Array, *, train: bool) -> jax.Array:
        """Patch pairs [B, 2, p, p, 3] -> logits over the 8 relative positions [B, 8]."""
        batch = pairs.shape[0]
        features = self.backbone(pairs.reshape(2 * batch, *pairs.shape[2:]), train=train)
        per_patch = jax.nn.relu(self.patch_norm(self.patch(features),
                                                use_running_average=not train))
        pair = self.pair(per_patch.reshape(batch, -1))
        return self.classifier(jax.nn.relu(self.pair_norm(pair, use_running_average=not train)),
                               train)

    def downstream_model(self) -> ResNet:
        return self.backbone
