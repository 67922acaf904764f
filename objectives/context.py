"""Context prediction pre-training (Doersch et al. 2015 "Unsupervised Visual Representation
Learning by Context Prediction", §3; cdoersch/deepcontext train.py).

Inside the jitted step, per image: the centre patch of a 3x3 grid with gaps and jitter and one
of its 8 neighbours, uniformly; each patch maybe downsampled and back, given a remedy against
chromatic aberration (colour dropping by default, as train.py; or the paper's green-magenta
projection) and scaled to unit root mean square (`input_pipeline.context.patch_pair`). The pair
network (`models.image_tasks.ContextNet`: one ResNet on both patches, fc6 per patch, fc7, fc8,
fc9) classifies the second patch's place; cross-entropy, the mean over the pairs (train.py:82
sums them; the presets scale the learning rate to match, see their comments).

At the paper's scale patches are 96 pixels, 48 apart, jittered by up to 7 (train.py:14-17): the
jittered grid needs 398 pixels. CIFAR's 32-pixel images keep the gap at about half a patch:
7-pixel patches 3 apart, jittered by 1 (a 29-pixel grid), no downsampling (the paper's
100-pixel floor is above a 7-pixel patch's 49).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import context, image_augment
from pretext_jax.models.image_tasks import ContextConfig, ContextNet
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
class ContextSettings:
    """The `objective` section: the pair's geometry and the remedies against shortcuts
    (module docstring; defaults: cdoersch/deepcontext train.py)."""

    image_size: int = 448
    """Side of host crops and of the kNN monitor's images (train.py resizes to 150K-450K
    pixels; 448^2 is 200K)."""
    patch_size: int = 96
    """Side of each patch (train.py:14: 96)."""
    gap: int = 48
    """Pixels between neighbouring cells of the grid (train.py:16: 48)."""
    jitter: int = 7
    """Each patch moved by up to this many pixels per axis (train.py:17: 7)."""
    counter_measure: str = "drop"
    """Against chromatic aberration: drop (2 of 3 channels to noise, train.py:98-105),
    project (the green-magenta axis out, §3.1) or none."""
    downsample_probability: float = 0.33
    """Share of patches downsampled and upsampled again (train.py:92: 0.33)."""
    downsample_min_pixels: int = 100
    """Smallest area of a downsampled patch in pixels (train.py:94: 100)."""

    def __post_init__(self) -> None:
        if self.patch_size < 1 or self.gap < 0 or self.jitter < 0:
            raise ValueError(f"patch_size={self.patch_size} must be >= 1, gap={self.gap} and "
                             f"jitter={self.jitter} >= 0 (the paper: 96, 48, 7)")
        window = context.grid_size(self.patch_size, self.gap, self.jitter)
        if window > self.image_size:
            raise ValueError(f"the 3x3 grid of patch_size={self.patch_size}, gap={self.gap}, "
                             f"jitter={self.jitter} needs {window} pixels, more than "
                             f"image_size={self.image_size}; raise image_size or lower them")
        if self.counter_measure not in context.COUNTER_MEASURES:
            raise ValueError(f"counter_measure={self.counter_measure!r} must be one of "
                             f"{context.COUNTER_MEASURES}")
        if not 0.0 <= self.downsample_probability <= 1.0:
            raise ValueError(f"downsample_probability={self.downsample_probability} must be in "
                             "[0, 1]")
        if self.downsample_probability and not (
                1 <= self.downsample_min_pixels <= (self.patch_size - 1) ** 2):
            raise ValueError(f"downsample_min_pixels={self.downsample_min_pixels} must be in "
                             f"[1, (patch_size - 1)^2 = {(self.patch_size - 1) ** 2}], or set "
                             "downsample_probability=0")


def pairs(rng: jax.Array, images: jax.Array, objective: ContextSettings
          ) -> tuple[jax.Array, jax.Array]:
    """Patch pairs [B, 2, p, p, 3] of uint8 images (whole or host crops) and their labels [B],
    the second patch's place (`input_pipeline.context.NEIGHBOURS`)."""
    images = image_augment.to_float(single_view(images))
    window = context.grid_size(objective.patch_size, objective.gap, objective.jitter)
    if min(images.shape[1:3]) < window:
        raise UserError(f"images of {images.shape[1]}x{images.shape[2]} pixels are smaller than "
                        f"the {window}-pixel grid of objective.patch_size, objective.gap and "
                        "objective.jitter; lower them or use larger images")
    return jax.vmap(lambda k, x: context.patch_pair(
        k, x, objective.patch_size, objective.gap, objective.jitter, objective.counter_measure,
        objective.downsample_probability, objective.downsample_min_pixels))(
        jax.random.split(rng, images.shape[0]), images)


def context_loss(model: ContextNet, batch: Batch, rng: jax.Array | None, *,
                 objective: ContextSettings | None = None) -> tuple[jax.Array, Metrics]:
    """Cross-entropy over the 8 relative positions of each image's patch pair (module
    docstring); `rng=None` (evaluation): pairs from a fixed key, BatchNorm running
    statistics."""
    key = rng if rng is not None else jax.random.key(EVAL_AUGMENT_SEED)
    patches, labels = pairs(key, batch["image"], objective or ContextSettings())
    logits = model(patches, train=rng is not None)
    return weighted_cross_entropy(logits, labels, jnp.ones(labels.shape), epsilon=0.0)


def build_context(config: ContextConfig, seed: int) -> ContextNet:
    with nnx.use_eager_sharding(False):
        return ContextNet(config, rngs=nnx.Rngs(seed))


_CIFAR_PAIR = {"image_size": 32, "patch_size": 7, "gap": 3, "jitter": 1,
               "counter_measure": "drop", "downsample_probability": 0.0}
PRESETS: dict[str, Any] = {
    # Context prediction at test size on 32-pixel images (module docstring), a narrow ResNet-18
    # with the CIFAR stem on the 7-pixel patches and small fully connected layers; Adam with a
    # cosine decay for the short run (as jigsaw_tiny) instead of the authors' plain SGD.
    "context_tiny": {
        "model": {"depth": 18, "stem": "cifar", "base_width": 8, "patch_features": 64,
                  "hidden_dim": 128},
        "objective": _CIFAR_PAIR,
        "optim": {"optimizer": "adamw", "learning_rate": 1e-3, "bias_correction": True,
                  "schedule": "cosine", "warmup_steps": 10, "weight_decay": 5e-4,
                  "clip_norm": 0.0},
        "train": TINY_IMAGE_TRAIN,
    },
    # The authors' pair network and optimiser on CIFAR-10 (module docstring: 7/3/1 geometry,
    # no downsampling): a ResNet-18 (CIFAR stem), fc6 4096 per patch, fc7 and fc8 4096; plain
    # SGD at a fixed rate, no momentum or weight decay (train.py:331-332, solver_mko.prototxt);
    # the rate of the summed loss, 1e-5 a pair, times the batch of 128 pairs for our mean;
    # 200 epochs of 391 steps as rotation_cifar10.
    "context_cifar10": {
        "model": {"depth": 18, "stem": "cifar", "patch_features": 4096, "hidden_dim": 4096},
        "objective": _CIFAR_PAIR,
        "data": {"source": ""},
        "optim": {"optimizer": "sgd", "learning_rate": 1.28e-3, "momentum": 0.0,
                  "weight_decay": 0.0, "schedule": "constant", "warmup_steps": 0,
                  "clip_norm": 0.0},
        "train": {"steps": 78200, "batch_size": 128, "eval_every": 3910},
    },
    # The authors' recipe (train.py, solver_mko.prototxt) with a ResNet-50 in place of the
    # AlexNet tower: 96-pixel patches 48 apart, jitter 7, colour dropping, a third of the
    # patches downsampled to as few as 100 pixels; images resized whole to 448 on the host;
    # plain SGD, fixed rate 1e-5 a pair on the summed loss = 2.56e-3 on the mean of 256 pairs
    # (512 patches: train.py:15's batch), no momentum or decay, the README's ~1M steps.
    "context_imagenet": {
        "model": {"depth": 50, "stem": "imagenet", "dtype": "bfloat16",
                  "patch_features": 4096, "hidden_dim": 4096},
        "objective": {"image_size": 448, "patch_size": 96, "gap": 48, "jitter": 7,
                      "counter_measure": "drop", "downsample_probability": 0.33,
                      "downsample_min_pixels": 100},
        "examples": {"host_crop_size": 448, "host_crop_area_min": 1.0},
        "data": {"source": "tfds:imagenet2012", "worker_count": 16},
        "optim": {"optimizer": "sgd", "learning_rate": 2.56e-3, "momentum": 0.0,
                  "weight_decay": 0.0, "schedule": "constant", "warmup_steps": 0,
                  "clip_norm": 0.0},
        "train": {"steps": 1000000, "batch_size": 256, "eval_every": 10000},
    },
}


register(Method(
    name="context",
    model_config=ContextConfig,
    example_config=ImageExampleConfig,
    objective_config=ContextSettings,
    build_model=build_context,
    loss=context_loss,
    prepare=prepare_two_view_images,
    units_per_example=lambda examples: 2,
    unit="patches",
    description="Context prediction: classify where a patch lies among the 8 neighbours of "
                "another (Doersch et al. 2015)",
    presets=PRESETS,
    resolution=Resolution(check=check_host_crops),
    evaluation=Evaluation(monitor=knn_monitor, summarize=knn_summary(("loss", "accuracy"))),
))
