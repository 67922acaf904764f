"""Contrastive Predictive Coding on raw audio (van den Oord, Li and Vinyals 2018, §2.2-2.3 and
§3.1): the InfoNCE loss of predicting the latents z_{t+k}, k = 1..K, from the context c_t.

For every real target frame z_u of the batch and every step k with a real context frame
t = u - k >= 0, a candidate z scores z^T W_k c_t (the log of eq. 3's f_k); the loss is the
cross-entropy of the true z_u among [z_u, N negatives] (eq. 4), averaged over the (b, t) of
each k, then over k. Negatives (the paper: "negative samples from the same and other sequences
in the mini-batch"; §3.1: each GPU's minibatch of 8 "from which the negative samples ... are
drawn"): `num_negatives` frames per target frame, drawn uniformly with replacement from every
real frame of its pool (`pool_sequences` consecutive rows, or the whole global batch) except
the target itself, so from its own sequence with probability about 1/P; all K predictions of
the same target share them. The paper gives no count; CPC_audio's 128 is the default.
Evaluation (`rng=None`) draws them with a fixed key.
Padding-aware: only real frames (`models.cpc.frame_mask`) are targets, contexts or negatives.

Metrics: the loss, the accuracy of picking the positive (its score above every negative's,
what the paper plots per step for speech) over all (b, t, k), and that accuracy per step k.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.audio import AudioExampleConfig
from pretext_jax.models.cpc import CPC, CPCConfig, frame_lengths
from pretext_jax.objectives.common.preset_parts import FSDD_EXAMPLES
from pretext_jax.objectives.common.speech import (
    check_probe_layer,
    prepare_speech,
    probe_monitor,
    probe_summary,
)
from pretext_jax.objectives.registry import Batch, Evaluation, Method, Metrics, Resolution, register

EVALUATION_SEED = 0  # the negatives' key when the loss gets no rng (evaluation)


@dataclasses.dataclass(frozen=True)
class CPCLossSettings:
    """The `objective` section: how many negatives each prediction is scored against."""

    num_negatives: int = 128
    """N, negatives per target frame, uniform over the real frames of its pool other than the
    target (its own and the pool's other sequences); not given in the paper, CPC_audio 128."""
    pool_sequences: int = 0
    """P, the consecutive rows of the batch whose frames are a target's negatives: 0 = the
    whole global batch; 8 = each GPU's 8 windows, as the paper draws them (§3.1)."""

    def __post_init__(self) -> None:
        if self.num_negatives < 1:
            raise ValueError(f"num_negatives={self.num_negatives} must be >= 1 (CPC_audio: 128)")
        if self.pool_sequences < 0:
            raise ValueError(f"pool_sequences={self.pool_sequences} must be >= 0 (0 = the whole "
                             "batch; the paper 8)")


def sample_negatives(rng: jax.Array, frames: jax.Array, num_negatives: int,
                     pool_sequences: int = 0) -> jax.Array:
    """[B, T, N] int32 indices into the flattened [B x T] frames: for each target frame (b, u),
    N draws uniform with replacement over the real frames (`frames` [B, T] bool) of its pool,
    rows [g P, (g + 1) P) for g = b // P (`pool_sequences` P; 0 = the whole batch), other than
    (b, u) itself. Real frames are numbered in row-major order; a pool's are a contiguous
    range of those numbers, so a draw is a number in the range, one past the target's own
    number skipped, mapped back to its frame. A padding target's draws are never scored."""
    batch_size, num_frames = frames.shape
    real = frames.reshape(-1).astype(jnp.int32)  # [B T]
    ranks = jnp.cumsum(real)  # inclusive: the real frame i is number ranks[i] - 1
    bounds = jnp.concatenate([jnp.zeros((1,), jnp.int32), ranks])  # real frames before i
    pool_rows = pool_sequences or batch_size
    rows = jnp.arange(batch_size * num_frames) // num_frames
    first = rows // pool_rows * pool_rows * num_frames
    last = jnp.minimum(first + pool_rows * num_frames, batch_size * num_frames)
    others = bounds[last] - bounds[first] - real  # [B T]
    draws = bounds[first][:, None] + jax.random.randint(
        rng, (real.shape[0], num_negatives), 0, jnp.maximum(others, 1)[:, None])
    draws = draws + real[:, None] * (draws >= ranks[:, None] - 1)  # [B T, N]
    indices = jnp.searchsorted(ranks, jnp.minimum(draws, ranks[-1] - 1), side="right")
    return jnp.minimum(indices, real.shape[0] - 1).astype(jnp.int32).reshape(
        batch_size, num_frames, num_negatives)


def aligned_predictions(predictions: jax.Array) -> jax.Array:
    """[B, T, K, C] W_k c_t at context frame t -> the same at target frame u = t + k: entry
    [b, u, k - 1] is W_k c_{u - k} (zeros where u < k)."""
    num_frames, num_steps = predictions.shape[1], predictions.shape[2]
    return jnp.stack([jnp.pad(predictions[:, :num_frames - k, k - 1], ((0, 0), (k, 0), (0, 0)))
                      for k in range(1, num_steps + 1)], axis=2)


def info_nce(features: jax.Array, predictions: jax.Array, frames: jax.Array,
             negatives: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Eq. 4 per step: `features` z [B, T, C], `predictions` W_k c_t [B, T, K, C] (at context
    frame t), `frames` [B, T] bool, `negatives` [B, T, N] flat frame indices per target frame.
    Returns per k ([K] each): the summed cross-entropies, the number of scored (t, t + k)
    pairs (both real) and how many of them rank the positive above every negative."""
    batch_size, num_frames, num_negatives = negatives.shape
    num_steps = predictions.shape[2]
    aligned = aligned_predictions(predictions).astype(jnp.float32)  # [B, T, K, C]
    features = features.astype(jnp.float32)
    candidates = jnp.take(features.reshape(batch_size * num_frames, -1), negatives.reshape(-1),
                          axis=0).reshape(batch_size, num_frames, num_negatives, -1)
    positive = jnp.einsum("btkc,btc->btk", aligned, features)  # [B, T, K]
    negative = jnp.einsum("btkc,btnc->btkn", aligned, candidates)  # [B, T, K, N]
    logits = jnp.concatenate([positive[..., None], negative], axis=-1)
    per_pair = jax.nn.logsumexp(logits, axis=-1) - positive  # [B, T, K]
    steps = jnp.arange(1, num_steps + 1)
    scored = frames[..., None] & (jnp.arange(num_frames)[:, None] >= steps)[None]  # [B, T, K]
    correct = scored & (positive > jnp.max(negative, axis=-1))
    return (jnp.sum(jnp.where(scored, per_pair, 0.0), axis=(0, 1)),
            jnp.sum(scored, axis=(0, 1)).astype(jnp.float32),
            jnp.sum(correct, axis=(0, 1)).astype(jnp.float32))


def cpc_loss(model: CPC, batch: Batch, rng: jax.Array | None, *,
             objective: CPCLossSettings | None = None) -> tuple[jax.Array, Metrics]:
    """The InfoNCE loss of a batch of `audio` [B, S] with its `attention_mask` [B, S],
    averaged over t for each k, then over k (module docstring)."""
    objective = objective or CPCLossSettings()
    out = model(batch["audio"], batch.get("attention_mask"))
    key = jax.random.key(EVALUATION_SEED) if rng is None else rng
    negatives = sample_negatives(key, out.frames, objective.num_negatives,
                                 objective.pool_sequences)
    loss_sums, counts, correct = info_nce(out.features, model.predictions(out.context),
                                          out.frames, negatives)
    loss = jnp.mean(loss_sums / jnp.maximum(counts, 1.0))
    one = jnp.ones((), jnp.float32)
    return loss, {"loss": (loss, one), "accuracy": (jnp.sum(correct), jnp.sum(counts)),
                  **{f"accuracy_step_{k + 1}": (correct[k], counts[k])
                     for k in range(len(counts))}}


def build_cpc(config: CPCConfig, seed: int) -> CPC:
    with nnx.use_eager_sharding(False):
        return CPC(config, rngs=nnx.Rngs(seed))


def probe_layers(model: CPC, audio: jax.Array, attention_mask: jax.Array, layer: int
                 ) -> tuple[jax.Array, jax.Array]:
    """The probes' features: layer 0 is z (g_enc), 1 the context c (g_ar, what §3.1's linear
    classifiers read); with the real frames."""
    out = model(audio, attention_mask)
    return (out.features, out.context)[layer], out.frames


def check_windows(model: CPCConfig, examples: AudioExampleConfig, objective: Any = None
                  ) -> None:
    """A window must give more frames than the K steps predicted from each context; the
    probes read z or c."""
    check_probe_layer(examples, 2)
    frames = frame_lengths(model, examples.max_samples)
    if frames <= model.prediction_steps:
        raise UserError(
            f"examples.max_samples={examples.max_samples} gives {frames} frames, not more than "
            f"model.prediction_steps={model.prediction_steps}; raise examples.max_samples to "
            f"at least {(model.prediction_steps + 1) * model.samples_per_frame}")


# torch's Adam as CPC_audio runs it: bias correction, eps 1e-8, no weight decay or clipping, a
# constant rate.
TORCH_ADAM_CONSTANT = {"schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0,
                       "bias_correction": True, "eps": 1e-8, "clip_norm": 0.0}

PRESETS = {
    # Seconds on a CPU: a 32-channel encoder, a 32-unit GRU, K = 4, 0.2 s windows (20 frames)
    # of the user's audio folder (--data), per-frame LayerNorm (converges in a few dozen steps).
    "cpc_tiny": {
        "model": {"conv_channels": 32, "context_size": 32, "prediction_steps": 4,
                  "conv_norm": "layer"},
        "objective": {"num_negatives": 16},
        "examples": {"max_samples": 3200, "max_eval_examples": 64},
        "data": {"source": "", "held_out_fraction": 0.1},
        "optim": {**TORCH_ADAM_CONSTANT, "learning_rate": 2e-3},
        "train": {"steps": 200, "batch_size": 16, "log_every": 25, "eval_every": 100,
                  "checkpoint_every": 100, "eval_batches": 2},
    },
    # The speech demo (`run.py demo --speech --data .../recordings`) and bench/speech_fsdd.py:
    # FSDD's 2,700 training recordings (labels and split from the file names), 0.5 s windows
    # (50 frames), a 128-channel encoder and GRU, K = 8; the probes classify digit and speaker.
    "cpc_digits": {
        "model": {"conv_channels": 128, "context_size": 128, "prediction_steps": 8,
                  "conv_norm": "layer"},
        "objective": {"num_negatives": 16},
        "examples": {**FSDD_EXAMPLES, "max_samples": 8000, "max_eval_examples": 300},
        "data": {"source": ""},
        "optim": {**TORCH_ADAM_CONSTANT, "learning_rate": 2e-3},
        "train": {"steps": 500, "batch_size": 32, "log_every": 25, "eval_every": 500,
                  "checkpoint_every": 250, "eval_batches": 4},
    },
    # van den Oord et al. 2018 §3.1: LibriSpeech train-clean-100 (100 h, 16 kHz), windows of
    # 20480 samples (128 frames), K = 12, Adam lr 2e-4, 8 GPUs x 8 windows = 64, negatives from
    # each GPU's 8 windows (pool_sequences 8: one device's rows of the batch). Not in the
    # paper: the step count (100,000, about 220 passes of one window per utterance), Adam's
    # other settings (torch's: bias correction, eps 1e-8, no weight decay, no clipping, a
    # constant rate), the negatives (CPC_audio's 128) and dropping utterances shorter than a
    # window (min_samples).
    "cpc_audio": {
        "objective": {"pool_sequences": 8},
        "examples": {"sample_rate": 16000, "max_samples": 20480, "min_samples": 20480},
        "data": {"source": "tfds:librispeech", "tfds_split": "train_clean100",
                 "held_out_fraction": 0.01},
        "optim": {**TORCH_ADAM_CONSTANT, "learning_rate": 2e-4},
        "train": {"steps": 100000, "batch_size": 64, "eval_every": 5000},
    },
}


METHOD = register(Method(
    name="cpc",
    model_config=CPCConfig,
    example_config=AudioExampleConfig,
    objective_config=CPCLossSettings,
    build_model=build_cpc,
    loss=cpc_loss,
    prepare=prepare_speech,
    units_per_example=lambda examples: examples.max_samples,
    unit="samples",
    description="CPC: InfoNCE of future audio latents from a GRU context (van den Oord et "
                "al. 2018)",
    presets=PRESETS,
    resolution=Resolution(check=check_windows),
    evaluation=Evaluation(monitor=probe_monitor(probe_layers),
                          summarize=probe_summary(("loss", "accuracy"))),
))
