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
from pretext_jax.objectives.registry import PreparedData


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

    build = functools.partial(bert_examples.build_with_vocab, create_examples, examples)
    train, held_out, tokenizer = prepare_text(
        data, build, examples, cache_dir, seed, markup=markup,
        check_tokenizer=bert_examples.MaskingVocab.from_tokenizer)
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
