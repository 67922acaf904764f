"""Jigsaw puzzle pre-training (Noroozi & Favaro 2016 "Unsupervised Learning of Visual
Representations by Solving Jigsaw Puzzles", §3; MehdiNoroozi/JigsawPuzzleSolver
solver_cfn_jps.prototxt, bbrattoli/JigsawPuzzlePytorch).

Inside the jitted step, per image: a window cut into 3x3 cells with a tile at a random place in
each (random gaps), grayscale for 70% of the images, the colour tiles' channels jittered,
every tile normalised on its own (`input_pipeline.jigsaw.puzzle_tiles`); a class drawn
uniformly from the permutation set (1,000 permutations chosen by maximal Hamming distance,
`input_pipeline.jigsaw.permutation_set`) and the tiles shuffled by it. The context-free
network (`models.image_tasks.JigsawNet`: one ResNet on every tile, fc6 per tile, fc7, fc8)
classifies the permutation; cross-entropy, the mean over the batch.

At the paper's scale the window is 225 pixels (cells of 75, tiles of 64, channels jittered by
up to 2 pixels). Smaller images keep the tile-to-cell ratio 64/75 (0.85): CIFAR's 32-pixel
images give a 30-pixel window of 10-pixel cells and 8-pixel tiles (8.5 rounded down, gaps of
0-4 pixels between neighbours), where a 2/64 channel jitter rounds to 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import image_augment, jigsaw
from pretext_jax.models.image_tasks import JigsawConfig, JigsawNet
from pretext_jax.objectives.common.losses import weighted_cross_entropy
from pretext_jax.objectives.common.preset_parts import TINY_IMAGE_TRAIN
from pretext_jax.objectives.common.two_view import (
    EVAL_AUGMENT_SEED,
    ImageExampleConfig,
    check_host_crops,
    knn_monitor,
    knn_summary,
    prepare_two_view_images,
    single_view,
)
from pretext_jax.objectives.registry import Batch, Evaluation, Method, Metrics, Resolution, register


@dataclasses.dataclass(frozen=True)
class JigsawSettings:
    """The `objective` section: the puzzle's geometry and its remedies against shortcuts
    (module docstring; defaults: the paper's)."""

    image_size: int = 256
    """Side of host crops and of the kNN monitor's images (the paper resizes to 256)."""
    puzzle_size: int = 225
    """Side of the window cut into 3x3 cells, a multiple of 3 (paper 225: cells of 75)."""
    tile_size: int = 64
    """Side of the tile taken at a random place in each cell, < puzzle_size / 3 (paper 64)."""
    grayscale_probability: float = 0.7
    """Share of puzzles made grayscale against chromatic aberration (paper 0.7)."""
    channel_jitter: int = 2
    """Colour tiles: each channel cut up to this many pixels off the tile's place (paper 2)."""

    def __post_init__(self) -> None:
        if self.puzzle_size % jigsaw.GRID or not 1 <= self.tile_size < self.puzzle_size // 3:
            raise ValueError(f"puzzle_size={self.puzzle_size} must be a multiple of 3 and "
                             f"tile_size={self.tile_size} in [1, puzzle_size / 3) (225, 64)")
        if not 0.0 <= self.grayscale_probability <= 1.0 or self.channel_jitter < 0:
            raise ValueError("grayscale_probability must be in [0, 1], channel_jitter >= 0")


def puzzles(rng: jax.Array, images: jax.Array, config: JigsawConfig,
            objective: JigsawSettings) -> tuple[jax.Array, jax.Array]:
    """Shuffled tiles [B, 9, t, t, 3] of uint8 images (whole or host crops) and their classes
    [B], indices into the permutation set."""
    images = image_augment.to_float(single_view(images))
    if min(images.shape[1:3]) < objective.puzzle_size:
        raise UserError(f"images of {images.shape[1]}x{images.shape[2]} pixels are smaller than "
                        f"objective.puzzle_size={objective.puzzle_size}; lower it (and "
                        "objective.tile_size) or use larger images")
    tile_key, class_key = jax.random.split(rng)
    tiles = jax.vmap(lambda k, x: jigsaw.puzzle_tiles(
        k, x, objective.puzzle_size, objective.tile_size, objective.grayscale_probability,
        objective.channel_jitter))(jax.random.split(tile_key, images.shape[0]), images)
    permutations = jnp.asarray(jigsaw.permutation_set(config.num_permutations,
                                                      config.permutation_seed))
    labels = jax.random.randint(class_key, (images.shape[0],), 0, config.num_permutations)
    return jigsaw.shuffle_tiles(tiles, permutations[labels]), labels


def jigsaw_loss(model: JigsawNet, batch: Batch, rng: jax.Array | None, *,
                objective: JigsawSettings | None = None) -> tuple[jax.Array, Metrics]:
    """Cross-entropy over the permutation set of each image's shuffled tiles (module
    docstring); `rng=None` (evaluation): puzzles and classes from a fixed key, BatchNorm
    running statistics."""
    objective = objective or JigsawSettings()
    key = rng if rng is not None else jax.random.key(EVAL_AUGMENT_SEED)
    tiles, labels = puzzles(key, batch["image"], model.config, objective)
    logits = model(tiles, train=rng is not None)
    return weighted_cross_entropy(logits, labels, jnp.ones(labels.shape), epsilon=0.0)


def check_jigsaw(model: JigsawConfig, examples: ImageExampleConfig, objective: JigsawSettings
                 ) -> None:
    """Host crops of `objective.image_size` that hold the puzzle."""
    check_host_crops(model, examples, objective)
    if examples.host_crop_size and examples.host_crop_size < objective.puzzle_size:
        raise UserError(f"examples.host_crop_size={examples.host_crop_size} is smaller than "
                        f"objective.puzzle_size={objective.puzzle_size}; raise it")


def build_jigsaw(config: JigsawConfig, seed: int) -> JigsawNet:
    with nnx.use_eager_sharding(False):
        return JigsawNet(config, rngs=nnx.Rngs(seed))


_CIFAR_PUZZLE = {"image_size": 32, "puzzle_size": 30, "tile_size": 8, "channel_jitter": 0}
PRESETS: dict[str, Any] = {
    # Jigsaw at test size on 32-pixel images (module docstring), a narrow ResNet-18 with the
    # CIFAR stem on the 8-pixel tiles, a set of 100 permutations (the paper's Table 1 also
    # trains on 100) and small fully connected layers; Adam with a cosine decay for the short
    # run instead of the paper's SGD steps (a choice, not compared with them).
    "jigsaw_tiny": {
        "model": {"depth": 18, "stem": "cifar", "base_width": 8, "num_permutations": 100,
                  "tile_features": 64, "hidden_dim": 256},
        "objective": _CIFAR_PUZZLE,
        "optim": {"optimizer": "adamw", "learning_rate": 1e-3, "bias_correction": True,
                  "schedule": "cosine", "warmup_steps": 10, "weight_decay": 5e-4,
                  "clip_norm": 0.0},
        "train": TINY_IMAGE_TRAIN,
    },
    # The paper's recipe (§3.3 and solver_cfn_jps.prototxt) with a ResNet-50 in place of the
    # CFN's AlexNet branch: 1,000 permutations, fc6 1024 per tile, fc7 4096; images resized
    # whole to 256 on the host (host crops covering the whole image: area 1), 225-pixel
    # windows, 64-pixel tiles; SGD lr 0.01, momentum 0.9, weight decay 5e-4, lr x0.1 every
    # 100,000 steps, 350,000 steps of batch 256.
    "jigsaw_imagenet": {
        "model": {"depth": 50, "stem": "imagenet", "dtype": "bfloat16",
                  "num_permutations": 1000, "tile_features": 1024, "hidden_dim": 4096},
        "objective": {"image_size": 256, "puzzle_size": 225, "tile_size": 64,
                      "grayscale_probability": 0.7, "channel_jitter": 2},
        "examples": {"host_crop_size": 256, "host_crop_area_min": 1.0},
        "data": {"source": "tfds:imagenet2012", "worker_count": 16},
        "optim": {"optimizer": "sgd", "learning_rate": 0.01, "momentum": 0.9,
                  "weight_decay": 5e-4, "schedule": "step",
                  "decay_boundaries": "100000,200000,300000", "decay_factor": 0.1,
                  "warmup_steps": 0, "clip_norm": 0.0},
        "train": {"steps": 350000, "batch_size": 256, "eval_every": 5000},
    },
}


register(Method(
    name="jigsaw",
    model_config=JigsawConfig,
    example_config=ImageExampleConfig,
    objective_config=JigsawSettings,
    build_model=build_jigsaw,
    loss=jigsaw_loss,
    prepare=prepare_two_view_images,
    units_per_example=lambda examples: jigsaw.TILES,
    unit="tiles",
    description="Jigsaw: classify which permutation shuffled 3x3 tiles of an image "
                "(Noroozi & Favaro 2016)",
    presets=PRESETS,
    resolution=Resolution(check=check_jigsaw),
    evaluation=Evaluation(monitor=knn_monitor, summarize=knn_summary(("loss", "accuracy"))),
))
