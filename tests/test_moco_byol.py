"""MoCo v2 and BYOL: the queue, the momentum (EMA) updates, the losses and their gradients
against numpy and hand computations, BYOL's target schedule, the new augmentations and SGD, and
both methods trained through the Trainer on a sharded mesh with the kNN monitor."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tfds_utils import write_cifar10_folder

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import image_augment as aug
from pretext_jax.models.momentum import EMA, BYOLConfig, MoCoConfig, call_in_groups
from pretext_jax.objectives.byol import (
    BYOLLossSettings,
    build_byol,
    byol_loss,
    target_decay,
    update_decay,
)
from pretext_jax.objectives.common.two_view import two_views
from pretext_jax.objectives.moco import (
    MoCoLossSettings,
    build_moco,
    info_nce,
    moco_loss,
)
from pretext_jax.pretrain.config import OptimConfig, make_config
from pretext_jax.pretrain.optim import make_optimizer
from pretext_jax.pretrain.trainer import Trainer

TINY_NET = dict(depth=10, stem="cifar", base_width=2)
VIEW_SIZE = 16


def normalize(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def flat(state: nnx.State) -> dict[tuple, np.ndarray]:
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(state)}


def images(count: int, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, 256, (count, 24, 24, 3)),
                       jnp.uint8)


def step(model: nnx.Module, loss_fn, batch, rng):
    """One training loss as the trainer runs it: gradients w.r.t. the parameters only, the
    other state (EMA, queue, statistics) as the loss leaves it."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        inner = nnx.merge(graphdef, params, rest, copy=True)
        value, metrics = loss_fn(inner, batch, rng)
        return value, (metrics, nnx.state(inner, nnx.Not(nnx.Param)))

    (value, (metrics, new_rest)), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return value, metrics, grads, nnx.merge(graphdef, params, new_rest)


def perturb(model: nnx.Module, seed: int) -> None:
    """Stands in for an optimizer step: moves every online parameter."""
    for i, (_, variable) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        noise = jax.random.normal(jax.random.key(seed * 1000 + i), variable.get_value().shape)
        variable.set_value(variable.get_value() + 0.05 * noise)


# ------------------------------------------------------------------------------ MoCo

def numpy_info_nce(q: np.ndarray, k: np.ndarray, queue: np.ndarray, t: float) -> float:
    """He et al. 2020 eq. 1 written out: -log exp(q.k+/t) / (exp(q.k+/t) + sum exp(q.k_i/t))."""
    total = 0.0
    for qi, ki in zip(q.astype(np.float64), k.astype(np.float64), strict=True):
        logits = np.concatenate([[qi @ ki], queue.astype(np.float64) @ qi]) / t
        total += np.log(np.exp(logits).sum()) - logits[0]
    return total / len(q)


def test_info_nce_equals_numpy():
    rng = np.random.default_rng(0)
    q, k = normalize(rng.standard_normal((2, 6, 5))).astype(np.float32)
    queue = normalize(rng.standard_normal((9, 5))).astype(np.float32)
    loss, metrics = info_nce(jnp.asarray(q), jnp.asarray(k), jnp.asarray(queue), 0.2)
    assert float(loss) == pytest.approx(numpy_info_nce(q, k, queue, 0.2), rel=1e-5)
    assert float(metrics["contrastive_loss"][0]) == pytest.approx(6 * float(loss), rel=1e-5)
    # Keys equal to the queries beat every queue entry: accuracy 6/6; unrelated keys do not.
    _, same = info_nce(jnp.asarray(q), jnp.asarray(q), jnp.asarray(queue), 0.2)
    assert float(same["contrastive_accuracy"][0]) == 6
    expected = sum(float(q[i] @ k[i]) > (queue @ q[i]).max() for i in range(6))
    assert float(metrics["contrastive_accuracy"][0]) == expected < 6


def test_moco_steps_against_numpy_queue_ema_loss_and_gradients():
    """Three training losses of a tiny MoCo with the online parameters moved between them.
    Reference per step: key encoder = m * key + (1 - m) * query (every parameter), keys =
    the updated key encoder on the second views, written over the oldest queue rows with the
    pointer wrapping around K = 20 (batch 8); InfoNCE against the queue as it was before the
    step. One BatchNorm group per image (`shuffle_bn_groups` = batch), so every key is a
    function of its own image and a wrong un-shuffle would misplace keys. The gradients equal
    those of InfoNCE with the keys held constant: nothing flows through the key encoder or
    its momentum update."""
    config = MoCoConfig(**TINY_NET, projection_dim=8, queue_size=20)
    settings = MoCoLossSettings(momentum=0.9, shuffle_bn_groups=8, image_size=VIEW_SIZE,
                                blur_probability=0.0, second_blur_probability=0.0)
    model = nnx.jit(lambda: build_moco(config, 0))()
    assert not any("target" in str(path) for path in flat(nnx.state(model, nnx.Param)))
    assert flat(nnx.state(model.target, EMA)).keys() == flat(nnx.state(model.online,
                                                                       nnx.Param)).keys()
    queue = np.asarray(model.queue.get_value())
    np.testing.assert_allclose(np.linalg.norm(queue, axis=1), 1.0, rtol=1e-5)
    target = flat(nnx.state(model.online, nnx.Param))  # initialised equal (builder.py)
    batch = {"image": images(8)}
    run = jax.jit(lambda m, key: step(m, functools.partial(moco_loss, objective=settings),
                                      batch, key))

    @nnx.jit
    def reference(model, rng):
        """Queries, keys and the constant-key gradients, from a model whose key encoder
        already holds the expected average."""
        query_images, key_images = two_views(jax.random.split(rng)[0], batch["image"],
                                             settings.view_augmentations)
        keys = call_in_groups(model.target, key_images, 8).projections
        keys = keys / jnp.linalg.norm(keys, axis=1, keepdims=True)
        graphdef, params, rest = nnx.split(model.online, nnx.Param, ...)

        def fixed_keys_loss(params):
            online = nnx.merge(graphdef, params, rest, copy=True)
            queries = call_in_groups(online, query_images, 8).projections
            queries = queries / jnp.linalg.norm(queries, axis=1, keepdims=True)
            return info_nce(queries, keys, model.queue.get_value(), 0.2)[0], queries

        grads, queries = jax.grad(fixed_keys_loss, has_aux=True)(params)
        return queries, keys, grads

    pointer = 0
    for t in range(3):
        if t:
            perturb(model, t)
        online = flat(nnx.state(model.online, nnx.Param))
        target = {p: 0.9 * target[p] + 0.1 * online[p] for p in target}
        expected_model = nnx.clone(model)
        nnx.update(expected_model.target, nnx.from_flat_state(
            {p: EMA(jnp.asarray(v)) for p, v in target.items()}))
        q, k, expected_grads = jax.tree.map(np.asarray, reference(expected_model,
                                                                  jax.random.key(t)))

        loss, metrics, grads, model = run(model, jax.random.key(t))

        for path, value in flat(nnx.state(model.target, EMA)).items():
            np.testing.assert_allclose(value, target[path], rtol=1e-5, atol=1e-6,
                                       err_msg=str(path))
        rows = (pointer + np.arange(8)) % 20
        expected_queue = queue.copy()
        expected_queue[rows] = k
        np.testing.assert_allclose(np.asarray(model.queue.get_value()), expected_queue,
                                   atol=2e-5)
        assert float(loss) == pytest.approx(numpy_info_nce(q, k, queue, 0.2), rel=1e-4)
        pointer = (pointer + 8) % 20
        assert int(model.queue_pointer.get_value()) == pointer
        queue = expected_queue
        ours, expected_grads = flat(grads["online"]), flat(expected_grads)
        scale = max(np.abs(v).max() for v in expected_grads.values())
        for path, value in expected_grads.items():
            np.testing.assert_allclose(ours[path], value, rtol=1e-3, atol=1e-5 * scale,
                                       err_msg=str(path))
    assert pointer == 4  # 0 -> 8 -> 16 -> wrapped to 4
    assert float(metrics["contrastive_accuracy"][1]) == 8


def test_symmetric_moco_averages_both_directions_and_enqueues_both_key_sets():
    """`objective.symmetric` (moco's CIFAR-10 colab demo, lightly's benchmark): the loss is
    the mean of InfoNCE(q(view 1), k(view 2)) and InfoNCE(q(view 2), k(view 1)) against the
    queue as it was, and the queue then holds [k(view 1), k(view 2)]. One BatchNorm group per
    image, so every query and key is a function of its own view (and the initial key encoder
    equals the query encoder). Control: the one-direction loss differs; a queue shorter than
    both key sets is refused."""
    config = MoCoConfig(**TINY_NET, projection_dim=8, queue_size=20)
    settings = MoCoLossSettings(shuffle_bn_groups=8, image_size=VIEW_SIZE, symmetric=True,
                                blur_probability=0.0, second_blur_probability=0.0)
    model = nnx.jit(lambda: build_moco(config, 0))()
    batch, rng = {"image": images(8)}, jax.random.key(5)
    queue = np.asarray(model.queue.get_value())
    views = two_views(jax.random.split(rng)[0], batch["image"], settings.view_augmentations)

    def projected(encoder, view):
        out = call_in_groups(nnx.clone(encoder), view, 8).projections
        return np.asarray(out / jnp.linalg.norm(out, axis=1, keepdims=True))

    queries = [projected(model.online, view) for view in views]
    keys = [projected(model.online, view) for view in views]  # key encoder = query encoder
    expected = (numpy_info_nce(queries[0], keys[1], queue, 0.2)
                + numpy_info_nce(queries[1], keys[0], queue, 0.2)) / 2
    one_way = numpy_info_nce(queries[0], keys[1], queue, 0.2)
    assert abs(expected - one_way) > 2e-4 * expected  # tiny nets: the views differ little

    loss, metrics, _, after = jax.jit(lambda m: step(
        m, functools.partial(moco_loss, objective=settings), batch, rng))(model)
    assert float(loss) == pytest.approx(expected, rel=2e-5)
    assert float(metrics["contrastive_loss"][1]) == 16
    expected_queue = queue.copy()
    expected_queue[:16] = np.concatenate(keys)
    np.testing.assert_allclose(np.asarray(after.queue.get_value()), expected_queue, atol=2e-5)
    assert int(after.queue_pointer.get_value()) == 16
    short = nnx.jit(lambda: build_moco(MoCoConfig(**TINY_NET, projection_dim=8,
                                                  queue_size=12), 0))()
    with pytest.raises(UserError, match="queue_size=12 is smaller than the 16 keys"):
        moco_loss(short, batch, rng, objective=settings)


class ConvNormalized(nnx.Module):
    """A small stand-in for an encoder: convolution, BatchNorm, mean over the image."""

    def __init__(self, rngs: nnx.Rngs):
        self.convolution = nnx.Conv(3, 4, (3, 3), rngs=rngs)
        self.normalization = nnx.BatchNorm(4, rngs=rngs)

    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        return self.normalization(self.convolution(x), use_running_average=not train).mean((1, 2))


def test_batchnorm_groups_are_separate_forward_passes():
    """`call_in_groups`: outputs of each group as if run alone (not the whole batch's);
    running statistics advanced by the mean of the groups' updates."""
    encoder = ConvNormalized(nnx.Rngs(0))
    x = jax.random.uniform(jax.random.key(1), (6, 5, 5, 3)) * jnp.arange(1, 7)[:, None, None, None]
    alone = [nnx.clone(encoder) for _ in range(2)]
    expected = np.concatenate([np.asarray(a(x[3 * i:3 * i + 3], train=True))
                               for i, a in enumerate(alone)])
    grouped = call_in_groups(encoder, x, 2)
    np.testing.assert_allclose(np.asarray(grouped), expected, atol=1e-5)
    assert not np.allclose(np.asarray(nnx.clone(encoder)(x, train=True)), expected, atol=1e-3)
    mean = jax.tree.map(lambda a, b: (a + b) / 2, *(flat(nnx.state(a, nnx.BatchStat))
                                                    for a in alone))
    for path, value in flat(nnx.state(encoder, nnx.BatchStat)).items():
        np.testing.assert_allclose(value, mean[path], atol=1e-6, err_msg=str(path))


# ------------------------------------------------------------------------------ BYOL

def test_byol_target_decay_schedule():
    """tau_k = 1 - (1 - tau_base)(cos(pi k / K) + 1) / 2, held at 1 after K."""
    k = np.array([0, 1, 50, 99, 100, 150])
    expected = 1 - (1 - 0.996) * (np.cos(np.pi * np.minimum(k, 100) / 100) + 1) / 2
    np.testing.assert_allclose(np.asarray(target_decay(jnp.asarray(k), 0.996, 100)), expected,
                               rtol=1e-6)
    assert expected[0] == pytest.approx(0.996) and expected[2] == pytest.approx(0.998)
    # What each update uses: none at the first, then tau_(k-1); constant: tau_base throughout
    # (lightly's CIFAR-10 benchmark); the control, the cosine schedule, rises.
    updates = jnp.arange(5)
    cosine = BYOLLossSettings(base_target_decay=0.99, target_decay_steps=4)
    np.testing.assert_allclose(np.asarray(update_decay(updates, cosine)), [1.0, *np.asarray(
        target_decay(jnp.arange(4), 0.99, 4))], rtol=1e-6)
    constant = dataclasses.replace(cosine, constant_target_decay=True)
    np.testing.assert_allclose(np.asarray(update_decay(updates, constant)),
                               [1.0, 0.99, 0.99, 0.99, 0.99], rtol=1e-6)


def test_byol_steps_against_numpy_ema_loss_and_stop_gradient():
    """Three BYOL training losses with the online parameters moved between them. Reference
    (byol_experiment.py, shifted to the start of the next step): no update at step 0 (the
    target keeps its own initialisation), then target = tau_{t-1} target + (1 - tau_{t-1})
    online_t; loss = mean of ||p1/|p1| - z2/|z2|||^2 + ||p2/|p2| - z1/|z1|||^2 = 2 - 2 cos
    each, computed in numpy from the networks' outputs; the gradients are those of that
    loss with the target's projections held constant."""
    config = BYOLConfig(**TINY_NET, projection_hidden_dim=16, projection_dim=8,
                        predictor_hidden_dim=16)
    settings = BYOLLossSettings(base_target_decay=0.9, target_decay_steps=4,
                                image_size=VIEW_SIZE)
    model = nnx.jit(lambda: build_byol(config, 0))()
    online0 = flat(nnx.state(model.online, nnx.Param))
    target = flat(nnx.state(model.target, EMA))
    assert any(not np.allclose(target[p], online0[p]) for p in target)  # independent init
    batch = {"image": images(8, seed=1)}
    run = jax.jit(lambda m, key: step(m, functools.partial(byol_loss, objective=settings),
                                      batch, key))

    @nnx.jit
    def reference(model, rng):
        views = two_views(rng, batch["image"], settings.view_augmentations)
        z = [model.target(v, train=True).projections for v in views]
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def fixed_target_loss(params):
            inner = nnx.merge(graphdef, params, rest, copy=True)
            p = [inner.predictor(inner.online(v, train=True).projections, True) for v in views]
            pn, zn = ([x / jnp.linalg.norm(x, axis=1, keepdims=True) for x in y] for y in (p, z))
            loss = jnp.mean(jnp.sum((pn[0] - zn[1]) ** 2, 1) + jnp.sum((pn[1] - zn[0]) ** 2, 1))
            return loss, p

        (loss, p), grads = jax.value_and_grad(fixed_target_loss, has_aux=True)(params)
        return p, z, loss, grads

    for t in range(3):
        if t:
            perturb(model, t)
        online = flat(nnx.state(model.online, nnx.Param))
        if t:
            tau = 1 - (1 - 0.9) * (np.cos(np.pi * (t - 1) / 4) + 1) / 2
            target = {p: tau * target[p] + (1 - tau) * online[p] for p in target}
        expected_model = nnx.clone(model)
        nnx.update(expected_model.target, nnx.from_flat_state(
            {p: EMA(jnp.asarray(v)) for p, v in target.items()}))
        p, z, expected, expected_grads = jax.tree.map(
            np.asarray, reference(expected_model, jax.random.key(t)))

        loss, metrics, grads, model = run(model, jax.random.key(t))

        for path, value in flat(nnx.state(model.target, EMA)).items():
            np.testing.assert_allclose(value, target[path], rtol=1e-5, atol=1e-6,
                                       err_msg=str(path))
        assert int(model.target_updates.get_value()) == t + 1
        assert float(metrics["target_decay"][0]) == pytest.approx(tau if t else 1.0)
        cos = [np.sum(normalize(a) * normalize(b), 1) for a, b in ((p[0], z[1]), (p[1], z[0]))]
        assert float(loss) == pytest.approx(float(np.mean(4 - 2 * cos[0] - 2 * cos[1])),
                                            rel=1e-4)
        assert float(loss) == pytest.approx(float(expected), rel=1e-5)
        ours, expected_grads = flat(grads), flat(expected_grads)
        scale = max(np.abs(v).max() for v in expected_grads.values())
        for path, value in expected_grads.items():
            np.testing.assert_allclose(ours[path], value, rtol=1e-3, atol=1e-5 * scale,
                                       err_msg=str(path))


# ---------------------------------------------------------------- augmentations, optimizer

def test_solarize_additive_brightness_and_asymmetric_views():
    x = jnp.asarray(np.random.default_rng(0).random((8, 8, 3)), jnp.float32)
    np.testing.assert_allclose(aug.solarize(x), np.where(x < 0.5, x, 1 - x))
    # Only brightness, additive: every pixel moves by the same delta in [-0.4, 0.4] (before the
    # clip to [0, 1]).
    mid = jnp.full((4, 4, 3), 0.5)
    shifted = np.asarray(aug.color_jitter(jax.random.key(3), mid, (0.4, 0, 0, 0), True))
    delta = shifted - 0.5
    assert np.allclose(delta, delta.flat[0]) and 0 < abs(delta.flat[0]) <= 0.4
    scaled = np.asarray(aug.color_jitter(jax.random.key(3), mid * 0, (0.4, 0, 0, 0)))
    np.testing.assert_array_equal(scaled, 0.0)  # multiplicative: black stays black
    first, second = BYOLLossSettings().view_augmentations()
    assert (first.blur_probability, first.solarize_probability) == (1.0, 0.0)
    assert (second.blur_probability, second.solarize_probability) == (0.1, 0.2)
    assert first.jitter == (0.4, 0.4, 0.2, 0.1) and first.additive_brightness
    # Solarisation p 1 on a view without other changes is the solarised image.
    plain = aug.AugmentConfig(image_size=8, crop=False, flip=False, jitter_strength=0.0,
                              grayscale_probability=0.0, blur_probability=0.0,
                              solarize_probability=1.0)
    np.testing.assert_allclose(aug.augment(jax.random.key(0), x, plain), aug.solarize(x),
                               atol=1e-6)


def test_sgd_is_torch_sgd_with_weight_decay_everywhere():
    """torch.optim.SGD (main_moco.py): d = g + wd w on every parameter, v = m v + d,
    w -= lr_t v, with the learning rate applied outside the momentum buffer."""
    config = OptimConfig(optimizer="sgd", learning_rate=0.3, schedule="cosine",
                         warmup_steps=0, weight_decay=1e-4, momentum=0.9, clip_norm=0.0)
    tx = make_optimizer(config, total_steps=4)
    params = {"bn": {"scale": jnp.asarray([1.0, -2.0])}, "w": jnp.asarray([[0.5, 3.0]])}
    state = tx.init(params)
    expected = jax.tree.map(np.asarray, params)
    velocity = jax.tree.map(np.zeros_like, expected)
    for t in range(3):
        grads = jax.tree.map(lambda a, t=t: jnp.cos(a * (t + 1)), params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        lr = 0.3 * 0.5 * (1 + np.cos(np.pi * t / 4))
        d = jax.tree.map(lambda g, w: np.asarray(g) + 1e-4 * w, grads, expected)
        velocity = jax.tree.map(lambda v, d: 0.9 * v + d, velocity, d)
        expected = jax.tree.map(lambda w, v, lr=lr: w - lr * v, expected, velocity)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6)


# ----------------------------------------------------------------------------- trainer

@pytest.fixture(scope="module")
def colour_folder(tmp_path_factory):
    """A CIFAR-10-format folder of 192 images, each one random colour with pixel noise, in 4
    classes: instances that a 4-wide ResNet can tell apart within a few dozen steps."""
    root = tmp_path_factory.mktemp("colours")
    rng = np.random.default_rng(0)

    def batch():
        colours = rng.integers(0, 256, (32, 1, 1, 3))
        pixels = np.clip(colours + rng.normal(0, 12, (32, 32, 32, 3)), 0, 255)
        return pixels, colours[:, 0, 0, 0] // 64

    return write_cifar10_folder(root, batch)


def train(preset: str, workdir, data: str, mesh: tuple[int, int, int], **overrides):
    values = {"data.source": data, "data.cache_dir": str(workdir.parent / "cache"),
              "model.depth": 10, "model.base_width": 4, "objective.image_size": 16,
              "objective.brightness": 0.0, "objective.contrast": 0.0,
              "objective.saturation": 0.0, "objective.hue": 0.0,
              "train.batch_size": 32, "train.steps": 40, "train.log_every": 10,
              "train.eval_every": 40, "train.eval_batches": 1, "train.progress": False,
              "train.checkpoint_every": 40, "mesh.data": mesh[0], "mesh.fsdp": mesh[1],
              "mesh.tensor": mesh[2], **overrides}
    summary = Trainer(make_config(preset, values), workdir).run()
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return summary, [r["loss"] for r in lines if r.get("split") == "train"]


def test_moco_trains_on_a_mixed_mesh_and_keeps_its_queue(tmp_path, colour_folder):
    """moco_tiny on data x fsdp x tensor = 2 x 2 x 2 (shuffled BatchNorm in 4 groups, K = 64,
    m = 0.9; Adam, because SGD needs far more than 60 steps to leave the start, where all
    features point the same way): the InfoNCE loss, at chance level log(K + 1) once the queue
    holds real keys, falls well below it; the kNN monitor runs at evaluation; the queue, its
    pointer and the key encoder come back from the checkpoint; linear evaluation gets the
    query backbone. A ResNet-18 (the other runs: ResNet-10, whose loss gets as low within 60
    steps but not to its lowest at the last)."""
    from pretext_jax.pretrain.loading import load_model

    summary, losses = train("moco_tiny", tmp_path / "moco", colour_folder, (2, 2, 2),
                            **{"model.depth": 18, "model.queue_size": 64,
                               "objective.shuffle_bn_groups": 4,
                               "objective.momentum": 0.9, "optim.optimizer": "adamw",
                               "optim.bias_correction": True, "optim.learning_rate": 3e-3,
                               "optim.weight_decay": 1e-4, "train.steps": 60})
    assert losses[-1] < min(losses[1:-1]) and losses[-1] < np.log(65) - 0.5, losses
    assert 0.0 <= summary["eval"]["knn_accuracy"] <= 1.0
    state = jax.device_get(summary["state"].model_state)
    assert int(state["queue_pointer"].get_value()) == 60 * 32 % 64
    restored = load_model(tmp_path / "moco")
    np.testing.assert_array_equal(np.asarray(restored.queue.get_value()),
                                  np.asarray(state["queue"].get_value()))
    saved = flat(state["target"])
    for path, value in flat(nnx.state(restored.target, EMA)).items():
        np.testing.assert_array_equal(value, saved[path], err_msg=str(path))
    backbone = load_model(tmp_path / "moco", downstream=True)
    assert type(backbone).__name__ == "ResNet" and backbone.config.base_width == 4


def test_byol_trains_on_a_mixed_mesh(tmp_path, colour_folder):
    """byol_tiny on data x fsdp x tensor = 2 x 2 x 2 (with blur, which once made XLA's CPU
    compiler abort on a `tensor` axis): the symmetrised regression loss (4 for unrelated
    directions) falls clearly, tau follows the schedule over the whole run (K = train.steps,
    filled in by the trainer), and the kNN monitor runs."""
    summary, losses = train("byol_tiny", tmp_path / "byol", colour_folder, (2, 2, 2))
    assert losses[-1] < 0.6 * losses[0], losses
    assert 0.0 <= summary["eval"]["knn_accuracy"] <= 1.0
    assert 0.99 < summary["train"]["target_decay"] <= 1.0
    saved = json.loads((tmp_path / "byol" / "model.json").read_text())["objective"]
    assert saved["target_decay_steps"] == 40
    assert int(jax.device_get(summary["state"].model_state["target_updates"].get_value())) == 40
