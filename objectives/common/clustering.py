"""DeepCluster's clustering step on the host, in numpy (Caron et al. 2018 §3.2-3.3;
facebookresearch/deepcluster clustering.py, util.py), deterministic for a seed:

- `pca_whiten`: PCA to `dim` dimensions with whitening (the reference's faiss
  `PCAMatrix(d, dim, eigen_power=-0.5)`), then L2-normalised rows (`preprocess_features`);
- `kmeans`: Lloyd's iterations from `k` distinct training points drawn at random (faiss
  `Clustering`'s initialisation, which the reference uses with 20 iterations), with faiss's
  re-seeding of empty clusters (`split_clusters`, the paper's §3.3 "empty clusters"): an empty
  cluster takes the centroid of a non-empty one (faiss visits the clusters in turn and takes
  each with probability (size - 1) / (n - k)), both moved apart by a relative 1/1024 in
  alternating directions, and the donor's points are split between the two at the next
  assignment. `on_device=True` runs each iteration's assignments and per-cluster sums on the
  accelerator (`device_lloyd_step`, jax, float32, chunks of rows: the faiss-on-GPU of the
  reference), the centroid update and the re-seeding on the host as before;
- `uniform_cluster_order`: the reference's `UnifLabelSampler`: n images drawn uniformly over the
  non-empty clusters (each cluster gives floor(n / non-empty) + 1 images, with replacement only
  when it is too small), shuffled, cut (or repeated) to n.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.progress import progress

SPLIT_EPS = 1.0 / 1024.0  # faiss Clustering.cpp's EPS for split centroids
WHITEN_EPS = 1e-8  # added to the eigenvalues before whitening (faiss adds none)


def pca_whiten(features: np.ndarray, dim: int) -> np.ndarray:
    """[N, d] -> [N, dim]: `whiten`, then L2-normalised rows (`preprocess_features`)."""
    whitened = whiten(features, dim)
    norms = np.linalg.norm(whitened, axis=1, keepdims=True)
    return (whitened / np.maximum(norms, 1e-12)).astype(np.float32)


def whiten(features: np.ndarray, dim: int) -> np.ndarray:
    """[N, d] -> [N, dim] float64: centred, projected on the top `dim` principal axes, each
    divided by the square root of its eigenvalue (unit variance, uncorrelated)."""
    x = np.asarray(features, np.float64)
    if dim > min(x.shape):
        raise UserError(f"objective.pca_dim={dim} exceeds the features' rank bound "
                        f"{min(x.shape)} ({x.shape[0]} images of {x.shape[1]} features); lower it")
    x = x - x.mean(axis=0)
    eigenvalues, eigenvectors = np.linalg.eigh(x.T @ x / x.shape[0])
    top = np.argsort(eigenvalues)[::-1][:dim]
    return (x @ eigenvectors[:, top]) / np.sqrt(eigenvalues[top] + WHITEN_EPS)


def assign(points: np.ndarray, centroids: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """Index of the nearest centroid (squared Euclidean, ties to the lowest index) per point."""
    squared = np.sum(centroids.astype(np.float64) ** 2, axis=1)
    return np.concatenate([
        np.argmin(squared - 2.0 * points[i:i + chunk].astype(np.float64) @ centroids.T.astype(
            np.float64), axis=1) for i in range(0, len(points), chunk)]).astype(np.int32)


def split_empty_clusters(centroids: np.ndarray, counts: np.ndarray, rng: np.random.Generator
                         ) -> int:
    """Re-seeds every empty cluster in place (faiss `split_clusters`); `counts` are updated as
    if the donor's points were split evenly. Returns how many were re-seeded."""
    k, splits = len(counts), 0
    total = counts.sum()
    for empty in np.flatnonzero(counts == 0):
        donor = 0  # faiss walks the clusters in turn, taking each w.p. (size - 1) / (n - k)
        while rng.random() * (total - k) >= counts[donor] - 1:
            donor = (donor + 1) % k
        sign = np.where(np.arange(centroids.shape[1]) % 2 == 0, 1.0, -1.0)
        centroids[empty] = centroids[donor] * (1 - sign * SPLIT_EPS)
        centroids[donor] = centroids[donor] * (1 + sign * SPLIT_EPS)
        counts[empty] = counts[donor] // 2
        counts[donor] -= counts[empty]
        splits += 1
    return splits


# An iteration's step: (assignment of each point, per-cluster sums [k, d] and counts [k]) for
# the centroids [k, d] it is given.
LloydStep = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]
DEVICE_DISTANCES = 2**26  # distances per chunk on the device (256 MB of float32)


def kmeans(points: np.ndarray, k: int, iterations: int, seed: int,
           setting: str = "objective.num_clusters", on_device: bool = False
           ) -> tuple[np.ndarray, np.ndarray, int]:
    """(centroids [k, d], assignments [N], empty clusters re-seeded) of `iterations` Lloyd
    steps from k distinct points drawn with `seed`. Each step assigns every point to its
    nearest centroid, moves each centroid to the mean of its points and re-seeds the empty
    ones; the returned assignments are to the final centroids. `setting`: the config key of
    k, which a refusal names. `on_device`: assignments and sums on the accelerator
    (`device_lloyd_step`), else in numpy (float64 distances)."""
    points = np.asarray(points, np.float32)
    if k >= len(points):
        raise UserError(f"{setting}={k} must be below the {len(points)} training images; "
                        "lower it")
    rng = np.random.default_rng(seed)
    centroids = points[np.sort(rng.choice(len(points), k, replace=False))].astype(np.float64)
    step = device_lloyd_step(points) if on_device else host_lloyd_step(points)
    splits = 0
    for _ in progress(range(iterations), f"k-means (k={k})", unit="iteration"):
        _, sums, counts = step(centroids)
        filled = counts > 0
        centroids[filled] = sums[filled] / counts[filled, None]
        splits += split_empty_clusters(centroids, counts, rng)
    return centroids.astype(np.float32), step(centroids)[0], splits


def host_lloyd_step(points: np.ndarray) -> LloydStep:
    """Lloyd's assignment and sums in numpy (`assign`: float64 distances)."""
    def step(centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        labels = assign(points, centroids)
        sums = np.zeros(centroids.shape, np.float64)
        np.add.at(sums, labels, points)
        return labels, sums, np.bincount(labels, minlength=len(centroids))
    return step


def device_lloyd_step(points: np.ndarray) -> LloydStep:
    """Lloyd's assignment and sums on the default jax device: the points go there once, each
    call sends the centroids (float32) and brings back the assignments, sums and counts. The
    distances of `DEVICE_DISTANCES // k` points at a time (ties to the lowest index)."""
    on_device = jnp.asarray(points, jnp.float32)

    def step(centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        chunk = max(1, min(len(points), DEVICE_DISTANCES // len(centroids)))
        labels, sums, counts = jax.device_get(_lloyd_sums(
            on_device, jnp.asarray(centroids, jnp.float32), chunk=chunk))
        return (np.asarray(labels, np.int32), np.asarray(sums, np.float64),
                np.asarray(counts, np.int64))
    return step


@functools.partial(jax.jit, static_argnames="chunk")
def _lloyd_sums(points: jax.Array, centroids: jax.Array, chunk: int
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    count, k = points.shape[0], centroids.shape[0]
    squared = jnp.sum(centroids * centroids, axis=1)
    padded = jnp.pad(points, ((0, -count % chunk), (0, 0)))

    def nearest(rows: jax.Array) -> jax.Array:
        return jnp.argmin(squared[None, :] - 2.0 * rows @ centroids.T, axis=1)

    labels = jax.lax.map(nearest, padded.reshape(-1, chunk, points.shape[1])).reshape(-1)[:count]
    sums = jax.ops.segment_sum(points, labels, num_segments=k)
    counts = jax.ops.segment_sum(jnp.ones(count, jnp.int32), labels, num_segments=k)
    return labels, sums, counts


def uniform_cluster_order(labels: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """n image indices drawn uniformly over the non-empty clusters of `labels` (the
    reference's `UnifLabelSampler.generate_indexes_epoch`)."""
    members = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    per_cluster = n // len(members) + 1
    order = np.concatenate([rng.choice(m, per_cluster, replace=len(m) <= per_cluster)
                            for m in members])
    rng.shuffle(order)
    return np.resize(order, n).astype(np.int64)
