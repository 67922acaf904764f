"""Fine-tuning strategies beside full fine-tuning: adapters (Houlsby et al. 2019; the authors'
google-research/adapter-bert) train only bottleneck adapters, the layer norms and the head;
gradual unfreezing (ULMFiT, Howard & Ruder 2018 §3.3) trains the head, then one more layer group
from the top every `optim.unfreeze_every_steps` updates. Frozen parameters stay bit for bit."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from resilience_utils import GRADIENT_STEP, assert_same_step_on_every_mesh, mesh_overrides
from test_finetune import FAST, bert_dir, glue_folder  # noqa: F401  (fixtures)

from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.errors import UserError
from pretext_jax.models.classifier import SequenceClassifier
from pretext_jax.models.encoder import ADAPTER_INIT_SCALE
from pretext_jax.objectives.common.classifier_recipes import FinetuneModelConfig
from pretext_jax.pretrain import hf
from pretext_jax.pretrain.finetune import finetune_config
from pretext_jax.pretrain.optim import FROZEN, adapter_labels, unfreezing_stages
from pretext_jax.pretrain.trainer import Trainer

H, M, L = 32, 4, 2  # test_finetune's tiny BERT: hidden 32, 2 layers; adapters of 4
TRAIN = [*FAST, "optim.learning_rate=1e-3", "optim.warmup_steps=0", "train.steps=8"]


def flat(tree: object) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))}


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """adapter-bert modeling.py `gelu` (the tanh approximation)."""
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def test_adapters_start_near_the_identity_and_are_it_with_a_zero_up_projection():
    """Each adapter is x + up(gelu(down(x))) (numpy, from `feedforward_adapter`), its weights
    truncated normal (std 1e-3, cut at 2 std), biases 0; so the classifier's logits are within
    the bound that gives of the same classifier without adapters, and equal to them with the
    up-projections zeroed (control: not equal before)."""
    fields = dict(vocab_size=24, hidden_size=H, num_layers=L, num_heads=4, intermediate_size=64,
                  max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
    adapted = SequenceClassifier(FinetuneModelConfig(**fields, adapter_size=M), rngs=nnx.Rngs(0))
    plain = SequenceClassifier(FinetuneModelConfig(**fields), rngs=nnx.Rngs(1))
    nnx.update(adapted, nnx.state(plain, nnx.Param))  # all but the adapters
    layers = adapted.encoder.stack.layers
    weights = np.concatenate([np.ravel(a.kernel[...]) for adapter in (
        layers.attention_adapter, layers.output_adapter) for a in (adapter.down, adapter.up)])
    assert weights.size == L * 2 * 2 * H * M
    assert np.abs(weights).max() <= 2 * ADAPTER_INIT_SCALE
    # the std of a normal cut at +-2 std is 0.880 of the uncut one
    assert abs(weights.std() / ADAPTER_INIT_SCALE - 0.880) < 0.05
    assert all(not np.any(a.bias[...]) for adapter in (layers.attention_adapter,
                                                       layers.output_adapter)
               for a in (adapter.down, adapter.up))

    x = np.random.default_rng(0).normal(size=(3, 5, H)).astype(np.float32)
    stacked = layers.output_adapter  # layer 0's below
    one = nnx.merge(nnx.graphdef(stacked), jax.tree.map(lambda v: v[0], nnx.state(stacked)))
    down, up = (np.asarray(p.kernel[...]) for p in (one.down, one.up))
    expected = x + gelu_tanh(x @ down) @ up
    np.testing.assert_allclose(np.asarray(one(x)), expected, rtol=1e-6, atol=1e-7)
    # |gelu(z)| <= |z| and every weight within 2 std: |A(x) - x| <= M |x|_1 (2 std)^2
    bound = M * np.abs(x).sum(-1, keepdims=True) * (2 * ADAPTER_INIT_SCALE) ** 2
    assert np.all(np.abs(np.asarray(one(x)) - x) <= bound)

    ids = np.random.default_rng(1).integers(0, 24, (4, 12))
    logits = nnx.jit(lambda model: model(ids))
    near, exact = np.asarray(logits(adapted)), np.asarray(logits(plain))
    assert 0 < np.abs(near - exact).max() < 1e-3
    for adapter in (layers.attention_adapter, layers.output_adapter):
        adapter.up.kernel[...] = np.zeros_like(adapter.up.kernel[...])
    # the same function, not the same program: float32 rounding may differ (1e-7 relative)
    np.testing.assert_allclose(np.asarray(logits(adapted)), exact, rtol=1e-6, atol=1e-9)


def test_adapter_tuning_trains_adapters_layer_norms_and_head_only(
        tmp_path, bert_dir, glue_folder, capsys):  # noqa: F811  (test_finetune's fixtures)
    """After 8 updates (weight decay 0.01 on): every frozen parameter bit for bit as it
    started, every trained one moved; the trained count is the hand count; the frozen
    parameters hold no Adam moments; refusals: ALBERT's shared layer, HF export."""
    config = finetune_config("sst2", bert_dir, glue_folder, [*TRAIN, "model.adapter_size=4"])
    assert config.model.adapter_size == M and config.optim.weight_decay == 0.01
    trainer = Trainer(config, tmp_path / "adapters")
    before = flat(trainer.init_state().params)
    summary = trainer.run()
    after = flat(summary["state"].params)
    labels = flat(adapter_labels(summary["state"].params))
    assert before.keys() == after.keys() == labels.keys()
    trained = {k for k, label in labels.items() if label != FROZEN}
    assert any("word_embeddings" in k for k in set(labels) - trained)
    for key in before:
        assert np.array_equal(before[key], after[key]) == (key not in trained), key
    # adapters: 2 a layer of H x M + M + M x H + H; layer norms: the embeddings' and 2 a layer
    # of scale and bias; the head: pooler H x H + H and output H x 2 + 2
    adapters, norms, head = L * 2 * (2 * H * M + M + H), (1 + 2 * L) * 2 * H, H * H + H + 2 * H + 2
    counted = sum(after[k].size for k in trained)
    assert counted == adapters + norms + head == summary["parameters"]["trained"]
    assert summary["parameters"]["total"] == sum(v.size for v in after.values())
    assert f"training {counted:,} of {summary['parameters']['total']:,} parameters" in (
        capsys.readouterr().out)
    moments = sum(v.size for v in flat(summary["state"].opt_state).values() if v.ndim)
    assert moments == 2 * counted  # Adam's m and v of the trained parameters only

    with pytest.raises(UserError, match="adapter_size=0 for head=albert"):
        finetune_config("sst2", bert_dir, glue_folder, ["model.adapter_size=4",
                                                        "model.head=albert"])
    with pytest.raises(UserError, match="no adapter layers"):
        hf.checkpoints(trainer.model_of(summary["state"]))


def test_adapters_under_gradual_unfreezing_step_the_same_on_every_mesh(
        tmp_path, bert_dir, glue_folder):  # noqa: F811  (test_finetune's fixtures)
    """One plain gradient step of an adapter-tuned classifier under gradual unfreezing (both
    masks at once: the head alone trains at the first step) gives the same loss and parameters
    on one device and on the (2, 2, 2) mesh, which shards the frozen parameters and the masked
    optimizer state too."""

    def trainer_at(workdir, mesh, devices):
        overrides = [*FAST, "train.steps=1", "model.adapter_size=4",
                     "optim.unfreeze_every_steps=1", *(
            f"{k}={v}" for k, v in {**GRADIENT_STEP, **mesh_overrides(mesh)}.items())]
        return Trainer(finetune_config("sst2", bert_dir, glue_folder, overrides), workdir,
                       devices=devices)

    assert_same_step_on_every_mesh(trainer_at, tmp_path)


def test_gradual_unfreezing_unfreezes_a_layer_group_every_n_steps_and_resumes_exactly(
        tmp_path, bert_dir, glue_folder):  # noqa: F811  (test_finetune's fixtures)
    """unfreeze_every_steps 2, 2 layers, ULMFiT's discriminative rates (1 / 2.6 per layer):
    updates 1-2 train the head, 3-4 also the top layer, 5-6 also the bottom one, 7-8 also the
    embeddings; each group bit for bit unchanged before its turn (weight decay on), moved after.
    The run, stopped at 2, 4 and 6 and resumed each time, ends bit for bit as a straight one
    (parameters and optimizer state)."""
    overrides = [*TRAIN, "optim.unfreeze_every_steps=2", f"optim.layerwise_lr_decay={1 / 2.6}"]
    config = finetune_config("sst2", bert_dir, glue_folder, overrides)
    trainer = Trainer(config, tmp_path / "straight")
    initial = trainer.init_state().params
    straight = trainer.run()["state"]
    stages = flat(unfreezing_stages(straight.params, 2))
    assert {int(v.max()) for k, v in stages.items() if "embeddings" in k} == {6}
    assert {int(v.max()) for k, v in stages.items() if "head" in k} == {0}

    def groups(params: object) -> dict[str, np.ndarray]:
        p = nnx.to_pure_dict(params)
        layers = p["encoder"]["stack"]["layers"]["query"]["kernel"]
        return {"head": p["head_output"]["kernel"], "top": layers[1], "bottom": layers[0],
                "embeddings": p["encoder"]["embeddings"]["word_embeddings"]["embedding"]}

    seen = [groups(initial)]
    resumed = Trainer(config, tmp_path / "resumed")  # each run resumes from the checkpoint
    for stop in (2, 4, 6, None):
        summary = resumed.run(stop_after=stop)
        seen.append(groups(summary["state"].params))
    order = ["head", "top", "bottom", "embeddings"]
    for stage in range(4):
        for k, name in enumerate(order):
            unchanged = np.array_equal(seen[stage][name], seen[stage + 1][name])
            assert unchanged == (k > stage), (stage, name)
    ours, theirs = (flat({"params": s.params, "opt_state": s.opt_state})
                    for s in (summary["state"], straight))
    assert ours.keys() == theirs.keys()
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    assert int(ours["['opt_state'].count"]) == 8  # the unfreezing schedule's own count

    with pytest.raises(UserError, match="optim.unfreeze_every_steps=0"):
        unfreezing_stages({"encoder": {"stack": {"layer": {"w": np.ones(2)}}}}, 2)
