"""Magnitude pruning (Gordon et al. 2020, "Compressing BERT"): the optimizer against TF
model_pruning's masking and mask updates (google-research model_pruning/python/pruning.py, as
mitchellgordon95/bert-prune runs it) re-stated in numpy, and the trainer pruning a fine-tuned
BERT on a sharded mesh through a resume."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from resilience_utils import mesh_overrides
from test_finetune import FAST, bert_dir, glue_folder  # noqa: F401  (fixtures)

from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.errors import UserError
from pretext_jax.pretrain import optim
from pretext_jax.pretrain.config import OptimConfig, config_from_dict
from pretext_jax.pretrain.finetune import finetune_config
from pretext_jax.pretrain.trainer import Trainer

LR, WD, EPS, B1, B2 = 0.01, 0.01, 1e-6, 0.9, 0.999


def encoder_like(rng: np.random.Generator) -> dict:
    """A parameter tree named as pretext's BERT names its own: stacked layer kernels, word and
    position embeddings, biases, BERT's pooler and a task head."""
    def normal(*shape):
        return rng.normal(size=shape).astype(np.float32)
    return {"encoder": {"stack": {"layers": {"query": {"kernel": normal(2, 6, 8),
                                                       "bias": normal(2, 8)}}},
                        "embeddings": {"word_embeddings": {"embedding": normal(20, 6)},
                                       "position_embeddings": {"embedding": normal(10, 6)}}},
            "pooler": {"kernel": normal(6, 6), "bias": normal(6)},
            "head": {"kernel": normal(6, 2)}}


TARGETS = {"['encoder']['stack']['layers']['query']['kernel']",
           "['encoder']['embeddings']['word_embeddings']['embedding']", "['pooler']['kernel']"}


def flat(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def model_pruning_run(params: dict, grads: list[dict], settings: dict, *, per_layer=True,
                      zero_masked=False):
    """The run re-stated from model_pruning and bert-prune's optimization.py: raw weights and a
    mask per target; the forward pass sees weight x mask, so a raw weight's gradient is the
    masked weight's times its mask; global-norm clip 1.0, BERT's AdamWeightDecay (no bias
    correction, decay 0.01 not on biases) on the raw weights; after update t (the global step
    before it), when t >= last update + frequency and t <= end_pruning_step (-1: always), every
    mask becomes |raw| >= the k-th largest |raw| of its matrix (each stacked layer its own:
    `per_layer`), k = round(n (1 - s(t))), s(t) = s_f + (s_i - s_f)(1 - min(1, t / end))^3.
    `zero_masked` (a negative control): masked raw weights set to 0, as a simpler pruner would.
    Returns the masked weights and masks after each update."""
    raw = {k: v.astype(np.float64) for k, v in flat(params).items()}
    masks = {k: np.ones_like(v, bool) for k, v in raw.items() if k in TARGETS}
    m = {k: np.zeros_like(v) for k, v in raw.items()}
    v = {k: np.zeros_like(x) for k, x in raw.items()}
    last, history = 0, []
    for t, grad in enumerate(grads):
        g = {k: x * masks[k] if k in masks else x for k, x in flat(grad).items()}
        norm = np.sqrt(sum(np.sum(x ** 2) for x in g.values()))
        g = {k: x * min(1.0, 1.0 / norm) for k, x in g.items()}
        for k in raw:
            m[k] = B1 * m[k] + (1 - B1) * g[k]
            v[k] = B2 * v[k] + (1 - B2) * g[k] ** 2
            update = m[k] / (np.sqrt(v[k]) + EPS)
            if not k.endswith("['bias']"):
                update = update + WD * raw[k]
            raw[k] = raw[k] - LR * update
        until = settings["prune_until_step"]
        if t >= last + settings["prune_frequency"] and (until < 0 or t <= until):
            last = t
            progress = min(1.0, t / settings["prune_end_step"])
            s = (settings["prune_sparsity"] + (settings["prune_initial_sparsity"]
                                               - settings["prune_sparsity"]) * (1 - progress) ** 3)
            for k in masks:
                rows = np.abs(raw[k]).reshape(
                    (raw[k].shape[0], -1) if per_layer and "layers" in k else (1, -1))
                keep = int(np.round(rows.shape[1] * (1 - s)))
                threshold = -np.sort(-rows, axis=1)[:, keep - 1]
                masks[k] = (rows >= threshold[:, None]).reshape(raw[k].shape)
                if zero_masked:
                    raw[k] = raw[k] * masks[k]
        history.append(({k: raw[k] * masks[k] if k in masks else raw[k] for k in raw},
                        {k: mask.copy() for k, mask in masks.items()}))
    return history


def pretext_run(params: dict, grads: list[dict], settings: dict):
    config = OptimConfig(schedule="constant", warmup_steps=0, learning_rate=LR, **settings)
    tx = optim.make_optimizer(config, len(grads))
    state, params = tx.init(params), jax.tree.map(jnp.asarray, params)
    step = jax.jit(tx.update)
    history = []
    for grad in grads:
        updates, state = step(grad, state, params)
        params = optax.apply_updates(params, updates)
        history.append((flat(params), flat(getattr(state, "masks", {}))))
    return history


GRADUAL = {"prune_sparsity": 0.75, "prune_initial_sparsity": 0.0, "prune_end_step": 12,
           "prune_frequency": 3, "prune_until_step": -1}


@pytest.fixture(scope="module")
def gradual_runs():
    rng = np.random.default_rng(0)
    params = encoder_like(rng)
    grads = [jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
             for _ in range(16)]
    return params, grads, pretext_run(params, grads, GRADUAL)


def test_sparsity_schedule_is_model_prunings_cubic_ramp():
    config = OptimConfig(**GRADUAL)
    expected = [0.75 * (1 - (1 - t / 12) ** 3) for t in range(13)] + [0.75] * 3
    np.testing.assert_allclose([float(optim.pruning_sparsity(config, t)) for t in range(16)],
                               expected, rtol=1e-6, atol=1e-7)
    one_shot = OptimConfig(prune_sparsity=0.6, prune_initial_sparsity=0.6, prune_end_step=1)
    assert float(optim.pruning_sparsity(one_shot, 0)) == pytest.approx(0.6)


def test_masks_and_weights_are_model_prunings(gradual_runs):
    """Masks first recomputed at update 3 (not 0), then 6, 9, 12, 15 (sparsity 0.43, 0.66,
    0.74, 0.75, 0.75), per layer on stacked layers; weights and masks after every update equal
    the re-statement's masked weights (1e-5) and masks; the pruned matrices end at exactly
    round(n (1 - 0.75)) kept weights each, the others untouched by pruning."""
    params, grads, ours = gradual_runs
    theirs = model_pruning_run(params, grads, GRADUAL)
    for t, ((weights, masks), (their_weights, their_masks)) in enumerate(
            zip(ours, theirs, strict=True)):
        for key in TARGETS:
            np.testing.assert_array_equal(masks[key], their_masks[key], err_msg=f"{t} {key}")
        for key, value in weights.items():
            np.testing.assert_allclose(value, their_weights[key], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{t} {key}")
    kernel = ours[-1][0]["['encoder']['stack']['layers']['query']['kernel']"]
    assert [int((layer == 0).sum()) for layer in kernel] == [48 - 12, 48 - 12]
    assert int((ours[-1][0]["['encoder']['embeddings']['word_embeddings']['embedding']"] == 0)
               .sum()) == 120 - 30
    for key in set(ours[-1][0]) - TARGETS:
        assert not (ours[-1][0][key] == 0).any(), key
    assert not (ours[2][0]["['pooler']['kernel']"] == 0).any()  # nothing pruned before 3
    assert (ours[3][0]["['pooler']['kernel']"] == 0).sum() == 36 - round(36 * (1 - 0.4336))


def test_negative_controls_one_threshold_per_stack_or_masked_weights_zeroed_differ(
        gradual_runs):
    """The comparison sees a threshold over both stacked layers at once, and a pruner that
    zeroes masked raw weights (they could not return; here one embedding weight does at
    update 12)."""
    params, grads, ours = gradual_runs
    key = "['encoder']['stack']['layers']['query']['kernel']"
    whole = model_pruning_run(params, grads, GRADUAL, per_layer=False)
    assert not np.array_equal(ours[3][1][key], whole[3][1][key])
    zeroed = model_pruning_run(params, grads, GRADUAL, zero_masked=True)
    assert any(not np.array_equal(masks[k], their_masks[k]) for (_, masks), (_, their_masks)
               in zip(ours, zeroed, strict=True) for k in TARGETS)


def test_keep_pruned_holds_a_checkpoints_zeros_and_only_those():
    """`keep_pruned` (bert-prune's fine-tuning of a pruned model): target weights exactly 0
    at the first update stay 0 bit for bit; zeros elsewhere (a bias, the head) train."""
    rng = np.random.default_rng(1)
    params = encoder_like(rng)
    zeroed = rng.random((2, 6, 8)) < 0.5
    params["encoder"]["stack"]["layers"]["query"]["kernel"][zeroed] = 0.0
    params["head"]["kernel"][0] = 0.0
    grads = [jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
             for _ in range(4)]
    weights, masks = pretext_run(params, grads, {"keep_pruned": True})[-1]
    kernel = weights["['encoder']['stack']['layers']['query']['kernel']"]
    np.testing.assert_array_equal(kernel == 0, zeroed)
    assert (weights["['head']['kernel']"][0] != 0).all()
    moved = pretext_run(params, grads, {})[-1][0]["['encoder']['stack']['layers']['query']"
                                                   "['kernel']"]
    assert (moved[zeroed] != 0).all()  # negative control: without it they train


def test_refusals_name_the_fix():
    with pytest.raises(UserError, match=r"optim.prune_sparsity=1.0 is outside .*\[0, 1\)"):
        config_from_dict({"method": "bert", "optim": {"prune_sparsity": 1.0}})
    tx = optim.make_optimizer(OptimConfig(prune_sparsity=0.5), 10)
    with pytest.raises(UserError, match="no weights to prune"):
        tx.init({"backbone": {"conv": {"kernel": jnp.ones((3, 3, 3, 8))}}})


def test_fine_tuning_prunes_on_a_sharded_mesh_and_resumes(
        tmp_path, bert_dir, glue_folder):  # noqa: F811  (test_finetune's fixtures)
    """SST-2 from a tiny BERT with bert-prune's one-shot downstream settings (initial = target
    0.5, end step 1, masks recomputed every 2 updates until update 4): on one device straight,
    and on the (2, 2, 2) mesh stopped after 3 updates and resumed, the two runs end with the
    same weights (1e-5) and masks; every layer's kernels and the word embeddings half zero;
    nothing else is, the task head (which holds BERT's pooler as its first dense) included."""
    settings = [*FAST, "train.steps=6", "optim.learning_rate=1e-3", "optim.warmup_steps=0",
                "optim.prune_sparsity=0.5", "optim.prune_initial_sparsity=0.5",
                "optim.prune_end_step=1", "optim.prune_frequency=2", "optim.prune_until_step=4",
                "train.checkpoint_every=3"]

    def trainer(workdir, mesh, devices=None):
        overrides = [*settings, *(f"{k}={v}" for k, v in mesh_overrides(mesh).items())]
        return Trainer(finetune_config("sst2", bert_dir, glue_folder, overrides), workdir,
                       devices=devices)

    single = trainer(tmp_path / "single", (1, 1, 1), jax.devices()[:1]).run()["state"]
    trainer(tmp_path / "mixed", (2, 2, 2)).run(stop_after=3)
    mixed = trainer(tmp_path / "mixed", (2, 2, 2)).run()["state"]
    ours, theirs = flat(nnx.to_pure_dict(mixed.params)), flat(nnx.to_pure_dict(single.params))
    for key, value in theirs.items():
        np.testing.assert_allclose(ours[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    assert flat(mixed.opt_state.masks).keys() == flat(single.opt_state.masks).keys()
    for key, mask in flat(single.opt_state.masks).items():
        np.testing.assert_array_equal(flat(mixed.opt_state.masks)[key], mask, err_msg=key)
    pruned = {key for key, value in theirs.items() if (value == 0).any()}
    assert pruned == {"['encoder']['embeddings']['word_embeddings']['embedding']",
                      *(f"['encoder']['stack']['layers']['{name}']['kernel']" for name in
                        ("query", "key", "value", "attention_output", "intermediate",
                         "output"))}, pruned  # the classifier's head_dense (BERT's pooler) not
    for key in pruned:
        rows = theirs[key].reshape((2, -1) if "layers" in key else (1, -1))
        assert ((rows == 0).mean(axis=1) == 0.5).all(), key
    assert int(single.opt_state.count) == int(mixed.opt_state.count) == 6
    assert int(single.opt_state.last_update) == 4
