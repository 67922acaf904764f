"""TinyBERT (Jiao et al. 2020 §3.1-3.2): a small BERT learns a frozen BERT's embeddings, hidden
states and attention scores layer by layer (`tinybert`: general distillation), then on a GLUE
task from a fine-tuned teacher, those layers first and its predictions after
(`tinybert_task`: task distillation).

Reference: huawei-noah/Pretrained-Language-Model TinyBERT/general_distill.py (the loss in the
training loop, argparse defaults, the README's command), transformer/modeling.py (the student
`TinyBertForPreTraining`, `BertSelfAttention`'s scores) and pregenerate_training_data.py (the
data). Student layer m (1..M) learns from teacher layer g(m) = m x N / M, the embeddings from
the teacher's (g(0) = 0):

    L = sum_m=1..M MSE(A_S^m, A_T^g(m)) + sum_m=0..M MSE(H_S^m W, H_T^g(m))

- A: the attention scores q.k / sqrt(D) of every head, before the softmax, with the authors'
  treatment of masking: modeling.py adds -10000 at padded keys, and general_distill.py then
  sets every score <= -100 to 0 in both networks' scores, so padded keys (and any genuine score
  at or below -100) compare as 0 = 0. Here: a score counts where its key is a token and it is
  above -100, else it is 0 (the same numbers; the two differ only for a score above 9,900).
  Padded queries are compared like any other.
- H^0: the embedding layer's output, H^m: layer m's; W: the student's `fit_dense` (d' -> d,
  with a bias), one for all of them in the authors' code (`model.shared_projection`).
- MSE: torch `MSELoss()`, the mean over every element (batch, heads, queries, keys; or batch,
  positions, width; padding included), summed over the mapped layers as the script sums them.

The data is BERT's sentence pairs ([CLS] A [SEP] B [SEP], token types 0/1, short sequences at
`short_seq_prob`) left unmasked: the authors' second general TinyBERT was trained on a corpus
without [MASK] (their README), and their script reads no label. The teacher is the
`model.teacher` BERT (pretext workdir or HF folder), its encoder's weights `Frozen`; the student
starts from scratch (general_distill.py `TinyBertForPreTraining.from_scratch`).

Task distillation (task_distill.py) runs twice on the task's training set:
`objective.stage=intermediate` with the same layer losses against a BERT classifier fine-tuned
on the task (a pretext `classify` workdir), the student started from the general TinyBERT
(`model.init`); then `objective.stage=prediction` from that run (`model.init`) with the soft
cross-entropy of the logits at temperature t = 1, task_distill.py's `soft_cross_entropy`:
the mean over the batch AND the classes of -softmax(z_T / t) log_softmax(z_S / t) (so 1 / C
of the usual per-example cross-entropy); STS-B (one output) takes the mean squared error to the
gold score instead, as the script does.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import glue
from pretext_jax.input_pipeline.examples import bert as bert_examples
from pretext_jax.input_pipeline.prepare import DataConfig, prepare_text
from pretext_jax.models.bert import Bert
from pretext_jax.models.classifier import SequenceClassifier, from_pretrained
from pretext_jax.models.tinybert import (
    TeacherFields,
    TinyBert,
    TinyBertConfig,
    TinyBertOutput,
    TinyBertTask,
    TinyBertTaskConfig,
)
from pretext_jax.objectives.common.glue_data import (
    GlueExampleConfig,
    glue_monitor,
    prepare_glue,
)
from pretext_jax.objectives.common.held_out import held_out_examples
from pretext_jax.objectives.common.preset_parts import (
    NO_DROPOUT,
    TINY_TEXT_OPTIM,
    TINY_TEXT_TRAIN,
)
from pretext_jax.objectives.common.starts import check_same_architecture
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

# general_distill.py: `torch.where(att <= -1e2, 0, att)` on both networks' scores.
SCORE_FLOOR = -100.0


@dataclasses.dataclass(frozen=True)
class PairExampleConfig:
    """pregenerate_training_data.py's flags that shape the records (same defaults): BERT's
    sentence pairs (`input_pipeline.examples.bert`), unmasked."""

    max_seq_length: int = 128
    """Tokens per pair incl. [CLS] and [SEP], at least 5 (general_distill.py 128)."""
    short_seq_prob: float = 0.1
    """Probability that a pair aims at a random shorter length (0.1)."""

    def __post_init__(self) -> None:
        self.pairs()  # BERT's checks

    def pairs(self) -> bert_examples.BertExampleConfig:
        """The BERT example settings that build these records: one pass over the documents,
        stored unmasked (`dynamic_masking` with no masking transform)."""
        return bert_examples.BertExampleConfig(
            max_seq_length=self.max_seq_length, short_seq_prob=self.short_seq_prob,
            dynamic_masking=True)


def layer_map(student_layers: int, teacher_layers: int) -> tuple[int, ...]:
    """g(m) = m x N / M for m = 0..M (§3.1 "uniform strategy"; general_distill.py's
    `layers_per_block`): the teacher hidden state each student state learns from, 0 the
    embeddings; student layer m's attention learns from teacher layer g(m)'s."""
    step = teacher_layers // student_layers
    return tuple(m * step for m in range(student_layers + 1))


def attention_score_loss(student: jax.Array, teacher: jax.Array, mask: jax.Array
                         ) -> jax.Array:
    """Sum over layers of the mean squared difference of the scores [M, B, N, T, T] (teacher
    already mapped), each score set to 0 where its key is padding (`mask` [B, T] 0) or it is at
    most -100 (general_distill.py)."""
    keys = mask.astype(bool)[None, :, None, None, :]  # [1, B, 1, 1, T]

    def kept(scores: jax.Array) -> jax.Array:
        scores = scores.astype(jnp.float32)
        return jnp.where(keys & (scores > SCORE_FLOOR), scores, 0.0)

    return jnp.sum(jnp.mean(jnp.square(kept(student) - kept(teacher)), axis=(1, 2, 3, 4)))


def hidden_state_loss(student: jax.Array, teacher: jax.Array) -> jax.Array:
    """Sum over states of the mean squared difference of the projected student states and the
    mapped teacher states [M + 1, B, T, d] (padding included, as torch `MSELoss()`)."""
    diff = student.astype(jnp.float32) - teacher.astype(jnp.float32)
    return jnp.sum(jnp.mean(jnp.square(diff), axis=(1, 2, 3)))


def layer_losses(out: TinyBertOutput, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(attention loss, hidden-state loss) of one forward pass with the uniform layer map."""
    mapped = jnp.asarray(layer_map(out.student_scores.shape[0], out.teacher_scores.shape[0]))
    attention = attention_score_loss(out.student_scores, out.teacher_scores[mapped[1:] - 1],
                                     mask)
    return attention, hidden_state_loss(out.student_states, out.teacher_states[mapped])


def general_distillation_loss(model: TinyBert, batch: Batch, rng: jax.Array | None
                              ) -> tuple[jax.Array, Metrics]:
    """att_loss + rep_loss (general_distill.py) on one batch of pairs (`rng=None`: no
    dropout)."""
    mask = batch["input_mask"]
    out = model(batch["input_ids"], batch["segment_ids"], mask, rng)
    attention, hidden = layer_losses(out, mask)
    loss = attention + hidden
    one = jnp.ones((), jnp.float32)
    return loss, {"loss": (loss, one), "att_loss": (attention, one), "rep_loss": (hidden, one)}


def build_tinybert(config: TinyBertConfig, seed: int) -> TinyBert:
    return TinyBert(config, rngs=nnx.Rngs(seed))


def prepare_pairs(data: DataConfig, examples: PairExampleConfig, cache_dir: Path, seed: int
                  ) -> PreparedData:
    """Corpus -> the teacher's tokenizer (`data.tokenizer`) -> BERT's sentence pairs,
    unmasked (pregenerate_training_data.py; the held-out ones too)."""
    pairs = examples.pairs()
    build = functools.partial(bert_examples.build_with_vocab,
                              bert_examples.bert_training_examples, pairs)
    train, held_out, tokenizer = prepare_text(
        data, build, pairs, cache_dir, seed,
        check_tokenizer=bert_examples.MaskingVocab.from_tokenizer)
    return PreparedData(train=train, eval=held_out_examples(held_out), tokenizer=tokenizer,
                        model_fields={"vocab_size": tokenizer.vocab_size})


def check_lengths(model: TinyBertConfig, examples: PairExampleConfig, objective: Any = None
                  ) -> None:
    """Every position needs a student and a teacher position embedding (no `objective`
    setting bears on it); no LayerDrop, as the layer losses read every student layer
    (`EncoderStack.trace` runs them all)."""
    if model.layerdrop:
        raise UserError(f"model.layerdrop={model.layerdrop}: TinyBERT's layer losses read every "
                        "student layer, so none is dropped; set model.layerdrop=0")
    positions = min(model.max_position_embeddings, model.teacher_max_position_embeddings)
    if examples.max_seq_length > positions:
        raise UserError(f"examples.max_seq_length={examples.max_seq_length} exceeds the "
                        f"student's or teacher's {positions} position embeddings; lower it")


TEACHER_FIELDS = {"hidden_size": "teacher_hidden_size", "num_layers": "teacher_num_layers",
                  "intermediate_size": "teacher_intermediate_size",
                  "max_position_embeddings": "teacher_max_position_embeddings",
                  "type_vocab_size": "type_vocab_size", "hidden_act": "teacher_hidden_act",
                  "layer_norm_eps": "teacher_layer_norm_eps"}


def check_teacher_shape(config: TeacherFields, theirs: Any) -> None:
    """The teacher's config `theirs` has the student's vocabulary and number of heads and the
    shape the `teacher_*` fields state; each mismatch is one line naming the fix."""
    where = config.teacher
    if theirs.num_heads != config.num_heads:
        raise UserError(f"the teacher has {theirs.num_heads} attention heads, the student "
                        f"model.num_heads={config.num_heads}; the attention-score loss compares "
                        f"them head by head (§3.1): set model.num_heads={theirs.num_heads}")
    if theirs.vocab_size != config.vocab_size:
        raise UserError(f"the teacher's vocabulary has {theirs.vocab_size} tokens, the "
                        f"student's {config.vocab_size}; tokenize with the teacher's own "
                        f"vocabulary (data.tokenizer={where} or its vocab.txt)")
    if theirs.embedding_width != theirs.hidden_size:
        raise UserError(f"the teacher {where} projects {theirs.embedding_width}-wide "
                        "embeddings to its hidden size; TinyBERT's teacher is a plain BERT")
    fixes = mismatched_fields(theirs, config, TEACHER_FIELDS)
    if fixes:
        raise UserError(f"the teacher {where} is not the one the model settings describe; set "
                        f"{' '.join(fixes)}")


def pretrained_tinybert(config: TinyBertConfig, seed: int, load: Callable[[str], Any]
                        ) -> TinyBert:
    """The run's start: a random student (general_distill.py `from_scratch`) and the frozen
    teacher `config.teacher`, checked against the settings."""
    teacher = load_teacher(config.teacher, load, "TinyBERT",
                           "a pretext bert workdir or a HuggingFace BERT folder")
    check_is_bert(teacher, config.teacher, "TinyBERT")
    check_teacher_shape(config, teacher.config)
    model = built_under_jit(lambda: build_tinybert(config, seed))
    freeze_into(model.teacher, teacher.encoder)
    return model


STAGES = ("intermediate", "prediction")


@dataclasses.dataclass(frozen=True)
class TaskDistillationSettings:
    """task_distill.py's two runs (`--pred_distill` off, then on) and `--temperature`."""

    stage: str = "intermediate"
    """intermediate: the layer losses (embeddings, hidden states, attention scores);
    prediction: the soft cross-entropy of the logits (§3.2's two steps)."""
    temperature: float = 1.0
    """Temperature t of the soft cross-entropy (task_distill.py 1.0; §3.1 Eq. 11)."""

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise UserError(f"objective.stage={self.stage!r} must be one of {', '.join(STAGES)} "
                            "(task_distill.py without, then with --pred_distill)")
        if not self.temperature > 0:
            raise UserError(f"objective.temperature={self.temperature} must be > 0 (1.0)")


def soft_cross_entropy(student_logits: jax.Array, teacher_logits: jax.Array,
                       temperature: float) -> jax.Array:
    """task_distill.py `soft_cross_entropy(z_S / t, z_T / t)`: the mean over [B, C] of
    -softmax(z_T / t) x log_softmax(z_S / t)."""
    log_p = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, -1)
    target = jax.nn.softmax(teacher_logits.astype(jnp.float32) / temperature, -1)
    return jnp.mean(-target * log_p)


def task_distillation_loss(model: TinyBertTask, batch: Batch, rng: jax.Array | None, *,
                           objective: TaskDistillationSettings) -> tuple[jax.Array, Metrics]:
    """The stage's loss on one batch of the task's examples (`rng=None`: no dropout)."""
    mask = batch["attention_mask"]
    out = model(batch["input_ids"], batch["token_type_ids"], mask, rng)
    one = jnp.ones((), jnp.float32)
    if objective.stage == "intermediate":
        attention, hidden = layer_losses(out.layers, mask)
        loss = attention + hidden
        return loss, {"loss": (loss, one), "att_loss": (attention, one),
                      "rep_loss": (hidden, one)}
    logits = out.student_logits.astype(jnp.float32)
    if logits.shape[-1] == 1:  # STS-B: task_distill.py regresses on the gold score
        loss = jnp.mean(jnp.square(logits[:, 0] - batch["label"].astype(jnp.float32)))
        return loss, {"loss": (loss, one)}
    loss = soft_cross_entropy(logits, out.teacher_logits, objective.temperature)
    correct = jnp.sum(jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32)
    return loss, {"loss": (loss, one),
                  "accuracy": (correct, jnp.asarray(logits.shape[0], jnp.float32))}


def build_tinybert_task(config: TinyBertTaskConfig, seed: int) -> TinyBertTask:
    return TinyBertTask(config, rngs=nnx.Rngs(seed))


def prepare_task(data: DataConfig, examples: GlueExampleConfig, cache_dir: Path, seed: int
                 ) -> PreparedData:
    """The GLUE task's records (`common.glue_data.prepare_glue`, the teacher's tokenizer) and
    the vocabulary size they give the student."""
    prepared = prepare_glue(data, examples, cache_dir, seed)
    return dataclasses.replace(prepared, model_fields={
        **prepared.model_fields, "vocab_size": prepared.tokenizer.vocab_size})


def check_task(model: TinyBertTaskConfig, examples: GlueExampleConfig, objective: Any = None
               ) -> None:
    """The task exists, reads BERT's layout and fits both networks' positions."""
    glue.glue_task(examples.task)
    if examples.layout != "bert":
        raise UserError(f"examples.layout={examples.layout}: TinyBERT's classifiers are BERT's; "
                        "set examples.layout=bert")
    check_lengths(model, examples)


def student_glue_metrics(model: TinyBertTask, data: PreparedData, examples: GlueExampleConfig,
                         objective: Any = None) -> dict[str, float]:
    """The student's GLUE metrics on the whole dev set."""
    return glue_monitor(model.student, data, examples)


def pretrained_tinybert_task(config: TinyBertTaskConfig, seed: int,
                             load: Callable[[str], Any]) -> TinyBertTask:
    """The run's start: the frozen fine-tuned teacher `config.teacher`, checked against the
    settings, and the student from `config.init` (a BERT such as a general TinyBERT: its
    encoder and pooler under a new head; a classifier of the student's shape, e.g. the
    intermediate stage's: whole) or random."""
    teacher = load_teacher(config.teacher, load, "TinyBERT's task distillation",
                           "a pretext classify workdir fine-tuned from a BERT")
    if not isinstance(teacher, SequenceClassifier) or teacher.config.head != "bert":
        raise UserError(f"{config.teacher} holds a {type(teacher).__name__}, not a BERT "
                        "classifier; the teacher is a BERT fine-tuned on the task (run.py "
                        "finetune --task TASK --init BERT)")
    if teacher.config.num_labels != config.num_labels:
        raise UserError(f"the teacher {config.teacher} has {teacher.config.num_labels} "
                        f"outputs, the task {config.num_labels}; pass a teacher fine-tuned on "
                        "this task")
    check_teacher_shape(config, teacher.config)
    model = built_under_jit(lambda: build_tinybert_task(config, seed))
    freeze_into(model.teacher, teacher)
    if config.init:
        start = load(config.init)
        if not isinstance(start, Bert | SequenceClassifier):
            raise UserError(f"model.init={config.init} holds a {type(start).__name__}; start "
                            "the student from a general TinyBERT, a BERT or this method's "
                            "intermediate stage")
        check_same_architecture(config, start.config, f"model.init={config.init}",
                                frozenset({"classifier_dropout"}))
        if isinstance(start, Bert):
            start = from_pretrained(start, config.student_config(), nnx.Rngs(seed))
        nnx.update(model.student, nnx.state(start, nnx.Param))
    return model


# TinyBERT_4 (Jiao et al. 2020 §4.1; general_distill.py's defaults with the README's command):
# 4 layers of 312, 12 heads, FFN 1200 from bert-base (12 x 768); 3 epochs over English
# Wikipedia in 128-token pairs, batch 256 (README), BertAdam lr 5e-5 (no bias correction, eps
# 1e-6, weight decay 0.01 off biases and LayerNorms: the optimizer groups' 0.01, not the unused
# --weight_decay 1e-4), linear warmup over 10 % then linear decay to 0 (`warmup_linear`),
# clipping at 1.0. Steps: ~25M pairs an epoch (2,500M words ~ 3.2B WordPieces / 128), so 3
# epochs of 256 ~ 300,000 (our estimate; recipe card).
PRESETS = {
    "tinybert_tiny": {
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 4, "intermediate_size": 64,
                  "max_position_embeddings": 128, "vocab_size": 0, **NO_DROPOUT,
                  "teacher_hidden_size": 64, "teacher_num_layers": 2,
                  "teacher_intermediate_size": 256, "teacher_max_position_embeddings": 128},
        "examples": {"max_seq_length": 64},
        "data": {"vocab_size": 4000},
        "optim": TINY_TEXT_OPTIM,
        "train": TINY_TEXT_TRAIN,
    },
    "tinybert_4l": {
        "model": {"hidden_size": 312, "num_layers": 4, "num_heads": 12,
                  "intermediate_size": 1200, "vocab_size": 0},
        "examples": {"max_seq_length": 128, "short_seq_prob": 0.1},
        "data": {"vocab_size": 30522},
        "optim": {"learning_rate": 5e-5, "schedule": "linear_from_peak",
                  "warmup_steps": 30000, "weight_decay": 0.01, "eps": 1e-6,
                  "clip_norm": 1.0},
        "train": {"steps": 300000, "batch_size": 256},
    },
}


# Task distillation's test size: the general tiny student under a BERT head, its teacher a
# `classify` run fine-tuned from a bert_tiny-sized BERT.
TASK_PRESETS = {
    "tinybert_task_tiny": {
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 4, "intermediate_size": 64,
                  "max_position_embeddings": 128, "vocab_size": 0, **NO_DROPOUT,
                  "teacher_hidden_size": 64, "teacher_num_layers": 2,
                  "teacher_intermediate_size": 256, "teacher_max_position_embeddings": 128},
        "examples": {"task": "sst2", "max_seq_length": 64},
        "optim": TINY_TEXT_OPTIM,
        "train": TINY_TEXT_TRAIN,
    },
}


register(Method(
    name="tinybert",
    model_config=TinyBertConfig,
    example_config=PairExampleConfig,
    build_model=build_tinybert,
    loss=general_distillation_loss,
    prepare=prepare_pairs,
    units_per_example=lambda examples: examples.max_seq_length,
    description="TinyBERT: a small BERT learning a frozen BERT's embeddings, hidden states "
                "and attention scores layer by layer (Jiao et al. 2020, general distillation)",
    presets=PRESETS,
    resolution=Resolution(check=check_lengths),
    evaluation=Evaluation(summarize=summary_of(metrics=("loss", "att_loss", "rep_loss"))),
    start=Start(pretrained=pretrained_tinybert),
))


register(Method(
    name="tinybert_task",
    model_config=TinyBertTaskConfig,
    example_config=GlueExampleConfig,
    objective_config=TaskDistillationSettings,
    build_model=build_tinybert_task,
    loss=task_distillation_loss,
    prepare=prepare_task,
    units_per_example=lambda examples: examples.max_seq_length,
    description="TinyBERT task distillation: a student classifier learns a fine-tuned BERT's "
                "layers, then its predictions, on a GLUE task (Jiao et al. 2020 §3.2)",
    presets=TASK_PRESETS,
    resolution=Resolution(check=check_task),
    evaluation=Evaluation(monitor=student_glue_metrics, summarize=summary_of(
        metrics=("loss", "att_loss", "rep_loss", "accuracy", "glue_score"))),
    start=Start(pretrained=pretrained_tinybert_task),
))
