"""wav2vec (Schneider, Baevski, Collobert and Auli 2019, §2-3): the binary contrastive loss of
telling the true future latent z_{i+k} from distractors drawn from the same utterance, given
the projected context h_k(c_i), for k = 1..K (K = 12).

Re-stated from fairseq `fairseq/models/wav2vec/wav2vec.py` (`Wav2VecPredictionsModel`:
`sample_negatives`, `forward`) and `fairseq/criterions/wav2vec_criterion.py`:
- Negatives (`sample_negatives`): for every target frame u of an utterance, `num_negatives`
  frames drawn uniformly with replacement from the utterance's other frames (a draw from
  [0, T - 1), moved up by one at or above u; here T is the row's real frames), shared by the
  K steps that predict that frame.
- Logits: a candidate z scores z . h_k(c_i), step k's target frame u = i + offset + k - 1
  (`offset`, `models.wav2vec.Wav2VecConfig.step_offset`).
- Loss (`infonce` off, the paper's eq. 1 with lambda = the number of negatives): binary
  cross-entropy with logits, label 1 for the positive and 0 for each negative, summed over
  every scored (i, k) and divided by the number of positives (the criterion's `sample_size`);
  `balanced_classes` weighs the negatives 1 / N. `infonce` on: the cross-entropy of the
  positive among [positive, negatives] instead (what wav2vec 2.0 uses).
Not ported: `cross_sample_negatives` and `sample_distance` (both off in the paper's recipe).

Metrics: the loss, the accuracy of the positive scoring above every negative over all scored
(i, k), and that accuracy per step k. Evaluation (`rng=None`) draws negatives with a fixed key.
Padding-aware: only real frames (`Wav2VecOutput.frames`) are targets, contexts or negatives.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.audio import AudioExampleConfig
from pretext_jax.models.wav2vec import Wav2Vec, Wav2VecConfig, frame_lengths
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
class Wav2VecLossSettings:
    """The `objective` section (fairseq's defaults: 10 negatives, binary loss, unbalanced)."""

    num_negatives: int = 10
    """N, distractors per target frame from the same utterance (paper 10)."""
    balanced_classes: bool = False
    """Weigh each negative's term 1 / N (fairseq `balanced_classes`, off)."""
    infonce: bool = False
    """Cross-entropy over [positive, negatives] instead of the binary loss (fairseq criterion
    `infonce`, off for wav2vec)."""

    def __post_init__(self) -> None:
        if self.num_negatives < 1:
            raise ValueError(f"num_negatives={self.num_negatives} must be >= 1 (wav2vec: 10)")


def sample_negatives(rng: jax.Array, frames: jax.Array, num_negatives: int) -> jax.Array:
    """[B, T, N] int32 frame indices within each row: for target frame (b, u), N draws uniform
    with replacement over the row's real frames (`frames` [B, T] bool, a prefix) other than u,
    as fairseq's `sample_negatives` (a draw from [0, n - 1), plus one at or above u). A
    padding target's draws are never scored."""
    batch_size, num_frames = frames.shape
    real = jnp.sum(frames, axis=1).astype(jnp.int32)  # [B]
    draws = jax.random.randint(rng, (batch_size, num_frames, num_negatives), 0,
                               jnp.maximum(real - 1, 1)[:, None, None])
    draws = draws + (draws >= jnp.arange(num_frames)[None, :, None])
    return jnp.minimum(draws, num_frames - 1).astype(jnp.int32)


def aligned_predictions(predictions: jax.Array, offset: int) -> jax.Array:
    """[B, T, K, C] h_k(c_i) at context frame i -> the same at target frame u = i + offset +
    k - 1 (zeros where u has no context)."""
    num_frames, num_steps = predictions.shape[1], predictions.shape[2]
    shifted = []
    for step in range(num_steps):
        shift = min(offset + step, num_frames)
        shifted.append(jnp.pad(predictions[:, :num_frames - shift, step],
                               ((0, 0), (shift, 0), (0, 0))))
    return jnp.stack(shifted, axis=2)


def binary_contrastive(features: jax.Array, predictions: jax.Array, frames: jax.Array,
                       negatives: jax.Array, offset: int, *, balanced_classes: bool = False,
                       infonce: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Eq. 1 per step: `features` z [B, T, C], `predictions` h_k(c_i) [B, T, K, C] (at context
    frame i), `frames` [B, T] bool, `negatives` [B, T, N] frame indices per target frame.
    Returns per k ([K] each): the summed losses, the number of scored (i, u) pairs (u real,
    u - offset - k + 1 >= 0) and how many of them score the positive above every negative."""
    num_frames, num_steps = predictions.shape[1], predictions.shape[2]
    aligned = aligned_predictions(predictions, offset).astype(jnp.float32)  # [B, T, K, C]
    features = features.astype(jnp.float32)
    candidates = jax.vmap(lambda z, index: z[index])(features, negatives)  # [B, T, N, C]
    positive = jnp.einsum("btkc,btc->btk", aligned, features)
    negative = jnp.einsum("btkc,btnc->btkn", aligned, candidates)  # [B, T, K, N]
    if infonce:
        logits = jnp.concatenate([positive[..., None], negative], axis=-1)
        per_pair = jax.nn.logsumexp(logits, axis=-1) - positive
    else:
        weight = 1.0 / negatives.shape[-1] if balanced_classes else 1.0
        # -log sigma(x) = softplus(-x); -log(1 - sigma(x)) = softplus(x)
        per_pair = jax.nn.softplus(-positive) + weight * jnp.sum(jax.nn.softplus(negative), -1)
    first = offset + jnp.arange(num_steps)  # the first target frame of each step
    scored = frames[..., None] & (jnp.arange(num_frames)[:, None] >= first)[None]  # [B, T, K]
    correct = scored & (positive > jnp.max(negative, axis=-1))
    return (jnp.sum(jnp.where(scored, per_pair, 0.0), axis=(0, 1)),
            jnp.sum(scored, axis=(0, 1)).astype(jnp.float32),
            jnp.sum(correct, axis=(0, 1)).astype(jnp.float32))


def wav2vec_loss(model: Wav2Vec, batch: Batch, rng: jax.Array | None, *,
                 objective: Wav2VecLossSettings | None = None) -> tuple[jax.Array, Metrics]:
    """The loss of a batch of `audio` [B, S] with its `attention_mask` [B, S]: every scored
    pair's term summed over the steps and divided by the number of positives (module
    docstring)."""
    objective = objective or Wav2VecLossSettings()
    out = model(batch["audio"], batch.get("attention_mask"))
    key = jax.random.key(EVALUATION_SEED) if rng is None else rng
    negatives = sample_negatives(key, out.frames, objective.num_negatives)
    sums, counts, correct = binary_contrastive(
        out.features, model.predictions(out.context), out.frames, negatives,
        model.config.step_offset, balanced_classes=objective.balanced_classes,
        infonce=objective.infonce)
    loss = jnp.sum(sums) / jnp.maximum(jnp.sum(counts), 1.0)
    one = jnp.ones((), jnp.float32)
    return loss, {"loss": (loss, one), "accuracy": (jnp.sum(correct), jnp.sum(counts)),
                  **{f"accuracy_step_{k + 1}": (correct[k], counts[k])
                     for k in range(len(counts))}}


def build_wav2vec(config: Wav2VecConfig, seed: int) -> Wav2Vec:
    with nnx.use_eager_sharding(False):
        return Wav2Vec(config, rngs=nnx.Rngs(seed))


def probe_layers(model: Wav2Vec, audio: jax.Array, attention_mask: jax.Array, layer: int
                 ) -> tuple[jax.Array, jax.Array]:
    """The probes' features: layer 0 is z (the encoder), 1 the context c (what the paper feeds
    its acoustic model, §3.3); with the real frames."""
    out = model(audio, attention_mask)
    return (out.features, out.context)[layer], out.frames


def check_windows(model: Wav2VecConfig, examples: AudioExampleConfig, objective: Any = None
                  ) -> None:
    """A window must give more frames than the offset, so step 1 has a target; the probes
    read z or c."""
    check_probe_layer(examples, 2)
    frames = frame_lengths(model, examples.max_samples)
    if frames <= model.step_offset:
        raise UserError(
            f"examples.max_samples={examples.max_samples} gives {max(frames, 0)} frames, not "
            f"more than the prediction offset {model.step_offset}; raise examples.max_samples "
            f"to at least {(model.step_offset + 2) * model.samples_per_frame}")


# fairseq's Adam (FairseqAdam's defaults: betas 0.9, 0.999, eps 1e-8 added before the bias
# correction, no weight decay) with the README's cosine schedule after a linear warmup; no
# clipping (fairseq clip_norm 0).
FAIRSEQ_ADAM_COSINE = {"optimizer": "adamw", "schedule": "cosine", "b2": 0.999, "eps": 1e-8,
                       "weight_decay": 0.0, "bias_correction": True,
                       "eps_before_bias_correction": True, "clip_norm": 0.0}
# Test/demo size: 5 encoder layers of 32 channels (the paper's kernels and strides, 160
# samples a frame), a 3-layer context network of 32, K = 4 (offset 3).
TINY_MODEL = {"conv_channels": [32] * 5, "conv_kernel_sizes": [10, 8, 4, 4, 4],
              "conv_strides": [5, 4, 2, 2, 2], "aggregator_channels": [32] * 3,
              "aggregator_kernel_sizes": [2, 3, 4], "prediction_steps": 4}

PRESETS = {
    # Seconds on a CPU: the tiny model on 0.2 s windows (18 frames) of the user's audio folder.
    "wav2vec_tiny": {
        "model": TINY_MODEL,
        "examples": {"max_samples": 3200, "max_eval_examples": 64},
        "data": {"source": "", "held_out_fraction": 0.1},
        "optim": {**FAIRSEQ_ADAM_COSINE, "learning_rate": 2e-3, "warmup_steps": 20},
        "train": {"steps": 200, "batch_size": 16, "log_every": 25, "eval_every": 100,
                  "checkpoint_every": 100, "eval_batches": 2},
    },
    # FSDD (../shared/data/fsdd/recordings, as wav2vec2_digits; bench/speech_fsdd.py): five
    # encoder layers of 64 channels (the paper's kernels and strides) and a 3-layer context
    # network of 64, K = 12 steps on half-second windows (50 frames), probes of digit and
    # speaker on the context c; cosine decay over 1,500 steps.
    "wav2vec_digits": {
        "model": {**TINY_MODEL, "conv_channels": [64] * 5, "aggregator_channels": [64] * 3,
                  "prediction_steps": 12},
        "examples": {**FSDD_EXAMPLES, "max_samples": 8000, "max_eval_examples": 300,
                     "probe_layer": 1},
        "data": {"source": ""},
        "optim": {**FAIRSEQ_ADAM_COSINE, "learning_rate": 2e-3, "warmup_steps": 100},
        "train": {"steps": 1500, "batch_size": 32, "log_every": 25, "eval_every": 500,
                  "checkpoint_every": 500, "eval_batches": 4},
    },
    # wav2vec large as fairseq's examples/wav2vec/README.md trains it (the model's and the
    # objective's defaults) on all 960 h of LibriSpeech: Adam lr 5e-3, 500 warmup updates,
    # cosine to 1e-6 at 400k updates, crops of at most 150,000 samples, 1.5 M samples per GPU
    # on 16 GPUs (§3.3): 16 x 10 rows at the crop cap; docs/methods/speech.md's card.
    "wav2vec_librispeech": {
        "examples": {"sample_rate": 16000, "max_samples": 150000},
        "data": {"source": "tfds:librispeech",
                 "tfds_split": "train_clean100+train_clean360+train_other500",
                 "held_out_fraction": 0.01},
        "optim": {**FAIRSEQ_ADAM_COSINE, "learning_rate": 5e-3, "warmup_steps": 500,
                  "end_learning_rate": 1e-6},
        "train": {"steps": 400000, "batch_size": 160, "eval_every": 10000},
    },
}


METHOD = register(Method(
    name="wav2vec",
    model_config=Wav2VecConfig,
    example_config=AudioExampleConfig,
    objective_config=Wav2VecLossSettings,
    build_model=build_wav2vec,
    loss=wav2vec_loss,
    prepare=prepare_speech,
    units_per_example=lambda examples: examples.max_samples,
    unit="samples",
    description="wav2vec: binary contrastive prediction of future audio latents from a "
                "convolutional context network (Schneider et al. 2019)",
    presets=PRESETS,
    resolution=Resolution(check=check_windows),
    evaluation=Evaluation(monitor=probe_monitor(probe_layers),
                          summarize=probe_summary(("loss", "accuracy"))),
))
