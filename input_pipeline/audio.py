"""Audio sources for the speech methods (wav2vec 2.0, CPC): mono waveforms at the model's
sample rate, cropped to a fixed length while loading.

Sources (`plan_audio`):

- a folder of audio files, searched recursively (wav, flac, ogg/opus, mp3, aiff, au: whatever
  libsndfile decodes through `soundfile`), or a glob of them (`**` recursive);
- a prepared TFDS audio dataset by name (`tfds:spoken_digit`): its `audio` feature (16-bit
  sample values as integers, or floats in [-1, 1]) and integer `label`, at the rate its
  features info gives, read from its ArrayRecord files (`sources.open_tfds`, never downloaded).

Labels (int32 fields of every batch): `AudioExampleConfig.label_pattern`'s named groups, searched
in each file name (FSDD: `(?P<digit>\\d)_(?P<speaker>[a-z]+)_(?P<index>\\d+)`): a group whose
values are all integers keeps them, any other is numbered in the sorted order of its values;
with no pattern, the class folders of `root/<class>/**` give `label` (two or more folders and no
audio directly in `root`), else there are no labels. TFDS datasets give their `label`.

Held out for evaluation: `eval_source` (another folder or glob); or `root/train` beside
`root/val|validation|test`; or `held_out_rule` on a label (`index<5` is FSDD's official split:
indices 0-4 are its test set); or a seeded `held_out_fraction` of the files. A TFDS dataset holds
out its `test` or `validation` split, else a seeded fraction of its records.

Preparation (`prepare_audio`) streams every utterance once: decode, check, resample to
`sample_rate` with soxr (`HQ`), store as int16 samples (x 32768, the 16-bit PCM scale) with its
labels in ArrayRecord (`records.write_records`, the waveform a variable-length feature) under a
fingerprint of the files and the settings that decide the records, so later runs reuse them.
Loading (`AudioRecords`) crops a random `max_samples` window of a longer utterance (fairseq
`RawAudioDataset.crop_to_max_size`), pads a shorter one with zeros and marks real samples in
`attention_mask`; held-out utterances give their first `max_samples`. `ShortestCropBatches`
instead batches utterances of similar length and crops every row to its batch's shortest
(fairseq's pre-training, `AudioBatchingConfig.crop_to_shortest`): no padding and no mask;
`budget_crop_batches` does so in batches of a samples budget whose row count varies with their
length (fairseq's `max_tokens`, `AudioBatchingConfig.samples_per_batch`).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grain
import numpy as np

from pretext_jax.errors import UserError, require
from pretext_jax.input_pipeline.descriptions import describe, files_fingerprint
from pretext_jax.input_pipeline.prepare import fingerprint
from pretext_jax.input_pipeline.records import (
    SPEC_FILE,
    UNENDING,
    RecordDirectory,
    write_records,
)
from pretext_jax.input_pipeline.sources import TfdsSplit, open_tfds, tfds_builder, tfds_fingerprint
from pretext_jax.input_pipeline.token_batches import Finish, TokenBudgetBatches, bucket_lengths

AUDIO_SUFFIXES = frozenset({".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aif", ".aiff",
                            ".aifc", ".au", ".w64", ".caf"})
EVAL_SPLIT_NAMES = ("val", "validation", "test")
PCM16_SCALE = 32768.0  # stored int16 sample = round(x * 32768), x in [-1, 1)
NORMALIZE_EPSILON = 1e-5  # fairseq: F.layer_norm over the utterance (eps 1e-5)
_RULE = re.compile(r"\s*(\w+)\s*(<=|>=|==|!=|<|>)\s*(\S+)\s*")
_INTEGER = re.compile(r"[+-]?\d+")
# libsndfile's log line for a WAV data chunk that promises more bytes than the file holds.
_TRUNCATED_DATA = re.compile(r"^data\s*:\s*\d+ \(should be \d+\)", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class AudioExampleConfig:
    """How utterances are prepared (`sample_rate`, `min_samples`, `label_pattern`,
    `held_out_rule`, `downmix`: part of the records' fingerprint) and loaded (`max_samples`,
    `normalize`, `max_eval_examples`). Defaults are wav2vec 2.0 base's (fairseq
    wav2vec2_base_librispeech.yaml: 16 kHz, max_sample_size 250,000, normalize false)."""

    sample_rate: int = 16000
    """The model's rate in Hz; every utterance is resampled to it (wav2vec 2.0: 16,000)."""
    max_samples: int = 250_000
    """Training crop: a random window of this many samples; shorter utterances are padded."""
    min_samples: int = 0
    """Utterances shorter than this (after resampling) are dropped at preparation (fairseq's
    min_sample_size; wav2vec 2.0 base 32,000); 0 keeps all, padding short ones."""
    normalize: bool = False
    """Zero mean, unit variance per utterance (fairseq normalize, HF do_normalize; base: false)."""
    label_pattern: str = ""
    """Regex with named groups searched in each file name, one label per group; empty = class
    folders (or no labels)."""
    held_out_rule: str = ""
    """Hold out the files whose label satisfies GROUP OP VALUE (OP one of < <= > >= == !=),
    e.g. index<5 (FSDD's official test set); empty = data.eval_source or held_out_fraction."""
    downmix: bool = False
    """Average the channels of multi-channel files; false = such a file is an error."""
    max_eval_examples: int = 1000
    """Most held-out utterances evaluated (evenly spaced; each max_samples floats in memory)."""
    probe_labels: str = ""
    """Comma-separated label fields that the linear probes classify from frozen features
    (`objectives.common.speech`), e.g. digit,speaker; empty = every label but `held_out_rule`'s."""
    probe_layer: int = -1
    """Which layer's output the probes pool, indexed as the method's `probe_layers` (wav2vec
    2.0: 0 = the Transformer's input .. L = its last block; CPC: 0 = z, 1 = c); -1 = last."""
    probe_samples: int = 0
    """The probes' window: the first this many samples of each utterance (0 = max_samples)."""
    probe_examples: int = 5000
    """Most utterances of each split (evenly spaced) that the probes fit on and classify."""

    def __post_init__(self) -> None:
        if self.sample_rate < 1000:
            raise UserError(f"examples.sample_rate={self.sample_rate} must be at least 1000 Hz; "
                            "e.g. examples.sample_rate=16000")
        if self.max_samples < 1:
            raise UserError(f"examples.max_samples={self.max_samples} must be >= 1; e.g. "
                            "examples.max_samples=250000")
        if self.min_samples < 0:
            raise UserError(f"examples.min_samples={self.min_samples} must be >= 0 (0 keeps "
                            "every utterance)")
        if self.max_eval_examples < 1:
            raise UserError(f"examples.max_eval_examples={self.max_eval_examples} must be >= 1")
        if self.probe_samples < 0:
            raise UserError(f"examples.probe_samples={self.probe_samples} must be >= 0 (0 = "
                            "examples.max_samples)")
        if self.probe_examples < 1:
            raise UserError(f"examples.probe_examples={self.probe_examples} must be >= 1")
        groups = self.label_groups()
        if self.held_out_rule:
            field = held_out_rule(self.held_out_rule)[0]
            known = groups or ("label",)
            if field not in known:
                raise UserError(f"examples.held_out_rule={self.held_out_rule!r} names {field}, "
                                f"not a label ({', '.join(known)}); use one of them")

    def label_groups(self) -> tuple[str, ...]:
        """The named groups of `label_pattern` (a UserError if it is not a regex with some)."""
        if not self.label_pattern:
            return ()
        try:
            pattern = re.compile(self.label_pattern)
        except re.error as e:
            raise UserError(f"examples.label_pattern={self.label_pattern!r} is not a regex "
                            f"({e}); fix it, e.g. (?P<digit>\\d)_(?P<speaker>[a-z]+)") from None
        if not pattern.groupindex:
            raise UserError(f"examples.label_pattern={self.label_pattern!r} has no named group; "
                            "name each label, e.g. (?P<digit>\\d)_(?P<speaker>[a-z]+)")
        return tuple(pattern.groupindex)

    def record_settings(self) -> dict[str, Any]:
        """The settings that decide the prepared records (the rest only change loading)."""
        return {"sample_rate": self.sample_rate, "min_samples": self.min_samples,
                "label_pattern": self.label_pattern, "held_out_rule": self.held_out_rule,
                "downmix": self.downmix}


@dataclasses.dataclass(frozen=True)
class AudioBatchingConfig(AudioExampleConfig):
    """`AudioExampleConfig` plus how training batches are formed (wav2vec 2.0): one padded
    `max_samples` crop per row, or fairseq's pre-training batches (`ShortestCropBatches`, of a
    samples budget: `budget_crop_batches`)."""

    crop_to_shortest: bool = False
    """Training batches of utterances of similar length, every row a random window of its
    batch's shortest utterance (at most max_samples): no padding (fairseq pre-training,
    RawAudioDataset pad=False); false = one padded max_samples crop per row."""
    length_buckets: int = 8
    """With crop_to_shortest: a batch's length is rounded down to one of at most this many
    lengths (percentiles of the utterances' lengths), so at most this many batch shapes
    compile; 0 = the exact shortest (fairseq: a shape per distinct length)."""
    samples_per_batch: int = 0
    """With crop_to_shortest: batches of at most this many samples (rows x their cropped
    length), their row count varying with the length (fairseq's max_tokens, summed over the
    GPUs: wav2vec 2.0 base 1.4M x 64; `input_pipeline.token_batches`); 0 = train.batch_size
    rows per step."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.length_buckets < 0:
            raise UserError(f"examples.length_buckets={self.length_buckets} must be >= 0 (0 = "
                            "the exact shortest length), e.g. examples.length_buckets=8")
        if self.samples_per_batch < 0 or self.samples_per_batch and not (
                self.crop_to_shortest and self.length_buckets):
            raise UserError(f"examples.samples_per_batch={self.samples_per_batch} needs "
                            "examples.crop_to_shortest=true and examples.length_buckets >= 1 "
                            "(0 = fixed rows); e.g. examples.samples_per_batch=89600000")


def held_out_rule(rule: str) -> tuple[str, str, str]:
    """(label, operator, value) of `GROUP OP VALUE`; order comparisons need an integer."""
    match = _RULE.fullmatch(rule)
    if not match or (match[2] not in ("==", "!=") and not _INTEGER.fullmatch(match[3])):
        raise UserError(f"examples.held_out_rule={rule!r} is not LABEL OP VALUE; write e.g. "
                        "index<5 or speaker==theo (< <= > >= compare integers)")
    return match[1], match[2], match[3]


def _satisfies(value: str, operator: str, bound: str) -> bool:
    """Whether a label's text satisfies `operator bound`: integers compare as numbers, other
    text only with == and != (`held_out_rule` checks that)."""
    if _INTEGER.fullmatch(value) and _INTEGER.fullmatch(bound):
        left, right = int(value), int(bound)
        return {"<": left < right, "<=": left <= right, ">": left > right, ">=": left >= right,
                "==": left == right, "!=": left != right}[operator]
    return (value == bound) == (operator == "==")


# ------------------------------------------------------------------------ decode and resample
def _soundfile() -> Any:
    return require("soundfile", "audio", "reading audio")


def to_mono(samples: np.ndarray, name: str, downmix: bool) -> np.ndarray:
    """[n] or [n, channels] samples as [n]: one channel as it is, several averaged when
    `downmix`, else a UserError naming the file."""
    if samples.ndim == 1 or samples.shape[1] == 1:
        return samples.reshape(-1)
    if not downmix:
        raise UserError(f"{name} has {samples.shape[1]} channels, not one; downmix it (sox IN "
                        "OUT remix -) or set examples.downmix=true")
    return samples.mean(axis=1, dtype=np.float32)


def read_audio(path: Path, downmix: bool = False) -> tuple[np.ndarray, int]:
    """(float32 mono samples in [-1, 1], sample rate) of an audio file; a file that is not
    audio, is truncated, is empty or has several channels (unless `downmix`) is a one-line
    UserError naming it."""
    soundfile = _soundfile()
    try:
        with soundfile.SoundFile(str(path)) as audio:
            if _TRUNCATED_DATA.search(audio.extra_info):
                raise UserError(f"{path} is truncated (its header promises more audio than the "
                                "file holds); re-download or re-encode it")
            samples = audio.read(dtype="float32", always_2d=True)
            rate, frames = audio.samplerate, audio.frames
    except (RuntimeError, ValueError, OSError) as e:  # soundfile.LibsndfileError is a RuntimeError
        reason = (getattr(e, "error_string", "") or str(e).replace(f" '{path}'", "")
                  or "libsndfile cannot decode it").strip().removeprefix("Error : ")
        raise UserError(f"{path} is not readable audio ({reason}); remove or re-encode it"
                        ) from None
    if len(samples) == 0:
        raise UserError(f"{path} holds no audio samples; remove it")
    if len(samples) < frames:
        raise UserError(f"{path} is truncated ({len(samples)} of {frames} samples); "
                        "re-download or re-encode it")
    return to_mono(samples, str(path), downmix), rate


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """float32 samples at `rate` resampled to `target` Hz by soxr (quality HQ); unchanged when
    the rates agree."""
    if rate == target:
        return samples
    soxr = require("soxr", "audio", "reading audio")
    return soxr.resample(samples, rate, target, quality="HQ").astype(np.float32, copy=False)


def to_pcm16(samples: np.ndarray) -> np.ndarray:
    """float samples in [-1, 1) as int16 (x 32768, rounded, clipped): how records store them."""
    return np.clip(np.rint(samples * PCM16_SCALE), -32768, 32767).astype(np.int16)


# ------------------------------------------------------------------------------ the plan
Reader = Callable[[Any], tuple[np.ndarray, int, dict[str, int]]]


@dataclasses.dataclass(frozen=True)
class AudioSplit:
    """One split's utterances before any audio is read: `keys` (file paths or TFDS record
    indices) and `read(key)` -> (float32 mono samples, sample rate, label values)."""

    name: str
    keys: Sequence[Any]
    read: Reader

    def __len__(self) -> int:
        return len(self.keys)


@dataclasses.dataclass(frozen=True)
class AudioPlan:
    """What preparation will write: the training and held-out utterances, the label fields
    (in batch order), the values behind categorical labels (`vocabularies[field][id]`), and
    `identity`, the facts that decide the records (source, files, TFDS version)."""

    source: str
    train: AudioSplit
    held_out: AudioSplit
    label_fields: tuple[str, ...]
    vocabularies: dict[str, list[str]]
    identity: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class _FileReader:
    labels: dict[Path, dict[str, int]]
    downmix: bool

    def __call__(self, path: Path) -> tuple[np.ndarray, int, dict[str, int]]:
        samples, rate = read_audio(path, self.downmix)
        return samples, rate, self.labels[path]


def audio_files(spec: str) -> tuple[Path, list[Path]]:
    """(root, the audio files under it, sorted) of a folder (recursive) or a glob (root: the
    matches' common folder); none is a UserError."""
    if any(c in spec for c in "*?[") and not Path(spec).exists():
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True)
                       if Path(p).suffix.lower() in AUDIO_SUFFIXES and Path(p).is_file())
        if not files:
            raise UserError(f"no audio file matches {spec}; check the pattern in data.source "
                            f"({', '.join(sorted(AUDIO_SUFFIXES))})")
        return Path(os.path.commonpath([f.parent for f in files])), files
    root = Path(spec)
    if not root.is_dir():
        raise UserError(f"data.source={spec} is not a folder, a glob or tfds:NAME; point it at "
                        "a folder of audio files")
    files = sorted(p for p in root.rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES
                   and p.is_file() and not any(part.startswith(".") for part in
                                               p.relative_to(root).parts))
    if not files:
        raise UserError(f"{root} has no audio files ({', '.join(sorted(AUDIO_SUFFIXES))}); "
                        "point data.source at a folder of them")
    return root, files


def _class_folders(root: Path, files: list[Path]) -> bool:
    """Whether `root/<class>/**` names the classes: no file directly in root, two or more
    top-level folders."""
    tops = {f.relative_to(root).parts[0] for f in files if len(f.relative_to(root).parts) > 1}
    return len(tops) >= 2 and all(len(f.relative_to(root).parts) > 1 for f in files)


def _label_values(root: Path, files: list[Path], examples: AudioExampleConfig,
                  by_folder: bool) -> list[dict[str, str]]:
    """Each file's label values as text: the pattern's groups, or its class folder."""
    if examples.label_pattern:
        pattern = re.compile(examples.label_pattern)
        values = []
        for path in files:
            match = pattern.search(path.name)
            if match is None or None in match.groupdict().values():
                raise UserError(f"{path} does not match examples.label_pattern="
                                f"{examples.label_pattern!r}; fix the pattern or remove the "
                                "file")
            values.append(match.groupdict())
        return values
    if by_folder:
        return [{"label": path.relative_to(root).parts[0]} for path in files]
    return [{} for _ in files]


def _encode_labels(values: list[dict[str, str]]) -> tuple[list[dict[str, int]],
                                                          dict[str, list[str]]]:
    """Integer labels: a field whose values are all integers keeps them, any other is numbered
    in the sorted order of its values (returned as its vocabulary)."""
    fields = list(values[0]) if values else []
    vocabularies = {field: sorted({v[field] for v in values}) for field in fields
                    if not all(_INTEGER.fullmatch(v[field]) for v in values)}
    ids = {field: {value: i for i, value in enumerate(vocabulary)}
           for field, vocabulary in vocabularies.items()}
    return ([{field: ids[field][v[field]] if field in ids else int(v[field]) for field in fields}
             for v in values], vocabularies)


def _folder_plan(source: str, eval_source: str, examples: AudioExampleConfig,
                 held_out_fraction: float, seed: int) -> AudioPlan:
    """Files, labels and the held-out split of a folder or glob (module docstring)."""
    root = Path(source)
    splits = {d.name: d for d in root.iterdir() if d.is_dir()} if root.is_dir() else {}
    eval_spec = eval_source
    if not eval_spec and "train" in splits and any(n in splits for n in EVAL_SPLIT_NAMES):
        eval_spec = str(splits[next(n for n in EVAL_SPLIT_NAMES if n in splits)])
        source = str(splits["train"])
    root, files = audio_files(source)
    eval_root, eval_files = audio_files(eval_spec) if eval_spec else (root, [])
    by_folder = not examples.label_pattern and _class_folders(root, files)
    if by_folder and eval_files and not _class_folders(eval_root, eval_files):
        raise UserError(f"{root} has class folders, {eval_root} does not; give the held-out "
                        "folder the same class folders")
    values = (_label_values(root, files, examples, by_folder)
              + _label_values(eval_root, eval_files, examples, by_folder))
    if examples.held_out_rule and eval_files:
        raise UserError(f"{eval_root} already holds the held-out files; drop "
                        f"examples.held_out_rule={examples.held_out_rule!r} or that folder")
    if examples.held_out_rule and not (examples.label_pattern or by_folder):
        raise UserError(f"examples.held_out_rule={examples.held_out_rule!r} needs labels: set "
                        "examples.label_pattern or use class folders")
    labels, vocabularies = _encode_labels(values)
    label_of = dict(zip(files + eval_files, labels, strict=True))
    if not eval_files:
        if examples.held_out_rule:
            field, operator, bound = held_out_rule(examples.held_out_rule)
            if operator not in ("==", "!=") and field in vocabularies:
                raise UserError(f"examples.held_out_rule={examples.held_out_rule!r} compares "
                                f"integers, and {field} has values like "
                                f"{vocabularies[field][0]!r}; use == or !=")
            held = [_satisfies(v[field], operator, bound) for v in values]
        else:
            order = np.random.default_rng(seed).permutation(len(files))
            count = min(max(1, round(len(files) * held_out_fraction)), len(files) - 1)
            held = np.isin(np.arange(len(files)), order[:count]).tolist()
        eval_files = [f for f, h in zip(files, held, strict=True) if h]
        files = [f for f, h in zip(files, held, strict=True) if not h]
        if not files or not eval_files:
            what = "every file" if not files else "no file"
            raise UserError(f"the held-out split of {source} takes {what}; change "
                            "examples.held_out_rule or data.held_out_fraction, or set "
                            "data.eval_source")
    reader = _FileReader(label_of, examples.downmix)
    identity = {"kind": "audio files", "data.source": str(root.resolve()),
                "files": files_fingerprint(root, files, [label_of[f] for f in files]),
                "data.eval_source": str(eval_root.resolve()),
                "held_out_files": files_fingerprint(eval_root, eval_files,
                                                    [label_of[f] for f in eval_files])}
    return AudioPlan(str(source), AudioSplit(str(root), files, reader),
                     AudioSplit(str(eval_root), eval_files, reader),
                     tuple(values[0]) if values else (), vocabularies, identity)


@dataclasses.dataclass(frozen=True)
class _TfdsReader:
    split: TfdsSplit
    rate: int
    downmix: bool

    def __call__(self, index: int) -> tuple[np.ndarray, int, dict[str, int]]:
        record = self.split[index]
        name = f"tfds:{self.split.name}[{self.split.fields['data.tfds_split']}] record {index}"
        samples = np.asarray(record["audio"])
        if samples.size == 0:
            raise UserError(f"{name} holds no audio samples; rebuild the dataset without it")
        if np.issubdtype(samples.dtype, np.integer):
            samples = samples.astype(np.float32) / PCM16_SCALE
        samples = to_mono(samples.astype(np.float32, copy=False), name, self.downmix)
        return samples, self.rate, ({"label": int(record["label"])} if "label" in record else {})


def _tfds_plan(name: str, split: str, data_dir: str | None, examples: AudioExampleConfig,
               held_out_fraction: float, seed: int) -> AudioPlan:
    """A TFDS dataset's training split and its test/validation split (else a seeded fraction
    of the training records); the sample rate from its features info or metadata."""
    if examples.label_pattern or examples.held_out_rule:
        raise UserError("examples.label_pattern and examples.held_out_rule apply to file names; "
                        "a tfds: source gives its label feature and its test split")
    try:
        builder = tfds_builder(name, data_dir)
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("tensorflow"):
            raise
        raise UserError(f"TFDS {name} has an Audio feature, which TFDS builds with TensorFlow "
                        "even to read it; pip install tensorflow-cpu, or give its audio files "
                        "as a folder") from None
    features = dict(builder.info.features.items())  # a FeaturesDict, which has no get()
    feature = features.get("audio")
    rate = getattr(feature, "sample_rate", None) or (builder.info.metadata or {}).get(
        "sample_rate")
    if feature is None or not rate:
        raise UserError(f"TFDS {name} has no audio feature with a sample rate (features: "
                        f"{', '.join(features)}); choose an audio dataset")
    train = open_tfds(name, split, data_dir)
    reader = _TfdsReader(train, rate, examples.downmix)
    keys: Sequence[int] = range(len(train))
    for eval_split in ("test", "validation"):
        if eval_split in builder.info.splits and eval_split != split:
            held_out = open_tfds(name, eval_split, data_dir)
            eval_keys: Sequence[int] = range(len(held_out))
            eval_reader = _TfdsReader(held_out, rate, examples.downmix)
            break
    else:
        order = np.random.default_rng(seed).permutation(len(train))
        count = min(max(1, round(len(train) * held_out_fraction)), len(train) - 1)
        keys, eval_keys = np.sort(order[count:]).tolist(), np.sort(order[:count]).tolist()
        eval_split, eval_reader = split, reader
    labelled = "label" in features
    identity = {"kind": "TFDS audio", "data.source": f"tfds:{name}", **tfds_fingerprint(builder),
                "data.tfds_split": split, "held_out": eval_split}
    if eval_split == split:  # a seeded fraction of the training split
        identity.update({"data.held_out_fraction": held_out_fraction, "seed": seed})
    return AudioPlan(f"tfds:{name}", AudioSplit(f"tfds:{name}[{split}]", keys, reader),
                     AudioSplit(f"tfds:{name}[{eval_split}]", eval_keys, eval_reader),
                     ("label",) if labelled else (), {}, identity)


def plan_audio(source: str, eval_source: str, examples: AudioExampleConfig, *,
               held_out_fraction: float, seed: int, tfds_split: str = "train",
               tfds_data_dir: str | None = None) -> AudioPlan:
    """Which utterances are trained on and held out, with their labels, from file names and
    dataset metadata alone (no audio is read)."""
    if not source:
        raise UserError("data.source must be audio: a folder or glob of audio files or "
                        "tfds:NAME (e.g. --data path/to/fsdd/recordings)")
    if source.startswith("tfds:"):
        if eval_source:
            raise UserError("data.eval_source is for folders; a tfds: source holds out its "
                            "test or validation split (or data.held_out_fraction)")
        return _tfds_plan(source[5:], tfds_split, tfds_data_dir, examples, held_out_fraction,
                          seed)
    return _folder_plan(source, eval_source, examples, held_out_fraction, seed)


# ------------------------------------------------------------------------------- preparation
def _utterances(split: AudioSplit, fields: tuple[str, ...], examples: AudioExampleConfig,
                progress: Any, totals: dict[str, int]) -> Iterator[dict[str, np.ndarray]]:
    """The split's records, one utterance at a time: int16 `audio` [n] at the model's rate and
    an int32 scalar per label field; utterances under `min_samples` are counted and dropped."""
    for key in split.keys:
        samples, rate, labels = split.read(key)
        audio = to_pcm16(resample(samples, rate, examples.sample_rate))
        progress.update()
        if len(audio) < max(examples.min_samples, 1):
            totals["dropped"] += 1
            continue
        totals["utterances"] += 1
        totals["samples"] += len(audio)
        yield {**{field: np.int32(labels[field]) for field in fields}, "audio": audio}
    if not totals["utterances"]:
        raise UserError(f"every utterance of {split.name} is shorter than examples.min_samples="
                        f"{examples.min_samples}; lower it")


def _write_split(split: AudioSplit, directory: Path, plan: AudioPlan,
                 examples: AudioExampleConfig) -> dict[str, int]:
    """Streams the split's utterances into records in `directory`, with a progress bar."""
    from tqdm import tqdm

    totals = {"utterances": 0, "samples": 0, "dropped": 0}
    with tqdm(total=len(split), unit="files", desc=f"preparing {split.name} ({directory.name})",
              dynamic_ncols=True, file=sys.stdout,
              mininterval=1.0 if sys.stdout.isatty() else 30.0) as progress:
        write_records(_utterances(split, plan.label_fields, examples, progress, totals),
                      directory, variable="audio", metadata={
                          "source": split.name, "sample_rate": examples.sample_rate,
                          "label_fields": list(plan.label_fields),
                          "vocabularies": plan.vocabularies,
                          "totals": totals})  # filled as the records stream; stored at the end
    return totals


def prepare_audio(source: str, eval_source: str, cache_root: Path,
                  examples: AudioExampleConfig, *, held_out_fraction: float, seed: int,
                  tfds_split: str = "train", tfds_data_dir: str | None = None
                  ) -> tuple[AudioRecords, AudioRecords]:
    """(training records with random crops, held-out records with fixed windows) of any source
    above (`plan_audio`), prepared once under `cache_root` and reused while the files and the
    record settings are the same. Held-out utterances for in-memory evaluation:
    `held_out.evaluation_examples(examples.max_eval_examples)`."""
    started = time.monotonic()
    plan = plan_audio(source, eval_source, examples, held_out_fraction=held_out_fraction,
                      seed=seed, tfds_split=tfds_split, tfds_data_dir=tfds_data_dir)
    base = Path(cache_root) / fingerprint("audio", plan.identity, examples.record_settings())
    written = {}
    for name, split in (("train", plan.train), ("eval", plan.held_out)):
        if not (base / name / SPEC_FILE).is_file():
            written[name] = _write_split(split, base / name, plan, examples)
    if written:
        hours = sum(t["samples"] for t in written.values()) / examples.sample_rate / 3600
        dropped = sum(t["dropped"] for t in written.values())
        print(f"prepared {plan.source}: "
              + " + ".join(f"{t['utterances']:,} {n}" for n, t in written.items())
              + f" utterances ({hours:.2f} h at {examples.sample_rate} Hz"
              + (f"; {dropped:,} under examples.min_samples dropped" if dropped else "")
              + f") in {time.monotonic() - started:.1f} s", flush=True)
    return (AudioRecords(base / "train", examples, random_crop=True),
            AudioRecords(base / "eval", examples, random_crop=False))


# ----------------------------------------------------------------------------------- loading
def audio_window(audio: np.ndarray, max_samples: int, start: int, normalize: bool
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(float32 [max_samples], int32 attention mask [max_samples]) of int16 `audio`: the
    window from `start`, zero-padded past the utterance's end (mask 0 there). `normalize`:
    zero mean and unit variance over the whole utterance before cropping (fairseq
    RawAudioDataset.postprocess: layer_norm, eps 1e-5)."""
    piece = audio[start:start + max_samples].astype(np.float32) / PCM16_SCALE
    if normalize:
        whole = audio.astype(np.float64) / PCM16_SCALE
        piece = ((piece - whole.mean()) / np.sqrt(whole.var() + NORMALIZE_EPSILON)
                 ).astype(np.float32)
    window = np.zeros(max_samples, np.float32)
    window[:len(piece)] = piece
    mask = np.zeros(max_samples, np.int32)
    mask[:len(piece)] = 1
    return window, mask


def random_start(length: int, max_samples: int, rng: np.random.Generator) -> int:
    """Where a random `max_samples` window of a longer utterance starts, uniform over the
    length - max_samples + 1 choices (fairseq crop_to_max_size); 0 when it is not longer."""
    return int(rng.integers(length - max_samples + 1)) if length > max_samples else 0


class _Window(grain.transforms.RandomMap):
    """A decoded record -> {"audio", "attention_mask", label fields}: a random window
    (`random_crop`, Grain's per-record rng, so deterministic for a seed) or the first one."""

    def __init__(self, fields: Sequence[str], max_samples: int, normalize: bool,
                 random_crop: bool):
        self.fields, self.max_samples = tuple(fields), max_samples
        self.normalize, self.random_crop = normalize, random_crop

    def random_map(self, element: dict[str, np.ndarray], rng: np.random.Generator
                   ) -> dict[str, np.ndarray]:
        start = (random_start(len(element["audio"]), self.max_samples, rng) if self.random_crop
                 else 0)
        return self.example(element, start)

    def example(self, element: dict[str, np.ndarray], start: int) -> dict[str, np.ndarray]:
        """The example of a decoded record whose window starts at `start`."""
        window, mask = audio_window(element["audio"], self.max_samples, start, self.normalize)
        return {"audio": window, "attention_mask": mask,
                **{field: np.int32(element[field]) for field in self.fields}}


class AudioRecords(RecordDirectory):
    """Prepared utterances for the loader: `load_transforms()` decodes a record and cuts its
    `max_samples` window (random for training, the first for held-out records), giving
    `audio` float32 [max_samples], `attention_mask` int32 [max_samples] (1 = real sample) and
    an int32 per label field (`label_fields`; `vocabularies` names categorical ones). The
    source's repr adds the loading settings to the records' description, so a resume with
    other crops is refused."""

    def __init__(self, directory: str | Path, examples: AudioExampleConfig, random_crop: bool):
        super().__init__(directory)
        if self.metadata.get("sample_rate") != examples.sample_rate:
            raise UserError(f"{directory} holds audio at {self.metadata.get('sample_rate')} Hz, "
                            f"not examples.sample_rate={examples.sample_rate}; delete it and "
                            "prepare again")
        self.example_config = examples
        self.label_fields: tuple[str, ...] = tuple(self.metadata["label_fields"])
        self.vocabularies: dict[str, list[str]] = self.metadata["vocabularies"]
        self.window = _Window(self.label_fields, examples.max_samples, examples.normalize,
                              random_crop)
        self.source.description = describe(
            "prepared audio", **{k: v for k, v in json.loads(self.source.description).items()
                                 if k != "kind"},
            **{"examples.max_samples": examples.max_samples,
               "examples.normalize": examples.normalize, "random_crop": random_crop})
        self.earlier_descriptions = ()  # no checkpoint predates audio records' descriptions

    def load_transforms(self) -> list[grain.transforms.Map | grain.transforms.RandomMap]:
        return [*super().load_transforms(), self.window]

    def examples(self, indices: Sequence[int], max_samples: int = 0) -> dict[str, np.ndarray]:
        """Stacked fixed windows at `indices`: the first `max_samples` of each utterance (0 =
        `examples.max_samples`), normalised as for training."""
        window = self.window if not max_samples else _Window(
            self.label_fields, max_samples, self.window.normalize, random_crop=False)
        rows = [window.example(self.spec.decode(self.source[int(i)]), 0) for i in indices]
        return {key: np.stack([row[key] for row in rows]) for key in rows[0]}

    def spaced_indices(self, limit: int) -> list[int]:
        """At most `limit` record indices, evenly spaced over the records."""
        count = min(limit, len(self))
        return np.linspace(0, len(self) - 1, count).round().astype(int).tolist()

    def evaluation_examples(self, limit: int) -> dict[str, np.ndarray]:
        """At most `limit` utterances, evenly spaced over the records, as fixed windows."""
        return self.examples(self.spaced_indices(limit))


@dataclasses.dataclass(frozen=True)
class CropWindow:
    """A decoded record as a row of a batch `length` samples long, cropped to its shortest: a
    window of that length at a random offset (fairseq `crop_to_max_size`), with its label
    fields (`token_batches.TokenBudgetBatches`' `fit`)."""

    label_fields: tuple[str, ...]
    normalize: bool

    def __call__(self, element: dict[str, np.ndarray], length: int, rng: np.random.Generator
                 ) -> dict[str, np.ndarray]:
        return self.at(element, length, random_start(len(element["audio"]), length, rng))

    def at(self, element: dict[str, np.ndarray], length: int, start: int
           ) -> dict[str, np.ndarray]:
        """The window of `length` samples from `start`."""
        window, _ = audio_window(element["audio"], length, start, self.normalize)
        return {"audio": window, **{field: np.int32(element[field])
                                    for field in self.label_fields}}


def budget_crop_batches(records: AudioRecords, examples: AudioBatchingConfig, multiple: int,
                        seed: int, finish: Finish | None = None) -> TokenBudgetBatches:
    """Batches of at most `examples.samples_per_batch` samples cropped to their shortest
    (fairseq's wav2vec 2.0 pre-training batches: `max_tokens` over utterances sorted by size,
    each cropped to the batch's shortest): lengths min(n, max_samples) rounded down to
    `examples.length_buckets` lengths, each bucket's batches as many rows as the budget holds
    in a multiple of `multiple` (`token_batches`, `crop`: a bucket's remainder is cropped into
    the next shorter bucket's batches; only the shortest bucket's is left out)."""
    return TokenBudgetBatches(
        records, np.minimum(records.variable_lengths(), examples.max_samples),
        budget=examples.samples_per_batch, length_buckets=examples.length_buckets,
        multiple=multiple, seed=seed, fit=CropWindow(records.label_fields, examples.normalize),
        finish=finish, crop=True, setting="examples.samples_per_batch")


class ShortestCropBatches:
    """Training rows of batches cropped to their shortest utterance (fairseq
    `RawAudioDataset.collater` with pad=False, as its wav2vec 2.0 pre-training reads audio), a
    random-access source for `records.make_loader` read in order: each `batch_size`
    consecutive keys are one batch.

    Each epoch (`plan`) sorts the utterances by length min(n, max_samples), longest first and
    equal lengths in random order (fairseq `ordered_indices`), cuts the order into batches of
    `batch_size` consecutive utterances (fairseq `batch_by_size` over that order, here with a
    fixed row count) and reads them in random order (fairseq's `EpochBatchIterator` shuffles
    its batches). The N mod batch_size utterances left over are dropped, from a random place in
    the order each epoch (fairseq keeps them as one smaller batch). A batch's length is its
    shortest utterance's, rounded down to a bucket (`bucket_lengths`), and every row is a
    window of that length at a random offset (fairseq `crop_to_max_size`): rows of a batch are
    equally long and hold no padding, so the examples have no `attention_mask`.

    Key k's row depends on (seed, batch_size, k) alone, so the loader's position is the plan's
    and a resumed loader continues it; `finish(example, k, record, start)`, if given, adds what
    a method draws per row from its place in the batch (wav2vec 2.0: masks equal within
    groups) and from the utterance's index and the window's first sample (HuBERT: the
    window's targets)."""

    def __init__(self, records: AudioRecords, examples: AudioBatchingConfig, batch_size: int,
                 seed: int, finish: Callable[[dict[str, np.ndarray], int, int, int],
                                             dict[str, np.ndarray]] | None = None):
        self.records, self.batch_size, self.seed, self.finish = records, batch_size, seed, finish
        self.max_samples, self.normalize = examples.max_samples, examples.normalize
        self.sizes = np.minimum(records.variable_lengths(), examples.max_samples)
        if len(self.sizes) < batch_size:
            raise UserError(f"{len(self.sizes)} training utterances are fewer than one batch "
                            f"(train.batch_size={batch_size}); lower it or give more audio")
        self.length_buckets = examples.length_buckets
        self.buckets = bucket_lengths(self.sizes, examples.length_buckets)
        self.batches_per_epoch = len(self.sizes) // batch_size
        self.source = self
        self._plan: tuple[int, np.ndarray, np.ndarray] | None = None  # the last epoch planned

    def __len__(self) -> int:
        return UNENDING // self.batch_size * self.batch_size

    def plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch `epoch`'s batches in reading order: record indices [batches, batch_size]
        (longest first within a batch) and each batch's length [batches]."""
        if self._plan is not None and self._plan[0] == epoch:
            return self._plan[1], self._plan[2]
        rng = np.random.default_rng([self.seed, epoch])
        count, rows = self.batches_per_epoch, self.batch_size
        ties = rng.permutation(len(self.sizes))
        order = np.lexsort((ties, self.sizes))[::-1]  # longest first, ties in random order
        start = int(rng.integers(len(order) - count * rows + 1))
        batches = order[start:start + count * rows].reshape(count, rows)[rng.permutation(count)]
        lengths = self.sizes[batches[:, -1]]
        if len(self.buckets):
            lengths = self.buckets[np.searchsorted(self.buckets, lengths, side="right") - 1]
        self._plan = (epoch, batches, lengths)
        return batches, lengths

    def __getitem__(self, key: int) -> dict[str, np.ndarray]:
        key = int(key)
        batch, row = divmod(key, self.batch_size)
        epoch, index = divmod(batch, self.batches_per_epoch)
        batches, lengths = self.plan(epoch)
        record, length = int(batches[index, row]), int(lengths[index])
        element = self.records.spec.decode(self.records.source[record])
        start = random_start(len(element["audio"]), length,
                             np.random.default_rng([self.seed, key, 0]))
        example = CropWindow(self.records.label_fields, self.normalize).at(element, length, start)
        return example if self.finish is None else self.finish(example, key, record, start)

    def load_transforms(self) -> list[grain.transforms.Map]:
        return []  # the rows are decoded and cropped here

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_plan": None}  # workers plan their own epochs

    def __repr__(self) -> str:
        return describe("audio batches cropped to their shortest", records=repr(
            self.records.source), batch=self.batch_size, seed=self.seed, **{
            "examples.max_samples": self.max_samples, "examples.normalize": self.normalize,
            "examples.length_buckets": self.length_buckets})


def mfcc_means(audio: np.ndarray, attention_mask: np.ndarray, sample_rate: int,
               num_coefficients: int = 13) -> np.ndarray:
    """[B, num_coefficients] float32: each waveform's MFCCs (librosa: 25 ms Hann windows every
    10 ms, 40 mel bands, log power, DCT-II) averaged over its frames, from its real samples
    (`attention_mask` [B, S], 1 = real) only: the classic hand-made features that learned
    speech representations are compared with."""
    librosa = require("librosa", "audio", "the MFCC baseline")
    window = round(0.025 * sample_rate)
    rows = []
    for samples, mask in zip(audio, attention_mask, strict=True):
        real = samples[:int(mask.sum())].astype(np.float32)
        coefficients = librosa.feature.mfcc(
            y=real, sr=sample_rate, n_mfcc=num_coefficients, n_fft=window,
            hop_length=round(0.010 * sample_rate), n_mels=40)  # [num_coefficients, frames]
        rows.append(coefficients.mean(axis=1))
    return np.stack(rows).astype(np.float32)
