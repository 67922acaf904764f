"""SimCLR pre-training objective (Chen et al. 2020): two augmented views of every image, one
ResNet + projection head over both (BatchNorm statistics over the 2N views of the global
batch), NT-Xent with negatives from the whole global batch.

Reference: google-research/simclr tf2/run.py, tf2/model.py, tf2/objective.py. The host delivers
uint8 images (whole, or for images of many sizes two host crops per image); the augmentations
run here, inside the jitted step, one key per view.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.input_pipeline import image_augment
from pretext_jax.input_pipeline.errors import UserError
from pretext_jax.input_pipeline.images import HostCrop, prepare_images
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.models.simclr import SimCLR, SimCLRConfig
from pretext_jax.objectives.contrastive import nt_xent
from pretext_jax.objectives.evaluation import extract_features, knn_accuracy
from pretext_jax.objectives.preset_parts import TINY_IMAGE_TRAIN
from pretext_jax.objectives.registry import Batch, Method, Metrics, PreparedData, register

# Held-out evaluation has no step rng; its views come from this fixed key.
EVAL_AUGMENT_SEED = 0


@dataclasses.dataclass(frozen=True)
class SimCLRLossSettings:
    """The `objective` section: NT-Xent's temperature (0.1 ImageNet, 0.5 CIFAR)."""

    temperature: float = 0.1
    """NT-Xent temperature, > 0 (SimCLR 0.1 ImageNet, 0.5 CIFAR-10)."""

    def __post_init__(self) -> None:
        if self.temperature <= 0.0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (SimCLR: 0.1 or 0.5)")


@dataclasses.dataclass(frozen=True)
class SimCLRObjectiveConfig(SimCLRConfig):
    """The network (`SimCLRConfig`) plus the views it is trained on: their size and the
    augmentation settings (`image_augment.AugmentConfig`, flattened so each is a `model.*`
    override; SimCLR treats the augmentations as part of the method, and the kNN monitor
    evaluates at `image_size`)."""

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
        if not 0.0 < self.crop_area_min <= 1.0:
            raise ValueError(f"crop_area_min={self.crop_area_min} must be in (0, 1]")

    def augment_config(self, crop: bool = True) -> image_augment.AugmentConfig:
        return image_augment.AugmentConfig(
            image_size=self.image_size, crop=crop,
            crop_window=image_augment.CropConfig(area=(self.crop_area_min, 1.0)),
            jitter_strength=self.jitter_strength, blur_probability=self.blur_probability)


@dataclasses.dataclass(frozen=True)
class ImageExampleConfig:
    """How images reach the device and how they are evaluated.

    `host_crop_size` > 0: decode on the host and deliver two random crops per image at that
    size (area `host_crop_area_min`..1), as data_util.py's ImageNet pipeline crops before
    anything else; must equal `model.image_size`. 0: images (all one size, e.g. CIFAR) go
    whole and are cropped on device. Held-out images are centre crops
    (`eval_crop_proportion`, 0.875 as data_util.py) when cropped on the host. The kNN monitor
    uses a bank of the first `knn_bank_size` training images, `knn_k` neighbours and vote
    temperature `knn_temperature` (solo-learn / lightly: k 200, temperature 0.1) against at
    most `max_eval_examples` held-out images.
    """

    host_crop_size: int = 0
    """Host-made crops: two per image, of this side (= model.image_size); 0 = whole images."""
    host_crop_area_min: float = 0.08
    """Smallest area fraction of a host crop (SimCLR 0.08; MoCo/BYOL: = model.crop_area_min)."""
    eval_crop_proportion: float = 0.875
    """Centre-crop fraction of held-out images cropped on the host (SimCLR 0.875)."""
    max_eval_examples: int = 10000
    """Most held-out images kept for evaluation and the kNN monitor."""
    knn_bank_size: int = 10000
    """Training images (the first n) in the kNN monitor's feature bank."""
    knn_k: int = 200
    """Neighbours voting in the kNN monitor (solo-learn, lightly: 200)."""
    knn_temperature: float = 0.1
    """Temperature of the kNN monitor's similarity-weighted vote (0.1)."""

    def host_crop(self) -> HostCrop:
        return HostCrop(size=self.host_crop_size,
                        window=image_augment.CropConfig(area=(self.host_crop_area_min, 1.0)),
                        eval_proportion=self.eval_crop_proportion)


def two_views(rng: jax.Array | None, images: jax.Array,
              augment: Callable[[bool], tuple[image_augment.AugmentConfig,
                                              image_augment.AugmentConfig]]
              ) -> tuple[jax.Array, jax.Array]:
    """Two augmented views of every image (shared by the image methods): `images` are whole
    [B, H, W, 3] uint8 images (cropped on device) or [B, 2, S, S, 3] host crops;
    `augment(crop)` gives the two views' settings. `rng=None` (evaluation) uses fixed views."""
    key = rng if rng is not None else jax.random.key(EVAL_AUGMENT_SEED)
    first_key, second_key = jax.random.split(key)
    if images.ndim == 5:  # [B, 2, S, S, 3]: two crops made on the host
        first, second = augment(False)
        firsts, seconds = images[:, 0], images[:, 1]
    else:
        first, second = augment(True)
        firsts = seconds = images
    return (image_augment.augment_batch(first_key, firsts, first),
            image_augment.augment_batch(second_key, seconds, second))


def simclr_loss(model: SimCLR, batch: Batch, rng: jax.Array | None, *,
                objective: SimCLRLossSettings | None = None) -> tuple[jax.Array, Metrics]:
    """NT-Xent of two views of every image (`objective` None: temperature 0.1); `rng=None`
    (evaluation) uses fixed views and the BatchNorm running statistics."""
    objective = objective or SimCLRLossSettings()
    config: SimCLRObjectiveConfig = model.config
    views = jnp.concatenate(two_views(rng, batch["image"],
                                      lambda crop: (config.augment_config(crop),) * 2))
    projections = model(views, train=rng is not None).projections
    first, second = jnp.split(projections, 2)
    loss, metrics = nt_xent(first, second, objective.temperature)
    return loss, {"loss": (loss, jnp.ones((), jnp.float32)), **metrics}


def evaluation_view(images: jax.Array, size: int) -> jax.Array:
    """The un-augmented input: [0, 1] floats at the training resolution."""
    images = image_augment.to_float(images)
    if images.shape[1:3] != (size, size):
        images = jax.image.resize(images, (images.shape[0], size, size, 3), "linear")
    return images


@nnx.jit
def backbone_features(model: nnx.Module, images: jax.Array) -> jax.Array:
    """The backbone's evaluation-mode features of uint8 images (centre view); module-level so
    every evaluation reuses the compiled function. Any image model with a `backbone` and
    `config.image_size` (SimCLR, MoCo, BYOL)."""
    return model.backbone(evaluation_view(images, model.config.image_size), train=False)


def knn_monitor(model: nnx.Module, data: PreparedData, examples: ImageExampleConfig
                ) -> dict[str, float]:
    """Held-out kNN accuracy of the backbone's features against a labelled training bank."""
    bank = data.train.examples(range(min(len(data.train), examples.knn_bank_size)))
    if (bank["label"] < 0).any() or (data.eval["label"] < 0).any():
        return {}  # unlabelled images: nothing to vote with
    features = [extract_features(lambda x: backbone_features(model, x), images)
                for images in (bank["image"], data.eval["image"])]
    num_classes = int(max(bank["label"].max(), data.eval["label"].max())) + 1
    return {"knn_accuracy": knn_accuracy(features[0], bank["label"], features[1],
                                         data.eval["label"], num_classes, examples.knn_k,
                                         examples.knn_temperature)}


def build_simclr(config: SimCLRObjectiveConfig, seed: int) -> SimCLR:
    with nnx.use_eager_sharding(False):
        return SimCLR(config, rngs=nnx.Rngs(seed))


def prepare_simclr(data: DataConfig, examples: ImageExampleConfig, cache_dir: Path,
                   seed: int) -> PreparedData:
    """Training images for the loader and the held-out images in memory
    (`input_pipeline.images.prepare_images`)."""
    train, held_out = prepare_images(
        data.source, data.eval_source, cache_dir, examples.max_eval_examples,
        crop=examples.host_crop(), held_out_fraction=data.held_out_fraction, seed=seed,
        tfds_split=data.tfds_split, tfds_data_dir=data.tfds_data_dir or None)
    return PreparedData(train=train, eval=held_out)


def check_simclr(model: SimCLRObjectiveConfig, examples: ImageExampleConfig) -> None:
    if examples.host_crop_size and examples.host_crop_size != model.image_size:
        raise UserError(f"examples.host_crop_size={examples.host_crop_size} must equal "
                        f"model.image_size={model.image_size}; set both to the same size")
    if not 0.0 < examples.host_crop_area_min <= 1.0:
        raise UserError(f"examples.host_crop_area_min={examples.host_crop_area_min} must be in "
                        "(0, 1], e.g. 0.08")


_LARS_COSINE = {"optimizer": "lars", "schedule": "cosine", "clip_norm": 0.0}

PRESETS = {
    # SimCLR on CIFAR-10 (simclr tf2 README command): ResNet-18 with the CIFAR stem, batch 512,
    # 1000 epochs (97,656 steps) with 10 of warmup, LARS lr 1.0 x 512/256, weight decay 1e-4,
    # temperature 0.5, jitter strength 0.5, no blur.
    "simclr_tiny": {
        "model": {"depth": 18, "stem": "cifar", "base_width": 8, "image_size": 32,
                  "jitter_strength": 0.5, "blur_probability": 0.0},
        "objective": {"temperature": 0.5},
        "optim": {**_LARS_COSINE, "learning_rate": 0.5, "warmup_steps": 10, "weight_decay": 1e-4},
        "train": TINY_IMAGE_TRAIN,
    },
    "simclr_cifar10": {
        "model": {"depth": 18, "stem": "cifar", "image_size": 32, "jitter_strength": 0.5,
                  "blur_probability": 0.0},
        "objective": {"temperature": 0.5},
        "data": {"source": ""},
        "optim": {**_LARS_COSINE, "learning_rate": 2.0, "warmup_steps": 977,
                  "weight_decay": 1e-4},
        "train": {"steps": 97656, "batch_size": 512, "eval_every": 2000},
    },
    # The offline image demo: scikit-learn's 1,797 scanned 8x8 digits, upsampled to 16 px by the
    # random resized crop, a narrow ResNet-18 with the CIFAR stem, CIFAR's augmentation settings.
    "simclr_digits": {
        "model": {"depth": 18, "stem": "cifar", "base_width": 16, "image_size": 16,
                  "jitter_strength": 0.5, "blur_probability": 0.0},
        "objective": {"temperature": 0.5},
        "examples": {"knn_k": 20},
        "data": {"source": "digits", "held_out_fraction": 0.2},
        "optim": {**_LARS_COSINE, "learning_rate": 1.0, "warmup_steps": 20, "weight_decay": 1e-4},
        "train": {"steps": 400, "batch_size": 256, "log_every": 25, "eval_every": 100,
                  "checkpoint_every": 200, "eval_batches": 1},
    },
    # SimCLR on ImageNet (Chen et al. 2020, Appendix B.1): ResNet-50, batch 4096, 100 epochs of
    # 1,281,167 images (31,278 steps) with 10 of warmup, LARS lr 4.8 (= 0.3 x 4096/256), weight
    # decay 1e-6, temperature 0.1, jitter strength 1.0, blur p 0.5; two random crops per image
    # made on the host, the rest of the augmentation on device.
    "simclr_imagenet": {
        "model": {"depth": 50, "stem": "imagenet", "image_size": 224, "dtype": "bfloat16",
                  "jitter_strength": 1.0, "blur_probability": 0.5},
        "objective": {"temperature": 0.1},
        "examples": {"host_crop_size": 224},
        "data": {"source": "tfds:imagenet2012", "worker_count": 16},
        "optim": {**_LARS_COSINE, "learning_rate": 4.8, "warmup_steps": 3128,
                  "weight_decay": 1e-6},
        "train": {"steps": 31278, "batch_size": 4096, "eval_every": 5000},
    },
}


register(Method(
    name="simclr",
    model_config=SimCLRObjectiveConfig,
    example_config=ImageExampleConfig,
    objective_config=SimCLRLossSettings,
    build_model=build_simclr,
    loss=simclr_loss,
    prepare=prepare_simclr,
    check=check_simclr,
    units_per_example=lambda examples: 2,
    monitor=knn_monitor,
    unit="views",
    description="SimCLR: NT-Xent between two augmented views (Chen et al. 2020)",
    presets=PRESETS,
))
