"""The compiled training step's body: gradients (accumulated over micro-batches when asked),
the optimizer update and the finiteness checks, as a pure function of the train state and a
batch. `pretrain.trainer` binds it to a method's loss and compiles it with the run's shardings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from pretext_jax.pretrain.checkpoints import TrainState
from pretext_jax.pretrain.feed import INDEX_KEY

# (params, model_state, batch, rng) -> (loss, (metrics, new model_state))
StateLoss = Callable[[Any, Any, Any, jax.Array | None], tuple[jax.Array, tuple[Any, Any]]]


def _gradients(loss: StateLoss, state: TrainState, batch: Any, rng: jax.Array,
               accum: int) -> tuple[Any, Any, Any]:
    """(gradients, metric sums, model state) of `batch`; with `accum` > 1 the batch is split
    into micro-batches whose gradients (averaged) and metric sums accumulate in a scan, each
    with its own dropout key fold_in(rng, index)."""
    grad_fn = jax.grad(loss, has_aux=True)
    if accum == 1:
        grads, (metrics, model_state) = grad_fn(state.params, state.model_state, batch, rng)
        return grads, metrics, model_state
    micro = jax.tree.map(lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch)

    def body(carry, inputs):
        grads_sum, metrics_sum, model_state = carry
        index, micro_batch = inputs
        grads, (metrics, model_state) = grad_fn(
            state.params, model_state, micro_batch, jax.random.fold_in(rng, index))
        return (jax.tree.map(jnp.add, grads_sum, grads),
                jax.tree.map(jnp.add, metrics_sum, metrics), model_state), None

    zero_grads = jax.tree.map(jnp.zeros_like, state.params)
    first_metrics = jax.eval_shape(
        lambda: grad_fn(state.params, state.model_state,
                        jax.tree.map(lambda x: x[0], micro), rng)[1][0])
    zero_metrics = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), first_metrics)
    (grads, metrics, model_state), _ = jax.lax.scan(
        body, (zero_grads, zero_metrics, state.model_state), (jnp.arange(accum), micro))
    return jax.tree.map(lambda g: g / accum, grads), metrics, model_state


def update_step(state: TrainState, batch: Any, *, loss: StateLoss,
                tx: optax.GradientTransformation, seed: int, accum: int,
                skip_nonfinite: bool) -> tuple[TrainState, Any]:
    """One optimizer step of `loss` on `batch`; the dropout key of step s is
    fold_in(key(seed), s). Metrics gain `grad_norm` and `nonfinite_steps` (1 when the loss, the
    gradients or the updated state hold NaN/Inf). With `skip_nonfinite` such a step changes
    nothing but the step counter (its batch is consumed); what the forward pass updates
    (BatchNorm statistics, XLNet's memory) follows its loss. Without it no select is compiled:
    the trainer stops the run before anything is saved."""
    rng = jax.random.fold_in(jax.random.key(seed), state.step)
    grads, metrics, model_state = _gradients(loss, state, batch, rng, accum)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics)
    one = jnp.ones((), jnp.float32)
    grad_norm = optax.tree.norm(grads)
    # The updated state too: an update can overflow where loss and gradients did not, and no
    # checkpoint may hold NaN/Inf.
    updated_finite = jnp.all(jnp.stack([
        jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves((params, opt_state, model_state))
        if jnp.issubdtype(leaf.dtype, jnp.inexact)]))
    loss_finite = jnp.isfinite(metrics["loss"][0]) & updated_finite
    finite = loss_finite & jnp.isfinite(grad_norm)
    metrics["grad_norm"] = (grad_norm, one)
    metrics["nonfinite_steps"] = (1.0 - finite.astype(jnp.float32), one)
    if skip_nonfinite:
        def keep(new: Any, old: Any, ok: jax.Array) -> Any:
            return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)

        params = keep(params, state.params, finite)
        opt_state = keep(opt_state, state.opt_state, finite)
        model_state = keep(model_state, state.model_state, loss_finite)
    return TrainState(step=state.step + 1, params=params, model_state=model_state,
                      opt_state=opt_state), metrics


def gather_rows(rows: dict[str, jax.Array], batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """A batch of record indices (`feed.INDEX_KEY`) -> the records' fields, taken from `rows`
    (every training record, in device memory)."""
    index = batch[INDEX_KEY]
    return {name: jnp.take(values, index, axis=0) for name, values in rows.items()}
