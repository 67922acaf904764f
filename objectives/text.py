"""Pieces shared by the text methods: the weighted cross-entropy every token loss uses, the
masked-LM data preparation (BERT, ALBERT, ELECTRA, RoBERTa), the encoder-decoder loss (T5,
BART, MASS), fixed draws of per-record
transforms for held-out records (dynamic masking, XLNet's and MPNet's permutations, T5's
noise), the permuted-LM baselines (XLNet, MPNet) and the sequence-length check.

Reference: google-research/bert run_pretraining.py (`get_masked_lm_output`: the weighted
loss) and create_pretraining_data.py (the records).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import bert_examples
from pretext_jax.input_pipeline.prepare import DataConfig, Markup, prepare_text
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.models.t5 import PAD_ID, T5
from pretext_jax.objectives.registry import Metrics, PreparedData

MAX_EVAL_EXAMPLES = 16384


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


def mlm_and_pair_loss(model: Any, batch: dict[str, jax.Array], rng: jax.Array | None,
                      pair: str = "nsp") -> tuple[jax.Array, Metrics]:
    """BERT's pre-training loss (run_pretraining.py `get_masked_lm_output`,
    `get_next_sentence_output`) for a model returning `BertOutput`: the weighted MLM loss at the
    gathered positions + the plain batch mean (`tf.reduce_mean`, no epsilon) of the pair
    classifier's loss on `next_sentence_labels`; its metrics are named `{pair}_loss`,
    `{pair}_accuracy` (BERT and ERNIE: nsp)."""
    out = model(batch["input_ids"], batch["segment_ids"], batch["input_mask"],
                masked_positions=batch["masked_lm_positions"], rng=rng)
    mlm_loss, mlm = weighted_cross_entropy(out.mlm_logits, batch["masked_lm_ids"],
                                           batch["masked_lm_weights"])
    labels = batch["next_sentence_labels"]
    pair_loss, pair_metrics = weighted_cross_entropy(out.nsp_logits, labels,
                                                     jnp.ones(labels.shape), epsilon=0.0)
    total = mlm_loss + pair_loss
    return total, {"loss": (total, jnp.ones((), jnp.float32)), "mlm_loss": mlm["loss"],
                   "mlm_accuracy": mlm["accuracy"], f"{pair}_loss": pair_metrics["loss"],
                   f"{pair}_accuracy": pair_metrics["accuracy"]}


def encoder_decoder_loss(model: T5, inputs: jax.Array, input_mask: jax.Array,
                         decoder_inputs: jax.Array, targets: jax.Array, rng: jax.Array | None,
                         language_ids: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
    """Teacher-forced cross-entropy of a T5 model's predictions of `targets` from the encoder's
    `inputs` (non-pad where `input_mask`) and the decoder's `decoder_inputs`, on the non-pad
    (non-0) targets, in float32: the mean over the batch's target tokens (HF
    `T5ForConditionalGeneration`'s loss; metrics are exact sums). `rng=None` is evaluation.
    `language_ids` (a model with language embeddings): the language of every encoder and
    decoder position, inputs and decoder inputs being of one length and language (MASS)."""
    out = model(inputs, input_mask, decoder_inputs, rng=rng, language_ids=language_ids,
                decoder_language_ids=language_ids)
    weights = (targets != PAD_ID).astype(jnp.float32)
    loss, metrics = weighted_cross_entropy(out.logits, targets, weights, epsilon=1e-6)
    return loss, {"loss": metrics["loss"], "accuracy": metrics["accuracy"],
                  "target_tokens": (jnp.sum(weights), jnp.float32(targets.shape[0])),
                  "input_tokens": (jnp.sum(input_mask.astype(jnp.float32)),
                                   jnp.float32(inputs.shape[0]))}


def held_out_examples(held_out: Any, transform: grain.transforms.RandomMap | None = None,
                      seed: int = 0, limit: int = MAX_EVAL_EXAMPLES) -> dict[str, np.ndarray]:
    """The held-out records kept in memory for evaluation (at most `limit`), with
    `transform` (masking, noising) drawn once with the fixed seed `seed + 2`, so held-out
    numbers compare across runs."""
    examples = held_out.examples(range(min(len(held_out), limit)))
    return examples if transform is None else mask_records(examples, transform, seed + 2)


def stacked_records(records: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Record sets with the same features, one after the other (several languages' held-out
    records); none at all is a UserError."""
    if not records:
        raise UserError("nothing was held out for evaluation; raise data.held_out_fraction, "
                        "give more text (documents separated by blank lines) or set "
                        "data.eval_source")
    return {key: np.concatenate([r[key] for r in records]) for key in records[0]}


def prepare_masked_lm(
    data: DataConfig, examples: Any, cache_dir: Path, seed: int,
    create_examples: Callable[..., Iterable[dict[str, np.ndarray]]], dynamic_masking: bool,
    markup: Markup | None = None,
) -> PreparedData:
    """Shared by the masked-LM methods: builds records with `create_examples(documents, vocab,
    examples, seed)` and, with `dynamic_masking`, masks while loading. Held-out evaluation
    always uses fixed masks (drawn once with a fixed seed), so its numbers are comparable
    across runs; it is kept in memory, so a huge held-out split is capped. `markup`: inline
    annotations the builder reads (`prepare.Markup`, ERNIE's spans)."""

    build = functools.partial(build_with_vocab, create_examples, examples)
    train, held_out, tokenizer = prepare_text(data, build, examples, cache_dir, seed,
                                              markup=markup)
    vocab = bert_examples.MaskingVocab.from_tokenizer(tokenizer)
    transforms = (bert_examples.DynamicMasking(vocab, examples),) if dynamic_masking else ()
    eval_examples = held_out_examples(held_out, transforms[0] if transforms else None, seed)
    return PreparedData(
        train=train,
        eval=eval_examples,
        transforms=transforms,
        model_fields={"vocab_size": tokenizer.vocab_size},
        report={"majority_baseline_mlm_accuracy":
                bert_examples.majority_baseline_accuracy(eval_examples)},
        tokenizer=tokenizer,
    )


def build_with_vocab(create_examples: Callable[..., Iterable[dict[str, np.ndarray]]],
                     examples: Any, documents: Any, tokenizer: Any, seed: int
                     ) -> Iterable[dict[str, np.ndarray]]:
    """A `prepare_text` builder (picklable as a `functools.partial` of this):
    `create_examples(documents, masking vocab, examples, seed)`."""
    return create_examples(documents, bert_examples.MaskingVocab.from_tokenizer(tokenizer),
                           examples, seed)


def mask_records(
    records: dict[str, np.ndarray], masking: grain.transforms.RandomMap, seed: int
) -> dict[str, np.ndarray]:
    """Applies a per-record random transform (dynamic masking, XLNet's permutations) once, with
    a fixed seed, to a stacked set of records."""
    rng = np.random.default_rng(seed)
    count = len(next(iter(records.values())))
    rows = [masking.random_map({k: v[i] for k, v in records.items()}, rng) for i in range(count)]
    return {k: np.stack([row[k] for row in rows]) for k in rows[0]}


def unigram_baselines(examples: dict[str, np.ndarray]) -> dict[str, float]:
    """Held-out PLM accuracy of always predicting the most frequent target, and the loss of
    predicting the held-out targets' own unigram distribution (no context at all)."""
    labels = examples["target_ids"][examples["target_weights"] > 0]
    probabilities = np.bincount(labels) / max(len(labels), 1)
    probabilities = probabilities[probabilities > 0]
    return {"majority_baseline_plm_accuracy": float(probabilities.max()),
            "unigram_baseline_plm_loss": float(-(probabilities * np.log(probabilities)).sum())}


def check_max_seq_length(model: EncoderConfig, examples: Any, objective: Any = None) -> None:
    """Every position of an example has a learned position embedding (no `objective` setting
    bears on it)."""
    if examples.max_seq_length > model.max_position_embeddings:
        raise UserError(
            f"examples.max_seq_length={examples.max_seq_length} exceeds "
            f"model.max_position_embeddings={model.max_position_embeddings}; lower the first or "
            "raise the second")
