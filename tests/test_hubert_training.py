"""HuBERT's targets and training (objectives/hubert.py, input_pipeline/mfcc.py): Kaldi's MFCCs
against kaldi-native-fbank, the deltas against their definition, the k-means targets' statistics
and cache, their alignment with the network's frames, the tiny preset training on a folder of
clips, and a killed run resuming bit for bit."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from resilience_utils import (
    GRADIENT_STEP,
    abort_and_resume,
    assert_same_training,
    run_in_process,
)
from test_wav2vec2_training import clips  # noqa: F401  (the fixture)

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.mfcc import deltas, kaldi_mfcc, mfcc_with_deltas
from pretext_jax.models.hubert import HubertConfig
from pretext_jax.models.wav2vec2 import feature_lengths
from pretext_jax.objectives import hubert
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

RATE = 16000
MAX_SAMPLES = 4000  # 49 frames of the tiny encoder (80 samples a frame)
TINY = {"examples.max_samples": MAX_SAMPLES, "train.batch_size": 8, "train.steps": 3,
        "train.log_every": 1, "train.eval_every": 1000, "train.eval_batches": 1,
        "train.checkpoint_every": 3, "train.progress": False, "optim.warmup_steps": 2,
        "data.held_out_fraction": 0.25, "model.num_classes": 8,
        "objective.kmeans_n_init": 2, "objective.kmeans_batch_size": 1024}


def tone(seconds: float = 0.7, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(RATE * seconds)) / RATE
    return (0.3 * np.sin(2 * np.pi * 440 * t) * np.linspace(0.2, 1, len(t))
            + 0.05 * rng.standard_normal(len(t))).astype(np.float32)


def test_mfcc_is_kaldis():
    """`kaldi_mfcc` equals kaldi-native-fbank's Kaldi MFCC at fairseq's dump_mfcc_feature.py
    settings (no dither, use_energy false, 23 bins, 13 ceps, lifter 22, 25/10 ms, povey);
    with the pre-emphasis off there (negative control) it does not."""
    knf = pytest.importorskip("kaldi_native_fbank")
    waveform = tone()

    def reference(preemphasis: float) -> np.ndarray:
        options = knf.MfccOptions()
        options.frame_opts.dither, options.frame_opts.samp_freq = 0.0, RATE
        options.frame_opts.preemph_coeff, options.use_energy = preemphasis, False
        mfcc = knf.OnlineMfcc(options)
        mfcc.accept_waveform(RATE, waveform.tolist())
        mfcc.input_finished()
        return np.stack([mfcc.get_frame(i) for i in range(mfcc.num_frames_ready)])

    ours = kaldi_mfcc(waveform, RATE)
    assert ours.shape == (1 + (len(waveform) - 400) // 160, 13)
    expected = reference(0.97)
    np.testing.assert_allclose(ours, expected, atol=2e-4 * np.abs(expected).max())
    assert np.abs(ours - reference(0.0)).max() > 0.1
    assert kaldi_mfcc(waveform[:399], RATE).shape == (0, 13)


def test_deltas_are_the_regression_over_two_frames():
    """d[t] = sum_n n (c[t+n] - c[t-n]) / 10 with the edge frames repeated (torchaudio
    compute_deltas, win_length 5), written out frame by frame; 39 = 13 x 3 features."""
    features = np.random.default_rng(0).standard_normal((7, 3)).astype(np.float32)
    clamp = lambda t: features[min(max(t, 0), 6)]  # noqa: E731
    expected = np.stack([(clamp(t + 1) - clamp(t - 1) + 2 * (clamp(t + 2) - clamp(t - 2))) / 10
                         for t in range(7)])
    np.testing.assert_allclose(deltas(features), expected, rtol=1e-6, atol=1e-7)
    full = mfcc_with_deltas(tone(), RATE)
    assert full.shape[1] == 39
    np.testing.assert_allclose(full[:, 13:26], deltas(full[:, :13]), rtol=1e-6)
    np.testing.assert_allclose(full[:, 26:], deltas(full[:, 13:26]), rtol=1e-6)
    assert mfcc_with_deltas(tone()[:399], RATE).shape == (0, 39)


def test_frame_targets_follow_fairseqs_alignment():
    """Labels at 100 Hz for a window from sample 1600 (label 10): 20 ms frames (320 samples)
    read every other label (forward_targets' ratio 2), 5 ms frames each label twice; frames
    past the window's labels get -1."""
    labels = np.arange(60)
    base = HubertConfig(num_layers=1, hidden_size=16, num_heads=2, position_conv_groups=2,
                        intermediate_size=8)
    assert base.samples_per_frame == 320
    np.testing.assert_array_equal(
        hubert.frame_targets(labels, 1600, 3200, 12, 100, base, RATE),
        [10, 12, 14, 16, 18, 20, 22, 24, 26, 28, -1, -1])
    tiny = HubertConfig(**{k: v for k, v in hubert.TINY_MODEL.items()})
    np.testing.assert_array_equal(
        hubert.frame_targets(labels, 1600, 800, 12, 100, tiny, RATE),
        [10, 10, 11, 11, 12, 12, 13, 13, 14, 14, -1, -1])
    # An utterance whose labels end before the window does: no target past them.
    np.testing.assert_array_equal(hubert.frame_targets(labels[:13], 1600, 3200, 4, 100, base,
                                                       RATE), [10, 12, -1, -1])
    # An utterance under 25 ms has no MFCC frame, so no label.
    np.testing.assert_array_equal(hubert.frame_targets(labels[:0], 0, 300, 3, 100, tiny, RATE),
                                  [-1, -1, -1])


@pytest.fixture(scope="module")
def prepared(clips):  # noqa: F811
    """The tiny preset's config and prepared data (records of both splits) on the clips."""
    config = make_config("hubert_tiny", {**TINY, **clips})
    data = hubert.prepare_hubert(config.data, config.examples, config.data.cache_dir, 0)
    return config, data


def test_targets_cluster_the_clips_and_are_cached(prepared):
    """Every frame of both splits has a label of the 8 clusters, all of them used, and the
    steady tones keep their cluster from one 10 ms frame to the next far more often than the
    same labels shuffled (negative control); the labels are stored beside the records and read
    back as they are; other k-means settings cluster again, into other labels."""
    config, data = prepared
    objective = config.objective
    train, held_out = hubert.cluster_targets(data.train, data.eval, 8, objective)
    for targets, records in ((train, data.train), (held_out, data.eval)):
        assert targets.labels.dtype == np.int16 and len(targets.offsets) == len(records) + 1
        assert targets.label_rate == 100
    assert set(np.unique(train.labels)) == set(range(8))
    assert np.bincount(train.labels).max() < 0.6 * len(train.labels)

    def kept(labels_of) -> float:
        pairs = [(u[:-1] == u[1:]).mean() for u in map(labels_of, range(len(data.train)))]
        return float(np.mean(pairs))

    shuffled = np.random.default_rng(0).permutation(train.labels)
    assert kept(train.of) > 0.8
    assert kept(lambda i: shuffled[train.offsets[i]:train.offsets[i + 1]]) < 0.4
    files = list(Path(data.train.directory).glob("hubert_targets_*.npz"))
    assert len(files) == 1
    stamp = files[0].stat().st_mtime_ns
    again = hubert.cluster_targets(data.train, data.eval, 8, objective)[0]
    np.testing.assert_array_equal(again.labels, train.labels)
    assert files[0].stat().st_mtime_ns == stamp
    other = hubert.cluster_targets(data.train, data.eval, 8, dataclasses.replace(
        objective, kmeans_n_init=1, kmeans_max_iter=1, kmeans_batch_size=64))[0]
    assert len(list(Path(data.train.directory).glob("hubert_targets_*.npz"))) == 2
    assert not np.array_equal(other.labels, train.labels)


def test_tiny_preset_trains_and_its_loss_falls_on_a_repeated_batch(tmp_path, clips):  # noqa: F811
    """Three steps of the tiny preset on the clips: finite losses, a held-out evaluation with
    the masked accuracy; batches carry 49 frames of targets (-1 only past the real frames) and
    masks; the loss falls on a repeated batch."""
    trainer = Trainer(make_config("hubert_tiny", {**TINY, **clips}), tmp_path / "w")
    trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [row["step"] for row in rows if row["split"] == "train"] == [1, 2, 3]
    assert all(np.isfinite(row["loss"]) for row in rows)
    assert any(row["split"] == "eval" and "masked_accuracy" in row for row in rows)
    state, batch = trainer.init_state(), next(trainer.data_iterator())
    labels, mask = np.asarray(batch["cluster_labels"]), np.asarray(batch["mask_time_indices"])
    assert labels.shape == mask.shape == (8, 49)
    real = feature_lengths(trainer.config.model, np.asarray(batch["attention_mask"]).sum(-1))
    assert mask.any() and (labels < 8).all() and (labels >= -1).all()
    for row, count in enumerate(real):
        assert (labels[row, :count - 1] >= 0).all() and not mask[row, count:].any()
    losses = []
    for _ in range(12):
        state, metrics = trainer.train_step(state, batch)
        losses.append(float(metrics["loss"][0]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1, losses


def test_killed_run_resumes_bit_for_bit(tmp_path, clips):  # noqa: F811
    overrides = {**TINY, **clips, "train.steps": 6, "train.checkpoint_every": 3}
    reference = tmp_path / "reference", tmp_path / "reference.log"
    run_in_process("hubert_tiny", overrides, *reference)
    ours = abort_and_resume("hubert_tiny", overrides, tmp_path, step=5)
    assert len(assert_same_training("hubert_tiny", overrides, ours, reference)) > 6


def test_batches_cropped_to_their_shortest_carry_their_windows_targets(tmp_path, clips):  # noqa: F811
    """examples.crop_to_shortest (fairseq's pad_audio false): rows of a batch equally long,
    no attention_mask, masked counts equal within each of the 2 batch groups, and a row's
    targets those of its utterance from its window's first sample (`frame_targets`, found
    again from the plan and the row's crop); a step trains."""
    config = make_config("hubert_tiny", {**TINY, **clips, "examples.crop_to_shortest": True,
                                         "examples.length_buckets": 2,
                                         "objective.batch_groups": 2})
    trainer = Trainer(config, tmp_path / "w")
    batch = next(trainer.data_iterator())
    assert set(batch) == {"audio", "mask_time_indices", "cluster_labels"}
    counts = np.asarray(batch["mask_time_indices"]).sum(axis=1).reshape(2, 4)
    assert (counts == counts[:, :1]).all() and counts.min() > 0
    source = trainer.data.segment(1, config).records(None)
    batches, lengths = source.plan(0)
    record, length = int(batches[0, 0]), int(lengths[0])
    audio = source.records.spec.decode(source.records.source[record])["audio"]
    start = next(s for s in range(len(audio) - length + 1)
                 if np.array_equal(audio[s:s + length] / 32768.0, source[0]["audio"]))
    frames = int(feature_lengths(config.model, length))
    np.testing.assert_array_equal(source[0]["cluster_labels"], hubert.frame_targets(
        source.finish.targets.of(record), start, length, frames, 100, config.model, RATE))
    # Only a window's last frames can lack a label: the utterance's last 25 ms MFCC frame ends
    # at or before its end.
    assert (np.asarray(batch["cluster_labels"])[:, :-4] >= 0).all()
    state, metrics = trainer.train_step(trainer.init_state(), batch)
    assert np.isfinite(float(metrics["loss"][0]))
    budget = {**TINY, **clips, "examples.samples_per_batch": 64_000,
              "examples.crop_to_shortest": True, "examples.length_buckets": 2}
    with pytest.raises(UserError, match="examples.samples_per_batch=0"):
        Trainer(make_config("hubert_tiny", budget), tmp_path / "budget")


def test_same_step_on_every_mesh(tmp_path, clips):  # noqa: F811
    """One gradient step (dropout and LayerDrop on, two batch groups, each spanning two of the
    mixed mesh's four data shards) gives the same loss and parameters on one device and on the
    (2, 2, 2) mesh, and it moves the parameters."""
    import jax

    results, batch, initial = {}, None, None
    for name, (mesh, devices) in {"single": ((1, 1, 1), jax.devices()[:1]),
                                  "mixed": ((2, 2, 2), None)}.items():
        values = {**TINY, **clips, **GRADIENT_STEP, "objective.batch_groups": 2,
                  "model.hidden_dropout": 0.1, "model.layerdrop": 0.2, "mesh.data": mesh[0],
                  "mesh.fsdp": mesh[1], "mesh.tensor": mesh[2]}
        trainer = Trainer(make_config("hubert_tiny", values), tmp_path / name, devices=devices)
        batch = next(trainer.data_iterator()) if batch is None else batch
        state = trainer.init_state()
        initial = jax.device_get(state.params) if initial is None else initial
        state, metrics = trainer.train_step(state, batch)
        params = jax.device_get(state.params)
        results[name] = (float(metrics["loss"][0]), {
            jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(params)})
    moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(), params,
                         initial)
    assert max(jax.tree.leaves(moved)) > 1e-2
    loss0, params0 = results["single"]
    assert np.isfinite(loss0)
    loss, params = results["mixed"]
    assert loss == pytest.approx(loss0, rel=1e-6, abs=1e-5)
    for key, value in params0.items():
        np.testing.assert_allclose(params[key], value, atol=2e-6, rtol=1e-5, err_msg=key)
