"""RotNet pre-training (Gidaris et al. 2018 "Unsupervised Representation Learning by Predicting
Image Rotations", §2 and §3.1; gidariss/FeatureLearningRotNet dataloader.py,
config/CIFAR10_RotNet_NIN4blocks.py).

Every image of the batch is augmented once (CIFAR: a random crop of the 4-pixel zero-padded
image and a horizontal flip, dataloader.py), then copied four times, rotated by 0, 90, 180 and
270 degrees on device (`image_augment.rotations`): the network sees 4B images, BatchNorm over
all of them, and classifies each copy's rotation (cross-entropy over the 4 classes, the mean
over the 4B copies). The paper's best CIFAR network, a NIN with 4 conv blocks, is replaced by
our ResNets with a linear 4-way head (`models.image_tasks.RotationNet`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.input_pipeline import image_augment
from pretext_jax.models.image_tasks import RotationNet
from pretext_jax.models.resnet import ResNetConfig
from pretext_jax.objectives.common.losses import weighted_cross_entropy
from pretext_jax.objectives.common.preset_parts import TINY_IMAGE_TRAIN
from pretext_jax.objectives.common.two_view import (
    ImageExampleConfig,
    check_host_crops,
    evaluation_view,
    knn_monitor,
    knn_summary,
    prepare_two_view_images,
    single_view,
)
from pretext_jax.objectives.registry import Batch, Evaluation, Method, Metrics, Resolution, register


@dataclasses.dataclass(frozen=True)
class RotationSettings:
    """The `objective` section: the side of the rotated images and their augmentation before
    rotating (RotNet CIFAR: torchvision RandomCrop(32, padding=4) and a horizontal flip)."""

    image_size: int = 32
    """Side of the (square) images rotated, and of the kNN monitor's (CIFAR 32)."""
    crop_padding: int = 4
    """Zero padding of the random crop before rotating, in pixels (RotNet CIFAR 4; 0 = none)."""
    flip: bool = True
    """Random horizontal flip before rotating (RotNet CIFAR: yes)."""

    def __post_init__(self) -> None:
        if self.image_size < 1 or self.crop_padding < 0:
            raise ValueError(f"image_size={self.image_size} must be >= 1 and crop_padding="
                             f"{self.crop_padding} >= 0")


def augment(rng: jax.Array, image: jax.Array, settings: RotationSettings) -> jax.Array:
    """RotNet's CIFAR augmentation of one [S, S, 3] float image: padded crop, flip."""
    crop_key, flip_key = jax.random.split(rng)
    if settings.crop_padding:
        image = image_augment.padded_crop(crop_key, image, settings.crop_padding)
    if settings.flip:
        image = jnp.where(jax.random.bernoulli(flip_key), image[:, ::-1], image)
    return image


def rotated_batch(rng: jax.Array | None, images: jax.Array, objective: RotationSettings
                  ) -> tuple[jax.Array, jax.Array]:
    """The 4B rotated copies [4B, S, S, 3] of uint8 images (whole or host crops), augmented
    first unless `rng` is None, and their rotation labels [4B]."""
    images = evaluation_view(single_view(images), objective.image_size)
    if rng is not None:
        keys = jax.random.split(rng, images.shape[0])
        images = jax.vmap(lambda k, x: augment(k, x, objective))(keys, images)
    return image_augment.rotations(images)


def rotation_loss(model: RotationNet, batch: Batch, rng: jax.Array | None, *,
                  objective: RotationSettings | None = None) -> tuple[jax.Array, Metrics]:
    """Cross-entropy of the rotation of each of the 4B copies (module docstring);
    `rng=None` (evaluation): no augmentation, BatchNorm running statistics."""
    rotated, labels = rotated_batch(rng, batch["image"], objective or RotationSettings())
    logits = model(rotated, train=rng is not None)
    return weighted_cross_entropy(logits, labels, jnp.ones(labels.shape), epsilon=0.0)


def build_rotation(config: ResNetConfig, seed: int) -> RotationNet:
    with nnx.use_eager_sharding(False):
        return RotationNet(config, rngs=nnx.Rngs(seed))


PRESETS = {
    # RotNet's CIFAR recipe at test size: a narrow ResNet-18 with the CIFAR stem, the paper's
    # optimiser with its lr steps (x0.2 at 30%, 60%, 80% of the run) over 200 steps.
    "rotation_tiny": {
        "model": {"depth": 18, "stem": "cifar", "base_width": 8},
        "objective": {"image_size": 32},
        "optim": {"optimizer": "sgd", "learning_rate": 0.1, "momentum": 0.9, "nesterov": True,
                  "weight_decay": 5e-4, "schedule": "step", "decay_boundaries": "60,120,160",
                  "decay_factor": 0.2, "warmup_steps": 0, "clip_norm": 0.0},
        "train": TINY_IMAGE_TRAIN,
    },
    # RotNet on CIFAR-10 (config/CIFAR10_RotNet_NIN4blocks.py): batch 128 images (x4
    # rotations), 200 epochs of 391 steps (50,000 images, last batch partial), SGD lr 0.1,
    # Nesterov momentum 0.9, weight decay 5e-4, lr x0.2 after epochs 60, 120 and 160; random
    # crop with 4-pixel padding and flip. Our ResNet-18 (CIFAR stem) replaces the NIN.
    "rotation_cifar10": {
        "model": {"depth": 18, "stem": "cifar"},
        "objective": {"image_size": 32, "crop_padding": 4, "flip": True},
        "data": {"source": ""},
        "optim": {"optimizer": "sgd", "learning_rate": 0.1, "momentum": 0.9, "nesterov": True,
                  "weight_decay": 5e-4, "schedule": "step",
                  "decay_boundaries": "23460,46920,62560", "decay_factor": 0.2,
                  "warmup_steps": 0, "clip_norm": 0.0},
        "train": {"steps": 78200, "batch_size": 128, "eval_every": 3910},
    },
}


register(Method(
    name="rotation",
    model_config=ResNetConfig,
    example_config=ImageExampleConfig,
    objective_config=RotationSettings,
    build_model=build_rotation,
    loss=rotation_loss,
    prepare=prepare_two_view_images,
    units_per_example=lambda examples: 4,
    unit="images",
    description="RotNet: predict which of 4 rotations an image went through "
                "(Gidaris et al. 2018)",
    presets=PRESETS,
    resolution=Resolution(check=check_host_crops),
    evaluation=Evaluation(monitor=knn_monitor, summarize=knn_summary(("loss", "accuracy"))),
))
