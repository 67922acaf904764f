"""kNN monitor against brute-force numpy, the linear probe on separable features, and that
linear evaluation leaves the encoder untouched."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.models.resnet import ResNet, ResNetConfig
from pretext_jax.objectives.common.evaluation import (
    extract_features,
    knn_accuracy,
    linear_probe_accuracy,
)


def numpy_knn(bank, bank_labels, queries, num_classes, k, temperature):
    bank = bank / np.linalg.norm(bank, axis=1, keepdims=True)
    predictions = []
    for query in queries:
        similarity = bank @ (query / np.linalg.norm(query))
        nearest = np.argsort(-similarity)[:k]
        votes = np.zeros(num_classes)
        for index in nearest:
            votes[bank_labels[index]] += np.exp(similarity[index] / temperature)
        predictions.append(np.argmax(votes))
    return np.asarray(predictions)


def test_knn_matches_brute_force():
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((4, 8))
    bank_labels = rng.integers(0, 4, 300)
    bank = centres[bank_labels] + 0.8 * rng.standard_normal((300, 8))
    query_labels = rng.integers(0, 4, 50)
    queries = centres[query_labels] + 0.8 * rng.standard_normal((50, 8))
    for k, temperature in ((1, 0.1), (20, 0.1), (200, 0.5)):
        expected = numpy_knn(bank, bank_labels, queries, 4, k, temperature)
        accuracy = knn_accuracy(bank, bank_labels, queries, query_labels, 4, k, temperature,
                                chunk=16)
        assert accuracy == np.mean(expected == query_labels)
    assert knn_accuracy(bank, bank_labels, queries, query_labels, 4, 20) > 0.8


def test_linear_probe_learns_separable_classes():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 3, 600)
    features = np.eye(3)[labels] @ rng.standard_normal((3, 16)) + 0.1 * rng.standard_normal(
        (600, 16))
    accuracy = linear_probe_accuracy(features[:500], labels[:500], features[500:], labels[500:],
                                     num_classes=3, steps=200)
    assert accuracy > 0.95


def test_linear_evaluation_leaves_the_encoder_frozen():
    model = ResNet(ResNetConfig(depth=18, stem="cifar", base_width=4), rngs=nnx.Rngs(0))
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    encode = nnx.jit(lambda m, x: m(x, train=False))
    images = np.random.default_rng(2).random((40, 8, 8, 3)).astype(np.float32)
    labels = np.arange(40) % 2
    features = extract_features(lambda x: encode(model, jnp.asarray(x)), images, batch_size=16)
    assert features.shape == (40, model.config.features)
    linear_probe_accuracy(features[:30], labels[:30], features[30:], labels[30:], 2, steps=20)
    after = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)  # parameters and BatchNorm statistics alike
