"""RoBERTa pre-training objective: masked LM only (Liu et al. 2019, §4.1-4.2).

No next-sentence task; FULL-SENTENCES inputs (`input_pipeline.examples.roberta`) masked anew
every time they are loaded (dynamic masking, BERT's 80/10/10). The loss is BERT's MLM loss
over the gathered masked positions, sum(w * nll) / (sum(w) + 1e-5) (fairseq's masked_lm
criterion: the mean over masked tokens).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import roberta as roberta_examples
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.models.roberta import Roberta, RobertaConfig
from pretext_jax.objectives.common.classifier_recipes import (
    ClassifierSettings,
    claims_encoders,
    fairseq_glue_settings,
)
from pretext_jax.objectives.common.losses import weighted_cross_entropy
from pretext_jax.objectives.common.masked_lm import prepare_masked_lm
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


def roberta_loss(model: Roberta, batch: Batch, rng: jax.Array | None
                 ) -> tuple[jax.Array, Metrics]:
    """The masked-LM loss on one batch of masked features; `rng=None` disables dropout."""
    out = model(batch["input_ids"], None, batch["input_mask"],
                masked_positions=batch["masked_lm_positions"], rng=rng)
    loss, mlm = weighted_cross_entropy(out.mlm_logits, batch["masked_lm_ids"],
                                       batch["masked_lm_weights"])
    return loss, {"loss": (loss, jnp.ones((), jnp.float32)), "mlm_loss": mlm["loss"],
                  "mlm_accuracy": mlm["accuracy"]}


def build_roberta(config: RobertaConfig, seed: int) -> Roberta:
    return Roberta(config, rngs=nnx.Rngs(seed))


def prepare_roberta(data: DataConfig, examples: roberta_examples.RobertaExampleConfig,
                    cache_dir: Path, seed: int) -> PreparedData:
    """Corpus -> tokenizer -> FULL-SENTENCES records, masked while loading. The tokenizer's
    padding id becomes the model's `position_padding_id` (where positions count from)."""
    prepared = prepare_masked_lm(data, examples, cache_dir, seed,
                                 roberta_examples.create_training_examples, dynamic_masking=True)
    pad_id = prepared.transforms[0].vocab.pad_id
    return dataclasses.replace(
        prepared, model_fields={**prepared.model_fields, "position_padding_id": pad_id})


def check_roberta(model: RobertaConfig, examples: roberta_examples.RobertaExampleConfig,
                  objective: Any = None) -> None:
    """Positions reach max_seq_length + padding id; the padding id may still come from the
    tokenizer (0 = ours), so at least 1 is assumed (HF's byte-level BPE pads with 1). No
    `objective` setting bears on it."""
    needed = examples.max_seq_length + max(model.position_padding_id, 1) + 1
    if needed > model.max_position_embeddings:
        raise UserError(
            f"examples.max_seq_length={examples.max_seq_length} needs "
            f"model.max_position_embeddings >= {needed} (RoBERTa's positions start after the "
            f"padding id), not {model.max_position_embeddings}; raise it or shorten the "
            "sequences")


# RoBERTa (Liu et al. 2019, Table 9 and §5; fairseq README.pretraining.md): BERT-Base size,
# 514 positions (512 + padding id + 1), one token type, FULL-SENTENCES inputs of 512 tokens,
# dynamic masking, no NSP; batch 8k, 500k steps, trained as fairseq-train does
# (`preset_parts.FAIRSEQ_ROBERTA_OPTIM`).
PRESETS = {
    "roberta_tiny": {
        "model": {**TINY_TEXT_MODEL, "vocab_size": 0, **NO_DROPOUT},
        "examples": {"max_seq_length": 64, "max_predictions_per_seq": 10},
        "data": {"vocab_size": 4000},
        "optim": {**TINY_TEXT_OPTIM, "b2": 0.98},
        "train": TINY_TEXT_TRAIN,
    },
    "roberta_base": {
        "model": {"vocab_size": 0, "max_position_embeddings": 514},
        "examples": {"max_seq_length": 512, "max_predictions_per_seq": 77},
        "data": {"vocab_size": 50265},
        "optim": FAIRSEQ_ROBERTA_OPTIM,
        "train": {"steps": 500000, "batch_size": 8192},
    },
}
# RoBERTa + LayerDrop (Fan et al. 2020 §5; fairseq examples/layerdrop/README.md, the released
# `roberta_layerdrop.base`): roberta_base trained with `--encoder-layerdrop 0.2`.
PRESETS["roberta_layerdrop"] = {
    **PRESETS["roberta_base"],
    "model": {**PRESETS["roberta_base"]["model"], "layerdrop": 0.2},
}


def glue_settings(hidden_size: int, task: str) -> ClassifierSettings:
    """RoBERTa's fine-tuning. GLUE: fairseq's examples/roberta/README.glue.md
    (`fairseq_glue_settings`: 10 epochs, per-task lr and batch, 6 % warmup, weight decay 0.1).
    SQuAD (Liu et al. 2019, Appendix Table 10): lr 1.5e-5, batch 48, weight decay 0.01, 2
    epochs, warmup 6 % then linear decay, with fairseq's Adam as for GLUE; v2.0 with the
    answerability classifier trained jointly (§5.2, `model.span_head=answerable`). Named
    entities: no RoBERTa recipe; the GLUE one's large-task column. The same for every size."""
    del hidden_size
    settings = fairseq_glue_settings(task)
    if task in ("squad", "squad2"):
        return dataclasses.replace(settings, learning_rate=1.5e-5, batch_size=48,
                                   weight_decay=0.01, epochs=2,
                                   span_head="answerable" if task == "squad2" else "")
    return settings


register(Method(
    name="roberta",
    model_config=RobertaConfig,
    example_config=roberta_examples.RobertaExampleConfig,
    build_model=build_roberta,
    loss=roberta_loss,
    prepare=prepare_roberta,
    units_per_example=lambda examples: examples.max_seq_length,
    description="RoBERTa: masked LM on FULL-SENTENCES inputs with dynamic masking, no NSP "
                "(Liu et al. 2019)",
    presets=PRESETS,
    resolution=Resolution(check=check_roberta),
    evaluation=Evaluation(summarize=summary_of(accuracy="mlm")),
    start=Start(hf_models=(Roberta,), finetunes=claims_encoders("roberta", glue_settings)),
))
