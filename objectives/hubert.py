"""HuBERT's pre-training objective (Hsu et al. 2021 §2-§3, §4.2): masked prediction of
cluster targets.

Reference: fairseq `models/hubert/hubert.py` (`compute_nce`, `compute_pred`, `forward`,
`feature_grad_mult`, `features_pen`), `criterions/hubert_criterion.py` and
`examples/hubert/config/pretrain/hubert_base_librispeech.yaml`.

- Targets: one cluster index per 20 ms frame (`batch["cluster_labels"]` [B, T], -1 where a
  frame has none).
- Masking (§4.2): span masks as wav2vec 2.0's (`objectives.common.speech.span_mask`), with
  fairseq HuBERT's mask_prob 0.8 over spans of 10 (p = 0.08 of the frames start a span).
- Prediction (§3): p(c | X~, t) = softmax_c(cos(A o_t, e_c) / tau), tau = 0.1 (fairseq
  `logit_temp`), A `final_proj`, e_c the cluster embeddings. fairseq puts the target first
  among every cluster with the target's own copy at -inf (`compute_nce`), which is the
  softmax over the K clusters.
- Loss (§2, eq. 2-3; fairseq `HubertCriterion`): alpha x the cross-entropy summed over the
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

import jax
import jax.numpy as jnp

from pretext_jax.models.hubert import Hubert
from pretext_jax.objectives.common.speech import feature_penalty
from pretext_jax.objectives.registry import Batch, Metrics


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
