"""The speech methods' downstream measure (objectives/common/speech.py): linear probes on frozen,
time-averaged features of a chosen layer, the MFCC baseline, the labels probed, the evaluation
hook and the CLI summary, `demo --speech`, and the real Free Spoken Digit Dataset when it is
there."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from pretext_jax import run
from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import audio
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.models.cpc import CPCConfig
from pretext_jax.objectives import cpc, wav2vec2
from pretext_jax.objectives.common import speech
from pretext_jax.objectives.common.preset_parts import FSDD_EXAMPLES
from pretext_jax.pretrain.config import make_config

soundfile = pytest.importorskip("soundfile")
pytest.importorskip("soxr")
librosa = pytest.importorskip("librosa")

RATE = 8000  # as FSDD's files: every test resamples to 16 kHz
PITCHES = (300.0, 700.0, 1500.0)  # "digit" d is a tone of PITCHES[d]
TINY_CPC = ["model.conv_channels=16", "model.context_size=16", "model.prediction_steps=3",
            "objective.num_negatives=4", "examples.max_samples=1600",
            "examples.probe_samples=4800", "train.batch_size=8", "train.log_every=2",
            "train.progress=false"]


def utterance(digit: int, speaker: int, index: int) -> np.ndarray:
    """0.15-0.4 s: speaker 0 a pure tone, speaker 1 the tone with its octave and some noise."""
    rng = np.random.default_rng(100 * digit + 10 * speaker + index)
    t = np.arange(int(RATE * rng.uniform(0.15, 0.4))) / RATE
    samples = 0.4 * np.sin(2 * np.pi * PITCHES[digit] * t)
    if speaker:
        samples += 0.3 * np.sin(4 * np.pi * PITCHES[digit] * t) + 0.05 * rng.standard_normal(
            len(t))
    return samples.astype(np.float32)


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    """FSDD's layout in miniature: {digit}_{speaker}_{index}.wav, 3 digits x 2 speakers x 10
    indices (0-4 are the held-out half, as FSDD's split)."""
    root = tmp_path_factory.mktemp("digits") / "recordings"
    root.mkdir()
    for digit in range(3):
        for speaker, name in enumerate(("amy", "bob")):
            for index in range(10):
                soundfile.write(str(root / f"{digit}_{name}_{index}.wav"),
                                utterance(digit, speaker, index), RATE, subtype="PCM_16")
    return root


def fsdd_like(**settings) -> audio.AudioExampleConfig:
    return audio.AudioExampleConfig(**{**FSDD_EXAMPLES, "max_samples": 1600,
                                       "probe_samples": 4800, **settings})


def prepared(digits: Path, cache: Path, **settings):
    return speech.prepare_speech(DataConfig(source=str(digits)), fsdd_like(**settings), cache,
                                 seed=0)


def test_mfcc_means_average_the_real_samples_only():
    """A padded window's MFCC means are librosa's MFCCs (25 ms / 10 ms, 40 mel bands) of its
    real samples alone, averaged over the frames; padding changes nothing."""
    samples = utterance(1, 1, 3)
    resampled = audio.resample(samples, RATE, 16000)
    window, mask = np.zeros((2, 9000), np.float32), np.zeros((2, 9000), np.int32)
    lengths = (len(resampled), len(resampled) // 2)
    for row, length in enumerate(lengths):
        window[row, :length], mask[row, :length] = resampled[:length], 1
    means = audio.mfcc_means(window, mask, 16000)
    for row, length in enumerate(lengths):
        expected = librosa.feature.mfcc(y=resampled[:length], sr=16000, n_mfcc=13, n_fft=400,
                                        hop_length=160, n_mels=40).mean(axis=1)
        np.testing.assert_allclose(means[row], expected, rtol=1e-5, atol=1e-4)
    assert not np.allclose(means[0], means[1])


def test_probed_labels_by_default_and_by_name(digits, tmp_path):
    """By default every label but the one the held-out rule splits by; named labels are checked
    against the records; audio without labels has nothing to probe."""
    data = prepared(digits, tmp_path / "cache")
    probes = data.monitor_data
    assert probes.labels == ("digit", "speaker")
    assert (len(probes.train_indices), len(probes.held_out_indices)) == (30, 30)
    assert set(data.report) == {"mfcc_probe_digit_accuracy", "mfcc_probe_speaker_accuracy"}
    train = probes.train
    assert speech.probed_labels(train, fsdd_like(probe_labels="speaker")) == ("speaker",)
    assert speech.probed_labels(train, fsdd_like(held_out_rule="")) == (
        "digit", "speaker", "index")
    with pytest.raises(UserError, match="names gender, not a label of the audio .it has digit, "
                                        "speaker, index"):
        speech.probed_labels(train, fsdd_like(probe_labels="speaker,gender"))
    unlabelled = tmp_path / "unlabelled"
    unlabelled.mkdir()
    for i in range(8):
        soundfile.write(str(unlabelled / f"{i}.wav"), utterance(0, 0, i), RATE)
    data = speech.prepare_speech(DataConfig(source=str(unlabelled), held_out_fraction=0.25),
                                 audio.AudioExampleConfig(max_samples=1600), tmp_path / "cache",
                                 seed=0)
    assert data.monitor_data is None and data.report == {}


def test_probe_accuracies_follow_the_features(digits, tmp_path):
    """The probe on MFCC means separates the tones (digit) and the timbres (speaker) of the
    held-out half; on features that carry no information it can do no better than one class
    (a third of the digits, half of the speakers)."""
    data = prepared(digits, tmp_path / "cache")
    assert data.report == {"mfcc_probe_digit_accuracy": 1.0, "mfcc_probe_speaker_accuracy": 1.0}
    blind = data.monitor_data.accuracies(lambda batch: np.zeros((len(batch["audio"]), 4)))
    assert blind["digit"] == pytest.approx(1 / 3) and blind["speaker"] == pytest.approx(1 / 2)
    pitch_only = data.monitor_data.accuracies(
        lambda batch: np.eye(3)[batch["digit"]] + 0.01 * batch["speaker"][:, None])
    assert pitch_only["digit"] == 1.0


def test_pooled_features_average_the_chosen_layers_real_frames():
    """`pooled_features` = the mean of the layer's features over each utterance's real frames
    (CPC: layer 0 is z, 1 and -1 the context c), whatever padding follows."""
    config = CPCConfig(conv_channels=8, context_size=6, prediction_steps=2)
    model = cpc.build_cpc(config, 0)
    rng = np.random.default_rng(0)
    batch = rng.standard_normal((3, 1600)).astype(np.float32)  # 10 frames of 160 samples
    mask = np.ones((3, 1600), np.int32)
    mask[1, 960:] = 0
    mask[2, 320:] = 0
    batch[mask == 0] = 0.0
    out = model(jnp.asarray(batch), jnp.asarray(mask))
    for layer, features in ((0, out.features), (1, out.context), (-1, out.context)):
        pooled = np.asarray(speech.pooled_features(model, jnp.asarray(batch), jnp.asarray(mask),
                                                   cpc.probe_layers, layer))
        frames = np.asarray(out.frames)
        expected = np.stack([np.asarray(features)[row][frames[row]].mean(0) for row in range(3)])
        np.testing.assert_allclose(pooled, expected, rtol=1e-5, atol=1e-6)
    assert frames.sum(1).tolist() == [10, 5, 1]  # frames wholly inside the real samples
    with pytest.raises(UserError, match="examples.probe_layer=2 is not one of this network's 2"):
        cpc.check_windows(config, audio.AudioExampleConfig(max_samples=800, probe_layer=2))


def test_demo_speech_reports_probes_beside_untrained_and_mfcc(digits, tmp_path, capsys):
    """`demo --speech --data FOLDER` (cpc_digits, shrunk): every evaluation logs the probes, and
    the summary prints each label's probe for the trained network, the same network untrained
    and the MFCC baseline."""
    code = run.main(["demo", "--speech", "--data", str(digits), "--workdir",
                     str(tmp_path / "demo"), *TINY_CPC, "train.steps=4", "train.eval_every=2",
                     "train.checkpoint_every=4", f"data.cache_dir={tmp_path / 'cache'}"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [json.loads(line) for line in (tmp_path / "demo" / "metrics.jsonl").read_text()
            .splitlines()]
    evaluations = [row for row in rows if row["split"] == "eval"]
    assert [row["step"] for row in evaluations] == [2, 4]
    for row in evaluations:
        assert 0.0 <= row["probe_digit_accuracy"] <= 1.0
        assert 0.0 <= row["probe_speaker_accuracy"] <= 1.0
    for label in ("digit", "speaker"):
        accuracy = evaluations[-1][f"probe_{label}_accuracy"]
        assert f"{label}: {accuracy:.3f} trained vs " in out
        assert " untrained vs 1.000 MFCC" in out.split(f"{label}: ")[1].splitlines()[0]


def test_fsdd_benchmark_reports_the_three_probes(digits, tmp_path):
    """`bench.speech_fsdd` on a folder in FSDD's layout: per label the trained network's probe,
    the untrained one's and the MFCC baseline's."""
    from bench import speech_fsdd

    rows = tmp_path / "rows.md"
    result = speech_fsdd.main(["--markdown", str(rows), "--steps", "2", "--data", str(digits),
                               "--workdir", str(tmp_path / "bench"), *TINY_CPC,
                               f"data.cache_dir={tmp_path / 'cache'}"])
    assert result["steps"] == 2 and set(result["held_out_probe_accuracy"]) == {"digit", "speaker"}
    for probes in result["held_out_probe_accuracy"].values():
        assert probes["mfcc"] == 1.0
        assert 0.0 <= probes["trained"] <= 1.0 and 0.0 <= probes["untrained"] <= 1.0
    header, alignment, row = rows.read_text().splitlines()  # the docs' table format
    assert header + "\n" + alignment == speech_fsdd.TABLE.header()
    assert row.startswith("| `cpc_digits` | 2 x 8 | digit ") and " / 1.000; speaker " in row


@pytest.mark.parametrize("args, message", [
    (["demo", "--speech"], "git clone https://github.com/Jakobovski/free-spoken-digit-dataset"),
    (["demo", "--images", "--speech", "--data", "x"], "--images or --speech, not both"),
    (["demo", "--data", "x"], "demo --data is for --speech"),
])
def test_demo_speech_arguments_are_one_line_errors(args, message, capsys):
    assert run.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_wav2vec2_probes_read_the_chosen_hidden_state(digits, tmp_path):
    """wav2vec2's probes pool hidden state `probe_layer` of its L + 1 (`Wav2Vec2.hidden_states`,
    HF's numbering); another layer gives other features, and an index past them is a one-line
    error of the method's check."""
    config = make_config("wav2vec2_tiny")
    model = wav2vec2.build_wav2vec2(config.model, 0)
    examples = fsdd_like(probe_layer=1)
    data = prepared(digits, tmp_path / "cache")
    batch = next(data.monitor_data.batches("train"))
    hidden, frames = model.hidden_states(jnp.asarray(batch["audio"]),
                                         jnp.asarray(batch["attention_mask"]))
    pooled = {layer: np.asarray(speech.pooled_features(
        model, jnp.asarray(batch["audio"]), jnp.asarray(batch["attention_mask"]),
        wav2vec2.probe_layers, layer)) for layer in (1, -1)}
    weights = np.asarray(frames, np.float32)[..., None]
    np.testing.assert_allclose(pooled[1], (np.asarray(hidden[1]) * weights).sum(1)
                               / weights.sum(1), rtol=1e-5, atol=1e-5)
    assert not np.allclose(pooled[1], pooled[-1], atol=1e-3)
    accuracies = speech.probe_monitor(wav2vec2.probe_layers)(model, data, examples, None)
    assert set(accuracies) == {"probe_digit_accuracy", "probe_speaker_accuracy"}
    assert accuracies["probe_digit_accuracy"] > 0.9  # the tones' pitch survives random layers
    with pytest.raises(UserError, match="examples.probe_layer=3 is not one of this network's 3"):
        wav2vec2.check_frames(config.model, fsdd_like(probe_layer=3))


def test_real_fsdd_mfcc_baseline(shared_data, tmp_path):
    """On FSDD's official split (2,700 / 300 recordings) the MFCC means name the speaker and
    the digit far above chance (1/6 and 1/10)."""
    recordings = shared_data / "fsdd" / "recordings"
    if not recordings.is_dir():
        pytest.skip(f"{recordings} not found")
    examples = audio.AudioExampleConfig(**{**FSDD_EXAMPLES, "max_samples": 8000})
    data = speech.prepare_speech(DataConfig(source=str(recordings)), examples,
                                 tmp_path / "cache", seed=0)
    probes = data.monitor_data
    assert (len(probes.train_indices), len(probes.held_out_indices)) == (2700, 300)
    assert data.report["mfcc_probe_digit_accuracy"] > 0.6
    assert data.report["mfcc_probe_speaker_accuracy"] > 0.85
