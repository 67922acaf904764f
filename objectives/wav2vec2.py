"""The pieces of wav2vec 2.0's pre-training objective (Baevski et al. 2020 §3.1-3.2, §4.2):
host-side span masks and distractor indices, and the on-device loss.

Reference: fairseq `data/data_utils.py` (`compute_mask_indices`),
`models/wav2vec/wav2vec2.py` (`sample_negatives`, `compute_preds`, the Gumbel temperature
schedule, `feature_grad_mult`, `features_pen`) and `criterions/wav2vec_criterion.py`; HF
transformers modeling_wav2vec2.py (`_compute_mask_indices`, `_sample_negative_indices`,
`Wav2Vec2ForPreTraining.forward`), the parity oracle (tests/test_wav2vec2.py).

- Masking (§3.1): a fraction p = 0.065 of the frames of each utterance start a span of M = 10
  masked frames (spans may overlap, so about half the frames end up masked), at least
  `min_spans` spans per utterance, as fairseq's `compute_mask_indices` draws them (3d262bb:
  the span count's rounding drawn per utterance, starts uniform over [0, n - M), so an
  utterance's last frame is never masked; HF's `_compute_mask_indices` draws one rounding
  per batch and starts over [0, n - M]). With `require_same_masks` (fairseq's pre-training
  default) every utterance of a GPU's batch keeps the fewest masked frames any of them has,
  the excess unmasked at random: here per group of `batch_groups` (`GroupMasks`), where
  batches are cropped to their shortest utterance (`examples.crop_to_shortest`);
  tests/test_reference_samplers.py compares both with a re-statement of fairseq's.
- Distractors (§3.2): K = 100 frames drawn uniformly (with replacement) from the other masked
  frames of the same utterance.
- Loss per masked frame: the contrastive loss -log softmax over [positive, K distractors] of
  cosine similarity / 0.1 between the projected context vector and the projected quantised
  targets (distractors equal to the positive get -inf, as HF), plus 0.1 x the diversity loss
  (G V - perplexity) / (G V), plus 10 x the mean square of the feature encoder's output
  (fairseq `features_pen`); the gradient reaching the feature encoder is scaled by 0.1
  (`feature_grad_mult`), and the Gumbel-softmax temperature anneals as
  max(2 x 0.999995^step, 0.5).
- Per GPU: fairseq computes the perplexity, the feature penalty and LayerDrop's draws on each
  GPU's batch. `batch_groups` splits a (micro-)batch into that many groups of consecutive rows
  that do the same (fairseq BASE: 64 GPUs), whatever the device mesh.

HF sums the contrastive and diversity terms over the masked frames; fairseq divides the sum by
that count (its `sample_size`, summed over the GPUs) before the update, which is what
`wav2vec2_loss` returns: the contrastive sum over every masked frame, and each group's
diversity loss and feature penalty weighted by its share of the masked frames (fairseq's
criterion multiplies them by the GPU's `sample_size`).

Registered as the method `wav2vec2` on audio records (`input_pipeline.audio`): masks and
distractors are drawn per record while loading (`SpanMasking` on padded crops, `GroupMasks` on
batches cropped to their shortest), and the model's update counter (`Wav2Vec2.updates`,
checkpointed model state) gives the Gumbel temperature's step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.input_pipeline.audio import (
    AudioBatchingConfig,
    AudioRecords,
    budget_crop_batches,
)
from pretext_jax.models.wav2vec2 import Wav2Vec2, Wav2Vec2Config, feature_lengths
from pretext_jax.objectives.common.held_out import mask_records
from pretext_jax.objectives.common.preset_parts import (
    FAIRSEQ_ROBERTA_OPTIM,
    FSDD_EXAMPLES,
    TINY_SPEECH_ENCODER,
)
from pretext_jax.objectives.common.speech import (
    MaskingSettings,
    check_batch_groups,
    check_frames,
    feature_penalty,
    group_span_mask,
    prepare_speech,
    probe_layers,
    probe_monitor,
    probe_summary,
    shortest_crop_segments,
    span_mask,
)
from pretext_jax.objectives.registry import (
    Batch,
    Evaluation,
    Loader,
    Method,
    Metrics,
    PreparedData,
    Resolution,
    Segments,
    Start,
    budget_batches,
    register,
)

COSINE_EPS = 1e-8  # torch.cosine_similarity's
HELD_OUT_MASK_SEED = 0  # held-out masks and distractors: drawn once, the same in every run


@dataclasses.dataclass(frozen=True)
class Wav2Vec2LossSettings:
    """The loss's settings (fairseq `wav2vec2_base_librispeech`'s, but one batch group: its
    64 GPUs are the `wav2vec2_base` preset's `batch_groups`)."""

    contrastive_temperature: float = 0.1
    """kappa, dividing the cosine similarities (paper 0.1; HF `contrastive_logits_temperature`)."""
    diversity_weight: float = 0.1
    """alpha, weight of the codebook diversity loss (paper 0.1)."""
    feature_penalty_weight: float = 10.0
    """Weight of the mean square of the feature encoder's output (fairseq `loss_weights`
    [0.1, 10]: 10)."""
    feature_grad_mult: float = 0.1
    """Scale of the gradient reaching the feature encoder (fairseq 0.1; 1.0 = unscaled)."""
    gumbel_start_temperature: float = 2.0
    """Gumbel-softmax temperature at step 0 (fairseq `latent_temp` (2, 0.5, 0.999995))."""
    gumbel_end_temperature: float = 0.5
    """The temperature's floor."""
    gumbel_decay: float = 0.999995
    """Factor applied to the temperature per update, in (0, 1]."""
    batch_groups: int = 1
    """Groups of consecutive rows a (micro-)batch is split into, one per GPU of the reference
    (fairseq BASE: 64): each has its own codebook perplexity, feature penalty, LayerDrop draws
    and, with examples.crop_to_shortest, equal masked counts; 1 = the whole batch."""

    def __post_init__(self) -> None:
        for name in ("contrastive_temperature", "gumbel_end_temperature"):
            if getattr(self, name) <= 0.0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        for name in ("diversity_weight", "feature_penalty_weight", "feature_grad_mult"):
            if getattr(self, name) < 0.0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.gumbel_start_temperature < self.gumbel_end_temperature:
            raise ValueError("gumbel_start_temperature must be >= gumbel_end_temperature "
                             "(wav2vec 2.0: 2.0 and 0.5)")
        if not 0.0 < self.gumbel_decay <= 1.0:
            raise ValueError(f"gumbel_decay={self.gumbel_decay} must be in (0, 1]")
        if self.batch_groups < 1:
            raise ValueError(f"batch_groups={self.batch_groups} must be >= 1 (1 = the whole "
                             "batch)")


# --- Host side (numpy) ---------------------------------------------------------------------

def sample_negatives(mask: np.ndarray, num_negatives: int, rng: np.random.Generator
                     ) -> np.ndarray:
    """[B, T, K] int32 distractor frames (indices within the utterance) for a [B, T] mask, with
    HF `_sample_negative_indices` semantics: each masked frame gets K draws, uniform with
    replacement over the utterance's other masked frames (never itself). Unmasked frames get 0
    (the loss ignores them); a lone masked frame gets itself, which the loss masks out."""
    batch_size, num_frames = mask.shape
    negatives = np.zeros((batch_size, num_frames, num_negatives), np.int32)
    for row in range(batch_size):
        masked = np.flatnonzero(mask[row])
        if len(masked) < 2:
            negatives[row, masked] = masked[:, None]
            continue
        draws = rng.integers(0, len(masked) - 1, size=(len(masked), num_negatives))
        draws += draws >= np.arange(len(masked))[:, None]  # skip the positive, stay uniform
        negatives[row, masked] = masked[draws]
    return negatives


def mask_batch(config: Wav2Vec2Config, attention_mask: np.ndarray, settings: MaskingSettings,
               rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The batch entries the loss reads beside the waveforms, for a [B, S] sample mask (1 =
    real sample): `mask_time_indices` [B, T] and `sampled_negative_indices` [B, T, K]."""
    attention_mask = np.asarray(attention_mask)
    num_frames = int(feature_lengths(config, attention_mask.shape[1]))
    lengths = feature_lengths(config, attention_mask.astype(np.int64).sum(-1))
    mask = span_mask(np.maximum(lengths, 0), num_frames, settings, rng)
    return {"mask_time_indices": mask,
            "sampled_negative_indices": sample_negatives(mask, settings.num_negatives, rng)}


# --- Device side ----------------------------------------------------------------------------

def gumbel_temperature(step: int | jax.Array, settings: Wav2Vec2LossSettings
                       ) -> jax.Array:
    """max(start x decay^step, end): fairseq's annealing (2 -> 0.5 with decay 0.999995).
    Computed as exp(step x log(decay)) with the logarithm in float64: 0.999995 itself is not
    exact enough in float32 (2 x 0.999995^100000 would be off by 1e-3)."""
    decayed = settings.gumbel_start_temperature * jnp.exp(
        jnp.asarray(step, jnp.float32) * math.log(settings.gumbel_decay))
    return jnp.maximum(decayed, settings.gumbel_end_temperature)


def cosine_similarity(a: jax.Array, b: jax.Array) -> jax.Array:
    """Cosine similarity over the last axis (broadcasting), as torch.cosine_similarity."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    norms = jnp.sum(a * a, axis=-1) * jnp.sum(b * b, axis=-1)
    return jnp.sum(a * b, axis=-1) * jax.lax.rsqrt(jnp.maximum(norms, COSINE_EPS ** 2))


def contrastive_loss(projected_states: jax.Array, projected_quantized_states: jax.Array,
                     negative_indices: jax.Array, mask: jax.Array, temperature: float
                     ) -> tuple[jax.Array, jax.Array]:
    """Summed over the masked frames of `mask` [B, T]: the cross-entropy of the positive among
    [positive, K distractors] with logits cos(c_t, q) / temperature (`projected_states` c and
    `projected_quantized_states` q [B, T, P], `negative_indices` [B, T, K] frames of the same
    utterance). Distractors equal to the positive get -inf (HF). Returns (loss sum, count of
    masked frames whose positive beats every distractor)."""
    batch_size, num_frames, num_negatives = negative_indices.shape
    negatives = jnp.take_along_axis(
        projected_quantized_states, negative_indices.reshape(batch_size, -1)[..., None],
        axis=1).reshape(batch_size, num_frames, num_negatives, -1)  # [B, T, K, P]
    targets = jnp.concatenate([projected_quantized_states[:, :, None], negatives],
                              axis=2)  # [B, T, 1 + K, P]
    logits = cosine_similarity(projected_states[:, :, None], targets) / temperature
    same_as_positive = jnp.all(negatives == projected_quantized_states[:, :, None], axis=-1)
    logits = logits.at[..., 1:].set(jnp.where(same_as_positive, -jnp.inf,
                                              logits[..., 1:]))  # [B, T, 1 + K]
    per_frame = jax.nn.logsumexp(logits, axis=-1) - logits[..., 0]  # [B, T]
    mask = mask.astype(bool)
    correct = logits[..., 0] > jnp.max(logits[..., 1:], axis=-1)
    return (jnp.sum(jnp.where(mask, per_frame, 0.0)),
            jnp.sum(mask & correct).astype(jnp.float32))


def diversity_loss(perplexity: jax.Array, num_codevectors: int) -> jax.Array:
    """(G V - perplexity) / (G V) (§3.2 L_d), per masked frame."""
    return (num_codevectors - perplexity) / num_codevectors


def wav2vec2_loss(model: Wav2Vec2, batch: Batch, rng: jax.Array | None, *,
                  objective: Wav2Vec2LossSettings | None = None, step: int | jax.Array = 0
                  ) -> tuple[jax.Array, Metrics]:
    """The pre-training loss per masked frame (module docstring) of a batch with
    `input_values` [B, S], optionally `attention_mask` [B, S], and `mask_batch`'s
    `mask_time_indices` [B, T] and `sampled_negative_indices` [B, T, K]. `step` is the update
    number the Gumbel temperature anneals with; `rng=None` (evaluation) quantises by argmax
    without dropout, over the batch as one group. Training splits it into
    `objective.batch_groups` groups (module docstring); `codevector_perplexity` is their
    mean, as fairseq logs its GPUs' mean."""
    objective = objective or Wav2Vec2LossSettings()
    groups = objective.batch_groups if rng is not None else 1
    mask = batch["mask_time_indices"].astype(bool)
    out = model(batch["input_values"], batch.get("attention_mask"), mask, rng,
                gumbel_temperature=gumbel_temperature(step, objective),
                feature_gradient_scale=objective.feature_grad_mult, groups=groups)
    contrastive_sum, correct = contrastive_loss(
        out.projected_states, out.projected_quantized_states,
        batch["sampled_negative_indices"], mask, objective.contrastive_temperature)
    count = jnp.sum(mask).astype(jnp.float32)
    group_counts = jnp.sum(mask.reshape(groups, -1), axis=1).astype(jnp.float32)  # [groups]
    weights = jnp.where(count > 0, group_counts / jnp.maximum(count, 1.0), 1.0 / groups)
    diversity = jnp.sum(weights * diversity_loss(out.codevector_perplexity,
                                                 model.config.num_codevectors))
    penalty = jnp.sum(weights * feature_penalty(out.conv_features, groups))
    loss = (contrastive_sum / jnp.maximum(count, 1.0) + objective.diversity_weight * diversity
            + objective.feature_penalty_weight * penalty)
    one = jnp.ones((), jnp.float32)
    return loss, {"loss": (loss, one), "contrastive_loss": (contrastive_sum, count),
                  "contrastive_accuracy": (correct, count), "diversity_loss": (diversity, one),
                  "codevector_perplexity": (jnp.mean(out.codevector_perplexity), one),
                  "feature_penalty": (penalty, one)}


# --- The registered method ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Wav2Vec2ObjectiveConfig(Wav2Vec2LossSettings, MaskingSettings):
    """The `objective` section: the loss's settings (`Wav2Vec2LossSettings`) and the host-side
    masking and distractor sampling (`MaskingSettings`), fairseq `wav2vec2_base_librispeech`'s
    by default (one batch group)."""

    def __post_init__(self) -> None:
        Wav2Vec2LossSettings.__post_init__(self)
        MaskingSettings.__post_init__(self)


class SpanMasking(grain.transforms.RandomMap):
    """An audio example -> the same plus `mask_time_indices` [T] (bool) and
    `sampled_negative_indices` [T, K] (int32) over its T = `feature_lengths(max_samples)`
    frames, drawn from its real samples' frame count with Grain's per-record rng (derived from
    the loader seed and the record's position, so reruns and resumes draw the same masks, as
    BERT's dynamic masking). Rows of a padded batch keep their own masked counts (fairseq's
    `require_same_masks` is `GroupMasks`', on batches cropped to their shortest)."""

    def __init__(self, config: Wav2Vec2Config, settings: MaskingSettings):
        self.config, self.settings = config, settings

    def random_map(self, element: dict[str, np.ndarray], rng: np.random.Generator
                   ) -> dict[str, np.ndarray]:
        drawn = mask_batch(self.config, element["attention_mask"][None], self.settings, rng)
        return {**element, **{name: value[0] for name, value in drawn.items()}}


@dataclasses.dataclass(frozen=True)
class GroupMasks:
    """The masks and distractors of a row of a batch cropped to its shortest utterance
    (`ShortestCropBatches`' `finish`), drawn as fairseq's `compute_mask_indices` draws them over
    one GPU's batch with `require_same_masks`: the batch's rows come in groups of
    `rows_per_group` consecutive keys (`batch_groups` per micro-batch), and every row of a group
    keeps the fewest masked frames of its group (`span_mask(same_count=True)`). A group's masks
    come from an rng seeded by (seed, group), a row's distractors from (seed, key): all rows of
    a batch have one length, so a row draws its group's masks without its neighbours' audio,
    the same in every worker and after a resume."""

    config: Wav2Vec2Config
    settings: MaskingSettings
    rows_per_group: int
    seed: int

    def __call__(self, example: dict[str, np.ndarray], key: int, record: int = 0,
                 start: int = 0) -> dict[str, np.ndarray]:
        del record, start  # the masks depend on the row's place alone
        group, row = divmod(key, self.rows_per_group)
        return group_row_masks(self.config, self.settings, example, row, self.rows_per_group,
                               np.random.default_rng([self.seed, group, 1]),
                               np.random.default_rng([self.seed, key, 2]))


def group_row_masks(config: Wav2Vec2Config, settings: MaskingSettings,
                    example: dict[str, np.ndarray], row: int, rows: int,
                    group_rng: np.random.Generator, row_rng: np.random.Generator
                    ) -> dict[str, np.ndarray]:
    """`example` with the masks of row `row` of a group of `rows` equally long rows
    (`group_span_mask`, from `group_rng`) and its distractors (from `row_rng`)."""
    frames = int(feature_lengths(config, len(example["audio"])))
    mask = group_span_mask(frames, settings, row, rows, group_rng)
    negatives = sample_negatives(mask[None], settings.num_negatives, row_rng)[0]
    return {**example, "mask_time_indices": mask, "sampled_negative_indices": negatives}


@dataclasses.dataclass(frozen=True)
class BatchGroupMasks:
    """`GroupMasks` for batches within a samples budget (`audio.budget_crop_batches`' `finish`),
    whose row count varies: batch `key` of R rows is `groups` groups (batch_groups per
    micro-batch, times the micro-batches) of R / groups consecutive rows; a group's masks come
    from an rng seeded by (seed, key, group), a row's distractors from (seed, key, row)."""

    config: Wav2Vec2Config
    settings: MaskingSettings
    groups: int
    seed: int

    def __call__(self, example: dict[str, np.ndarray], key: int, row: int, rows: int
                 ) -> dict[str, np.ndarray]:
        per_group = rows // self.groups
        group, place = divmod(row, per_group)
        return group_row_masks(self.config, self.settings, example, place, per_group,
                               np.random.default_rng([self.seed, key, group, 3]),
                               np.random.default_rng([self.seed, key, row, 4]))


def pretraining_loss(model: Wav2Vec2, batch: Batch, rng: jax.Array | None, *,
                     objective: Wav2Vec2ObjectiveConfig) -> tuple[jax.Array, Metrics]:
    """`wav2vec2_loss` of an audio batch (`audio`, `SpanMasking`'s or `GroupMasks`' fields and,
    for padded crops, `attention_mask`) at the Gumbel temperature of `model.updates` training
    updates; training advances that count by one (evaluation, `rng=None`, quantises by argmax
    and leaves it)."""
    updates = model.updates.get_value()
    inputs = {"input_values": batch["audio"], "attention_mask": batch.get("attention_mask"),
              "mask_time_indices": batch["mask_time_indices"],
              "sampled_negative_indices": batch["sampled_negative_indices"]}
    loss, metrics = wav2vec2_loss(model, inputs, rng, objective=objective, step=updates)
    if rng is not None:
        model.updates.set_value(updates + 1)
        metrics["gumbel_temperature"] = (gumbel_temperature(updates, objective),
                                         jnp.ones((), jnp.float32))
    return loss, metrics


def resolve_for_run(objective: Wav2Vec2ObjectiveConfig, config: Any
                    ) -> Wav2Vec2ObjectiveConfig:
    """The run's objective settings (`per_loss_call_decay`), once a micro-batch is known to
    split into `batch_groups` groups."""
    check_batch_groups(objective.batch_groups, config)
    return per_loss_call_decay(objective, config)


def per_loss_call_decay(objective: Wav2Vec2ObjectiveConfig, config: Any
                        ) -> Wav2Vec2ObjectiveConfig:
    """`gumbel_decay` is per optimizer update (fairseq `num_updates`); the loss advances the
    count once per call, which is optim.grad_accum_steps = A times an update, so each call
    decays by gumbel_decay^(1/A): after every update the temperature is fairseq's (within one
    update the micro-batches' temperatures differ by that fraction of a step)."""
    accumulation = config.optim.grad_accum_steps
    if accumulation == 1:
        return objective
    return dataclasses.replace(objective, gumbel_decay=objective.gumbel_decay ** (1 / accumulation))


def build_wav2vec2(config: Wav2Vec2Config, seed: int) -> Wav2Vec2:
    return Wav2Vec2(config, rngs=nnx.Rngs(seed))


def budget_crop_segments(records: AudioRecords, model_config: Wav2Vec2Config,
                         objective: Wav2Vec2ObjectiveConfig) -> Segments:
    """`PreparedData.segments` of batches within `examples.samples_per_batch` samples cropped
    to their shortest (`audio.budget_crop_batches`): rows in a multiple of the mesh's shards
    and of the groups (batch_groups per micro-batch), each row masked by `BatchGroupMasks`."""

    def source(multiple: int, config: Any) -> Any:
        groups = objective.batch_groups * config.optim.grad_accum_steps
        seed = config.train.seed
        return budget_crop_batches(records, config.examples, math.lcm(multiple, groups), seed,
                                   BatchGroupMasks(model_config, objective, groups, seed))

    return budget_batches(source)


def mask_audio(data: PreparedData, model_config: Wav2Vec2Config,
               objective: Wav2Vec2ObjectiveConfig, load: Loader | None = None) -> PreparedData:
    """Training masks drawn while loading: `SpanMasking` of padded crops, or batches cropped
    to their shortest utterance with `GroupMasks` (`examples.crop_to_shortest`); held-out
    examples (padded first windows either way) masked once by `SpanMasking` with a fixed seed,
    so held-out numbers compare across runs (none: a trainer fed its batches directly, as
    bench's and the parity tests' are)."""
    del load
    masking = SpanMasking(model_config, objective)
    held_out = None if data.eval is None else mask_records(data.eval, masking,
                                                           HELD_OUT_MASK_SEED)
    examples = getattr(data.train, "example_config", None)
    if isinstance(data.train, AudioRecords) and getattr(examples, "samples_per_batch", 0):
        return dataclasses.replace(data, eval=held_out, segments=budget_crop_segments(
            data.train, model_config, objective))
    if isinstance(data.train, AudioRecords) and getattr(examples, "crop_to_shortest", False):
        return dataclasses.replace(data, eval=held_out, segments=shortest_crop_segments(
            data.train, objective.batch_groups,
            lambda rows, seed: GroupMasks(model_config, objective, rows, seed)))
    return dataclasses.replace(data, transforms=(*data.transforms, masking), eval=held_out)


# Test/demo size: the tiny speech encoder, small codebooks, no dropout.
TINY_MODEL = {**TINY_SPEECH_ENCODER, "codevectors_per_group": 32, "codevector_dim": 32,
              "projection_dim": 32, "quantizer_input_dropout": 0.0}
TINY_OPTIM = {**FAIRSEQ_ROBERTA_OPTIM, "learning_rate": 1e-3, "warmup_steps": 20}

PRESETS = {
    # The tiny model with 20 distractors on one-second crops of the user's audio folder (--data).
    "wav2vec2_tiny": {
        "model": TINY_MODEL,
        "objective": {"num_negatives": 20},
        "examples": {"max_samples": 16000, "max_eval_examples": 256},
        "data": {"source": "", "held_out_fraction": 0.1},
        "optim": TINY_OPTIM,
        "train": {"steps": 200, "batch_size": 16, "log_every": 25, "eval_every": 100,
                  "checkpoint_every": 100, "eval_batches": 4},
    },
    # bench/speech_fsdd.py: the tiny model on FSDD's 2,700 training recordings (labels and
    # split from the file names), one-second crops (most recordings whole), probes of digit and
    # speaker on the last hidden state; linear decay over 1,500 steps.
    "wav2vec2_digits": {
        "model": TINY_MODEL,
        "objective": {"num_negatives": 20},
        "examples": {**FSDD_EXAMPLES, "max_samples": 16000, "max_eval_examples": 300},
        "data": {"source": ""},
        "optim": {**TINY_OPTIM, "warmup_steps": 100},
        "train": {"steps": 1500, "batch_size": 16, "log_every": 25, "eval_every": 500,
                  "checkpoint_every": 500, "eval_batches": 4},
    },
    # BASE on LibriSpeech 960 h (Baevski et al. 2020 §4.2; fairseq
    # examples/wav2vec/config/pretraining/wav2vec2_base_librispeech.yaml): the model's and the
    # objective's defaults are that recipe (conv (512,)*7, group norm, 12 x 768, FFN 3072, 12
    # heads, position conv 128/16, G=2 V=320, codevectors 256, final dim 256, dropout 0.1,
    # layerdrop 0.05, feature dropouts 0.1, feature gradient x 0.1; mask p 0.065 x span 10, 100
    # distractors, kappa 0.1, diversity 0.1, feature penalty 10, Gumbel 2 -> 0.5 by 0.999995).
    # fairseq's Adam (0.9, 0.98), eps 1e-6, decoupled weight decay 0.01, lr 5e-4 after 32k
    # warmup updates then linear decay to 400k (polynomial_decay), no clipping; utterances under
    # 32,000 samples dropped, no normalisation; batches of similar lengths cropped to their
    # shortest utterance (at most 250,000 samples), so no padding; per GPU batch (64 groups of
    # rows): equal masked counts, perplexity, feature penalty and LayerDrop draws.
    # Batches of at most 1.4 M samples per GPU x 64 = 89.6 M per step (fairseq max_tokens;
    # `examples.samples_per_batch`): 320 rows at the 250,000 cap, 5 per group as fairseq's 5
    # per GPU, more for shorter lengths; at most 5,600 s of audio per update (the paper's
    # "1.6 h"). Where this departs: fairseq sizes each GPU's batch by its longest utterance
    # before the crop, ours the step's batch by the cropped length, at one of 8 lengths (8
    # buckets, so at most 8 shapes compile); train.batch_size sizes the held-out batches.
    # Mixed precision is bfloat16 compute (fairseq: fp16 with loss scaling).
    "wav2vec2_base": {
        "model": {"dtype": "bfloat16"},
        "objective": {"batch_groups": 64},
        "examples": {"max_samples": 250000, "min_samples": 32000, "crop_to_shortest": True,
                     "length_buckets": 8, "samples_per_batch": 89_600_000},
        "data": {"source": "", "worker_count": 16},
        "optim": {**FAIRSEQ_ROBERTA_OPTIM, "learning_rate": 5e-4, "warmup_steps": 32000},
        "train": {"steps": 400000, "batch_size": 384, "eval_every": 10000},
    },
}


register(Method(
    name="wav2vec2",
    model_config=Wav2Vec2Config,
    example_config=AudioBatchingConfig,
    objective_config=Wav2Vec2ObjectiveConfig,
    build_model=build_wav2vec2,
    loss=pretraining_loss,
    prepare=prepare_speech,
    units_per_example=lambda examples: examples.max_samples,
    unit="samples",
    description="wav2vec 2.0: contrastive prediction of quantised speech features at masked "
                "frames (Baevski et al. 2020)",
    presets=PRESETS,
    resolution=Resolution(check=check_frames, run_settings=resolve_for_run,
                          complete_data=mask_audio),
    evaluation=Evaluation(monitor=probe_monitor(probe_layers), summarize=probe_summary(
        ("loss", "contrastive_accuracy", "codevector_perplexity"))),
    start=Start(hf_models=(Wav2Vec2,)),
))
