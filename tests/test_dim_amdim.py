"""Deep InfoMax and AMDIM: the JSD and NCE losses and their gradients against numpy loops over
images and locations; AMDIM's multiscale pairing, its 5x5 source sampling, the encoder's 7x7 /
5x5 / 1x1 maps and their receptive fields, and its views (shared flip, reflected translation);
DIM's wiring of local and global terms. Training: `run.py pretrain --preset amdim_tiny` runs
with the kNN monitor and a killed copy resumes to the same losses and parameters; AMDIM
descends on fixed views; one sharded step equals the single-device one for both, and
`dim_tiny` trains on in its trainer with a falling loss."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from resilience_utils import (
    GRADIENT_STEP,
    abort_and_resume,
    final_params,
    flat_params,
    mesh_overrides,
    read_log,
    train_losses,
)
from tfds_utils import write_cifar10_folder

from pretext_jax import run
from pretext_jax.errors import UserError
from pretext_jax.models.infomax import AMDIMConfig, AMDIMOutput, DIMConfig
from pretext_jax.objectives.amdim import (
    AMDIMSettings,
    amdim_loss,
    amdim_views,
    build_amdim,
    check_amdim,
    multiscale_nce,
    nce_scores,
    source_locations,
)
from pretext_jax.objectives.common.two_view import ImageExampleConfig
from pretext_jax.objectives.dim import (
    DIMSettings,
    build_dim,
    check_dim,
    dim_loss,
    jsd_mi_loss,
)
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer


def softplus(x: float) -> float:
    return float(np.logaddexp(0.0, x))


def numpy_jsd_loss(vectors: np.ndarray, locations: np.ndarray) -> float:
    """-(E_P[-sp(-T)] - E_N[sp(T)]) with T[i, j, l] = vectors[i] . locations[j, l], looped."""
    positives, negatives = [], []
    for i in range(len(vectors)):
        for j in range(len(locations)):
            for loc in locations[j]:
                score = float(np.dot(vectors[i], loc))
                (positives if i == j else negatives).append(score)
    return -(np.mean([-softplus(-t) for t in positives])
             - np.mean([softplus(t) for t in negatives]))


def numpy_nce(sources: np.ndarray, targets: np.ndarray, tclip: float) -> tuple[float, float]:
    """costs.py's g2l NCE, looped: for image i and target location l, -log of exp(positive) over
    exp(positive) + the sum over every location of every other image; and mean(raw^2)."""
    count, locations, depth = targets.shape
    raw = np.zeros((count, count, locations))
    for i in range(count):
        for j in range(count):
            for loc in range(locations):
                raw[i, j, loc] = np.dot(sources[i], targets[j, loc]) / np.sqrt(depth)
    clipped = tclip * np.tanh(raw / tclip)
    losses = []
    for i in range(count):
        negatives = [clipped[i, j, m] for j in range(count) if j != i
                     for m in range(locations)]
        for loc in range(locations):
            positive = clipped[i, i, loc]
            losses.append(-(positive - np.log(np.exp(positive) + np.sum(np.exp(negatives)))))
    return float(np.mean(losses)), float(np.mean(raw ** 2))


def numeric_gradient(f, x: np.ndarray, h: float = 1e-5) -> np.ndarray:
    """Central differences of the float64 function f at x."""
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[index] += h
        down[index] -= h
        grad[index] = (f(up) - f(down)) / (2 * h)
    return grad


# --------------------------------------------------------------------------------- losses

def test_jsd_loss_and_gradients_equal_numpy():
    rng = np.random.default_rng(0)
    vectors, locations = rng.normal(size=(4, 3)), rng.normal(size=(4, 5, 3))
    loss, estimate = jsd_mi_loss(jnp.asarray(vectors, jnp.float32),
                                 jnp.asarray(locations, jnp.float32))
    expected = numpy_jsd_loss(vectors, locations)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert float(estimate) == pytest.approx(-expected, rel=1e-5)
    grads = jax.jit(jax.grad(lambda v, m: jsd_mi_loss(v, m)[0], argnums=(0, 1)))(
        jnp.asarray(vectors, jnp.float32), jnp.asarray(locations, jnp.float32))
    np.testing.assert_allclose(grads[0], numeric_gradient(
        lambda v: numpy_jsd_loss(v, locations), vectors), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grads[1], numeric_gradient(
        lambda m: numpy_jsd_loss(vectors, m), locations), rtol=1e-4, atol=1e-6)
    # Perfect separation (positives >> 0 >> negatives) approaches the bound's maximum: 2 log 2
    # above the shifted estimator's zero, i.e. an estimate of 0.
    separated = np.zeros((3, 2, 3))
    for i in range(3):
        separated[i, :, i] = 30.0
    vectors = np.eye(3) - 0.5
    assert float(jsd_mi_loss(jnp.asarray(vectors), jnp.asarray(separated))[0]) == (
        pytest.approx(0.0, abs=1e-5))


def test_nce_loss_and_gradients_equal_numpy():
    """Scores large enough for the tanh clip (tclip 2) to matter."""
    rng = np.random.default_rng(1)
    sources, targets = 2 * rng.normal(size=(3, 4)), 2 * rng.normal(size=(3, 4, 4))
    loss, squares = nce_scores(jnp.asarray(sources, jnp.float32),
                               jnp.asarray(targets, jnp.float32), 2.0)
    expected, expected_squares = numpy_nce(sources, targets, 2.0)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert float(squares) == pytest.approx(expected_squares, rel=1e-5)
    assert expected_squares > 2.0  # raw scores beyond the clip's linear range

    def total(s, t):
        nce, square = nce_scores(s, t, 2.0)
        return nce + 0.05 * square

    def numpy_total(s, t):
        nce, square = numpy_nce(s, t, 2.0)
        return nce + 0.05 * square

    grads = jax.jit(jax.grad(total, argnums=(0, 1)))(jnp.asarray(sources, jnp.float32),
                                                     jnp.asarray(targets, jnp.float32))
    np.testing.assert_allclose(grads[0], numeric_gradient(
        lambda s: numpy_total(s, targets), sources), rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(grads[1], numeric_gradient(
        lambda t: numpy_total(sources, t), targets), rtol=1e-3, atol=1e-6)


def test_multiscale_pairs_and_source_locations():
    """1->5, 1->7 and 5->5 in both directions, each pair the mean of its two directions, plus
    0.05 x 0.5 x the six mean squared scores; the 5->5 source of each image is its r5 at one
    location drawn uniformly from the 25."""
    rng = np.random.default_rng(2)
    views = [AMDIMOutput(r1=jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
                         r5=jnp.asarray(rng.normal(size=(3, 5, 5, 4)), jnp.float32),
                         r7=jnp.asarray(rng.normal(size=(3, 7, 7, 4)), jnp.float32))
             for _ in range(2)]
    key = jax.random.key(3)
    loss, metrics = jax.jit(multiscale_nce, static_argnums=3)(*views, key, AMDIMSettings())
    flat = [{name: np.asarray(getattr(v, name)).reshape(3, -1, 4) for name in ("r5", "r7")}
            for v in views]
    sources = [{"r1": np.asarray(v.r1), "r5": np.asarray(source_locations(k, v.r5))}
               for k, v in zip(jax.random.split(key), views, strict=True)]
    expected, squares = 0.0, 0.0
    for source, target in (("r1", "r5"), ("r1", "r7"), ("r5", "r5")):
        pair = 0.0
        for a, b in ((0, 1), (1, 0)):
            nce, square = numpy_nce(sources[a][source], flat[b][target], 20.0)
            pair, squares = pair + 0.5 * nce, squares + square
        assert float(metrics[f"nce_{source[1]}t{target[1]}"][0]) == pytest.approx(pair,
                                                                                   rel=1e-5)
        expected += pair
    assert float(loss) == pytest.approx(expected + 0.025 * squares, rel=1e-5)
    # Source locations: rows of the map, all 25 drawn about equally often.
    maps = jnp.arange(400 * 25 * 2, dtype=jnp.float32).reshape(400, 5, 5, 2)
    picked = np.asarray(source_locations(jax.random.key(0), maps))
    index = (picked[:, 0] - np.arange(400) * 50) / 2
    assert np.array_equal(index, np.round(index)) and set(index.astype(int)) == set(range(25))
    np.testing.assert_array_equal(picked, np.asarray(maps).reshape(400, 25, 2)[
        np.arange(400), index.astype(int)])
    assert np.bincount(index.astype(int)).max() < 35  # 16 expected per location


# ------------------------------------------------------------------------ AMDIM's network

TINY_AMDIM = AMDIMConfig(ndf=4, n_rkhs=16, n_depth=1)


def test_encoder_scales_and_receptive_fields():
    """On 32-pixel images: r1 [B, n_rkhs], r5 [B, 5, 5, n_rkhs], r7 [B, 7, 7, n_rkhs]. r7 at
    (i, j) sees pixels [4i, 4i + 8) x [4j, 4j + 8) (conv 3, then windows 4/2 and 2/2), r5 at
    (0, 0) the 16 x 16 corner (one more 3-window over r7's grid), r1 every pixel."""
    model = build_amdim(TINY_AMDIM, 0)
    forward = nnx.jit(lambda model, x: model(x, train=False))
    images = jnp.asarray(np.random.default_rng(0).random((2, 32, 32, 3)), jnp.float32)
    base = forward(model, images)
    assert base.r1.shape == (2, 16) and base.r5.shape == (2, 5, 5, 16)
    assert base.r7.shape == (2, 7, 7, 16)

    def changed(row: int, column: int) -> tuple[bool, bool, bool]:
        out = forward(model, images.at[:, row, column].add(5.0))
        return tuple(not np.allclose(np.asarray(a), np.asarray(b), atol=1e-6) for a, b in (
            (out.r7[:, 1, 1], base.r7[:, 1, 1]), (out.r5[:, 0, 0], base.r5[:, 0, 0]),
            (out.r1, base.r1)))

    assert changed(4, 11) == (True, True, True)
    assert changed(11, 11) == (True, True, True)
    assert changed(12, 4) == (False, True, True)
    assert changed(3, 8) == (False, True, True)
    assert changed(16, 2) == (False, False, True)
    assert changed(31, 31) == (False, False, True)
    with pytest.raises(UserError, match="objective.image_size=32"):
        check_amdim(TINY_AMDIM, ImageExampleConfig(), AMDIMSettings(image_size=64))
    with pytest.raises(UserError, match="host_crop_size=0"):
        check_amdim(TINY_AMDIM, ImageExampleConfig(host_crop_size=32), AMDIMSettings())


def test_views_share_the_flip_and_translate_with_reflection():
    """Colour off: each view is a window of the reflect-padded image, shifted by up to 4 in
    each axis (all shifts occur), of the image or its mirror, the same one for both views."""
    images = np.random.default_rng(0).integers(0, 256, (32, 32, 32, 3), np.uint8)
    views_of = jax.jit(amdim_views, static_argnums=2)
    settings = AMDIMSettings(translate_probability=1.0, brightness=0.0, contrast=0.0,
                             saturation=0.0, hue=0.0, grayscale_probability=0.0)
    views = [np.asarray(v) for v in views_of(jax.random.key(0), jnp.asarray(images),
                                             settings)]
    floats = images / 255.0
    flips, shifts = [], set()
    for b in range(32):
        found = []
        for view in views:
            for flip, image in ((0, floats[b]), (1, floats[b][:, ::-1])):
                padded = np.pad(image, ((4, 4), (4, 4), (0, 0)), mode="reflect")
                for dy in range(9):
                    for dx in range(9):
                        if np.allclose(padded[dy:dy + 32, dx:dx + 32], view[b], atol=1e-6):
                            found.append(flip)
                            shifts.add((dy - 4, dx - 4))
        assert len(found) == 2 and found[0] == found[1], b
        flips.append(found[0])
    assert 0.25 < np.mean(flips) < 0.75 and {s for s, _ in shifts} == set(range(-4, 5))
    assert not np.array_equal(*views)
    # The colour pipeline: grayscale in about a quarter of the views.
    gray = [np.allclose(v[..., 0], v[..., 1]) for v in np.concatenate(views_of(
        jax.random.key(1), jnp.asarray(images), AMDIMSettings()))]
    assert 0.1 < np.mean(gray) < 0.45


# ------------------------------------------------------------------------------------ DIM

def test_dim_loss_is_beta_local_plus_alpha_global_of_the_models_embeddings():
    """Evaluation mode: local JSD over the stage-3 map's 4x4 locations of 16-pixel images
    (embedded to mi_units), global JSD over one embedding of the map per image."""
    config = DIMConfig(depth=10, stem="cifar", base_width=2, hidden_dim=8, global_dim=4,
                       mi_units=6)
    model = build_dim(config, 0)
    images = np.random.default_rng(0).integers(0, 256, (4, 16, 16, 3), np.uint8)
    settings = DIMSettings(image_size=16, global_weight=0.5, local_weight=1.0)
    loss, metrics = nnx.jit(dim_loss, static_argnames="objective")(
        model, {"image": jnp.asarray(images)}, None, objective=settings)
    out = nnx.jit(lambda model, x: model(x, train=False, global_dim=True))(
        model, jnp.asarray(images / 255.0, jnp.float32))
    assert out.local.shape == (4, 4, 4, 6) and out.global_.shape == (4, 6)
    local = numpy_jsd_loss(np.asarray(out.global_, np.float64),
                           np.asarray(out.local, np.float64).reshape(4, 16, 6))
    global_ = numpy_jsd_loss(np.asarray(out.global_vector, np.float64),
                             np.asarray(out.global_map, np.float64)[:, None])
    assert float(loss) == pytest.approx(local + 0.5 * global_, rel=1e-4)
    assert float(metrics["local_jsd"][0]) == pytest.approx(-local, rel=1e-4)
    with pytest.raises(UserError, match="model.global_mi=true"):
        check_dim(DIMConfig(global_mi=False), ImageExampleConfig(), settings)


# ------------------------------------------------------------------------------- training

def disc_images(rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray]:
    """[count, 32, 32, 3] uint8 images of a disc of random colour and radius on a random
    background, and the radius classes (0 or 1)."""
    yy, xx = np.mgrid[0:32, 0:32]
    fg, bg = rng.integers(0, 256, (2, count, 1, 1, 3))
    radius = rng.integers(6, 14, (count, 1, 1))
    disc = ((yy - 16) ** 2 + (xx - 16) ** 2 < radius ** 2)[..., None]
    pixels = np.clip(np.where(disc, fg, bg) + rng.normal(0, 8, (count, 32, 32, 3)), 0, 255)
    return pixels.astype(np.uint8), (radius[:, 0, 0] - 6) // 4


@pytest.fixture(scope="module")
def disc_folder(tmp_path_factory) -> str:
    """A CIFAR-10-format folder of 96 disc images (`disc_images`), 16 per batch file."""
    root = tmp_path_factory.mktemp("discs")
    rng = np.random.default_rng(0)
    return write_cifar10_folder(root, lambda: disc_images(rng, 16))


SMALL = {"amdim_tiny": {"model.ndf": 4, "model.n_rkhs": 16, "model.n_depth": 1},
         "dim_tiny": {"model.depth": 10, "model.base_width": 2, "model.hidden_dim": 8,
                      "model.global_dim": 4, "model.mi_units": 8, "objective.image_size": 16}}


def settings(preset: str, data: str, tmp_path, **overrides) -> dict:
    return {**SMALL[preset], "data.source": data, "data.cache_dir": str(tmp_path / "cache"),
            "train.batch_size": 16, "train.steps": 8, "train.log_every": 1,
            "train.eval_every": 1000, "train.eval_batches": 1, "train.checkpoint_every": 3,
            "train.progress": False, "examples.knn_bank_size": 32, "examples.knn_k": 5,
            **overrides}


def test_cli_trains_amdim_tiny_and_a_killed_copy_resumes_exactly(disc_folder, tmp_path):
    """`run.py pretrain --preset amdim_tiny` runs 8 steps (the loss starts below chance,
    log(1 + 15 x 25) + log(1 + 15 x 49) + log(1 + 15 x 25), and stays finite; with
    augmented views 8 steps of this tiny encoder do not move it measurably, see the fixed-view
    test) and the kNN monitor runs at the end. The same run killed in place of step 5
    (`abort_and_resume`: last checkpoint step 3), then rerun: every step's loss and the final
    parameters equal the CLI run's bit for bit."""
    overrides = settings("amdim_tiny", disc_folder, tmp_path, **{"train.eval_every": 8})
    args = [f"{k}={v}" for k, v in overrides.items() if k != "data.source"]
    assert run.main(["pretrain", "--preset", "amdim_tiny", "--data", disc_folder,
                     "--workdir", str(tmp_path / "cli"), *args]) == 0
    rows = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").read_text()
            .splitlines()]
    losses = [row["loss"] for row in rows if row["split"] == "train"]
    chance = 2 * np.log(1 + 15 * 25) + np.log(1 + 15 * 49)
    assert len(losses) == 8 and np.isfinite(losses).all() and losses[0] < chance, losses
    assert any(row["split"] == "eval" and 0 <= row["knn_accuracy"] <= 1 for row in rows)
    ours = abort_and_resume("amdim_tiny", overrides, tmp_path, step=5)
    executed = [step for step, _ in read_log(ours[1])]
    assert 5 in executed and executed[-1] == 8 and len(executed) > 8, executed
    assert train_losses(ours[0]) == train_losses(tmp_path / "cli")
    mine, reference = (final_params("amdim_tiny", overrides, w) for w in (ours[0],
                                                                          tmp_path / "cli"))
    assert mine.keys() == reference.keys()
    assert all(np.array_equal(mine[k], reference[k]) for k in reference)


def test_amdim_descends_on_fixed_views():
    """With the views and 5x5 sources fixed (one key), twelve Adam steps (lr 3e-3, b1 0.8,
    training-mode BatchNorm) on 16 disc images lower the NCE terms steadily, by more than 1
    nat (at most one step up)."""
    model = build_amdim(TINY_AMDIM, 0)
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = optax.adam(3e-3, b1=0.8)
    batch = {"image": jnp.asarray(disc_images(np.random.default_rng(1), 16)[0])}

    @jax.jit
    def step(params, state):
        def loss(params):
            metrics = amdim_loss(nnx.merge(graph, params, rest, copy=True), batch,
                                 jax.random.key(0), objective=AMDIMSettings())[1]
            return sum(metrics[f"nce_{pair}"][0] for pair in ("1t5", "1t7", "5t5"))

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    state, losses = optimizer.init(params), []
    for _ in range(12):
        params, state, value = step(params, state)
        losses.append(float(value))
    assert losses[-1] < losses[0] - 1.0 and sum(np.diff(losses) > 0) <= 1, losses


@pytest.mark.parametrize("preset", ["dim_tiny", "amdim_tiny"])
def test_sharded_step_equals_the_single_device_step(preset, disc_folder, tmp_path):
    """One plain gradient step (GRADIENT_STEP) on one device and on data x fsdp x tensor =
    2 x 2 x 2 from the same batch and initial parameters: the same loss, and every
    parameter's update the same to 0.5% of its size (float32 sums in another order; a
    gradient scaled or missing a device's share is off by 10% or more). dim_tiny (local and
    global DIM, no augmentation) then trains on: six more steps on the same batch lower the
    loss and raise both JSD estimates."""
    results, batch, initial, single = {}, None, None, None
    for name, mesh, devices in (("single", (1, 1, 1), jax.devices()[:1]),
                                ("mixed", (2, 2, 2), None)):
        values = settings(preset, disc_folder, tmp_path, **{
            **GRADIENT_STEP, "optim.learning_rate": 0.1, **mesh_overrides(mesh)})
        trainer = Trainer(make_config(preset, values), tmp_path / name, devices=devices)
        batch = next(trainer.data_iterator()) if batch is None else batch
        state = trainer.init_state()
        initial = flat_params(state.params) if initial is None else initial
        state, metrics = trainer.train_step(state, batch)
        results[name] = float(metrics["loss"][0]), flat_params(state.params)
        if name == "single":
            single = trainer, state, metrics
    if preset == "dim_tiny":
        trainer, state, first = single
        history = [first]
        for _ in range(6):
            state, metrics = trainer.train_step(state, batch)
            history.append(metrics)
        losses = [float(m["loss"][0]) for m in history]
        # every later loss under the first, the last 0.3 under it (a step may rise: CPUs differ)
        assert max(losses[1:]) < losses[0] and losses[-1] < losses[0] - 0.3, losses
        for name in ("local_jsd", "global_jsd"):
            assert float(history[-1][name][0]) > float(history[0][name][0]), history
    loss0, params0 = results["single"]
    moved = {k for k, v in params0.items() if np.abs(v - initial[k]).max() > 1e-6}
    assert len(moved) > 0.6 * len(params0)  # AMDIM: convs before zero-initialised ones stay
    loss, params = results["mixed"]
    assert loss == pytest.approx(loss0, rel=1e-5)
    errors = {k: np.linalg.norm(params[k] - params0[k]) / np.linalg.norm(params0[k] - initial[k])
              for k in moved}
    assert max(errors.values()) < 5e-3, errors
