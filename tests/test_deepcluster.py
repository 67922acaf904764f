"""DeepCluster: the clustering step against plain numpy, the sampler's statistics, the loss, the
Sobel filter, training from the CLI, an exact resume after a kill (pseudo-labels included) and
the sharded step."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from resilience_utils import GRADIENT_STEP, abort_and_resume, assert_same_training, run_in_process
from tfds_utils import write_colour_folder

from pretext_jax import run
from pretext_jax.errors import UserError
from pretext_jax.models.deepcluster import SOBEL_X, sobel
from pretext_jax.objectives.common import clustering
from pretext_jax.objectives.common.clustering import (
    SPLIT_EPS,
    kmeans,
    pca_whiten,
    split_empty_clusters,
    uniform_cluster_order,
    whiten,
)
from pretext_jax.objectives.deepcluster import pseudo_label_loss
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer


def simple_kmeans(points: np.ndarray, k: int, iterations: int, seed: int):
    """Lloyd's algorithm written plainly: a loop over points for the assignment, a loop over
    clusters for the means, from the same k points kmeans draws."""
    init = np.sort(np.random.default_rng(seed).choice(len(points), k, replace=False))
    centroids = points[init].astype(np.float64)

    def nearest(c):
        return np.array([int(np.argmin([np.sum((p - ci) ** 2) for ci in c])) for p in points])

    for _ in range(iterations):
        labels = nearest(centroids)
        centroids = np.stack([points[labels == j].mean(axis=0) for j in range(k)])
    return centroids, nearest(centroids)


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_kmeans_equals_a_plain_numpy_kmeans_on_the_same_seeds(on_device, monkeypatch):
    """On the host (numpy, float64 distances) and on the device (jax, float32, here in chunks
    of 7 points: 120 is no multiple, so the last chunk is padded)."""
    monkeypatch.setattr(clustering, "DEVICE_DISTANCES", 7 * 5)
    rng = np.random.default_rng(0)
    centres = rng.normal(0, 4, (5, 3))
    points = (centres[rng.integers(0, 5, 120)] + rng.normal(0, 1, (120, 3))).astype(np.float32)
    for seed in (0, 1, 2):
        centroids, labels, splits = kmeans(points, 5, 6, seed, on_device=on_device)
        expected_centroids, expected_labels = simple_kmeans(points, 5, 6, seed)
        assert splits == 0
        np.testing.assert_array_equal(labels, expected_labels)
        np.testing.assert_allclose(centroids, expected_centroids, rtol=1e-5, atol=1e-5)
    again = kmeans(points, 5, 6, 1, on_device=on_device)
    np.testing.assert_array_equal(again[1], kmeans(points, 5, 6, 1, on_device=on_device)[1])
    with pytest.raises(UserError, match="^model.num_clusters=120 must be below the 120 "):
        kmeans(points, 120, 6, 0, setting="model.num_clusters")  # DeepCluster's setting


def test_empty_clusters_are_split_from_a_non_empty_one():
    """faiss `split_clusters`: the empty cluster takes a donor's centroid, the two moved apart
    by a relative 1/1024 with alternating signs, the donor's count halved between them."""
    centroids = np.array([[1.0, 2.0, 3.0], [9.0, 9.0, 9.0], [4.0, 4.0, 4.0]])
    counts = np.array([0, 9, 1])
    before = centroids.copy()
    assert split_empty_clusters(centroids, counts, np.random.default_rng(0)) == 1
    sign = np.array([1.0, -1.0, 1.0])
    # cluster 2 holds one point (probability 0 of being split): the donor is cluster 1
    np.testing.assert_allclose(centroids[0], before[1] * (1 - sign * SPLIT_EPS))
    np.testing.assert_allclose(centroids[1], before[1] * (1 + sign * SPLIT_EPS))
    np.testing.assert_array_equal(counts, [4, 5, 1])
    # In k-means: duplicate initial centroids leave clusters empty; each is re-seeded and every
    # cluster ends with points.
    rng = np.random.default_rng(1)
    points = np.concatenate([np.tile([[1.0, 2.0]], (8, 1)), [1.0, 2.0] + rng.normal(0, 0.1, (8, 2)),
                             [6.0, 6.0] + rng.normal(0, 0.1, (8, 2))]).astype(np.float32)
    seed = next(s for s in range(100)
                if np.sum(np.random.default_rng(s).choice(24, 3, replace=False) < 8) >= 2)
    for on_device in (False, True):
        _, labels, splits = kmeans(points, 3, 5, seed, on_device=on_device)
        assert splits >= 1
        assert np.bincount(labels, minlength=3).min() > 0


def test_pca_whitening_gives_identity_covariance_on_the_kept_axes_and_unit_rows():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 12)) @ rng.normal(size=(12, 12)) + 3.0
    white = whiten(x, 5)
    np.testing.assert_allclose(np.cov(white.T, bias=True), np.eye(5), atol=1e-6)
    # the kept axes are the top principal ones: |projections| match numpy's SVD
    u, s, _ = np.linalg.svd(x - x.mean(0), full_matrices=False)
    np.testing.assert_allclose(np.abs(white), np.abs(u[:, :5]) * np.sqrt(400), atol=1e-6)
    normalised = pca_whiten(x, 5)
    np.testing.assert_allclose(np.linalg.norm(normalised, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(normalised, white / np.linalg.norm(white, axis=1, keepdims=True),
                               rtol=1e-5, atol=1e-6)


def test_uniform_cluster_order_draws_every_non_empty_cluster_equally():
    """UnifLabelSampler: n // c + 1 draws from each of the c non-empty clusters (with
    replacement only for small ones), shuffled, cut to n."""
    labels = np.array([0] * 1 + [2] * 5 + [3] * 3000 + [5] * 200)  # 1 and 4 are empty
    order = uniform_cluster_order(labels, 2000, np.random.default_rng(0))
    assert len(order) == 2000
    counts = np.bincount(labels[order], minlength=6)
    assert counts[1] == counts[4] == 0
    assert all(499 <= counts[c] <= 501 for c in (0, 2, 3, 5)), counts
    big = order[labels[order] == 3]
    assert len(np.unique(big)) == len(big)  # 3000 members > 501 draws: without replacement
    assert set(order[labels[order] == 2]) == set(range(1, 6))
    assert not np.array_equal(order[:50], np.sort(order[:50]))  # shuffled
    np.testing.assert_array_equal(order, uniform_cluster_order(labels, 2000,
                                                               np.random.default_rng(0)))


def test_pseudo_label_loss_and_gradient_against_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 7)).astype(np.float32)
    labels = rng.integers(0, 7, 6).astype(np.int32)
    loss, metrics = pseudo_label_loss(jnp.asarray(logits), jnp.asarray(labels))
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    expected = -np.mean(np.log(p[np.arange(6), labels]))
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert float(metrics["cluster_accuracy"][0]) == np.sum(logits.argmax(1) == labels)
    grad = jax.grad(lambda z: pseudo_label_loss(z, jnp.asarray(labels))[0])(jnp.asarray(logits))
    np.testing.assert_allclose(grad, (p - np.eye(7)[labels]) / 6, atol=1e-6)


def test_sobel_filter_against_a_numpy_convolution():
    rng = np.random.default_rng(0)
    images = rng.random((2, 6, 5, 3)).astype(np.float32)
    # deepcluster models/alexnet.py: a 1x1 grayscale conv with every weight 1/3, then Sobel.
    gray = np.pad(images.mean(-1), ((0, 0), (1, 1), (1, 1)))
    kx = np.array(SOBEL_X)
    expected = np.zeros((2, 6, 5, 2))
    for i in range(6):
        for j in range(5):
            window = gray[:, i:i + 3, j:j + 3]
            expected[:, i, j] = np.stack([np.sum(window * kx, (1, 2)),
                                          np.sum(window * kx.T, (1, 2))], axis=-1)
    np.testing.assert_allclose(sobel(jnp.asarray(images)), expected, atol=1e-5)
    flat = sobel(jnp.full((1, 5, 5, 3), 0.7))
    np.testing.assert_allclose(flat[0, 1:-1, 1:-1], 0.0, atol=1e-6)  # no edges inside


@pytest.fixture(scope="module")
def colour_folder(tmp_path_factory):
    """A CIFAR-10-format folder of 192 images of 8 noisy colours (160 training images)."""
    return write_colour_folder(tmp_path_factory.mktemp("colours"))


def small(data: str, workdir, **overrides) -> dict:
    """deepcluster_tiny at test size (a ResNet-10 4 channels wide): 8 clusters of
    8-dimensional features, a new clustering every 4 steps, batch 16, a train row every step."""
    return {"data.source": data, "data.cache_dir": str(workdir / "cache"),
            "model.depth": 10, "model.base_width": 4, "model.num_clusters": 8,
            "objective.image_size": 16, "objective.pca_dim": 8, "objective.recluster_every": 4,
            "train.batch_size": 16, "train.steps": 8, "train.log_every": 1,
            "train.eval_every": 1000, "train.eval_batches": 1, "train.checkpoint_every": 3,
            "train.progress": False,
            **overrides}


def test_cli_trains_the_tiny_preset_with_falling_loss(tmp_path, colour_folder):
    """`run.py pretrain --preset deepcluster_tiny` with the Sobel input (Adam: SGD needs far
    more steps at this size): the head restarts at every clustering, and within the second
    round the loss falls well below the chance level log 8; the kNN monitor runs."""
    settings = small(colour_folder, tmp_path, **{
        "train.steps": 16, "train.eval_every": 16, "train.batch_size": 32,
        "objective.recluster_every": 8, "model.sobel": True, "optim.optimizer": "adamw",
        "optim.bias_correction": True, "optim.learning_rate": 1e-2})
    args = [f"{key}={value}" for key, value in settings.items() if key != "data.source"]
    assert run.main(["pretrain", "--preset", "deepcluster_tiny", "--data", colour_folder,
                     "--workdir", str(tmp_path / "run"), *args]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    losses = [row["loss"] for row in rows if row["split"] == "train"]
    assert losses[0] == pytest.approx(np.log(8), abs=0.1)  # a fresh head: N(0, 0.01) weights
    assert np.mean(losses[-3:]) < np.mean(losses[8:11]) - 0.3, losses
    assert losses[-1] < np.log(8) - 0.4, losses
    assert any(row["split"] == "eval" and 0 <= row["knn_accuracy"] <= 1 for row in rows)


def test_killed_run_resumes_exactly_with_its_cluster_state(tmp_path, colour_folder):
    """Killed in place of step 7 (`abort_and_resume`; rounds begin at steps 1 and 5, so the
    rerun resumes from the step-6 checkpoint inside a round: the round's order is rebuilt from
    the checkpointed pseudo-labels): the same batches, losses, parameters and pseudo-labels as
    a run never interrupted."""
    overrides = small(colour_folder, tmp_path)
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process("deepcluster_tiny", overrides, *reference)
    ours = abort_and_resume("deepcluster_tiny", overrides, tmp_path, step=7)
    executed = assert_same_training("deepcluster_tiny", overrides, ours, reference)
    assert len(executed) > 8
    labels = []
    for workdir, _ in (ours, reference):
        trainer = Trainer(make_config("deepcluster_tiny", overrides), workdir)
        state, _ = trainer.checkpoints.restore_latest_readable()
        trainer.checkpoints.close()
        labels.append(np.asarray(jax.device_get(state.model_state["labels"].get_value())))
    np.testing.assert_array_equal(*labels)
    assert len(labels[0]) == 160 and len(np.unique(labels[0])) > 1


def test_sharded_step_equals_the_single_device_step(tmp_path, colour_folder):
    """The first step (clustering, then one gradient step; with momentum 0.9 the first update
    is still -lr x gradient) on one device and on data x fsdp x tensor = 2 x 2 x 2: the same
    pseudo-labels, loss and parameters. The next round's start re-initialises the head and
    zeroes its momentum only."""
    layouts = {"single": ((1, 1, 1), jax.devices()[:1]), "mixed": ((2, 2, 2), None)}
    results = {}
    for name, (mesh, devices) in layouts.items():
        values = small(colour_folder, tmp_path, **{
            **GRADIENT_STEP, "optim.learning_rate": 0.1, "optim.momentum": 0.9,
            "mesh.data": mesh[0],
            "mesh.fsdp": mesh[1], "mesh.tensor": mesh[2]})
        trainer = Trainer(make_config("deepcluster_tiny", values), tmp_path / name,
                          devices=devices)
        state = begin_round(trainer, trainer.init_state(), 0)
        state, metrics = trainer.train_step(state, next(trainer.data_iterator(state)))
        params = {jax.tree_util.keystr(k): np.asarray(v) for k, v in
                  jax.tree_util.tree_leaves_with_path(jax.device_get(state.params))}
        labels = np.asarray(jax.device_get(state.model_state["labels"].get_value()))
        results[name] = float(metrics["loss"][0]), params, labels
        if name == "single":
            check_next_round(trainer, state)
    loss0, params0, labels0 = results["single"]
    assert loss0 == pytest.approx(np.log(8), abs=0.1)
    for name, (loss, params, labels) in results.items():
        np.testing.assert_array_equal(labels, labels0, err_msg=name)
        assert loss == pytest.approx(loss0, rel=1e-5), name
        for key, value in params0.items():
            np.testing.assert_allclose(params[key], value, atol=2e-6, rtol=1e-5,
                                       err_msg=f"{name} {key}")


def begin_round(trainer: Trainer, state, index: int):
    """The state after the trainer begins round `index` (its segment's `begin`)."""
    first = index * trainer.objective.recluster_every + 1
    return trainer.begin_segment(state, trainer.data.segment(first, trainer.config))


def check_next_round(trainer: Trainer, state) -> None:
    """The next round's `begin`: a new N(0, 0.01) head with zero momentum; the backbone's
    momentum and parameters kept."""
    new = begin_round(trainer, state, 1)

    def leaves(tree):
        return {jax.tree_util.keystr(k): np.asarray(v)
                for k, v in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))}

    old_params, new_params = leaves(state.params), leaves(new.params)
    head = [k for k in new_params if k.startswith("['head']")]
    assert head and all(not np.array_equal(old_params[k], new_params[k]) for k in head)
    kernel = next(k for k in head if "kernel" in k)
    assert np.std(new_params[kernel]) == pytest.approx(0.01, rel=0.2)
    assert all(np.array_equal(old_params[k], v) for k, v in new_params.items() if k not in head)
    momentum = leaves(new.opt_state)
    assert any("'head'" in k for k in momentum)
    assert all(not v.any() for k, v in momentum.items() if "'head'" in k)
    assert any(v.any() for k, v in momentum.items() if "'backbone'" in k)
