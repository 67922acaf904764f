"""wav2vec (models/wav2vec.py, objectives/wav2vec.py). HF has no wav2vec 1.0 class, so the
oracles are re-statements written here from fairseq `fairseq/models/wav2vec/wav2vec.py` and
`fairseq/criterions/wav2vec_criterion.py` (re-stated, not copied): the encoder, the context
network and the step projections in numpy, in fairseq's [B, C, T] layout, with the same
weights; the loss as `Wav2VecPredictionsModel.forward` builds its flat logits and labels and
the criterion sums binary cross-entropy over them, in torch, whose autograd gives the
reference gradient. Each has a negative control. The tiny preset trains in process on wav
files written here, with the speech probes."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from resilience_utils import (
    GRADIENT_STEP,
    abort_and_resume,
    assert_same_step_on_every_mesh,
    assert_same_training,
    mesh_overrides,
    run_in_process,
)

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.audio import AudioExampleConfig
from pretext_jax.models.wav2vec import Wav2Vec, Wav2VecConfig, frame_lengths
from pretext_jax.objectives.wav2vec import (
    binary_contrastive,
    build_wav2vec,
    check_windows,
    sample_negatives,
)
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.loading import load_model
from pretext_jax.pretrain.trainer import Trainer

# Small enough for numpy: 3 encoder layers (8 channels, the last keeps its width, so the
# encoder's skip connection applies), a context network that widens (a residual projection)
# and keeps its width, K = 3.
TINY = Wav2VecConfig(conv_channels=(8, 8, 8), conv_kernel_sizes=(10, 4, 3),
                     conv_strides=(5, 2, 1), aggregator_channels=(6, 6),
                     aggregator_kernel_sizes=(2, 3), skip_connections_feat=True,
                     prediction_steps=3)
RATE = 16000
WINDOW = 3200  # wav2vec_tiny's examples.max_samples: 18 frames


# --- The networks against numpy ----------------------------------------------------------------

def np_conv1d(x: np.ndarray, weight: np.ndarray, stride: int) -> np.ndarray:
    """torch's Conv1d without padding: x [B, C_in, T], weight [C_out, C_in, k]."""
    kernel = weight.shape[-1]
    steps = (x.shape[-1] - kernel) // stride + 1
    windows = np.stack([x[..., t * stride:t * stride + kernel] for t in range(steps)], axis=2)
    return np.einsum("bitk,oik->bot", windows, weight)


def np_group_norm(x: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """GroupNorm(1, C): one mean and variance per utterance over [C, T], eps 1e-5."""
    mean = x.mean(axis=(1, 2), keepdims=True)
    variance = x.var(axis=(1, 2), keepdims=True)
    return (x - mean) / np.sqrt(variance + 1e-5) * scale[None, :, None] + bias[None, :, None]


def torch_weight(conv) -> np.ndarray:
    """An nnx.Conv kernel [k, C_in, C_out] as torch's Conv1d weight [C_out, C_in, k]."""
    return np.asarray(conv.kernel[...], np.float64).transpose(2, 1, 0)


def numpy_wav2vec(model: Wav2Vec, audio: np.ndarray, zero_pad: bool = False
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """fairseq's Wav2VecModel.forward up to the projections, in [B, C, T]: returns z [B, C, T],
    c [B, A, T] and project_to_steps(c) [B, C, T, K]. `zero_pad` swaps the context network's
    replication padding for zeros (the negative control)."""
    config = model.config
    scale = math.sqrt(config.residual_scale)
    x = audio.astype(np.float64)[:, None, :]
    for layer, stride in zip(model.conv_layers, config.conv_strides, strict=True):
        residual = x
        x = np_conv1d(x, torch_weight(layer.conv), stride)
        x = np.maximum(np_group_norm(x, np.asarray(layer.norm_scale[...]),
                                     np.asarray(layer.norm_bias[...])), 0.0)
        if config.skip_connections_feat and x.shape[1] == residual.shape[1]:
            residual = residual[..., ::residual.shape[2] // x.shape[2]][..., :x.shape[2]]
            x = (x + residual) * scale
    z = np.log(np.abs(x) + 1.0)
    x = z
    for layer, projection, kernel in zip(model.aggregator_layers, model.residual_projections,
                                         config.aggregator_kernel_sizes, strict=True):
        residual = x
        half = kernel // 2
        left = half + (half - 1 if kernel % 2 == 0 else half)  # fairseq's ka + kb
        padded = np.pad(x, ((0, 0), (0, 0), (left, 0)), mode="constant" if zero_pad else "edge")
        x = np_conv1d(padded, torch_weight(layer.conv), 1)
        x = x + np.asarray(layer.conv.bias[...])[None, :, None]
        x = np.maximum(np_group_norm(x, np.asarray(layer.norm_scale[...]),
                                     np.asarray(layer.norm_bias[...])), 0.0)
        if projection is not None:  # Conv1d(in, out, 1, bias=False)
            residual = np.einsum("bit,io->bot", residual, np.asarray(projection.kernel[...]))
        x = (x + residual) * scale
    # ConvTranspose2d(A, C, (1, K)) on c [B, A, T, 1]: weight [A, C, 1, K], one bias [C]
    weight = np.asarray(model.projection_kernel[...], np.float64).transpose(1, 2, 0)[:, :, None]
    steps = np.einsum("bat,acs->bcts", x, weight[:, :, 0])
    return z, x, steps + np.asarray(model.projection_bias[...])[None, :, None, None]


def perturbed(model: Wav2Vec, seed: int) -> Wav2Vec:
    """`model` with its constant-initialised parameters (norm scales and biases, conv and
    projection biases) set to random values, so the comparison sees every parameter."""
    rng = np.random.default_rng(seed)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            value = np.asarray(node[...])
            if np.all(value == value.flat[0]):
                node[...] = jnp.asarray(rng.normal(0.0, 0.5, value.shape), jnp.float32)
    return model


@pytest.mark.parametrize("zero_pad", [False, True])
def test_networks_equal_a_numpy_restatement_of_fairseq(zero_pad):
    padding = "zeros" if zero_pad else "replicate"
    model = perturbed(build_wav2vec(dataclasses.replace(TINY, aggregator_padding=padding), 0), 1)
    audio = np.random.default_rng(2).normal(size=(2, 400)).astype(np.float32)
    out = model(jnp.asarray(audio))
    z, context, steps = numpy_wav2vec(model, audio, zero_pad)
    assert out.features.shape == (2, int(frame_lengths(TINY, 400)), 8)
    np.testing.assert_allclose(np.asarray(out.features), z.transpose(0, 2, 1), atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.context), context.transpose(0, 2, 1), atol=1e-5)
    np.testing.assert_allclose(np.asarray(model.predictions(out.context)),
                               steps.transpose(0, 2, 3, 1), atol=1e-5)
    # negative control: the other causal padding gives other context vectors
    _, wrong, _ = numpy_wav2vec(model, audio, not zero_pad)
    assert np.abs(np.asarray(out.context) - wrong.transpose(0, 2, 1)).max() > 1e-3


def test_offset_auto_is_fairseqs_receptive_field_rule():
    """fairseq's "auto": ceil(receptive field / stride) over the encoder, 465 / 160 -> 3 for
    the paper's (1x1 layers change neither); an explicit offset wins."""
    assert Wav2VecConfig().step_offset == 3
    assert Wav2VecConfig(conv_kernel_sizes=(10, 8, 4, 4, 4), conv_strides=(5, 4, 2, 2, 2),
                         conv_channels=(512,) * 5).step_offset == 3
    assert TINY.step_offset == math.ceil((10 + 3 * 5 + 2 * 10) / 10)  # 45 / 10 -> 5
    assert dataclasses.replace(TINY, offset=1).step_offset == 1


def test_padding_never_changes_real_frames():
    """A right-padded row's real frames (and the context over them) equal the utterance's
    alone: the group norms read real frames only; without that they would not."""
    model = build_wav2vec(TINY, 1)
    audio = np.random.default_rng(1).normal(size=(1, 300)).astype(np.float32)
    padded = np.concatenate([audio, np.zeros((1, 200), np.float32)], axis=1)
    mask = (np.arange(500) < 300)[None].astype(np.int32)
    alone, batched = model(jnp.asarray(audio)), model(jnp.asarray(padded), jnp.asarray(mask))
    real = int(frame_lengths(TINY, 300))
    assert np.asarray(batched.frames).sum() == real == alone.features.shape[1]
    np.testing.assert_allclose(np.asarray(batched.features[:, :real]),
                               np.asarray(alone.features), atol=1e-5)
    np.testing.assert_allclose(np.asarray(batched.context[:, :real]),
                               np.asarray(alone.context), atol=1e-5)
    unmasked = model(jnp.asarray(padded))  # negative control: padding in the statistics
    assert np.abs(np.asarray(unmasked.features[:, :real] - alone.features)).max() > 1e-3


def test_window_check():
    check_windows(TINY, AudioExampleConfig(max_samples=400))
    with pytest.raises(UserError, match="raise examples.max_samples to at least 70"):
        check_windows(TINY, AudioExampleConfig(max_samples=60))


# --- The loss and its gradient against torch -------------------------------------------------

def torch_fairseq_loss(torch, context, z, weight, bias, negatives, offset: int,
                       infonce: bool = False, balanced: bool = False):
    """Wav2VecPredictionsModel.forward and the wav2vec criterion re-stated in torch:
    context [B, A, T], z [B, C, T], weight [A, C, 1, K] and bias [C] (ConvTranspose2d),
    `negatives` [B, N * T] frame indices within each row, t-major as fairseq's `neg_idxs`."""
    bsz, fsz, tsz = z.shape
    n = negatives.shape[1] // tsz
    x = torch.nn.functional.conv_transpose2d(context.unsqueeze(-1), weight, bias)  # BxCxTxK
    flat = z.transpose(0, 1).reshape(fsz, -1)  # C x (B T)
    index = negatives + torch.arange(bsz)[:, None] * tsz
    negs = flat[:, index.reshape(-1)].view(fsz, bsz, n, tsz).permute(2, 1, 0, 3)  # NxBxCxT
    targets = torch.cat([z.unsqueeze(0), negs], dim=0)
    copies = targets.shape[0]
    steps = min(x.shape[-1], tsz - offset)
    predictions, labels, weights = [], [], []
    for i in range(steps):
        shift = i + offset
        if infonce:
            predictions.append(torch.einsum("bct,nbct->tbn", x[..., :-shift, i],
                                            targets[..., shift:]).reshape(-1, copies))
        else:
            logits = torch.einsum("bct,nbct->nbt", x[..., :-shift, i], targets[..., shift:])
            positives = logits[0].numel()
            predictions.append(logits.flatten())
            label = torch.zeros(logits.numel())
            label[:positives] = 1.0
            labels.append(label)
            weight_of = torch.full((logits.numel(),), 1.0 / n if balanced else 1.0)
            weight_of[:positives] = 1.0
            weights.append(weight_of)
    if infonce:
        logits = torch.cat(predictions)
        target = torch.zeros(len(logits), dtype=torch.long)
        return torch.nn.functional.cross_entropy(logits, target, reduction="sum") / len(logits)
    labels = torch.cat(labels)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(
        torch.cat(predictions), labels, torch.cat(weights), reduction="sum")
    return loss / labels.sum()


def ours_loss(context, z, kernel, bias, negatives, offset, **settings):
    predictions = jnp.einsum("bta,kac->btkc", context, kernel) + bias
    frames = jnp.ones(z.shape[:2], bool)
    sums, counts, _ = binary_contrastive(z, predictions, frames, negatives, offset, **settings)
    return jnp.sum(sums) / jnp.sum(counts)


@pytest.mark.parametrize("variant", ["binary", "balanced", "infonce"])
def test_loss_and_gradient_equal_fairseqs_in_torch(variant):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    batch, frames, channels, width, steps, n, offset = 2, 9, 4, 5, 3, 4, 2
    context = rng.normal(size=(batch, frames, width)).astype(np.float32)
    z = rng.normal(size=(batch, frames, channels)).astype(np.float32)
    kernel = rng.normal(0, 0.5, size=(steps, width, channels)).astype(np.float32)
    bias = rng.normal(size=(channels,)).astype(np.float32)
    negatives = np.asarray(sample_negatives(jax.random.key(0), jnp.ones((batch, frames), bool),
                                            n))  # [B, T, N]
    settings = {"balanced_classes": variant == "balanced", "infonce": variant == "infonce"}
    loss, grads = jax.value_and_grad(ours_loss, argnums=(0, 1, 2, 3))(
        jnp.asarray(context), jnp.asarray(z), jnp.asarray(kernel), jnp.asarray(bias),
        jnp.asarray(negatives), offset, **settings)

    def reference(variant: str, negative_index: np.ndarray):
        tensors = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in
                   (context.transpose(0, 2, 1), z.transpose(0, 2, 1),
                    kernel.transpose(1, 2, 0)[:, :, None], bias)]
        index = torch.tensor(negative_index.transpose(0, 2, 1).reshape(batch, -1))
        value = torch_fairseq_loss(torch, *tensors, index, offset,
                                   infonce=variant == "infonce", balanced=variant == "balanced")
        value.backward()
        return float(value.detach()), [t.grad.numpy() for t in tensors]

    expected, expected_grads = reference(variant, negatives)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    ours_grads = [np.asarray(grads[0]).transpose(0, 2, 1), np.asarray(grads[1]).transpose(0, 2, 1),
                  np.asarray(grads[2]).transpose(1, 2, 0)[:, :, None], np.asarray(grads[3])]
    for ours, theirs in zip(ours_grads, expected_grads, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
    # negative controls: the other loss, and negatives drawn from the other utterance
    other, _ = reference("infonce" if variant != "infonce" else "binary", negatives)
    assert abs(other - float(loss)) > 1e-2
    swapped, _ = reference(variant, negatives[::-1])  # row 0 reads row 1's frames, and so on
    crossed = float(ours_loss(jnp.asarray(context), jnp.asarray(z), jnp.asarray(kernel),
                              jnp.asarray(bias), jnp.asarray(negatives[::-1]), offset,
                              **settings))
    assert abs(swapped - float(loss)) > 1e-2 and crossed == pytest.approx(swapped, rel=1e-5)


def test_padding_is_never_scored():
    """Frames past a row's real ones are neither targets nor negatives: the loss of a padded
    batch equals the sum over its rows' losses taken alone (same negatives)."""
    rng = np.random.default_rng(3)
    z = jnp.asarray(rng.normal(size=(2, 8, 3)), jnp.float32)
    predictions = jnp.asarray(rng.normal(size=(2, 8, 2, 3)), jnp.float32)
    frames = jnp.arange(8)[None, :] < jnp.asarray([[8], [5]])
    negatives = sample_negatives(jax.random.key(1), frames, 6)
    assert int(jnp.max(negatives[1, :5])) < 5  # draws stay in the real frames
    sums, counts, _ = binary_contrastive(z, predictions, frames, negatives, 1)
    alone = binary_contrastive(z[1:, :5], predictions[1:, :5], frames[1:, :5],
                               negatives[1:, :5], 1)
    first = binary_contrastive(z[:1], predictions[:1], frames[:1], negatives[:1], 1)
    np.testing.assert_allclose(np.asarray(sums), np.asarray(first[0] + alone[0]), rtol=1e-6)
    assert np.asarray(counts).tolist() == [7 + 4, 6 + 3]


# --- The tiny preset through the trainer -------------------------------------------------------

@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> dict[str, str | float]:
    """32 tones named {digit}_{speaker}_{index}.wav (FSDD's names; the digit sets the pitch),
    0.15-0.2 s each, with the data settings that read them and probe the digit."""
    soundfile = pytest.importorskip("soundfile")
    pytest.importorskip("soxr")
    root = tmp_path_factory.mktemp("digits")
    rng = np.random.default_rng(0)
    for i in range(32):
        digit, speaker = i % 3, ("ann", "bob")[i // 3 % 2]
        times = np.arange(int(rng.integers(2400, WINDOW + 1))) / RATE
        tone = np.sin(2 * np.pi * (300 + 500 * digit) * times) + 0.1 * rng.normal(size=len(times))
        soundfile.write(str(root / f"{digit}_{speaker}_{i}.wav"),
                        (0.4 * tone).astype(np.float32), RATE, subtype="PCM_16")
    return {"data.source": str(root), "data.cache_dir": str(root / "cache"),
            "examples.label_pattern": r"(?P<digit>\d)_(?P<speaker>[a-z]+)_(?P<index>\d+)",
            "examples.held_out_rule": "index<8", "examples.probe_labels": "digit"}


def test_tiny_preset_trains_with_the_probe(tmp_path, digits):
    """wav2vec_tiny through the Trainer: the loss falls from its start, the held-out metrics
    and the digit probe come out, and the workdir loads back as the model."""
    values = {**digits, "train.steps": 30, "train.log_every": 5, "train.eval_every": 30,
              "train.checkpoint_every": 30, "train.eval_batches": 1, "train.progress": False}
    trainer = Trainer(make_config("wav2vec_tiny", values), tmp_path / "w")
    summary = trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text()
            .splitlines()]
    losses = [row["loss"] for row in rows if row.get("split") == "train"]
    assert np.isfinite(losses).all() and len(losses) == 6
    assert losses[-1] < 0.8 * losses[0], losses
    assert 0.0 <= summary["eval"]["accuracy"] <= 1.0
    assert 0.0 <= summary["eval"]["probe_digit_accuracy"] <= 1.0
    restored = load_model(tmp_path / "w")
    assert isinstance(restored, Wav2Vec) and restored.config == trainer.config.model



SHORT = {"train.log_every": 1, "train.eval_every": 1000, "train.eval_batches": 1,
         "train.progress": False}


def test_same_step_on_every_mesh(tmp_path, digits):
    """One gradient step (same-utterance negatives drawn per row) gives the same loss and
    parameters on one device and on the (2, 2, 2) mesh, and moves the parameters."""
    def trainer_at(workdir, mesh, devices):
        values = {**digits, **SHORT, **GRADIENT_STEP, **mesh_overrides(mesh),
                  "train.steps": 1, "train.batch_size": 8}
        return Trainer(make_config("wav2vec_tiny", values), workdir, devices=devices)

    assert_same_step_on_every_mesh(trainer_at, tmp_path)


def test_killed_run_resumes_bit_for_bit(tmp_path, digits):
    """A run stopped in place of step 5 and resumed from its step-3 checkpoint reads the same
    batches and ends with the same parameters as a straight run."""
    overrides = {**digits, **SHORT, "train.steps": 6, "train.checkpoint_every": 3,
                 "train.batch_size": 8}
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process("wav2vec_tiny", overrides, *reference)
    ours = abort_and_resume("wav2vec_tiny", overrides, tmp_path, step=5)
    assert len(assert_same_training("wav2vec_tiny", overrides, ours, reference)) > 6
