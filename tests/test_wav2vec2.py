"""wav2vec 2.0: parity with HF `Wav2Vec2ForPreTraining` (states, quantiser, losses; BASE- and
LV-60-style layouts, padded batches) and with HF's `output_hidden_states`, the HF round trip,
the span masks and distractors against HF's samplers, the feature-encoder gradient scale and the
Gumbel temperature schedule."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import (
    Parity,
    assert_loads_back,
    hf_reference,
    load_without_warnings,
    random_model,
    random_params,
)

from pretext_jax.errors import UserError
from pretext_jax.models.wav2vec2 import (
    PositionConv,
    Wav2Vec2,
    Wav2Vec2Config,
    codebook_perplexity,
    feature_lengths,
)
from pretext_jax.objectives.wav2vec2 import (
    MaskingSettings,
    Wav2Vec2LossSettings,
    contrastive_loss,
    diversity_loss,
    feature_penalty,
    gumbel_temperature,
    mask_batch,
    sample_negatives,
    span_mask,
    wav2vec2_loss,
)
from pretext_jax.pretrain import hf
from pretext_jax.pretrain.mesh import batch_sharding, make_mesh, state_shardings

HF_TINY = dict(conv_dim=(16, 16, 16), conv_kernel=(10, 3, 3), conv_stride=(5, 2, 2),
               hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
               num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
               num_codevector_groups=2, num_codevectors_per_group=8, codevector_dim=12,
               proj_codevector_dim=10)
# The same network as ours, without dropout or LayerDrop.
TINY = Wav2Vec2Config(
    conv_channels=(16, 16, 16), conv_kernel_sizes=(10, 3, 3), conv_strides=(5, 2, 2),
    hidden_size=32, num_layers=2, num_heads=4, intermediate_size=37, position_conv_kernel=16,
    position_conv_groups=2, num_codevector_groups=2, codevectors_per_group=8, codevector_dim=12,
    projection_dim=10, hidden_dropout=0.0, attention_dropout=0.0, feature_projection_dropout=0.0,
    quantizer_input_dropout=0.0, layerdrop=0.0)
NUM_SAMPLES = 1200  # 59 frames
NUM_NEGATIVES = 20
MASKING = MaskingSettings(num_negatives=NUM_NEGATIVES)
# `hf.load` overrides that give TINY from its export (HF's config has no "no dropout").
NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0, layerdrop=0.0,
                  activation_dropout=0.0, feature_projection_dropout=0.0,
                  quantizer_input_dropout=0.0)


def padded_waveforms(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """[3, 1200] waveforms, rows 1 and 2 zero-padded after 900 and 520 samples."""
    rng = np.random.default_rng(seed)
    mask = np.ones((3, NUM_SAMPLES), np.int64)
    mask[1, 900:] = 0
    mask[2, 520:] = 0
    return np.where(mask == 1, rng.standard_normal(mask.shape), 0.0).astype(np.float32), mask


def hf_masks(reference, attention_mask: np.ndarray, seed: int):
    """HF's own mask and distractors (with HF's batch offsets) for the padded batch."""
    import torch
    from transformers.models.wav2vec2.modeling_wav2vec2 import (
        _compute_mask_indices,
        _sample_negative_indices,
    )

    num_frames = int(reference._get_feat_extract_output_lengths(attention_mask.shape[1]))
    frames = reference._get_feature_vector_attention_mask(
        num_frames, torch.tensor(attention_mask)).numpy()
    np.random.seed(seed)
    mask = _compute_mask_indices((len(frames), num_frames), mask_prob=0.65, mask_length=10,
                                 attention_mask=torch.tensor(frames), min_masks=2)
    negatives = _sample_negative_indices((len(frames), num_frames), NUM_NEGATIVES, mask)
    return mask, negatives


@pytest.fixture(scope="module")
def reference_folder(tmp_path_factory):
    """A perturbed random tiny HF model per layout, saved; BASE: group norm, post-LN; LV-60:
    layer norm in every conv, conv biases, pre-LN ("stable layer norm")."""
    pytest.importorskip("transformers")
    folders = {}
    for name, extra in (("base", {}), ("lv60", {"feat_extract_norm": "layer",
                                                "conv_bias": True,
                                                "do_stable_layer_norm": True})):
        folders[name] = tmp_path_factory.mktemp(name)
        hf_reference("Wav2Vec2ForPreTraining", 1, **HF_TINY, **extra).save_pretrained(
            folders[name])
    return folders


@pytest.mark.parametrize("layout", ["base", "lv60"])
def test_parity_with_hf_on_a_padded_batch(deterministic_torch, reference_folder, layout):
    transformers = pytest.importorskip("transformers")
    torch = deterministic_torch
    reference = transformers.Wav2Vec2ForPreTraining.from_pretrained(
        reference_folder[layout]).eval()
    model = load_without_warnings(reference_folder[layout])
    assert isinstance(model, Wav2Vec2)
    assert model.config.pre_layer_norm == (layout == "lv60")
    waveforms, attention_mask = padded_waveforms()
    mask, hf_negatives = hf_masks(reference, attention_mask, seed=3)
    with torch.no_grad():
        expected = reference(torch.tensor(waveforms), attention_mask=torch.tensor(attention_mask),
                             mask_time_indices=torch.tensor(mask),
                             sampled_negative_indices=torch.tensor(hf_negatives).long())
        last_hidden = reference.wav2vec2(torch.tensor(waveforms),
                                         attention_mask=torch.tensor(attention_mask),
                                         mask_time_indices=torch.tensor(mask)).last_hidden_state
    out = model(jnp.asarray(waveforms), jnp.asarray(attention_mask), jnp.asarray(mask))
    num_frames = mask.shape[1]
    frames = np.arange(num_frames) < feature_lengths(model.config, attention_mask.sum(-1))[:, None]
    np.testing.assert_array_equal(out.frames, frames)
    for ours, theirs in ((out.last_hidden_state, last_hidden),
                         (out.projected_states, expected.projected_states),
                         (out.projected_quantized_states, expected.projected_quantized_states)):
        np.testing.assert_allclose(ours, theirs.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(out.codevector_perplexity, expected.codevector_perplexity,
                               rtol=1e-6)
    looped = hf.load(reference_folder[layout], scan_layers=False, remat="full")
    np.testing.assert_allclose(
        looped(jnp.asarray(waveforms), jnp.asarray(attention_mask),
               jnp.asarray(mask)).projected_states, out.projected_states, atol=1e-6, rtol=0)
    # The loss pieces on our outputs, with HF's distractors as indices within the utterance.
    negatives = hf_negatives - (np.arange(len(mask)) * num_frames)[:, None, None]
    contrastive, _ = contrastive_loss(out.projected_states, out.projected_quantized_states,
                                      jnp.asarray(negatives), jnp.asarray(mask), 0.1)
    np.testing.assert_allclose(contrastive, expected.contrastive_loss, rtol=1e-5)
    diversity = diversity_loss(out.codevector_perplexity, model.config.num_codevectors)
    np.testing.assert_allclose(diversity * mask.sum(), expected.diversity_loss, rtol=1e-5)
    # The whole loss: HF's sum over masked frames, per masked frame, plus the feature penalty.
    batch = {"input_values": jnp.asarray(waveforms), "attention_mask": jnp.asarray(attention_mask),
             "mask_time_indices": jnp.asarray(mask),
             "sampled_negative_indices": jnp.asarray(negatives)}
    loss, metrics = wav2vec2_loss(model, batch, None)
    penalty = feature_penalty(out.conv_features)
    np.testing.assert_allclose((loss - 10.0 * penalty) * mask.sum(), expected.loss, rtol=1e-5)
    assert metrics["contrastive_loss"][1] == mask.sum()
    assert 0 < metrics["contrastive_accuracy"][0] <= mask.sum()


@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.parametrize("layout", ["base", "lv60"])
def test_hidden_states_match_hf_output_hidden_states(deterministic_torch, reference_folder,
                                                     layout, scan_layers):
    """`Wav2Vec2.hidden_states` against HF `Wav2Vec2Model(..., output_hidden_states=True)` (the
    model inside `Wav2Vec2ForPreTraining`) on a padded batch: every entry on the real frames,
    entry 0 with the encoder's LayerNorm for post-LN (BASE) and without for pre-LN (LV-60), the
    last before pre-LN's final LayerNorm, which only `last_hidden_state` has."""
    transformers = pytest.importorskip("transformers")
    torch = deterministic_torch
    reference = transformers.Wav2Vec2ForPreTraining.from_pretrained(
        reference_folder[layout]).eval()
    model = hf.load(reference_folder[layout], scan_layers=scan_layers)
    assert model.config.scan_layers == scan_layers
    waveforms, attention_mask = padded_waveforms(4)
    with torch.no_grad():
        expected = reference.wav2vec2(torch.tensor(waveforms),
                                      attention_mask=torch.tensor(attention_mask),
                                      output_hidden_states=True)
    hidden_states, frames = model.hidden_states(jnp.asarray(waveforms),
                                                jnp.asarray(attention_mask))
    num_frames = int(feature_lengths(model.config, NUM_SAMPLES))
    assert hidden_states.shape == (model.config.num_layers + 1, 3, num_frames, 32)
    assert len(expected.hidden_states) == len(hidden_states)
    real = np.asarray(reference._get_feature_vector_attention_mask(
        num_frames, torch.tensor(attention_mask)))
    np.testing.assert_array_equal(frames, real)
    assert not real.all()
    for i, (ours, theirs) in enumerate(zip(hidden_states, expected.hidden_states, strict=True)):
        np.testing.assert_allclose(np.asarray(ours)[real], theirs.numpy()[real], atol=1e-5,
                                   rtol=0, err_msg=f"hidden state {i}")
    last = model(jnp.asarray(waveforms), jnp.asarray(attention_mask)).last_hidden_state
    np.testing.assert_allclose(last, expected.last_hidden_state.numpy(), atol=1e-5, rtol=0)
    if layout == "lv60":
        last_entry = model.encoder.layer_norm(hidden_states[-1])
        assert np.abs(np.asarray(hidden_states[-1] - last)[real]).max() > 0.1
    else:
        last_entry = hidden_states[-1]
    np.testing.assert_allclose(np.asarray(last_entry)[real], np.asarray(last)[real], atol=1e-6,
                               rtol=0)


def test_training_quantiser_matches_hf_with_the_same_gumbel_noise(deterministic_torch,
                                                                   reference_folder,
                                                                   monkeypatch):
    """HF's training path (hard `gumbel_softmax`, perplexity of the soft probabilities over the
    masked frames) fed our Gumbel noise: same codevectors, perplexity and straight-through
    gradient with respect to the features."""
    transformers = pytest.importorskip("transformers")
    torch = deterministic_torch
    reference = transformers.Wav2Vec2ForPreTraining.from_pretrained(reference_folder["base"])
    quantizer = reference.quantizer.train()
    model = hf.load(reference_folder["base"])
    features = np.random.default_rng(0).standard_normal((2, 9, 16)).astype(np.float32)
    mask = np.zeros((2, 9), bool)
    mask[0, 2:7] = mask[1, :4] = True
    key, temperature = jax.random.key(5), 1.7
    noise = torch.tensor(np.asarray(jax.random.gumbel(key, (2, 9, 2, 8))).reshape(-1, 8))

    def gumbel_softmax(logits, tau, hard):
        soft = torch.softmax((logits + noise) / tau, dim=-1)
        one_hot = torch.zeros_like(soft).scatter_(-1, soft.argmax(-1, keepdim=True), 1.0)
        return one_hot - soft.detach() + soft

    monkeypatch.setattr(torch.nn.functional, "gumbel_softmax", gumbel_softmax)
    quantizer.temperature = temperature
    inputs = torch.tensor(features, requires_grad=True)
    expected, expected_perplexity = quantizer(inputs, mask_time_indices=torch.tensor(mask))
    weights = np.random.default_rng(1).standard_normal(expected.shape).astype(np.float32)
    (expected * torch.tensor(weights)).sum().backward()

    def weighted(x):
        quantized, perplexity = model.quantizer(x, jnp.asarray(mask), key, temperature)
        return jnp.sum(quantized * weights), (quantized, perplexity)

    gradient, (quantized, perplexity) = jax.grad(weighted, has_aux=True)(jnp.asarray(features))
    np.testing.assert_allclose(quantized, expected.detach().numpy(), atol=1e-6, rtol=0)
    np.testing.assert_allclose(perplexity, expected_perplexity.item(), rtol=1e-6)
    np.testing.assert_allclose(gradient, inputs.grad.numpy(), atol=1e-5, rtol=1e-5)
    assert np.abs(gradient).max() > 1e-3


def hf_projections(model, waveforms, mask):
    out = model(waveforms, attention_mask=mask)
    return {"projected_states": out.projected_states,
            "projected_quantized_states": out.projected_quantized_states}


def our_projections(model: Wav2Vec2, waveforms, mask):
    out = model(waveforms, mask)
    return {"projected_states": out.projected_states,
            "projected_quantized_states": out.projected_quantized_states}


@pytest.mark.usefixtures("deterministic_torch")
def test_round_trip_through_transformers(tmp_path):
    pytest.importorskip("transformers")
    ours = random_model(Wav2Vec2, TINY, 3)
    parity = Parity("Wav2Vec2ForPreTraining", hf_projections, our_projections)
    _, saved = parity.round_trip(ours, tmp_path / "hf", *padded_waveforms(1), **NO_DROPOUT)
    assert saved["model_type"] == "wav2vec2"
    # A checkpoint saved before torch's parametrisations (facebook/wav2vec2-base) names the
    # weight-normalised position convolution weight_g / weight_v.
    from safetensors.numpy import load_file, save_file

    state = load_file(tmp_path / "hf" / "model.safetensors")
    old_names = {name.replace("parametrizations.weight.original0", "weight_g")
                 .replace("parametrizations.weight.original1", "weight_v"): value
                 for name, value in state.items()}
    assert len(set(old_names) - set(state)) == 2
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(saved))
    save_file(old_names, tmp_path / "old" / "model.safetensors")
    assert_loads_back(ours, tmp_path / "old", **NO_DROPOUT)


def test_bad_configs():
    with pytest.raises(ValueError, match="one entry per"):
        Wav2Vec2Config(conv_channels=(16, 16), conv_kernel_sizes=(10,), conv_strides=(5,))
    with pytest.raises(ValueError, match="position_conv_groups"):
        dataclasses.replace(TINY, position_conv_groups=3)
    with pytest.raises(ValueError, match="conv_norm"):
        dataclasses.replace(TINY, conv_norm="batch")
    with pytest.raises(ValueError, match="mask_start_fraction"):
        MaskingSettings(mask_start_fraction=0.0)
    with pytest.raises(ValueError, match="gumbel_start_temperature"):
        Wav2Vec2LossSettings(gumbel_start_temperature=0.1)
    from pretext_jax.models.hf import conversion

    with pytest.raises(UserError, match="adapter"):
        conversion.converter_and_config({"model_type": "wav2vec2", "add_adapter": True},
                                        "folder", {})


def runs(row: np.ndarray) -> list[int]:
    """Lengths of the maximal runs of True in a bool row."""
    edges = np.diff(np.concatenate([[0], row.astype(int), [0]]))
    return list(np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1))


def test_span_masks_follow_hf_statistics():
    """Per-utterance masked fractions as HF `_compute_mask_indices` gives for the same lengths
    (p 0.065 of the frames start a span of 10, at least 2 spans; fairseq's sampler, which ours
    follows, is compared in tests/test_reference_samplers.py); spans lie within the utterance,
    runs are at least one span long; an utterance too short for its spans is unmasked."""
    torch = pytest.importorskip("torch")
    from transformers.models.wav2vec2.modeling_wav2vec2 import _compute_mask_indices

    lengths, num_frames, draws = np.array([200, 120, 35, 9]), 200, 400
    frames = torch.tensor(np.arange(num_frames)[None] < lengths[:, None])
    rng = np.random.default_rng(0)
    np.random.seed(0)
    ours = np.stack([span_mask(lengths, num_frames, MaskingSettings(), rng)
                     for _ in range(draws)])  # [draws, B, T]
    theirs = np.stack([_compute_mask_indices((4, num_frames), 0.65, 10, frames, min_masks=2)
                       for _ in range(draws)])
    real = np.arange(num_frames)[None, None] < lengths[None, :, None]
    assert not ours[~np.broadcast_to(real, ours.shape)].any()  # never beyond the utterance
    ours_fraction = ours.sum(-1).mean(0) / lengths
    theirs_fraction = (theirs & real).sum(-1).mean(0) / lengths
    np.testing.assert_allclose(ours_fraction, theirs_fraction, atol=0.02)
    assert 0.4 < ours_fraction[0] < 0.6  # about half the frames of a long utterance
    assert ours_fraction[3] == 0.0
    for draw in ours[:50]:
        for row in draw[:3]:
            assert min(runs(row)) >= 10
    # 2 spans need more than 12 frames: fairseq's start places are n - 10 when that exceeds
    # the span count
    assert not span_mask([12], 12, MaskingSettings(), rng).any()
    assert span_mask([13], 13, MaskingSettings(), rng).sum() in (11, 12)


def test_negatives_come_from_the_other_masked_frames_of_the_utterance():
    rng = np.random.default_rng(1)
    attention_mask = np.zeros((3, NUM_SAMPLES), np.int64)
    for row, length in enumerate((NUM_SAMPLES, 900, 520)):
        attention_mask[row, :length] = 1
    batch = mask_batch(TINY, attention_mask, MASKING, rng)
    mask, negatives = batch["mask_time_indices"], batch["sampled_negative_indices"]
    num_frames = int(feature_lengths(TINY, NUM_SAMPLES))
    assert mask.shape == (3, num_frames) and negatives.shape == (3, num_frames, NUM_NEGATIVES)
    assert negatives.dtype == np.int32
    lengths = feature_lengths(TINY, attention_mask.sum(-1))
    for row in range(3):
        masked = np.flatnonzero(mask[row])
        assert masked.max() < lengths[row]
        chosen = negatives[row, masked]  # [m, K]
        assert np.isin(chosen, masked).all()
        assert not (chosen == masked[:, None]).any()
        assert (negatives[row, ~mask[row]] == 0).all()
    # uniform over the m - 1 others: each appears about K / (m - 1) times per masked frame
    big = sample_negatives(np.ones((1, 11), bool), 20000, rng)[0]  # [11, 20000]
    counts = np.stack([np.bincount(row, minlength=11) for row in big]) / 20000
    np.testing.assert_allclose(counts[~np.eye(11, dtype=bool)], 0.1, atol=0.01)
    lone = sample_negatives(np.eye(1, 5, 2, dtype=bool), 4, rng)
    np.testing.assert_array_equal(lone[0, 2], [2, 2, 2, 2])  # masked out by the loss


def test_batch_groups_are_per_gpu_perplexity_penalty_and_layerdrop():
    """`groups` splits a batch into groups of consecutive rows, as fairseq's GPUs: each group's
    codebook perplexity and feature penalty are its own, the loss weighs them by the group's
    masked frames (fairseq's criterion scales them by the GPU's sample_size), and LayerDrop
    draws per group: two copies of one utterance in two groups come out different under some
    key, where one group (the negative control) treats them alike."""
    rng = np.random.default_rng(0)
    probs = jax.nn.softmax(jnp.asarray(rng.standard_normal((4, 7, 2, 8))), axis=-1)
    mask = jnp.asarray(rng.random((4, 7)) < 0.5)
    np.testing.assert_allclose(codebook_perplexity(probs, mask, 2), jnp.concatenate(
        [codebook_perplexity(probs[:2], mask[:2]), codebook_perplexity(probs[2:], mask[2:])]),
        rtol=1e-6)
    assert codebook_perplexity(probs, mask).shape == (1,)
    features = jnp.asarray(rng.standard_normal((4, 7, 3)))
    np.testing.assert_allclose(feature_penalty(features, 2), [jnp.mean(features[:2] ** 2),
                                                              jnp.mean(features[2:] ** 2)],
                               rtol=1e-6)

    model = Wav2Vec2(dataclasses.replace(TINY, layerdrop=0.5), rngs=nnx.Rngs(0))
    waveform = rng.standard_normal((1, NUM_SAMPLES)).astype(np.float32)
    twice = jnp.asarray(np.concatenate([waveform, waveform]))

    def difference(groups: int, seed: int) -> float:
        hidden = model(twice, None, None, jax.random.key(seed), groups=groups).last_hidden_state
        return float(jnp.abs(hidden[0] - hidden[1]).max())

    assert difference(1, 0) == 0.0 and difference(2, 0) > 1e-3

    frames = int(feature_lengths(TINY, NUM_SAMPLES))
    audio = jnp.asarray(rng.standard_normal((2, NUM_SAMPLES)).astype(np.float32))
    mask = np.zeros((2, frames), bool)
    mask[0, :30], mask[1, 5:25] = True, True  # 30 masked frames in the first group, 20 after
    batch = {"input_values": audio, "mask_time_indices": jnp.asarray(mask),
             "sampled_negative_indices": jnp.asarray(sample_negatives(mask, NUM_NEGATIVES, rng))}
    settings = Wav2Vec2LossSettings(batch_groups=2)
    key = jax.random.key(1)
    _, metrics = wav2vec2_loss(model, batch, key, objective=settings)
    out = model(audio, None, jnp.asarray(mask), key,
                gumbel_temperature=gumbel_temperature(0, settings),
                feature_gradient_scale=settings.feature_grad_mult, groups=2)
    shares = np.array([0.6, 0.4])
    np.testing.assert_allclose(metrics["diversity_loss"][0], np.sum(
        shares * diversity_loss(out.codevector_perplexity, TINY.num_codevectors)), rtol=1e-5)
    np.testing.assert_allclose(metrics["feature_penalty"][0], np.sum(
        shares * feature_penalty(out.conv_features, 2)), rtol=1e-5)
    np.testing.assert_allclose(metrics["codevector_perplexity"][0],
                               np.mean(out.codevector_perplexity), rtol=1e-6)


def test_feature_encoder_gradient_is_scaled():
    """feature_grad_mult 0.1 multiplies the gradient of every feature-encoder parameter by 0.1
    (loss terms through the features, the feature penalty included) and leaves the others."""
    model = random_model(
        Wav2Vec2, dataclasses.replace(TINY, hidden_dropout=0.1, layerdrop=0.2), 2)
    waveforms, attention_mask = padded_waveforms(2)
    batch = {"input_values": jnp.asarray(waveforms), "attention_mask": jnp.asarray(attention_mask),
             **{k: jnp.asarray(v) for k, v in mask_batch(TINY, attention_mask, MASKING,
                                                         np.random.default_rng(2)).items()}}

    def gradients(scale: float):
        settings = Wav2Vec2LossSettings(feature_grad_mult=scale)

        def loss(m):
            return wav2vec2_loss(m, batch, jax.random.key(0), objective=settings, step=10)[0]

        value, grads = nnx.value_and_grad(loss)(model)
        return value, dict(nnx.to_flat_state(grads))

    value, scaled = gradients(0.1)
    unscaled_value, unscaled = gradients(1.0)
    assert np.isfinite(value) and value == unscaled_value
    for path, grad in unscaled.items():
        factor = 0.1 if path[0] == "conv_layers" else 1.0
        np.testing.assert_allclose(scaled[path].get_value(), factor * grad.get_value(),
                                   rtol=1e-4, atol=1e-9, err_msg=str(path))
    assert np.abs(unscaled[("conv_layers", 0, "conv", "kernel")].get_value()).max() > 0


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (2, 1, 4)])
def test_position_conv_gradient_is_the_same_on_a_mixed_mesh(mesh_shape):
    """The grouped position convolution's gradient with the batch sharded over ('data', 'fsdp')
    and replicated over 'tensor' equals the single-device one. XLA's SPMD partitioner multiplied
    the kernel gradient of a `feature_group_count` convolution by the replication (x2, x4), so
    `PositionConv` convolves group by group."""
    with nnx.use_eager_sharding(False):
        conv = random_params(PositionConv(TINY, rngs=nnx.Rngs(0)), 0)
    graphdef, params = nnx.split(conv)
    x = jax.random.normal(jax.random.key(1), (8, 20, TINY.hidden_size))

    def loss(params, x):
        return jnp.sum(jnp.sin(nnx.merge(graphdef, params)(x)))

    grad = jax.jit(jax.grad(loss))
    expected = grad(params, x)
    mesh = make_mesh(*mesh_shape)
    sharded = grad(jax.device_put(params, state_shardings(params, mesh)),
                   jax.device_put(x, batch_sharding(mesh)))
    for (path, want), got in zip(nnx.to_flat_state(expected), jax.tree.leaves(sharded),
                                 strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want.get_value()), rtol=1e-5,
                                   atol=1e-5, err_msg=str(path))


def test_gumbel_temperature_schedule():
    settings = Wav2Vec2LossSettings()
    for step in (0, 1, 1000, 100_000, 277_000):
        assert float(gumbel_temperature(step, settings)) == pytest.approx(
            max(2.0 * 0.999995 ** step, 0.5), rel=1e-5)
    assert float(gumbel_temperature(277_300, settings)) == 0.5  # floor from ~277,259 on
    assert float(gumbel_temperature(10 ** 7, settings)) == 0.5
    assert math.log(4) / -math.log(0.999995) == pytest.approx(277_258, abs=1)
    steps = jnp.array([0, 50_000])
    np.testing.assert_allclose(jax.jit(gumbel_temperature, static_argnums=1)(steps, settings),
                               [2.0, 2.0 * 0.999995 ** 50_000], rtol=1e-5)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_position_conv_init_std_is_fairseqs(dropout):
    """fairseq's wav2vec2.py draws the position convolution's weight from
    normal(0, sqrt(4 (1 - dropout) / (kernel * hidden))) before weight normalisation: the
    sample std of a wide draw is that value (5 % apart for dropout 0 vs 0.1; the draw's own
    error is ~0.1 %)."""
    config = dataclasses.replace(TINY, hidden_size=256, num_heads=4, position_conv_kernel=128,
                                 position_conv_groups=16, hidden_dropout=dropout)
    with nnx.use_eager_sharding(False):
        weight = np.asarray(PositionConv(config, rngs=nnx.Rngs(0)).weight_v[...])
    expected = np.sqrt(4 * (1 - dropout) / (128 * 256))
    assert weight.std() == pytest.approx(expected, rel=0.005)
