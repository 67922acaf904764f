"""The token losses the text methods share: the weighted cross-entropy every token loss uses,
BERT's masked-LM + sentence-pair loss (BERT, ERNIE) and the teacher-forced encoder-decoder loss
(T5, BART, MASS).

Reference: google-research/bert run_pretraining.py (`get_masked_lm_output`: the weighted loss).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pretext_jax.models.t5 import PAD_ID, T5
from pretext_jax.objectives.registry import Metrics


def weighted_cross_entropy(
    logits: jax.Array, labels: jax.Array, weights: jax.Array, epsilon: float = 1e-5
) -> tuple[jax.Array, Metrics]:
    """sum(w * nll) / (sum(w) + epsilon) with float32 log-softmax, plus weighted accuracy
    (BERT's epsilon is 1e-5, ELECTRA's 1e-6; with unit weights and epsilon 0 it is the plain
    mean, as BERT's NSP loss)."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    weights = weights.astype(jnp.float32)
    loss = jnp.sum(weights * nll) / (jnp.sum(weights) + epsilon)
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return loss, {"accuracy": (jnp.sum(weights * correct), jnp.sum(weights)),
                  "loss": (jnp.sum(weights * nll), jnp.sum(weights))}


def smoothed_nll(log_probs: jax.Array, labels: jax.Array, label_smoothing: float
                 ) -> tuple[jax.Array, jax.Array]:
    """(label-smoothed loss, plain negative log-likelihood) per position of `log_probs`
    [..., V] at `labels` [...]: (1 - eps) x nll + eps / V x the sum over the vocabulary of
    -log p, i.e. the target smoothed towards the uniform distribution (fairseq 0.8's
    `label_smoothed_nll_loss`, which MASS fine-tunes with; ProphetNet's `ngram_criterions.py`;
    HF Trainer's `label_smoothing_factor`). Newer fairseq spreads eps over the V - 1 other
    tokens, a difference of eps / V on the target's weight."""
    nll = -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    if not label_smoothing:
        return nll, nll
    smooth = -jnp.sum(log_probs, axis=-1) / log_probs.shape[-1]
    return (1.0 - label_smoothing) * nll + label_smoothing * smooth, nll


def label_smoothed_cross_entropy(logits: jax.Array, labels: jax.Array, weights: jax.Array,
                                 label_smoothing: float, epsilon: float = 1e-6
                                 ) -> tuple[jax.Array, Metrics]:
    """`weighted_cross_entropy` with the target smoothed by `label_smoothing` (`smoothed_nll`):
    sum(w x loss) / (sum(w) + epsilon); the metrics add the plain cross-entropy (`nll`) beside
    the smoothed `loss`. With `label_smoothing` 0 it is `weighted_cross_entropy`."""
    if not label_smoothing:
        return weighted_cross_entropy(logits, labels, weights, epsilon)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    per_token, nll = smoothed_nll(log_probs, labels, label_smoothing)
    weights = weights.astype(jnp.float32)
    total = jnp.sum(weights)
    loss = jnp.sum(weights * per_token) / (total + epsilon)
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return loss, {"accuracy": (jnp.sum(weights * correct), total),
                  "loss": (jnp.sum(weights * per_token), total),
                  "nll": (jnp.sum(weights * nll), total)}



def mlm_and_pair_terms(out: Any, batch: dict[str, jax.Array], pair: str = "nsp"
                       ) -> tuple[jax.Array, jax.Array, Metrics]:
    """BERT's two pre-training losses (run_pretraining.py `get_masked_lm_output`,
    `get_next_sentence_output`) of a `BertOutput` computed at `masked_lm_positions`: the
    weighted MLM loss and the plain batch mean (`tf.reduce_mean`, no epsilon) of the pair
    classifier's loss on `next_sentence_labels`; metrics `mlm_loss`, `mlm_accuracy`,
    `{pair}_loss`, `{pair}_accuracy` (BERT and ERNIE: nsp)."""
    mlm_loss, mlm = weighted_cross_entropy(out.mlm_logits, batch["masked_lm_ids"],
                                           batch["masked_lm_weights"])
    labels = batch["next_sentence_labels"]
    pair_loss, pair_metrics = weighted_cross_entropy(out.nsp_logits, labels,
                                                     jnp.ones(labels.shape), epsilon=0.0)
    return mlm_loss, pair_loss, {"mlm_loss": mlm["loss"], "mlm_accuracy": mlm["accuracy"],
                                 f"{pair}_loss": pair_metrics["loss"],
                                 f"{pair}_accuracy": pair_metrics["accuracy"]}


def mlm_and_pair_loss(model: Any, batch: dict[str, jax.Array], rng: jax.Array | None,
                      pair: str = "nsp", pair_weight: float = 1.0) -> tuple[jax.Array, Metrics]:
    """BERT's pre-training loss for a model returning `BertOutput`: MLM + `pair_weight` x the
    pair loss (`mlm_and_pair_terms`; its metrics are reported whatever the weight)."""
    out = model(batch["input_ids"], batch["segment_ids"], batch["input_mask"],
                masked_positions=batch["masked_lm_positions"], rng=rng)
    mlm_loss, pair_loss, metrics = mlm_and_pair_terms(out, batch, pair)
    total = mlm_loss + pair_weight * pair_loss
    return total, {"loss": (total, jnp.ones((), jnp.float32)), **metrics}



def encoder_decoder_loss(model: T5, inputs: jax.Array, input_mask: jax.Array,
                         decoder_inputs: jax.Array, targets: jax.Array, rng: jax.Array | None,
                         language_ids: jax.Array | None = None,
                         cross_attention_mask: jax.Array | None = None
                         ) -> tuple[jax.Array, Metrics]:
    """Teacher-forced cross-entropy of a T5 model's predictions of `targets` from the encoder's
    `inputs` (non-pad where `input_mask`) and the decoder's `decoder_inputs`, on the non-pad
    (non-0) targets, in float32: the mean over the batch's target tokens (HF
    `T5ForConditionalGeneration`'s loss; metrics are exact sums). `rng=None` is evaluation.
    `language_ids` (a model with language embeddings): the language of every encoder and
    decoder position, inputs and decoder inputs being of one length and language (MASS).
    `cross_attention_mask`: the encoder positions the decoder attends to, if not all of
    `input_mask`'s (MASS: not the [MASK]ed ones)."""
    out = model(inputs, input_mask, decoder_inputs, rng=rng, language_ids=language_ids,
                decoder_language_ids=language_ids, cross_attention_mask=cross_attention_mask)
    weights = (targets != PAD_ID).astype(jnp.float32)
    loss, metrics = weighted_cross_entropy(out.logits, targets, weights, epsilon=1e-6)
    return loss, {"loss": metrics["loss"], "accuracy": metrics["accuracy"],
                  "target_tokens": (jnp.sum(weights), jnp.float32(targets.shape[0])),
                  "input_tokens": (jnp.sum(input_mask.astype(jnp.float32)),
                                   jnp.float32(inputs.shape[0]))}
