"""CPC on raw audio (models/cpc.py, objectives/cpc.py). No reference implementation is an oracle
here: the GRU is checked against a step-by-step numpy loop with the same weights, the encoder's
frame count against the convolution length formula, InfoNCE and its gradient against numpy
(a hand-derived gradient) with the same negatives, the negatives' sampling rules directly; on
wav files written here the tiny preset trains through the Trainer on the 8-device mesh, a
sharded step equals the single-device one, a killed run resumes bit for bit, and the CLI runs
the preset."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from resilience_utils import GRADIENT_STEP, abort_and_resume, assert_same_training, run_in_process

from pretext_jax import run
from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.audio import AudioExampleConfig
from pretext_jax.models.cpc import CPC, GRU, CPCConfig, frame_lengths, frame_mask
from pretext_jax.objectives.cpc import build_cpc, check_windows, info_nce, sample_negatives
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.loading import load_model
from pretext_jax.pretrain.trainer import Trainer

TINY = CPCConfig(conv_channels=8, context_size=6, prediction_steps=3)
RATE = 16000
WINDOW = 3200  # cpc_tiny's examples.max_samples: 20 frames
# Short cpc_tiny runs: a train row every step, checkpoints every 3 steps, no eval on the way.
SHORT = {"train.steps": 8, "train.log_every": 1, "train.eval_every": 1000,
         "train.eval_batches": 1, "train.checkpoint_every": 3, "train.progress": False}


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def test_gru_equals_a_step_by_step_numpy_loop():
    with nnx.use_eager_sharding(False):
        gru = GRU(5, 7, jnp.float32, rngs=nnx.Rngs(0))
    x = np.random.default_rng(0).normal(size=(2, 6, 5)).astype(np.float32)
    w_x, w_h = np.asarray(gru.input.kernel[...]), np.asarray(gru.hidden.kernel[...])
    b_x, b_h = np.asarray(gru.input.bias[...]), np.asarray(gru.hidden.bias[...])
    h = np.zeros((2, 7))
    expected = []
    for t in range(6):
        gates_x, gates_h = x[:, t] @ w_x + b_x, h @ w_h + b_h
        reset = sigmoid(gates_x[:, :7] + gates_h[:, :7])
        update = sigmoid(gates_x[:, 7:14] + gates_h[:, 7:14])
        new = np.tanh(gates_x[:, 14:] + reset * gates_h[:, 14:])
        h = (1 - update) * new + update * h
        expected.append(h)
    np.testing.assert_allclose(np.asarray(gru(jnp.asarray(x))), np.stack(expected, axis=1),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("paddings", [(3, 2, 1, 1, 1), (0, 0, 0, 0, 0)])
def test_encoder_frame_count_is_the_length_formula(paddings):
    config = CPCConfig(conv_channels=4, context_size=4, conv_paddings=paddings)
    model = build_cpc(config, 0)
    for length in (400, 1600, 1759, 3200, 20480):
        frames = model.encode(jnp.zeros((1, length))).shape[1]
        assert frames == frame_lengths(config, length), length
        if paddings == (3, 2, 1, 1, 1) and length % 160 == 0:
            assert frames == length // 160  # one frame per 10 ms at 16 kHz
    assert frame_lengths(config, 20480) == (128 if paddings[0] else 126)
    assert config.samples_per_frame == 160


def test_padding_never_changes_real_frames():
    """The frames `frame_mask` marks real in a right-padded row equal those of the utterance
    alone: 5 of its 6 (the last one's inner convolutions read the padding's activations, not
    their own zeros); the GRU is causal, so the contexts agree too."""
    model = build_cpc(dataclasses.replace(TINY, conv_norm="layer"), 1)
    audio = np.random.default_rng(1).normal(size=(1, 1000)).astype(np.float32)
    padded = np.concatenate([audio, np.zeros((1, 600), np.float32)], axis=1)
    mask = np.concatenate([np.ones((1, 1000), np.int32), np.zeros((1, 600), np.int32)], axis=1)
    alone, batched = model(jnp.asarray(audio)), model(jnp.asarray(padded), jnp.asarray(mask))
    real = int(frame_lengths(TINY, 1000, padded_after=True))
    assert np.asarray(batched.frames).sum() == real == 5 and alone.features.shape[1] == 6
    np.testing.assert_allclose(np.asarray(batched.features[:, :real]),
                               np.asarray(alone.features[:, :real]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(batched.context[:, :real]),
                               np.asarray(alone.context[:, :real]), rtol=1e-5, atol=1e-6)


def frames_of(lengths: list[int], num_frames: int) -> jnp.ndarray:
    return jnp.arange(num_frames)[None, :] < jnp.asarray(lengths)[:, None]


@pytest.mark.parametrize("pool_sequences", [0, 2])
def test_negatives_are_real_frames_of_the_pool_but_never_the_positive(pool_sequences):
    """Rows of 7, 4, 1 and 5 real frames of 7: each target's draws cover every other real frame
    of its pool (the whole batch, or rows {0, 1} and {2, 3}), own sequence included, and
    nothing else; the positive is never drawn, and draws are uniform."""
    lengths = [7, 4, 1, 5]
    frames = frames_of(lengths, 7)
    negatives = np.asarray(sample_negatives(jax.random.key(3), frames, 600, pool_sequences))
    own = np.arange(28).reshape(4, 7)
    real = own[np.asarray(frames)]
    for b, length in enumerate(lengths):
        pool = real if not pool_sequences else real[real // 7 // 2 == b // 2]
        for u in range(length):
            drawn = negatives[b, u]
            assert not np.any(drawn == own[b, u]), (b, u)
            assert set(drawn.tolist()) == set(pool.tolist()) - {own[b, u]}, (b, u)
    counts = np.bincount(negatives[0, 0], minlength=28)[real]
    others = (16 if not pool_sequences else 10)  # real frames in the pool but the target
    assert counts[0] == 0 and counts[1:others + 1].min() > 600 / others / 2


def numpy_info_nce(z: np.ndarray, context: np.ndarray, kernel: np.ndarray, lengths: list[int],
                   negatives: np.ndarray) -> tuple[float, np.ndarray, np.ndarray, float]:
    """Eq. 4 averaged over t for each k, then over k, with its gradient w.r.t. the W_k and the
    context by hand: d loss / d logits = (softmax - onehot(positive)) / (count_k K); the
    logits are candidate . (W_k c_t)."""
    batch_size, num_frames, _ = z.shape
    num_steps = kernel.shape[0]
    flat = z.reshape(batch_size * num_frames, -1)
    terms: dict[int, list[tuple[int, int, float, np.ndarray, np.ndarray]]] = {}
    correct = 0
    for k in range(1, num_steps + 1):
        terms[k] = []
        for b in range(batch_size):
            for t in range(lengths[b] - k):
                prediction = kernel[k - 1].T @ context[b, t]  # W_k c_t, [C]
                candidates = np.concatenate([z[b, t + k][None], flat[negatives[b, t + k]]])
                logits = candidates @ prediction
                log_sum = np.log(np.sum(np.exp(logits - logits.max()))) + logits.max()
                softmax = np.exp(logits - log_sum)
                softmax[0] -= 1.0
                terms[k].append((b, t, log_sum - logits[0], softmax, candidates))
                correct += logits[0] > logits[1:].max()
    loss = np.mean([np.mean([term[2] for term in terms[k]]) for k in terms])
    kernel_grad, context_grad = np.zeros_like(kernel), np.zeros_like(context)
    for k, items in terms.items():
        for b, t, _, dlogits, candidates in items:
            dprediction = candidates.T @ dlogits / (len(items) * num_steps)  # [C]
            kernel_grad[k - 1] += np.outer(context[b, t], dprediction)
            context_grad[b, t] += kernel[k - 1] @ dprediction
    total = sum(len(items) for items in terms.values())
    return float(loss), kernel_grad, context_grad, correct / total


def test_info_nce_and_its_gradient_equal_numpy():
    rng = np.random.default_rng(0)
    lengths = [6, 4]
    z = rng.normal(size=(2, 6, 3))
    context = rng.normal(size=(2, 6, 4))
    kernel = rng.normal(size=(3, 4, 3))
    frames = frames_of(lengths, 6)
    negatives = sample_negatives(jax.random.key(0), frames, 5)

    def loss_of(kernel: jax.Array, context: jax.Array) -> tuple[jax.Array, jax.Array]:
        predictions = jnp.einsum("bth,khc->btkc", context, kernel)
        sums, counts, correct = info_nce(jnp.asarray(z, jnp.float32), predictions, frames,
                                         negatives)
        return jnp.mean(sums / counts), jnp.sum(correct) / jnp.sum(counts)

    (loss, accuracy), grads = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)(
        jnp.asarray(kernel, jnp.float32), jnp.asarray(context, jnp.float32))
    expected, kernel_grad, context_grad, expected_accuracy = numpy_info_nce(
        z, context, kernel, lengths, np.asarray(negatives))
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    np.testing.assert_allclose(float(accuracy), expected_accuracy)
    np.testing.assert_allclose(np.asarray(grads[0]), kernel_grad, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grads[1]), context_grad, rtol=1e-4, atol=1e-6)
    # padding frames of the second row (t >= 4) get no gradient
    assert not np.asarray(grads[1])[1, 3:].any()


def test_frame_mask_and_window_check():
    mask = jnp.asarray(np.arange(3200)[None, :] < np.asarray([[3200], [1000]]), jnp.int32)
    assert np.asarray(frame_mask(TINY, mask, 20)).sum(1).tolist() == [20, 5]
    valid = dataclasses.replace(TINY, conv_paddings=(0,) * 5)  # valid convolutions: no loss
    assert frame_lengths(valid, 1000, padded_after=True) == frame_lengths(valid, 1000) == 4
    check_windows(TINY, AudioExampleConfig(max_samples=640))  # 4 frames > K = 3
    with pytest.raises(UserError, match="raise examples.max_samples to at least 640"):
        check_windows(TINY, AudioExampleConfig(max_samples=480))


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory) -> dict[str, str | float]:
    """24 tones sweeping in frequency, 0.15-0.2 s each (at most one window, so a batch holds
    whole utterances, some padded), in a folder; the data settings that read it, 16 of them
    for training, with a record cache the module's runs share."""
    soundfile = pytest.importorskip("soundfile")
    pytest.importorskip("soxr")
    root = tmp_path_factory.mktemp("sweeps")
    rng = np.random.default_rng(0)
    for i in range(24):
        times = np.arange(int(rng.integers(2400, WINDOW + 1))) / RATE
        start, end = rng.uniform(200, 2000, 2)
        phase = 2 * np.pi * (start * times + (end - start) * times ** 2 / (2 * times[-1]))
        soundfile.write(str(root / f"{i}.wav"), (0.5 * np.sin(phase)).astype(np.float32), RATE,
                        subtype="PCM_16")
    return {"data.source": str(root), "data.cache_dir": str(root / "cache"),
            "data.held_out_fraction": 1 / 3}


def tiny_trainer(workdir: Path, sweeps: dict, mesh: tuple[int, int, int] = (-1, 1, 1),
                 devices: list | None = None, **overrides) -> Trainer:
    """A cpc_tiny Trainer on `sweeps` with the mesh (data, fsdp, tensor) of `devices`."""
    values = {**SHORT, **sweeps, "mesh.data": mesh[0], "mesh.fsdp": mesh[1],
              "mesh.tensor": mesh[2], **overrides}
    return Trainer(make_config("cpc_tiny", values), workdir, devices=devices)


def metric_rows(workdir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_tiny_preset_trains_on_the_mesh(tmp_path, sweeps):
    """cpc_tiny through the Trainer on 8 devices: the 16 training utterances fit a window, so
    every step sees the same 16 windows; the loss stays finite and falls from its start near
    log(N + 1); the workdir loads back as the model."""
    trainer = tiny_trainer(tmp_path / "w", sweeps, **{
        "train.steps": 30, "train.log_every": 5, "train.eval_every": 30,
        "train.checkpoint_every": 30, "train.eval_batches": 2})
    summary = trainer.run()
    lines = metric_rows(tmp_path / "w")
    losses = [row["loss"] for row in lines if row.get("split") == "train"]
    assert np.isfinite(losses).all() and len(losses) == 6
    assert losses[0] == pytest.approx(np.log(17), abs=0.3)  # N = 16 negatives
    assert losses[-1] < losses[0] - 0.3 and losses[-1] < min(losses[:-1]), losses
    assert np.isfinite(summary["eval"]["loss"]) and 0.0 <= summary["eval"]["accuracy"] <= 1.0
    restored = load_model(tmp_path / "w")
    assert isinstance(restored, CPC) and restored.config == trainer.config.model
    trained = jax.device_get(summary["state"].params["prediction_kernel"].get_value())
    np.testing.assert_array_equal(np.asarray(restored.prediction_kernel[...]), trained)


def flat_tree(tree: object) -> dict[str, np.ndarray]:
    """The leaves of a (device) pytree as numpy arrays, by path."""
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))}


@pytest.mark.parametrize("pool_sequences", [0, 8])
def test_same_step_on_every_mesh(tmp_path, sweeps, pool_sequences):
    """One step (random negatives on, drawn over the global batch or over pools of 8 rows that
    span devices) gives the same loss and parameters, hence gradients, on one device and on
    meshes of 8; the batch has padded rows, and the step moves every parameter tensor."""
    layouts = {"single": ((1, 1, 1), jax.devices()[:1]), "dp": ((8, 1, 1), None),
               "mixed": ((2, 2, 2), None)}
    results, batch, initial = {}, None, None
    for name, (mesh, devices) in layouts.items():
        trainer = tiny_trainer(tmp_path / name, sweeps, mesh=mesh, devices=devices,
                               **GRADIENT_STEP, **{"objective.pool_sequences": pool_sequences})
        batch = next(trainer.data_iterator()) if batch is None else batch
        state = trainer.init_state()
        initial = flat_tree(state.params) if initial is None else initial
        state, metrics = trainer.train_step(state, batch)
        results[name] = float(metrics["loss"][0]), flat_tree(state.params)
    assert (batch["attention_mask"].sum(1) < WINDOW).any()
    loss0, params0 = results["single"]
    assert loss0 == pytest.approx(np.log(17), abs=0.5)  # N = 16 negatives
    assert params0.keys() == initial.keys()
    for key, value in params0.items():
        assert np.abs(value - initial[key]).max() > 1e-3, key
    for name, (loss, params) in results.items():
        assert loss == pytest.approx(loss0, rel=1e-6, abs=1e-5), name
        assert params.keys() == params0.keys()
        for key, value in params0.items():
            np.testing.assert_allclose(params[key], value, atol=2e-6, rtol=1e-5,
                                       err_msg=f"{name} {key}")


def test_killed_run_resumes_bit_for_bit(tmp_path, sweeps):
    """Killed in place of step 5 (`abort_and_resume`: the step-3 checkpoint is the last),
    then a rerun: the same batches,
    losses and final parameters as a run never interrupted."""
    overrides = {**SHORT, **sweeps}
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process("cpc_tiny", overrides, *reference)
    ours = abort_and_resume("cpc_tiny", overrides, tmp_path, step=5)
    executed = assert_same_training("cpc_tiny", overrides, ours, reference)
    assert len(executed) > 8  # the kill lost steps after the step-3 checkpoint, which were redone


def test_cli_pretrains_the_tiny_preset(tmp_path, sweeps):
    """`run.py pretrain --preset cpc_tiny --data FOLDER` trains, logs and evaluates."""
    settings = [f"{key}={value}" for key, value in sweeps.items() if key != "data.source"]
    assert run.main(["pretrain", "--preset", "cpc_tiny", "--data", sweeps["data.source"],
                     "--workdir", str(tmp_path / "run"), "train.steps=2",
                     "train.progress=false", *settings]) == 0
    rows = metric_rows(tmp_path / "run")
    assert [row["step"] for row in rows if row["split"] == "train"] == [2]
    assert any(row["split"] == "eval" and np.isfinite(row["accuracy"]) for row in rows)
