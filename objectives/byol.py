"""BYOL pre-training (Grill et al. 2020 "Bootstrap Your Own Latent", §3.1-3.2, Appendices B and
J; deepmind byol byol_experiment.py, utils/augmentations.py, utils/schedules.py).

Two asymmetrically augmented views v, v' of every image (view 1: blur p 1.0, no solarisation;
view 2: blur p 0.1, solarisation p 0.2; both: colour jitter 0.4/0.4/0.2/0.1 with an additive
brightness shift, p 0.8, grayscale p 0.2, flip). The online network (ResNet, projector,
predictor q) regresses the target network's projection of the other view:
loss = mean over images of [2 - 2 cos(q(z_v), sg(z'_v')) + 2 - 2 cos(q(z_v'), sg(z'_v))]
(`regression_loss` = ||a/|a| - b/|b|||^2 = 2 - 2 cos). Each view goes through each network on
its own, so BatchNorm statistics are per view as in byol_experiment.py (global over the
sharded batch, the reference's cross-replica BatchNorm).

The target is the EMA of the online ResNet + projector with the cosine schedule
tau_k = 1 - (1 - tau_base) (cos(pi k / K) + 1) / 2 (tau_base 0.996). The loss has no step
argument, so the model keeps the number of target updates k (a Variable, carried and
checkpointed by the trainer) and the objective settings hold K (`objective.target_decay_steps`;
0, the default, is the whole run, filled in by the trainer: with `optim.grad_accum_steps` = A
every micro-batch is one update, so K = train.steps x A).

The update runs at the start of each training loss from the current online parameters. The
reference updates after each optimizer step instead: target_{t+1} = tau_t target_t +
(1 - tau_t) online_{t+1}. Both give the same sequence of targets: the loss of step t (t >= 1)
here sets target <- tau_{t-1} target + (1 - tau_{t-1}) online_t, which is exactly the
reference's target_t, and at t = 0 it leaves the (independently initialised) target as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.momentum import BYOL, BYOLConfig, ema_update
from pretext_jax.objectives.common.contrastive import l2_normalize
from pretext_jax.objectives.common.preset_parts import TINY_IMAGE_TRAIN
from pretext_jax.objectives.common.two_view import (
    ImageExampleConfig,
    TwoViewAugmentation,
    check_two_view_method,
    knn_monitor,
    knn_summary,
    prepare_two_view_images,
    two_views,
)
from pretext_jax.objectives.registry import Batch, Evaluation, Method, Metrics, Resolution, register


@dataclasses.dataclass(frozen=True)
class BYOLLossSettings(TwoViewAugmentation):
    """The `objective` section: the target schedule, `base_target_decay` tau_base (0.996 for
    1000 epochs, configs/byol.py) over `target_decay_steps` K updates (0, the default: the whole
    run, train.steps x optim.grad_accum_steps loss calls, filled in by the trainer through
    `run_settings`), and BYOL's augmentations (`TwoViewAugmentation` with the byol
    augmentations.py defaults below)."""

    crop_area_min: float = 0.08
    saturation: float = 0.2
    additive_brightness: bool = True
    blur_probability: float = 1.0
    second_blur_probability: float = 0.1
    second_solarize_probability: float = 0.2
    base_target_decay: float = 0.996
    """tau_base of the target EMA's cosine schedule, in [0, 1] (BYOL 0.996)."""
    target_decay_steps: int = 0
    """K, updates over which tau rises to 1; 0 = the whole run (train.steps x grad_accum_steps)."""
    constant_target_decay: bool = False
    """tau stays at base_target_decay throughout (lightly's CIFAR-10 benchmark: 0.99); False:
    BYOL's cosine rise to 1 over K updates."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.base_target_decay <= 1.0:
            raise ValueError(f"base_target_decay={self.base_target_decay} must be in [0, 1] "
                             "(BYOL: 0.996)")
        if self.target_decay_steps < 0:
            raise ValueError(f"target_decay_steps={self.target_decay_steps} must be >= 0 (0 = "
                             "the whole run: train.steps x optim.grad_accum_steps)")


def target_decay(updates: jax.Array, base: float, total: int) -> jax.Array:
    """tau_k = 1 - (1 - base) (cos(pi k / K) + 1) / 2 with k clipped to K (§3.2;
    schedules.py `target_ema`): base at k = 0, 1 at k = K."""
    k = jnp.minimum(updates, total).astype(jnp.float32)
    return 1.0 - (1.0 - base) * (jnp.cos(jnp.pi * k / total) + 1.0) / 2.0


def update_decay(updates: jax.Array, objective: BYOLLossSettings) -> jax.Array:
    """The EMA decay of the target update after `updates` earlier ones: 1 for the first (the
    target keeps its initialisation; byol_experiment.py updates after each step, we before the
    next), then tau_(updates - 1) (`target_decay`), or `base_target_decay` throughout with
    `constant_target_decay`."""
    if objective.constant_target_decay:
        scheduled = jnp.float32(objective.base_target_decay)
    else:
        scheduled = target_decay(updates - 1, objective.base_target_decay,
                                 objective.target_decay_steps)
    return jnp.where(updates == 0, 1.0, scheduled)


def regression_loss(predictions: jax.Array, targets: jax.Array) -> jax.Array:
    """Per example ||p/|p| - z/|z|||^2 = 2 - 2 cos(p, z) (helpers.py `regression_loss`)."""
    difference = l2_normalize(predictions.astype(jnp.float32)) - l2_normalize(
        targets.astype(jnp.float32))
    return jnp.sum(difference * difference, axis=-1)


def byol_loss(model: BYOL, batch: Batch, rng: jax.Array | None, *,
              objective: BYOLLossSettings) -> tuple[jax.Array, Metrics]:
    """The symmetrised BYOL loss (module docstring); training first updates the target on the
    schedule of `objective` (its `target_decay_steps` resolved, > 0). `rng=None` (evaluation)
    uses fixed views and BatchNorm running statistics and leaves the target as it is."""
    train = rng is not None
    views = two_views(rng, batch["image"], objective.view_augmentations)
    one = jnp.ones((), jnp.float32)
    extra: Metrics = {}
    if train:
        updates = model.target_updates.get_value()
        decay = update_decay(updates, objective)
        ema_update(model.target, model.online, decay)
        model.target_updates.set_value(updates + 1)
        extra["target_decay"] = (decay, one)
    predictions = [model.predictor(model.online(v, train=train).projections, train)
                   for v in views]
    targets = [jax.lax.stop_gradient(model.target(v, train=train).projections) for v in views]
    per_image = (regression_loss(predictions[0], targets[1])
                 + regression_loss(predictions[1], targets[0]))
    loss = jnp.mean(per_image)
    count = jnp.float32(per_image.shape[0])
    return loss, {"loss": (loss, one), "regression_loss": (jnp.sum(per_image), count), **extra}


def whole_run_schedule(objective: BYOLLossSettings, config: Any) -> BYOLLossSettings:
    """`target_decay_steps` 0 -> the run's number of loss calls (train.steps x accumulation)."""
    if objective.target_decay_steps:
        return objective
    return dataclasses.replace(
        objective, target_decay_steps=config.train.steps * config.optim.grad_accum_steps)


def build_byol(config: BYOLConfig, seed: int) -> BYOL:
    with nnx.use_eager_sharding(False):
        return BYOL(config, rngs=nnx.Rngs(seed))


PRESETS = {
    # BYOL at test size: a narrow ResNet-18 with the CIFAR stem, small MLPs, the paper's
    # augmentations and target schedule (K = train.steps), LARS with 10 warmup steps.
    "byol_tiny": {
        "model": {"depth": 18, "stem": "cifar", "base_width": 8, "projection_hidden_dim": 256,
                  "projection_dim": 64, "predictor_hidden_dim": 256},
        "objective": {"base_target_decay": 0.99, "image_size": 32},
        "optim": {"optimizer": "lars", "learning_rate_after_momentum": True,
                  "learning_rate": 0.5, "schedule": "cosine", "warmup_steps": 10,
                  "weight_decay": 1.5e-6, "clip_norm": 0.0},
        "train": TINY_IMAGE_TRAIN,
    },
    # lightly's CIFAR-10 benchmark for BYOL (docs/source/getting_started/benchmarks/
    # cifar10_benchmark.py, batch 512): ResNet-18 with the CIFAR stem, projector 512 -> 1024 ->
    # 256 and predictor 256 -> 1024 -> 256, a constant target decay 0.99, BYOL's two views
    # without blur (solarisation p 0.2 on the second), SGD lr 0.06 x 512/128, momentum 0.9,
    # weight decay 5e-4, cosine over 200 epochs; lightly reports kNN 0.868.
    "byol_cifar10": {
        "model": {"depth": 18, "stem": "cifar", "projection_hidden_dim": 1024,
                  "projection_dim": 256, "predictor_hidden_dim": 1024},
        "objective": {"base_target_decay": 0.99, "constant_target_decay": True,
                      "image_size": 32, "additive_brightness": False, "blur_probability": 0.0,
                      "second_blur_probability": 0.0},
        "data": {"source": ""},
        "optim": {"optimizer": "sgd", "learning_rate": 0.24, "schedule": "cosine",
                  "warmup_steps": 0, "weight_decay": 5e-4, "momentum": 0.9, "clip_norm": 0.0},
        "train": {"steps": 19531, "batch_size": 512, "eval_every": 2000},
    },
    # BYOL on ImageNet (Grill et al. 2020 §3.3 and Appendix J; configs/byol.py for 1000
    # epochs): ResNet-50, projector and predictor 4096 -> 256, tau_base 0.996 with the cosine
    # schedule over the whole run, LARS (trust 1e-3, momentum 0.9, neither decay nor adaptation
    # on biases and BatchNorm; the rate scales the momentum, optimizers.py `lars`) lr 0.2 x
    # 4096/256 = 3.2, weight decay 1.5e-6, batch 4096, 1000 epochs = 312,785 steps with 10 of
    # warmup (3,127), cosine; crops of area 0.08-1.
    "byol_imagenet": {
        "model": {"depth": 50, "stem": "imagenet", "dtype": "bfloat16",
                  "projection_hidden_dim": 4096, "projection_dim": 256,
                  "predictor_hidden_dim": 4096},
        "objective": {"base_target_decay": 0.996, "image_size": 224},
        "examples": {"host_crop_size": 224, "host_crop_area_min": 0.08},
        "data": {"source": "tfds:imagenet2012", "worker_count": 16},
        "optim": {"optimizer": "lars", "learning_rate_after_momentum": True,
                  "learning_rate": 3.2, "schedule": "cosine", "warmup_steps": 3127,
                  "weight_decay": 1.5e-6, "momentum": 0.9, "trust_coefficient": 1e-3,
                  "clip_norm": 0.0},
        "train": {"steps": 312785, "batch_size": 4096, "eval_every": 5000},
    },
}


register(Method(
    name="byol",
    model_config=BYOLConfig,
    example_config=ImageExampleConfig,
    objective_config=BYOLLossSettings,
    build_model=build_byol,
    loss=byol_loss,
    prepare=prepare_two_view_images,
    units_per_example=lambda examples: 2,
    unit="views",
    description="BYOL: predict a momentum target's projection of the other view "
                "(Grill et al. 2020)",
    presets=PRESETS,
    resolution=Resolution(check=check_two_view_method, run_settings=whole_run_schedule),
    evaluation=Evaluation(monitor=knn_monitor, summarize=knn_summary()),
))
