"""UniLM pre-training: one BERT encoder, four self-attention masks (Dong et al. 2019, §2).

Each example carries its objective (`input_pipeline.examples.unilm`: 1/3 bidirectional, 1/3
sequence-to-sequence, 1/6 left-to-right, 1/6 right-to-left, §2.3); `attention_masks` turns
(objective, token types, padding) into the [B, T, T] mask M of §2.1 on the device, inside the
loss, and BERT's encoder (`models.bert.Bert`, unchanged apart from taking a per-query mask)
reads it. The loss is the masked-LM cross-entropy over all masked tokens of the batch, every
objective alike (§2.3 "the sum of different types of LM objectives"), plus next-sentence
prediction on the bidirectional examples only (§2.2), as BERT's: mean NLL over those examples.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import unilm as unilm_examples
from pretext_jax.input_pipeline.examples.unilm import (
    BIDIRECTIONAL,
    LEFT_TO_RIGHT,
    OBJECTIVES,
    SEGMENT_TYPES,
    SEQ2SEQ,
    TYPE_VOCAB_SIZE,
)
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.models.bert import Bert
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.objectives.common.losses import weighted_cross_entropy
from pretext_jax.objectives.common.masked_lm import check_max_seq_length, prepare_masked_lm
from pretext_jax.objectives.common.preset_parts import (
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
    register,
    summary_of,
)


def attention_masks(objective: jax.Array, segment_ids: jax.Array, input_mask: jax.Array
                    ) -> jax.Array:
    """M[b, i, j] = query i of example b may attend to key j, [B, T, T] bool (§2.2, Fig. 1):
    bidirectional: every token; left-to-right: j <= i; right-to-left: j >= i;
    sequence-to-sequence: the source segment (token type 4) from every query, and target
    keys j <= i from target queries. Padding keys are never attended; padding queries (whose
    outputs nothing reads) attend to every token, so no row is empty."""
    positions = jnp.arange(segment_ids.shape[1])
    left = positions[None, :] <= positions[:, None]  # [T, T]: key j <= query i
    valid = input_mask.astype(bool)  # [B, T]
    source = (segment_ids == SEGMENT_TYPES[SEQ2SEQ][0]) & valid  # [B, T]
    seq2seq = source[:, None, :] | (left[None] & ~source[:, :, None])  # [B, T, T]
    chosen = objective[:, None, None]
    allowed = jnp.where(chosen == BIDIRECTIONAL, True,
                        jnp.where(chosen == SEQ2SEQ, seq2seq,
                                  jnp.where(chosen == LEFT_TO_RIGHT, left[None], left.T[None])))
    keys = valid[:, None, :]
    return jnp.where(valid[:, :, None], allowed & keys, keys)


def unilm_loss(model: Bert, batch: Batch, rng: jax.Array | None) -> tuple[jax.Array, Metrics]:
    """Masked LM under each example's attention mask + NSP on the bidirectional examples;
    also the MLM loss per objective. `rng=None` disables dropout."""
    objective = batch["objective"]
    mask = attention_masks(objective, batch["segment_ids"], batch["input_mask"])
    out = model(batch["input_ids"], batch["segment_ids"], mask,
                masked_positions=batch["masked_lm_positions"], rng=rng)
    weights = batch["masked_lm_weights"]
    mlm_loss, mlm = weighted_cross_entropy(out.mlm_logits, batch["masked_lm_ids"], weights)
    bidirectional = (objective == BIDIRECTIONAL).astype(jnp.float32)
    nsp_loss, nsp = weighted_cross_entropy(out.nsp_logits, batch["next_sentence_labels"],
                                           bidirectional)
    total = mlm_loss + nsp_loss
    metrics = {"loss": (total, jnp.ones((), jnp.float32)), "mlm_loss": mlm["loss"],
               "mlm_accuracy": mlm["accuracy"], "nsp_loss": nsp["loss"],
               "nsp_accuracy": nsp["accuracy"]}
    for index, name in enumerate(OBJECTIVES):
        _, own = weighted_cross_entropy(out.mlm_logits, batch["masked_lm_ids"],
                                        weights * (objective == index)[:, None])
        metrics[f"mlm_loss_{name}"] = own["loss"]
    return total, metrics


def build_unilm(config: EncoderConfig, seed: int) -> Bert:
    return Bert(config, rngs=nnx.Rngs(seed))


def prepare_unilm(data: DataConfig, examples: unilm_examples.UnilmExampleConfig,
                  cache_dir: Path, seed: int) -> PreparedData:
    """Corpus -> tokenizer -> examples of the four objectives with static n-gram masks."""
    return prepare_masked_lm(data, examples, cache_dir, seed,
                             unilm_examples.create_training_examples, dynamic_masking=False)


def check_unilm(model: EncoderConfig, examples: unilm_examples.UnilmExampleConfig,
                objective: Any = None) -> None:
    """Positions for every token, and a token type for each objective's segments."""
    check_max_seq_length(model, examples)
    if model.type_vocab_size < TYPE_VOCAB_SIZE:
        raise UserError(f"model.type_vocab_size={model.type_vocab_size} is too small for UniLM, "
                        f"whose token types name the objective; set "
                        f"model.type_vocab_size={TYPE_VOCAB_SIZE}")


# UniLM (Dong et al. 2019 §2.3): BERT-Large initialised from BERT-Large, 28,996 cased
# WordPieces, max length 512, 15% masking 80/10/10 with 20% bi/trigram spans, Adam
# (b2 0.999) lr 3e-5 with linear warmup over 40k steps then linear decay, dropout 0.1, weight
# decay 0.01, batch 330, ~770k steps. `unilm_base` keeps the recipe at BERT-Base size and
# trains from scratch (no BERT-Large initialisation); its optimizer is BERT's AdamW without
# bias correction (unilm-v1 trains with pytorch_pretrained_bert's BertAdam, clip norm 1.0).
PRESETS = {
    "unilm_tiny": {
        "model": {**TINY_TEXT_MODEL, "vocab_size": 0, "type_vocab_size": TYPE_VOCAB_SIZE,
                  **NO_DROPOUT},
        "examples": {"max_seq_length": 64, "max_predictions_per_seq": 10, "dupe_factor": 5},
        "data": {"vocab_size": 4000},
        "optim": TINY_TEXT_OPTIM,
        "train": TINY_TEXT_TRAIN,
    },
    "unilm_base": {
        "model": {"vocab_size": 28996, "type_vocab_size": TYPE_VOCAB_SIZE},
        "examples": {"max_seq_length": 512, "max_predictions_per_seq": 77},
        "data": {"vocab_size": 28996},
        "optim": {"learning_rate": 3e-5, "schedule": "linear_from_peak", "warmup_steps": 40000,
                  "weight_decay": 0.01},
        "train": {"steps": 770000, "batch_size": 330},
    },
}


register(Method(
    name="unilm",
    model_config=EncoderConfig,
    example_config=unilm_examples.UnilmExampleConfig,
    build_model=build_unilm,
    loss=unilm_loss,
    prepare=prepare_unilm,
    units_per_example=lambda examples: examples.max_seq_length,
    description="UniLM: masked LM under bidirectional, seq2seq, left-to-right and "
                "right-to-left attention masks in one encoder (Dong et al. 2019)",
    presets=PRESETS,
    resolution=Resolution(check=check_unilm),
    evaluation=Evaluation(summarize=summary_of(accuracy="mlm", metrics=("loss", "nsp_accuracy"))),
))
