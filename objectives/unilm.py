"""UniLM pre-training: one BERT encoder, four self-attention masks (Dong et al. 2019, §2).

Each example carries its objective (`input_pipeline.examples.unilm`: 1/3 bidirectional, 1/3
sequence-to-sequence, 1/6 left-to-right, 1/6 right-to-left, §2.3); `attention_masks` turns
(objective, token types, padding) into the [B, T, T] mask M of §2.1 on the device, inside the
loss, and BERT's encoder (`models.bert.Bert`, unchanged apart from taking a per-query mask)
reads it. The loss is the masked-LM cross-entropy over all masked tokens of the batch, every
objective alike (§2.3 "the sum of different types of LM objectives"), plus next-sentence
prediction on the bidirectional examples only (§2.2), as BERT's: mean NLL over those examples.

The paper's model continues from BERT-Large (§2.3): `model.init` names a BERT (HF folder,
pretext workdir or model directory) whose weights start the run, its two token-type rows
widened to UniLM's six as unilm-v1's `from_pretrained` widens them (`widen_token_types`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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
from pretext_jax.objectives.common.starts import check_same_architecture
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


@dataclasses.dataclass(frozen=True)
class UnilmConfig(EncoderConfig):
    """BERT's encoder with UniLM's token types, and the BERT it may start from."""

    init: str = ""
    """Start from this BERT: an HF folder (the paper: bert-large-cased), a pretext workdir or
    model directory of the same architecture; '' = random initialisation."""


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


def build_unilm(config: UnilmConfig, seed: int) -> Bert:
    return Bert(config, rngs=nnx.Rngs(seed))


def widen_token_types(bert_rows: jax.Array, count: int) -> jax.Array:
    """A BERT's two token-type embedding rows [2, E] as UniLM's `count` rows, as unilm-v1's
    `BertPreTrainedModel.from_pretrained` widens them: rows 0 and 1 kept, the left-to-right
    (2), right-to-left (3) and seq2seq source (4) rows copies of row 0, the seq2seq target row
    (5) and any later one copies of row 1. A BERT with `count` rows or more keeps its first
    `count`."""
    if bert_rows.shape[0] >= count:
        return bert_rows[:count]
    sources = [0, 1, 0, 0, 0, 1] + [1] * max(count - 6, 0)
    return bert_rows[jnp.asarray(sources[:count])]


def pretrained_unilm(config: UnilmConfig, seed: int, load: Callable[[str], nnx.Module]
                     ) -> Bert | None:
    """The run's model with the weights of the BERT at `config.init` (§2.3: UniLM continues
    from BERT-Large), or None for a random start. Every parameter is the BERT's, the
    token-type rows widened (`widen_token_types`); an architecture that differs is a
    UserError naming the setting."""
    if not config.init:
        return None
    if not Path(config.init).is_dir():
        raise UserError(f"model.init={config.init} is not a directory; download the BERT to "
                        "start from (the paper: bert-large-cased, e.g. huggingface-cli download "
                        "bert-large-cased --local-dir FOLDER) and pass model.init=FOLDER")
    loaded = load(config.init)
    if type(loaded) is not Bert:
        raise UserError(f"{config.init} holds a {type(loaded).__name__}, not the BERT that "
                        "UniLM continues from")
    # The token types are UniLM's own: `widen_token_types` widens the BERT's.
    check_same_architecture(config, loaded.config, config.init, frozenset({"type_vocab_size"}))
    fresh = build_unilm(config, seed)
    weights = dict(nnx.to_flat_state(nnx.state(loaded, nnx.Param)))
    for key, variable in nnx.to_flat_state(nnx.state(fresh, nnx.Param)):
        value = weights[key][...]
        if "token_type_embeddings" in key:
            value = widen_token_types(value, config.type_vocab_size)
        variable.set_value(value)
    return fresh


def prepare_unilm(data: DataConfig, examples: unilm_examples.UnilmExampleConfig,
                  cache_dir: Path, seed: int) -> PreparedData:
    """Corpus -> tokenizer -> examples of the four objectives with static n-gram masks."""
    return prepare_masked_lm(data, examples, cache_dir, seed,
                             unilm_examples.create_training_examples, dynamic_masking=False)


def check_unilm(model: UnilmConfig, examples: unilm_examples.UnilmExampleConfig,
                objective: Any = None) -> None:
    """Positions for every token, and a token type for each objective's segments."""
    check_max_seq_length(model, examples)
    if model.type_vocab_size < TYPE_VOCAB_SIZE:
        raise UserError(f"model.type_vocab_size={model.type_vocab_size} is too small for UniLM, "
                        f"whose token types name the objective; set "
                        f"model.type_vocab_size={TYPE_VOCAB_SIZE}")


# UniLM (Dong et al. 2019 §2.3; unilm-v1's run_seq2seq-style pre-training with
# pytorch_pretrained_bert's BertAdam): BERT-Large initialised from BERT-Large, 28,996 cased
# WordPieces, max length 512, 15% masking 80/10/10 with 20% bi/trigram spans, Adam (b2 0.999,
# no bias correction, clip norm 1.0) lr 3e-5 with linear warmup over 40k steps then linear decay
# to 0 from the peak (BertAdam's warmup_linear), dropout 0.1, weight decay 0.01, batch 330,
# ~770k steps: `unilm_large`, whose `model.init` and `data.tokenizer` name the bert-large-cased
# folder to download (a relative path: pass model.init=FOLDER data.tokenizer=FOLDER/vocab.txt).
# `unilm_base_from_scratch` trains BERT-Base size from a random start at BERT's from-scratch
# rate (1e-4, 10k warmup; 3e-5 is a rate for continuing), the rest of the recipe kept: our
# choice, not the paper's. Departure (both): objectives and masks are drawn once per
# `dupe_factor` pass rather than on every load.
PRESETS = {
    "unilm_tiny": {
        "model": {**TINY_TEXT_MODEL, "vocab_size": 0, "type_vocab_size": TYPE_VOCAB_SIZE,
                  **NO_DROPOUT},
        "examples": {"max_seq_length": 64, "max_predictions_per_seq": 10, "dupe_factor": 5},
        "data": {"vocab_size": 4000},
        "optim": TINY_TEXT_OPTIM,
        "train": TINY_TEXT_TRAIN,
    },
    "unilm_large": {
        "model": {"hidden_size": 1024, "num_layers": 24, "num_heads": 16,
                  "intermediate_size": 4096, "vocab_size": 28996,
                  "type_vocab_size": TYPE_VOCAB_SIZE, "init": "bert-large-cased"},
        "examples": {"max_seq_length": 512, "max_predictions_per_seq": 77},
        "data": {"tokenizer": "bert-large-cased/vocab.txt", "vocab_size": 28996},
        "optim": {"learning_rate": 3e-5, "schedule": "linear_from_peak", "warmup_steps": 40000,
                  "weight_decay": 0.01},
        "train": {"steps": 770000, "batch_size": 330},
    },
    "unilm_base_from_scratch": {
        "model": {"vocab_size": 28996, "type_vocab_size": TYPE_VOCAB_SIZE},
        "examples": {"max_seq_length": 512, "max_predictions_per_seq": 77},
        "data": {"vocab_size": 28996},
        "optim": {"learning_rate": 1e-4, "schedule": "linear_from_peak", "warmup_steps": 10000,
                  "weight_decay": 0.01},
        "train": {"steps": 770000, "batch_size": 330},
    },
}


register(Method(
    name="unilm",
    model_config=UnilmConfig,
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
    start=Start(pretrained=pretrained_unilm),
))
