"""HuBERT's pre-training objective (Hsu et al. 2021 §II, §IV-C): masked prediction of
cluster targets.

Reference: fairseq `models/hubert/hubert.py` (`compute_nce`, `compute_pred`, `forward`,
`feature_grad_mult`, `features_pen`), `criterions/hubert_criterion.py` and
`examples/hubert/config/pretrain/hubert_base_librispeech.yaml`.

- Targets: one cluster index per 20 ms frame (`batch["cluster_labels"]` [B, T], -1 where a
  frame has none): k-means of MFCCs (iteration 1, §IV-B) or of a layer's hidden states of the
  iteration-1 model (iteration 2: fairseq simple_kmeans/dump_hubert_feature.py,
  learn_kmeans.py, dump_km_label.py).
- Masking (§IV-C): span masks as wav2vec 2.0's (`objectives.common.speech.span_mask`), with
  fairseq HuBERT's mask_prob 0.8 over spans of 10 (p = 0.08 of the frames start a span).
- Prediction (§II-E): p(c | X~, t) = softmax_c(cos(A o_t, e_c) / tau), tau = 0.1 (fairseq
  `logit_temp`), A `final_proj`, e_c the cluster embeddings. fairseq puts the target first
  among every cluster with the target's own copy at -inf (`compute_nce`), which is the
  softmax over the K clusters.
- Loss (§II-B, eqs. 2-3; fairseq `HubertCriterion`): alpha x the cross-entropy summed over the
  masked frames + (1 - alpha) x over the unmasked ones (`masked_weight` 1.0 and
  `unmasked_weight` 0.0: fairseq `pred_masked_weight` / `pred_nomask_weight`; the paper's
  alpha = 1), plus 10 x the mean square of the feature encoder's output times the frames
  counted (`loss_weights` [10]), all divided by the frames counted (fairseq's `sample_size`:
  the masked frames, plus the unmasked ones when their weight is > 0). The gradient reaching
  the feature encoder is scaled by 0.1 (`feature_grad_mult`).
- Per GPU: `batch_groups` splits a (micro-)batch into groups of consecutive rows, each with
  its own feature penalty (weighted by its share of the counted frames, as fairseq's criterion
  multiplies each GPU's by its `sample_size`) and LayerDrop draws.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError, require
from pretext_jax.input_pipeline.audio import (
    AudioBatchingConfig,
    AudioRecords,
    audio_window,
    prepare_audio,
    random_start,
)
from pretext_jax.input_pipeline.descriptions import describe
from pretext_jax.input_pipeline.mfcc import mfcc_with_deltas
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.models.hubert import Hubert, HubertConfig
from pretext_jax.models.wav2vec2 import Wav2Vec2Body, feature_lengths
from pretext_jax.objectives.common.preset_parts import (
    FAIRSEQ_ROBERTA_OPTIM,
    FSDD_EXAMPLES,
    TINY_SPEECH_ENCODER,
)
from pretext_jax.objectives.common.speech import (
    SpanSettings,
    check_batch_groups,
    check_frames,
    feature_penalty,
    group_span_mask,
    probe_layers,
    probe_monitor,
    probe_summary,
    shortest_crop_segments,
    span_mask,
    speech_data,
)
from pretext_jax.objectives.registry import (
    Batch,
    Evaluation,
    Loader,
    Method,
    Metrics,
    PreparedData,
    Resolution,
    Start,
    register,
    whole_run,
)
from pretext_jax.progress import progress

MFCC_LABEL_RATE = 100  # Hz: 10 ms MFCC frames (fairseq README: label_rate 100 for MFCC targets)
KMEANS_SEED = 0  # learn_kmeans.py's --seed default
HELD_OUT_MASK_SEED = 0  # held-out masks: drawn once, the same in every run


@dataclasses.dataclass(frozen=True)
class HubertLossSettings:
    """The loss's settings (fairseq `hubert_base_librispeech`'s, one batch group)."""

    logit_temperature: float = 0.1
    """tau, dividing the cosine similarities (fairseq `logit_temp` 0.1)."""
    masked_weight: float = 1.0
    """alpha, weight of the cross-entropy on masked frames (fairseq `pred_masked_weight`)."""
    unmasked_weight: float = 0.0
    """Weight of the cross-entropy on unmasked frames (fairseq `pred_nomask_weight`; the
    paper's 1 - alpha = 0)."""
    feature_penalty_weight: float = 10.0
    """Weight of the mean square of the feature encoder's output (fairseq `loss_weights`
    [10])."""
    feature_grad_mult: float = 0.1
    """Scale of the gradient reaching the feature encoder (fairseq 0.1; 1.0 = unscaled)."""
    batch_groups: int = 1
    """Groups of consecutive rows a (micro-)batch is split into, one per GPU of the reference
    (fairseq BASE: 32): each has its own feature penalty, LayerDrop draws and, with
    examples.crop_to_shortest, equal masked counts; 1 = the whole batch."""

    def __post_init__(self) -> None:
        if self.logit_temperature <= 0.0:
            raise ValueError(f"logit_temperature={self.logit_temperature} must be > 0")
        for name in ("masked_weight", "unmasked_weight", "feature_penalty_weight",
                     "feature_grad_mult"):
            if getattr(self, name) < 0.0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.masked_weight == 0.0 and self.unmasked_weight == 0.0:
            raise ValueError("masked_weight and unmasked_weight are both 0, so nothing is "
                             "predicted; HuBERT: masked_weight=1.0")
        if self.batch_groups < 1:
            raise ValueError(f"batch_groups={self.batch_groups} must be >= 1 (1 = the whole "
                             "batch)")


def cluster_cross_entropy(similarity: jax.Array, labels: jax.Array, temperature: float
                          ) -> tuple[jax.Array, jax.Array]:
    """Per frame, the cross-entropy of the target cluster under softmax(similarity /
    temperature) and whether it is the argmax: `similarity` [B, T, K], `labels` [B, T] (any
    value where a frame has no target) -> ([B, T] float32, [B, T] bool)."""
    logits = similarity.astype(jnp.float32) / temperature
    target = jnp.take_along_axis(logits, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    return (jax.nn.logsumexp(logits, axis=-1) - target,
            jnp.argmax(logits, axis=-1) == labels)


def prediction_loss(similarity: jax.Array, labels: jax.Array, mask: jax.Array,
                    frames: jax.Array, penalty: jax.Array, objective: HubertLossSettings
                    ) -> tuple[jax.Array, Metrics]:
    """The loss (module docstring) from the cosine similarities [B, T, K], the targets
    `labels` [B, T] (< 0: none), the masked frames `mask` [B, T], the real frames `frames`
    [B, T] and each batch group's feature penalty `penalty` [groups]."""
    per_frame, correct = cluster_cross_entropy(similarity, labels, objective.logit_temperature)
    scored = frames.astype(bool) & (labels >= 0)
    masked, unmasked = scored & mask.astype(bool), scored & ~mask.astype(bool)
    groups = penalty.shape[0]
    terms, counted, metrics = 0.0, jnp.zeros((groups,), jnp.float32), {}
    for name, where, weight in (("masked", masked, objective.masked_weight),
                                ("unmasked", unmasked, objective.unmasked_weight)):
        count = jnp.sum(where).astype(jnp.float32)
        total = jnp.sum(jnp.where(where, per_frame, 0.0))
        metrics[f"{name}_loss"] = (total, count)
        metrics[f"{name}_accuracy"] = (jnp.sum(where & correct).astype(jnp.float32), count)
        if weight > 0:
            terms = terms + weight * total
            counted = counted + jnp.sum(where.reshape(groups, -1), axis=1).astype(jnp.float32)
    sample_size = jnp.sum(counted)
    denominator = jnp.maximum(sample_size, 1.0)
    weights = jnp.where(sample_size > 0, counted / denominator, 1.0 / groups)
    penalty = jnp.sum(weights * penalty)
    loss = terms / denominator + objective.feature_penalty_weight * penalty
    one = jnp.ones((), jnp.float32)
    return loss, {"loss": (loss, one), **metrics, "feature_penalty": (penalty, one)}


def hubert_loss(model: Hubert, batch: Batch, rng: jax.Array | None, *,
                objective: HubertLossSettings) -> tuple[jax.Array, Metrics]:
    """`prediction_loss` of a batch with `audio` [B, S], optionally `attention_mask` [B, S],
    `mask_time_indices` [B, T] and `cluster_labels` [B, T] int32 (-1: none). Training splits
    it into `objective.batch_groups` groups; evaluation (`rng=None`, no dropout) is one."""
    groups = objective.batch_groups if rng is not None else 1
    mask = batch["mask_time_indices"].astype(bool)
    out = model(batch["audio"], batch.get("attention_mask"), mask, rng,
                feature_gradient_scale=objective.feature_grad_mult, groups=groups)
    return prediction_loss(model.cluster_similarity(out.projected_states),
                           batch["cluster_labels"], mask, out.frames,
                           feature_penalty(out.conv_features, groups), objective)


# --- Targets: k-means of MFCCs (iteration 1) or of a model's hidden states (iteration 2) ---

TARGETS = ("mfcc", "hidden")

@dataclasses.dataclass(frozen=True)
class HubertObjectiveConfig(HubertLossSettings, SpanSettings):
    """The `objective` section: the loss's settings (`HubertLossSettings`), the span masks
    (`SpanSettings`, fairseq HuBERT's mask_prob 0.8) and the k-means of the targets (fairseq
    simple_kmeans/learn_kmeans.py's MiniBatchKMeans settings; its k is model.num_classes) of
    what `targets` names."""

    mask_start_fraction: float = 0.08
    """p, the fraction of an utterance's frames that start a masked span of mask_span (fairseq
    HuBERT `mask_prob` 0.8 = p x 10)."""
    kmeans_batch_size: int = 10000
    """Frames per MiniBatchKMeans step (learn_kmeans.py --batch_size)."""
    kmeans_max_iter: int = 100
    """Passes over the frames at most (--max_iter)."""
    kmeans_n_init: int = 20
    """k-means++ initialisations tried, the best kept (--n_init)."""
    kmeans_max_no_improvement: int = 100
    """Steps without a better smoothed inertia before stopping (--max_no_improvement)."""
    kmeans_fraction: float = 1.0
    """Fraction of the training utterances whose frames fit the clusters (--percent, rounded
    up as learn_kmeans.py's np.ceil; 1.0 = all); every frame is labelled."""
    targets: str = "mfcc"
    """What is clustered (§IV-B): mfcc (iteration 1: 39 MFCCs with deltas of 10 ms frames) or
    hidden (iteration 2: `target_layer`'s hidden states of `target_model`, one per frame of
    the network; dump_hubert_feature.py)."""
    target_model: str = ""
    """targets=hidden: the model clustered (fairseq: the iteration-1 checkpoint), a pretext
    hubert workdir or model directory, or a HuggingFace HubertModel folder."""
    target_layer: int = 6
    """targets=hidden: the Transformer block whose output is clustered, 1 = the first
    (dump_hubert_feature.py `layer`; BASE's iteration 2: 6)."""
    target_batch_size: int = 8
    """targets=hidden: utterances per forward pass of the frozen model (each whole, padded to
    a length bucket; the group norm leaves the padding out)."""

    def __post_init__(self) -> None:
        HubertLossSettings.__post_init__(self)
        SpanSettings.__post_init__(self)
        for name in ("kmeans_batch_size", "kmeans_max_iter", "kmeans_n_init",
                     "kmeans_max_no_improvement"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 0.0 < self.kmeans_fraction <= 1.0:
            raise ValueError(f"kmeans_fraction={self.kmeans_fraction} must be in (0, 1]")
        if self.targets not in TARGETS:
            raise ValueError(f"targets={self.targets!r} must be one of {', '.join(TARGETS)}")
        for name in ("target_layer", "target_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


@dataclasses.dataclass(frozen=True)
class FrameFeatures:
    """What the targets cluster: `of(records, indices)` yields (index, [frames, d] float32
    features) for each utterance at `indices`, in any order; `rate` their frames per second;
    `name` what decides them, in the targets' fingerprint."""

    of: Callable[[AudioRecords, Sequence[int]], Iterator[tuple[int, np.ndarray]]]
    rate: int
    name: str


def utterance_mfccs(records: AudioRecords, indices: Sequence[int]
                    ) -> Iterator[tuple[int, np.ndarray]]:
    """[frames, 39] MFCCs with deltas (`input_pipeline.mfcc`) of each whole utterance at
    `indices`, its waveform in [-1, 1] as fairseq's reader gives it (no normalisation)."""
    rate = records.example_config.sample_rate
    for index in progress(indices, "MFCC features", total=len(indices), unit="utterance"):
        audio = records.spec.decode(records.source[int(index)])["audio"]
        waveform, _ = audio_window(audio, len(audio), 0, normalize=False)
        yield int(index), mfcc_with_deltas(waveform, rate)


MFCC_FEATURES = FrameFeatures(utterance_mfccs, MFCC_LABEL_RATE, "mfcc39")


@functools.partial(nnx.jit, static_argnames=("layer",))
def layer_features(model: Wav2Vec2Body, audio: jax.Array, attention_mask: jax.Array,
                   layer: int) -> jax.Array:
    """[B, T, H] float32 output of Transformer block `layer` (HF `hidden_states[layer]`) of
    each row run alone (`hidden_states(alone=True)`), in evaluation mode."""
    return model.hidden_states(audio, attention_mask, alone=True)[0][layer].astype(jnp.float32)


def padded_length(samples: int) -> int:
    """`samples` rounded up to a multiple of an eighth of its power of two (a few compiled
    shapes per doubling of the utterances' length)."""
    step = max(1 << max(samples.bit_length() - 4, 0), 1)
    return -(-samples // step) * step


def hidden_features(teacher: Wav2Vec2Body, layer: int, batch_size: int, normalize: bool,
                    name: str, sample_rate: int) -> FrameFeatures:
    """The `layer_features` of `teacher` for every frame of an utterance (fairseq
    dump_hubert_feature.py: the whole utterance, normalised when the task normalises), in
    jitted batches of `batch_size` utterances of similar length: a block of 16 batches is
    decoded, sorted by length and run, so memory holds one block."""
    block = 16 * batch_size

    def batches(records: AudioRecords, indices: list[int]
                ) -> Iterator[tuple[int, np.ndarray]]:
        for first in range(0, len(indices), block):
            audio = {i: records.spec.decode(records.source[i])["audio"]
                     for i in indices[first:first + block]}
            order = sorted(audio, key=lambda i: len(audio[i]))
            for start in range(0, len(order), batch_size):
                rows = order[start:start + batch_size]
                size = padded_length(max(len(audio[i]) for i in rows))
                windows = [audio_window(audio[i], size, 0, normalize) for i in rows]
                windows += windows[-1:] * (batch_size - len(rows))  # one shape for every batch
                features = np.asarray(jax.device_get(layer_features(
                    teacher, jnp.asarray(np.stack([w[0] for w in windows])),
                    jnp.asarray(np.stack([w[1] for w in windows])), layer)))
                for row, index in enumerate(rows):
                    frames = max(int(feature_lengths(teacher.config, len(audio[index]))), 0)
                    yield index, features[row, :frames]

    def of(records: AudioRecords, indices: Sequence[int]) -> Iterator[tuple[int, np.ndarray]]:
        indices = [int(i) for i in indices]
        yield from progress(batches(records, indices), f"layer {layer} features",
                            total=len(indices), unit="utterance")

    return FrameFeatures(of, sample_rate // teacher.config.samples_per_frame, name)


def model_identity(model: nnx.Module) -> str:
    """A digest of the model's config and parameters: what decides its features."""
    digest = hashlib.sha256(repr(getattr(model, "config", type(model))).encode())
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(np.ascontiguousarray(jax.device_get(leaf)).tobytes())
    return digest.hexdigest()[:16]


def teacher_features(model: HubertConfig, examples: AudioBatchingConfig,
                     objective: HubertObjectiveConfig, load: Loader | None) -> FrameFeatures:
    """targets=hidden: `hidden_features` of `objective.target_model` read by `load` (the
    trainer's reader) and run in float32, refused in one line where it is missing, not a
    wav2vec 2.0 / HuBERT network, has fewer blocks than `target_layer` or frames at another
    rate than `model`."""
    path = objective.target_model
    if not path:
        raise UserError("objective.targets=hidden needs objective.target_model=PATH: the "
                        "iteration-1 model (a hubert workdir or a HuggingFace HubertModel "
                        "folder)")
    if not Path(path).is_dir():
        raise UserError(f"objective.target_model={path} is not a directory; pass the "
                        "iteration-1 run's workdir or a HuggingFace HubertModel folder")
    if load is None:
        raise ValueError("targets=hidden needs the trainer's loader (`load`)")
    teacher = load(path)
    if not isinstance(teacher, Wav2Vec2Body):
        raise UserError(f"objective.target_model={path} holds a {type(teacher).__name__}, "
                        "not a HuBERT or wav2vec 2.0 network; pass an iteration-1 hubert "
                        "workdir or a HuggingFace HubertModel folder")
    layers = teacher.config.num_layers
    if objective.target_layer > layers:
        raise UserError(f"objective.target_layer={objective.target_layer} is past the "
                        f"{layers} blocks of {path}; choose 1 to {layers} (BASE: 6)")
    if teacher.config.samples_per_frame != model.samples_per_frame:
        raise UserError(f"{path} makes a frame of {teacher.config.samples_per_frame} samples, "
                        f"the model {model.samples_per_frame}, so its labels would not align "
                        "with the frames; give both the same conv_strides")
    if examples.sample_rate % model.samples_per_frame:
        raise UserError(f"examples.sample_rate={examples.sample_rate} is not a multiple of the "
                        f"{model.samples_per_frame} samples of a frame; the labels need a "
                        "whole frame rate")
    if teacher.config.compute_dtype != jnp.float32:  # dump_hubert_feature.py: float32
        params = nnx.state(teacher, nnx.Param)
        teacher = nnx.eval_shape(lambda: type(teacher)(
            dataclasses.replace(teacher.config, dtype="float32"), rngs=nnx.Rngs(0)))
        nnx.update(teacher, params)
    name = f"hidden:{model_identity(teacher)}:layer{objective.target_layer}"
    return hidden_features(teacher, objective.target_layer, objective.target_batch_size,
                           examples.normalize, name, examples.sample_rate)


def fit_kmeans(features: np.ndarray, clusters: int, objective: HubertObjectiveConfig,
               seed: int) -> np.ndarray:
    """[clusters, d] centroids of scikit-learn's MiniBatchKMeans with learn_kmeans.py's
    settings (k-means++, tol 0, no reassignment, init_size default) on `features` [N, d]."""
    cluster = require("sklearn.cluster", "audio", "HuBERT's k-means targets")
    if len(features) < clusters:
        raise UserError(f"{len(features)} frames to cluster are fewer than model.num_classes="
                        f"{clusters}; lower it or give more audio")
    model = cluster.MiniBatchKMeans(
        n_clusters=clusters, init="k-means++", max_iter=objective.kmeans_max_iter,
        batch_size=objective.kmeans_batch_size, compute_labels=False, tol=0.0,
        max_no_improvement=objective.kmeans_max_no_improvement, init_size=None,
        n_init=objective.kmeans_n_init, reassignment_ratio=0.0, random_state=seed)
    return model.fit(features).cluster_centers_.astype(np.float32)


def nearest_centroid(features: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """[N] int16 index of the nearest centroid (squared Euclidean) of each row of `features`
    (dump_km_label.py `ApplyKmeans`)."""
    distances = ((features ** 2).sum(1, keepdims=True) - 2 * features @ centroids.T
                 + (centroids ** 2).sum(1))
    return np.argmin(distances, axis=1).astype(np.int16)


@dataclasses.dataclass(frozen=True)
class ClusterTargets:
    """Every utterance's cluster index per label frame, at `label_rate` Hz: utterance i's are
    `labels[offsets[i]:offsets[i + 1]]`."""

    labels: np.ndarray
    offsets: np.ndarray
    label_rate: int

    def of(self, index: int) -> np.ndarray:
        return self.labels[self.offsets[index]:self.offsets[index + 1]]

    @property
    def checksum(self) -> int:
        return zlib.crc32(self.labels.tobytes()) ^ zlib.crc32(self.offsets.tobytes())


def label_utterances(records: AudioRecords, centroids: np.ndarray, features: FrameFeatures
                     ) -> ClusterTargets:
    """Every utterance of `records` labelled by its frames' nearest centroids."""
    labels: list[np.ndarray] = [np.zeros(0, np.int16)] * len(records)
    for index, frames in features.of(records, range(len(records))):
        labels[index] = nearest_centroid(frames, centroids)
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in labels])]).astype(np.int64)
    return ClusterTargets(np.concatenate(labels), offsets, features.rate)


def cluster_targets(train: AudioRecords, held_out: AudioRecords, clusters: int,
                    objective: HubertObjectiveConfig, features: FrameFeatures = MFCC_FEATURES
                    ) -> tuple[ClusterTargets, ClusterTargets]:
    """The targets (paper §IV-B, fairseq simple_kmeans): k-means of the training utterances'
    `features` (a `kmeans_fraction` of them; MFCCs in iteration 1, a layer's hidden states
    after), then every frame of both splits labelled by its nearest centroid. Deterministic
    (seed `KMEANS_SEED`); kept beside the training records under a fingerprint of what decides
    them (the features' `name`: the teacher's weights and layer), so a rerun or resume reads
    the same labels back instead of clustering again."""
    settings = {"features": features.name, "clusters": clusters, "held_out": repr(held_out.source),
                **{f.name: getattr(objective, f.name) for f in dataclasses.fields(objective)
                   if f.name.startswith("kmeans_")}}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(train.directory) / f"hubert_targets_{key}.npz"
    if path.is_file():
        with np.load(path) as stored:
            return tuple(ClusterTargets(stored[f"{split}_labels"], stored[f"{split}_offsets"],
                                        features.rate) for split in ("train", "held_out"))
    rng = np.random.default_rng(KMEANS_SEED)
    chosen = (range(len(train)) if objective.kmeans_fraction == 1.0 else np.sort(rng.choice(
        len(train), int(np.ceil(objective.kmeans_fraction * len(train))), replace=False)))
    sample = dict(features.of(train, chosen))
    centroids = fit_kmeans(np.concatenate([sample.pop(int(i)) for i in chosen]), clusters,
                           objective, KMEANS_SEED)
    found = (label_utterances(train, centroids, features),
             label_utterances(held_out, centroids, features))
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
    np.savez(partial, **{f"{split}_{name}": getattr(targets, name)
                         for split, targets in zip(("train", "held_out"), found, strict=True)
                         for name in ("labels", "offsets")})
    os.replace(partial, path)
    return found


def frame_targets(labels: np.ndarray, start: int, samples: int, num_frames: int,
                  label_rate: int, config: HubertConfig, sample_rate: int) -> np.ndarray:
    """[num_frames] int32 targets of the network's frames for a window of `samples` real
    samples from sample `start` of an utterance labelled `labels` at `label_rate` Hz, as
    fairseq aligns them: the window's labels start at round(start x rate / sample rate)
    (hubert_dataset.py `collater_frm_label`), and frame t reads label floor(t x label_rate x
    samples_per_frame / sample_rate) of them (hubert.py `forward_targets`: every other one of
    100 Hz MFCC labels for 20 ms frames); -1 where the window has no label (fairseq trims
    those frames)."""
    first = int(round(start * label_rate / sample_rate))
    size = min(int(round(samples * label_rate / sample_rate)), len(labels) - first)
    if size <= 0:  # e.g. an utterance under one 25 ms MFCC frame: no label at all
        return np.full(num_frames, -1, np.int32)
    ratio = label_rate * config.samples_per_frame / sample_rate
    index = (np.arange(num_frames) * ratio).astype(np.int64)
    return np.where(index < size, labels[first + np.minimum(index, size - 1)],
                    -1).astype(np.int32)


class TargetWindow(grain.transforms.RandomMap):
    """An utterance with its labels (`TargetedRecords`) -> a `max_samples` window (random for
    training, the first for held-out) with `attention_mask`, its frames' `cluster_labels`
    (`frame_targets`) and span masks over its real frames (`mask_time_indices`), drawn with
    Grain's per-record rng, so reruns and resumes draw the same."""

    def __init__(self, config: HubertConfig, examples: AudioBatchingConfig,
                 settings: SpanSettings, fields: tuple[str, ...], label_rate: int,
                 random_crop: bool):
        self.config, self.examples, self.settings = config, examples, settings
        self.fields, self.label_rate, self.random_crop = fields, label_rate, random_crop

    def random_map(self, element: dict[str, np.ndarray], rng: np.random.Generator
                   ) -> dict[str, np.ndarray]:
        size = self.examples.max_samples
        start = (random_start(len(element["audio"]), size, rng) if self.random_crop else 0)
        return self.window(element, start, rng)

    def window(self, element: dict[str, np.ndarray], start: int, rng: np.random.Generator
               ) -> dict[str, np.ndarray]:
        size = self.examples.max_samples
        audio, mask = audio_window(element["audio"], size, start, self.examples.normalize)
        frames = int(feature_lengths(self.config, size))
        real = max(int(feature_lengths(self.config, int(mask.sum()))), 0)
        return {"audio": audio, "attention_mask": mask,
                **{field: np.int32(element[field]) for field in self.fields},
                "cluster_labels": frame_targets(element["targets"], start, int(mask.sum()),
                                                frames, self.label_rate, self.config,
                                                self.examples.sample_rate),
                "mask_time_indices": span_mask(np.array([real]), frames, self.settings,
                                               rng)[0]}


class TargetedRecords:
    """Training utterances with their targets for Grain: record i is utterance i decoded, with
    its labels as `targets`; `TargetWindow` cuts the window. Its description (kept in
    checkpoints) names the records and a checksum of the labels, so a resume on other targets
    is refused."""

    def __init__(self, records: AudioRecords, targets: ClusterTargets, window: TargetWindow):
        self.records, self.targets, self.window = records, targets, window
        self.source = self
        self.description = describe("hubert_targets", records=repr(records.source),
                                    labels_crc32=targets.checksum,
                                    **{"examples.max_samples": window.examples.max_samples})

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        element = self.records.spec.decode(self.records.source[int(index)])
        return {**element, "targets": self.targets.of(int(index))}

    def __repr__(self) -> str:
        return self.description

    def load_transforms(self) -> list[grain.transforms.RandomMap]:
        return [self.window]


@dataclasses.dataclass(frozen=True)
class ShortestCropTargets:
    """`ShortestCropBatches`' `finish` for HuBERT (batches cropped to their shortest
    utterance, fairseq's `pad_audio` false): a row's span masks equal in count within its
    group of `rows_per_group` rows (`group_span_mask`, fairseq `require_same_masks`) and its
    window's targets (`frame_targets` of utterance `record` from sample `start`)."""

    config: HubertConfig
    settings: SpanSettings
    targets: ClusterTargets
    sample_rate: int
    rows_per_group: int
    seed: int

    def __call__(self, example: dict[str, np.ndarray], key: int, record: int, start: int
                 ) -> dict[str, np.ndarray]:
        samples = len(example["audio"])
        frames = int(feature_lengths(self.config, samples))
        return {**example,
                "cluster_labels": frame_targets(self.targets.of(record), start, samples, frames,
                                                 self.targets.label_rate, self.config,
                                                 self.sample_rate),
                "mask_time_indices": group_span_mask(
                    frames, self.settings, key % self.rows_per_group, self.rows_per_group,
                    np.random.default_rng([self.seed, key // self.rows_per_group, 1]))}


def resolve_for_run(objective: HubertObjectiveConfig, config: Any) -> HubertObjectiveConfig:
    """`check_batch_groups`: a micro-batch splits into `objective.batch_groups` groups; batches
    within a samples budget are refused (their rows do not yet carry the targets' offsets)."""
    check_batch_groups(objective.batch_groups, config)
    if getattr(config.examples, "samples_per_batch", 0):
        raise UserError("hubert reads fixed-row batches (train.batch_size); set "
                        "examples.samples_per_batch=0")
    return objective


def prepare_hubert(data: DataConfig, examples: AudioBatchingConfig, cache_dir: Path,
                   seed: int) -> PreparedData:
    """The speech methods' data (`speech_data`), but `eval` the held-out records themselves:
    `with_targets` labels their first windows once the targets are known."""
    train, held_out = prepare_audio(data.source, data.eval_source, cache_dir, examples,
                                    held_out_fraction=data.held_out_fraction, seed=seed,
                                    tfds_split=data.tfds_split,
                                    tfds_data_dir=data.tfds_data_dir or None)
    return dataclasses.replace(speech_data(train, held_out, examples), eval=held_out)


def with_targets(data: PreparedData, model: HubertConfig, objective: HubertObjectiveConfig,
                 load: Loader | None = None) -> PreparedData:
    """`Resolution.complete_data`: the targets (`cluster_targets` of MFCCs, or of the hidden
    states of the model `load` reads, `teacher_features`), the training utterances read with
    them (`TargetedRecords`: windows cut, labelled and masked while loading) and the held-out
    first windows labelled and masked once with a fixed seed."""
    train, held_out_records = data.train, data.eval
    examples = train.example_config
    features = (MFCC_FEATURES if objective.targets == "mfcc"
                else teacher_features(model, examples, objective, load))
    train_targets, held_out_targets = cluster_targets(train, held_out_records,
                                                      model.num_classes, objective, features)
    fields = train.label_fields
    window = TargetWindow(model, examples, objective, fields, train_targets.label_rate, True)
    first = TargetWindow(model, examples, objective, fields, held_out_targets.label_rate,
                         False)
    rng = np.random.default_rng(HELD_OUT_MASK_SEED)
    rows = [first.window({**held_out_records.spec.decode(held_out_records.source[i]),
                          "targets": held_out_targets.of(i)}, 0, rng)
            for i in held_out_records.spaced_indices(examples.max_eval_examples)]
    held_out = {key: np.stack([row[key] for row in rows]) for key in rows[0]}
    if examples.crop_to_shortest:
        segments = shortest_crop_segments(
            train, objective.batch_groups, lambda rows, seed: ShortestCropTargets(
                model, objective, train_targets, examples.sample_rate, rows, seed))
    else:
        segments = whole_run(TargetedRecords(train, train_targets, window))
    return dataclasses.replace(data, eval=held_out, segments=segments)


# --- The registered method ----------------------------------------------------------------

def build_hubert(config: HubertConfig, seed: int) -> Hubert:
    return Hubert(config, rngs=nnx.Rngs(seed))


def check_hubert(model: HubertConfig, examples: AudioBatchingConfig,
                 objective: HubertObjectiveConfig) -> None:
    """`check_frames`; k-means steps of at least k frames (scikit-learn's requirement)."""
    check_frames(model, examples)
    if objective.kmeans_batch_size < model.num_classes:
        raise UserError(f"objective.kmeans_batch_size={objective.kmeans_batch_size} is below "
                        f"model.num_classes={model.num_classes}; raise it (fairseq: 10000)")


TINY_MODEL = {**TINY_SPEECH_ENCODER, "num_classes": 100, "final_dim": 32}
TINY_OPTIM = {**FAIRSEQ_ROBERTA_OPTIM, "learning_rate": 1e-3, "warmup_steps": 20}

PRESETS = {
    # The tiny model on one-second crops of the user's audio folder (--data), iteration 1's
    # targets: 100 clusters of the MFCCs.
    "hubert_tiny": {
        "model": TINY_MODEL,
        "examples": {"max_samples": 16000, "max_eval_examples": 256},
        "data": {"source": "", "held_out_fraction": 0.1},
        "optim": TINY_OPTIM,
        "train": {"steps": 200, "batch_size": 16, "log_every": 25, "eval_every": 100,
                  "checkpoint_every": 100, "eval_batches": 4},
    },
    # FSDD (../shared/data/fsdd/recordings, as wav2vec2_digits): the tiny model predicting 100
    # MFCC clusters, one-second crops, probes of digit and speaker on the last hidden state.
    "hubert_digits": {
        "model": TINY_MODEL,
        "examples": {**FSDD_EXAMPLES, "max_samples": 16000, "max_eval_examples": 300},
        "data": {"source": ""},
        "optim": {**TINY_OPTIM, "warmup_steps": 100},
        "train": {"steps": 1500, "batch_size": 16, "log_every": 25, "eval_every": 500,
                  "checkpoint_every": 500, "eval_batches": 4},
    },
    # BASE iteration 1 on LibriSpeech 960 h (Hsu et al. 2021 §IV-C; fairseq
    # examples/hubert/config/pretrain/hubert_base_librispeech.yaml): the model's and the
    # objective's defaults are that recipe (wav2vec 2.0 BASE's network, final_dim 256; mask
    # p 0.08 x span 10, tau 0.1, masked frames only, feature penalty 10, feature gradient x
    # 0.1) with 100 clusters of MFCCs fitted on 10 % of the utterances (simple_kmeans README's
    # --percent 0.1); fairseq's Adam (0.9, 0.98), eps 1e-6, decoupled weight
    # decay 0.01, lr 5e-4 after 32k warmup updates then linear decay to the end of the run
    # (polynomial_decay), clipping at 10; utterances under 32,000 samples dropped, no
    # normalisation; batches cropped to their shortest utterance (pad_audio false) with equal
    # masked counts per GPU batch, 32 batch groups; 250k updates (the paper's first iteration,
    # §IV-C; the yaml's max_update 400k is the second's). Departures are on the recipe card.
    "hubert_base": {
        "model": {"num_classes": 100, "dtype": "bfloat16"},
        "objective": {"batch_groups": 32, "kmeans_fraction": 0.1},
        "examples": {"max_samples": 250000, "min_samples": 32000, "crop_to_shortest": True,
                     "length_buckets": 8},
        "data": {"source": "", "worker_count": 16},
        "optim": {**FAIRSEQ_ROBERTA_OPTIM, "learning_rate": 5e-4, "warmup_steps": 32000,
                  "clip_norm": 10.0},
        "train": {"steps": 250000, "batch_size": 192, "eval_every": 10000},
    },
}
# FSDD's second iteration: hubert_digits predicting 100 clusters of the first Transformer block
# of the two (the tiny network's middle, as BASE's 6 of 12) of objective.target_model, the
# hubert_digits run (bench.speech_fsdd --iteration2 passes it).
PRESETS["hubert_digits_iter2"] = {
    **PRESETS["hubert_digits"],
    "objective": {"targets": "hidden", "target_layer": 1, "target_model": ""},
}
# BASE iteration 2 (§IV-B/C; fairseq hubert_base_librispeech.yaml, whose max_update 400k is
# this iteration's): hubert_base predicting 500 clusters (simple_kmeans README: n_cluster 500,
# --percent 0.1) of the 6th block's output of objective.target_model, the iteration-1 BASE
# (a hubert_base workdir or HF HubertModel folder; labels at the model's 50 Hz, the yaml's
# label_rate 50), for 400k updates; the rest as iteration 1.
PRESETS["hubert_base_iter2"] = {
    **PRESETS["hubert_base"],
    "model": {**PRESETS["hubert_base"]["model"], "num_classes": 500},
    "objective": {**PRESETS["hubert_base"]["objective"], "targets": "hidden",
                  "target_layer": 6, "target_model": ""},
    "train": {**PRESETS["hubert_base"]["train"], "steps": 400000},
}


register(Method(
    name="hubert",
    model_config=HubertConfig,
    example_config=AudioBatchingConfig,
    objective_config=HubertObjectiveConfig,
    build_model=build_hubert,
    loss=hubert_loss,
    prepare=prepare_hubert,
    units_per_example=lambda examples: examples.max_samples,
    unit="samples",
    description="HuBERT: masked prediction of k-means cluster targets of speech frames "
                "(Hsu et al. 2021)",
    presets=PRESETS,
    resolution=Resolution(check=check_hubert, run_settings=resolve_for_run,
                          complete_data=with_targets),
    evaluation=Evaluation(monitor=probe_monitor(probe_layers), summarize=probe_summary(
        ("loss", "masked_accuracy"))),
    start=Start(hf_models=(Hubert,)),
))
