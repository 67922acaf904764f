"""wav2vec 2.0 on the one trainer (objectives/wav2vec2.py): the tiny preset trains on a folder of
short clips, a sharded step equals the single-device one, a killed run resumes bit for bit, the
Gumbel temperature follows its schedule over the model's update count, the host-side masks keep
the samplers' statistics, and the CLI runs the preset."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx
from resilience_utils import GRADIENT_STEP, abort_and_resume, assert_same_training, run_in_process

from pretext_jax import run
from pretext_jax.models.hf import tables as hf_tables  # noqa: F401  (registers the HF tables)
from pretext_jax.models.hf.conversion import from_hf, to_hf
from pretext_jax.models.wav2vec2 import Wav2Vec2, Wav2Vec2Config, feature_lengths
from pretext_jax.objectives.wav2vec2 import (
    SpanMasking,
    Wav2Vec2ObjectiveConfig,
    gumbel_temperature,
    per_loss_call_decay,
    span_mask,
)
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

soundfile = pytest.importorskip("soundfile")
pytest.importorskip("soxr")

RATE = 16000
MAX_SAMPLES = 4000  # 49 frames of the tiny encoder (80 samples a frame)
TINY = {"examples.max_samples": MAX_SAMPLES, "train.batch_size": 8, "train.steps": 3,
        "train.log_every": 1, "train.eval_every": 1000, "train.eval_batches": 1,
        "train.checkpoint_every": 3, "train.progress": False, "optim.warmup_steps": 2,
        "data.held_out_fraction": 0.25}


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, str]:
    """32 clips of 0.15-0.5 s (noisy tones, some shorter than a crop) in a folder, and a shared
    record cache."""
    root = tmp_path_factory.mktemp("clips")
    rng = np.random.default_rng(0)
    for i in range(32):
        length = int(rng.integers(2400, 8000))
        t = np.arange(length) / RATE
        samples = 0.3 * np.sin(2 * np.pi * (200 + 40 * (i % 8)) * t) + 0.05 * rng.standard_normal(
            length)
        soundfile.write(str(root / f"{i}.wav"), samples.astype(np.float32), RATE,
                        subtype="PCM_16")
    return {"data.source": str(root), "data.cache_dir": str(root / "cache")}


def tiny_trainer(workdir, clips, mesh=(-1, 1, 1), devices=None, **overrides) -> Trainer:
    values = {**TINY, **clips, "mesh.data": mesh[0], "mesh.fsdp": mesh[1],
              "mesh.tensor": mesh[2], **overrides}
    return Trainer(make_config("wav2vec2_tiny", values), workdir, devices=devices)


def test_tiny_preset_trains_and_its_loss_falls_on_a_repeated_batch(tmp_path, clips):
    trainer = tiny_trainer(tmp_path / "w", clips)
    trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text()
            .splitlines()]
    train = [row for row in rows if row["split"] == "train"]
    assert [row["step"] for row in train] == [1, 2, 3]
    assert all(np.isfinite(row["loss"]) for row in rows)
    assert any(row["split"] == "eval" and "contrastive_accuracy" in row for row in rows)

    state, batch = trainer.init_state(), next(trainer.data_iterator())
    assert batch["mask_time_indices"].shape == (8, 49)
    assert batch["sampled_negative_indices"].shape == (8, 49, 20)
    losses = []
    for _ in range(12):
        state, metrics = trainer.train_step(state, batch)
        losses.append(float(metrics["loss"][0]))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.1, losses


def test_same_step_on_every_mesh(tmp_path, clips):
    """One gradient step (Gumbel sampling on) gives the same loss, parameters (so gradients)
    and update count on one device and on the (2, 2, 2) mesh, and it moves the parameters."""
    results = {}
    layouts = {"single": ((1, 1, 1), jax.devices()[:1]), "mixed": ((2, 2, 2), None)}
    batch = initial = None
    for name, (mesh, devices) in layouts.items():
        trainer = tiny_trainer(tmp_path / name, clips, mesh=mesh, devices=devices,
                               **GRADIENT_STEP)
        batch = next(trainer.data_iterator()) if batch is None else batch
        state = trainer.init_state()
        initial = jax.device_get(state.params) if initial is None else initial
        state, metrics = trainer.train_step(state, batch)
        moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(),
                             jax.device_get(state.params), initial)
        tree = jax.device_get({"params": state.params, "model_state": state.model_state})
        results[name] = (float(metrics["loss"][0]),
                         {jax.tree_util.keystr(k): np.asarray(v)
                          for k, v in jax.tree_util.tree_leaves_with_path(tree)})
    assert max(jax.tree.leaves(moved)) > 1e-2  # a real step (the preset's first lr is 0)
    loss0, params0 = results["single"]
    assert np.isfinite(loss0)
    assert int(params0["['model_state']['updates'].value"]) == 1
    for name, (loss, params) in results.items():
        assert loss == pytest.approx(loss0, rel=1e-6, abs=1e-5), name
        for key, value in params0.items():
            np.testing.assert_allclose(params[key], value, atol=2e-6, rtol=1e-5,
                                       err_msg=f"{name} {key}")


def test_update_count_drives_the_gumbel_temperature(tmp_path, clips):
    trainer = tiny_trainer(tmp_path / "w", clips, **{"objective.gumbel_decay": 0.5,
                                                     "objective.gumbel_start_temperature": 2.0})
    state, iterator = trainer.init_state(), trainer.data_iterator()
    temperatures = []
    for _ in range(4):
        state, metrics = trainer.train_step(state, next(iterator))
        temperatures.append(float(metrics["gumbel_temperature"][0]))
    assert int(jax.device_get(state.model_state["updates"].get_value())) == 4
    assert temperatures == pytest.approx([2.0, 1.0, 0.5, 0.5])  # max(2 x 0.5^k, 0.5)
    evaluated = trainer.evaluate(state)
    assert "gumbel_temperature" not in evaluated
    assert int(jax.device_get(state.model_state["updates"].get_value())) == 4

    settings = Wav2Vec2ObjectiveConfig()
    assert float(gumbel_temperature(100_000, settings)) == pytest.approx(
        2 * 0.999995 ** 100_000, rel=1e-5)
    accumulated = make_config("wav2vec2_tiny", {"optim.grad_accum_steps": 4})
    per_call = per_loss_call_decay(settings, accumulated)
    assert per_call.gumbel_decay ** 4 == pytest.approx(settings.gumbel_decay, rel=1e-12)


def test_hf_import_initialises_the_update_count():
    config = Wav2Vec2Config(conv_channels=(8, 8), conv_kernel_sizes=(10, 4),
                            conv_strides=(5, 4), hidden_size=16, num_layers=1, num_heads=2,
                            intermediate_size=32, position_conv_kernel=4,
                            position_conv_groups=2, codevectors_per_group=4,
                            codevector_dim=8, projection_dim=8)
    hf_config, state = to_hf(Wav2Vec2(config, rngs=nnx.Rngs(0)))
    model = from_hf(hf_config, state)
    assert isinstance(model.updates.get_value(), jax.Array)
    assert int(model.updates.get_value()) == 0


def test_host_masks_keep_the_samplers_statistics():
    """Per-utterance draws: about p x n spans of M frames over the real frames only, distractors
    drawn from the other masked frames; the same record and rng seed give the same draws."""
    config = make_config("wav2vec2_tiny").model
    settings = Wav2Vec2ObjectiveConfig()
    masking = SpanMasking(config, settings)
    num_frames = int(feature_lengths(config, 16000))
    rng = np.random.default_rng(0)
    real = np.zeros(16000, np.int32)
    real[:12000] = 1
    frames = int(feature_lengths(config, 12000))
    fractions = []
    for _ in range(200):
        drawn = masking.random_map({"attention_mask": real, "audio": np.zeros(16000)}, rng)
        mask, negatives = drawn["mask_time_indices"], drawn["sampled_negative_indices"]
        assert mask.shape == (num_frames,)
        assert negatives.shape == (num_frames, settings.num_negatives)
        assert not mask[frames:].any()
        masked = np.flatnonzero(mask)
        assert np.isin(negatives[masked], masked).all()
        assert (negatives[masked] != masked[:, None]).all()
        fractions.append(mask.mean() * num_frames / frames)
    # The batch sampler's coverage of utterances of that length (per-batch rounding draws).
    expected = np.mean([span_mask(np.full(8, frames), frames, settings, rng).mean()
                        for _ in range(50)])
    assert 0.4 < expected < 0.6  # spans overlap: about half the frames (§3.1)
    assert np.mean(fractions) == pytest.approx(expected, abs=0.02)
    again = [masking.random_map({"attention_mask": real}, np.random.default_rng(7))
             for _ in range(2)]
    for key in ("mask_time_indices", "sampled_negative_indices"):
        np.testing.assert_array_equal(again[0][key], again[1][key])


def test_killed_run_resumes_bit_for_bit(tmp_path, clips):
    overrides = {**TINY, **clips, "train.steps": 8, "train.checkpoint_every": 3}
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process("wav2vec2_tiny", overrides, *reference)
    ours = abort_and_resume("wav2vec2_tiny", overrides, tmp_path, step=5)
    executed = assert_same_training("wav2vec2_tiny", overrides, ours, reference)
    assert len(executed) > 8  # the kill lost steps after the step-3 checkpoint, which were redone
    counts = []
    for workdir, _ in (ours, reference):
        trainer = Trainer(make_config("wav2vec2_tiny", overrides), workdir)
        state, _ = trainer.checkpoints.restore_latest_readable()
        trainer.checkpoints.close()
        counts.append(int(jax.device_get(state.model_state["updates"].get_value())))
    assert counts == [8, 8]


def test_cli_pretrains_the_tiny_preset(tmp_path, clips):
    assert run.main(["pretrain", "--preset", "wav2vec2_tiny", "--data", clips["data.source"],
                     "--workdir", str(tmp_path / "run"), "train.steps=2", "train.batch_size=8",
                     f"examples.max_samples={MAX_SAMPLES}", "train.progress=false",
                     f"data.cache_dir={clips['data.cache_dir']}",
                     "data.held_out_fraction=0.25"]) == 0
    assert (tmp_path / "run" / "metrics.jsonl").exists()
