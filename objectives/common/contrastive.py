"""Contrastive losses: SimCLR's NT-Xent, InfoNCE of queries against one
positive each and a shared set of negatives (MoCo's queue, CMC's memory-bank samples), and
InfoNCE against the other keys of the batch (InfoWord's sentence / n-gram term).

Reference: google-research/simclr tf2/objective.py (`add_contrastive_loss`), Chen et al. 2020
§2.1 (NT-Xent). Under `jit` the embeddings are global arrays, so the similarity matrices span
the whole batch and every image meets the negatives of every device, as the reference's
cross-replica concatenation arranges; with the batch sharded, XLA gathers what it needs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pretext_jax.objectives.registry import Metrics

LARGE_NUM = 1e9  # objective.py: subtracted from self-similarities


def l2_normalize(x: jax.Array, epsilon: float = 1e-12) -> jax.Array:
    """x / max(||x||, sqrt(epsilon)), as tf.math.l2_normalize."""
    return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), epsilon))


def nt_xent(first: jax.Array, second: jax.Array, temperature: float
            ) -> tuple[jax.Array, Metrics]:
    """NT-Xent of two views [N, D] (row i of each is the same image): for each view, softmax
    cross-entropy of its positive against the other view's N - 1 negatives and its own view's
    N - 1 others (self-similarity masked); loss = mean over images of the sum of both
    directions. Metrics: contrastive accuracy (the positive has the largest logit among the
    other view's) and the loss."""
    dtype = jnp.promote_types(first.dtype, jnp.float32)  # bf16 features -> float32 logits
    first, second = l2_normalize(first.astype(dtype)), l2_normalize(second.astype(dtype))
    self_mask = jnp.eye(first.shape[0], dtype=dtype) * LARGE_NUM
    aa = first @ first.T / temperature - self_mask
    bb = second @ second.T / temperature - self_mask
    ab = first @ second.T / temperature
    ba = second @ first.T / temperature

    def direction(positives_and_others: jax.Array, same_view: jax.Array) -> jax.Array:
        logits = jnp.concatenate([positives_and_others, same_view], axis=1)
        return jax.nn.logsumexp(logits, axis=1) - jnp.diagonal(positives_and_others)

    per_image = direction(ab, aa) + direction(ba, bb)
    count = jnp.float32(first.shape[0])
    correct = jnp.sum(jnp.argmax(ab, axis=1) == jnp.arange(first.shape[0]))
    return jnp.mean(per_image), {"contrastive_loss": (jnp.sum(per_image), count),
                                 "contrastive_accuracy": (correct.astype(jnp.float32), count)}


def info_nce(queries: jax.Array, keys: jax.Array, negatives: jax.Array, temperature: float
             ) -> tuple[jax.Array, Metrics]:
    """InfoNCE on L2-normalised queries and their positive keys [N, D] and negatives [K, D]
    shared by every query (MoCo eq. 1: the queue; CMC: memory-bank samples): for each query,
    cross-entropy of the logits [q.k+, q.n_1..K] / T with the positive at index 0; the mean
    over queries. Metrics: the loss and the (1 + K)-way accuracy."""
    queries, keys, negatives = (x.astype(jnp.float32) for x in (queries, keys, negatives))
    positive = jnp.sum(queries * keys, axis=1, keepdims=True)
    logits = jnp.concatenate([positive, queries @ negatives.T], axis=1) / temperature
    per_query = jax.nn.logsumexp(logits, axis=1) - logits[:, 0]
    count = jnp.float32(queries.shape[0])
    correct = jnp.sum(jnp.argmax(logits, axis=1) == 0).astype(jnp.float32)
    return jnp.mean(per_query), {"contrastive_loss": (jnp.sum(per_query), count),
                                 "contrastive_accuracy": (correct, count)}


def in_batch_info_nce(queries: jax.Array, keys: jax.Array) -> tuple[jax.Array, Metrics]:
    """InfoNCE with in-batch negatives and a plain dot-product critic: query i's positive is
    key i, the candidate set is every key of the (global) batch, so
    loss_i = logsumexp_j(q_i . k_j) - q_i . k_i (InfoWord's I_DIM, Kong et al. 2020 §4, with
    the sign turned into a loss); the mean over queries. No normalisation and no temperature:
    the scores are the raw inner products of the two representations. Metrics: the loss and
    the N-way accuracy (the positive scores highest)."""
    queries, keys = queries.astype(jnp.float32), keys.astype(jnp.float32)
    logits = queries @ keys.T
    per_query = jax.nn.logsumexp(logits, axis=1) - jnp.diagonal(logits)
    count = jnp.float32(queries.shape[0])
    correct = jnp.sum(jnp.argmax(logits, axis=1) == jnp.arange(queries.shape[0]))
    return jnp.mean(per_query), {"contrastive_loss": (jnp.sum(per_query), count),
                                 "contrastive_accuracy": (correct.astype(jnp.float32), count)}
