"""NT-Xent against a plain numpy reference, on one device and with the two views on different
devices of a mesh, and its gradients against finite differences."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from jax.test_util import check_grads

from pretext_jax.objectives.common.contrastive import nt_xent
from pretext_jax.pretrain.mesh import make_mesh


def numpy_nt_xent(first: np.ndarray, second: np.ndarray, temperature: float) -> float:
    """Chen et al. 2020 eq. 1 written out: for every anchor in both views, -log of its
    positive's share among all 2N - 1 other embeddings; the sum of both directions per image,
    averaged over images."""
    views = [v / np.linalg.norm(v, axis=1, keepdims=True) for v in (first, second)]
    everything = np.concatenate(views).astype(np.float64)
    n = len(first)
    total = 0.0
    for anchor in range(2 * n):
        positive = (anchor + n) % (2 * n)
        similarities = everything @ everything[anchor] / temperature
        others = np.delete(similarities, anchor)
        total += np.log(np.exp(others).sum()) - similarities[positive]
    return total / n


@pytest.mark.parametrize("temperature", [0.1, 0.5])
def test_nt_xent_equals_numpy(temperature):
    rng = np.random.default_rng(0)
    first, second = rng.standard_normal((2, 12, 7)).astype(np.float32)
    loss, metrics = nt_xent(jnp.asarray(first), jnp.asarray(second), temperature)
    assert float(loss) == pytest.approx(numpy_nt_xent(first, second, temperature), rel=1e-5)
    assert float(metrics["contrastive_loss"][0] / metrics["contrastive_loss"][1]) == (
        pytest.approx(float(loss), rel=1e-6))
    # Identical views: every positive is the best match.
    _, same = nt_xent(jnp.asarray(first), jnp.asarray(first), temperature)
    assert float(same["contrastive_accuracy"][0]) == 12


def test_nt_xent_on_a_mesh_with_the_views_on_different_devices():
    """The batch is [view 1 of all images; view 2 of all images], sharded over 8 devices, so
    an image's two views live on different devices; the loss is the global one."""
    rng = np.random.default_rng(1)
    first, second = rng.standard_normal((2, 16, 5)).astype(np.float32)
    mesh = make_mesh(8, 1, 1)
    batch = jax.device_put(np.concatenate([first, second]),
                           NamedSharding(mesh, PartitionSpec("data")))
    assert {tuple(s.index[0].indices(32)[:2]) for s in batch.addressable_shards} == {
        (4 * i, 4 * i + 4) for i in range(8)}

    @jax.jit
    def loss(views):
        half = views.shape[0] // 2
        return nt_xent(views[:half], views[half:], 0.5)[0]

    assert float(loss(batch)) == pytest.approx(numpy_nt_xent(first, second, 0.5), rel=1e-5)


def test_nt_xent_gradients_match_finite_differences():
    rng = np.random.default_rng(2)
    first, second = (jnp.asarray(v, jnp.float32) for v in rng.standard_normal((2, 4, 3)))
    with jax.enable_x64(True):
        check_grads(lambda a, b: nt_xent(a, b, 0.5)[0], (first.astype(jnp.float64),
                                                        second.astype(jnp.float64)),
                    order=1, modes=("rev",), atol=1e-6, rtol=1e-6)
