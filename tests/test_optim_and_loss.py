"""Optimizer details from BERT's optimization.py and the MLM/NSP loss formula, against numpy."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.errors import UserError
from pretext_jax.models.classifier import XLNetClassifierConfig
from pretext_jax.models.t5 import T5Config
from pretext_jax.objectives import registry
from pretext_jax.objectives.common.losses import weighted_cross_entropy
from pretext_jax.pretrain.config import OptimConfig
from pretext_jax.pretrain.optim import decay_mask, learning_rate_schedule, make_optimizer


def test_bert_linear_schedule_decays_over_the_whole_run():
    config = OptimConfig(learning_rate=1e-3, warmup_steps=10)
    schedule = learning_rate_schedule(config, total_steps=100)
    for step in (0, 5, 9):
        assert float(schedule(step)) == pytest.approx(1e-3 * step / 10)
    # After warmup: polynomial_decay(power=1) computed from step 0, not from the warmup's end.
    for step in (10, 40, 99, 100):
        assert float(schedule(step)) == pytest.approx(1e-3 * (1 - step / 100), abs=1e-9)


def electra_reference_lr(step: int, peak: float, warmup: int, total: int) -> float:
    """google-research/electra model/optimization.py `create_optimizer` in plain Python:
    tf.train.polynomial_decay(peak, step, total, end_learning_rate=0, power=1, cycle=False),
    then lr *= min(1, step / warmup), `step` being the global step before its increment."""
    decayed = (peak - 0.0) * (1.0 - min(step, total) / total) ** 1.0 + 0.0
    return decayed * min(1.0, step / warmup)


def test_electra_schedule_multiplies_the_decay_by_the_warmup_ramp():
    config = OptimConfig(learning_rate=1e-3, warmup_steps=10, schedule="electra_linear")
    schedule = learning_rate_schedule(config, total_steps=100)
    for step in range(0, 106):
        assert float(schedule(step)) == pytest.approx(
            electra_reference_lr(step, 1e-3, 10, 100), rel=1e-6, abs=1e-12)
    # Not BERT's: during warmup the ramp scales the decayed value (5e-4 * 0.95 at step 5),
    # and the peak, reached at the end of warmup, is 1e-3 * (1 - 10/100).
    bert = learning_rate_schedule(OptimConfig(learning_rate=1e-3, warmup_steps=10), 100)
    assert float(bert(5)) == pytest.approx(5e-4)
    assert float(schedule(5)) == pytest.approx(5e-4 * 0.95)
    assert float(schedule(10)) == pytest.approx(9e-4)
    # Optimizer updates use schedule(count) with count = 0 at the first update, as the
    # reference's pre-increment global step: the first update has learning rate 0.
    tx = make_optimizer(OptimConfig(learning_rate=1e-3, warmup_steps=10,
                                    schedule="electra_linear", clip_norm=0.0,
                                    weight_decay=0.0), 100)
    params = {"w": jnp.ones(3)}
    updates, _ = tx.update({"w": jnp.ones(3)}, tx.init(params), params)
    np.testing.assert_array_equal(updates["w"], 0.0)
    with pytest.raises(UserError, match="electra_linear"):
        learning_rate_schedule(OptimConfig(schedule="electra"), 100)


def fairseq_reference_lr(num_updates: int, peak: float, warmup: int, total: int,
                         end: float = 0.0) -> float:
    """fairseq/optim/lr_scheduler/polynomial_decay_schedule.py `step_update` (power 1) in plain
    Python; the trainer sets it with step_update(0) before the first update, so update n uses
    num_updates = n."""
    if warmup > 0 and num_updates <= warmup:
        return num_updates / float(warmup) * peak
    if num_updates >= total:
        return end
    return (peak - end) * (1 - (num_updates - warmup) / (total - warmup)) + end


def test_fairseq_schedule_decays_from_the_peak_after_warmup():
    config = OptimConfig(learning_rate=1e-3, warmup_steps=10, schedule="linear_from_peak",
                         end_learning_rate=1e-5)
    schedule = learning_rate_schedule(config, total_steps=100)
    for step in range(0, 106):
        assert float(schedule(step)) == pytest.approx(
            fairseq_reference_lr(step, 1e-3, 10, 100, 1e-5), rel=3e-6, abs=1e-12)  # float32
    assert float(schedule(10)) == pytest.approx(1e-3)  # BERT's `linear` is at 0.9e-3 there


class XLMInverseSqrtReference:
    """XLM src/optim.py `AdamInverseSqrtWithWarmup`'s rate as its `step` sets it, re-stated in
    plain Python: the rate starts at `warmup_init_lr`; after each update the count is
    incremented and the rate recomputed (fairseq's inverse_sqrt `step_update` is the same)."""

    def __init__(self, peak: float, warmup: int, start: float):
        self.peak, self.warmup, self.start = peak, warmup, start
        self.lr, self.num_updates = start, 0

    def step(self) -> float:
        """One update: returns the rate it used, then advances."""
        used = self.lr
        self.num_updates += 1
        if self.num_updates < self.warmup:
            self.lr = self.start + self.num_updates * (self.peak - self.start) / self.warmup
        else:
            self.lr = self.peak * self.warmup ** 0.5 * self.num_updates ** -0.5
        return used


def test_inverse_sqrt_warmup_is_xlm_and_fairseq_schedule():
    config = OptimConfig(learning_rate=1e-3, warmup_steps=40, schedule="inverse_sqrt_warmup",
                         warmup_init_learning_rate=1e-7)
    schedule = learning_rate_schedule(config, total_steps=200)
    reference = XLMInverseSqrtReference(1e-3, 40, 1e-7)
    used = [reference.step() for _ in range(300)]  # past total_steps: no end clipping
    ours = [float(schedule(n)) for n in range(300)]
    np.testing.assert_allclose(ours, used, rtol=3e-6, atol=1e-12)
    assert ours[0] == pytest.approx(1e-7) and ours[40] == pytest.approx(1e-3)
    # Negative control: T5's inverse_sqrt holds the peak during warmup.
    t5 = learning_rate_schedule(dataclasses.replace(config, schedule="inverse_sqrt"), 200)
    assert float(t5(10)) == pytest.approx(1e-3) and ours[10] == pytest.approx(2.5e-4, rel=1e-3)
    assert not np.allclose([float(t5(n)) for n in range(40)], used[:40])


def fairseq_tri_stage(n: int, peak: float, init: float, final: float, warmup: int, hold: int,
                      decay: int) -> float:
    """fairseq tri_stage_lr_scheduler.py `step_update(num_updates)`, re-stated."""
    if n < warmup:
        return init + (peak - init) / warmup * n
    if n < warmup + hold:
        return peak
    if n <= warmup + hold + decay:
        return peak * np.exp(np.log(final / peak) / decay * (n - warmup - hold))
    return final


def test_tri_stage_is_fairseq_wav2vec2_finetuning_schedule():
    """phase_ratio [0.1, 0.4, 0.5] of 200 updates, init_lr_scale 0.01, final_lr_scale 0.05."""
    config = OptimConfig(learning_rate=5e-5, schedule="tri_stage", warmup_steps=20,
                         hold_steps=80, warmup_init_learning_rate=5e-7, end_learning_rate=2.5e-6)
    schedule = learning_rate_schedule(config, total_steps=200)
    ours = [float(schedule(n)) for n in range(260)]
    expected = [fairseq_tri_stage(n, 5e-5, 5e-7, 2.5e-6, 20, 80, 100) for n in range(260)]
    np.testing.assert_allclose(ours, expected, rtol=2e-6)
    assert ours[20] == ours[99] == pytest.approx(5e-5) and ours[250] == pytest.approx(2.5e-6)
    # Negative control: without the hold, the decay starts at the end of warmup.
    no_hold = learning_rate_schedule(dataclasses.replace(config, hold_steps=0), 200)
    assert float(no_hold(60)) < 0.9 * ours[60]
    with pytest.raises(UserError, match="end_learning_rate"):
        learning_rate_schedule(dataclasses.replace(config, end_learning_rate=0.0), 200)


def test_fairseq_adam_matches_numpy():
    """fairseq/optim/adam.py `Adam.step`, three steps: m, v moments, p -= wd lr p on every
    parameter (biases and LayerNorm too), then p -= lr sqrt(1 - b2^t) / (1 - b1^t) m /
    (sqrt(v) + eps)."""
    config = OptimConfig(learning_rate=0.1, warmup_steps=0, schedule="constant",
                         weight_decay=0.01, clip_norm=0.0, b2=0.98, eps=1e-6,
                         bias_correction=True, eps_before_bias_correction=True,
                         decay_norms_and_biases=True)
    tx = make_optimizer(config, total_steps=10)
    rng = np.random.default_rng(0)
    params = {"dense": {"kernel": jnp.asarray(rng.normal(size=(2, 3)), jnp.float32),
                        "bias": jnp.asarray(rng.normal(size=3), jnp.float32)},
              "layer_norm": {"scale": jnp.ones(3)}}
    expected = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    m = jax.tree.map(np.zeros_like, expected)
    v = jax.tree.map(np.zeros_like, expected)
    state = tx.init(params)
    for t in range(1, 4):
        grads = jax.tree.map(lambda x, t=t: 1e-5 * t * np.sin(7 * x + t), expected)
        m = jax.tree.map(lambda a, g: 0.9 * a + 0.1 * g, m, grads)
        v = jax.tree.map(lambda a, g: 0.98 * a + 0.02 * g * g, v, grads)
        step = 0.1 * np.sqrt(1 - 0.98 ** t) / (1 - 0.9 ** t)
        expected = jax.tree.map(lambda p, a, b, s=step: p - 0.01 * 0.1 * p
                                - s * a / (np.sqrt(b) + 1e-6), expected, m, v)
        updates, state = tx.update(jax.tree.map(jnp.asarray, grads), state, params)
        params = optax.apply_updates(params, updates)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(np.asarray(a), b, rtol=2e-6, atol=1e-7)
    with pytest.raises(UserError, match="bias_correction"):
        from pretext_jax.pretrain.config import make_config

        make_config("bert_tiny", ["optim.eps_before_bias_correction=true",
                                  "optim.bias_correction=false"])


def test_cosine_schedule_reaches_end():
    config = OptimConfig(learning_rate=1.0, warmup_steps=10, schedule="cosine",
                         end_learning_rate=0.1)
    schedule = learning_rate_schedule(config, total_steps=110)
    assert float(schedule(10)) == pytest.approx(1.0)
    assert float(schedule(60)) == pytest.approx(0.55, abs=1e-6)
    assert float(schedule(110)) == pytest.approx(0.1, abs=1e-6)


def test_adam_without_bias_correction_and_decay_mask_match_numpy():
    """Two steps of BERT's AdamWeightDecay by hand: m/(sqrt(v)+eps) + wd*w, no decay on
    LayerNorm or bias, global-norm clipping first."""
    config = OptimConfig(learning_rate=0.1, warmup_steps=0, schedule="constant",
                         weight_decay=0.01, clip_norm=1.0)
    tx = make_optimizer(config, total_steps=10)
    params = {"dense": {"kernel": jnp.array([[1.0, -2.0]]), "bias": jnp.array([0.5])},
              "layer_norm": {"scale": jnp.array([1.0])}}
    grads = [{"dense": {"kernel": jnp.array([[3.0, 4.0]]), "bias": jnp.array([0.0])},
              "layer_norm": {"scale": jnp.array([0.0])}},
             {"dense": {"kernel": jnp.array([[0.1, -0.2]]), "bias": jnp.array([0.3])},
              "layer_norm": {"scale": jnp.array([0.4])}}]
    state = tx.init(params)
    expected = jax.tree.map(np.asarray, params)
    m = jax.tree.map(np.zeros_like, expected)
    v = jax.tree.map(np.zeros_like, expected)
    for g in grads:
        norm = np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(g)))
        g = jax.tree.map(lambda x, n=norm: np.asarray(x) * min(1.0, 1.0 / n), g)
        m = jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, m, g)
        v = jax.tree.map(lambda a, b: 0.999 * a + 0.001 * b * b, v, g)
        step = jax.tree.map(lambda a, b: a / (np.sqrt(b) + 1e-6), m, v)
        step["dense"]["kernel"] = step["dense"]["kernel"] + 0.01 * expected["dense"]["kernel"]
        expected = jax.tree.map(lambda p, s: p - 0.1 * s, expected, step)
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-7)


def test_decay_mask_skips_norms_and_biases():
    params = {"lm_head": {"bias": 1}, "nsp": {"kernel": 1, "bias": 1},
              "mlm_layer_norm": {"scale": 1},
              "encoder": {"embeddings": {"word_embeddings": {"embedding": 1}}}}
    mask = decay_mask(params)
    assert mask == {"lm_head": {"bias": False}, "nsp": {"kernel": True, "bias": False},
                    "mlm_layer_norm": {"scale": False},
                    "encoder": {"embeddings": {"word_embeddings": {"embedding": True}}}}


# The weight-decay exclusions as a list of names (what `decay_mask` applied before it looked at a
# parameter's own name only): no decay where any component of the path is one of these.
NAME_LIST_EXCLUSIONS = ("bias", "scale", "layer_norm", "mlm_bias")

# Every registered method's default model, plus the model variants whose parameters differ.
DECAY_MASK_MODELS = [(name, None) for name in registry.names()] + [
    ("classify", XLNetClassifierConfig()), ("t5", T5Config(tie_word_embeddings=False))]


@pytest.mark.parametrize(("method", "model_config"), DECAY_MASK_MODELS,
                         ids=[f"{m}-{type(c).__name__}" if c else m for m, c in DECAY_MASK_MODELS])
def test_decay_mask_of_every_model_is_the_name_list_one(method, model_config, tmp_path):
    """Each model decays exactly the parameters that the name list decayed: the same set before
    and after the rule became generic. The MLM head's parameters of BERT and ELECTRA's
    generator, once `mlm_transform`, `mlm_layer_norm`, `mlm_bias` and now `lm_head.dense`,
    `lm_head.layer_norm`, `lm_head.bias`, get the same verdict from the list under either name
    (kernel decayed; LayerNorm and biases not). A parameter whose own name ends in `_bias`
    (XLNet's `lm_bias`, ELMo's `lstm_bias`) is a bias, except XLNet's r_w/r_r/r_s biases, which
    xlnet's model_utils.py decays (`include_in_weight_decay`); a module of that name (T5's
    `relative_attention_bias` embedding) is not."""
    m = registry.get(method)
    model_config = model_config or m.model_config()
    if getattr(model_config, "vocab_size", None) == 0:  # set from the data at prepare time
        model_config = dataclasses.replace(model_config, vocab_size=64)
    if hasattr(model_config, "task_labels") and model_config.task_labels is None:  # so too
        model_config = dataclasses.replace(model_config, task_labels=(3, 1))
    if method == "semi":  # its network is the backbone of a saved image run, under a head
        (tmp_path / "model.json").write_text(json.dumps({"method": "simclr", "model": {
            "depth": 18, "stem": "cifar", "base_width": 4}}))
        model_config = dataclasses.replace(model_config, architecture=str(tmp_path))
    model = nnx.eval_shape(lambda: m.build_model(model_config, 0))
    params = nnx.state(model, nnx.Param)
    names = lambda path: [str(getattr(k, "key", getattr(k, "name", k))) for k in path]  # noqa: E731
    own_name = lambda path: [n for n in names(path) if n != "value"][-1]  # noqa: E731
    expected = {tuple(names(path)): own_name(path) in ("r_w_bias", "r_r_bias", "r_s_bias")
                or not (any(n in NAME_LIST_EXCLUSIONS for n in names(path))
                        or own_name(path).endswith("_bias"))
                for path, _ in jax.tree_util.tree_leaves_with_path(params)}
    actual = {tuple(names(path)): bool(decays)
              for path, decays in jax.tree_util.tree_leaves_with_path(decay_mask(params))}
    assert actual == expected
    assert any(actual.values())
    assert not all(actual.values()) or method == "word2vec"  # two embedding tables, nothing else


def test_weighted_cross_entropy_is_the_reference_formula():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 11)).astype(np.float32)
    labels = rng.integers(0, 11, size=(3, 5))
    weights = (rng.random((3, 5)) > 0.3).astype(np.float32)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, labels[..., None], -1)[..., 0]
    expected = (weights * nll).sum() / (weights.sum() + 1e-5)
    loss, metrics = weighted_cross_entropy(jnp.asarray(logits), jnp.asarray(labels),
                                           jnp.asarray(weights))
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    correct = (logits.argmax(-1) == labels) * weights
    numerator, denominator = metrics["accuracy"]
    assert float(numerator) == correct.sum() and float(denominator) == weights.sum()


def test_bert_loss_is_mlm_plus_the_plain_mean_of_nsp():
    """run_pretraining.py: MLM sum(w nll) / (sum(w) + 1e-5) plus NSP `tf.reduce_mean` of the
    per-example losses (no epsilon in the NSP denominator)."""
    from types import SimpleNamespace

    from pretext_jax.objectives.bert import BertLossSettings, bert_loss

    rng = np.random.default_rng(1)
    mlm_logits = rng.normal(size=(4, 3, 7)).astype(np.float32)
    nsp_logits = rng.normal(size=(4, 2)).astype(np.float32)
    batch = {"input_ids": np.zeros((4, 5), np.int32), "segment_ids": np.zeros((4, 5), np.int32),
             "input_mask": np.ones((4, 5), np.int32),
             "masked_lm_positions": np.zeros((4, 3), np.int32),
             "masked_lm_ids": rng.integers(0, 7, (4, 3)).astype(np.int32),
             "masked_lm_weights": np.array([[1, 1, 0]] * 4, np.float32),
             "next_sentence_labels": np.array([0, 1, 1, 0], np.int32)}

    def model(*args, **kwargs):
        return SimpleNamespace(mlm_logits=jnp.asarray(mlm_logits),
                               nsp_logits=jnp.asarray(nsp_logits))

    def nll(logits, labels):
        logits = logits.astype(np.float64)
        log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        return -np.take_along_axis(log_probs, labels[..., None], -1)[..., 0]

    weights = batch["masked_lm_weights"]
    mlm = (weights * nll(mlm_logits, batch["masked_lm_ids"])).sum() / (weights.sum() + 1e-5)
    nsp = nll(nsp_logits, batch["next_sentence_labels"]).mean()
    total, _ = bert_loss(model, batch, None)
    assert float(total) == pytest.approx(mlm + nsp, rel=3e-7)
    # NSP alone (no MLM weight): sum / (B + 1e-5), the formula this replaced, is 2.5e-6 lower,
    # 30 float32 ulps away, so only the plain mean passes.
    nsp_only, _ = bert_loss(model, {**batch, "masked_lm_weights": 0 * weights}, None)
    assert abs(float(nsp_only) - nsp) < 2e-7 < abs(float(nsp_only) - nsp * 4 / (4 + 1e-5))
    # `objective.next_sentence_weight` scales NSP's term; at 0 the loss is the MLM's and the
    # NSP accuracy is still reported.
    for weight in (0.0, 0.5):
        total, metrics = bert_loss(model, batch, None,
                                   objective=BertLossSettings(next_sentence_weight=weight))
        assert float(total) == pytest.approx(mlm + weight * nsp, rel=3e-7)
        assert "nsp_accuracy" in metrics
    with pytest.raises(ValueError, match="next_sentence_weight=-1.0 must be >= 0"):
        BertLossSettings(next_sentence_weight=-1.0)


def test_lars_matches_simclr_lars_optimizer_by_hand():
    """Two steps of SimCLR's lars_optimizer.py (classic momentum): g += wd w; trust =
    eta ||w|| / ||g||; v = m v + lr trust g; w -= v. BatchNorm scale and biases get neither
    decay nor adaptation."""
    config = OptimConfig(optimizer="lars", learning_rate=0.5, warmup_steps=0,
                         schedule="constant", weight_decay=1e-4, clip_norm=0.0, momentum=0.9,
                         trust_coefficient=0.001)
    tx = make_optimizer(config, total_steps=10)
    rng = np.random.default_rng(0)
    params = {"conv": {"kernel": rng.standard_normal((3, 3, 2, 4))},
              "bn": {"scale": rng.standard_normal(4), "bias": rng.standard_normal(4)}}
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    state = tx.init(params)
    expected = jax.tree.map(np.asarray, params)
    velocity = jax.tree.map(np.zeros_like, expected)
    for step in range(2):
        grads = jax.tree.map(lambda a, s=step: jnp.sin(a * (s + 1)), params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        for path in (("conv", "kernel"), ("bn", "scale"), ("bn", "bias")):
            w = expected[path[0]][path[1]]
            g = np.asarray(grads[path[0]][path[1]], np.float64)
            if path[0] == "conv":  # decay and trust ratio only for the convolution kernel
                g = g + 1e-4 * w
                g = 0.001 * np.linalg.norm(w) / np.linalg.norm(g) * g
            v = 0.9 * velocity[path[0]][path[1]] + 0.5 * g
            velocity[path[0]][path[1]] = v
            expected[path[0]][path[1]] = w - v
        for key, value in jax.tree_util.tree_leaves_with_path(params):
            want = expected[key[0].key][key[1].key]
            np.testing.assert_allclose(np.asarray(value), want, rtol=1e-5, atol=1e-6)
