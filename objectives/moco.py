"""MoCo v2 pre-training (He et al. 2020 "Momentum Contrast"; Chen et al. 2020 "Improved
Baselines with Momentum Contrastive Learning"; facebookresearch/moco main_moco.py,
moco/builder.py).

One training step, as builder.py's `forward`:
1. the key encoder's parameters move towards the query encoder's current ones,
   k <- m k + (1 - m) q (m = 0.999), before any key is computed;
2. queries q = normalise(f_q(view 1)); keys k = normalise(f_k(view 2)) with "shuffling BN"
   (§3.3): the key batch is permuted before the key encoder and un-permuted after it;
3. InfoNCE (eq. 1) with logits [q.k+, q.queue] / T, T = 0.2, the positive at index 0;
4. the keys are enqueued after the loss (FIFO), so a step's keys are never its own negatives.

Shuffling BN here: under `jit` our BatchNorm statistics span the whole global batch, which would
make the shuffle pointless (the permuted batch has the same statistics). So both encoders
compute BatchNorm statistics over `objective.shuffle_bn_groups` groups of consecutive examples,
as each of the reference's 8 GPUs does over its 32 (`models.momentum.call_in_groups`); the key
batch is permuted across groups first, so a query and its positive key see statistics of
different subsets. `shuffle_bn_groups=1` is global BatchNorm (the shuffle then changes nothing; §3.3
reports that the model then cheats the pretext task).

The key encoder, its BatchNorm statistics, the queue and its pointer are model state: the loss
updates them, the trainer carries and checkpoints them. With `optim.grad_accum_steps` > 1 every
micro-batch is one reference iteration for the momentum update and the queue (both happen once
per micro-batch, from the same query parameters within a step); the gradients are still summed
over the micro-batches before the one optimizer update.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.models.momentum import MoCo, MoCoConfig, call_in_groups, ema_update
from pretext_jax.objectives.common.contrastive import info_nce, l2_normalize
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
class MoCoLossSettings(TwoViewAugmentation):
    """The `objective` section: InfoNCE `temperature` (0.2 in v2, 0.07 in v1), key-encoder
    `momentum` m (0.999), `shuffle_bn_groups` (8: the reference's 8 GPUs), and the
    augmentations of the two views (`TwoViewAugmentation`: MoCo v2's `--aug-plus`)."""

    temperature: float = 0.2
    """InfoNCE temperature T, > 0 (MoCo v2 0.2, v1 0.07)."""
    momentum: float = 0.999
    """Key-encoder EMA momentum m, in [0, 1] (MoCo 0.999)."""
    shuffle_bn_groups: int = 8
    """BatchNorm groups for shuffling BN, dividing the (micro-)batch (MoCo 8; 1 = global BN)."""
    symmetric: bool = False
    """Also view 2 as queries against view 1's keys, the two losses averaged and both key sets
    enqueued after them (the CIFAR-10 demo notebook of facebookresearch/moco, lightly's CIFAR-10
    benchmark); the paper's MoCo is one direction (False)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.temperature <= 0.0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (MoCo v2: 0.2)")
        if not 0.0 <= self.momentum <= 1.0:
            raise ValueError(f"momentum={self.momentum} must be in [0, 1] (MoCo: 0.999)")
        if self.shuffle_bn_groups < 1:
            raise ValueError(f"shuffle_bn_groups={self.shuffle_bn_groups} must be >= 1")


def moco_loss(model: MoCo, batch: Batch, rng: jax.Array | None, *,
              objective: MoCoLossSettings | None = None) -> tuple[jax.Array, Metrics]:
    """One MoCo step (module docstring; `objective` None: MoCo v2's settings); `rng=None`
    (evaluation) uses fixed views, BatchNorm running statistics, no shuffle, and leaves the key
    encoder and the queue as they are. With `objective.symmetric` each view is also the other's
    query: the two InfoNCE losses against the same queue are averaged (their metrics summed)
    and both directions' keys are enqueued afterwards (the colab demo's `_dequeue_and_enqueue`
    of [k1, k2])."""
    objective = objective or MoCoLossSettings()
    train = rng is not None
    view_rng, shuffle_rng = jax.random.split(rng) if train else (None, None)
    views = two_views(view_rng, batch["image"], objective.view_augmentations)
    size = views[0].shape[0]
    if train:
        groups = objective.shuffle_bn_groups
        if size % groups:
            raise UserError(f"the (micro-)batch of {size} images is not divisible by "
                            f"objective.shuffle_bn_groups={groups}; change either")
        enqueued = size * (2 if objective.symmetric else 1)
        if enqueued > model.config.queue_size:
            raise UserError(f"model.queue_size={model.config.queue_size} is smaller than the "
                            f"{enqueued} keys a (micro-)batch enqueues; use a larger queue")
        ema_update(model.target, model.online, objective.momentum)
    directions = ((0, 1), (1, 0)) if objective.symmetric else ((0, 1),)
    shuffle_rngs = ([None] * len(directions) if not train else
                    list(jax.random.split(shuffle_rng)) if objective.symmetric else [shuffle_rng])
    losses, all_keys, metrics = [], [], {}
    for (query_view, key_view), direction_rng in zip(directions, shuffle_rngs, strict=True):
        queries, keys = query_and_keys(model, views[query_view], views[key_view],
                                       direction_rng, objective)
        loss, direction_metrics = info_nce(queries, keys, model.queue.get_value(),
                                           objective.temperature)
        losses.append(loss)
        all_keys.append(keys)
        metrics = jax.tree.map(jnp.add, metrics, direction_metrics) if metrics else \
            direction_metrics
    if train:
        model.enqueue(jnp.concatenate(all_keys[::-1]))
    loss = sum(losses) / len(losses)
    return loss, {"loss": (loss, jnp.ones((), jnp.float32)), **metrics}


def query_and_keys(model: MoCo, query_images: jax.Array, key_images: jax.Array,
                   shuffle_rng: jax.Array | None, objective: MoCoLossSettings
                   ) -> tuple[jax.Array, jax.Array]:
    """L2-normalised float32 queries f_q(query_images) and keys f_k(key_images), the keys
    without gradient; in training (`shuffle_rng` given) with grouped BatchNorm and the key batch
    shuffled across the groups (shuffling BN, §3.3)."""
    if shuffle_rng is not None:
        groups = objective.shuffle_bn_groups
        queries = call_in_groups(model.online, query_images, groups).projections
        order = jax.random.permutation(shuffle_rng, key_images.shape[0])
        shuffled = call_in_groups(model.target, key_images[order], groups).projections
        keys = jnp.zeros_like(shuffled).at[order].set(shuffled)  # undo the shuffle
    else:
        queries = model.online(query_images, train=False).projections
        keys = model.target(key_images, train=False).projections
    queries = l2_normalize(queries.astype(jnp.float32))
    return queries, jax.lax.stop_gradient(l2_normalize(keys.astype(jnp.float32)))


def build_moco(config: MoCoConfig, seed: int) -> MoCo:
    with nnx.use_eager_sharding(False):
        return MoCo(config, rngs=nnx.Rngs(seed))




PRESETS = {
    # MoCo v2 at test size: the settings of facebookresearch/moco's CIFAR-10 demo notebook
    # (K 4096, m 0.99, BatchNorm split 8 ways, SGD lr 0.06 x batch/512, weight decay 5e-4) with
    # v2's temperature 0.2 and a narrow ResNet-18 with the CIFAR stem.
    "moco_tiny": {
        "model": {"depth": 18, "stem": "cifar", "base_width": 8, "projection_dim": 64,
                  "queue_size": 4096},
        "objective": {"momentum": 0.99, "image_size": 32, "crop_area_min": 0.2,
                      "blur_probability": 0.0, "second_blur_probability": 0.0},
        "optim": {"optimizer": "sgd", "learning_rate": 0.0075, "schedule": "cosine",
                  "warmup_steps": 0, "weight_decay": 5e-4, "clip_norm": 0.0},
        "train": TINY_IMAGE_TRAIN,
    },
    # lightly's CIFAR-10 benchmark for MoCo (docs/source/getting_started/benchmarks/
    # cifar10_benchmark.py, the batch-512 rows: memory bank 8192): ResNet-18 with the CIFAR stem,
    # 512 -> 512 -> 128 head, m 0.99, T 0.1, BatchNorm split 8 ways with shuffled keys, the
    # symmetric loss, SimCLR's views at jitter strength 0.5 without blur, SGD lr 0.06 x 512/128,
    # momentum 0.9, weight decay 5e-4, cosine over 200 epochs; lightly reports kNN 0.847.
    "moco_cifar10": {
        "model": {"depth": 18, "stem": "cifar", "projection_dim": 128, "queue_size": 8192},
        "objective": {"momentum": 0.99, "temperature": 0.1, "symmetric": True,
                      "shuffle_bn_groups": 8, "image_size": 32, "crop_area_min": 0.08,
                      "blur_probability": 0.0, "second_blur_probability": 0.0},
        "data": {"source": ""},
        "optim": {"optimizer": "sgd", "learning_rate": 0.24, "schedule": "cosine",
                  "warmup_steps": 0, "weight_decay": 5e-4, "momentum": 0.9, "clip_norm": 0.0},
        "train": {"steps": 19531, "batch_size": 512, "eval_every": 2000},
    },
    # MoCo v2 on ImageNet (Chen et al. 2020 "Improved Baselines" §3 and Table 1; main_moco.py
    # --mlp --aug-plus --cos): ResNet-50, 2048-wide MLP head to 128, K 65536, m 0.999, T 0.2,
    # BatchNorm per 8 GPUs with shuffled keys, SGD lr 0.03 (x batch/256), momentum 0.9,
    # weight decay 1e-4 on every parameter, cosine over 200 epochs of 5,004 steps (1,281,167
    # images, batch 256, last partial batch dropped), no warmup; crops of area 0.2-1.
    "moco_v2_imagenet": {
        "model": {"depth": 50, "stem": "imagenet", "dtype": "bfloat16", "projection_dim": 128,
                  "queue_size": 65536},
        "objective": {"momentum": 0.999, "temperature": 0.2, "shuffle_bn_groups": 8,
                      "image_size": 224, "crop_area_min": 0.2},
        "examples": {"host_crop_size": 224, "host_crop_area_min": 0.2},
        "data": {"source": "tfds:imagenet2012", "worker_count": 16},
        "optim": {"optimizer": "sgd", "learning_rate": 0.03, "schedule": "cosine",
                  "warmup_steps": 0, "weight_decay": 1e-4, "momentum": 0.9, "clip_norm": 0.0},
        "train": {"steps": 1000800, "batch_size": 256, "eval_every": 25020},
    },
}


register(Method(
    name="moco",
    model_config=MoCoConfig,
    example_config=ImageExampleConfig,
    objective_config=MoCoLossSettings,
    build_model=build_moco,
    loss=moco_loss,
    prepare=prepare_two_view_images,
    units_per_example=lambda examples: 2,
    unit="views",
    description="MoCo v2: InfoNCE against a queue of momentum-encoded keys (He et al. 2020)",
    presets=PRESETS,
    resolution=Resolution(check=check_two_view_method),
    evaluation=Evaluation(monitor=knn_monitor,
                          summarize=knn_summary(("loss", "contrastive_accuracy"))),
))
