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
from pretext_jax.models.resnet import ResNet
from pretext_jax.models.simclr import SimCLR, SimCLRConfig
from pretext_jax.objectives.common.contrastive import nt_xent
from pretext_jax.objectives.common.preset_parts import TINY_IMAGE_TRAIN
from pretext_jax.objectives.common.two_view import (
    ImageExampleConfig,
    ViewSettings,
    check_host_crops,
    knn_monitor,
    knn_summary,
    prepare_two_view_images,
    two_views,
)
from pretext_jax.objectives.registry import (
    Batch,
    Evaluation,
    Method,
    Metrics,
    Resolution,
    Start,
    register,
)


@dataclasses.dataclass(frozen=True)
class SimCLRLossSettings(ViewSettings):
    """The `objective` section: NT-Xent's temperature (0.1 ImageNet, 0.5 CIFAR) and the views
    it is computed on (`ViewSettings` and data_util.py's augmentation, both views alike:
    `image_augment.AugmentConfig` with the colour-jitter strength and blur probability here;
    SimCLR treats the augmentations as part of the method)."""

    temperature: float = 0.1
    """NT-Xent temperature, > 0 (SimCLR 0.1 ImageNet, 0.5 CIFAR-10)."""
    jitter_strength: float = 1.0
    """Colour-jitter strength s (amounts 0.8 s, hue 0.2 s): SimCLR 1.0 ImageNet, 0.5 CIFAR."""
    blur_probability: float = 0.5
    """Probability of Gaussian blur per view (SimCLR 0.5 on ImageNet; none on CIFAR)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.temperature <= 0.0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (SimCLR: 0.1 or 0.5)")

    def augment_config(self, crop: bool = True) -> image_augment.AugmentConfig:
        """The augmentation of either view (`crop=False`: the host cropped)."""
        return image_augment.AugmentConfig(
            image_size=self.image_size, crop=crop, crop_window=self.crop_window(),
            jitter_strength=self.jitter_strength, blur_probability=self.blur_probability)

    def view_augmentations(self, crop: bool = True
                           ) -> tuple[image_augment.AugmentConfig, image_augment.AugmentConfig]:
        return (self.augment_config(crop),) * 2


def simclr_loss(model: SimCLR, batch: Batch, rng: jax.Array | None, *,
                objective: SimCLRLossSettings | None = None) -> tuple[jax.Array, Metrics]:
    """NT-Xent of two views of every image (`objective` None: ImageNet's settings); `rng=None`
    (evaluation) uses fixed views and the BatchNorm running statistics."""
    objective = objective or SimCLRLossSettings()
    views = jnp.concatenate(two_views(rng, batch["image"], objective.view_augmentations))
    projections = model(views, train=rng is not None).projections
    first, second = jnp.split(projections, 2)
    loss, metrics = nt_xent(first, second, objective.temperature)
    return loss, {"loss": (loss, jnp.ones((), jnp.float32)), **metrics}


def build_simclr(config: SimCLRConfig, seed: int) -> SimCLR:
    with nnx.use_eager_sharding(False):
        return SimCLR(config, rngs=nnx.Rngs(seed))


_LARS_COSINE = {"optimizer": "lars", "schedule": "cosine", "clip_norm": 0.0}

PRESETS = {
    # SimCLR on CIFAR-10 (simclr tf2 README command): ResNet-18 with the CIFAR stem, batch 512,
    # 1000 epochs (97,656 steps) with 10 of warmup, LARS lr 1.0 x 512/256, weight decay 1e-4,
    # temperature 0.5, jitter strength 0.5, no blur.
    "simclr_tiny": {
        "model": {"depth": 18, "stem": "cifar", "base_width": 8},
        "objective": {"temperature": 0.5, "image_size": 32, "jitter_strength": 0.5,
                      "blur_probability": 0.0},
        "optim": {**_LARS_COSINE, "learning_rate": 0.5, "warmup_steps": 10, "weight_decay": 1e-4},
        "train": TINY_IMAGE_TRAIN,
    },
    "simclr_cifar10": {
        "model": {"depth": 18, "stem": "cifar"},
        "objective": {"temperature": 0.5, "image_size": 32, "jitter_strength": 0.5,
                      "blur_probability": 0.0},
        "data": {"source": ""},
        "optim": {**_LARS_COSINE, "learning_rate": 2.0, "warmup_steps": 977,
                  "weight_decay": 1e-4},
        "train": {"steps": 97656, "batch_size": 512, "eval_every": 2000},
    },
    # The offline image demo: scikit-learn's 1,797 scanned 8x8 digits at their own 8 px, a
    # narrow ResNet-10 with the CIFAR stem, CIFAR's augmentation settings but crops of at least
    # 40% of a digit (SimCLR's 8% leave a few pixels of a digit this small), 200 steps of 256
    # (about 36 passes over the 1,438 training digits). With every label, random features of
    # 8x8 digits already vote well (kNN about 0.90), so the monitor also fits a linear probe to
    # 10 labelled digits per class, where the gain over the untrained network shows.
    "simclr_digits": {
        "model": {"depth": 10, "stem": "cifar", "base_width": 16},
        "objective": {"temperature": 0.5, "image_size": 8, "crop_area_min": 0.4,
                      "jitter_strength": 0.5, "blur_probability": 0.0},
        "examples": {"knn_k": 20, "probe_labels_per_class": 10},
        "data": {"source": "digits", "held_out_fraction": 0.2},
        "optim": {**_LARS_COSINE, "learning_rate": 1.0, "warmup_steps": 10, "weight_decay": 1e-4},
        "train": {"steps": 200, "batch_size": 256, "log_every": 20, "eval_every": 100,
                  "checkpoint_every": 100, "eval_batches": 1},
    },
    # SimCLR on ImageNet (Chen et al. 2020, Appendix B.1): ResNet-50, batch 4096, 100 epochs of
    # 1,281,167 images (31,278 steps) with 10 of warmup, LARS lr 4.8 (= 0.3 x 4096/256), weight
    # decay 1e-6, temperature 0.1, jitter strength 1.0, blur p 0.5; two random crops per image
    # made on the host, the rest of the augmentation on device.
    "simclr_imagenet": {
        "model": {"depth": 50, "stem": "imagenet", "dtype": "bfloat16"},
        "objective": {"temperature": 0.1, "image_size": 224, "jitter_strength": 1.0,
                      "blur_probability": 0.5},
        "examples": {"host_crop_size": 224},
        "data": {"source": "tfds:imagenet2012", "worker_count": 16},
        "optim": {**_LARS_COSINE, "learning_rate": 4.8, "warmup_steps": 3128,
                  "weight_decay": 1e-6},
        "train": {"steps": 31278, "batch_size": 4096, "eval_every": 5000},
    },
}


register(Method(
    name="simclr",
    model_config=SimCLRConfig,
    example_config=ImageExampleConfig,
    objective_config=SimCLRLossSettings,
    build_model=build_simclr,
    loss=simclr_loss,
    prepare=prepare_two_view_images,
    units_per_example=lambda examples: 2,
    unit="views",
    description="SimCLR: NT-Xent between two augmented views (Chen et al. 2020)",
    presets=PRESETS,
    resolution=Resolution(check=check_host_crops),
    evaluation=Evaluation(monitor=knn_monitor,
                          summarize=knn_summary(("loss", "contrastive_accuracy"))),
    start=Start(hf_models=(ResNet,)),
))
