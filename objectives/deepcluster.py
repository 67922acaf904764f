"""DeepCluster (Caron et al. 2018 "Deep Clustering for Unsupervised Learning of Visual
Features"; facebookresearch/deepcluster main.py, clustering.py, util.py).

Training alternates, in rounds of `objective.recluster_every` steps (the reference: one epoch):
1. at the start of a round (`begin_round`), the backbone's evaluation-mode features of every
   training image (streamed in batches of `objective.cluster_batch_size`; only the [N, d]
   features are kept), PCA-whitened to `objective.pca_dim` and L2-normalised, are clustered
   by k-means into `model.num_clusters` groups (`objectives.common.clustering`, numpy, seeded by the
   run's seed and the round; empty clusters re-seeded as the paper's §3.3); the assignments
   become the images' pseudo-labels (model state, so checkpointed) and the top layer is
   re-initialised, its optimizer moments restarting from zero (main.py builds a new top-layer
   optimizer every epoch);
2. the round's images are `recluster_every x train.batch_size` draws uniform over the non-empty
   clusters (`clustering.uniform_cluster_order`, the reference's `UnifLabelSampler`, seeded by
   the run's seed and the round), read in that order (`ClusterRound`);
3. each step: random resized crop and flip (main.py's training transform), the network
   (optionally behind the Sobel filter) and cross-entropy against the pseudo-labels.

A resume rebuilds the round's order from the checkpointed pseudo-labels, the seed and the
round, then moves the loader to its checkpointed position: it is exact.

Held-out images have no pseudo-labels, so evaluation reports no loss; the kNN monitor measures
the backbone. Departures: k-means++ is not used (faiss's random initialisation is, as the
reference); the reference's clustering draws a fresh random seed each epoch, here it is derived
from `train.seed` and the round so that runs repeat; the top layer is trained by the run's
optimizer (momentum included), where main.py gives it its own SGD without momentum.
"""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.descriptions import describe
from pretext_jax.input_pipeline.indexed import WithField
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.models.deepcluster import DeepCluster, DeepClusterConfig
from pretext_jax.objectives.common.clustering import kmeans, pca_whiten, uniform_cluster_order
from pretext_jax.objectives.common.preset_parts import TINY_IMAGE_TRAIN
from pretext_jax.objectives.common.two_view import (
    ImageExampleConfig,
    ViewSettings,
    backbone_features,
    check_host_crops,
    cropped_and_flipped,
    knn_monitor,
    knn_summary,
    prepare_two_view_images,
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
from pretext_jax.progress import progress


@dataclasses.dataclass(frozen=True)
class DeepClusterSettings(ViewSettings):
    """The `objective` section: the round length `recluster_every` (steps), the clustering's
    `pca_dim` (256) and `kmeans_iterations` (20, the reference's faiss setting), the batch of
    the feature pass `cluster_batch_size`, and the view (`image_size`, `crop_area_min`, flip:
    torchvision's RandomResizedCrop and RandomHorizontalFlip as main.py)."""

    recluster_every: int = 1000
    """Steps between clusterings (the paper: one epoch, N / batch_size steps)."""
    pca_dim: int = 256
    """Dimensions kept by the PCA-whitening before k-means (the paper: 256)."""
    kmeans_iterations: int = 20
    """Lloyd iterations of k-means (the reference's faiss `niter` 20)."""
    kmeans_on_device: bool = False
    """Run the k-means' assignments on the accelerator (as the reference's faiss on a GPU),
    float32; false: numpy on the host, float64 distances."""
    cluster_batch_size: int = 256
    """Images per batch of the feature pass over the training set."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("recluster_every", "pca_dim", "kmeans_iterations", "cluster_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


def pseudo_label_loss(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, Metrics]:
    """Mean cross-entropy of `logits` [B, K] against pseudo-labels [B]; metrics: the loss and
    the top-1 accuracy on the pseudo-labels."""
    logits = logits.astype(jnp.float32)
    per_image = jax.nn.logsumexp(logits, axis=1) - jnp.take_along_axis(
        logits, labels[:, None], axis=1)[:, 0]
    count = jnp.float32(labels.shape[0])
    correct = jnp.sum(jnp.argmax(logits, axis=1) == labels).astype(jnp.float32)
    loss = jnp.mean(per_image)
    return loss, {"loss": (loss, jnp.ones((), jnp.float32)),
                  "cluster_loss": (jnp.sum(per_image), count),
                  "cluster_accuracy": (correct, count)}


def deepcluster_loss(model: DeepCluster, batch: Batch, rng: jax.Array | None, *,
                     objective: DeepClusterSettings | None = None
                     ) -> tuple[jax.Array, Metrics]:
    """One DeepCluster step on the round's images, whose `label` is the pseudo-label; `rng=None`
    (evaluation: held-out images have no pseudo-label) gives no metrics."""
    objective = objective or DeepClusterSettings()
    if rng is None:
        return jnp.zeros((), jnp.float32), {}
    views = cropped_and_flipped(rng, batch["image"], objective)
    return pseudo_label_loss(model(views, train=True), batch["label"])


class ClusterRound:
    """One round's training records for Grain, read in order: record i is training image
    `order[i]` with its pseudo-label as `label` (`indexed.WithField`). Its description (kept in
    checkpoints) names the training images, the round and checksums of the labels and the
    order."""

    def __init__(self, train: Any, labels: np.ndarray, order: np.ndarray, round_index: int):
        self.train, self.labels, self.order = train, labels, order
        self.source = self
        self.description = describe(
            "deepcluster_round", train=repr(train.source), round=round_index,
            pseudo_labels_crc32=zlib.crc32(labels.astype(np.int32).tobytes()),
            order_crc32=zlib.crc32(order.astype(np.int64).tobytes()))

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, index: int) -> dict[str, Any]:
        image = int(self.order[index])
        return self.train.source[image], np.int32(self.labels[image])

    def __repr__(self) -> str:
        return self.description

    def load_transforms(self) -> list[Any]:
        return [WithField(self.train.load_transforms(), "label")]


def round_seed(seed: int, round_index: int, purpose: int) -> np.random.Generator:
    """The numpy generator of a round's k-means (purpose 0) or sampling order (purpose 1)."""
    return np.random.default_rng([seed, round_index, purpose])


def training_features(model: DeepCluster, train: Any, objective: DeepClusterSettings
                      ) -> np.ndarray:
    """The backbone's evaluation-mode features [N, d] of every training image, in batches."""
    count, size = len(train), objective.cluster_batch_size
    starts = range(0, count, size)
    return np.concatenate([
        np.asarray(backbone_features(model, train.examples(range(i, min(i + size, count)))[
            "image"], objective.image_size), np.float32)
        for i in progress(starts, "features to cluster", total=len(starts), unit="batch")])


def begin_round(model: DeepCluster, train: Any, objective: DeepClusterSettings, seed: int,
                round_index: int) -> tuple[str, ...]:
    """Clusters the training set's features into new pseudo-labels and re-initialises the top
    layer (module docstring, step 1); the head's optimizer state restarts."""
    points = pca_whiten(training_features(model, train, objective), objective.pca_dim)
    seed_k = int(round_seed(seed, round_index, 0).integers(2**31))
    _, labels, _ = kmeans(points, model.config.num_clusters, objective.kmeans_iterations, seed_k,
                          setting="model.num_clusters", on_device=objective.kmeans_on_device)
    model.labels.set_value(jnp.asarray(labels))
    model.reinitialise_head(jax.random.fold_in(jax.random.key(seed), round_index))
    return ("head",)


def round_source(model: DeepCluster, train: Any, objective: DeepClusterSettings, seed: int,
                 round_index: int, batch_size: int) -> ClusterRound:
    """The round's cluster-uniform image order (module docstring, step 2)."""
    labels = np.asarray(jax.device_get(model.labels.get_value()))
    order = uniform_cluster_order(labels, objective.recluster_every * batch_size,
                                  round_seed(seed, round_index, 1))
    return ClusterRound(train, labels, order, round_index)


def rounds(train: Any, objective: DeepClusterSettings) -> Segments:
    """`PreparedData.segments`: round r is steps r x `recluster_every` + 1 onwards, begun by a
    clustering (`begin_round`) and read in its cluster-uniform order (`round_source`), which
    depends only on the checkpointed pseudo-labels, the run's seed and r, so a resume is
    exact."""
    every = objective.recluster_every

    def segment(step: int, config: Any) -> Segment:
        index, seed = (step - 1) // every, config.train.seed
        return Segment(
            first_step=index * every + 1, last_step=(index + 1) * every, shuffle=False,
            records=lambda model: round_source(model, train, objective, seed, index,
                                               config.train.batch_size),
            begin=lambda model: begin_round(model, train, objective, seed, index))

    return segment


def prepare_deepcluster(data: DataConfig, examples: ImageExampleConfig, cache_dir: Path,
                        seed: int) -> PreparedData:
    """The image methods' data, with the training image count as `model.num_images`; the
    rounds are added once the objective is resolved (`with_rounds`)."""
    prepared = prepare_two_view_images(data, examples, cache_dir, seed)
    return dataclasses.replace(prepared, model_fields={"num_images": len(prepared.train)})


def with_rounds(prepared: PreparedData, model: DeepClusterConfig,
                objective: DeepClusterSettings, load: Loader | None = None) -> PreparedData:
    """`Resolution.complete_data`: the training steps in rounds (`rounds`)."""
    del model, load
    return dataclasses.replace(prepared, segments=rounds(prepared.train, objective))


def check_deepcluster(model: DeepClusterConfig, examples: ImageExampleConfig,
                      objective: DeepClusterSettings) -> None:
    """Host crops of the view's size; no more PCA dimensions than features; fewer clusters
    than training images."""
    check_host_crops(model, examples, objective)
    features = model.backbone_config().features
    if objective.pca_dim > features:
        raise UserError(f"objective.pca_dim={objective.pca_dim} exceeds the backbone's "
                        f"{features} features; lower it")
    if model.num_images and model.num_clusters >= model.num_images:
        raise UserError(f"model.num_clusters={model.num_clusters} must be below the "
                        f"{model.num_images} training images; lower it")


def build_deepcluster(config: DeepClusterConfig, seed: int) -> DeepCluster:
    with nnx.use_eager_sharding(False):
        return DeepCluster(config, rngs=nnx.Rngs(seed))


PRESETS = {
    # Test size: a narrow ResNet-18 with the CIFAR stem, 32 clusters of 16-dimensional whitened
    # features, a new clustering every 50 steps.
    "deepcluster_tiny": {
        "model": {"depth": 18, "stem": "cifar", "base_width": 8, "num_clusters": 32},
        "objective": {"image_size": 32, "recluster_every": 50, "pca_dim": 16},
        "optim": {"optimizer": "sgd", "learning_rate": 0.05, "schedule": "constant",
                  "warmup_steps": 0, "weight_decay": 1e-5, "momentum": 0.9, "clip_norm": 0.0},
        "train": TINY_IMAGE_TRAIN,
    },
    # The paper's recipe (§4 "Implementation details"; main.py defaults) at CIFAR-10 size: Sobel
    # input, SGD momentum 0.9, constant lr 0.05, weight decay 1e-5, batch 256, re-clustering
    # every epoch (50,000 / 256 = 195 steps), PCA to 256 dimensions, 20 k-means iterations;
    # ResNet-18 with the CIFAR stem instead of AlexNet / VGG-16, and k = 100 clusters (10x the
    # classes, the paper's ratio of 10,000 clusters to ImageNet's 1,000 classes).
    "deepcluster_cifar10": {
        "model": {"depth": 18, "stem": "cifar", "num_clusters": 100, "sobel": True},
        "objective": {"image_size": 32, "recluster_every": 195, "pca_dim": 256},
        "data": {"source": ""},
        "optim": {"optimizer": "sgd", "learning_rate": 0.05, "schedule": "constant",
                  "warmup_steps": 0, "weight_decay": 1e-5, "momentum": 0.9, "clip_norm": 0.0},
        "train": {"steps": 97500, "batch_size": 256, "eval_every": 1950,
                  "checkpoint_every": 1950},
    },
}


register(Method(
    name="deepcluster",
    model_config=DeepClusterConfig,
    example_config=ImageExampleConfig,
    objective_config=DeepClusterSettings,
    build_model=build_deepcluster,
    loss=deepcluster_loss,
    prepare=prepare_deepcluster,
    units_per_example=lambda examples: 1,
    unit="images",
    description="DeepCluster: k-means pseudo-labels of the features, re-clustered every round "
                "(Caron et al. 2018)",
    presets=PRESETS,
    resolution=Resolution(check=check_deepcluster, complete_data=with_rounds),
    evaluation=Evaluation(monitor=knn_monitor, summarize=knn_summary(("loss", "cluster_accuracy"))),
))
