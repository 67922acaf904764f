"""DistilBERT: a 6-layer student distilled from a frozen BERT (Sanh et al. 2019, §2-3).

Reference: huggingface/transformers examples/research_projects/distillation (`distiller.py`
`Distiller.step`, `train.py`'s arguments and the README's command, `scripts/
extract_distilbert.py`). The loss is the README's triple

    5.0 x L_ce + 2.0 x L_mlm + 1.0 x L_cos

- L_ce: KL(teacher || student) of the softmaxes at temperature T = 2 over the vocabulary, at
  every non-padding position (`restrict_ce_to_mask` off), summed over the vocabulary and
  averaged over those positions (torch `KLDivLoss(reduction="batchmean")` on the selected
  rows), times T^2;
- L_mlm: the student's cross-entropy at the masked positions (their mean);
- L_cos: the mean over non-padding positions of 1 - cos(student, teacher last hidden state)
  (torch `CosineEmbeddingLoss` with target 1: cos = x.y / sqrt((|x|^2 + 1e-12)(|y|^2 + 1e-12))).

No next-sentence task; inputs are masked anew on every load (dynamic masking, 80/10/10). The
teacher is the `model.teacher` BERT (pretext workdir or HF folder) with its weights `Frozen`
(never a parameter) inside the same jitted step; the student starts from every other teacher
layer (`models.distilbert.student_from_teacher`). A teacher without an MLM head (a bare
`BertModel`, e.g. a sentence-transformers model) gives no soft targets: it needs
`objective.alpha_ce=0`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import roberta as roberta_examples
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.models.distilbert import (
    Distillation,
    DistillationConfig,
    DistillationOutput,
    student_from_teacher,
)
from pretext_jax.objectives.common.losses import weighted_cross_entropy
from pretext_jax.objectives.common.masked_lm import prepare_masked_lm
from pretext_jax.objectives.common.preset_parts import (
    NO_DROPOUT,
    TINY_TEXT_MODEL,
    TINY_TEXT_OPTIM,
    TINY_TEXT_TRAIN,
)
from pretext_jax.objectives.common.teachers import (
    built_under_jit,
    check_is_bert,
    freeze_into,
    load_teacher,
    mismatched_fields,
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

# torch's cosine_embedding_loss adds this to each squared norm (ATen Loss.cpp `EPSILON`).
COSINE_EPSILON = 1e-12
# HF BERT classes with the masked-LM head (`cls.predictions`); a bare `BertModel` has none.
HF_CLASSES_WITH_MLM_HEAD = ("BertForMaskedLM", "BertForPreTraining", "BertLMHeadModel")


@dataclasses.dataclass(frozen=True)
class DistillationSettings:
    """The loss weights and temperature of distiller.py (train.py `--alpha_*`,
    `--temperature`; the README's command sets 5.0, 2.0, 1.0)."""

    alpha_ce: float = 5.0
    """Weight of the soft-target KL at `temperature` (README 5.0); 0 for a teacher without an
    MLM head."""
    alpha_mlm: float = 2.0
    """Weight of the masked-LM cross-entropy (README 2.0)."""
    alpha_cos: float = 1.0
    """Weight of the cosine loss between last hidden states (README 1.0)."""
    temperature: float = 2.0
    """Softmax temperature T of the soft targets; L_ce is multiplied by T^2 (train.py 2.0)."""

    def __post_init__(self) -> None:
        weights = (self.alpha_ce, self.alpha_mlm, self.alpha_cos)
        if min(weights) < 0 or sum(weights) <= 0:
            raise UserError(f"objective.alpha_ce, alpha_mlm, alpha_cos = {weights} must be >= 0 "
                            "with a positive sum (distiller.py: 5.0, 2.0, 1.0)")
        if not self.temperature > 0:
            raise UserError(f"objective.temperature={self.temperature} must be > 0 (2.0)")


def soft_target_loss(student_logits: jax.Array, teacher_logits: jax.Array, mask: jax.Array,
                     temperature: float) -> jax.Array:
    """KL(softmax(t / T) || softmax(s / T)) summed over the vocabulary, averaged over the
    positions where `mask` [B, T] is 1, times T^2 (distiller.py `loss_ce`)."""
    log_p_student = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, -1)
    log_p_teacher = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, -1)
    kl = jnp.sum(jnp.exp(log_p_teacher) * (log_p_teacher - log_p_student), axis=-1)  # [B, T]
    mask = mask.astype(jnp.float32)
    return jnp.sum(kl * mask) / jnp.sum(mask) * temperature ** 2


def cosine_loss(student_hidden: jax.Array, teacher_hidden: jax.Array, mask: jax.Array
                ) -> jax.Array:
    """Mean over the positions where `mask` [B, T] is 1 of 1 - cos(student, teacher) of the
    hidden states [B, T, H] (torch `CosineEmbeddingLoss`, target 1)."""
    s, t = student_hidden.astype(jnp.float32), teacher_hidden.astype(jnp.float32)
    cos = jnp.sum(s * t, -1) / jnp.sqrt((jnp.sum(s * s, -1) + COSINE_EPSILON)
                                        * (jnp.sum(t * t, -1) + COSINE_EPSILON))  # [B, T]
    mask = mask.astype(jnp.float32)
    return jnp.sum((1.0 - cos) * mask) / jnp.sum(mask)


def distillation_loss(model: Distillation, batch: Batch, rng: jax.Array | None, *,
                      objective: DistillationSettings) -> tuple[jax.Array, Metrics]:
    """alpha_ce L_ce + alpha_mlm L_mlm + alpha_cos L_cos on one batch of masked records
    (`rng=None`: no dropout)."""
    mask = batch["input_mask"]
    out: DistillationOutput = model(batch["input_ids"], mask,
                                    batch["masked_lm_positions"],
                                    soft_targets=objective.alpha_ce > 0, rng=rng)
    mlm, mlm_metrics = weighted_cross_entropy(out.mlm_logits, batch["masked_lm_ids"],
                                              batch["masked_lm_weights"], epsilon=0.0)
    cos = cosine_loss(out.student_hidden, out.teacher_hidden, mask)
    loss = objective.alpha_mlm * mlm + objective.alpha_cos * cos
    one = jnp.ones((), jnp.float32)
    metrics = {"mlm_loss": mlm_metrics["loss"], "mlm_accuracy": mlm_metrics["accuracy"],
               "cos_loss": (cos, one)}
    if out.teacher_logits is not None:
        ce = soft_target_loss(out.student_logits, out.teacher_logits, mask,
                              objective.temperature)
        loss = loss + objective.alpha_ce * ce
        metrics["ce_loss"] = (ce, one)
    return loss, {"loss": (loss, one), **metrics}


def build_distillation(config: DistillationConfig, seed: int) -> Distillation:
    return Distillation(config, rngs=nnx.Rngs(seed))


def prepare_distillation(data: DataConfig, examples: roberta_examples.RobertaExampleConfig,
                         cache_dir: Path, seed: int) -> PreparedData:
    """Corpus -> the teacher's tokenizer (`data.tokenizer`) -> sentences packed up to
    `max_seq_length`, masked while loading."""
    return prepare_masked_lm(data, examples, cache_dir, seed,
                             roberta_examples.create_training_examples, dynamic_masking=True)


def check_distillation(model: DistillationConfig, examples: Any,
                       objective: DistillationSettings) -> None:
    """Soft targets need the teacher's MLM head; every position needs a student and a teacher
    position embedding."""
    if not model.teacher_mlm_head and objective.alpha_ce > 0:
        raise UserError(f"model.teacher_mlm_head=false: the teacher has no MLM head, so no soft "
                        f"targets for objective.alpha_ce={objective.alpha_ce}; set "
                        "objective.alpha_ce=0 (cosine and MLM losses only)")
    positions = min(model.max_position_embeddings, model.teacher_max_position_embeddings)
    if examples.max_seq_length > positions:
        raise UserError(f"examples.max_seq_length={examples.max_seq_length} exceeds the "
                        f"student's or teacher's {positions} position embeddings; lower it")


def teacher_has_mlm_head(path: Path) -> bool:
    """Whether the teacher at `path` has trained MLM-head weights: a pretext directory unless
    its model.json records the head among the parameters its HF source lacked; a HF folder if
    its config.json names a class with the head."""
    info = path / "model.json"
    if info.is_file():
        untrained = json.loads(info.read_text()).get("source", {}).get("untrained", ())
        return not any(name.startswith("lm_head.") for name in untrained)
    config = json.loads((path / "config.json").read_text())
    return bool(set(config.get("architectures") or ()) & set(HF_CLASSES_WITH_MLM_HEAD))


TEACHER_FIELDS = {"num_layers": "teacher_num_layers", "num_heads": "teacher_num_heads",
                  "intermediate_size": "teacher_intermediate_size",
                  "max_position_embeddings": "teacher_max_position_embeddings",
                  "type_vocab_size": "teacher_type_vocab_size",
                  "hidden_act": "teacher_hidden_act", "layer_norm_eps": "teacher_layer_norm_eps"}


def check_teacher(config: DistillationConfig, teacher: Any, has_head: bool) -> None:
    """The loaded `teacher` is a BERT of the student's width and vocabulary whose shape the
    `teacher_*` fields state; each mismatch is one line naming the fix."""
    where = config.teacher
    check_is_bert(teacher, where, "DistilBERT")
    theirs = teacher.config
    if theirs.hidden_size != config.hidden_size:
        raise UserError(f"the teacher's hidden size {theirs.hidden_size} differs from the "
                        f"student's model.hidden_size={config.hidden_size}; the cosine loss "
                        f"compares their hidden states: set model.hidden_size={theirs.hidden_size}")
    if theirs.vocab_size != config.vocab_size:
        raise UserError(f"the teacher's vocabulary has {theirs.vocab_size} tokens, the "
                        f"student's {config.vocab_size}; tokenize with the teacher's own "
                        f"vocabulary (data.tokenizer={where} or its vocab.txt)")
    if theirs.max_position_embeddings != config.max_position_embeddings:
        raise UserError(f"the student starts from the teacher's {theirs.max_position_embeddings} "
                        "position embeddings (train.py asserts the two agree); set "
                        f"model.max_position_embeddings={theirs.max_position_embeddings}")
    fixes = mismatched_fields(theirs, config, TEACHER_FIELDS)
    if has_head != config.teacher_mlm_head:
        fixes.append(f"model.teacher_mlm_head={str(has_head).lower()}")
    if fixes:
        raise UserError(f"the teacher {where} is not the one the model settings describe; set "
                        f"{' '.join(fixes)}")


def pretrained_distillation(config: DistillationConfig, seed: int,
                            load: Callable[[str], Any]) -> Distillation:
    """The run's start: the frozen teacher `config.teacher`, checked against the settings,
    and the student initialised from its layers (extract_distilbert.py)."""
    teacher = load_teacher(config.teacher, load, "DistilBERT",
                           "a pretext bert workdir or a HuggingFace BertForMaskedLM folder")
    check_teacher(config, teacher, teacher_has_mlm_head(Path(config.teacher)))
    model = built_under_jit(lambda: build_distillation(config, seed))
    student_from_teacher(model.student, teacher, config.student_init_layers,
                         config.init_vocab_transform)
    freeze_into(model.teacher, teacher)
    return model


# DistilBERT (Sanh et al. 2019 §3; the research project's README command and train.py
# defaults): bert-base's width, 6 layers initialised from teacher layers 0, 2, 4, 7, 9, 11
# (extract_distilbert.py), batches of 4,000 sequences by gradient accumulation (§3 "up to 4K";
# train.py: 5 per GPU x 50 accumulation steps x the GPUs), AdamW (torch's: bias-corrected, eps
# after the correction) lr 5e-4, betas (0.9, 0.98), eps 1e-6, no weight decay, clipping at 5.0,
# linear warmup over 5 % of the steps then linear decay to 0, 3 epochs: ~4,800 steps of
# 4,000 x 512 tokens over BERT's 3.3B-word corpus (recipe card).
PRESETS = {
    "distilbert_tiny": {
        "model": {**TINY_TEXT_MODEL, "num_layers": 1, "vocab_size": 0, **NO_DROPOUT,
                  "teacher_num_layers": 2, "teacher_num_heads": 4,
                  "teacher_intermediate_size": 256, "teacher_max_position_embeddings": 128},
        "examples": {"max_seq_length": 64, "max_predictions_per_seq": 10},
        "data": {"vocab_size": 4000},
        "optim": TINY_TEXT_OPTIM,
        "train": TINY_TEXT_TRAIN,
    },
    "distilbert_base": {
        "model": {"vocab_size": 0, "init_layers": [0, 2, 4, 7, 9, 11]},
        "examples": {"max_seq_length": 512, "max_predictions_per_seq": 77},
        "data": {"vocab_size": 30522},
        "optim": {"learning_rate": 5e-4, "schedule": "linear_from_peak",
                  "warmup_steps": 240, "b2": 0.98, "eps": 1e-6, "weight_decay": 0.0,
                  "bias_correction": True, "clip_norm": 5.0, "grad_accum_steps": 50},
        "train": {"steps": 4800, "batch_size": 4000},
    },
}


register(Method(
    name="distilbert",
    model_config=DistillationConfig,
    example_config=roberta_examples.RobertaExampleConfig,
    objective_config=DistillationSettings,
    build_model=build_distillation,
    loss=distillation_loss,
    prepare=prepare_distillation,
    units_per_example=lambda examples: examples.max_seq_length,
    description="DistilBERT: a 6-layer student distilled from a frozen BERT teacher with soft "
                "targets, masked LM and a cosine loss on hidden states (Sanh et al. 2019)",
    presets=PRESETS,
    resolution=Resolution(check=check_distillation),
    evaluation=Evaluation(summarize=summary_of(accuracy="mlm",
                                               metrics=("loss", "ce_loss", "cos_loss"))),
    start=Start(pretrained=pretrained_distillation),
))
