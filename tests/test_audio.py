"""The audio source (input_pipeline/audio.py): decoding and resampling real files, labels from
file names and class folders, held-out splits, prepared records, random crops with padding
and masks, bad files, TFDS audio, and the real Free Spoken Digit Dataset when it is there."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import audio
from pretext_jax.input_pipeline.records import make_loader

soundfile = pytest.importorskip("soundfile")
pytest.importorskip("soxr")

FSDD_PATTERN = r"(?P<digit>\d)_(?P<speaker>[a-z]+)_(?P<index>\d+)"


def tone(frequency: float, seconds: float, rate: int) -> np.ndarray:
    return (0.5 * np.sin(2 * np.pi * frequency * np.arange(int(seconds * rate)) / rate)
            ).astype(np.float32)


def write(path: Path, samples: np.ndarray, rate: int, subtype: str = "PCM_16") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(str(path), samples, rate, subtype=subtype)
    return path


def ramp(start: int, length: int) -> np.ndarray:
    """int16 samples start, start + 1, ...: a window's first sample tells where it was cut."""
    return np.arange(start, start + length, dtype=np.int16)


def prepare(source: Path | str, cache: Path, eval_source: str = "", fraction: float = 0.25,
            **settings) -> tuple[audio.AudioRecords, audio.AudioRecords]:
    return audio.prepare_audio(str(source), eval_source, cache,
                               audio.AudioExampleConfig(**settings),
                               held_out_fraction=fraction, seed=0)


def test_resampling_8_to_16_khz_keeps_a_tones_frequency_and_doubles_the_length(tmp_path):
    path = write(tmp_path / "tone.wav", tone(440.0, 1.0, 8000), 8000)
    samples, rate = audio.read_audio(path)
    assert rate == 8000 and samples.shape == (8000,) and samples.dtype == np.float32
    resampled = audio.resample(samples, rate, 16000)
    assert resampled.dtype == np.float32 and abs(len(resampled) - 2 * len(samples)) <= 1
    spectrum = np.abs(np.fft.rfft(resampled))
    peak = np.fft.rfftfreq(len(resampled), 1 / 16000)[np.argmax(spectrum)]
    assert abs(peak - 440.0) <= 1.0
    # Nothing new above the old Nyquist frequency (4 kHz): the resampler's filter holds.
    assert spectrum[np.fft.rfftfreq(len(resampled), 1 / 16000) > 4100].max() < 1e-3 * spectrum.max()
    # Prepared records hold the resampled length, as int16 of the same tone.
    write(tmp_path / "b" / "tone2.flac", tone(440.0, 0.5, 8000), 8000)
    train, held_out = prepare(tmp_path, tmp_path / "cache", fraction=0.5, max_samples=20000)
    lengths = [len(records.spec.decode(records.source[i])["audio"])
               for records in (train, held_out) for i in range(len(records))]
    assert sorted(lengths) == [8000, 16000]


def test_random_crops_padding_masks_and_determinism(tmp_path):
    """16 kHz ramps (stored exactly): a 5,000-sample utterance gives a random 3,000-sample
    window, a 1,000-sample one is padded with zeros and masked; the same seed gives the same
    batches, another seed other crops; held-out windows are the first samples."""
    for k, length in enumerate([5000, 1000, 5000, 1000, 5000, 1000, 5000, 1000]):
        cls = "long" if length == 5000 else "short"
        write(tmp_path / "data" / cls / f"{k}.wav", ramp(4000 * k, length), 16000)
    train, held_out = prepare(tmp_path / "data", tmp_path / "cache", fraction=0.25,
                              max_samples=3000)
    assert (len(train), len(held_out)) == (6, 2)
    assert train.label_fields == ("label",) and train.vocabularies == {"label": ["long", "short"]}

    def batches(seed: int) -> list[dict[str, np.ndarray]]:
        return [dict(b) for b in make_loader(train, batch_size=3, seed=seed, num_epochs=2)]

    first = batches(7)
    assert len(first) == 4
    for batch in first:
        assert batch["audio"].shape == (3, 3000) and batch["audio"].dtype == np.float32
        assert batch["attention_mask"].shape == (3, 3000)
        assert batch["attention_mask"].dtype == np.int32 and batch["label"].dtype == np.int32
        for row, mask, label in zip(batch["audio"], batch["attention_mask"], batch["label"],
                                    strict=True):
            samples = np.rint(row * 32768).astype(np.int64)
            real = int(mask.sum())
            assert real == (3000 if label == 0 else 1000) and mask[:real].all()
            assert (samples[real:] == 0).all()
            start = samples[0] % 4000  # offset of the window in its utterance
            np.testing.assert_array_equal(samples[:real], samples[0] + np.arange(real))
            assert 0 <= start <= (2000 if label == 0 else 0)
    starts = [int(np.rint(b["audio"][i, 0] * 32768)) for b in first for i in range(3)]
    again = [int(np.rint(b["audio"][i, 0] * 32768)) for b in batches(7) for i in range(3)]
    other = [int(np.rint(b["audio"][i, 0] * 32768)) for b in batches(8) for i in range(3)]
    assert starts == again and sorted(starts) != sorted(other)
    assert len({s % 4000 for s in starts if s % 4000}) > 1  # crops do move
    evaluation = held_out.evaluation_examples(10)
    assert evaluation["audio"].shape == (2, 3000)
    assert (np.rint(evaluation["audio"][:, 0] * 32768) % 4000 == 0).all()  # first samples
    np.testing.assert_array_equal(evaluation["audio"], held_out.evaluation_examples(10)["audio"])


def test_normalize_gives_zero_mean_unit_variance_over_the_utterance(tmp_path):
    rng = np.random.default_rng(0)
    for k in range(4):
        write(tmp_path / f"{k}.wav", (0.2 + 0.1 * rng.standard_normal(800)).astype(np.float32),
              16000)
    _, held_out = prepare(tmp_path, tmp_path / "cache", fraction=0.5, max_samples=1000,
                          normalize=True)
    example = held_out.examples([0])
    real = example["audio"][0, :800]
    assert abs(real.mean()) < 1e-4 and abs(real.std() - 1) < 1e-3
    assert (example["audio"][0, 800:] == 0).all() and example["attention_mask"].sum() == 800


def test_batches_cropped_to_their_shortest_utterance(tmp_path):
    """24 ramps of 300 to 2,600 samples (a sample's value names its utterance and offset),
    batches of 4: a batch holds utterances of neighbouring lengths, every row one window of its
    utterance as long as the batch's shortest (at most max_samples) rounded down to one of at
    most `length_buckets` lengths, with no padding and no mask; an epoch reads each utterance
    at most once and leaves fewer than a batch; the same seed gives the same rows, another seed
    other ones, and a loader moved to a saved position continues as the first one did."""
    rng = np.random.default_rng(0)
    lengths = rng.permutation(300 + 100 * np.arange(24))
    bases = -32768 + np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for k, (base, length) in enumerate(zip(bases, lengths, strict=True)):
        write(tmp_path / "data" / f"{k:02d}.wav", ramp(int(base), int(length)), 16000)
    train, _ = prepare(tmp_path / "data", tmp_path / "cache", max_samples=2000)
    stored = train.variable_lengths()
    assert stored.tolist() == [len(train.spec.decode(train.source[i])["audio"])
                               for i in range(len(train))]
    (train.directory / "lengths.npy").unlink()  # records prepared before lengths were stored
    np.testing.assert_array_equal(train.variable_lengths(), stored)
    sizes = np.minimum(stored, 2000)
    config = audio.AudioBatchingConfig(max_samples=2000, crop_to_shortest=True,
                                       length_buckets=3)
    source = audio.ShortestCropBatches(train, config, batch_size=4, seed=3)
    assert len(source.buckets) <= 3 and source.buckets[0] == sizes.min()
    epoch = source.batches_per_epoch * 4
    assert epoch == len(train) // 4 * 4
    seen_lengths = set()
    for first in range(0, 2 * epoch, epoch):
        read = []
        for batch in range(first, first + epoch, 4):
            rows = [source[key] for key in range(batch, batch + 4)]
            assert all(set(row) == {"audio"} for row in rows)  # no attention_mask
            length = len(rows[0]["audio"])
            seen_lengths.add(length)
            utterances = []
            for row in rows:
                samples = np.rint(row["audio"] * 32768).astype(np.int64)
                assert len(samples) == length  # equal rows, none padded
                k = int(np.searchsorted(bases, samples[0], side="right")) - 1
                offset = samples[0] - bases[k]
                np.testing.assert_array_equal(samples, samples[0] + np.arange(length))
                assert offset + length <= lengths[k]  # a window inside its utterance
                utterances.append(k)
            by_length = np.minimum(lengths[utterances], 2000)
            assert length == source.buckets[source.buckets <= by_length.min()].max()
            inside = (sizes > by_length.min()) & (sizes < by_length.max())
            assert inside.sum() <= 4 - 2  # neighbours in the length order
            read += utterances
        assert len(set(read)) == len(read) == epoch  # each utterance at most once an epoch
    assert seen_lengths <= set(source.buckets.tolist())
    exact = audio.ShortestCropBatches(
        train, audio.AudioBatchingConfig(max_samples=2000, crop_to_shortest=True,
                                         length_buckets=0), batch_size=4, seed=3)
    batches, batch_lengths = exact.plan(0)
    np.testing.assert_array_equal(batch_lengths, sizes[batches].min(axis=1))

    def rows(seed: int) -> list[np.ndarray]:
        again = audio.ShortestCropBatches(train, config, batch_size=4, seed=seed)
        return [again[key]["audio"] for key in range(2 * epoch)]

    same, other = rows(3), rows(4)
    assert all(np.array_equal(a, source[k]["audio"]) for k, a in enumerate(same))
    assert not all(len(a) == len(b) and np.array_equal(a, b) for a, b in zip(same, other,
                                                                             strict=True))
    loader = iter(make_loader(source, batch_size=4, seed=0, shuffle=False))
    for _ in range(3):
        next(loader)
    position, expected = loader.get_state(), next(loader)
    resumed = iter(make_loader(audio.ShortestCropBatches(train, config, batch_size=4, seed=3),
                               batch_size=4, seed=0, shuffle=False))
    resumed.set_state(position)
    np.testing.assert_array_equal(next(resumed)["audio"], expected["audio"])
    np.testing.assert_array_equal(expected["audio"], np.stack([source[k]["audio"]
                                                               for k in range(12, 16)]))
    with pytest.raises(UserError, match="fewer than one batch"):
        audio.ShortestCropBatches(train, config, batch_size=len(train) + 1, seed=3)


def fsdd_like(root: Path, digits: int = 3, speakers: tuple[str, ...] = ("alice", "bob"),
              indices: int = 7) -> list[Path]:
    """FSDD's layout in miniature: {digit}_{speaker}_{index}.wav, 8 kHz, 0.05 s each."""
    return [write(root / f"{d}_{s}_{i}.wav", tone(300 + 100 * d, 0.05, 8000), 8000)
            for d in range(digits) for s in speakers for i in range(indices)]


def test_file_name_labels_and_fsdds_official_split_by_index(tmp_path):
    files = fsdd_like(tmp_path / "recordings")
    settings = audio.AudioExampleConfig(label_pattern=FSDD_PATTERN, held_out_rule="index<5",
                                        max_samples=1000)
    plan = audio.plan_audio(str(tmp_path), "", settings, held_out_fraction=0.1, seed=0)
    assert (len(plan.train), len(plan.held_out)) == (12, 30) and len(files) == 42
    assert plan.label_fields == ("digit", "speaker", "index")
    assert plan.vocabularies == {"speaker": ["alice", "bob"]}  # digit and index are integers
    assert all(int(p.stem.split("_")[2]) < 5 for p in plan.held_out.keys)
    train, held_out = audio.prepare_audio(str(tmp_path), "", tmp_path / "cache", settings,
                                          held_out_fraction=0.1, seed=0)
    evaluation = held_out.evaluation_examples(100)
    assert set(evaluation) == {"audio", "attention_mask", "digit", "speaker", "index"}
    assert sorted(evaluation["index"].tolist()) == sorted(list(range(5)) * 6)
    assert set(evaluation["digit"].tolist()) == {0, 1, 2}
    assert set(evaluation["speaker"].tolist()) == {0, 1}
    assert (evaluation["attention_mask"].sum(1) == 800).all()  # 400 samples at 8 kHz -> 800
    training = train.examples(range(len(train)))
    assert set(training["index"].tolist()) == {5, 6}
    # A categorical rule holds a speaker out.
    by_speaker = audio.plan_audio(str(tmp_path), "", audio.AudioExampleConfig(
        label_pattern=FSDD_PATTERN, held_out_rule="speaker==bob"), held_out_fraction=0.1, seed=0)
    assert {p.name.split("_")[1] for p in by_speaker.held_out.keys} == {"bob"}


def test_sources_folders_globs_eval_source_and_class_folders(tmp_path):
    for cls in ("yes", "no"):
        for i in range(3):
            write(tmp_path / "train" / cls / f"{i}.flac", tone(200, 0.02, 16000), 16000)
        write(tmp_path / "val" / cls / "0.wav", tone(200, 0.02, 16000), 16000)
    config = audio.AudioExampleConfig(max_samples=500)
    plan = audio.plan_audio(str(tmp_path), "", config, held_out_fraction=0.5, seed=0)
    assert (len(plan.train), len(plan.held_out)) == (6, 2)  # root/train + root/val
    assert plan.vocabularies == {"label": ["no", "yes"]}
    plan = audio.plan_audio(str(tmp_path / "train"), str(tmp_path / "val"), config,
                            held_out_fraction=0.5, seed=0)
    assert (len(plan.train), len(plan.held_out)) == (6, 2)
    glob_plan = audio.plan_audio(str(tmp_path / "train" / "**" / "*.flac"), "", config,
                                 held_out_fraction=0.5, seed=0)
    assert (len(glob_plan.train), len(glob_plan.held_out)) == (3, 3)
    assert glob_plan.vocabularies == {"label": ["no", "yes"]}  # class folders under the root
    flat = audio.plan_audio(str(tmp_path / "train" / "yes"), "", config,
                            held_out_fraction=0.34, seed=0)
    assert flat.label_fields == () and (len(flat.train), len(flat.held_out)) == (2, 1)
    with pytest.raises(UserError, match="no audio file matches"):
        audio.plan_audio(str(tmp_path / "*.mp3"), "", config, held_out_fraction=0.5, seed=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has no audio files"):
        audio.plan_audio(str(tmp_path / "empty"), "", config, held_out_fraction=0.5, seed=0)
    with pytest.raises(UserError, match="does not match examples.label_pattern"):
        audio.plan_audio(str(tmp_path / "train"), "", audio.AudioExampleConfig(
            label_pattern=FSDD_PATTERN), held_out_fraction=0.5, seed=0)
    with pytest.raises(UserError, match="takes no file"):
        audio.plan_audio(str(tmp_path / "train"), "", audio.AudioExampleConfig(
            held_out_rule="label==maybe"), held_out_fraction=0.5, seed=0)
    with pytest.raises(UserError, match="already holds the held-out files"):
        audio.plan_audio(str(tmp_path), "", audio.AudioExampleConfig(
            held_out_rule="label==no"), held_out_fraction=0.5, seed=0)
    with pytest.raises(UserError, match="needs labels"):
        audio.plan_audio(str(tmp_path / "train" / "yes"), "", audio.AudioExampleConfig(
            held_out_rule="label==no"), held_out_fraction=0.5, seed=0)
    with pytest.raises(UserError, match="compares integers"):
        audio.plan_audio(str(tmp_path / "train"), "", audio.AudioExampleConfig(
            held_out_rule="label>5"), held_out_fraction=0.5, seed=0)
    for bad, message in [({"held_out_rule": "index<five"}, "is not LABEL OP VALUE"),
                         ({"label_pattern": "(?P<digit>", }, "is not a regex"),
                         ({"label_pattern": r"\d"}, "has no named group"),
                         ({"label_pattern": FSDD_PATTERN, "held_out_rule": "fold<1"},
                          "not a label"),
                         ({"max_samples": 0}, "examples.max_samples")]:
        with pytest.raises(UserError, match=message):
            audio.AudioExampleConfig(**bad)


def test_records_are_reused_and_redone_when_files_or_settings_change(tmp_path, capsys):
    fsdd_like(tmp_path / "data", digits=2, indices=3)
    first, _ = prepare(tmp_path / "data", tmp_path / "cache", max_samples=400)
    assert "prepared" in capsys.readouterr().out
    again, _ = prepare(tmp_path / "data", tmp_path / "cache", max_samples=800)
    assert "prepared" not in capsys.readouterr().out and again.directory == first.directory
    assert repr(again.source) != repr(first.source)  # a resume sees the other crop length
    other_rate, _ = prepare(tmp_path / "data", tmp_path / "cache", sample_rate=8000)
    assert other_rate.directory != first.directory
    edited = tmp_path / "data" / "0_alice_0.wav"
    os.utime(edited, ns=(edited.stat().st_atime_ns, edited.stat().st_mtime_ns + 10**9))
    changed, _ = prepare(tmp_path / "data", tmp_path / "cache", max_samples=400)
    assert changed.directory != first.directory
    # min_samples drops short utterances at preparation (0.05 s at 16 kHz: 800 samples).
    for index in (8, 9):
        write(tmp_path / "data" / f"1_bob_{index}.wav", tone(300, 0.2, 8000), 8000)
    kept, held_out = prepare(tmp_path / "data", tmp_path / "cache", min_samples=1000,
                             label_pattern=FSDD_PATTERN, held_out_rule="index==9")
    assert (len(kept), len(held_out)) == (1, 1) and kept.metadata["totals"] == {
        "utterances": 1, "samples": 3200, "dropped": 12}
    assert "12 under examples.min_samples dropped" in capsys.readouterr().out
    with pytest.raises(UserError, match="shorter than examples.min_samples=4000"):
        prepare(tmp_path / "data", tmp_path / "cache", min_samples=4000)


def _bad_files(root: Path) -> dict[str, tuple[Path, str]]:
    stereo = write(root / "stereo.wav", np.stack([tone(200, 0.05, 8000)] * 2, axis=1), 8000)
    empty = write(root / "empty.wav", np.zeros(0, np.float32), 8000)
    text = root / "notes.wav"
    text.write_text("these are notes, not audio\n")
    whole = write(root / "whole.wav", tone(200, 0.5, 8000), 8000).read_bytes()
    truncated = root / "truncated.wav"
    truncated.write_bytes(whole[:len(whole) // 2])
    flac = write(root / "whole.flac", np.random.default_rng(0).uniform(-0.5, 0.5, 8000)
                 .astype(np.float32), 8000).read_bytes()
    truncated_flac = root / "truncated.flac"
    truncated_flac.write_bytes(flac[:len(flac) // 2])
    return {"stereo": (stereo, "2 channels"), "empty": (empty, "no audio samples"),
            "text": (text, "not readable audio"), "truncated": (truncated, "truncated"),
            "truncated flac": (truncated_flac, "truncat|not readable")}


@pytest.mark.parametrize("case", ["stereo", "empty", "text", "truncated", "truncated flac"])
def test_bad_audio_is_a_one_line_error_naming_the_file(tmp_path, case):
    path, message = _bad_files(tmp_path / "bad")[case]
    data = tmp_path / "data"
    fsdd_like(data, digits=1, indices=2)
    (data / path.name).write_bytes(path.read_bytes())
    with pytest.raises(UserError) as error:
        prepare(data, tmp_path / "cache", fraction=0.1)
    text = str(error.value)
    assert str(data / path.name) in text and len(text.splitlines()) == 1, text
    assert re.search(message, text), text
    assert not list((tmp_path / "cache").rglob("*.tmp"))  # no half-written records left


def test_downmix_averages_the_channels(tmp_path):
    left, right = tone(200, 0.05, 16000), tone(300, 0.05, 16000)
    path = write(tmp_path / "stereo.wav", np.stack([left, right], axis=1), 16000, "FLOAT")
    samples, _ = audio.read_audio(path, downmix=True)
    np.testing.assert_allclose(samples, (left + right) / 2, atol=1e-6)


def test_a_missing_extra_names_it(tmp_path, monkeypatch):
    path = write(tmp_path / "a.wav", tone(200, 0.05, 8000), 8000)
    monkeypatch.setitem(sys.modules, "soundfile", None)
    with pytest.raises(UserError, match=r"pip install 'pretext-jax\[audio\]'"):
        audio.read_audio(path)


def test_tfds_audio_dataset_is_read_with_its_labels_and_rate(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    from tfds_utils import build_audio_dataset

    rng = np.random.default_rng(0)
    clips = {"train": [ramp(0, 400 + 40 * i) for i in range(8)],
             "test": [(rng.standard_normal(300) * 3000).astype(np.int16) for _ in range(3)]}
    build_audio_dataset(tmp_path / "tfds", "tiny_digits", clips, sample_rate=8000, classes=3)
    config = audio.AudioExampleConfig(max_samples=2000)
    train, held_out = audio.prepare_audio("tfds:tiny_digits", "", tmp_path / "cache", config,
                                          held_out_fraction=0.25, seed=0,
                                          tfds_data_dir=str(tmp_path / "tfds"))
    assert (len(train), len(held_out)) == (8, 3) and train.label_fields == ("label",)
    training = train.examples(range(8))
    order = np.argsort(training["attention_mask"].sum(1))
    assert training["attention_mask"].sum(1)[order].tolist() == [
        2 * (400 + 40 * i) for i in range(8)]  # 8 kHz -> 16 kHz
    assert training["label"][order].tolist() == [i % 3 for i in range(8)]
    assert held_out.evaluation_examples(10)["label"].tolist() == [0, 1, 2]
    assert "tfds:tiny_digits[train]" in repr(train.source)
    # Without a test split, a seeded fraction of the training split is held out.
    build_audio_dataset(tmp_path / "tfds", "only_train", {"train": clips["train"]},
                        sample_rate=16000, classes=2)
    train, held_out = audio.prepare_audio("tfds:only_train", "", tmp_path / "cache", config,
                                          held_out_fraction=0.25, seed=0,
                                          tfds_data_dir=str(tmp_path / "tfds"))
    assert (len(train), len(held_out)) == (6, 2)
    with pytest.raises(UserError, match="apply to file names"):
        audio.prepare_audio("tfds:only_train", "", tmp_path / "cache", audio.AudioExampleConfig(
            held_out_rule="label<1"), held_out_fraction=0.25, seed=0,
            tfds_data_dir=str(tmp_path / "tfds"))


def test_real_free_spoken_digit_dataset(shared_data, tmp_path):
    """FSDD (README: 3,000 recordings, 6 speakers, digits 0-9; indices 0-4 are the official
    test set): counts from the file names, then two speakers' recordings prepared and read."""
    fsdd = shared_data / "fsdd"
    if not (fsdd / "recordings").is_dir():
        pytest.skip(f"{fsdd}/recordings not found")
    config = audio.AudioExampleConfig(label_pattern=FSDD_PATTERN, held_out_rule="index<5",
                                      max_samples=16000)
    plan = audio.plan_audio(str(fsdd), "", config, held_out_fraction=0.1, seed=0)
    assert len(plan.train) + len(plan.held_out) == 3000 and len(plan.held_out) == 300
    assert len(plan.vocabularies["speaker"]) == 6
    labels = [plan.train.read.labels[p] for p in plan.train.keys]
    assert {row["digit"] for row in labels} == set(range(10))
    assert {row["index"] for row in labels} == set(range(5, 50))
    subset = str(fsdd / "recordings" / "*_[jt]*_*.wav")  # jackson and theo: 1,000 files
    train, held_out = audio.prepare_audio(subset, "", tmp_path / "cache", config,
                                          held_out_fraction=0.1, seed=0)
    assert (len(train), len(held_out)) == (900, 100)
    assert train.vocabularies == {"speaker": ["jackson", "theo"]}
    batch = next(iter(make_loader(train, batch_size=8, seed=0)))
    assert batch["audio"].shape == (8, 16000) and set(batch) == {
        "audio", "attention_mask", "digit", "speaker", "index"}
    lengths = batch["attention_mask"].sum(1)
    assert ((lengths >= 0.14 * 16000 - 2) & (lengths <= 16000)).all()  # 0.14-2.28 s at 16 kHz
    assert np.abs(batch["audio"]).max() <= 1.0
