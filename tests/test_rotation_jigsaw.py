"""Rotation (RotNet) and Jigsaw: the rotations against np.rot90, RotNet's padded crop, the
jigsaw permutation set (size, uniqueness, Hamming distances, the paper's greedy algorithm
written plainly), the tile layout (window, cells, random gaps, channel jitter, per-tile
normalisation, grayscale share), the shuffle and its inverse, both losses and their head
gradients against numpy; on a CIFAR-format folder of oriented images both tiny presets train
on the 8-device mesh with falling losses and the kNN monitor, a sharded step equals the
single-device one, a killed run resumes bit for bit, and the CLI runs them."""

from __future__ import annotations

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from resilience_utils import GRADIENT_STEP, abort_and_resume, assert_same_training, run_in_process
from tfds_utils import write_cifar10_folder

from pretext_jax import run
from pretext_jax.bench.image_cifar10 import decay_boundaries as bench_boundaries
from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import image_augment, jigsaw
from pretext_jax.models.image_tasks import JigsawConfig
from pretext_jax.models.resnet import ResNetConfig
from pretext_jax.objectives.jigsaw import JigsawSettings, build_jigsaw, jigsaw_loss, puzzles
from pretext_jax.objectives.rotation import (
    RotationSettings,
    build_rotation,
    rotated_batch,
    rotation_loss,
)
from pretext_jax.pretrain.config import OptimConfig, make_config
from pretext_jax.pretrain.loading import load_model
from pretext_jax.pretrain.optim import learning_rate_schedule, make_optimizer
from pretext_jax.pretrain.trainer import Trainer

TINY_NET = dict(depth=10, stem="cifar", base_width=2)


def uint8_images(count: int, size: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, size, size, 3), np.uint8)


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def numpy_cross_entropy(logits: np.ndarray, labels: np.ndarray) -> float:
    logits = logits.astype(np.float64)
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return float(np.mean(log_z - logits[np.arange(len(labels)), labels]))


def head_gradient(model, loss_fn, batch, settings, path):
    """d loss / d (the parameter at `path`) in evaluation mode (`rng=None`)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        return loss_fn(nnx.merge(graphdef, params, rest, copy=True), batch, None,
                       objective=settings)[0]

    grads = jax.jit(jax.grad(loss))(params)
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)}[path]


# ---------------------------------------------------------------------------- rotation

def test_rotations_are_counter_clockwise_quarter_turns_with_their_labels():
    images = jnp.asarray(uint8_images(3, 5))
    rotated, labels = image_augment.rotations(images)
    assert rotated.shape == (12, 5, 5, 3)
    np.testing.assert_array_equal(np.asarray(labels), np.repeat(np.arange(4), 3))
    for k in range(4):
        np.testing.assert_array_equal(np.asarray(rotated[3 * k:3 * k + 3]),
                                      np.rot90(np.asarray(images), k, axes=(1, 2)))
    # 90 degrees counter-clockwise (dataloader.py rotate_img: flipud of the transpose): the
    # top-right pixel goes to the top left, the top-left one to the bottom left.
    one = np.zeros((1, 5, 5, 3), np.uint8)
    one[0, 0, 4], one[0, 0, 0] = 1, 2
    quarter = np.asarray(image_augment.rotations(jnp.asarray(one))[0][1])
    assert quarter[0, 0, 0] == 1 and quarter[4, 0, 0] == 2
    np.testing.assert_array_equal(quarter, np.flipud(one[0].transpose(1, 0, 2)))
    with pytest.raises(ValueError, match="square"):
        image_augment.rotations(jnp.zeros((1, 4, 5, 3)))


def test_padded_crop_is_a_window_of_the_zero_padded_image():
    image = jnp.asarray(np.random.default_rng(0).random((8, 8, 3)), jnp.float32)
    padded = np.pad(np.asarray(image), ((4, 4), (4, 4), (0, 0)))
    offsets = set()
    for seed in range(200):
        crop = np.asarray(image_augment.padded_crop(jax.random.key(seed), image, 4))
        matches = [(t, u) for t in range(9) for u in range(9)
                   if np.array_equal(padded[t:t + 8, u:u + 8], crop)]
        assert matches, seed
        offsets.add(matches[0])
    assert {t for t, _ in offsets} == set(range(9)) == {u for _, u in offsets}


def test_rotation_loss_and_head_gradient_equal_numpy():
    """Evaluation mode (no augmentation): the loss is numpy's cross-entropy of the network's
    logits on np.rot90 copies with labels 0..3; the head's gradient is features^T (softmax -
    one-hot) / 4B."""
    model = nnx.jit(lambda: build_rotation(ResNetConfig(**TINY_NET), 0))()
    settings = RotationSettings(image_size=16)
    images = uint8_images(5)
    batch = {"image": jnp.asarray(images)}
    copies = np.concatenate([np.rot90(images, k, axes=(1, 2)) for k in range(4)])
    labels = np.repeat(np.arange(4), 5)
    logits = np.asarray(model(jnp.asarray(copies / 255.0, jnp.float32), train=False))
    loss, metrics = rotation_loss(model, batch, None, objective=settings)
    assert float(loss) == pytest.approx(numpy_cross_entropy(logits, labels), rel=1e-5)
    assert float(metrics["accuracy"][0]) == np.sum(logits.argmax(-1) == labels)
    assert float(metrics["accuracy"][1]) == 20
    features = np.asarray(model.backbone(jnp.asarray(copies / 255.0, jnp.float32),
                                         train=False), np.float64)
    expected = features.T @ (softmax(logits.astype(np.float64)) - np.eye(4)[labels]) / 20
    np.testing.assert_allclose(head_gradient(model, rotation_loss, batch, settings,
                                             ("head", "kernel")), expected, rtol=1e-4,
                               atol=1e-6)
    # Training: every image is augmented once, then rotated: block k is block 0 turned k times.
    rotated, labels = rotated_batch(jax.random.key(0), batch["image"], settings)
    first = np.asarray(rotated[:5])
    for k in range(4):
        np.testing.assert_array_equal(np.asarray(rotated[5 * k:5 * k + 5]),
                                      np.rot90(first, k, axes=(1, 2)))
    assert not np.allclose(first, images / 255.0)


def test_step_schedule_and_nesterov_sgd_as_torch():
    """RotNet's optimiser: lr x factor after each boundary (update n uses schedule(n)), and
    torch's SGD(nesterov=True, weight_decay): d = g + wd w, v = m v + d, w -= lr (d + m v)."""
    config = OptimConfig(optimizer="sgd", schedule="step", learning_rate=0.1, warmup_steps=0,
                         decay_boundaries="2,4", decay_factor=0.2, momentum=0.9, nesterov=True,
                         weight_decay=0.01, clip_norm=0.0)
    schedule = learning_rate_schedule(config, 6)
    np.testing.assert_allclose([float(schedule(n)) for n in range(6)],
                               [0.1, 0.1, 0.02, 0.02, 0.004, 0.004], rtol=1e-6)
    optimizer = make_optimizer(config, 6)
    w = jnp.array([1.0, -2.0])
    state = optimizer.init(w)
    expected, velocity = np.array([1.0, -2.0]), np.zeros(2)
    for n in range(5):
        g = jnp.array([0.5, 0.25]) * (n + 1)
        updates, state = optimizer.update(g, state, w)
        w = w + updates
        d = np.asarray(g) + 0.01 * expected
        velocity = 0.9 * velocity + d
        expected = expected - [0.1, 0.1, 0.02, 0.02, 0.004][n] * (d + 0.9 * velocity)
        np.testing.assert_allclose(np.asarray(w), expected, rtol=1e-5)
    for bad in ("", "4,2", "0,3", "a"):
        with pytest.raises(UserError, match="optim.decay_boundaries"):
            learning_rate_schedule(OptimConfig(schedule="step", decay_boundaries=bad), 6)
    # The CIFAR-10 bench's drops at fractions of a run stay increasing however short the run.
    for steps, expected in ((200, "60,120,160"), (3, "1,2,3")):
        assert bench_boundaries(steps, 0.3, 0.6, 0.8) == f"optim.decay_boundaries={expected}"
        learning_rate_schedule(OptimConfig(schedule="step", decay_boundaries=expected), steps)


# ---------------------------------------------------------------------- permutation set

def paper_algorithm(tiles: int, count: int, seed: int) -> np.ndarray:
    """Noroozi & Favaro's Algorithm 1 written out: all permutations, the first at random, then
    the remaining one of the largest summed Hamming distance to the chosen ones (D-bar =
    1^T D; np.argmax: the first on ties), removed from the candidates. Integer sums: the float
    means of select_permutations.py can break exact ties by rounding."""
    candidates = np.array(list(itertools.permutations(range(tiles))))
    j = int(np.random.default_rng(seed).integers(len(candidates)))
    chosen = []
    for _ in range(count):
        chosen.append(candidates[j])
        candidates = np.delete(candidates, j, axis=0)
        distance = (np.array(chosen)[:, None, :] != candidates[None]).sum(-1).sum(0)
        j = int(np.argmax(distance))
    return np.array(chosen)


def pairwise_hamming(permutations: np.ndarray) -> np.ndarray:
    upper = np.triu_indices(len(permutations), 1)
    return (permutations[:, None, :] != permutations[None]).sum(-1)[upper]


@pytest.mark.parametrize(("tiles", "count", "seed"), [(5, 40, 0), (6, 60, 3)])
def test_permutation_set_is_the_papers_greedy_algorithm(tiles, count, seed):
    np.testing.assert_array_equal(jigsaw.permutation_set(count, seed, tiles),
                                  paper_algorithm(tiles, count, seed))


def test_permutation_set_of_the_papers_size():
    """1,000 distinct permutations of 9 tiles; mean pairwise Hamming distance 8.008 (the paper's
    Table 1: 8.00 for its maximal set of 1,000), minimum 2; above a random choice of the same
    size (8 expected: two random permutations agree in 1 place on average); a function of
    the seed."""
    permutations = jigsaw.permutation_set(1000, 0)
    assert permutations.shape == (1000, 9)
    assert (np.sort(permutations, axis=1) == np.arange(9)).all()
    assert len({tuple(p) for p in permutations}) == 1000
    distances = pairwise_hamming(permutations)
    assert distances.min() == 2 and distances.mean() == pytest.approx(8.008, abs=5e-4)
    random = np.array([np.random.default_rng(i).permutation(9) for i in range(1000)])
    assert pairwise_hamming(random).mean() < distances.mean() - 0.005
    np.testing.assert_array_equal(jigsaw.permutation_set(1000, 0), permutations)
    other = jigsaw.permutation_set(100, 1)
    assert not np.array_equal(other, permutations[:100])
    assert pairwise_hamming(other).min() >= 2
    with pytest.raises(ValueError, match="impossible"):
        jigsaw.permutation_set(121, 0, 5)


# ------------------------------------------------------------------------ tile layout

def test_tiles_lie_in_their_cells_with_random_gaps():
    """Window inside the image; tile i at (row, column) = divmod(i, 3) lies inside cell
    (row, column) of the window; over many draws every offset inside a cell occurs, so the gap
    between neighbours ranges over 0 .. 2 (cell - tile) and edges rarely line up."""
    height, width, puzzle, tile = 40, 36, 30, 8
    cell = puzzle // 3
    grid = np.array([(r * cell, c * cell) for r in range(3) for c in range(3)])
    insides, gaps = [], []
    for seed in range(300):
        origin, positions = (np.asarray(x) for x in jigsaw.tile_positions(
            jax.random.key(seed), height, width, puzzle, tile))
        assert 0 <= origin[0] <= height - puzzle and 0 <= origin[1] <= width - puzzle
        inside = positions - origin - grid
        assert ((inside >= 0) & (inside <= cell - tile)).all()
        insides.append(inside)
        gaps.append(positions[1, 1] - positions[0, 1] - tile)
    assert set(np.concatenate(insides).ravel()) == set(range(cell - tile + 1))
    assert min(gaps) == 0 and max(gaps) == 2 * (cell - tile)


def test_cut_tiles_channel_jitter_and_normalisation():
    image = jnp.asarray(np.random.default_rng(0).random((20, 20, 3)), jnp.float32)
    positions = jnp.array([(r * 6, c * 6 + 1) for r in range(3) for c in range(3)])
    tiles = np.asarray(jigsaw.cut_tiles(image, positions, 5))
    for i, (top, left) in enumerate(np.asarray(positions)):
        np.testing.assert_array_equal(tiles[i], np.asarray(image)[top:top + 5, left:left + 5])
    offsets = jnp.asarray(np.random.default_rng(1).integers(-1, 2, (9, 3, 2)))
    jittered = np.asarray(jigsaw.cut_tiles(image, positions + 1, 5, offsets))
    for i, (top, left) in enumerate(np.asarray(positions + 1)):
        for c in range(3):
            dy, dx = np.asarray(offsets[i, c])
            np.testing.assert_array_equal(jittered[i, ..., c], np.asarray(image)[
                top + dy:top + dy + 5, left + dx:left + dx + 5, c])
    normalised = np.asarray(jigsaw.normalize_tiles(jnp.asarray(tiles)))
    np.testing.assert_allclose(normalised.mean(axis=(1, 2, 3)), 0, atol=1e-5)
    np.testing.assert_allclose(normalised.std(axis=(1, 2, 3)), 1, atol=1e-3)


def test_puzzle_grayscale_share_and_colour_jitter():
    """About 70% of the puzzles are gray (equal channels in every tile); colour puzzles have
    their channels cut at different places."""
    images = jnp.asarray(np.random.default_rng(0).random((400, 16, 16, 3)), jnp.float32)
    keys = jax.random.split(jax.random.key(0), 400)
    tiles = np.asarray(jax.vmap(lambda k, x: jigsaw.puzzle_tiles(k, x, 15, 4, 0.7, 1))(
        keys, images))
    gray = np.array([np.allclose(t[..., 0], t[..., 1]) and np.allclose(t[..., 1], t[..., 2])
                     for t in tiles])
    assert 0.64 < gray.mean() < 0.76
    np.testing.assert_allclose(tiles.mean(axis=(2, 3, 4)), 0, atol=1e-4)


def test_shuffle_places_the_permuted_tiles_and_argsort_restores_them():
    tiles = jnp.arange(2 * 9 * 2).reshape(2, 9, 2)
    permutations = jnp.asarray(jigsaw.permutation_set(10, 0)[[3, 7]])
    shuffled = np.asarray(jigsaw.shuffle_tiles(tiles, permutations))
    for b in range(2):
        for t in range(9):
            np.testing.assert_array_equal(shuffled[b, t], np.asarray(tiles)[
                b, int(permutations[b, t])])
        inverse = np.argsort(np.asarray(permutations[b]))
        np.testing.assert_array_equal(shuffled[b][inverse], np.asarray(tiles[b]))


def test_jigsaw_loss_and_head_gradient_equal_numpy():
    """Evaluation mode: the loss is numpy's cross-entropy of the network's logits on the
    shuffled tiles with their classes; fc8's gradient is fc7's activations^T (softmax -
    one-hot) / B; the tiles are the cell-order puzzle shuffled by the class's permutation."""
    config = JigsawConfig(**TINY_NET, num_permutations=12, tile_features=8, hidden_dim=16)
    settings = JigsawSettings(image_size=16, puzzle_size=15, tile_size=4, channel_jitter=1)
    model = nnx.jit(lambda: build_jigsaw(config, 0))()
    batch = {"image": jnp.asarray(uint8_images(6))}
    key = jax.random.key(0)  # two_view.EVAL_AUGMENT_SEED
    tiles, labels = (np.asarray(x) for x in puzzles(key, batch["image"], config, settings))
    assert tiles.shape == (6, 9, 4, 4, 3) and labels.shape == (6,)
    loss, metrics = jigsaw_loss(model, batch, None, objective=settings)
    logits = np.asarray(model(jnp.asarray(tiles), train=False))
    assert float(loss) == pytest.approx(numpy_cross_entropy(logits, labels), rel=1e-5)
    assert float(metrics["accuracy"][1]) == 6
    features = model.backbone(jnp.asarray(tiles.reshape(54, 4, 4, 3)), train=False)
    fc6 = jax.nn.relu(model.tile(features)).reshape(6, -1)
    fc7 = np.asarray(jax.nn.relu(model.classifier.hidden(fc6)), np.float64)
    expected = fc7.T @ (softmax(logits.astype(np.float64)) - np.eye(12)[labels]) / 6
    np.testing.assert_allclose(head_gradient(model, jigsaw_loss, batch, settings,
                                             ("classifier", "output", "kernel")), expected,
                               rtol=1e-4, atol=1e-6)
    # The puzzle in cell order, shuffled by each image's permutation, is what the model saw.
    tile_key, _ = jax.random.split(key)
    images = image_augment.to_float(batch["image"])
    ordered = np.asarray(jax.vmap(lambda k, x: jigsaw.puzzle_tiles(k, x, 15, 4, 0.7, 1))(
        jax.random.split(tile_key, 6), images))
    permutations = jigsaw.permutation_set(12, 0)[labels]
    for b in range(6):
        np.testing.assert_array_equal(tiles[b], ordered[b][permutations[b]])
    with pytest.raises(UserError, match="objective.puzzle_size=30"):
        puzzles(key, batch["image"], config, JigsawSettings(puzzle_size=30, tile_size=8))


# ----------------------------------------------------------------------------- training

@pytest.fixture(scope="module")
def oriented_folder(tmp_path_factory) -> str:
    """A CIFAR-10-format folder of 192 images with an orientation and parts: a background
    darkening from top to bottom (rotation) and a disc of random colour near the centre whose
    arcs tell the cells apart (jigsaw); labels = the disc's radius class."""
    root = tmp_path_factory.mktemp("oriented")
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:32, 0:32]

    def batch():
        fg, bg = rng.integers(0, 256, (2, 32, 1, 1, 3))
        cy, cx = rng.integers(13, 19, (2, 32, 1, 1))
        radius = rng.integers(8, 13, (32, 1, 1))
        disc = ((yy - cy) ** 2 + (xx - cx) ** 2 < radius ** 2)[..., None]
        pixels = np.where(disc, fg, bg * (1.0 - yy / 48.0)[None, ..., None])
        pixels = np.clip(pixels + rng.normal(0, 8, pixels.shape), 0, 255)
        return pixels, (radius[:, 0, 0] - 8) // 2

    return write_cifar10_folder(root, batch)


# Short runs of either tiny preset: batch 32 of 32-pixel images, a ResNet-10 (one block a
# stage) 4 channels wide; jigsaw with 8 permutations (100 do not move within a test's steps).
PRESETS = {"rotation_tiny": {"model.depth": 10, "model.base_width": 4},
           "jigsaw_tiny": {"model.depth": 10, "model.base_width": 4, "model.num_permutations": 8,
                           "optim.learning_rate": 3e-3}}
# The mesh-equality and resume tests: 8 images a step through a ResNet-10 2 channels wide.
SMALL = {"train.batch_size": 8, "model.base_width": 2}
SHORT = {"train.batch_size": 32, "train.log_every": 1, "train.eval_every": 1000,
         "train.eval_batches": 1, "train.checkpoint_every": 3, "train.progress": False,
         "train.steps": 8}


def settings(preset: str, data: str, tmp_path, **overrides) -> dict:
    return {**SHORT, **PRESETS[preset], "data.source": data,
            "data.cache_dir": str(tmp_path / "cache"), **overrides}


def flat_tree(tree: object) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))}


@pytest.mark.parametrize("preset", ["rotation_tiny", "jigsaw_tiny"])
def test_same_step_on_one_device_and_a_mixed_mesh(preset, oriented_folder, tmp_path):
    """One plain gradient step: the same loss on 1 device and on 2 x 2 x 2, and the same update
    of every parameter tensor: the last layer's to 1e-5 of its norm, the others' to 0.5%
    (float32 sums in another order, amplified on the way back through 20 BatchNorm layers,
    reach 0.13% in the first stage; a gradient scaled or missing a device's share is off by
    10% or more everywhere); the step moved the parameters."""
    results, batch, initial = {}, None, None
    for name, mesh, devices in (("single", (1, 1, 1), jax.devices()[:1]),
                                ("mixed", (2, 2, 2), None)):
        values = settings(preset, oriented_folder, tmp_path, **{
            **GRADIENT_STEP, **SMALL, "mesh.data": mesh[0], "mesh.fsdp": mesh[1],
            "mesh.tensor": mesh[2]})
        trainer = Trainer(make_config(preset, values), tmp_path / name, devices=devices)
        batch = next(trainer.data_iterator()) if batch is None else batch
        state = trainer.init_state()
        initial = flat_tree(state.params) if initial is None else initial
        state, metrics = trainer.train_step(state, batch)
        results[name] = float(metrics["loss"][0]), flat_tree(state.params)
    loss0, params0 = results["single"]
    assert sum(np.abs(v - initial[k]).max() > 1e-4 for k, v in params0.items()) > 0.9 * len(
        params0)
    loss, params = results["mixed"]
    assert loss == pytest.approx(loss0, rel=1e-5)
    errors = {key: np.linalg.norm(params[key] - value) / np.linalg.norm(value - initial[key])
              for key, value in params0.items()}
    last = [key for key in errors if "['head']" in key or "['output']" in key]
    assert len(last) == 2 and max(errors[key] for key in last) < 1e-5, errors
    assert max(errors.values()) < 5e-3, errors


@pytest.mark.parametrize("preset", ["rotation_tiny", "jigsaw_tiny"])
def test_killed_run_resumes_bit_for_bit(preset, oriented_folder, tmp_path):
    """Killed in place of step 5 (`abort_and_resume`: the last checkpoint is step 3's), then a
    rerun: the batches,
    losses and final parameters of an uninterrupted run."""
    overrides = settings(preset, oriented_folder, tmp_path, **SMALL)
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process(preset, overrides, *reference)
    ours = abort_and_resume(preset, overrides, tmp_path, step=5)
    assert len(assert_same_training(preset, overrides, ours, reference)) > 8


@pytest.mark.parametrize(("preset", "steps", "start"), [("rotation_tiny", 30, np.log(4)),
                                                        ("jigsaw_tiny", 50, np.log(8))])
def test_cli_trains_the_tiny_preset_on_a_mixed_mesh(preset, steps, start, oriented_folder,
                                                    tmp_path):
    """`run.py pretrain --preset P --data FOLDER` on data x fsdp x tensor = 2 x 2 x 2: the loss
    starts near chance, log(classes), and falls well below it; the held-out accuracy is well
    above chance and the kNN monitor runs; the workdir's downstream model is the ResNet."""
    values = settings(preset, oriented_folder, tmp_path, **{
        "train.steps": steps, "train.log_every": 5, "train.eval_every": steps,
        "train.checkpoint_every": steps, "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    del values["data.source"]
    assert run.main(["pretrain", "--preset", preset, "--data", oriented_folder, "--workdir",
                     str(tmp_path / "run"), *(f"{k}={v}" for k, v in values.items())]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    losses = [row["loss"] for row in rows if row["split"] == "train"]
    assert losses[0] == pytest.approx(start, abs=0.3)
    assert losses[-1] < 0.6 * start and losses[-1] < min(losses[:-1]) + 0.05, losses
    evaluation = [row for row in rows if row["split"] == "eval"][-1]
    assert evaluation["accuracy"] > 0.5 and 0.0 <= evaluation["knn_accuracy"] <= 1.0
    backbone = load_model(tmp_path / "run", downstream=True)
    assert type(backbone).__name__ == "ResNet" and backbone.config.base_width == 4
