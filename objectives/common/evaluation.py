"""Representation evaluation on frozen features: the kNN monitor and linear evaluation.

kNN (Wu et al. 2018 §3.4, as solo-learn and lightly run it during SSL training): cosine
similarity to a labelled bank, the k nearest vote with weight exp(similarity / temperature).
Linear evaluation (Chen et al. 2020 §4, B.6 for transfer): a multinomial logistic regression
trained on features that are computed once and never differentiated, so the encoder cannot
change.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pretext_jax.objectives.common.contrastive import l2_normalize
from pretext_jax.progress import progress


def extract_features(encode: Callable[[jax.Array], jax.Array], inputs: np.ndarray,
                     batch_size: int = 256, description: str = "features") -> np.ndarray:
    """`encode` (jit-compiled by the caller) over `inputs` in batches, with progress named
    `description`; returns host arrays."""
    starts = range(0, len(inputs), batch_size)
    return np.concatenate([
        np.asarray(jax.lax.stop_gradient(encode(inputs[i:i + batch_size])))
        for i in progress(starts, description, total=len(starts), unit="batch")])


def knn_accuracy(bank: np.ndarray, bank_labels: np.ndarray, queries: np.ndarray,
                 query_labels: np.ndarray, num_classes: int, k: int = 200,
                 temperature: float = 0.1, chunk: int = 1024) -> float:
    """Weighted kNN top-1 accuracy: for each query, the k most cosine-similar bank entries vote
    for their class with weight exp(similarity / temperature)."""
    bank_n = l2_normalize(jnp.asarray(bank, jnp.float32))
    one_hot = jax.nn.one_hot(jnp.asarray(bank_labels), num_classes)
    k = min(k, len(bank))

    @jax.jit
    def predict(query):
        similarity = l2_normalize(query) @ bank_n.T
        top, index = jax.lax.top_k(similarity, k)
        votes = jnp.einsum("qk,qkc->qc", jnp.exp(top / temperature), one_hot[index])
        return jnp.argmax(votes, axis=-1)

    correct = 0
    starts = range(0, len(queries), chunk)
    for start in progress(starts, "kNN", total=len(starts), unit="chunk"):
        predicted = predict(jnp.asarray(queries[start:start + chunk], jnp.float32))
        correct += int(np.sum(np.asarray(predicted) == query_labels[start:start + chunk]))
    return correct / len(queries)


def linear_probe_accuracy(train: np.ndarray, train_labels: np.ndarray, test: np.ndarray,
                          test_labels: np.ndarray, num_classes: int, l2: float = 1e-4,
                          steps: int = 500, learning_rate: float = 0.05) -> float:
    """Test accuracy of a multinomial logistic regression on standardised frozen features
    (full-batch Adam with an L2 penalty)."""
    mean, std = train.mean(0), train.std(0) + 1e-6
    x_train = jnp.asarray((train - mean) / std, jnp.float32)
    x_test = jnp.asarray((test - mean) / std, jnp.float32)
    y_train = jnp.asarray(train_labels)
    params = {"w": jnp.zeros((x_train.shape[1], num_classes)), "b": jnp.zeros((num_classes,))}
    tx = optax.adam(learning_rate)

    def loss(p):
        logits = x_train @ p["w"] + p["b"]
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, y_train).mean()
        return nll + l2 * jnp.sum(p["w"] ** 2)

    @jax.jit
    def step(p, state):
        updates, state = tx.update(jax.grad(loss)(p), state)
        return optax.apply_updates(p, updates), state

    state = tx.init(params)
    for _ in progress(range(steps), "linear probe", unit="step"):
        params, state = step(params, state)
    predicted = np.asarray(jnp.argmax(x_test @ params["w"] + params["b"], axis=-1))
    return float(np.mean(predicted == test_labels))
