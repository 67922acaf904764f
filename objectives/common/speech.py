"""What the speech methods (wav2vec 2.0, HuBERT, CPC) share: their data preparation from the audio
source (`input_pipeline.audio`) and the downstream measure of their representations.

The measure is a linear probe on frozen features, as CPC §3.1 evaluates speaker
classification ("a linear classifier on top of these features") and SUPERB probes wav2vec 2.0:
each utterance's first `examples.probe_samples` samples go through the network, the real frames
of one layer (`examples.probe_layer`, indexed as the method's `probe_layers`) are averaged over
time, and a multinomial logistic regression (`evaluation.linear_probe_accuracy`) fitted on
the training utterances classifies the held-out ones (at most `examples.probe_examples` of
each, evenly spaced), once per label in `examples.probe_labels` (FSDD: the spoken digit and the
speaker). The same probe on the mean MFCCs of the same windows (`mfcc_means`) is the
hand-made baseline, computed once while preparing; the CLI adds the same network untrained.

Also wav2vec 2.0's span masks (`span_mask`, fairseq's `compute_mask_indices`), which
pre-training (wav2vec 2.0's and HuBERT's) draws over frames and CTC fine-tuning over frames and
channels, and the feature penalty both pre-training losses add.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.audio import (
    AudioExampleConfig,
    AudioRecords,
    ShortestCropBatches,
    held_out_rule,
    mfcc_means,
    prepare_audio,
)
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.models.wav2vec2 import SpeechEncoderConfig, Wav2Vec2Body, feature_lengths
from pretext_jax.objectives.common.evaluation import linear_probe_accuracy
from pretext_jax.objectives.registry import (
    PreparedData,
    Segment,
    Segments,
    Summarize,
    summary_of,
)
from pretext_jax.progress import progress

PROBE_BATCH = 32  # utterances per feature batch (fixed, so one compiled shape)
# (model, audio [B, S], attention_mask [B, S], layer) -> (features [B, T, D], frames [B, T])
LayerOutput = Callable[[Any, jax.Array, jax.Array, int], tuple[jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class ProbeData:
    """The records the probes read (`PreparedData.monitor_data`): which utterances fit the
    probe (`train_indices` of `train`), which it classifies (`held_out_indices` of
    `held_out`), the label fields probed and the window length."""

    train: AudioRecords
    train_indices: list[int]
    held_out: AudioRecords
    held_out_indices: list[int]
    labels: tuple[str, ...]
    samples: int

    def batches(self, split: str) -> Iterator[dict[str, np.ndarray]]:
        """The split's probe windows, `PROBE_BATCH` utterances at a time."""
        records, indices = ((self.train, self.train_indices) if split == "train"
                            else (self.held_out, self.held_out_indices))
        for start in range(0, len(indices), PROBE_BATCH):
            yield records.examples(indices[start:start + PROBE_BATCH], self.samples)

    def accuracies(self, features: Callable[[dict[str, np.ndarray]], np.ndarray]
                   ) -> dict[str, float]:
        """{label: held-out accuracy} of one probe per label on `features(batch)` [b, D];
        the classes are 0 .. the largest label either split holds."""
        pooled, labels = {}, {}
        for split in ("train", "held_out"):
            count = len(self.train_indices if split == "train" else self.held_out_indices)
            batches = progress(self.batches(split), f"probe features ({split})",
                               total=-(-count // PROBE_BATCH), unit="batch")
            parts = [(features(batch), {name: batch[name] for name in self.labels})
                     for batch in batches]  # no waveforms kept
            pooled[split] = np.concatenate([part[0] for part in parts])
            labels[split] = {name: np.concatenate([part[1][name] for part in parts])
                             for name in self.labels}
        return {name: linear_probe_accuracy(
                    pooled["train"], labels["train"][name], pooled["held_out"],
                    labels["held_out"][name],
                    int(max(labels["train"][name].max(), labels["held_out"][name].max())) + 1)
                for name in self.labels}


def probed_labels(records: AudioRecords, examples: AudioExampleConfig) -> tuple[str, ...]:
    """`examples.probe_labels`, checked against the records' labels; by default every label
    except the one `examples.held_out_rule` splits by (FSDD: digit and speaker, not index)."""
    if examples.probe_labels:
        names = tuple(name.strip() for name in examples.probe_labels.split(","))
        unknown = [name for name in names if name not in records.label_fields]
        if unknown:
            raise UserError(f"examples.probe_labels={examples.probe_labels!r} names "
                            f"{', '.join(unknown)}, not a label of the audio (it has "
                            f"{', '.join(records.label_fields) or 'none'}); name those, or "
                            "give labels with examples.label_pattern")
        return names
    split_by = held_out_rule(examples.held_out_rule)[0] if examples.held_out_rule else ""
    return tuple(name for name in records.label_fields if name != split_by)


def probe_data(train: AudioRecords, held_out: AudioRecords, examples: AudioExampleConfig
               ) -> ProbeData | None:
    """What the probes read, or None where the audio has no labels to probe."""
    labels = probed_labels(train, examples)
    if not labels:
        return None
    return ProbeData(train, train.spaced_indices(examples.probe_examples), held_out,
                     held_out.spaced_indices(examples.probe_examples), labels,
                     examples.probe_samples or examples.max_samples)


def prepare_speech(data: DataConfig, examples: AudioExampleConfig, cache_dir: Path,
                   seed: int) -> PreparedData:
    """Audio records (`input_pipeline.audio.prepare_audio`) as `speech_data`."""
    train, held_out = prepare_audio(data.source, data.eval_source, cache_dir, examples,
                                    held_out_fraction=data.held_out_fraction, seed=seed,
                                    tfds_split=data.tfds_split,
                                    tfds_data_dir=data.tfds_data_dir or None)
    return speech_data(train, held_out, examples)


def speech_data(train: AudioRecords, held_out: AudioRecords, examples: AudioExampleConfig
                ) -> PreparedData:
    """Random `max_samples` crops of `train` for training, the first window of at most
    `max_eval_examples` `held_out` utterances for evaluation, the probes' records and the MFCC
    baseline's accuracies (`report`: `mfcc_probe_<label>_accuracy`)."""
    probes = probe_data(train, held_out, examples)
    report = {}
    if probes is not None:
        mfcc = probes.accuracies(lambda batch: mfcc_means(batch["audio"], batch["attention_mask"],
                                                          examples.sample_rate))
        report = {f"mfcc_probe_{name}_accuracy": value for name, value in mfcc.items()}
    return PreparedData(train=train, eval=held_out.evaluation_examples(examples.max_eval_examples),
                        monitor_data=probes, report=report)


@functools.partial(nnx.jit, static_argnames=("layer_output", "layer"))
def pooled_features(model: nnx.Module, audio: jax.Array, attention_mask: jax.Array,
                    layer_output: LayerOutput, layer: int) -> jax.Array:
    """[B, D]: `layer_output`'s features of `layer`, averaged over each utterance's real
    frames; module-level, so every evaluation reuses the compiled function."""
    features, frames = layer_output(model, audio, attention_mask, layer)
    weights = frames.astype(jnp.float32)[..., None]  # [B, T, 1]
    return (jnp.sum(features.astype(jnp.float32) * weights, axis=1)
            / jnp.maximum(jnp.sum(weights, axis=1), 1.0))


def probe_monitor(layer_output: LayerOutput) -> Callable[..., dict[str, float]]:
    """An `Evaluation.monitor`: `probe_<label>_accuracy` of the linear probe on the frozen, pooled
    features of `examples.probe_layer` (module docstring); nothing where there are no labels."""

    def monitor(model: nnx.Module, data: PreparedData, examples: AudioExampleConfig,
                objective: Any) -> dict[str, float]:
        del objective
        probes: ProbeData | None = data.monitor_data
        if probes is None:
            return {}

        def features(batch: dict[str, np.ndarray]) -> np.ndarray:
            count = len(batch["audio"])
            padding = ((0, PROBE_BATCH - count), (0, 0))  # one shape for every batch
            pooled = pooled_features(model, jnp.asarray(np.pad(batch["audio"], padding)),
                                     jnp.asarray(np.pad(batch["attention_mask"], padding)),
                                     layer_output, examples.probe_layer)
            return np.asarray(jax.device_get(pooled))[:count]

        return {f"probe_{name}_accuracy": value
                for name, value in probes.accuracies(features).items()}

    return monitor


def check_probe_layer(examples: AudioExampleConfig, num_layers: int) -> None:
    """`examples.probe_layer` indexes one of the `num_layers` outputs (negative from the end)."""
    if not -num_layers <= examples.probe_layer < num_layers:
        raise UserError(f"examples.probe_layer={examples.probe_layer} is not one of this "
                        f"network's {num_layers} probe layers (0 .. {num_layers - 1}, or "
                        "negative from the end); e.g. examples.probe_layer=-1")


def probe_summary(metrics: tuple[str, ...]) -> Summarize:
    """`summary_of(metrics=...)`, then per probed label the held-out probe accuracy of the
    trained network beside the same network untrained and the MFCC baseline."""
    held_out = summary_of(metrics=metrics)

    def summarize(evaluation: dict[str, float], report: dict[str, Any],
                  untrained: Callable[[], dict[str, float]]) -> list[str]:
        lines = held_out(evaluation, report, untrained)
        probed = [key for key in evaluation if key.startswith("probe_")]
        if probed:
            baseline = untrained()
            lines.append("  held-out linear probe on frozen features (mean over time):")
        for key in probed:
            label = key.removeprefix("probe_").removesuffix("_accuracy")
            line = (f"    {label}: {evaluation[key]:.3f} trained vs {baseline[key]:.3f} "
                    "untrained")
            mfcc = report.get(f"mfcc_{key}")
            lines.append(line + (f" vs {mfcc:.3f} MFCC" if mfcc is not None else ""))
        return lines

    return summarize


def probe_layers(model: Wav2Vec2Body, audio: jax.Array, attention_mask: jax.Array, layer: int
                 ) -> tuple[jax.Array, jax.Array]:
    """The probes' features of wav2vec 2.0 and HuBERT: the Transformer's hidden states as HF
    numbers them (0 = its input, L = its last block's output), with the real frames."""
    hidden_states, frames = model.hidden_states(audio, attention_mask)
    return hidden_states[layer], frames


def check_frames(model: SpeechEncoderConfig, examples: AudioExampleConfig, objective: Any = None
                 ) -> None:
    """A `max_samples` window makes at least one frame through the feature encoder; the
    probes read one of the L + 1 hidden states."""
    check_probe_layer(examples, model.num_layers + 1)
    if feature_lengths(model, examples.max_samples) < 1:
        raise UserError(f"examples.max_samples={examples.max_samples} is shorter than the "
                        "feature encoder's receptive field (no frame); raise it (wav2vec 2.0: "
                        "250000)")


# --- Span masks (wav2vec 2.0 pre-training and CTC fine-tuning) -----------------------------

@dataclasses.dataclass(frozen=True)
class SpanSettings:
    """Host-side span masking of frames (fairseq `compute_mask_indices`; wav2vec 2.0 BASE:
    mask_prob 0.65 over spans of 10, i.e. 0.065 of the frames start a span)."""

    mask_start_fraction: float = 0.065
    """p, the fraction of an utterance's frames that start a masked span (wav2vec 2.0 §4.2
    0.065; HF `mask_time_prob` / fairseq `mask_prob` = p x mask_span = 0.65)."""
    mask_span: int = 10
    """M, frames masked from each start (paper 10; HF `mask_time_length`)."""
    min_spans: int = 2
    """Fewest spans per utterance that has room for them (HF `mask_time_min_masks` 2)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.mask_start_fraction < 1.0:
            raise ValueError(f"mask_start_fraction={self.mask_start_fraction} must be in (0, 1) "
                             "(wav2vec 2.0: 0.065)")
        if self.mask_span < 1:
            raise ValueError(f"mask_span={self.mask_span} must be >= 1")
        if self.min_spans < 0:
            raise ValueError(f"min_spans={self.min_spans} must be >= 0")


@dataclasses.dataclass(frozen=True)
class MaskingSettings(SpanSettings):
    """Span masks (`SpanSettings`) and wav2vec 2.0's distractor sampling (fairseq BASE: 100
    negatives)."""

    num_negatives: int = 100
    """K, distractors per masked frame, from the same utterance's masked frames (paper 100)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_negatives < 1:
            raise ValueError(f"num_negatives={self.num_negatives} must be >= 1")


def span_mask(frame_lengths: np.ndarray, num_frames: int, settings: SpanSettings,
              rng: np.random.Generator, same_count: bool = False) -> np.ndarray:
    """[B, T] bool, True = masked, for utterances of `frame_lengths` real frames (right-padded
    to `num_frames`), as fairseq's `compute_mask_indices` draws them for wav2vec2.py (static
    spans, overlapping, `num_mask_ver` 2, `idc_select_ver` 1): per utterance of n frames,
    int(p n + u) spans (u ~ U[0, 1) per utterance), at least `min_spans`; distinct starts
    uniform over [0, n - M), each masking M frames (spans overlap). `same_count` (fairseq
    `require_same_masks`): every row keeps as many masked frames as the row with fewest, its
    others unmasked at random. An utterance of no more than M + count frames gets no mask
    (fairseq falls back to count + 1 start places there, which can mask all of it, and then
    raises)."""
    span = settings.mask_span
    masked = []
    for length in np.asarray(frame_lengths, np.int64).tolist():
        count = max(int(settings.mask_start_fraction * length + rng.random()),
                    settings.min_spans)
        if length - span <= count:
            masked.append(np.zeros(0, np.int64))
            continue
        starts = rng.choice(length - span, count, replace=False)
        masked.append(np.unique(starts[:, None] + np.arange(span)))
    if same_count and masked:
        fewest = min(len(frames) for frames in masked)
        masked = [rng.choice(frames, fewest, replace=False) if len(frames) > fewest else frames
                  for frames in masked]
    mask = np.zeros((len(masked), num_frames), bool)
    for row, frames in enumerate(masked):
        mask[row, frames] = True
    return mask


def group_span_mask(frames: int, settings: SpanSettings, row: int, rows: int,
                    group_rng: np.random.Generator) -> np.ndarray:
    """[frames] bool: the mask of row `row` of a group of `rows` equally long rows of a batch
    cropped to its shortest utterance, drawn as fairseq's `compute_mask_indices` draws them
    over one GPU's batch with `require_same_masks`: every row of the group keeps the fewest
    masked frames of any (`span_mask(same_count=True)`). The group's masks come from
    `group_rng`, seeded by the group's place alone, so a row draws them without its
    neighbours' audio, the same in every worker and after a resume."""
    return span_mask(np.full(rows, frames), frames, settings, group_rng, same_count=True)[row]


def check_batch_groups(batch_groups: int, config: Any) -> None:
    """A micro-batch (train.batch_size / optim.grad_accum_steps rows) splits into
    `batch_groups` groups of rows (wav2vec 2.0's and HuBERT's per-GPU batches)."""
    micro = config.train.batch_size // config.optim.grad_accum_steps
    if micro % batch_groups:
        raise UserError(f"a micro-batch of {micro} rows (train.batch_size / "
                        f"optim.grad_accum_steps) does not split into objective.batch_groups="
                        f"{batch_groups} groups; use a multiple of it")


def shortest_crop_segments(
    records: AudioRecords, batch_groups: int,
    finish: Callable[[int, int], Callable[[dict[str, np.ndarray], int, int, int],
                                          dict[str, np.ndarray]]]) -> Segments:
    """`PreparedData.segments` of batches cropped to their shortest utterance
    (`examples.crop_to_shortest`): the whole run reads `ShortestCropBatches` of the run's batch
    size and seed, in order, each row completed by `finish(rows, seed)` (wav2vec 2.0's
    `GroupMasks`, HuBERT's targets and masks), `rows` = train.batch_size /
    optim.grad_accum_steps / `batch_groups`, the rows of a batch group."""

    def segment(step: int, config: Any) -> Segment:
        del step
        rows = config.train.batch_size // config.optim.grad_accum_steps // batch_groups
        source = ShortestCropBatches(records, config.examples, config.train.batch_size,
                                     config.train.seed, finish(rows, config.train.seed))
        return Segment(first_step=1, last_step=None, records=lambda model: source,
                       shuffle=False)

    return segment


def feature_penalty(conv_features: jax.Array, groups: int = 1) -> jax.Array:
    """[groups]: the mean square of the feature encoder's output (fairseq `features_pen` of
    wav2vec2.py and hubert.py) over each group of B / `groups` consecutive rows of
    `conv_features` [B, T, C]."""
    squares = jnp.square(conv_features.astype(jnp.float32))
    return jnp.mean(squares.reshape(groups, -1), axis=1)
