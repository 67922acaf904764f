"""HuBERT: parity with HF `HubertModel` (last hidden state and every hidden state on a padded
batch, BASE- and LV-60-style layouts, with and without the feature projection's LayerNorm),
the HF import and export (the pre-training head left out), and the masked-prediction loss and
its gradient against a torch re-statement of fairseq's hubert.py / hubert_criterion.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import Parity, assert_same_params, hf_reference, random_model
from test_wav2vec2 import HF_TINY, NO_DROPOUT, padded_waveforms

from pretext_jax.models.hubert import Hubert, HubertConfig
from pretext_jax.models.wav2vec2 import feature_lengths
from pretext_jax.pretrain import hf

HF_HUBERT_TINY = {k: v for k, v in HF_TINY.items()
                  if k not in ("num_codevector_groups", "num_codevectors_per_group",
                               "codevector_dim", "proj_codevector_dim")}
# The same network as ours, without dropout or LayerDrop; a small head of 7 clusters.
TINY = HubertConfig(
    conv_channels=(16, 16, 16), conv_kernel_sizes=(10, 3, 3), conv_strides=(5, 2, 2),
    hidden_size=32, num_layers=2, num_heads=4, intermediate_size=37, position_conv_kernel=16,
    position_conv_groups=2, num_classes=7, final_dim=12, hidden_dropout=0.0,
    attention_dropout=0.0, feature_projection_dropout=0.0, layerdrop=0.0)
HEAD = {"num_classes": 7, "final_dim": 12}
# `hf.load` overrides that give TINY from its export (HF's config has no "no dropout").
HUBERT_NO_DROPOUT = {k: v for k, v in NO_DROPOUT.items() if k != "quantizer_input_dropout"}
LAYOUTS = {"base": {}, "lv60": {"feat_extract_norm": "layer", "conv_bias": True,
                                "do_stable_layer_norm": True},
           "no_projection_norm": {"feat_proj_layer_norm": False}}


def _real(frames, value):
    """`value` [..., B, T, H] with padded frames zeroed (they hold no meaningful values)."""
    return value * frames[..., None]


def hf_states(model, waveforms, mask):
    import torch

    out = model(waveforms, attention_mask=mask, output_hidden_states=True)
    frames = model._get_feature_vector_attention_mask(out.last_hidden_state.shape[1], mask)
    return {"last_hidden_state": _real(frames, out.last_hidden_state),
            "hidden_states": _real(frames, torch.stack(out.hidden_states))}


def our_states(model: Hubert, waveforms, mask):
    hidden_states, frames = model.hidden_states(waveforms, mask)
    return {"last_hidden_state": _real(frames, model(waveforms, mask).last_hidden_state),
            "hidden_states": _real(frames, hidden_states)}


PARITY = Parity("HubertModel", hf_states, our_states)


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """A perturbed random tiny HF `HubertModel` per layout, saved."""
    pytest.importorskip("transformers")
    folders = {}
    for name, extra in LAYOUTS.items():
        folders[name] = tmp_path_factory.mktemp(name)
        hf_reference("HubertModel", 2, **HF_HUBERT_TINY, **extra).save_pretrained(folders[name])
    return folders


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parity_with_hf_hubert_model(deterministic_torch, hf_folders, layout):
    """Every hidden state and the last one on a padded batch within 1e-5 of HF's; the import
    warns that the pre-training head (which HF has no class for) keeps its initial values."""
    transformers = pytest.importorskip("transformers")
    reference = transformers.HubertModel.from_pretrained(hf_folders[layout]).eval()
    with pytest.warns(UserWarning, match="final_proj, label_embs_concat"):
        model = hf.load(hf_folders[layout], **HEAD)
    assert isinstance(model, Hubert)
    assert model.config.pre_layer_norm == (layout == "lv60")
    assert (model.feature_layer_norm is None) == (layout == "no_projection_norm")
    waveforms, mask = padded_waveforms(5)
    expected = PARITY.assert_parity(model, reference, waveforms, mask)
    assert expected["hidden_states"].shape[0] == TINY.num_layers + 1
    # Negative control: another layout's weights do not pass.
    other = hf.load(hf_folders["base" if layout != "base" else "lv60"], **HEAD)
    with pytest.raises(AssertionError):
        PARITY.assert_parity(other, reference, waveforms, mask)


@pytest.mark.usefixtures("deterministic_torch")
def test_export_is_hf_hubert_model_without_the_head(tmp_path):
    """Our random model exported: transformers reads a complete `HubertModel` (no missing or
    unexpected tensor) computing our states; the head is not written, and reading the export
    back gives the same body (the head at its initial values)."""
    transformers = pytest.importorskip("transformers")
    ours = random_model(Hubert, TINY, 3)
    hf.save(ours, tmp_path)
    reloaded, info = transformers.HubertModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    assert reloaded.config.architectures == ["HubertModel"]
    PARITY.assert_parity(ours, reloaded.eval(), *padded_waveforms(1))
    from safetensors.numpy import load_file

    names = set(load_file(tmp_path / "model.safetensors"))
    assert not any(name.startswith(("final_proj", "label_embs", "hubert.")) for name in names)
    with pytest.warns(UserWarning, match="final_proj, label_embs_concat"):
        back = hf.load(tmp_path, **HEAD, **HUBERT_NO_DROPOUT)
    assert back.config == TINY
    for name in ("final_proj", "label_embeddings"):
        setattr(back, name, getattr(ours, name))
    assert_same_params(back, ours)


def test_bad_configs():
    with pytest.raises(ValueError, match="num_classes"):
        dataclasses.replace(TINY, num_classes=0)
    from pretext_jax.errors import UserError
    from pretext_jax.models.hf import conversion

    with pytest.raises(UserError, match="conv_pos_batch_norm"):
        conversion.converter_and_config({"model_type": "hubert", "conv_pos_batch_norm": True},
                                        "folder", {})


def test_cluster_similarity_is_cosine():
    model = random_model(Hubert, TINY, 4)
    x = jax.random.normal(jax.random.key(0), (2, 5, TINY.final_dim))
    e = np.asarray(model.label_embeddings[...])
    expected = np.einsum("bte,ke->btk", x, e) / (
        np.linalg.norm(x, axis=-1)[..., None] * np.linalg.norm(e, axis=-1))
    np.testing.assert_allclose(model.cluster_similarity(x), expected, rtol=1e-5, atol=1e-6)
    assert feature_lengths(TINY, 1200) == 59
    assert nnx.state(model, nnx.Param)["label_embeddings"].get_value().shape == (7, 12)
    assert jnp.all(jnp.abs(model.cluster_similarity(x)) <= 1.0 + 1e-6)


# --- The loss against a torch re-statement of fairseq's -------------------------------------

def fairseq_hubert_loss(projected, embeddings, features, labels, mask, frames, groups,
                        masked_weight=1.0, unmasked_weight=0.0, penalty_weight=10.0,
                        logit_temp=0.1):
    """fairseq's HuBERT loss, re-stated from models/hubert/hubert.py (`compute_pred`,
    `compute_nce`: cosine of the projected frame with [its target's embedding, every
    embedding], the target's own copy at -inf, over `logit_temp`; `features_pen`) and
    criterions/hubert_criterion.py (cross-entropy of index 0 summed over the masked and the
    unmasked frames, `sample_size` the frames of each weighted term, `loss_weights` [10] x
    features_pen x sample_size) for `groups` GPUs of consecutive rows, summed over GPUs and
    divided by the summed sample size as fairseq's optimizer step does. torch tensors in,
    the loss out."""
    import torch
    import torch.nn.functional as F

    def compute_nce(x, pos, negs):
        neg_is_pos = (pos == negs).all(-1)
        logits = torch.cosine_similarity(x.float(), torch.cat([pos[None], negs]).float(),
                                         dim=-1) / logit_temp
        logits[1:][neg_is_pos] = float("-inf")
        return logits.transpose(0, 1)

    def compute_pred(proj_x, target):
        y = torch.index_select(embeddings, 0, target.long())
        negs = embeddings.unsqueeze(1).expand(-1, proj_x.size(0), -1)
        return compute_nce(proj_x, y, negs)

    total, sample_size = 0.0, 0
    rows = len(labels) // groups
    for g in range(groups):
        part = slice(g * rows, (g + 1) * rows)
        real = frames[part] & (labels[part] >= 0)
        loss, size = 0.0, 0
        for weight, where in ((masked_weight, real & mask[part]),
                              (unmasked_weight, real & ~mask[part])):
            logits = compute_pred(projected[part][where], labels[part][where])
            term = F.cross_entropy(logits, logits.new_zeros(len(logits), dtype=torch.long),
                                   reduction="sum")
            if weight > 0:
                loss, size = loss + weight * term, size + int(where.sum())
        features_pen = features[part].float().pow(2).mean()
        total = total + loss + penalty_weight * features_pen * size
        sample_size += size
    return total / sample_size


def loss_inputs(seed: int = 0):
    """Projected frames [4, 9, 6], 5 cluster embeddings, conv features [4, 9, 3], targets with
    -1 at padded frames of rows 1 and 3, masks."""
    rng = np.random.default_rng(seed)
    projected = rng.standard_normal((4, 9, 6)).astype(np.float32)
    embeddings = rng.uniform(size=(5, 6)).astype(np.float32)
    features = rng.standard_normal((4, 9, 3)).astype(np.float32)
    frames = np.ones((4, 9), bool)
    frames[1, 6:] = frames[3, 4:] = False
    labels = np.where(frames, rng.integers(0, 5, (4, 9)), -1).astype(np.int32)
    mask = rng.random((4, 9)) < 0.5
    mask[:, 0] = True
    return projected, embeddings, features, labels, mask, frames


@pytest.mark.parametrize("groups,weights", [(1, (1.0, 0.0)), (2, (1.0, 0.0)), (2, (0.7, 0.3))])
def test_loss_and_gradient_match_fairseq_restatement(deterministic_torch, groups, weights):
    """`prediction_loss` on cosine similarities and feature penalties, and its gradient with
    respect to the projected frames, the embeddings and the conv features, equal the torch
    re-statement of fairseq's (`fairseq_hubert_loss`); a different alpha or temperature
    (negative controls) does not."""
    from pretext_jax.models.hubert import cosine_similarities
    from pretext_jax.objectives.common.speech import feature_penalty
    from pretext_jax.objectives.hubert import HubertLossSettings, prediction_loss

    torch = deterministic_torch
    projected, embeddings, features, labels, mask, frames = loss_inputs()

    def ours(settings):
        def loss(p, e, f):
            return prediction_loss(cosine_similarities(p, e), jnp.asarray(labels),
                                   jnp.asarray(mask), jnp.asarray(frames),
                                   feature_penalty(f, groups), settings)[0]
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(
            jnp.asarray(projected), jnp.asarray(embeddings), jnp.asarray(features))

    tensors = [torch.tensor(a, requires_grad=True) for a in (projected, embeddings, features)]
    expected = fairseq_hubert_loss(*tensors, torch.tensor(labels), torch.tensor(mask),
                                   torch.tensor(frames), groups, *weights)
    expected.backward()
    settings = HubertLossSettings(masked_weight=weights[0], unmasked_weight=weights[1])
    value, grads = ours(settings)
    np.testing.assert_allclose(value, expected.item(), rtol=1e-5)
    for ours_grad, tensor in zip(grads, tensors, strict=True):
        np.testing.assert_allclose(ours_grad, tensor.grad.numpy(), rtol=1e-4, atol=1e-6)
        assert np.abs(tensor.grad.numpy()).max() > 1e-3
    for other in (dataclasses.replace(settings, unmasked_weight=weights[1] + 0.5),
                  dataclasses.replace(settings, logit_temperature=0.2)):
        assert abs(float(ours(other)[0]) - expected.item()) > 1e-3


def test_hubert_loss_reads_the_model():
    """`hubert_loss` on a tiny model: the masked cross-entropy from the model's own cluster
    similarities, the accuracies counted on masked frames, and a gradient for every
    parameter."""
    from pretext_jax.objectives.hubert import HubertLossSettings, hubert_loss

    model = random_model(Hubert, TINY, 5)
    waveforms, attention_mask = padded_waveforms(3)
    frames = np.asarray(feature_lengths(TINY, attention_mask.sum(-1)))
    mask = np.zeros((3, 59), bool)
    mask[:, 10:25] = True
    labels = np.where(np.arange(59) < frames[:, None],
                      np.random.default_rng(0).integers(0, 7, (3, 59)), -1).astype(np.int32)
    batch = {"audio": jnp.asarray(waveforms), "attention_mask": jnp.asarray(attention_mask),
             "mask_time_indices": jnp.asarray(mask), "cluster_labels": jnp.asarray(labels)}
    settings = HubertLossSettings()
    (loss, metrics), grads = nnx.jit(nnx.value_and_grad(
        lambda m: hubert_loss(m, batch, None, objective=settings), has_aux=True))(model)
    scored = mask & (labels >= 0)
    assert metrics["masked_loss"][1] == scored.sum()
    penalty = metrics["feature_penalty"][0]
    np.testing.assert_allclose(loss, metrics["masked_loss"][0] / scored.sum() + 10 * penalty,
                               rtol=1e-6)
    for path, grad in nnx.to_flat_state(grads):
        assert np.abs(np.asarray(grad.get_value())).max() > 0, path


def test_hf_models_belong_to_hubert_and_ctc_hubert_claims_them_for_ctc():
    """A HuBERT model (a wav2vec 2.0 body with another head) is the `hubert` method's, a
    `HubertForCTC` the `ctc_hubert` method's; on task ctc a HuBERT body (pre-trained or
    fine-tuned) gets `ctc_hubert`'s recipe and a wav2vec 2.0 keeps `ctc`'s (the control)."""
    from test_wav2vec2 import TINY as WAV2VEC2_TINY

    from pretext_jax import objectives  # noqa: F401  (registers the methods)
    from pretext_jax.models.hubert import HubertCTCConfig, HubertForCTC
    from pretext_jax.models.wav2vec2 import Wav2Vec2
    from pretext_jax.objectives import registry

    hubert = nnx.eval_shape(lambda: Hubert(TINY, rngs=nnx.Rngs(0)))
    assert registry.method_of_model(hubert) == "hubert"
    body = {k: v for k, v in dataclasses.asdict(TINY).items() if k not in HEAD}
    tuned = nnx.eval_shape(lambda: HubertForCTC(HubertCTCConfig(**body), rngs=nnx.Rngs(0)))
    assert registry.method_of_model(tuned) == "ctc_hubert"
    ctc = registry.downstream_task("ctc")
    for model in (hubert, tuned):
        assert registry.downstream_recipe(model, ctc, {}).values["method"] == "ctc_hubert"
    wav2vec2 = nnx.eval_shape(lambda: Wav2Vec2(WAV2VEC2_TINY, rngs=nnx.Rngs(0)))
    assert registry.downstream_recipe(wav2vec2, ctc, {}).values["method"] == "ctc"
