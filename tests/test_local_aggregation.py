"""Local Aggregation: the loss and its gradient against a numpy re-statement of the reference's
`get_LA_loss` on hand-built neighbour sets, the close neighbours against their definition, the
instance-recognition warm-up's NCE against `get_IR_losses`, one training call (both phases and
the memory-bank update) against numpy, the rounds' data, the refusals, and a run on a 2 x 2 x 2
mesh: its phases, a clustering through the trainer, an exact resume after a kill (bank and
clusters included, with a control that loses the clusters) and the sharded step against the
single-device one in both phases."""

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
    abort,
    assert_same_step_on_every_mesh,
    assert_same_training,
    mesh_overrides,
    run_in_process,
    tampered_restore,
    train_losses,
)
from tfds_utils import write_colour_folder

from pretext_jax import run
from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import image_augment
from pretext_jax.models.local_aggregation import NOT_CLUSTERED, LocalAggregationConfig
from pretext_jax.objectives.common.clustering import kmeans
from pretext_jax.objectives.common.two_view import ImageExampleConfig
from pretext_jax.objectives.local_aggregation import (
    IMAGENET_IMAGES,
    IMAGENET_Z,
    LocalAggregationSettings,
    aggregation_loss,
    build_local_aggregation,
    check_local_aggregation,
    close_in_background,
    clustering_seed,
    instance_recognition_loss,
    local_aggregation_loss,
    phases,
    round_order,
)
from pretext_jax.pretrain.checkpoints import TrainState
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

PRESET = "local_aggregation_tiny"


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def numpy_aggregation(z, bank, labels, index, k, t):
    """instance_model.py `get_LA_loss` per image, in float64: B_i the k rows of largest v.m,
    C_i the rows sharing a cluster with i in some clustering, the loss
    -log(sum_{C ∩ B} exp(v.m / t) / sum_B exp(v.m / t) + 1e-7) and its gradient in v."""
    losses, grads = [], []
    for v, i in zip(z, index, strict=True):
        scores = bank @ v
        background = np.argsort(-scores)[:k]
        close = [j for j in background if any(labels[h, j] == labels[h, i]
                                              for h in range(len(labels)))]
        w = np.exp(scores / t)
        ratio = w[close].sum() / w[background].sum()
        losses.append(-np.log(ratio + 1e-7))
        mean_close = (w[close] @ bank[close] / w[close].sum()) if close else 0.0
        mean_background = w[background] @ bank[background] / w[background].sum()
        grads.append(-ratio / (ratio + 1e-7) * (mean_close - mean_background) / t)
    return np.mean(losses), np.stack(grads) / len(z), np.array(losses)


def test_aggregation_loss_and_gradient_against_numpy_on_hand_built_neighbour_sets():
    """Eight bank rows, two clusterings, k = 3: image 0's background set is rows {0, 1, 2}
    (its embedding is nearest them), of which rows 0 and 2 share a cluster with it (2 in the
    second clustering only); image 5's is rows {3, 6, 7}, none of its clusters' (the loss is
    -log 1e-7 with a zero gradient); image 3's is rows {1, 3, 4}, all close (row 1 through
    the second clustering; loss ~ 0). Then random sets against the same re-statement."""
    bank = unit(np.array([[1, 0, 0], [.9, .3, 0], [.8, 0, .4], [0, 1, 0], [0, .9, .2],
                          [0, 0, 1], [-1, 0, .1], [-.9, -.3, 0]], np.float64))
    labels = np.array([[0, 1, 2, 3, 3, 4, 5, 5],
                       [0, 3, 0, 3, 3, 2, 3, 1]])
    z = unit(np.array([[1, .1, .1], [-1, -.2, -.3], [0, 1, .1]], np.float64))
    index = np.array([0, 5, 3])
    _, background = jax.lax.top_k(jnp.asarray(z @ bank.T, jnp.float32), 3)
    assert [sorted(b) for b in np.asarray(background).tolist()] == [
        [0, 1, 2], [3, 6, 7], [1, 3, 4]]
    close = np.asarray(close_in_background(jnp.asarray(labels), jnp.asarray(index),
                                           background))
    by_row = [dict(zip(b.tolist(), c.tolist(), strict=True))
              for b, c in zip(np.asarray(background), close, strict=True)]
    assert by_row == [{0: True, 1: False, 2: True}, {3: False, 6: False, 7: False},
                      {1: True, 3: True, 4: True}]
    per_image = numpy_aggregation(z, bank, labels, index, 3, 0.5)[2]
    assert per_image[1] == pytest.approx(-np.log(1e-7)) and per_image[2] < 1e-6
    rng = np.random.default_rng(0)
    random_case = (unit(rng.normal(size=(6, 5))), unit(rng.normal(size=(40, 5))),
                   rng.integers(0, 4, (3, 40)), rng.choice(40, 6, replace=False), 0.07)
    for case in ((z, bank, labels, index, 0.5), random_case):
        t = case[-1]
        args = [jnp.asarray(a, jnp.float32) for a in case[:2]] + [
            jnp.asarray(a, jnp.int32) for a in case[2:4]]
        expected, expected_grad, per_image = numpy_aggregation(*case[:4], 3, t)
        (loss, metrics), grad = jax.jit(jax.value_and_grad(aggregation_loss, has_aux=True),
                                        static_argnums=(4, 5))(*args, 3, t)
        assert float(loss) == pytest.approx(expected, rel=1e-5)
        assert float(metrics["aggregation_loss"][0]) == pytest.approx(per_image.sum(), rel=1e-5)
        np.testing.assert_allclose(grad, expected_grad, atol=2e-5)


def test_close_neighbours_are_the_union_over_clusterings_of_shared_clusters():
    """For random labels and background sets, entry (i, t) is True exactly when background
    row b_it shares a cluster with image i in at least one clustering."""
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 5, (4, 30))
    index = rng.choice(30, 7, replace=False)
    background = rng.integers(0, 30, (7, 9))
    close = np.asarray(close_in_background(jnp.asarray(labels), jnp.asarray(index),
                                           jnp.asarray(background)))
    for b, i in enumerate(index):
        members = set().union(*(set(np.flatnonzero(labels[h] == labels[h, i]))
                                for h in range(4)))
        assert close[b].tolist() == [int(j) in members for j in background[b]]
    assert 0 < close.mean() < 1


def numpy_instance(z, own, noise, n, t):
    """instance_model.py `get_IR_losses` in float64 and its gradient in z."""
    partition = IMAGENET_Z / IMAGENET_IMAGES * n
    p_data = np.exp(np.sum(z * own, 1) / t) / partition
    p_noise = np.exp(np.einsum("bd,bkd->bk", z, noise) / t) / partition
    c = noise.shape[1] / n
    loss = -(np.log(p_data / (p_data + c + 1e-7)).sum()
             + np.log(c / (p_noise + c + 1e-7)).sum()) / len(z)
    grad = -((1 - p_data / (p_data + c + 1e-7))[:, None] * own
             - np.einsum("bk,bkd->bd", p_noise / (p_noise + c + 1e-7), noise)) / t / len(z)
    return loss, grad


def test_instance_recognition_loss_and_gradient_against_numpy():
    rng = np.random.default_rng(2)
    z, own = unit(rng.normal(size=(5, 6))), unit(rng.normal(size=(5, 6)))
    own[0] = z[0]  # one image's own row equals its embedding
    noise = unit(rng.normal(size=(5, 7, 6)))
    expected, expected_grad = numpy_instance(z, own, noise, 50, 0.07)
    args = [jnp.asarray(a, jnp.float32) for a in (z, own, noise)]
    (loss, metrics), grad = jax.jit(jax.value_and_grad(instance_recognition_loss, has_aux=True),
                                    static_argnums=(3, 4))(*args, 50, 0.07)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert sum(float(metrics[k][0]) for k in ("loss_model", "loss_noise")) / 5 == \
        pytest.approx(expected, rel=1e-5)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-4, atol=1e-6)


def test_one_training_call_in_each_phase_against_numpy():
    """`local_aggregation_loss` on one batch: unclustered, the warm-up's NCE against each
    image's own bank row and 32 rows drawn for it; once clustered (labels set by hand), the
    local aggregation loss; in both, rows `index` <- normalise(m row + (1 - m) v) (m = 0.3)
    afterwards and every other row unchanged."""
    model = build_local_aggregation(LocalAggregationConfig(
        depth=10, stem="cifar", base_width=2, embedding_dim=8, num_clusterings=2,
        num_images=40), seed=0)
    assert np.all(np.asarray(model.labels.get_value()) == NOT_CLUSTERED)
    objective = LocalAggregationSettings(image_size=8, instance_negatives=32,
                                         background_neighbours=6, momentum=0.3, temperature=0.1)
    rng = np.random.default_rng(0)
    batch = {"image": jnp.asarray(rng.integers(0, 256, (4, 12, 12, 3)), jnp.uint8),
             "index": jnp.asarray([7, 2, 31, 0], jnp.int32)}
    index = np.asarray(batch["index"])

    @nnx.jit
    def step(model, batch, key):
        """The embeddings the loss sees (its views; BatchNorm in training mode normalises by the
        batch's statistics, so this extra forward pass changes nothing the loss sees), then the
        loss."""
        views = image_augment.augment_batch(jax.random.split(key)[0], batch["image"],
                                            objective.augmentation())
        z = model(views, train=True)
        return z, local_aggregation_loss(model, batch, key, objective=objective)

    labels = rng.integers(0, 3, (2, 40)).astype(np.int32)
    for phase, key in (("instance", jax.random.key(3)), ("aggregation", jax.random.key(4))):
        if phase == "aggregation":
            model.labels.set_value(jnp.asarray(labels))
        bank = np.asarray(model.memory.get_value(), np.float64)
        z, (loss, metrics) = step(model, batch, key)
        z = unit(np.asarray(z, np.float64))
        if phase == "instance":
            noise_key = jax.random.split(key)[1]
            noise = np.asarray(jax.random.randint(noise_key, (4, 32), 0, 40))
            expected = numpy_instance(z, bank[index], bank[noise], 40, 0.1)[0]
        else:
            expected = numpy_aggregation(z, bank, labels, index, 6, 0.1)[0]
        assert float(loss) == pytest.approx(expected, rel=1e-4), phase
        assert (float(metrics["instance_loss"][1]) > 0) == (phase == "instance")
        after = np.asarray(model.memory.get_value())
        np.testing.assert_allclose(after[index], unit(0.3 * bank[index] + 0.7 * z), atol=1e-5)
        kept = np.setdiff1d(np.arange(40), index)
        np.testing.assert_array_equal(after[kept], bank[kept].astype(np.float32))


def test_rounds_read_whole_permutations_and_follow_the_warm_up():
    """Round r's rows are whole permutations drawn from (seed, r); the warm-up is one shuffled
    segment without a clustering, each round after it one begun by a clustering."""
    order = round_order(10, 25, seed=3, round_index=1)
    assert len(order) == 25 and all(sorted(order[i:i + 10]) == list(range(10))
                                    for i in (0, 10))
    np.testing.assert_array_equal(order, round_order(10, 25, 3, 1))
    assert not np.array_equal(order, round_order(10, 25, 3, 2))
    segments = phases(list(range(10)), LocalAggregationSettings(instance_steps=4,
                                                                recluster_every=3))
    config = make_config(PRESET)
    spans = [(s.first_step, s.last_step, s.shuffle, s.begin is not None)
             for s in (segments(step, config) for step in (1, 4, 5, 7, 8, 10))]
    assert spans == [(1, 4, True, False), (1, 4, True, False), (5, 7, False, True),
                     (5, 7, False, True), (8, 10, False, True), (8, 10, False, True)]


def test_settings_that_do_not_fit_the_data_are_refused():
    model = LocalAggregationConfig(depth=10, num_images=100)
    fitting = {"background_neighbours": 100, "instance_negatives": 100, "num_clusters": 99}
    check_local_aggregation(model, ImageExampleConfig(), LocalAggregationSettings(**fitting))
    for settings, named in (({"background_neighbours": 101}, "background_neighbours=101"),
                            ({"instance_negatives": 200}, "instance_negatives=200"),
                            ({"num_clusters": 100}, "num_clusters=100")):
        with pytest.raises(UserError, match=named):
            check_local_aggregation(model, ImageExampleConfig(),
                                    LocalAggregationSettings(**{**fitting, **settings}))
    for settings in ({"temperature": 0.0}, {"momentum": 1.0}, {"num_clusters": 1},
                     {"instance_steps": -1}, {"color_jitter": 0.6}):
        with pytest.raises(ValueError):
            LocalAggregationSettings(**settings)


@pytest.fixture(scope="module")
def colour_folder(tmp_path_factory):
    """A CIFAR-10-format folder of 192 images of 8 noisy colours (160 training images)."""
    return write_colour_folder(tmp_path_factory.mktemp("la_colours"))


def small(folder: str, root, **overrides) -> dict:
    """The tiny preset at test size on the (2, 2, 2) mesh: ResNet-10 of 2 channels on 16 px,
    2 warm-up steps, then 2 clusterings of 8 clusters every 3 steps, 32 neighbours."""
    return {"data.source": folder, "data.cache_dir": str(root / "cache"), "model.depth": 10,
            "model.base_width": 2, "model.embedding_dim": 16, "objective.image_size": 16,
            "objective.instance_steps": 2, "objective.recluster_every": 3,
            "objective.num_clusters": 8, "objective.background_neighbours": 32,
            "objective.instance_negatives": 32, "train.batch_size": 16, "train.steps": 8,
            "train.log_every": 1, "train.eval_every": 1000, "train.eval_batches": 1,
            "train.checkpoint_every": 4, "train.progress": False,
            **mesh_overrides((2, 2, 2)), **overrides}


def clusters_lost(state: TrainState) -> TrainState:
    """`state` with the cluster labels reset to unclustered, as if they were not saved."""
    return dataclasses.replace(state, model_state=jax.tree_util.tree_map_with_path(
        lambda path, leaf: (jnp.full_like(leaf, NOT_CLUSTERED)
                            if "labels" in jax.tree_util.keystr(path) else leaf),
        state.model_state))


def test_run_phases_rounds_resume_and_the_sharded_step(colour_folder, tmp_path, capsys):
    """8 steps on the 2 x 2 x 2 mesh: steps 1-2 are the warm-up, 3-8 local aggregation (rounds
    begin at 3 and 6). Killed in place of step 7 (`abort`: last checkpoint step 4, inside the
    first round) and rerun: the batches, losses, parameters, memory bank and cluster labels of a
    run never interrupted; rerun with the clusters lost, step 5 differs. The next round's start
    through the trainer: each clustering is `kmeans` of the bank with its seed, nothing else
    changes. Then the sharded step equals the single-device one, warm-up and local aggregation
    (the run's SGD, whose first step is -0.03 x the gradient with weight decay: at GRADIENT_STEP's
    rate 1 the warm-up's gradient at T = 0.07 makes float32 reordering in the first convolution
    visible, 1e-5 against a tolerance of 2e-6 + 1e-5 relative). A background set larger than
    the bank is refused from the CLI."""
    overrides = small(colour_folder, tmp_path)
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process(PRESET, overrides, *reference)
    losses = [row for row in map(json.loads,
                                 (reference[0] / "metrics.jsonl").read_text().splitlines())
              if row["split"] == "train"]
    assert [row["instance_loss"] > 0 for row in losses] == [True] * 2 + [False] * 6
    assert all(row["aggregation_loss"] > 0 for row in losses[2:])

    ours, control = (tmp_path / "w", tmp_path / "w.log"), (tmp_path / "lost", tmp_path / "l.log")
    abort(PRESET, overrides, *ours, step=7)
    shutil.copytree(ours[0], control[0])
    shutil.copy(ours[1], control[1])
    run_in_process(PRESET, overrides, *ours)
    assert_same_training(PRESET, overrides, ours, reference)
    with tampered_restore(clusters_lost):
        run_in_process(PRESET, overrides, *control)
    assert train_losses(control[0])[5] != train_losses(reference[0])[5]

    states = []
    for workdir in (ours[0], reference[0]):
        trainer = Trainer(make_config(PRESET, overrides), workdir)
        states.append(trainer.checkpoints.restore_latest_readable()[0])
        trainer.checkpoints.close()
    for name in ("memory", "labels"):
        np.testing.assert_array_equal(*(np.asarray(jax.device_get(s.model_state[name]
                                                                  .get_value())) for s in states))
    check_next_round(trainer, states[1])

    def trainer_at(workdir, mesh, devices, clustered=False):
        class Start(Trainer):
            def init_state(self) -> TrainState:
                state = super().init_state()
                return (self.begin_segment(state, self.data.segment(1, self.config))
                        if clustered else state)

        return Start(make_config(PRESET, {**overrides, **mesh_overrides(mesh),
                                          "objective.instance_steps": 0}),
                     workdir, devices=devices)

    assert_same_step_on_every_mesh(trainer_at, tmp_path / "instance")
    assert_same_step_on_every_mesh(lambda *a: trainer_at(*a, clustered=True),
                                   tmp_path / "aggregation")

    args = [f"{k}={v}" for k, v in overrides.items() if k != "data.source"]
    assert run.main(["pretrain", "--preset", PRESET, "--data", colour_folder, "--workdir",
                     str(tmp_path / "refused"), *args,
                     "objective.background_neighbours=500"]) == 2
    assert "background_neighbours=500 exceeds the memory bank" in capsys.readouterr().err


def check_next_round(trainer: Trainer, state: TrainState) -> None:
    """The round after the last one begins (its segment's `begin`, through the trainer): each
    clustering's labels are `kmeans` of the bank with that clustering's seed; the bank, the
    parameters and the optimizer state are unchanged."""
    config = trainer.config
    segment = trainer.data.segment(config.train.steps + 1, config)
    assert segment.first_step == config.train.steps + 1 and segment.begin is not None
    new = trainer.begin_segment(state, segment)
    bank = np.asarray(jax.device_get(new.model_state["memory"].get_value()))
    np.testing.assert_array_equal(bank, np.asarray(jax.device_get(
        state.model_state["memory"].get_value())))
    labels = np.asarray(jax.device_get(new.model_state["labels"].get_value()))
    objective = trainer.objective
    for h in range(2):
        expected = kmeans(bank, objective.num_clusters, objective.kmeans_iterations,
                          clustering_seed(config.train.seed, h))[1]
        np.testing.assert_array_equal(labels[h], expected)
    assert not np.array_equal(labels[0], labels[1])  # two seeds, two clusterings
    for old, fresh in ((state.params, new.params), (state.opt_state, new.opt_state)):
        assert all(np.array_equal(a, b) for a, b in zip(
            jax.tree.leaves(jax.device_get(old)), jax.tree.leaves(jax.device_get(fresh)),
            strict=True))
