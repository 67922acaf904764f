"""AMDIM (Bachman, Hjelm & Buchwalter 2019 "Learning Representations by Maximizing Mutual
Information Across Views", §3; Philip-Bachman/amdim-public costs.py `NCE_MI_MULTI`,
`LossMultiNCE`, model.py, datasets.py, task_self_supervised.py).

Two augmented views of every image go through the encoder (`models.infomax.AMDIM`), which
gives embeddings at three scales: the 1x1 global feature r1, and the 5x5 and 7x7 maps r5, r7.
Each view's sources predict the other view's targets with the NCE bound:

- 1 -> 5 and 1 -> 7: r1 of view A against every location of r5 / r7 of view B;
- 5 -> 5: one location of r5 of view A, drawn uniformly per image, against every location of
  r5 of view B (`LossMultiNCE._sample_src_ftr`);

both directions, each pair's loss the mean of the two. A source of image i scores every target
location of every image j: s[i, j, l] = src_i . trg_{j, l} / sqrt(n_rkhs), soft-clipped to
tclip tanh(s / tclip); each positive (j = i, location l) is a softmax over itself and all
locations of the other images (shared negatives), and the NCE loss is the mean over (i, l) of
its negative log-probability. The regulariser `logit_penalty` x mean(s^2) (before clipping) of
each of the six score sets is added with weight 1/2, as `NCE_MI_MULTI.forward`. The training
loss is 1->5 + 1->7 + 5->5 + the regulariser (task_self_supervised.py; its online evaluation
classifiers are left out: the kNN monitor and bench/image_cifar10.py evaluate instead).

Views (datasets.py `TransformsC10`): one horizontal flip per image shared by both views, then
per view a translation of up to `translate` pixels with reflected borders (p 0.8), colour
jitter (0.4, 0.4, 0.4, hue 0.2; p 0.8) and grayscale (p 0.25). `translate=0` uses the STL-10 /
ImageNet pipeline's random resized crop instead (area `crop_area_min`..1, aspect 0.7-1.4, our
TensorFlow-style crop sampler in place of torchvision's). Inputs stay in [0, 1] (the reference
normalises by the dataset's mean and std).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import image_augment
from pretext_jax.models.infomax import AMDIM, AMDIMConfig, AMDIMEncoder
from pretext_jax.objectives.common.preset_parts import TINY_IMAGE_TRAIN
from pretext_jax.objectives.common.two_view import (
    EVAL_AUGMENT_SEED,
    ImageExampleConfig,
    evaluation_view,
    knn_monitor,
    knn_summary,
    prepare_two_view_images,
)
from pretext_jax.objectives.registry import Batch, Evaluation, Method, Metrics, Resolution, register

ASPECT = (0.7, 1.4)  # datasets.py RandomResizedCrop(ratio=(0.7, 1.4))


@dataclasses.dataclass(frozen=True)
class AMDIMSettings:
    """The `objective` section: the views (module docstring; datasets.py `TransformsC10`) and
    the NCE settings (costs.py)."""

    image_size: int = 32
    """Side of the views: 32, the side amdim-public's 32x32 encoder takes."""
    translate: int = 4
    """Largest shift of the reflected translation, in pixels (CIFAR 4); 0 = random crop."""
    translate_probability: float = 0.8
    """Probability of the translation per view (datasets.py 0.8)."""
    crop_area_min: float = 0.3
    """With translate 0: smallest area of the random resized crop (STL-10, ImageNet 0.3)."""
    brightness: float = 0.4
    """Colour-jitter brightness amount (AMDIM 0.4)."""
    contrast: float = 0.4
    """Colour-jitter contrast amount (AMDIM 0.4)."""
    saturation: float = 0.4
    """Colour-jitter saturation amount (AMDIM 0.4)."""
    hue: float = 0.2
    """Colour-jitter hue amount, in [0, 0.5] (CIFAR and STL-10 0.2, ImageNet 0.1)."""
    grayscale_probability: float = 0.25
    """Probability of grayscale per view (AMDIM 0.25)."""
    tclip: float = 20.0
    """Soft clip of the scores, tclip tanh(s / tclip), > 0 (train.py --tclip 20)."""
    logit_penalty: float = 0.05
    """Weight of the mean squared raw score of each score set (costs.py 5e-2)."""

    def __post_init__(self) -> None:
        if self.translate < 0 or not 0.0 < self.crop_area_min <= 1.0:
            raise ValueError("translate must be >= 0 and crop_area_min in (0, 1]")
        if not 0.0 <= self.translate_probability <= 1.0 or not (
                0.0 <= self.grayscale_probability <= 1.0):
            raise ValueError("translate_probability and grayscale_probability must be in "
                             "[0, 1]")
        if min(self.brightness, self.contrast, self.saturation, self.hue) < 0 or self.hue > 0.5:
            raise ValueError("brightness, contrast, saturation must be >= 0 and hue in [0, 0.5]")
        if self.tclip <= 0 or self.logit_penalty < 0:
            raise ValueError("tclip must be > 0 and logit_penalty >= 0")

    def augment_config(self) -> image_augment.AugmentConfig:
        """Each view's crop (translate 0), jitter and grayscale; the flip is shared."""
        return image_augment.AugmentConfig(
            image_size=self.image_size, crop=self.translate == 0,
            crop_window=image_augment.CropConfig(area=(self.crop_area_min, 1.0), aspect=ASPECT),
            flip=False, jitter=(self.brightness, self.contrast, self.saturation, self.hue),
            grayscale_probability=self.grayscale_probability, blur_probability=0.0)


def amdim_views(rng: jax.Array | None, images: jax.Array, settings: AMDIMSettings
                ) -> tuple[jax.Array, jax.Array]:
    """Two views [B, S, S, 3] in [0, 1] of whole uint8 images [B, H, W, 3] (module docstring);
    `rng` None (evaluation): fixed views."""
    key = rng if rng is not None else jax.random.key(EVAL_AUGMENT_SEED)
    flip_key, *view_keys = jax.random.split(key, 3)
    images = (evaluation_view(images, settings.image_size) if settings.translate
              else image_augment.to_float(images))
    flips = jax.random.bernoulli(flip_key, 0.5, (images.shape[0], 1, 1, 1))
    images = jnp.where(flips, images[:, :, ::-1], images)
    config = settings.augment_config()

    def view(key: jax.Array, image: jax.Array) -> jax.Array:
        shift_key, apply_key, key = jax.random.split(key, 3)
        if settings.translate:
            moved = image_augment.padded_crop(shift_key, image, settings.translate, "reflect")
            image = jnp.where(jax.random.bernoulli(apply_key, settings.translate_probability),
                              moved, image)
        return image_augment.augment(key, image, config)

    return tuple(jax.vmap(view)(jax.random.split(k, images.shape[0]), images)
                 for k in view_keys)


def nce_scores(sources: jax.Array, targets: jax.Array, tclip: float
               ) -> tuple[jax.Array, jax.Array]:
    """costs.py `_model_scores`/`_loss_g2l`: `sources` [N, D] predict `targets` [N, L, D].
    Returns the NCE loss (mean over images i and target locations l of -log softmax of the
    positive (i, i, l) against every location of the other images) and mean(raw score^2)."""
    sources, targets = sources.astype(jnp.float32), targets.astype(jnp.float32)
    raw = jnp.einsum("id,jld->ijl", sources, targets) / math.sqrt(sources.shape[-1])
    squares = jnp.mean(raw ** 2)
    clipped = tclip * jnp.tanh(raw / tclip)
    count = raw.shape[0]
    positives = jnp.diagonal(clipped, axis1=0, axis2=1).T  # [N, L]
    others = jnp.where(jnp.eye(count, dtype=bool)[:, :, None], -jnp.inf, clipped)
    negatives = jax.nn.logsumexp(others.reshape(count, -1), axis=1)  # [N]
    log_probabilities = positives - jnp.logaddexp(positives, negatives[:, None])
    return -jnp.mean(log_probabilities), squares


def source_locations(rng: jax.Array, maps: jax.Array) -> jax.Array:
    """One location per image of `maps` [N, h, w, D], uniform over the h x w: [N, D]."""
    count, height, width, depth = maps.shape
    index = jax.random.randint(rng, (count,), 0, height * width)
    return maps.reshape(count, height * width, depth)[jnp.arange(count), index]


def multiscale_nce(first: Any, second: Any, rng: jax.Array, settings: AMDIMSettings
                   ) -> tuple[jax.Array, Metrics]:
    """costs.py `LossMultiNCE` on the two views' `AMDIMOutput`s: 1->5, 1->7 and 5->5 in both
    directions plus the regulariser (module docstring)."""
    flat = [{"r1": out.r1, "r5": out.r5.reshape(out.r5.shape[0], -1, out.r5.shape[-1]),
             "r7": out.r7.reshape(out.r7.shape[0], -1, out.r7.shape[-1])}
            for out in (first, second)]
    keys = jax.random.split(rng)
    sources = [{"r1": out.r1, "r5": source_locations(key, out.r5)}
               for key, out in zip(keys, (first, second), strict=True)]
    one = jnp.ones((), jnp.float32)
    loss, squares, metrics = 0.0, 0.0, {}
    for source, target in (("r1", "r5"), ("r1", "r7"), ("r5", "r5")):
        pair = 0.0
        for a, b in ((0, 1), (1, 0)):
            nce, square = nce_scores(sources[a][source], flat[b][target], settings.tclip)
            pair, squares = pair + 0.5 * nce, squares + square
        loss = loss + pair
        metrics[f"nce_{source[1]}t{target[1]}"] = (pair, one)
    penalty = settings.logit_penalty * 0.5 * squares
    return loss + penalty, {**metrics, "logit_penalty": (penalty, one)}


def amdim_loss(model: AMDIM, batch: Batch, rng: jax.Array | None, *,
               objective: AMDIMSettings | None = None) -> tuple[jax.Array, Metrics]:
    """AMDIM's loss on two views of every image; `rng` None (evaluation): fixed views and
    source locations, BatchNorm running statistics."""
    objective = objective or AMDIMSettings()
    view_key, source_key = jax.random.split(
        rng if rng is not None else jax.random.key(EVAL_AUGMENT_SEED))
    first, second = amdim_views(view_key, batch["image"], objective)
    # One encoder call per view, as model.py: BatchNorm statistics are each view's.
    outputs = [model(view, train=rng is not None) for view in (first, second)]
    loss, metrics = multiscale_nce(*outputs, source_key, objective)
    return loss, {"loss": (loss, jnp.ones((), jnp.float32)), **metrics}


def check_amdim(model: AMDIMConfig, examples: ImageExampleConfig, objective: AMDIMSettings
                ) -> None:
    """The encoder's 32-pixel layout and whole images (the views are cut on device)."""
    del model
    if objective.image_size != AMDIMEncoder.SIZE:
        raise UserError(f"objective.image_size={objective.image_size}: the AMDIM encoder is "
                        f"amdim-public's 32x32 one; set objective.image_size={AMDIMEncoder.SIZE}")
    if examples.host_crop_size:
        raise UserError(f"examples.host_crop_size={examples.host_crop_size}: AMDIM makes its "
                        "views on device from whole images; set examples.host_crop_size=0")


def build_amdim(config: AMDIMConfig, seed: int) -> AMDIM:
    with nnx.use_eager_sharding(False):
        return AMDIM(config, rngs=nnx.Rngs(seed))


# task_self_supervised.py: torch Adam, betas (0.8, 0.999), eps 1e-8, weight decay 1e-5 (torch
# adds it to the gradient; ours is decoupled), lr ramped linearly over the first 500 updates.
_ADAM = {"optimizer": "adamw", "b1": 0.8, "b2": 0.999, "eps": 1e-8, "weight_decay": 1e-5,
         "bias_correction": True, "clip_norm": 0.0}

PRESETS = {
    # The CIFAR recipe at test size: ndf 8, n_rkhs 32, one layer per block, a constant lr 5x
    # the reference's after a 20-step warmup, 200 steps.
    "amdim_tiny": {
        "model": {"ndf": 8, "n_rkhs": 32, "n_depth": 1},
        "objective": {"image_size": 32, "tclip": 20.0},
        "optim": {**_ADAM, "learning_rate": 1e-3, "schedule": "constant", "warmup_steps": 20},
        "train": TINY_IMAGE_TRAIN,
    },
    # AMDIM on CIFAR-10 (train.py defaults: ndf 128, n_rkhs 1024, n_depth 3, tclip 20, batch
    # 200, lr 2e-4; task_self_supervised.py: 300 epochs of 250 steps, lr x0.2 after epochs 250
    # and 280, 500 warmup updates), TransformsC10's views.
    "amdim_cifar10": {
        "model": {"ndf": 128, "n_rkhs": 1024, "n_depth": 3},
        "objective": {"image_size": 32, "translate": 4, "tclip": 20.0},
        "data": {"source": ""},
        "optim": {**_ADAM, "learning_rate": 2e-4, "schedule": "step", "warmup_steps": 500,
                  "decay_boundaries": "62500,70000", "decay_factor": 0.2},
        "train": {"steps": 75000, "batch_size": 200, "eval_every": 2500},
    },
}


register(Method(
    name="amdim",
    model_config=AMDIMConfig,
    example_config=ImageExampleConfig,
    objective_config=AMDIMSettings,
    build_model=build_amdim,
    loss=amdim_loss,
    prepare=prepare_two_view_images,
    units_per_example=lambda examples: 2,
    unit="views",
    description="AMDIM: multiscale NCE between two augmented views (Bachman et al. 2019)",
    presets=PRESETS,
    resolution=Resolution(check=check_amdim),
    evaluation=Evaluation(monitor=knn_monitor,
                          summarize=knn_summary(("loss", "nce_1t5", "nce_1t7", "nce_5t5"))),
))
