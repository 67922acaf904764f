"""UniLM's sequence-to-sequence fine-tuning loss (Dong et al. 2019 §2.4, §3.2): target tokens
of `[SOS] source [EOS] target [EOS]` are masked and predicted under the seq2seq mask
(`models.prefix_lm.PrefixLM`), as microsoft/unilm unilm-v1 trains them
(src/biunilm/seq2seq_loader.py `Preprocess4Seq2seq.__call__` 181-254, modeling.py
`BertForPreTrainingLossMask.forward` 1288-1300, loss.py `LabelSmoothingLoss`).

Masking, per example, drawn on the device from the step's key (unilm-v1 draws it on the host
for every example it loads; the same distribution): the candidates are every target token, the
final EOS included, and with `mask_source_words` also the source tokens but its EOS
(seq2seq_loader.py 191-199); n = min(max_pred, max(1, round(mask_prob x k))) of them, k the
target's tokens without its EOS (plus the source's without EOS with `mask_source_words`:
183-187; Python's and jnp's round both round half to even), uniformly without replacement
(the first n of a shuffle, 200-238, without n-gram spans: run_seq2seq.py's `skipgram_prb`
defaults to 0); each chosen token becomes [MASK] with probability 0.8, a uniformly drawn id of
the vocabulary with 0.1, and stays with 0.1 (245-249). A held-out batch (no step key) is
masked with a fixed key, so its loss compares between evaluations.

Loss: the KL divergence of the model's distribution from the smoothed target, the target's
probability 1 - eps and eps / (V - 2) on every other id but padding (`LabelSmoothingLoss`;
with eps 0 the cross-entropy), summed over the chosen positions and divided by their count
in the batch plus 1e-5 (`loss_mask_and_normalize`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pretext_jax.errors import UserError
from pretext_jax.models.layers import split_rng
from pretext_jax.objectives.registry import Batch, Metrics

EVAL_KEY = 0  # the held-out batches' masking key


@dataclasses.dataclass(frozen=True)
class MaskedTargetSettings:
    """The masked-target fine-tuning loss (unilm-v1 run_seq2seq.py's flags)."""

    label_smoothing: float = 0.1
    """eps of the smoothed target, in [0, 1) (UniLM §3.2: 0.1)."""
    mask_prob: float = 0.7
    """Share of the target tokens masked, in (0, 1] (UniLM §3.2: 0.7)."""
    max_pred: int = 140
    """Most masked tokens per example (run_seq2seq --max_pred; CNN/DailyMail 140)."""
    mask_source_words: bool = False
    """Also mask source tokens (run_seq2seq --mask_source_words; off in the recipes)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.label_smoothing < 1.0:
            raise UserError(f"objective.label_smoothing={self.label_smoothing} must be in [0, 1)")
        if not 0.0 < self.mask_prob <= 1.0 or self.max_pred < 1:
            raise UserError(f"objective.mask_prob={self.mask_prob} must be in (0, 1] and "
                            f"objective.max_pred={self.max_pred} at least 1 (UniLM: 0.7, 140)")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TargetMasks:
    """What `sample_masks` draws: the masked sequences' source (`inputs` [B, S]) and target
    (`targets` [B, T]) blocks, and per example the `positions` [B, P] of the chosen tokens in
    the packed sequence (`[SOS]` at 0, source j at 1 + j, target k at 1 + S + k), their
    original `labels` and `weights` (1 for the first n, 0 after)."""

    inputs: jax.Array
    targets: jax.Array
    positions: jax.Array
    labels: jax.Array
    weights: jax.Array


def sample_masks(rng: jax.Array, batch: Batch, settings: MaskedTargetSettings, *,
                 vocab_size: int, mask_id: int, eos_id: int) -> TargetMasks:
    """The masking of one batch of summary records (`inputs`, `input_mask`, `targets`,
    `target_mask`; module docstring)."""
    inputs, targets = batch["inputs"], batch["targets"]
    source_tokens = batch["input_mask"].astype(bool)
    target_tokens = batch["target_mask"].astype(bool)
    width = inputs.shape[1]
    count = jnp.sum(target_tokens, axis=1) - 1  # target tokens without EOS
    if settings.mask_source_words:
        source = source_tokens & (inputs != eos_id)  # the document, not its EOS
        count = count + jnp.sum(source, axis=1)
    else:
        source = jnp.zeros_like(source_tokens)
    candidates = jnp.concatenate([source, target_tokens], axis=1)  # [B, S + T]
    chosen_count = jnp.minimum(settings.max_pred, jnp.maximum(
        1, jnp.round(count * settings.mask_prob).astype(jnp.int32)))
    slots = min(settings.max_pred, candidates.shape[1] if settings.mask_source_words
                else targets.shape[1])
    shuffle_key, mode_key, coin_key, word_key = jax.random.split(rng, 4)
    order = jnp.where(candidates, jax.random.uniform(shuffle_key, candidates.shape), 2.0)
    chosen = jnp.argsort(order, axis=1)[:, :slots]  # [B, P]: candidates in random order
    weights = (jnp.arange(slots) < chosen_count[:, None]).astype(jnp.float32)
    sequence = jnp.concatenate([inputs, targets], axis=1)
    labels = jnp.take_along_axis(sequence, chosen, axis=1)
    masked = jax.random.uniform(mode_key, chosen.shape) < 0.8
    random = ~masked & (jax.random.uniform(coin_key, chosen.shape) < 0.5)
    words = jax.random.randint(word_key, chosen.shape, 0, vocab_size, labels.dtype)
    replaced = jnp.where(masked, mask_id, jnp.where(random, words, labels))
    rows = jnp.arange(sequence.shape[0])[:, None]
    # unchosen slots write their own token back (their weight is 0)
    sequence = sequence.at[rows, chosen].set(jnp.where(weights > 0, replaced, labels))
    return TargetMasks(sequence[:, :width], sequence[:, width:], chosen + 1, labels, weights)


def smoothed_kl(log_probs: jax.Array, labels: jax.Array, label_smoothing: float, pad_id: int
                ) -> tuple[jax.Array, jax.Array]:
    """(unilm-v1's label-smoothed loss, the plain negative log-likelihood) per position of
    `log_probs` [..., V] at `labels` [...]: KL(q || p) with q = 1 - eps at the label and
    eps / (V - 2) at every other id but `pad_id` (loss.py `LabelSmoothingLoss`)."""
    nll = -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    if not label_smoothing:
        return nll, nll
    smooth = label_smoothing / (log_probs.shape[-1] - 2)
    others = -(jnp.sum(log_probs, axis=-1) + nll) + log_probs[..., pad_id]  # -sum log p, rest
    entropy = ((1.0 - label_smoothing) * jnp.log1p(-label_smoothing)
               + label_smoothing * jnp.log(smooth))  # sum q log q
    return entropy + (1.0 - label_smoothing) * nll + smooth * others, nll


def masked_target_loss(model: Any, batch: Batch, rng: jax.Array | None, *,
                       objective: MaskedTargetSettings) -> tuple[jax.Array, Metrics]:
    """The masked-target loss of a `PrefixLM` on a batch of summary records (module
    docstring); `rng=None` is evaluation (no dropout, the fixed masking key)."""
    c = model.config
    mask_rng, dropout_rng = split_rng(rng, 2)
    masks = sample_masks(jax.random.key(EVAL_KEY) if mask_rng is None else mask_rng, batch,
                         objective, vocab_size=c.vocab_size, mask_id=c.mask_token_id,
                         eos_id=c.eos_token_id)
    logits = model(masks.inputs, batch["input_mask"], masks.targets,
                   masked_positions=masks.positions, rng=dropout_rng)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    per_token, nll = smoothed_kl(log_probs, masks.labels, objective.label_smoothing,
                                 c.pad_token_id)
    total = jnp.sum(masks.weights)
    loss = jnp.sum(masks.weights * per_token) / (total + 1e-5)
    correct = (jnp.argmax(logits, axis=-1) == masks.labels).astype(jnp.float32)
    return loss, {"loss": (jnp.sum(masks.weights * per_token), total),
                  "nll": (jnp.sum(masks.weights * nll), total),
                  "accuracy": (jnp.sum(masks.weights * correct), total),
                  "masked_tokens": (total, jnp.float32(batch["targets"].shape[0]))}
