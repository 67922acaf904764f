"""Masked-LM data preparation (BERT, ALBERT, ELECTRA, RoBERTa, ERNIE, StructBERT), the permuted-LM
baselines (XLNet, MPNet) and the sequence-length check of learned positions.

Reference: google-research/bert create_pretraining_data.py (the records).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import bert as bert_examples
from pretext_jax.input_pipeline.prepare import DataConfig, Markup, prepare_text
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.objectives.common.held_out import held_out_examples
from pretext_jax.objectives.registry import PreparedData, Segment, Segments


def prepare_masked_lm(
    data: DataConfig, examples: Any, cache_dir: Path, seed: int,
    create_examples: Callable[..., Iterable[dict[str, np.ndarray]]], dynamic_masking: bool,
    markup: Markup | None = None,
) -> PreparedData:
    """Shared by the masked-LM methods: builds records with `create_examples(documents, vocab,
    examples, seed)` and, with `dynamic_masking`, masks while loading. Held-out evaluation
    always uses fixed masks (drawn once with a fixed seed), so its numbers are comparable
    across runs; it is kept in memory, so a huge held-out split is capped. `markup`: inline
    annotations the builder reads (`prepare.Markup`, ERNIE's spans). With
    `examples.long_phase_fraction` (BERT's 128 -> 512 phases) the records are built again at
    the long phase's length (`examples.long_phase()`), and they feed the run's last steps
    (`phases`); held-out evaluation stays at the first phase's length."""

    build = functools.partial(bert_examples.build_with_vocab, create_examples, examples)
    train, held_out, tokenizer = prepare_text(
        data, build, examples, cache_dir, seed, markup=markup,
        check_tokenizer=bert_examples.MaskingVocab.from_tokenizer)
    vocab = bert_examples.MaskingVocab.from_tokenizer(tokenizer)
    transforms = (bert_examples.DynamicMasking(vocab, examples),) if dynamic_masking else ()
    eval_examples = held_out_examples(held_out, transforms[0] if transforms else None, seed)
    segments = None
    if getattr(examples, "long_phase_fraction", 0.0):
        long_build = functools.partial(bert_examples.build_with_vocab, create_examples,
                                       examples.long_phase())
        long_train, _, _ = prepare_text(data, long_build, examples.long_phase(), cache_dir, seed,
                                        markup=markup)
        segments = phases(train, long_train, examples.long_phase_fraction)
    return PreparedData(
        train=train,
        eval=eval_examples,
        transforms=transforms,
        model_fields={"vocab_size": tokenizer.vocab_size},
        report={"majority_baseline_mlm_accuracy":
                bert_examples.majority_baseline_accuracy(eval_examples)},
        tokenizer=tokenizer,
        segments=segments,
    )


def long_phase_start(steps: int, fraction: float) -> int:
    """The first step (1-based) of the long phase: the last round(fraction x steps) steps."""
    return steps - round(fraction * steps) + 1


def phases(short: Any, long: Any, fraction: float) -> Segments:
    """`PreparedData.segments` of two phases (google-research/bert README: 90 % of the steps at
    128 tokens, the last 10 % at 512): `short` records before the long phase's first step
    (`long_phase_start` of the run's `train.steps`), `long` ones from it on, each shuffled by
    the run's seed."""

    def segment(step: int, config: Any) -> Segment:
        first_long = long_phase_start(config.train.steps, fraction)
        if step < first_long:
            return Segment(first_step=1, last_step=first_long - 1, records=lambda model: short)
        return Segment(first_step=first_long, last_step=None, records=lambda model: long)

    return segment



def unigram_baselines(examples: dict[str, np.ndarray]) -> dict[str, float]:
    """Held-out PLM accuracy of always predicting the most frequent target, and the loss of
    predicting the held-out targets' own unigram distribution (no context at all)."""
    labels = examples["target_ids"][examples["target_weights"] > 0]
    probabilities = np.bincount(labels) / max(len(labels), 1)
    probabilities = probabilities[probabilities > 0]
    return {"majority_baseline_plm_accuracy": float(probabilities.max()),
            "unigram_baseline_plm_loss": float(-(probabilities * np.log(probabilities)).sum())}



def check_max_seq_length(model: EncoderConfig, examples: Any, objective: Any = None) -> None:
    """Every position of an example, in either phase, has a learned position embedding (no
    `objective` setting bears on it)."""
    if examples.max_seq_length > model.max_position_embeddings:
        raise UserError(
            f"examples.max_seq_length={examples.max_seq_length} exceeds "
            f"model.max_position_embeddings={model.max_position_embeddings}; lower the first or "
            "raise the second")
    if getattr(examples, "long_phase_fraction", 0.0) and (
            examples.long_max_seq_length > model.max_position_embeddings):
        raise UserError(
            f"examples.long_max_seq_length={examples.long_max_seq_length} exceeds "
            f"model.max_position_embeddings={model.max_position_embeddings}; lower the first or "
            "raise the second")
