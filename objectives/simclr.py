"""SimCLR pre-training objective (Chen et al. 2020): two augmented views of every image, one
ResNet + projection head over both (BatchNorm statistics over the 2N views of the global
batch), NT-Xent with negatives from the whole global batch.

Reference: google-research/simclr tf2/run.py, tf2/model.py, tf2/objective.py. The host delivers
uint8 images (whole, or for images of many sizes two host crops per image); the augmentations
run here, inside the jitted step, one key per view.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.input_pipeline import image_augment
from pretext_jax.models.simclr import SimCLR, SimCLRConfig
from pretext_jax.objectives.contrastive import nt_xent
from pretext_jax.objectives.registry import Batch, Method, Metrics, register
from pretext_jax.objectives.two_view import (
    ImageExampleConfig,
    check_host_crops,
    knn_monitor,
    knn_summary,
    prepare_two_view_images,
    two_views,
)


@dataclasses.dataclass(frozen=True)
class SimCLRObjectiveConfig(SimCLRConfig):
    """The network (`SimCLRConfig`) plus the objective: NT-Xent `temperature` (0.1 ImageNet,
    0.5 CIFAR) and the augmentation settings (`image_augment.AugmentConfig`, flattened so
    each is a `model.*` override; SimCLR treats the augmentations as part of the method)."""

    temperature: float = 0.1
    """NT-Xent temperature, > 0 (SimCLR 0.1 ImageNet, 0.5 CIFAR-10)."""
    image_size: int = 224
    """Side of the augmented views in pixels (ImageNet 224, CIFAR 32)."""
    crop_area_min: float = 0.08
    """Smallest area fraction of the random resized crop, in (0, 1] (SimCLR 0.08)."""
    jitter_strength: float = 1.0
    """Colour-jitter strength s (amounts 0.8 s, hue 0.2 s): SimCLR 1.0 ImageNet, 0.5 CIFAR."""
    blur_probability: float = 0.5
    """Probability of Gaussian blur per view (SimCLR 0.5 on ImageNet; none on CIFAR)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.temperature <= 0.0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (SimCLR: 0.1 or 0.5)")
        if not 0.0 < self.crop_area_min <= 1.0:
            raise ValueError(f"crop_area_min={self.crop_area_min} must be in (0, 1]")

    def augment_config(self, crop: bool = True) -> image_augment.AugmentConfig:
        return image_augment.AugmentConfig(
            image_size=self.image_size, crop=crop,
            crop_window=image_augment.CropConfig(area=(self.crop_area_min, 1.0)),
            jitter_strength=self.jitter_strength, blur_probability=self.blur_probability)


def simclr_loss(model: SimCLR, batch: Batch, rng: jax.Array | None
                ) -> tuple[jax.Array, Metrics]:
    """NT-Xent of two views of every image; `rng=None` (evaluation) uses fixed views and the
    BatchNorm running statistics."""
    config: SimCLRObjectiveConfig = model.config
    views = jnp.concatenate(two_views(rng, batch["image"],
                                      lambda crop: (config.augment_config(crop),) * 2))
    projections = model(views, train=rng is not None).projections
    first, second = jnp.split(projections, 2)
    loss, metrics = nt_xent(first, second, config.temperature)
    return loss, {"loss": (loss, jnp.ones((), jnp.float32)), **metrics}


def build_simclr(config: SimCLRObjectiveConfig, seed: int) -> SimCLR:
    with nnx.use_eager_sharding(False):
        return SimCLR(config, rngs=nnx.Rngs(seed))


register(Method(
    name="simclr",
    model_config=SimCLRObjectiveConfig,
    example_config=ImageExampleConfig,
    build_model=build_simclr,
    loss=simclr_loss,
    prepare=prepare_two_view_images,
    check=check_host_crops,
    units_per_example=lambda examples: 2,
    monitor=knn_monitor,
    unit="views",
    description="SimCLR: NT-Xent between two augmented views (Chen et al. 2020)",
    summarize=knn_summary(("loss", "contrastive_accuracy")),
))
