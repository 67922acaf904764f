"""MPNet pre-training objective: masked and permuted language modelling (Song et al. 2020,
§2.2-2.3).

Reference: microsoft/MPNet masked_permutation_criterion.py and masked_permutation_net.py
(`compute_mpnet`): the loss is the cross-entropy of the query stream's logits against the b
predicted tokens, in factorisation order, averaged over all predictions of the batch. Every
record is a full block, so every row predicts exactly b tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import mpnet as mpnet_examples
from pretext_jax.input_pipeline.examples.bert import MaskingVocab, build_with_vocab
from pretext_jax.input_pipeline.prepare import DataConfig, prepare_text
from pretext_jax.models.mpnet import MPNet, MPNetConfig
from pretext_jax.objectives.common.classifier_recipes import (
    ClassifierSettings,
    claims_encoders,
    fairseq_glue_settings,
)
from pretext_jax.objectives.common.held_out import held_out_examples
from pretext_jax.objectives.common.losses import weighted_cross_entropy
from pretext_jax.objectives.common.masked_lm import unigram_baselines
from pretext_jax.objectives.common.preset_parts import (
    FAIRSEQ_ROBERTA_OPTIM,
    NO_DROPOUT,
    TINY_TEXT_MODEL,
    TINY_TEXT_OPTIM,
    TINY_TEXT_TRAIN,
)
from pretext_jax.objectives.registry import (
    Batch,
    Evaluation,
    Method,
    Metrics,
    PreparedData,
    Resolution,
    Start,
    register,
    summary_of,
)


def mpnet_loss(model: MPNet, batch: Batch, rng: jax.Array | None) -> tuple[jax.Array, Metrics]:
    """Two-stream forward on a batch of `MaskedPermutation` features; `rng=None` disables
    dropout. Metrics are named as XLNet's (`plm_*`): both are permuted-LM predictions."""
    targets = batch["target_ids"]
    out = model(batch["input_ids"], position_ids=batch["position_ids"],
                pred_size=targets.shape[1], rng=rng)
    loss, plm = weighted_cross_entropy(out.logits, targets, jnp.ones(targets.shape),
                                       epsilon=0.0)
    one = jnp.ones((), jnp.float32)
    return loss, {"loss": (loss, one), "plm_loss": plm["loss"], "plm_accuracy": plm["accuracy"]}


def build_mpnet(config: MPNetConfig, seed: int) -> MPNet:
    return MPNet(config, rngs=nnx.Rngs(seed))


def prepare_mpnet(data: DataConfig, examples: mpnet_examples.MPNetExampleConfig,
                  cache_dir: Path, seed: int) -> PreparedData:
    """Corpus -> tokenizer -> full blocks -> ArrayRecord; permutations, predicted parts and
    80/10/10 corruption drawn while loading (fixed once, with a fixed seed, for held-out)."""

    build = functools.partial(build_with_vocab, mpnet_examples.create_training_examples,
                              examples)
    train, held_out, tokenizer = prepare_text(data, build, examples, cache_dir, seed)
    sampling = mpnet_examples.MaskedPermutation(MaskingVocab.from_tokenizer(tokenizer),
                                                examples)
    eval_examples = held_out_examples(held_out, sampling, seed)
    weights = np.ones(eval_examples["target_ids"].shape)
    return PreparedData(
        train=train, eval=eval_examples, transforms=(sampling,),
        model_fields={"vocab_size": tokenizer.vocab_size},
        report=unigram_baselines({"target_ids": eval_examples["target_ids"],
                                  "target_weights": weights}),
        tokenizer=tokenizer)


def check_mpnet(model: MPNetConfig, examples: mpnet_examples.MPNetExampleConfig,
                objective: Any = None) -> None:
    """Every position (from 2) has a learned embedding (no `objective` setting bears on it)."""
    if examples.max_seq_length > model.max_length:
        raise UserError(
            f"examples.max_seq_length={examples.max_seq_length} needs "
            f"model.max_position_embeddings >= {examples.max_seq_length + 2} (positions start "
            f"at 2), not {model.max_position_embeddings}; lower the first or raise the second")


# MPNet (Song et al. 2020, §3.1; microsoft/MPNet README's fairseq-train command): BERT-Base size
# with 512 positions (+2), relative position bias, whole-word permutations, 15% predicted with
# 80/10/10 inputs; batch 8192, 500k steps, Adam (bias-corrected) b2 0.98, eps 1e-6, lr 6e-4 with
# warmup (24k as RoBERTa-Base's Table 9 schedule, which MPNet follows) then linear decay, weight
# decay 0.01, no clipping (--clip-norm 0.0); fairseq's Adam (eps before the bias correction,
# decay on every parameter) and polynomial_decay (from the peak at the end of warmup), as
# roberta_base.
PRESETS = {
    "mpnet_tiny": {
        "model": {**TINY_TEXT_MODEL, "max_position_embeddings": 130, "vocab_size": 0,
                  **NO_DROPOUT},
        "examples": {"max_seq_length": 64},
        "data": {"vocab_size": 4000},
        "optim": TINY_TEXT_OPTIM,
        "train": TINY_TEXT_TRAIN,
    },
    "mpnet_base": {
        "model": {"vocab_size": 0, "max_position_embeddings": 514},
        "examples": {"max_seq_length": 512, "pred_prob": 0.15, "whole_word_mask": True},
        "data": {"vocab_size": 30522},
        "optim": FAIRSEQ_ROBERTA_OPTIM,
        "train": {"steps": 500000, "batch_size": 8192},
    },
}


def glue_settings(hidden_size: int, task: str) -> ClassifierSettings:
    """MPNet's fine-tuning. GLUE: microsoft/MPNet MPNet/README.glue.md, fairseq's RoBERTa
    recipe (`fairseq_glue_settings`). SQuAD (MPNet/README.squad.md's fairseq-train command and
    its `squad2` task): lr 2e-5, batch 48 (6 on each of 8 GPUs), weight decay 0.01, 326 warmup
    updates of 5,430 (6 %), i.e. 2 passes over v2.0's 130k questions, windows of 512; fairseq's
    Adam, schedule and no clipping as for GLUE. Named entities: no MPNet recipe; the GLUE one's
    large-task column. The same for every size."""
    del hidden_size
    settings = fairseq_glue_settings(task)
    if task in ("squad", "squad2"):
        return dataclasses.replace(settings, learning_rate=2e-5, batch_size=48,
                                   weight_decay=0.01, epochs=2, max_seq_length=512)
    return settings


register(Method(
    name="mpnet",
    model_config=MPNetConfig,
    example_config=mpnet_examples.MPNetExampleConfig,
    build_model=build_mpnet,
    loss=mpnet_loss,
    prepare=prepare_mpnet,
    units_per_example=lambda examples: examples.max_seq_length,
    description="MPNet: masked and permuted LM with two-stream attention (Song et al. 2020)",
    presets=PRESETS,
    resolution=Resolution(check=check_mpnet),
    evaluation=Evaluation(summarize=summary_of(accuracy="plm")),
    start=Start(hf_models=(MPNet,), finetunes=claims_encoders("mpnet", glue_settings)),
))
