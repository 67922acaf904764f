"""CMC pre-training (Tian, Krishnan & Isola 2019 "Contrastive Multiview Coding" §3;
HobbitLong/CMC train_CMC.py, NCE/NCEAverage.py, NCE/NCECriterion.py `NCESoftmaxLoss`).

One training step, as train_CMC.py with `--softmax`:
1. every image gets one random resized crop (area `crop_area_min`..1) and flip, on device (the
   reference's transform: no colour jitter, which would change the views' relation); its L
   and ab channels are the two views (`models.cmc`);
2. each view's encoder and projection, L2-normalised: z_l, z_ab [B, d];
3. the memory-bank contrast of NCEAverage.py: for image i (its training-set row `index`),
   the L anchor z_l[i] scores the ab bank's row i (the positive) and K rows of the ab bank
   drawn uniformly over all training images (negatives); the ab anchor likewise against the
   L bank, with the same draw. Each is a (K + 1)-way softmax cross-entropy at temperature T
   (`contrastive.info_nce`), and the loss is their sum L(L -> ab) + L(ab -> L);
4. after the scores, both banks' rows i move to normalise(m x row + (1 - m) z) with m = 0.5.

Why the memory bank and the softmax: it is the paper's and the reference's ImageNet form (K =
16,384 negatives however small the batch), and the softmax criterion is the one the
reference's ResNet runs use (`--softmax`; the paper's NCE criterion with its constant Z fixed
on the first batch is not built here). The bank is model state: checkpointed, its rows sharded
over the data axes, so a resume is exact.

Departures: the K negatives are drawn once per step for the whole batch (the reference draws K
per image: a [B, K + 1, d] gather, 1 GiB of floats per view at batch 128 and K 16,384); each
image still meets K uniform draws, as in the reference possibly its own row. Our BatchNorm is
global over the batch (the reference's DataParallel splits it per GPU; the positives come
from the bank, so no batch statistics can leak them). An image twice in one batch (a batch
across an epoch boundary) keeps one of its two bank updates.

Held-out images have no bank rows: evaluation (`rng=None`) scores each image's centre view's
z_l against its own z_ab (and back) among the same kind of K bank rows, drawn with a fixed key.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.input_pipeline.indexed import IndexedRecords
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.models.cmc import CMC, CMCConfig
from pretext_jax.objectives.common.contrastive import info_nce, l2_normalize
from pretext_jax.objectives.common.preset_parts import MEMORY_BANK_SGD, TINY_IMAGE_TRAIN
from pretext_jax.objectives.common.two_view import (
    EVAL_AUGMENT_SEED,
    ImageExampleConfig,
    ViewSettings,
    check_two_view_method,
    cropped_and_flipped,
    evaluation_view,
    knn_monitor,
    knn_summary,
    prepare_two_view_images,
    single_view,
)
from pretext_jax.objectives.registry import (
    Batch,
    Evaluation,
    Method,
    Metrics,
    PreparedData,
    Resolution,
    register,
)


@dataclasses.dataclass(frozen=True)
class CMCSettings(ViewSettings):
    """The `objective` section: the softmax contrast's temperature `temperature` (nce_t 0.07),
    negatives per anchor `num_negatives` (nce_k 16,384), the banks' `momentum` (nce_m 0.5), and
    the view (`image_size`, crop of area `crop_area_min`..1 and flip: train_CMC.py)."""

    crop_area_min: float = 0.2
    """Smallest area fraction of the random resized crop (CMC `crop_low` 0.2; ImageNet ResNets
    0.08)."""
    temperature: float = 0.07
    """Softmax temperature T, > 0 (CMC `nce_t` 0.07 ImageNet, 0.1 STL-10)."""
    num_negatives: int = 16384
    """Memory-bank rows drawn as negatives each step, K (CMC `nce_k` 16,384)."""
    momentum: float = 0.5
    """Memory-bank momentum m: row <- normalise(m row + (1 - m) z) (CMC `nce_m` 0.5)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.temperature <= 0.0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (CMC: 0.07)")
        if self.num_negatives < 1:
            raise ValueError(f"num_negatives={self.num_negatives} must be >= 1 (CMC: 16384)")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum={self.momentum} must be in [0, 1) (CMC: 0.5)")


def cross_view_contrast(z_l: jax.Array, z_ab: jax.Array, l_positives: jax.Array,
                        ab_positives: jax.Array, l_negatives: jax.Array,
                        ab_negatives: jax.Array, temperature: float
                        ) -> tuple[jax.Array, Metrics]:
    """L(L -> ab) + L(ab -> L) on L2-normalised [B, d] embeddings: z_l against the ab
    positives [B, d] and ab negatives [K, d], z_ab against the L ones (`info_nce` each).
    Metrics: the sum (`loss`), each direction's (`l_loss`: L anchors, `ab_loss`: ab anchors,
    the reference's names) and the (K + 1)-way accuracy over both directions."""
    l_loss, l_metrics = info_nce(z_l, ab_positives, ab_negatives, temperature)
    ab_loss, ab_metrics = info_nce(z_ab, l_positives, l_negatives, temperature)
    loss = l_loss + ab_loss
    return loss, {"loss": (loss, jnp.ones((), jnp.float32)),
                  "l_loss": l_metrics["contrastive_loss"],
                  "ab_loss": ab_metrics["contrastive_loss"],
                  "contrastive_accuracy": jax.tree.map(
                      jnp.add, l_metrics["contrastive_accuracy"],
                      ab_metrics["contrastive_accuracy"])}


def cmc_loss(model: CMC, batch: Batch, rng: jax.Array | None, *,
             objective: CMCSettings | None = None) -> tuple[jax.Array, Metrics]:
    """One CMC step (module docstring) on uint8 images and their training-set rows `index`;
    `rng=None` (evaluation) uses centre views, BatchNorm running statistics, fixed negatives,
    each image's other view as its positive, and leaves the banks as they are."""
    objective = objective or CMCSettings()
    train = rng is not None
    if train:
        view_key, negative_key = jax.random.split(rng)
        images = cropped_and_flipped(view_key, batch["image"], objective)
    else:
        negative_key = jax.random.key(EVAL_AUGMENT_SEED)
        images = evaluation_view(single_view(batch["image"]), objective.image_size)
    z_l, z_ab = (l2_normalize(z.astype(jnp.float32)) for z in model(images, train=train))
    memory_l, memory_ab = (jax.lax.stop_gradient(bank.get_value())
                           for bank in (model.memory_l, model.memory_ab))
    drawn = jax.random.randint(negative_key, (objective.num_negatives,), 0,
                               memory_l.shape[0])
    if train:
        l_positives, ab_positives = memory_l[batch["index"]], memory_ab[batch["index"]]
    else:
        l_positives, ab_positives = (jax.lax.stop_gradient(z) for z in (z_l, z_ab))
    loss, metrics = cross_view_contrast(z_l, z_ab, l_positives, ab_positives, memory_l[drawn],
                                        memory_ab[drawn], objective.temperature)
    if train:
        model.update_memory(batch["index"], z_l, z_ab, objective.momentum)
    return loss, metrics


def prepare_cmc(data: DataConfig, examples: ImageExampleConfig, cache_dir: Path, seed: int
                ) -> PreparedData:
    """The image methods' data, training images read with their row `index`
    (`indexed.IndexedRecords`), and the training image count as `model.num_images`."""
    prepared = prepare_two_view_images(data, examples, cache_dir, seed)
    return dataclasses.replace(prepared, train=IndexedRecords(prepared.train),
                               model_fields={"num_images": len(prepared.train)})


def build_cmc(config: CMCConfig, seed: int) -> CMC:
    with nnx.use_eager_sharding(False):
        return CMC(config, rngs=nnx.Rngs(seed))


PRESETS = {
    # Test size: two ResNet-18s (CIFAR stem) of 4 base channels each (half the other tiny
    # presets' 8), 64-dimensional embeddings, 4,096 negatives, the reference's optimiser with
    # its lr steps at 50/67/83% of the run.
    "cmc_tiny": {
        "model": {"depth": 18, "stem": "cifar", "base_width": 4, "projection_dim": 64},
        "objective": {"image_size": 32, "num_negatives": 4096},
        "optim": {**MEMORY_BANK_SGD, "decay_boundaries": "100,133,167"},
        "train": TINY_IMAGE_TRAIN,
    },
    # train_CMC.py's defaults with `--softmax`, at CIFAR-10 size: batch 128, 240 epochs of
    # 50,000 / 128 steps (93,750), SGD lr 0.03, momentum 0.9, weight decay 1e-4, lr x0.1 after
    # epochs 120, 160 and 200; nce_k 16,384, nce_t 0.07, nce_m 0.5, feat_dim 128; crops of area
    # 0.2-1 and flip. The reference's `resnet18v1` (two ResNet-18s of half width: 32 base
    # channels each) with our CIFAR stem; the paper's own runs are on ImageNet and STL-10.
    "cmc_cifar10": {
        "model": {"depth": 18, "stem": "cifar", "base_width": 32, "projection_dim": 128},
        "objective": {"image_size": 32, "crop_area_min": 0.2, "temperature": 0.07,
                      "num_negatives": 16384, "momentum": 0.5},
        "data": {"source": ""},
        "optim": {**MEMORY_BANK_SGD, "decay_boundaries": "46875,62500,78125"},
        "train": {"steps": 93750, "batch_size": 128, "eval_every": 3750},
    },
}


register(Method(
    name="cmc",
    model_config=CMCConfig,
    example_config=ImageExampleConfig,
    objective_config=CMCSettings,
    build_model=build_cmc,
    loss=cmc_loss,
    prepare=prepare_cmc,
    units_per_example=lambda examples: 1,
    unit="images",
    description="CMC: contrast of L and ab views against memory banks (Tian et al. 2019)",
    presets=PRESETS,
    resolution=Resolution(check=check_two_view_method),
    evaluation=Evaluation(monitor=knn_monitor,
                          summarize=knn_summary(("loss", "contrastive_accuracy"))),
))
