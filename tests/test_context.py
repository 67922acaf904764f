"""Context prediction (Doersch et al. 2015): the pair sampler's statistics against the paper's
definition (uniform labels over the 8 neighbours, the grid step between the two patches, the
jitter's range and uniformity, the grid anywhere in the image), the downsampling against
jax.image.resize and its area law, colour dropping and the green-magenta projection (with
negative controls), the loss and fc9's gradient against numpy, a sharded step equal to the
single-device one, a killed run's exact resume, and bad settings refused in one line."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from resilience_utils import (
    GRADIENT_STEP,
    abort_and_resume,
    assert_same_step_on_every_mesh,
    assert_same_training,
    mesh_overrides,
    run_in_process,
)
from test_rotation_jigsaw import (
    TINY_NET,
    head_gradient,
    numpy_cross_entropy,
    softmax,
    uint8_images,
)
from tfds_utils import write_cifar10_folder

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import context
from pretext_jax.models.image_tasks import ContextConfig
from pretext_jax.objectives.context import ContextSettings, build_context, context_loss, pairs
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

CHI2_7_DOF_999 = 24.32  # the chi-square distribution's 0.999 quantile at 7 degrees of freedom
CHI2_8_DOF_999 = 26.12


def chi_square(counts: np.ndarray, expected: np.ndarray) -> float:
    return float(np.sum((counts - expected) ** 2 / expected))


def draw_positions(count: int, size: int, patch: int, gap: int, jitter: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    keys = jax.random.split(jax.random.key(0), count)
    positions, labels = jax.vmap(lambda k: context.pair_positions(
        k, size, size, patch, gap, jitter))(keys)
    return np.asarray(positions), np.asarray(labels)


def test_pairs_are_the_centre_and_a_uniform_neighbour_with_uniform_jitter():
    """On an image as large as the jittered grid, the grid's corner is fixed, so each patch's
    jitter is its place minus its cell's: uniform over [-3, 3] on both axes and for both
    patches; the second patch's cell is the label's neighbour of the
    centre (train.py pos2lbl order), and the 8 labels are uniform (chi-square at p = 0.001; a
    sample with one label drawn twice as often fails it)."""
    patch, gap, jitter, count = 5, 4, 3, 4000
    size = context.grid_size(patch, gap, jitter)
    positions, labels = draw_positions(count, size, patch, gap, jitter)
    expected = np.full(8, count / 8)
    assert chi_square(np.bincount(labels, minlength=8), expected) < CHI2_7_DOF_999
    biased = np.bincount(np.concatenate([labels, labels[labels == 0]]), minlength=8)
    assert chi_square(biased, biased.sum() * np.ones(8) / 8) > CHI2_7_DOF_999
    step = patch + gap
    cells = np.stack([np.ones((count, 2), int), 1 + context.NEIGHBOURS[labels]], 1)
    offsets = positions - jitter - cells * step
    assert np.abs(offsets).max() == jitter
    values = np.arange(-jitter, jitter + 1)
    for axis in np.moveaxis(offsets, (1, 2), (0, 1)).reshape(4, count):
        counts = (axis[:, None] == values).sum(0)
        assert chi_square(counts, np.full(7, count / 7)) < 22.46  # 6 dof, p = 0.001
    # Where the second patch lies relative to the first: the grid step in the label's direction,
    # up to the two jitters; the labels are row-major over the neighbours, centre left out.
    np.testing.assert_array_equal(context.NEIGHBOURS, [(-1, -1), (-1, 0), (-1, 1), (0, -1),
                                                       (0, 1), (1, -1), (1, 0), (1, 1)])
    relative = positions[:, 1] - positions[:, 0] - step * context.NEIGHBOURS[labels]
    assert np.abs(relative).max() <= 2 * jitter
    # On a larger image the grid lies anywhere, and every patch inside the image.
    positions, _ = draw_positions(2000, size + 6, patch, gap, jitter)
    corners = positions[:, 0] - jitter - step  # the centre's cell, back to the grid's corner
    assert corners.min() == -jitter and corners.max() == 6 + jitter
    assert positions.min() >= 0 and positions.max() <= size + 6 - patch


def test_downsampling_is_a_resize_down_and_back_with_uniform_area():
    """A downsampled patch equals jax.image.resize (bilinear, no antialiasing) to side s and
    back; s = floor(sqrt(area)), area uniform in [min_pixels, (P - 1)^2] (train.py:94), so each
    side's share is its band of areas; a third of the patches (probability 0.33) change."""
    size, min_pixels, count = 12, 4, 1000
    patch = jnp.asarray(np.random.default_rng(0).random((size, size, 3)), jnp.float32)
    sides = np.arange(2, size - 1)  # side P - 1 needs an area of exactly (P - 1)^2
    oracles = np.stack([np.asarray(jax.image.resize(jax.image.resize(
        patch, (s, s, 3), "linear", antialias=False), (size, size, 3), "linear",
        antialias=False)) for s in sides])
    keys = jax.random.split(jax.random.key(1), count)

    @functools.partial(jax.jit, static_argnums=0)
    def degraded_patches(probability: float) -> jax.Array:
        return jax.vmap(lambda k: context.degrade(k, patch, probability, min_pixels))(keys)

    degraded = np.asarray(degraded_patches(1.0))
    errors = np.abs(degraded[:, None] - oracles[None]).max(axis=(2, 3, 4))
    assert errors.min(1).max() < 1e-5
    counts = np.bincount(errors.argmin(1), minlength=len(sides))
    bands = np.minimum((sides + 1) ** 2, (size - 1) ** 2) - np.maximum(sides ** 2, min_pixels)
    assert chi_square(counts, count * bands / bands.sum()) < CHI2_8_DOF_999
    changed = np.abs(np.asarray(degraded_patches(0.33)) - np.asarray(patch)).max(
        axis=(1, 2, 3)) > 0
    assert 0.28 < changed.mean() < 0.38


def test_colour_dropping_keeps_one_channel_and_noises_the_others():
    """`drop` (train.py:98-105): one channel, uniform, is the patch's minus its mean; the two
    others are uniform noise in +-0.5/255, zero-mean, independent of the image; `none` keeps
    all three centred channels (the control)."""
    patch = jnp.asarray(np.random.default_rng(0).random((9, 9, 3)), jnp.float32)
    centred = np.asarray(patch) - np.asarray(patch).mean(axis=(0, 1))
    keys = jax.random.split(jax.random.key(2), 600)
    dropped = np.asarray(jax.vmap(lambda k: context.counter_aberration(k, patch, "drop"))(keys))
    kept = np.isclose(dropped, centred, atol=1e-6).all(axis=(1, 2))
    assert (kept.sum(1) == 1).all()
    assert chi_square(kept.sum(0), np.full(3, 200)) < 13.82  # 2 dof, p = 0.001
    noise = dropped[~np.broadcast_to(kept[:, None, None], dropped.shape)]
    assert np.abs(noise).max() <= 0.5 / 255
    assert abs(noise.mean()) < 1e-4 and noise.std() == pytest.approx(1 / 255 / 12 ** 0.5,
                                                                     rel=0.02)
    np.testing.assert_allclose(np.asarray(context.counter_aberration(keys[0], patch, "none")),
                               centred, atol=1e-6)


def test_projection_removes_the_green_magenta_component():
    """`project` (§3.1): B = I - a a^T / a^T a with a = (-1, 2, -1) leaves every pixel of the
    final (unit root mean square) patch with no component along a, and keeps the components
    orthogonal to it; without it (`none`, `drop`) the component is there."""
    image = jnp.asarray(np.random.default_rng(0).random((24, 24, 3)), jnp.float32)
    a = context.GREEN_MAGENTA

    def sampled(mode: str) -> np.ndarray:
        return np.asarray(jax.jit(context.patch_pair, static_argnums=range(2, 8))(
            jax.random.key(3), image, 5, 2, 1, mode, 0.0, 1)[0])

    projected, plain = sampled("project"), sampled("none")
    np.testing.assert_allclose(projected @ a, 0, atol=1e-5)
    for control in (plain, sampled("drop")):
        assert np.abs(control @ a).mean() > 0.1
    np.testing.assert_allclose(np.sqrt(np.mean(projected ** 2, axis=(1, 2, 3))), 1, rtol=1e-4)
    # Orthogonal to a, the projection changes nothing: the gray axis (1, 1, 1) and a x (1, 1, 1).
    for direction in (np.ones(3), np.cross(a, np.ones(3))):
        np.testing.assert_allclose(context.PROJECTION @ direction, direction, atol=1e-12)


def test_context_loss_and_head_gradient_equal_numpy():
    """Evaluation mode: the loss is numpy's cross-entropy of the network's logits on the pairs
    with their labels; fc9's gradient is fc8's activations^T (softmax - one-hot) / B; the pairs
    are `patch_pair`'s for each image's key."""
    config = ContextConfig(**{**TINY_NET, "depth": 10}, patch_features=8, hidden_dim=16)
    settings = ContextSettings(image_size=16, patch_size=4, gap=1, jitter=1,
                               counter_measure="project", downsample_probability=0.5,
                               downsample_min_pixels=4)
    model = nnx.jit(lambda: build_context(config, 0))()
    batch = {"image": jnp.asarray(uint8_images(6))}
    key = jax.random.key(0)  # two_view.EVAL_AUGMENT_SEED
    patches, labels = (np.asarray(x) for x in pairs(key, batch["image"], settings))
    assert patches.shape == (6, 2, 4, 4, 3) and labels.shape == (6,)
    loss, metrics = nnx.jit(lambda m: context_loss(m, batch, None, objective=settings))(model)

    @nnx.jit
    def logits_and_fc8(model, pairs):  # fc6 -> fc7 -> fc8 spelled out in evaluation mode
        features = model.backbone(pairs.reshape(12, 4, 4, 3), train=False)
        fc6 = jax.nn.relu(model.patch_norm(model.patch(features), use_running_average=True))
        fc7 = jax.nn.relu(model.pair_norm(model.pair(fc6.reshape(6, -1)),
                                          use_running_average=True))
        return model(pairs, train=False), jax.nn.relu(model.classifier.hidden(fc7))

    logits, fc8 = (np.asarray(x, np.float64) for x in logits_and_fc8(model,
                                                                     jnp.asarray(patches)))
    assert float(loss) == pytest.approx(numpy_cross_entropy(logits, labels), rel=1e-5)
    assert float(metrics["accuracy"][1]) == 6
    expected = fc8.T @ (softmax(logits) - np.eye(8)[labels]) / 6
    gradient = head_gradient(model, context_loss, batch, settings,
                             ("classifier", "output", "kernel"))
    np.testing.assert_allclose(gradient, expected, rtol=1e-4, atol=1e-6)
    images = batch["image"].astype(jnp.float32) / 255
    one = jax.jit(lambda k, x: context.patch_pair(k, x, 4, 1, 1, "project", 0.5, 4))
    for b, k in enumerate(jax.random.split(key, 6)):
        pair, label = one(k, images[b])
        np.testing.assert_allclose(np.asarray(pair), patches[b], rtol=1e-5, atol=1e-5)
        assert int(label) == labels[b]


# ----------------------------------------------------------------------------- training

@pytest.fixture(scope="module")
def cifar_folder(tmp_path_factory) -> str:
    """A CIFAR-10-format folder of 6 x 16 random images."""
    rng = np.random.default_rng(0)
    return write_cifar10_folder(tmp_path_factory.mktemp("cifar"), lambda: (
        rng.integers(0, 256, (16, 32, 32, 3), np.uint8), rng.integers(0, 10, 16)))


def overrides(data: str, tmp_path, **more) -> dict:
    """`context_tiny` at 8 images a step through a ResNet-10 2 channels wide, fc 16 (fewer
    BatchNorm layers than the preset's ResNet-18 to amplify float32 sums in another order)."""
    return {"data.source": data, "data.cache_dir": str(tmp_path / "cache"),
            "model.depth": 10, "model.base_width": 2, "model.patch_features": 16,
            "model.hidden_dim": 16, "train.batch_size": 8, "train.log_every": 1,
            "train.eval_every": 1000, "train.eval_batches": 1, "train.checkpoint_every": 2,
            "train.progress": False, "train.steps": 4, **more}


def test_same_step_on_one_device_and_a_mixed_mesh(cifar_folder, tmp_path):
    def trainer_at(workdir, mesh, devices):
        values = overrides(cifar_folder, tmp_path, **GRADIENT_STEP, **mesh_overrides(mesh))
        return Trainer(make_config("context_tiny", values), workdir, devices=devices)

    batch = assert_same_step_on_every_mesh(trainer_at, tmp_path)
    assert batch["image"].shape == (8, 32, 32, 3)


def test_killed_run_resumes_bit_for_bit(cifar_folder, tmp_path):
    """Killed in place of step 3 (the last checkpoint is step 2's), then rerun: the batches,
    losses and final parameters of an uninterrupted run."""
    values = overrides(cifar_folder, tmp_path)
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process("context_tiny", values, *reference)
    ours = abort_and_resume("context_tiny", values, tmp_path, step=3)
    assert len(assert_same_training("context_tiny", values, ours, reference)) > 4


@pytest.mark.parametrize(("override", "hint"), [
    ({"objective.patch_size": 12}, "raise image_size or lower them"),
    ({"objective.counter_measure": "gray"}, "must be one of ('drop', 'project', 'none')"),
    ({"objective.downsample_probability": 0.3}, "or set downsample_probability=0"),
    ({"objective.jitter": -1}, "jitter=-1 >= 0"),
])
def test_bad_settings_are_refused_in_one_line(override, hint):
    with pytest.raises(UserError) as error:
        make_config("context_tiny", override)
    assert hint in str(error.value) and "\n" not in str(error.value)


def test_images_smaller_than_the_grid_are_refused():
    with pytest.raises(UserError, match=r"smaller than the 29-pixel grid of objective\."):
        pairs(jax.random.key(0), jnp.zeros((2, 28, 28, 3), jnp.uint8), ContextSettings(
            image_size=32, patch_size=7, gap=3, jitter=1, downsample_probability=0.0))
