"""Pieces shared by the two-view image methods (SimCLR, MoCo, BYOL): how images reach the device
(`ImageExampleConfig`, `prepare_two_view_images`), two augmented views of every image inside
the step (`two_views`; the `objective` settings of the views in `ViewSettings`, MoCo's and
BYOL's per-view ones in `TwoViewAugmentation`), the checks of host crops against the views, and
the kNN monitor of the backbone's features.

Reference: google-research/simclr tf2/data_util.py (views and crops), facebookresearch/moco
main_moco.py (`--aug-plus`), deepmind byol utils/augmentations.py; the kNN monitor as
solo-learn's and lightly's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import image_augment
from pretext_jax.input_pipeline.images import HostCrop, prepare_images
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.objectives.common.evaluation import (
    extract_features,
    knn_accuracy,
    linear_probe_accuracy,
)
from pretext_jax.objectives.registry import PreparedData, Summarize, summary_of

# Held-out evaluation has no step rng; its views come from this fixed key.
EVAL_AUGMENT_SEED = 0
# The few-label probe's labelled images are drawn with this seed.
PROBE_LABELS_SEED = 0


@dataclasses.dataclass(frozen=True)
class ImageExampleConfig:
    """How images reach the device and how they are evaluated.

    `host_crop_size` > 0: decode on the host and deliver two random crops per image at that
    size (area `host_crop_area_min`..1), as data_util.py's ImageNet pipeline crops before
    anything else; must equal `objective.image_size`. 0: images (all one size, e.g. CIFAR) go
    whole and are cropped on device. Held-out images are centre crops
    (`eval_crop_proportion`, 0.875 as data_util.py) when cropped on the host. The kNN monitor
    uses a bank of the first `knn_bank_size` training images, `knn_k` neighbours and vote
    temperature `knn_temperature` (solo-learn / lightly: k 200, temperature 0.1) against at
    most `max_eval_examples` held-out images; with `probe_labels_per_class` > 0 it also fits a
    linear probe to the features of that many labelled bank images per class (a few-label
    evaluation, for data where every label makes even random features look good).
    `skip_unreadable_images`: an image folder's images are each decoded once before training
    (remembered in the data cache per set of files) and those Pillow cannot read are left out
    and listed; otherwise the first unreadable image stops the run, naming its file.
    """

    host_crop_size: int = 0
    """Host-made crops: two per image, of this side (= objective.image_size); 0 = whole."""
    host_crop_area_min: float = 0.08
    """Smallest area fraction of a host crop (SimCLR 0.08; MoCo/BYOL = objective.crop_area_min)."""
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
    probe_labels_per_class: int = 0
    """Labelled bank images per class (a seeded draw) for the monitor's linear probe; 0: none."""
    skip_unreadable_images: bool = False
    """Image folders: decode every image once first and leave out those Pillow cannot read."""

    def __post_init__(self) -> None:
        if self.probe_labels_per_class < 0:
            raise ValueError(f"probe_labels_per_class={self.probe_labels_per_class} must be >= 0 "
                             "(0: no few-label probe)")

    def host_crop(self) -> HostCrop:
        return HostCrop(size=self.host_crop_size,
                        window=image_augment.CropConfig(area=(self.host_crop_area_min, 1.0)),
                        eval_proportion=self.eval_crop_proportion)


@dataclasses.dataclass(frozen=True)
class ViewSettings:
    """What every two-view method's `objective` section says about its views: their side
    `image_size` (host crops must match it; the kNN monitor evaluates at it) and the random
    resized crop's smallest area `crop_area_min` (TensorFlow's crop sampler, see
    `image_augment`). A method's settings extend it with its augmentations, flat so that each is
    an `objective.*` override, and say in `view_augmentations` how they make the two views."""

    image_size: int = 224
    """Side of the augmented views in pixels (ImageNet 224, CIFAR 32)."""
    crop_area_min: float = 0.08
    """Smallest area fraction of the random resized crop, in (0, 1] (SimCLR, BYOL 0.08)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.crop_area_min <= 1.0:
            raise ValueError(f"crop_area_min={self.crop_area_min} must be in (0, 1]")

    def crop_window(self) -> image_augment.CropConfig:
        return image_augment.CropConfig(area=(self.crop_area_min, 1.0))

    def crop_and_flip(self, crop: bool = True) -> image_augment.AugmentConfig:
        """Random resized crop (`crop=False`: the host cropped) and flip, no colour change
        (torchvision RandomResizedCrop + RandomHorizontalFlip: DeepCluster, CMC)."""
        return image_augment.AugmentConfig(
            image_size=self.image_size, crop=crop, crop_window=self.crop_window(),
            jitter_probability=0.0, grayscale_probability=0.0, blur_probability=0.0)

    def view_augmentations(self, crop: bool = True
                           ) -> tuple[image_augment.AugmentConfig, image_augment.AugmentConfig]:
        """The first and second view's augmentations (`crop=False`: the host cropped)."""
        raise NotImplementedError(f"{type(self).__name__} defines no view_augmentations")


@dataclasses.dataclass(frozen=True)
class TwoViewAugmentation(ViewSettings):
    """Views with their own blur and solarisation probabilities (MoCo, BYOL). Defaults are
    MoCo v2's (main_moco.py `--aug-plus`): random resized crop of area `crop_area_min`..1
    (torchvision's RandomResizedCrop(scale=(0.2, 1)) draws the aspect log-uniformly), colour
    jitter (`brightness`, `contrast`, `saturation`, `hue`) = torchvision ColorJitter(0.4, 0.4,
    0.4, 0.1) with p 0.8, grayscale p 0.2, Gaussian blur (sigma 0.1-2) with p
    `blur_probability` for the first view and `second_blur_probability` for the second, flip;
    solarisation with p `solarize_probability` / `second_solarize_probability` (BYOL)."""

    crop_area_min: float = 0.2
    """Smallest area fraction of the random resized crop, in (0, 1] (MoCo v2 0.2, BYOL 0.08)."""
    brightness: float = 0.4
    """Colour-jitter brightness amount b (MoCo v2 and BYOL 0.4)."""
    contrast: float = 0.4
    """Colour-jitter contrast amount (MoCo v2 and BYOL 0.4)."""
    saturation: float = 0.4
    """Colour-jitter saturation amount (MoCo v2 0.4, BYOL 0.2)."""
    hue: float = 0.1
    """Colour-jitter hue amount, in [0, 0.5] (MoCo v2 and BYOL 0.1)."""
    additive_brightness: bool = False
    """Shift brightness by U(-b, b) instead of scaling it by U(1 - b, 1 + b) (BYOL true)."""
    blur_probability: float = 0.5
    """Probability of Gaussian blur on the first view (MoCo v2 0.5, BYOL 1.0)."""
    second_blur_probability: float = 0.5
    """Probability of Gaussian blur on the second view (MoCo v2 0.5, BYOL 0.1)."""
    solarize_probability: float = 0.0
    """Probability of solarisation on the first view (MoCo 0, BYOL 0)."""
    second_solarize_probability: float = 0.0
    """Probability of solarisation on the second view (MoCo 0, BYOL 0.2)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("blur_probability", "second_blur_probability", "solarize_probability",
                     "second_solarize_probability"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1]")
        if min(self.brightness, self.contrast, self.saturation, self.hue) < 0 or self.hue > 0.5:
            raise ValueError("brightness, contrast, saturation must be >= 0 and hue in [0, 0.5]")

    def view_augmentations(self, crop: bool = True
                           ) -> tuple[image_augment.AugmentConfig, image_augment.AugmentConfig]:
        def view(blur: float, solarize: float) -> image_augment.AugmentConfig:
            return image_augment.AugmentConfig(
                image_size=self.image_size, crop=crop, crop_window=self.crop_window(),
                jitter=(self.brightness, self.contrast, self.saturation, self.hue),
                additive_brightness=self.additive_brightness, blur_probability=blur,
                solarize_probability=solarize)

        return (view(self.blur_probability, self.solarize_probability),
                view(self.second_blur_probability, self.second_solarize_probability))


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


def single_view(images: jax.Array) -> jax.Array:
    """One image per example for the single-view methods (rotation, jigsaw): whole [B, H, W, 3]
    images as they are, of host crops [B, 2, S, S, 3] the first."""
    return images[:, 0] if images.ndim == 5 else images


def cropped_and_flipped(rng: jax.Array, images: jax.Array, settings: ViewSettings
                        ) -> jax.Array:
    """One randomly cropped and flipped view [B, S, S, 3] in [0, 1] of every image
    (`ViewSettings.crop_and_flip`): of whole uint8 images, or of the first host crop."""
    return image_augment.augment_batch(rng, single_view(images),
                                       settings.crop_and_flip(crop=images.ndim != 5))


def evaluation_view(images: jax.Array, size: int) -> jax.Array:
    """The un-augmented input: [0, 1] floats at the training resolution."""
    images = image_augment.to_float(images)
    if images.shape[1:3] != (size, size):
        images = jax.image.resize(images, (images.shape[0], size, size, 3), "linear")
    return images


@functools.partial(nnx.jit, static_argnames="size")
def backbone_features(model: nnx.Module, images: jax.Array, size: int) -> jax.Array:
    """The backbone's evaluation-mode features of uint8 images (centre view) at the views' side
    `size` (`objective.image_size`); module-level so every evaluation reuses the compiled
    function. Any image model with a `backbone` (SimCLR, MoCo, BYOL)."""
    return model.backbone(evaluation_view(images, size), train=False)


def labelled_subset(labels: np.ndarray, count: int) -> np.ndarray:
    """Sorted indices of `count` entries of every class in `labels` (all of a smaller class),
    drawn with a fixed seed (`PROBE_LABELS_SEED`): the same images at every evaluation."""
    rng = np.random.default_rng(PROBE_LABELS_SEED)
    return np.sort(np.concatenate([rng.permutation(np.flatnonzero(labels == label))[:count]
                                   for label in np.unique(labels)]))


def knn_monitor(model: nnx.Module, data: PreparedData, examples: ImageExampleConfig,
                objective: ViewSettings) -> dict[str, float]:
    """Held-out kNN accuracy of the backbone's features (at `objective.image_size`) against a
    labelled training bank, and with `examples.probe_labels_per_class` the held-out accuracy
    of a linear probe fitted to that many bank images per class."""
    bank = data.train.examples(range(min(len(data.train), examples.knn_bank_size)))
    if (bank["label"] < 0).any() or (data.eval["label"] < 0).any():
        return {}  # unlabelled images: nothing to vote with
    bank_features, held_out_features = (
        extract_features(lambda x: backbone_features(model, x, objective.image_size), images,
                         description=description)
        for images, description in ((bank["image"], "kNN bank features"),
                                    (data.eval["image"], "held-out features")))
    num_classes = int(max(bank["label"].max(), data.eval["label"].max())) + 1
    results = {"knn_accuracy": knn_accuracy(bank_features, bank["label"], held_out_features,
                                            data.eval["label"], num_classes, examples.knn_k,
                                            examples.knn_temperature)}
    if examples.probe_labels_per_class:
        labelled = labelled_subset(bank["label"], examples.probe_labels_per_class)
        results["few_label_probe_accuracy"] = linear_probe_accuracy(
            bank_features[labelled], bank["label"][labelled], held_out_features,
            data.eval["label"], num_classes)
    return results


def prepare_two_view_images(data: DataConfig, examples: ImageExampleConfig, cache_dir: Path,
                             seed: int) -> PreparedData:
    """Training images for the loader and the held-out images in memory
    (`input_pipeline.images.prepare_images`)."""
    train, held_out = prepare_images(
        data.source, data.eval_source, cache_dir, examples.max_eval_examples,
        crop=examples.host_crop(), held_out_fraction=data.held_out_fraction, seed=seed,
        tfds_split=data.tfds_split, tfds_data_dir=data.tfds_data_dir or None,
        skip_unreadable=examples.skip_unreadable_images)
    report = ({"probe_labels_per_class": examples.probe_labels_per_class}
              if examples.probe_labels_per_class else {})
    return PreparedData(train=train, eval=held_out, report=report)


def check_host_crops(model: Any, examples: ImageExampleConfig, objective: ViewSettings
                     ) -> None:
    """Host crops of the views' size (`objective.image_size`) and a valid area range."""
    del model  # the views' settings are the objective's
    if examples.host_crop_size and examples.host_crop_size != objective.image_size:
        raise UserError(f"examples.host_crop_size={examples.host_crop_size} must equal "
                        f"objective.image_size={objective.image_size}; set both to the same "
                        "size")
    if not 0.0 < examples.host_crop_area_min <= 1.0:
        raise UserError(f"examples.host_crop_area_min={examples.host_crop_area_min} must be in "
                        "(0, 1], e.g. 0.08")


def check_two_view_method(model: Any, examples: ImageExampleConfig, objective: ViewSettings
                          ) -> None:
    """`check_host_crops`, and host crops drawn from the same area range as the views'
    augmentation (MoCo, BYOL, CMC)."""
    check_host_crops(model, examples, objective)
    if examples.host_crop_size and examples.host_crop_area_min != objective.crop_area_min:
        raise UserError(f"examples.host_crop_area_min={examples.host_crop_area_min} differs from "
                        f"objective.crop_area_min={objective.crop_area_min}; set both to the "
                        "same value")


def knn_summary(metrics: tuple[str, ...] = ("loss",)) -> Summarize:
    """`summary_of(metrics=...)` and the kNN accuracy of the backbone's features (and the
    few-label probe's, if the monitor fitted one) beside the same network's at its random
    initialisation."""
    held_out = summary_of(metrics=metrics)

    def summarize(evaluation: dict[str, float], report: dict[str, Any],
                  untrained: Callable[[], dict[str, float]]) -> list[str]:
        lines = held_out(evaluation, report, untrained)
        baseline = functools.cache(untrained)  # one untrained evaluation for every line
        described = {"knn_accuracy": "kNN accuracy of the backbone's features",
                     "few_label_probe_accuracy": "accuracy of a linear probe on the backbone's "
                     f"features fitted to {report.get('probe_labels_per_class')} labelled "
                     "training images per class"}
        for key, description in described.items():
            if key in evaluation:
                lines.append(f"  held-out {description} {evaluation[key]:.3f} vs "
                             f"{baseline()[key]:.3f} for the same network untrained")
        return lines

    return summarize
