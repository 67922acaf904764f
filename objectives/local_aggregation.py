"""Local Aggregation (Zhuang, Zhai & Yamins 2019 "Local Aggregation for Unsupervised Learning
of Visual Embeddings"; neuroailab/LocalAggregation model/instance_model.py `LossBuilder`,
model/cluster_km.py, param_setter.py; the PyTorch port neuroailab/LocalAggregation-Pytorch
src/objectives/localagg.py).

A run is two phases of one network (`models.local_aggregation`), one memory bank and one
optimizer, as the reference's LA run restores the variables and global step of a 10-epoch
instance-recognition (IR) run and continues from them (its README; la_final.json `load_step`):

1. steps 1..`instance_steps`: instance recognition (Wu et al. 2018 §3.2,
   `instance_recognition_loss`): each image's normalised embedding v against its own bank
   row and `instance_negatives` rows drawn uniformly for it, through NCE with the fixed
   partition constant of `LossBuilder._softmax`;
2. then rounds of `recluster_every` steps (the reference: one epoch), each begun by
   `num_clusterings` k-means runs of `num_clusters` clusters over the memory bank
   (`objectives.common.clustering.kmeans`, 20 iterations as cluster_km.py's faiss setting,
   clustering h seeded by the run's seed and h, as cluster_km.py seeds it 1234 + h every
   time); each step of the round minimises the local aggregation loss (§3,
   `aggregation_loss`): with B_i the `background_neighbours` bank rows most similar to v_i
   and C_i the images sharing a cluster with i in any clustering,
   L_i = -log(P(C_i ∩ B_i | v_i) / P(B_i | v_i)), P(A | v) = sum_{j in A} exp(v.m_j / T) / Z.
   Z cancels; the reference adds 1e-7 to the ratio before the log, as here.

After every step's scores, the batch's bank rows move to normalise(m row + (1 - m) v).
Augmentation (preprocessing_inst, Wu et al.'s): a random resized crop of area
`crop_area_min`..1 (0.2), grayscale with p 0.2, colour jitter of 0.4 (brightness, contrast,
saturation, hue; always applied), flip.

Data: training images carry their row `index`. The warm-up reads them shuffled; round r reads
`recluster_every x batch` rows in an order of whole permutations drawn from (seed, r)
(`round_records`), so a round's records depend only on the seed and r and a resume inside a
round is exact (the memory bank and the cluster labels are checkpointed model state).

Departures: ResNet v1.5 (the reference's resnet_model.py is pre-activation ResNet v2, its
default version); BatchNorm over the global batch; grayscale is applied after the colour
jitter (the reference: before); the k-means is DeepCluster's Lloyd's (the reference: faiss on
a GPU), its assignments on the accelerator with `kmeans_on_device` (ImageNet's 1.28 M rows and
30,000 clusters are about 2 x 10^14 floating-point operations a clustering, hours per epoch on
a host), else in numpy on the host; the reference re-clusters also
whenever its process restarts, a resume here keeps the checkpointed clusters. An image twice in
one batch keeps one of its two bank updates. Held-out images have no bank rows or clusters:
evaluation reports no loss, the kNN monitor measures the backbone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import image_augment
from pretext_jax.input_pipeline.indexed import IndexedRecords, SelectedRecords
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.models.local_aggregation import (
    NOT_CLUSTERED,
    LocalAggregation,
    LocalAggregationConfig,
)
from pretext_jax.objectives.common.clustering import kmeans
from pretext_jax.objectives.common.contrastive import l2_normalize
from pretext_jax.objectives.common.preset_parts import MEMORY_BANK_SGD, TINY_IMAGE_TRAIN
from pretext_jax.objectives.common.two_view import (
    ImageExampleConfig,
    ViewSettings,
    check_two_view_method,
    knn_monitor,
    knn_summary,
    prepare_two_view_images,
    single_view,
)
from pretext_jax.objectives.registry import (
    Batch,
    Evaluation,
    Loader,
    Method,
    Metrics,
    PreparedData,
    Resolution,
    Segment,
    Segments,
    register,
)

# instance_model.py `LossBuilder._softmax`: Z = 2876934.2 / 1281167 x the bank's rows, a
# constant (the NCE estimate of the partition function on ImageNet, scaled to the data).
IMAGENET_Z = 2876934.2
IMAGENET_IMAGES = 1281167
EPSILON = 1e-7  # instance_model.py: added inside both losses' logarithms


@dataclasses.dataclass(frozen=True)
class LocalAggregationSettings(ViewSettings):
    """The `objective` section: the warm-up `instance_steps` and its `instance_negatives`, the
    softmax `temperature`, the background set's size `background_neighbours`, the clusterings'
    `num_clusters`, `kmeans_iterations` and where they run (`kmeans_on_device`), the round
    length `recluster_every`, the bank's `momentum`, and the view (crop of area
    `crop_area_min`..1, `color_jitter`, `grayscale_probability`, flip)."""

    crop_area_min: float = 0.2
    """Smallest area fraction of the random resized crop (preprocessing_inst `size_minval` 0.2)."""
    color_jitter: float = 0.4
    """Brightness, contrast, saturation and hue jitter amounts, always applied (0.4)."""
    grayscale_probability: float = 0.2
    """Probability of converting a view to grayscale (`ApplyGray(image, 0.2)`)."""
    temperature: float = 0.07
    """Softmax temperature T, > 0 (`instance_t` 0.07)."""
    momentum: float = 0.5
    """Memory-bank momentum m: row <- normalise(m row + (1 - m) v) (`instance_m` 0.5)."""
    instance_steps: int = 0
    """Instance-recognition warm-up steps before the first clustering (the reference: 10
    epochs, 100,090 steps on ImageNet); 0: local aggregation from step 1."""
    instance_negatives: int = 4096
    """Bank rows drawn uniformly per image as the warm-up's noise samples (`instance_k` 4096)."""
    background_neighbours: int = 4096
    """Nearest bank rows that form the background set B_i (`instance_k` 4096)."""
    num_clusters: int = 10000
    """k of each k-means over the memory bank (`kmeans_k`; la_final.json: 30,000 for ResNets)."""
    kmeans_iterations: int = 20
    """Lloyd iterations of each k-means (cluster_km.py's faiss `niter` 20)."""
    kmeans_on_device: bool = False
    """Run the k-means' assignments on the accelerator (as the reference's faiss on a GPU),
    float32; false: numpy on the host, float64 distances."""
    recluster_every: int = 10009
    """Steps between clusterings (the reference: an epoch, data_len // batch_size)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.temperature <= 0.0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (LA: 0.07)")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum={self.momentum} must be in [0, 1) (LA: 0.5)")
        if not 0.0 <= self.color_jitter <= 0.5 or not 0.0 <= self.grayscale_probability <= 1.0:
            raise ValueError("color_jitter must be in [0, 0.5] (a hue shift) and "
                             "grayscale_probability in [0, 1]")
        if self.instance_steps < 0:
            raise ValueError(f"instance_steps={self.instance_steps} must be >= 0")
        for name in ("instance_negatives", "background_neighbours", "kmeans_iterations",
                     "recluster_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_clusters < 2:
            raise ValueError(f"num_clusters={self.num_clusters} must be >= 2")

    def augmentation(self, crop: bool = True) -> image_augment.AugmentConfig:
        """The view (`crop=False`: the host cropped): preprocessing_inst's training branch."""
        amount = self.color_jitter
        return image_augment.AugmentConfig(
            image_size=self.image_size, crop=crop, crop_window=self.crop_window(),
            jitter=(amount, amount, amount, amount), jitter_probability=1.0,
            grayscale_probability=self.grayscale_probability, blur_probability=0.0)


def instance_recognition_loss(z: jax.Array, own: jax.Array, noise: jax.Array, num_images: int,
                              temperature: float) -> tuple[jax.Array, Metrics]:
    """Wu et al.'s NCE (instance_model.py `get_IR_losses`) of normalised embeddings z [B, d]
    against their own bank rows `own` [B, d] and noise rows [B, K, d] drawn uniformly from the
    bank's `num_images`: P(j | v) = exp(v.m_j / T) / Z with Z = IMAGENET_Z / IMAGENET_IMAGES x
    N; the data term log(P(i) / (P(i) + K / N)), the noise term log((K / N) / (P(n) + K / N)),
    both summed and divided by B. Metrics: the loss and its two terms (`loss_model`,
    `loss_noise`)."""
    z, own, noise = (x.astype(jnp.float32) for x in (z, own, noise))
    partition = IMAGENET_Z / IMAGENET_IMAGES * num_images
    data_prob = jnp.exp(jnp.sum(z * own, axis=1) / temperature) / partition
    noise_prob = jnp.exp(jnp.einsum("bd,bkd->bk", z, noise) / temperature) / partition
    noise_mass = noise.shape[1] / num_images
    ln_data = jnp.log(data_prob / (data_prob + noise_mass + EPSILON))
    ln_noise = jnp.log(noise_mass / (noise_prob + noise_mass + EPSILON))
    count = jnp.float32(z.shape[0])
    loss = -(jnp.sum(ln_data) + jnp.sum(ln_noise)) / count
    return loss, {"instance_loss": (loss * count, count),
                  "loss_model": (-jnp.sum(ln_data), count),
                  "loss_noise": (-jnp.sum(ln_noise), count)}


def close_in_background(labels: jax.Array, index: jax.Array, background: jax.Array
                        ) -> jax.Array:
    """[B, k] bool: background neighbour j of image i shares a cluster with i in at least one
    clustering (labels [H, N], index [B], background [B, k] bank rows): C_i ∩ B_i."""
    own = labels[:, index]  # [H, B]
    theirs = labels[:, background]  # [H, B, k]
    return jnp.any(theirs == own[:, :, None], axis=0)


def aggregation_loss(z: jax.Array, bank: jax.Array, labels: jax.Array, index: jax.Array,
                     background_neighbours: int, temperature: float
                     ) -> tuple[jax.Array, Metrics]:
    """The local aggregation loss (§3; instance_model.py `get_LA_loss`) of normalised
    embeddings z [B, d] of training images `index` [B]: B_i the `background_neighbours` rows of
    `bank` [N, d] with the largest v_i.m_j (the image's own row among them if it ranks),
    C_i ∩ B_i those sharing a cluster of `labels` [H, N] with i, and the mean over the batch of
    -log(sum_{C ∩ B} exp(v.m / T) / sum_B exp(v.m / T) + 1e-7). Metrics: the loss, the mean
    fraction of B_i that is close (`close_fraction`) and how often the image's own row is in
    B_i (`self_in_background`)."""
    scores = z.astype(jnp.float32) @ bank.astype(jnp.float32).T
    top, background = jax.lax.top_k(scores, background_neighbours)
    close = close_in_background(labels, index, background)
    logits = top / temperature
    weights = jnp.exp(logits - jax.lax.stop_gradient(jnp.max(logits, axis=1, keepdims=True)))
    ratio = jnp.sum(jnp.where(close, weights, 0.0), axis=1) / jnp.sum(weights, axis=1)
    per_image = -jnp.log(ratio + EPSILON)
    count = jnp.float32(z.shape[0])
    own_row = jnp.any(background == index[:, None], axis=1)
    return jnp.mean(per_image), {
        "aggregation_loss": (jnp.sum(per_image), count),
        "close_fraction": (jnp.sum(jnp.mean(close.astype(jnp.float32), axis=1)), count),
        "self_in_background": (jnp.sum(own_row.astype(jnp.float32)), count)}


def empty_metrics(*names: str) -> Metrics:
    """Metrics of the phase not running this step: zero over zero (the trainer reports 0)."""
    zero = jnp.zeros((), jnp.float32)
    return {name: (zero, zero) for name in names}


IR_METRICS = ("instance_loss", "loss_model", "loss_noise")
LA_METRICS = ("aggregation_loss", "close_fraction", "self_in_background")


def local_aggregation_loss(model: LocalAggregation, batch: Batch, rng: jax.Array | None, *,
                           objective: LocalAggregationSettings | None = None
                           ) -> tuple[jax.Array, Metrics]:
    """One step (module docstring) on uint8 images and their training-set rows `index`: the
    warm-up's loss until the bank is first clustered, the local aggregation loss after, then
    the bank update. `rng=None` (evaluation: held-out images have no bank rows) gives no
    metrics."""
    objective = objective or LocalAggregationSettings()
    if rng is None:
        return jnp.zeros((), jnp.float32), {}
    view_key, noise_key = jax.random.split(rng)
    images = single_view(batch["image"])
    views = image_augment.augment_batch(view_key, images,
                                        objective.augmentation(crop=batch["image"].ndim != 5))
    z = l2_normalize(model(views, train=True).astype(jnp.float32))
    bank = jax.lax.stop_gradient(model.memory.get_value())
    labels = model.labels.get_value()
    index = batch["index"]

    def instance(z: jax.Array) -> tuple[jax.Array, Metrics]:
        noise = jax.random.randint(noise_key, (z.shape[0], objective.instance_negatives), 0,
                                   bank.shape[0])
        loss, metrics = instance_recognition_loss(z, bank[index], bank[noise], bank.shape[0],
                                                  objective.temperature)
        return loss, {**metrics, **empty_metrics(*LA_METRICS)}

    def aggregation(z: jax.Array) -> tuple[jax.Array, Metrics]:
        loss, metrics = aggregation_loss(z, bank, labels, index,
                                         objective.background_neighbours, objective.temperature)
        return loss, {**empty_metrics(*IR_METRICS), **metrics}

    loss, metrics = jax.lax.cond(labels[0, 0] == NOT_CLUSTERED, instance, aggregation, z)
    model.update_memory(index, z, objective.momentum)
    return loss, {"loss": (loss, jnp.ones((), jnp.float32)), **metrics}


def clustering_seed(seed: int, clustering: int) -> int:
    """The k-means seed of clustering h: the same at every round (cluster_km.py: 1234 + h)."""
    return int(np.random.default_rng([seed, clustering]).integers(2**31))


def cluster_memory(model: LocalAggregation, objective: LocalAggregationSettings, seed: int
                   ) -> tuple[str, ...]:
    """A round's start: `num_clusterings` k-means runs over the memory bank's rows
    (cluster_km.py `recompute_clusters`); their assignments become the cluster labels. No
    optimizer state restarts."""
    bank = np.asarray(jax.device_get(model.memory.get_value()), np.float32)
    labels = np.stack([
        kmeans(bank, objective.num_clusters, objective.kmeans_iterations,
               clustering_seed(seed, h), on_device=objective.kmeans_on_device)[1]
        for h in range(model.config.num_clusterings)])
    model.labels.set_value(jnp.asarray(labels, jnp.int32))
    return ()


def round_order(count: int, length: int, seed: int, round_index: int) -> np.ndarray:
    """Round r's rows: whole permutations of range(count) drawn from (seed, r), one after
    another, cut to `length` (every row once per permutation, as an epoch reads them)."""
    rng = np.random.default_rng([seed, round_index])
    return np.concatenate([rng.permutation(count)
                           for _ in range(-(-length // count))])[:length]


def round_records(train: IndexedRecords, seed: int, round_index: int, length: int
                  ) -> SelectedRecords:
    """Round r's records, read in order: `train` (rows with their `index`) at `round_order`."""
    return SelectedRecords(train, round_order(len(train), length, seed, round_index))


def phases(train: IndexedRecords, objective: LocalAggregationSettings) -> Segments:
    """`PreparedData.segments`: the warm-up (steps 1..`instance_steps`, shuffled), then round r
    (steps warm-up + r x `recluster_every` + 1 onwards), begun by clustering the bank and read
    in `round_order`."""
    warm, every = objective.instance_steps, objective.recluster_every

    def segment(step: int, config: Any) -> Segment:
        if step <= warm:
            return Segment(first_step=1, last_step=warm, records=lambda model: train)
        index, seed = (step - warm - 1) // every, config.train.seed
        first = warm + index * every + 1
        return Segment(
            first_step=first, last_step=first + every - 1, shuffle=False,
            records=lambda model: round_records(train, seed, index,
                                                every * config.train.batch_size),
            begin=lambda model: cluster_memory(model, objective, seed))

    return segment


def prepare_local_aggregation(data: DataConfig, examples: ImageExampleConfig, cache_dir: Path,
                              seed: int) -> PreparedData:
    """The image methods' data, training images read with their row `index`, and the training
    image count as `model.num_images`; the phases are added once the objective is resolved
    (`with_phases`)."""
    prepared = prepare_two_view_images(data, examples, cache_dir, seed)
    return dataclasses.replace(prepared, train=IndexedRecords(prepared.train),
                               model_fields={"num_images": len(prepared.train)})


def with_phases(prepared: PreparedData, model: LocalAggregationConfig,
                objective: LocalAggregationSettings, load: Loader | None = None) -> PreparedData:
    """`Resolution.complete_data`: the bank's size checked against the settings now that the
    data has set it (`check_bank`), then the warm-up and the rounds (`phases`)."""
    del load
    check_bank(model, objective)
    return dataclasses.replace(prepared, segments=phases(prepared.train, objective))


def check_bank(model: LocalAggregationConfig, objective: LocalAggregationSettings) -> None:
    """A bank (one row per training image) at least as large as the background set and the
    warm-up's noise draw, and more images than clusters; nothing to check before the data has
    set `model.num_images`."""
    if not model.num_images:
        return
    for name in ("background_neighbours", "instance_negatives"):
        if getattr(objective, name) > model.num_images:
            raise UserError(f"objective.{name}={getattr(objective, name)} exceeds the memory "
                            f"bank's {model.num_images} rows (one per training image); lower it")
    if objective.num_clusters >= model.num_images:
        raise UserError(f"objective.num_clusters={objective.num_clusters} must be below the "
                        f"{model.num_images} training images; lower it")


def check_local_aggregation(model: LocalAggregationConfig, examples: ImageExampleConfig,
                            objective: LocalAggregationSettings) -> None:
    """`Resolution.check`: host crops as the view's, and `check_bank`."""
    check_two_view_method(model, examples, objective)
    check_bank(model, objective)


def build_local_aggregation(config: LocalAggregationConfig, seed: int) -> LocalAggregation:
    with nnx.use_eager_sharding(False):
        return LocalAggregation(config, rngs=nnx.Rngs(seed))


# param_setter.py's optimiser (`MEMORY_BANK_SGD`; its weight decay skips BatchNorm, ours does
# not), the lr x0.1 at each of `lr_boundaries` (global steps, the warm-up's included).
PRESETS = {
    # Test size: a narrow ResNet-18 (CIFAR stem), 32-dimensional embeddings, 50 warm-up steps,
    # then 2 clusterings of 16 clusters re-made every 25 steps, 256 background neighbours.
    "local_aggregation_tiny": {
        "model": {"depth": 18, "stem": "cifar", "base_width": 8, "embedding_dim": 32,
                  "num_clusterings": 2},
        "objective": {"image_size": 32, "instance_steps": 50, "instance_negatives": 256,
                      "background_neighbours": 256, "num_clusters": 16, "recluster_every": 25},
        "optim": {**MEMORY_BANK_SGD, "decay_boundaries": "150,175"},
        "train": TINY_IMAGE_TRAIN,
    },
    # la_final.json `res18_IR` then `res18_LA` as one run: ResNet-18, batch 128, 10 warm-up
    # epochs (100,090 steps of IR), then LA to global step 2,001,800 (200 epochs of 10,009
    # steps), lr 0.03 x0.1 at steps 1,600,000 and 1,873,411; 10 clusterings of 30,000
    # clusters re-made every epoch, 4,096 background neighbours and noise samples, T 0.07,
    # m 0.5; crops of area 0.2-1 at 224 px.
    "local_aggregation_imagenet": {
        "model": {"depth": 18, "stem": "imagenet", "embedding_dim": 128,
                  "num_clusterings": 10},
        "objective": {"image_size": 224, "crop_area_min": 0.2, "instance_steps": 100090,
                      "instance_negatives": 4096, "background_neighbours": 4096,
                      "num_clusters": 30000, "recluster_every": 10009, "temperature": 0.07,
                      "momentum": 0.5, "kmeans_on_device": True},
        "examples": {"host_crop_size": 224, "host_crop_area_min": 0.2},
        "data": {"source": ""},
        "optim": {**MEMORY_BANK_SGD, "decay_boundaries": "1600000,1873411"},
        "train": {"steps": 2001800, "batch_size": 128, "eval_every": 10009,
                  "checkpoint_every": 10009},
    },
    # The same recipe at CIFAR-10 size (ours; the paper trains on ImageNet only): ResNet-18
    # with the CIFAR stem, batch 128, 10 warm-up epochs of 390 steps, 200 epochs in all,
    # lr x0.1 at epochs 160 and 187 as res18_LA; 10 clusterings of 1,000 clusters (the
    # ImageNet ratio of 30,000 clusters to 1.28 M images is one per 43; CIFAR-10's 50,000
    # images at that ratio give 1,170), 4,096 neighbours.
    "local_aggregation_cifar10": {
        "model": {"depth": 18, "stem": "cifar", "embedding_dim": 128, "num_clusterings": 10},
        "objective": {"image_size": 32, "crop_area_min": 0.2, "instance_steps": 3900,
                      "instance_negatives": 4096, "background_neighbours": 4096,
                      "num_clusters": 1000, "recluster_every": 390},
        "data": {"source": ""},
        "optim": {**MEMORY_BANK_SGD, "decay_boundaries": "62400,72930"},
        "train": {"steps": 78000, "batch_size": 128, "eval_every": 3900,
                  "checkpoint_every": 3900},
    },
}


register(Method(
    name="local_aggregation",
    model_config=LocalAggregationConfig,
    example_config=ImageExampleConfig,
    objective_config=LocalAggregationSettings,
    build_model=build_local_aggregation,
    loss=local_aggregation_loss,
    prepare=prepare_local_aggregation,
    units_per_example=lambda examples: 1,
    unit="images",
    description="Local Aggregation: close neighbours from k-means over a memory bank against "
                "background neighbours, after an instance-recognition warm-up (Zhuang et al. "
                "2019)",
    presets=PRESETS,
    resolution=Resolution(check=check_local_aggregation, complete_data=with_phases),
    evaluation=Evaluation(monitor=knn_monitor,
                          summarize=knn_summary()),
))
