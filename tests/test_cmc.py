"""CMC: the Lab conversion against the CIE formula written per pixel and known colours, the
views' normalisation, the cross-view loss and its gradient against numpy, one step's loss and
memory-bank update against numpy, the training rows' indices, the CLI run with a killed run
resuming bit for bit (memory banks included), and from its state the sharded step against the
single-device one."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from resilience_utils import (
    MESHES,
    abort,
    flat_params,
    mesh_overrides,
    read_log,
    run_in_process,
    tampered_restore,
    train_losses,
)
from tfds_utils import write_cifar10_folder

from pretext_jax import run
from pretext_jax.input_pipeline.images import HostCrop, prepare_images
from pretext_jax.input_pipeline.indexed import IndexedRecords
from pretext_jax.input_pipeline.records import make_loader
from pretext_jax.models.cmc import CMCConfig, lab_views, rgb_to_lab
from pretext_jax.objectives.cmc import (
    CMCSettings,
    build_cmc,
    cmc_loss,
    cross_view_contrast,
)
from pretext_jax.objectives.common.two_view import cropped_and_flipped
from pretext_jax.pretrain.checkpoints import TrainState
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.loading import load_model
from pretext_jax.pretrain.trainer import Trainer


def cie_lab(r: float, g: float, b: float) -> tuple[float, float, float]:
    """CIE L*a*b* (D65) of one sRGB colour in [0, 1], written out per channel."""
    def linear(c):
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = linear(r), linear(g), linear(b)
    x = (0.412453 * r + 0.357580 * g + 0.180423 * b) / 0.95047
    y = 0.212671 * r + 0.715160 * g + 0.072169 * b
    z = (0.019334 * r + 0.119193 * g + 0.950227 * b) / 1.08883

    def f(t):
        return t ** (1.0 / 3.0) if t > (6.0 / 29.0) ** 3 else t / (3 * (6.0 / 29.0) ** 2) + 4 / 29

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def test_lab_conversion_equals_the_cie_formula_and_known_colours():
    rng = np.random.default_rng(0)
    pixels = np.concatenate([rng.random((200, 3)), rng.random((50, 3)) * 0.05,  # dark: linear f
                             np.array([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])]).astype(np.float32)
    expected = np.array([cie_lab(*p) for p in pixels.astype(np.float64)])
    np.testing.assert_allclose(rgb_to_lab(jnp.asarray(pixels)), expected, atol=2e-3)
    # skimage.color.rgb2lab's values (the reference's RGB2Lab): white, black, red, green, blue
    known = {(1, 1, 1): (100.0, 0.0, 0.0), (0, 0, 0): (0.0, 0.0, 0.0),
             (1, 0, 0): (53.2408, 80.0925, 67.2032), (0, 1, 0): (87.7347, -86.1827, 83.1793),
             (0, 0, 1): (32.2970, 79.1875, -107.8602)}
    lab = rgb_to_lab(jnp.asarray(list(known), jnp.float32))
    np.testing.assert_allclose(lab, np.array(list(known.values())), atol=2e-2)
    grey = rgb_to_lab(jnp.linspace(0, 1, 11)[:, None].repeat(3, 1))
    np.testing.assert_allclose(grey[:, 1:], 0.0, atol=1e-2)  # no chroma
    assert np.all(np.diff(np.asarray(grey[:, 0])) > 0)  # lightness rises with the grey level


def test_views_are_l_and_ab_scaled_to_the_unit_range_over_the_srgb_gamut():
    """train_CMC.py's Normalize: L 0..100 and a, b over the gamut's extremes onto [-1, 1]; the
    RGB cube's corners reach them (green min a, magenta max a, blue min b, yellow max b)."""
    corners = jnp.asarray([[(i >> 2) & 1, (i >> 1) & 1, i & 1] for i in range(8)],
                          jnp.float32)[:, None, None, :]
    l_view, ab_view = lab_views(corners)
    assert l_view.shape == (8, 1, 1, 1) and ab_view.shape == (8, 1, 1, 2)
    views = np.concatenate([l_view, ab_view], -1)[:, 0, 0]
    assert views.min() >= -1 - 1e-4 and views.max() <= 1 + 1e-4
    np.testing.assert_allclose(views[0, 0], -1, atol=1e-5)  # black
    np.testing.assert_allclose(views[7, 0], 1, atol=1e-4)  # white
    green, magenta, blue, yellow = 2, 5, 1, 6
    np.testing.assert_allclose([views[green, 1], views[magenta, 1], views[blue, 2],
                                views[yellow, 2]], [-1, 1, -1, 1], atol=1e-4)


def numpy_direction(z, positives, negatives, t):
    """One direction's softmax contrast and its gradient with respect to the anchors z."""
    candidates = np.concatenate([positives[:, None], np.broadcast_to(
        negatives, (len(z), *negatives.shape))], axis=1)  # [B, 1 + K, d]
    logits = np.einsum("bd,bkd->bk", z, candidates) / t
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    loss = np.mean(-np.log(p[:, 0]))
    grad = (np.einsum("bk,bkd->bd", p, candidates) - positives) / t / len(z)
    return loss, grad, np.sum(logits.argmax(1) == 0)


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_cross_view_loss_and_gradient_against_numpy():
    rng = np.random.default_rng(0)
    z_l, z_ab, pos_l, pos_ab = (unit(rng.normal(size=(5, 6))) for _ in range(4))
    neg_l, neg_ab = (unit(rng.normal(size=(7, 6))) for _ in range(2))
    pos_ab[0] = z_l[0]  # one anchor certainly right
    arrays = [jnp.asarray(a, jnp.float32) for a in (z_l, z_ab, pos_l, pos_ab, neg_l, neg_ab)]
    loss, metrics = cross_view_contrast(*arrays, 0.2)
    l_loss, l_grad, l_right = numpy_direction(z_l, pos_ab, neg_ab, 0.2)
    ab_loss, ab_grad, ab_right = numpy_direction(z_ab, pos_l, neg_l, 0.2)
    assert float(loss) == pytest.approx(l_loss + ab_loss, rel=1e-5)
    assert float(metrics["l_loss"][0]) / 5 == pytest.approx(l_loss, rel=1e-5)
    assert float(metrics["ab_loss"][0]) / 5 == pytest.approx(ab_loss, rel=1e-5)
    assert tuple(map(float, metrics["contrastive_accuracy"])) == (l_right + ab_right, 10)
    grads = jax.grad(lambda a, b: cross_view_contrast(a, b, *arrays[2:], 0.2)[0],
                     argnums=(0, 1))(*arrays[:2])
    np.testing.assert_allclose(grads[0], l_grad, atol=1e-5)
    np.testing.assert_allclose(grads[1], ab_grad, atol=1e-5)


def test_one_step_loss_and_memory_update_against_numpy():
    """A training call of `cmc_loss`: the L anchors against the ab bank's own rows and drawn
    rows, the ab anchors against the L bank's, then rows `index` of both banks <- normalise(m
    row + (1 - m) z) (m = 0.3 here); other rows unchanged."""
    model = build_cmc(CMCConfig(depth=10, stem="cifar", base_width=2, projection_dim=8,
                                num_images=12), seed=0)
    objective = CMCSettings(image_size=8, num_negatives=16, momentum=0.3)
    rng = np.random.default_rng(0)
    batch = {"image": jnp.asarray(rng.integers(0, 256, (4, 12, 12, 3)), jnp.uint8),
             "index": jnp.asarray([7, 2, 11, 0], jnp.int32)}
    key = jax.random.key(3)
    banks = [np.asarray(b.get_value(), np.float64) for b in (model.memory_l, model.memory_ab)]
    view_key, negative_key = jax.random.split(key)
    forward = nnx.jit(lambda m, k, images: m(cropped_and_flipped(k, images, objective),
                                             train=True))
    z_l, z_ab = (unit(np.asarray(z, np.float64))
                 for z in forward(nnx.clone(model), view_key, batch["image"]))
    drawn = np.asarray(jax.random.randint(negative_key, (16,), 0, 12))
    index = np.asarray(batch["index"])
    expected = (numpy_direction(z_l, banks[1][index], banks[1][drawn], 0.07)[0]
                + numpy_direction(z_ab, banks[0][index], banks[0][drawn], 0.07)[0])
    step = nnx.jit(lambda m, b, k: cmc_loss(m, b, k, objective=objective))
    loss, _ = step(model, batch, key)
    assert float(loss) == pytest.approx(expected, rel=1e-4)
    for bank, before, z in zip((model.memory_l, model.memory_ab), banks, (z_l, z_ab),
                               strict=True):
        after = np.asarray(bank.get_value())
        np.testing.assert_allclose(after[index], unit(0.3 * before[index] + 0.7 * z), atol=1e-4)
        kept = np.setdiff1d(np.arange(12), index)
        np.testing.assert_array_equal(after[kept], before[kept].astype(np.float32))


@pytest.fixture(scope="module")
def colour_folder(tmp_path_factory):
    """A CIFAR-10-format folder of 192 images (160 for training), each one random colour with
    pixel noise, labelled by its brightest channel."""
    root = tmp_path_factory.mktemp("cmc_colours")
    rng = np.random.default_rng(0)

    def batch():
        colours = rng.integers(0, 256, (32, 1, 1, 3))
        pixels = np.clip(colours + rng.normal(0, 12, (32, 32, 32, 3)), 0, 255)
        return pixels, colours[:, 0, 0].argmax(-1)

    return write_cifar10_folder(root, batch)


def test_training_records_carry_their_row(colour_folder, tmp_path):
    """Every loaded record's `index` is its row: its image is that row's, and an epoch reads
    each row once."""
    train, _ = prepare_images(colour_folder, "", tmp_path, 8, crop=HostCrop(),
                              held_out_fraction=0.0, seed=0)
    records = IndexedRecords(train)
    assert len(records) == 160 and "indexed records" in repr(records)
    batches = list(make_loader(records, batch_size=32, seed=0, num_epochs=1))
    index = np.concatenate([b["index"] for b in batches])
    assert sorted(index.tolist()) == list(range(160)) and index.dtype == np.int32
    np.testing.assert_array_equal(np.concatenate([b["image"] for b in batches]),
                                  train.examples(index)["image"])


# 16 images a step through two ResNet-10s 2 channels wide.
SMALL = {"model.depth": 10, "model.base_width": 2, "model.projection_dim": 16,
         "objective.image_size": 8, "objective.num_negatives": 256, "train.batch_size": 16,
         "train.log_every": 1, "train.eval_batches": 1, "train.progress": False}
MIXED = MESHES["mixed"][0]


def test_cli_run_and_a_killed_run_resuming_with_its_memory_banks(colour_folder, tmp_path):
    """`run.py pretrain --preset cmc_tiny` for 8 steps on data x fsdp x tensor = 2 x 2 x 2: the
    held-out evaluation and the kNN monitor run, the downstream model takes RGB, every bank
    row seen is a unit vector. A run killed in place of step 6 (`abort`: last checkpoint step
    4) and rerun gives the CLI run's batches, losses, parameters and memory banks bit for bit;
    rerun with the banks lost (zeros restored), every step after the checkpoint differs. From
    its last state, the sharded step equals the single-device one
    (`assert_same_step_on_one_device`)."""
    overrides = {**SMALL, **mesh_overrides(MIXED), "data.source": colour_folder,
                 "data.cache_dir": str(tmp_path / "c"), "train.steps": 8,
                 "train.eval_every": 8, "train.checkpoint_every": 4}
    args = [f"{k}={v}" for k, v in overrides.items() if k != "data.source"]
    assert run.main(["pretrain", "--preset", "cmc_tiny", "--data", colour_folder,
                     "--workdir", str(tmp_path / "cli"), *args]) == 0
    rows = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").read_text()
            .splitlines()]
    evaluation = [row for row in rows if row["split"] == "eval"][-1]
    assert np.isfinite(evaluation["loss"]) and 0.0 <= evaluation["knn_accuracy"] <= 1.0
    backbone = load_model(tmp_path / "cli", downstream=True)
    assert type(backbone).__name__ == "LabEncoders" and backbone.features == 2 * 16

    ours, control = (tmp_path / "w", tmp_path / "w.log"), (tmp_path / "lost", tmp_path / "l.log")
    abort("cmc_tiny", overrides, *ours, step=6)
    shutil.copytree(ours[0], control[0])
    shutil.copy(ours[1], control[1])
    run_in_process("cmc_tiny", overrides, *ours)
    with tampered_restore(banks_lost):
        run_in_process("cmc_tiny", overrides, *control)
    assert sorted(dict(read_log(ours[1]))) == list(range(1, 9))
    cli_losses = train_losses(tmp_path / "cli")
    assert train_losses(ours[0]) == cli_losses
    lost = train_losses(control[0])
    assert all(lost[step] != cli_losses[step] for step in range(5, 9)), (lost, cli_losses)
    states = []
    for workdir in (ours[0], tmp_path / "cli"):
        trainer = Trainer(make_config("cmc_tiny", overrides), workdir)
        states.append(trainer.checkpoints.restore_latest_readable()[0])
        trainer.checkpoints.close()
    mine, cli = (flat_params(state.params) for state in states)
    assert mine.keys() == cli.keys() and all(np.array_equal(mine[k], cli[k]) for k in cli)
    for name in ("memory_l", "memory_ab"):
        mine_bank, cli_bank = (np.asarray(jax.device_get(state.model_state[name].get_value()))
                               for state in states)
        np.testing.assert_array_equal(mine_bank, cli_bank)
        seen = np.abs(np.linalg.norm(cli_bank, axis=1) - 1.0) < 1e-5
        assert seen.sum() == 8 * 16  # an epoch reads each of the 160 rows once

    assert_same_step_on_one_device(trainer, states[1], overrides)


def banks_lost(state: TrainState) -> TrainState:
    """`state` with both memory banks zero, as if they were not checkpointed."""
    return dataclasses.replace(state, model_state=jax.tree_util.tree_map_with_path(
        lambda path, leaf: leaf * 0 if "memory" in jax.tree_util.keystr(path) else leaf,
        state.model_state))


def assert_same_step_on_one_device(mixed: Trainer, state, overrides: dict) -> None:
    """From a state of the 2 x 2 x 2 mesh (bank rows sharded over the data axes) and one batch,
    a step there and a step on one device give the same loss and memory banks, and the same
    update of every parameter tensor: the projections' to 1e-4 of its norm, the ResNets' to
    0.5% (float32 sums in another order, amplified on the way back through 20 BatchNorm
    layers, as tests/test_rotation_jigsaw.py measures; a gradient scaled or missing a device's
    share is off by 10% or more everywhere). Further steps on that batch lower its loss."""
    single = Trainer(make_config("cmc_tiny", {**overrides, **mesh_overrides((1, 1, 1))}),
                     mixed.workdir.parent / "single", devices=jax.devices()[:1])
    batch = next(mixed.data_iterator())
    initial = flat_params(state.params)
    results = {}
    copy = jax.device_put(jax.device_get(state), single.state_sharding)  # steps donate
    for name, trainer, start in (("single", single, copy), ("mixed", mixed, state)):
        state, metrics = trainer.train_step(start, batch)
        results[name] = (float(metrics["loss"][0]), flat_params(state.params),
                         [np.asarray(jax.device_get(state.model_state[bank].get_value()))
                          for bank in ("memory_l", "memory_ab")])
    (loss0, params0, banks0), (loss, params, banks) = results["single"], results["mixed"]
    assert loss == pytest.approx(loss0, rel=1e-5)
    for bank, bank0 in zip(banks, banks0, strict=True):
        np.testing.assert_allclose(bank, bank0, atol=1e-5)
    errors = {key: np.linalg.norm(params[key] - value) / np.linalg.norm(value - initial[key])
              for key, value in params0.items()}
    projections = [key for key in errors if "projection" in key]
    assert len(projections) == 4 and max(errors[key] for key in projections) < 1e-4, errors
    assert max(errors.values()) < 5e-3, errors
    losses = [loss]
    for _ in range(5):
        state, metrics = mixed.train_step(state, batch)
        losses.append(float(metrics["loss"][0]))
    assert losses[-1] < losses[0] - 1.0, losses
