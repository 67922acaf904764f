"""Optimizers and learning-rate schedules, built from optax.

BERT's AdamWeightDecayOptimizer (google-research/bert optimization.py) is Adam *without* bias
correction, decoupled weight decay that skips LayerNorm and bias parameters, and a learning rate
that warms up linearly and then decays linearly to 0 over the *whole* run (the decay is computed
from step 0, so after warmup lr = peak * (1 - step / total)). optax has no switch for Adam without
bias correction, so that one transformation is written here; everything else is optax.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pretext_jax.errors import UserError

# Parameters that weight decay skips, by their own name (the last component of their path):
# biases and the scales of LayerNorm, RMSNorm and BatchNorm. optimization.py excludes
# "LayerNorm", "layer_norm" and "bias" by name; a normalisation layer's parameters here are its
# `scale` and `bias`, so the two rules pick the same ones. A name ending in `_bias` (XLNet's
# `lm_bias`, ELMo's `lstm_bias`) is a bias too, as the substring match of xlnet's
# model_utils.py and HF's `no_decay` lists treat it, except XLNet's attention biases, which
# model_utils.py's AdamWeightDecayOptimizer decays (its `include_in_weight_decay`).
NO_DECAY_PARAMETERS = ("bias", "scale")
NO_DECAY_SUFFIX = "_bias"
DECAYED_BIASES = ("r_w_bias", "r_r_bias", "r_s_bias")
SCHEDULES = ("linear", "electra_linear", "linear_from_peak", "cosine", "constant",
             "inverse_sqrt", "inverse_sqrt_warmup", "step", "tri_stage")


class ScaleByAdamEpsHatState(NamedTuple):
    count: jax.Array
    mu: Any
    nu: Any


def scale_by_adam_eps_hat(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """Adam in the form of Kingma & Ba §2's last paragraph, which fairseq's `Adam`
    (fairseq/optim/adam.py) and `tf.train.AdamOptimizer` implement: sqrt(1 - b2^t) / (1 - b1^t)
    x m / (sqrt(v) + eps), i.e. eps added to the root of the raw second moment, before its
    bias correction (optax's `scale_by_adam` adds it after: eps / sqrt(1 - b2^t) there)."""

    def init(params: Any) -> ScaleByAdamEpsHatState:
        zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
        return ScaleByAdamEpsHatState(count=jnp.zeros((), jnp.int32), mu=zeros, nu=zeros)

    def update(updates: Any, state: ScaleByAdamEpsHatState, params: Any = None):
        del params
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g), state.nu, updates)
        count = state.count + 1
        t = count.astype(jnp.float32)
        step = jnp.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        updates = jax.tree.map(lambda m, v: step * m / (jnp.sqrt(v) + eps), mu, nu)
        return updates, ScaleByAdamEpsHatState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


class ScaleByAdamNoBiasCorrectionState(NamedTuple):
    mu: Any
    nu: Any


def scale_by_adam_without_bias_correction(
    b1: float, b2: float, eps: float
) -> optax.GradientTransformation:
    """m / (sqrt(v) + eps) with raw moments (optimization.py `AdamWeightDecayOptimizer`)."""

    def init(params: Any) -> ScaleByAdamNoBiasCorrectionState:
        zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
        return ScaleByAdamNoBiasCorrectionState(mu=zeros, nu=zeros)

    def update(updates: Any, state: ScaleByAdamNoBiasCorrectionState, params: Any = None):
        del params
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g), state.nu, updates)
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
        return updates, ScaleByAdamNoBiasCorrectionState(mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


def decay_mask(params: Any) -> Any:
    """True where weight decay applies: on every parameter but biases and normalisation scales
    (`NO_DECAY_PARAMETERS` or a `NO_DECAY_SUFFIX` but not `DECAYED_BIASES`, matched against the
    parameter's own name)."""

    def keep(path: tuple[Any, ...], _: Any) -> bool:
        name = _parameter_name(path)
        if name in DECAYED_BIASES:
            return True
        return name not in NO_DECAY_PARAMETERS and not name.endswith(NO_DECAY_SUFFIX)

    return jax.tree_util.tree_map_with_path(keep, params)


def _names(path: tuple[Any, ...]) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def _parameter_name(path: tuple[Any, ...]) -> str:
    """The parameter's own name: the last component of its path that is not the `value` of
    an nnx Variable."""
    names = _names(path)
    while names and names[-1] == "value":
        names.pop()
    return names[-1] if names else ""


def layer_depth_factors(params: Any, decay: float) -> Any:
    """Learning-rate factors per parameter as ELECTRA's optimization.py `_get_layer_lrs` sets
    them for fine-tuning: with L layers, embeddings (and their projection) get decay^(L+2),
    layer i gets decay^(L+1-i) (a [L, 1, ...] array on our stacked layer parameters), the
    task head and everything else 1."""
    layers = next((leaf.shape[0] for path, leaf in jax.tree_util.tree_leaves_with_path(params)
                   if "layers" in _names(path)), 0)

    def factor(path: tuple[Any, ...], leaf: Any) -> Any:
        names = _names(path)
        if any(n.startswith("embeddings") for n in names):
            return jnp.float32(decay ** (layers + 2))
        if "layers" in names:
            per_layer = decay ** (layers + 1 - jnp.arange(1, layers + 1, dtype=jnp.float32))
            return per_layer.reshape(-1, *([1] * (leaf.ndim - 1)))
        return jnp.float32(1.0)

    return jax.tree_util.tree_map_with_path(factor, params)


def scale_by_layer_depth(decay: float) -> optax.GradientTransformation:
    """Multiplies each update by its `layer_depth_factors` (stateless)."""

    def update(updates: Any, state: optax.EmptyState, params: Any = None):
        del params
        factors = layer_depth_factors(updates, decay)
        return jax.tree.map(lambda u, f: u * f.astype(u.dtype), updates, factors), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


TRAINED, FROZEN = "trained", "frozen"


def adapter_labels(params: Any) -> Any:
    """`TRAINED` or `FROZEN` per parameter for adapter tuning (Houlsby et al. 2019 §2: only the
    adapters, the layer norms and the task head train; adapter-bert optimization.py
    `create_optimizer` trains its "adapters", "layer_norm" and "head" collections): a parameter
    trains if a component of its path names an adapter, it belongs to a layer norm, or it lies
    outside the `encoder` (the head on it; BERT's pre-trained pooler included)."""

    def label(path: tuple[Any, ...], _: Any) -> str:
        names = _names(path)
        trained = (names[0] != "encoder" or any("adapter" in n for n in names)
                   or any(n.endswith("layer_norm") for n in names))
        return TRAINED if trained else FROZEN

    return jax.tree_util.tree_map_with_path(label, params)


def trained_parameters(params: Any, labels: Callable[[Any], Any] | None) -> dict[str, int]:
    """{"trained": parameters that train, "total": all} of `params` under the label function
    `labels` (`adapter_labels`; None: all train). Gradual unfreezing trains them all in the
    end, so it counts them all."""
    sizes = [int(math.prod(leaf.shape)) for leaf in jax.tree.leaves(params)]
    kinds = jax.tree.leaves(labels(params)) if labels else [TRAINED] * len(sizes)
    return {"trained": sum(size for size, kind in zip(sizes, kinds, strict=True)
                           if kind == TRAINED), "total": sum(sizes)}


def unfreezing_stages(params: Any, every: int) -> Any:
    """The update count from which each parameter trains under gradual unfreezing (ULMFiT,
    Howard & Ruder 2018 §3.3: the last layer group first, then the next lower group every
    `every` updates): the head and all else outside the embeddings and layers from 0, layer i
    of L (0-based from the bottom, a [L, 1, ...] array on stacked layer parameters) from
    (L - i) x every, the embeddings (and their projection) from (L + 1) x every. The layer
    groups are `layer_depth_factors`'."""
    layers = next((leaf.shape[0] for path, leaf in jax.tree_util.tree_leaves_with_path(params)
                   if "layers" in _names(path)), 0)
    if not layers:
        raise UserError(f"optim.unfreeze_every_steps={every} unfreezes stacked Transformer layers "
                        "one by one; this model has none (ALBERT shares one layer): set "
                        "optim.unfreeze_every_steps=0")

    def stage(path: tuple[Any, ...], leaf: Any) -> Any:
        names = _names(path)
        if any(n.startswith("embeddings") for n in names):
            return jnp.int32((layers + 1) * every)
        if "layers" in names:
            start = (layers - jnp.arange(layers, dtype=jnp.int32)) * every
            return start.reshape(-1, *([1] * (leaf.ndim - 1)))
        return jnp.int32(0)

    return jax.tree_util.tree_map_with_path(stage, params)


class GradualUnfreezingState(NamedTuple):
    count: jax.Array
    inner: Any


def gradually_unfrozen(inner: optax.GradientTransformation, every: int
                       ) -> optax.GradientTransformation:
    """`inner` on the parameters `unfreezing_stages` has unfrozen by the update count: the others'
    gradients enter it as 0 (no clipping share, no moments) and their updates leave it as
    exactly 0 (no weight decay), as frozen (requires_grad False) parameters in fastai's
    ULMFiT. The count lives in the state, so a resumed run continues the schedule."""

    def mask(tree: Any, count: jax.Array) -> Any:
        return jax.tree.map(lambda u, start: jnp.where(count >= start, u, jnp.zeros_like(u)),
                            tree, unfreezing_stages(tree, every))

    def init(params: Any) -> GradualUnfreezingState:
        return GradualUnfreezingState(count=jnp.zeros((), jnp.int32), inner=inner.init(params))

    def update(updates: Any, state: GradualUnfreezingState, params: Any = None):
        updates, inner_state = inner.update(mask(updates, state.count), state.inner, params)
        return mask(updates, state.count), GradualUnfreezingState(state.count + 1, inner_state)

    return optax.GradientTransformation(init, update)


def pruning_targets(params: Any) -> Any:
    """True for the weights magnitude pruning prunes, as Gordon et al. 2020's bert-prune masks
    them (its modeling.py wraps them in model_pruning's `apply_mask`): the word embeddings and
    every dense kernel of the encoder (attention query/key/value/output, intermediate, output)
    and of BERT's pre-training pooler; not biases, layer norms, position or token-type
    embeddings, the pre-training heads, adapters or a task head. Departure: bert-prune also
    masks the pooler in fine-tuning, where pretext's classifier holds it as the head's first
    dense layer (`head_dense`, new in the other families), which stays dense."""

    def target(path: tuple[Any, ...], leaf: Any) -> bool:
        names = _names(path)
        if any("adapter" in n for n in names) or len(getattr(leaf, "shape", ())) < 2:
            return False
        name = _parameter_name(path)
        return ((name == "kernel" and ("encoder" in names or names[0] == "pooler"))
                or (name == "embedding" and "word_embeddings" in names))

    return jax.tree_util.tree_map_with_path(target, params)


def pruning_sparsity(config: Any, step: Any) -> jax.Array:
    """The sparsity at update `step` (0-based): model_pruning's `_setup_sparsity` (Zhu & Gupta
    2017 eq. 1, begin step 0, exponent 3): s_f + (s_i - s_f) (1 - min(1, step / end))^3."""
    progress = jnp.clip(jnp.asarray(step, jnp.float32) / config.prune_end_step, 0.0, 1.0)
    return (config.prune_sparsity + (config.prune_initial_sparsity - config.prune_sparsity)
            * (1.0 - progress) ** 3)


def magnitude_mask(weights: jax.Array, sparsity: jax.Array, per_layer: bool) -> jax.Array:
    """Keeps the largest-magnitude weights of each matrix (each layer's own on stacked layer
    parameters `per_layer`): model_pruning's `_update_mask`, k = round(n (1 - sparsity)) weights
    kept (at least 1), the threshold the k-th largest |w|, the mask |w| >= threshold (ties at
    the threshold kept)."""
    rows = jnp.abs(weights).reshape((weights.shape[0], -1) if per_layer else (1, -1))
    size = rows.shape[1]
    kept = jnp.clip(jnp.round(size * (1.0 - sparsity)).astype(jnp.int32), 1, size)
    threshold = jnp.sort(rows, axis=1)[:, size - kept]
    return (rows >= threshold[:, None]).reshape(weights.shape)


def updates_masks(config: Any) -> bool:
    """Whether `config` (OptimConfig) prunes by magnitude as it trains (a sparsity above 0)."""
    return config.prune_sparsity > 0 or config.prune_initial_sparsity > 0


class MagnitudePruningState(NamedTuple):
    count: jax.Array
    last_update: jax.Array
    masks: Any
    weights: Any
    inner: Any


def magnitude_pruned(inner: optax.GradientTransformation, config: Any
                     ) -> optax.GradientTransformation:
    """`inner` with gradual magnitude pruning as TF's model_pruning runs it for Gordon et al.
    2020 (bert-prune's optimization.py, settings in `config`): each `pruning_targets` matrix
    has a mask and keeps its unmasked ("raw") weights in the state, as model_pruning's weight
    variables; the model sees raw x mask (the parameters), so a masked weight's gradient enters
    `inner` as 0, `inner` updates the raw weights (Adam's moments and the weight decay still
    move a masked one), and every `prune_frequency` updates (the first at that count:
    `conditional_mask_update_op`), while the count is at most `prune_until_step` (-1: always),
    the masks are recomputed from the updated raw weights at `pruning_sparsity`
    (`magnitude_mask`; a masked weight that has grown back above the threshold returns). The
    raw weights start as the parameters at the first update (after a checkpoint's are loaded).
    With `keep_pruned`, weights exactly 0 at the first update (a pruned checkpoint's, whose
    raw values are gone) are masked from the start, as bert-prune's fine-tuning keeps the
    pre-training masks. Pruning costs one more copy of the pruned matrices beside Adam's two
    (`keep_pruned` alone none); the masks, raw weights and counts live in the state, so a
    resumed run continues them."""
    prunes = updates_masks(config)

    def init(params: Any) -> MagnitudePruningState:
        targets = pruning_targets(params)
        if not any(jax.tree.leaves(targets)):
            raise UserError("magnitude pruning (optim.prune_sparsity, optim.keep_pruned) prunes "
                            "a Transformer encoder's dense kernels and word embeddings; this "
                            "model has no weights to prune: set optim.prune_sparsity=0, "
                            "optim.prune_initial_sparsity=0 and optim.keep_pruned=false")
        return MagnitudePruningState(
            count=jnp.zeros((), jnp.int32), last_update=jnp.zeros((), jnp.int32),
            masks=jax.tree.map(lambda p, t: jnp.ones(p.shape if t else (), jnp.bool_),
                               params, targets),
            weights=jax.tree.map(lambda p, t: p if t and prunes else jnp.zeros((), p.dtype),
                                 params, targets),
            inner=inner.init(params))

    def update(updates: Any, state: MagnitudePruningState, params: Any = None):
        targets = pruning_targets(params)
        first = state.count == 0

        def on_targets(fn: Callable[..., Any], *trees: Any) -> Any:
            return jax.tree.map(lambda t, *leaves: fn(*leaves) if t else leaves[0],
                                targets, *trees)

        # Without mask updates (keep_pruned alone) a masked weight never moves (gradient,
        # moments and decay all 0), so the raw weights are the parameters and are not stored.
        raw = (on_targets(lambda w, p: jnp.where(first, p, w), state.weights, params)
               if prunes else params)
        masks = state.masks
        if config.keep_pruned:
            masks = on_targets(lambda m, p: jnp.where(first, p != 0, m), masks, params)
        grads = on_targets(lambda g, m: jnp.where(m, g, jnp.zeros_like(g)), updates, masks)
        inner_params = on_targets(lambda p, w: w, params, raw)
        raw_updates, inner_state = inner.update(grads, state.inner, inner_params)
        raw = on_targets(lambda w, u: w + u, raw, raw_updates)
        count, last_update, new_masks = state.count, state.last_update, masks
        if prunes:
            due = count >= last_update + config.prune_frequency
            if config.prune_until_step >= 0:
                due &= count <= config.prune_until_step
            sparsity = pruning_sparsity(config, count)
            per_layer = jax.tree_util.tree_map_with_path(
                lambda path, _: "layers" in _names(path), params)
            new_masks = jax.lax.cond(
                due, lambda: on_targets(lambda _, w, layered: magnitude_mask(w, sparsity, layered),
                                        masks, raw, per_layer),
                lambda: masks)
            last_update = jnp.where(due, count, last_update)
        # The parameters become raw x mask exactly: kept weights move by their update (they
        # equal their raw value), returning ones jump to it, masked ones go to 0.
        updates = on_targets(
            lambda u, p, w, old, new: jnp.where(new, jnp.where(old, u, w), -p),
            raw_updates, params, raw, masks, new_masks)
        return updates, MagnitudePruningState(count + 1, last_update, new_masks,
                                              raw if prunes else state.weights, inner_state)

    return optax.GradientTransformation(init, update)


def learning_rate_schedule(config: Any, total_steps: int) -> optax.Schedule:
    """`linear` (BERT: warmup, then peak * (1 - step/total) down to end_learning_rate),
    `electra_linear` (ELECTRA: the linear decay times the warmup ramp, `electra_schedule`),
    `linear_from_peak` (warmup to the peak, then linear from the peak to end_learning_rate over
    the remaining steps: fairseq's `polynomial_decay` with power 1, XLNet's `get_train_op`
    with decay_method poly), `cosine` (warmup then cosine
    to end), `constant` (warmup then flat), `inverse_sqrt` (T5), `inverse_sqrt_warmup`
    (fairseq, XLM: `inverse_sqrt_warmup_schedule`) or `step` (warmup, then the
    peak times `decay_factor` after each of the steps in `decay_boundaries`: Caffe's `step`
    policy, RotNet's `LUT_lr`) or `tri_stage` (wav2vec 2.0 fine-tuning: `tri_stage_schedule`,
    decaying over the steps after warmup and hold). Steps count from 0: update
    n (the n-th, 0-based) uses schedule(n), the value of the references' global step (fairseq:
    num_updates) before it is incremented."""
    peak, warmup, end = config.learning_rate, config.warmup_steps, config.end_learning_rate
    if config.schedule == "electra_linear":
        return electra_schedule(peak, warmup, total_steps, end)
    warmup = min(warmup, total_steps)
    ramp = optax.linear_schedule(0.0, peak, max(warmup, 1))
    if config.schedule == "linear":
        after = optax.linear_schedule(
            peak * (1 - warmup / total_steps) + end * warmup / total_steps, end,
            max(total_steps - warmup, 1))
    elif config.schedule == "linear_from_peak":
        # polynomial_decay_schedule.py `step_update`: n <= warmup: peak * n / warmup; then
        # (peak - end) * (1 - (n - warmup) / (total - warmup)) + end, and end from total on.
        after = optax.linear_schedule(peak, end, max(total_steps - warmup, 1))
    elif config.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, max(total_steps - warmup, 1), end / peak)
    elif config.schedule == "constant":
        after = optax.constant_schedule(peak)
    elif config.schedule == "inverse_sqrt":
        return inverse_sqrt_schedule(peak, warmup)
    elif config.schedule == "inverse_sqrt_warmup":
        return inverse_sqrt_warmup_schedule(peak, config.warmup_steps,
                                            config.warmup_init_learning_rate)
    elif config.schedule == "tri_stage":
        return tri_stage_schedule(peak, config.warmup_init_learning_rate, end, warmup,
                                  config.hold_steps,
                                  total_steps - warmup - config.hold_steps)
    elif config.schedule == "step":
        after = optax.piecewise_constant_schedule(peak, {
            boundary - warmup: config.decay_factor
            for boundary in decay_boundaries(config.decay_boundaries)})
    else:
        raise UserError(f"optim.schedule={config.schedule!r} is unknown; use one of "
                        f"{', '.join(SCHEDULES)}")
    return optax.join_schedules([ramp, after], [warmup])


def decay_boundaries(text: str) -> list[int]:
    """`optim.decay_boundaries` ("60,120" or "") as increasing step numbers."""
    try:
        steps = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        steps = []
    if not steps or steps != sorted(set(steps)) or steps[0] < 1:
        raise UserError(f"optim.decay_boundaries={text!r} must be increasing positive step "
                        "numbers separated by commas, e.g. 100000,200000")
    return steps


def electra_schedule(peak: float, warmup: int, total_steps: int,
                     end: float = 0.0) -> optax.Schedule:
    """ELECTRA's learning rate (google-research/electra model/optimization.py
    `create_optimizer`): `polynomial_decay` with power 1 from `peak` to `end` over the whole
    run, (peak - end) * (1 - min(n, total) / total) + end, *multiplied* by the warmup ramp
    min(1, n / warmup), n being the global step before its increment. Unlike BERT's schedule
    (which replaces the decayed value by peak * n / warmup during warmup), the ramp scales the
    already decaying value, so the schedule is continuous and peaks below `peak` at n = warmup.
    `warmup` 0: no ramp."""
    total = float(max(total_steps, 1))

    def schedule(step: Any) -> jax.Array:
        n = jnp.asarray(step, jnp.float32)
        decayed = (peak - end) * (1.0 - jnp.minimum(n, total) / total) + end
        if warmup <= 0:
            return decayed
        return decayed * jnp.minimum(1.0, n / float(warmup))

    return schedule


def inverse_sqrt_schedule(peak: float, warmup: int) -> optax.Schedule:
    """T5's "inverse square root" schedule (Raffel et al. 2020, §3.1.2): 1/sqrt(max(n, k)),
    constant for the first k steps (no ramp), written as peak * sqrt(k / max(n, k)) so that
    `learning_rate` is the peak: T5's is learning_rate 0.01 with warmup_steps k = 10^4."""
    k = float(max(warmup, 1))
    return lambda step: peak * jnp.sqrt(k / jnp.maximum(jnp.asarray(step, jnp.float32), k))


def inverse_sqrt_warmup_schedule(peak: float, warmup: int, start: float) -> optax.Schedule:
    """fairseq's `inverse_sqrt` (fairseq/optim/lr_scheduler/inverse_square_root_schedule.py) and
    XLM's `AdamInverseSqrtWithWarmup` (XLM src/optim.py): for update n < warmup the rate is
    start + n * (peak - start) / warmup (`warmup_init_lr` + num_updates * `lr_step`), from then
    on peak * sqrt(warmup) / sqrt(n) (`decay_factor` * num_updates ** -0.5). Both set the
    optimizer's rate to `warmup_init_lr` before the first update and recompute it after each
    from the incremented count, so update n (0-based) uses the value at n, as optax counts.
    `warmup` 0: peak * sqrt(1 / max(n, 1)), the decay from the first update."""
    if warmup <= 0:
        return lambda step: peak * jax.lax.rsqrt(jnp.maximum(jnp.asarray(step, jnp.float32), 1.0))
    slope = (peak - start) / warmup

    def schedule(step: Any) -> jax.Array:
        n = jnp.asarray(step, jnp.float32)
        ramp = start + n * slope
        decay = peak * jnp.sqrt(float(warmup)) * jax.lax.rsqrt(jnp.maximum(n, 1.0))
        return jnp.where(n < warmup, ramp, decay)

    return schedule


def tri_stage_schedule(peak: float, start: float, end: float, warmup: int, hold: int,
                       decay: int) -> optax.Schedule:
    """fairseq's `tri_stage` (fairseq/optim/lr_scheduler/tri_stage_lr_scheduler.py, the
    wav2vec 2.0 fine-tuning schedule, Park et al. 2019's): update n < warmup uses start + n *
    (peak - start) / warmup; then peak for `hold` updates; then peak * exp(-k * m) at m updates
    into the decay, k = log(peak / end) / decay, reaching `end` after `decay` updates and
    staying there. fairseq's configs give the stages as fractions of the updates (`phase_ratio`
    [0.1, 0.4, 0.5]) and start and end as fractions of the peak (`init_lr_scale` 0.01,
    `final_lr_scale` 0.05)."""
    if not 0 < end <= peak or decay < 1:
        raise UserError(f"optim.schedule=tri_stage decays to optim.end_learning_rate={end} "
                        f"over {decay} steps: it needs 0 < end_learning_rate <= learning_rate "
                        "and train.steps > optim.warmup_steps + optim.hold_steps")
    rate = math.log(peak / end) / decay

    def schedule(step: Any) -> jax.Array:
        n = jnp.asarray(step, jnp.float32)
        ramp = start + n * (peak - start) / max(warmup, 1)
        decayed = peak * jnp.exp(-rate * jnp.minimum(n - warmup - hold, decay))
        return jnp.where(n < warmup, ramp, jnp.where(n < warmup + hold, peak, decayed))

    return schedule


def adafactor(schedule: optax.Schedule, weight_decay: float) -> optax.GradientTransformation:
    """Adafactor as T5 is trained with it (Shazeer & Stern 2018; Mesh TensorFlow's
    `AdafactorOptimizer` defaults, which `optax.adafactor` shares: second moments factored into
    row and column statistics for matrices whose two largest dims are >= 128, decay
    1 - (t+1)^-0.8, updates clipped to RMS 1, steps scaled by the parameter's RMS (at least
    1e-3), no momentum, eps 1e-30). `weight_decay` (T5: 0) is optax's, not on LayerNorm
    scales or biases.

    It runs per parameter, and per layer on stacked layer parameters (a `layers` axis, vmapped),
    because the reference sees one variable per layer: factoring, clipping and the parameter
    scale never mix layers. The state is a tuple with one entry per parameter (its statistics
    are vectors or small), so it is not sharded like the parameters."""

    def transforms(tree: Any) -> list[optax.GradientTransformation]:
        decay = jax.tree.leaves(decay_mask(tree))
        stacked = jax.tree.leaves(jax.tree_util.tree_map_with_path(
            lambda path, _: "layers" in _names(path), tree))
        out = []
        for decays, per_layer in zip(decay, stacked, strict=True):
            rate = weight_decay if decays and weight_decay else None
            tx = optax.adafactor(schedule, weight_decay_rate=rate)
            out.append(optax.GradientTransformation(jax.vmap(tx.init), jax.vmap(tx.update))
                       if per_layer else tx)
        return out

    def init(params: Any) -> tuple[Any, ...]:
        return tuple(tx.init(p) for tx, p in zip(transforms(params), jax.tree.leaves(params),
                                                  strict=True))

    def update(updates: Any, state: tuple[Any, ...], params: Any = None):
        leaves, treedef = jax.tree.flatten(updates)
        new = [tx.update(u, s, p) for tx, u, s, p in zip(
            transforms(updates), leaves, state, jax.tree.leaves(params), strict=True)]
        return jax.tree.unflatten(treedef, [u for u, _ in new]), tuple(s for _, s in new)

    return optax.GradientTransformation(init, update)


def adam_moments(config: Any) -> optax.GradientTransformation:
    """Adam's m / (sqrt(v) + eps) as `config` places the bias correction and eps (adamw, lamb)."""
    if not config.bias_correction:
        return scale_by_adam_without_bias_correction(config.b1, config.b2, config.eps)
    if config.eps_before_bias_correction:
        return scale_by_adam_eps_hat(config.b1, config.b2, config.eps)
    return optax.scale_by_adam(config.b1, config.b2, config.eps)


def scale_by_layer_trust_ratio(mask: Any = None) -> optax.GradientTransformation:
    """LAMB's layer adaptation (You et al. 2020; albert lamb_optimizer.py): each update times
    ||w|| / ||update||, 1 where either norm is 0, for the parameters `mask` selects (None: all).
    The norms are per variable of the reference, so per layer on stacked layer parameters (a
    `layers` axis), where optax's `scale_by_trust_ratio` would take one norm over all layers."""

    def update(updates: Any, state: optax.EmptyState, params: Any = None):
        stacked = jax.tree_util.tree_map_with_path(lambda path, _: "layers" in _names(path),
                                                   updates)

        def scale(u: jax.Array, p: jax.Array, per_layer: bool) -> jax.Array:
            axes = tuple(range(1, u.ndim)) if per_layer and u.ndim > 1 else None
            w_norm = jnp.sqrt(jnp.sum(jnp.square(p.astype(jnp.float32)), axes, keepdims=True))
            u_norm = jnp.sqrt(jnp.sum(jnp.square(u.astype(jnp.float32)), axes, keepdims=True))
            usable = (w_norm > 0) & (u_norm > 0)
            ratio = jnp.where(usable, w_norm / jnp.where(usable, u_norm, 1.0), 1.0)
            return (u * ratio).astype(u.dtype)

        return jax.tree.map(scale, updates, params, stacked), state

    transform = optax.GradientTransformation(lambda params: optax.EmptyState(), update)
    return transform if mask is None else optax.masked(transform, mask)


def make_optimizer(config: Any, total_steps: int, labels: Any = None
                   ) -> optax.GradientTransformation:
    """The optax chain for `config` (OptimConfig): clip -> moments -> decoupled decay -> lr,
    under gradual unfreezing with `unfreeze_every_steps`; with `labels` (a function of the
    parameters to `TRAINED` or `FROZEN` each, `adapter_labels`), on the trained parameters only:
    the frozen ones have no optimizer state and an update of exactly 0; all under magnitude
    pruning (`magnitude_pruned`) with `prune_sparsity`, `prune_initial_sparsity` or
    `keep_pruned`."""
    tx = _optimizer(config, total_steps)
    if config.unfreeze_every_steps:
        tx = gradually_unfrozen(tx, config.unfreeze_every_steps)
    if labels is not None:
        tx = optax.multi_transform({TRAINED: tx, FROZEN: optax.set_to_zero()}, labels)
    if updates_masks(config) or config.keep_pruned:
        tx = magnitude_pruned(tx, config)
    return tx


def _optimizer(config: Any, total_steps: int) -> optax.GradientTransformation:
    """`make_optimizer`'s chain for every parameter."""
    schedule = learning_rate_schedule(config, total_steps)
    # fairseq's Adam decays every parameter; the TF references skip LayerNorm and biases.
    decayed = None if config.decay_norms_and_biases else decay_mask
    if config.optimizer == "adamw":
        core = optax.chain(
            adam_moments(config),
            optax.add_decayed_weights(config.weight_decay, mask=decayed),
            optax.scale_by_learning_rate(schedule),
        )
    elif config.optimizer == "lamb":
        # google-research/albert lamb_optimizer.py `LAMBOptimizer`: Adam moments (without bias
        # correction unless asked), + decay, the trust ratio, lr; the trust ratio skips what the
        # decay skips (its exclude_from_layer_adaptation defaults to exclude_from_weight_decay).
        core = optax.chain(adam_moments(config),
                           optax.add_decayed_weights(config.weight_decay, mask=decayed),
                           scale_by_layer_trust_ratio(mask=decayed),
                           optax.scale_by_learning_rate(schedule))
    elif config.optimizer == "lars" and config.learning_rate_after_momentum:
        # BYOL's utils/optimizers.py `lars`: decay -> trust ratio -> momentum trace -> lr
        # (v = m v + trust * (g + wd w), w -= lr v): the rate scales the whole velocity.
        core = optax.chain(
            optax.add_decayed_weights(config.weight_decay, mask=decay_mask),
            optax.masked(optax.scale_by_trust_ratio(trust_coefficient=config.trust_coefficient),
                         decay_mask),
            optax.trace(decay=config.momentum),
            optax.scale_by_learning_rate(schedule))
    elif config.optimizer == "lars":
        # optax.lars = decay -> trust ratio -> lr -> momentum trace, i.e. SimCLR's
        # lars_optimizer.py with classic momentum (v = m v + lr * trust * (g + wd w)).
        core = optax.lars(schedule, config.weight_decay, weight_decay_mask=decay_mask,
                          trust_coefficient=config.trust_coefficient, trust_ratio_mask=decay_mask,
                          momentum=config.momentum)
    elif config.optimizer == "sgd":
        # torch.optim.SGD as MoCo's main_moco.py uses it: d = g + wd w on every parameter
        # (BatchNorm and biases included), v = m v + d, w -= lr v.
        core = optax.chain(optax.add_decayed_weights(config.weight_decay),
                           optax.sgd(schedule, momentum=config.momentum,
                                     nesterov=config.nesterov))
    elif config.optimizer == "adafactor":
        core = adafactor(schedule, config.weight_decay)
    elif config.optimizer == "adagrad":
        # tf.train.AdagradOptimizer(lr, initial_accumulator_value=1.0) as bilm-tf (ELMo) runs
        # it: a = 1 + sum g^2, w -= lr g / sqrt(a); no weight decay.
        core = optax.adagrad(schedule, initial_accumulator_value=1.0, eps=0.0)
    else:
        raise UserError(f"optim.optimizer={config.optimizer!r} is unknown; use adamw, lamb, "
                        "lars, sgd, adafactor or adagrad")
    if config.layerwise_lr_decay != 1.0:
        core = optax.chain(core, scale_by_layer_depth(config.layerwise_lr_decay))
    if config.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(config.clip_norm), core)
    return core
