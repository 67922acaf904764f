"""TinyBERT (Jiao et al. 2020): a small BERT student beside a frozen BERT teacher, both
exposing every layer's hidden states and attention scores.

Reference: huawei-noah/Pretrained-Language-Model TinyBERT/transformer/modeling.py
(`TinyBertForPreTraining`, `BertEncoder.forward`, `BertSelfAttention.forward`).

- The student is a BERT (`models.bert.Bert`, HF `BertForPreTraining`) of M layers and width
  d'; its pre-training heads are kept (the authors' `TinyBertForPreTraining` has them) but no
  loss reads them. `fit_dense` (d' -> d, with a bias) maps its hidden states to the teacher's
  width d (§3.1 Eq. 8's W_h); the authors' code applies that one layer to the embeddings as
  well (§3.1 Eq. 10's W_e), `shared_projection=False` gives the embeddings their own
  (`fit_embeddings`).
- The teacher is a BERT encoder of N layers (`Encoder`) with its weights `Frozen` Variables
  (`models.layers.params_as`), no pooler or heads: general distillation reads its hidden
  states and attention scores only (general_distill.py loads a `BertModel`).
- `TinyBertOutput` holds the student's projected states (embeddings and each layer's output)
  and raw attention scores, and the teacher's, unmapped: which teacher layer each student
  layer learns from is the loss's choice (objectives/tinybert.py `layer_map`).
- `TinyBertTask` is task_distill.py's pair: a student and a fine-tuned teacher, each a BERT
  `SequenceClassifier`, traced as above and with their logits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.bert import Bert
from pretext_jax.models.classifier import ClassifierConfig, SequenceClassifier
from pretext_jax.models.encoder import Encoder, EncoderConfig
from pretext_jax.models.layers import Frozen, dense, params_as, split_rng


@dataclasses.dataclass(frozen=True)
class TeacherFields:
    """The shape of the BERT teacher (bert-base by default) and the projection to its width.
    Student and teacher share the vocabulary (the teacher's tokenizer), the number of attention
    heads (the attention-score loss compares them head by head) and the token types; the
    teacher's layers are a multiple of the student's (general_distill.py asserts it)."""

    teacher: str = ""
    """The BERT teacher: a pretext workdir or model directory, or a HuggingFace folder."""
    teacher_hidden_size: int = 768
    """Width d of the teacher (bert-base 768)."""
    teacher_num_layers: int = 12
    """Layers N of the teacher (bert-base 12), a multiple of num_layers."""
    teacher_intermediate_size: int = 3072
    """Feed-forward width of the teacher (bert-base 3072)."""
    teacher_max_position_embeddings: int = 512
    """Position embeddings of the teacher (bert-base 512)."""
    teacher_hidden_act: str = "gelu"
    """The teacher's activation: gelu, gelu_tanh or relu."""
    teacher_layer_norm_eps: float = 1e-12
    """The teacher's LayerNorm epsilon (BERT 1e-12)."""
    shared_projection: bool = True
    """One projection W_h for the embeddings and every layer (modeling.py `fit_dense`); false:
    the embeddings get their own W_e (§3.1 Eq. 10)."""

    def teacher_fields(self) -> dict[str, Any]:
        """The teacher encoder's `EncoderConfig` fields: the `teacher_*` ones, the student's
        vocabulary, heads, token types, dtype and layer execution, no dropout (a departure:
        general_distill.py and task_distill.py never call the teacher's `eval()`, so its
        dropout stays on there; see the recipe card)."""
        if self.teacher_num_layers % self.num_layers:
            raise ValueError(f"teacher_num_layers={self.teacher_num_layers} must be a multiple "
                             f"of num_layers={self.num_layers} (g(m) = m x N / M; "
                             "general_distill.py asserts it)")
        return dict(
            vocab_size=self.vocab_size, hidden_size=self.teacher_hidden_size,
            num_layers=self.teacher_num_layers, num_heads=self.num_heads,
            intermediate_size=self.teacher_intermediate_size,
            max_position_embeddings=self.teacher_max_position_embeddings,
            type_vocab_size=self.type_vocab_size, hidden_act=self.teacher_hidden_act,
            layer_norm_eps=self.teacher_layer_norm_eps, hidden_dropout=0.0,
            attention_dropout=0.0, dtype=self.dtype, scan_layers=self.scan_layers,
            attention_implementation=self.attention_implementation)


@dataclasses.dataclass(frozen=True)
class TinyBertConfig(EncoderConfig, TeacherFields):
    """General distillation: the student (`EncoderConfig`'s fields: TinyBERT_4 has 4 layers of
    312, 12 heads, FFN 1200) and its teacher (`TeacherFields`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.teacher_config()  # the teacher's own checks

    def student_config(self) -> EncoderConfig:
        """The student's own fields."""
        names = {f.name for f in dataclasses.fields(EncoderConfig)}
        return EncoderConfig(**{n: getattr(self, n) for n in names})

    def teacher_config(self) -> EncoderConfig:
        return EncoderConfig(**self.teacher_fields())


@dataclasses.dataclass(frozen=True)
class TinyBertTaskConfig(ClassifierConfig, TeacherFields):
    """Task distillation: the student classifier (`ClassifierConfig`'s fields, the bert head)
    started from `init`, and its teacher (`TeacherFields`), a BERT classifier fine-tuned on
    the task."""

    heads: ClassVar[tuple[str, ...]] = ("bert",)
    init: str = ""
    """The student's start: a general TinyBERT (a pretext tinybert workdir), any BERT, or this
    method's intermediate-stage workdir; '' = random."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.teacher_config()  # the teacher's own checks

    def student_config(self) -> ClassifierConfig:
        """The student's own fields."""
        names = {f.name for f in dataclasses.fields(ClassifierConfig)}
        return ClassifierConfig(**{n: getattr(self, n) for n in names})

    def teacher_config(self) -> ClassifierConfig:
        return ClassifierConfig(**self.teacher_fields(), num_labels=self.num_labels)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TinyBertOutput:
    """The student's hidden states projected to the teacher's width, `student_states`
    [M + 1, B, T, d] (index 0: the embeddings, m: layer m's output), its attention scores
    `student_scores` [M, B, N_h, T, T] (q.k / sqrt(D), unmasked), and the teacher's
    `teacher_states` [N + 1, B, T, d] and `teacher_scores` [N, B, N_h, T, T] (constants to
    differentiation)."""

    student_states: jax.Array
    student_scores: jax.Array
    teacher_states: jax.Array
    teacher_scores: jax.Array


def traced(encoder: Encoder, input_ids: jax.Array, token_type_ids: jax.Array,
           attention_mask: jax.Array, rng: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Every hidden state [L + 1, B, T, H] (the embeddings first) and every layer's attention
    scores [L, B, N, T, T] of `encoder` (modeling.py `BertEncoder.forward`'s two lists)."""
    x, mask, rng = encoder.stack_inputs(input_ids, token_type_ids, attention_mask, rng)
    states, scores = encoder.stack.trace(x, mask, rng)
    return jnp.concatenate([x[None], states]), scores


class Fit(nnx.Module):
    """The projection of the student's states to the teacher's width: `dense` (W_h, d' -> d
    with a bias: modeling.py `fit_dense`) on every state, or with `shared_projection` false on
    the layers' only, `embeddings` (W_e) on the embeddings'."""

    def __init__(self, config: TeacherFields, *, rngs: nnx.Rngs):
        h, d = config.hidden_size, config.teacher_hidden_size
        self.dense = dense(config, h, d, ("embed", "mlp"), rngs)
        self.embeddings = (None if config.shared_projection
                           else dense(config, h, d, ("embed", "mlp"), rngs))

    def __call__(self, states: jax.Array) -> jax.Array:
        """[M + 1, B, T, d'] (the embeddings first) -> [M + 1, B, T, d]."""
        projected = self.dense(states)
        if self.embeddings is not None:
            projected = projected.at[0].set(self.embeddings(states[0]))
        return projected


class TinyBert(nnx.Module):
    """The TinyBERT `student` (a `Bert`) with its projection(s) to the teacher's width `fit`
    (parameters), and the BERT `teacher` encoder (`Frozen` Variables)."""

    def __init__(self, config: TinyBertConfig, *, rngs: nnx.Rngs):
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self.student = Bert(config.student_config(), rngs=rngs)
            self.fit = Fit(config, rngs=rngs)
            self.teacher = params_as(Encoder(config.teacher_config(), rngs=rngs), Frozen)

    def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array,
                 attention_mask: jax.Array, rng: jax.Array | None = None) -> TinyBertOutput:
        """Both networks on the same `input_ids`, `token_type_ids`, `attention_mask` [B, T]
        (general_distill.py feeds the teacher and student the same three); `rng` is the
        student's dropout."""
        states, scores = traced(self.student.encoder, input_ids, token_type_ids,
                                attention_mask, rng)
        teacher = jax.lax.stop_gradient(traced(self.teacher, input_ids, token_type_ids,
                                               attention_mask, None))
        return TinyBertOutput(student_states=self.fit(states), student_scores=scores,
                              teacher_states=teacher[0], teacher_scores=teacher[1])

    def downstream_model(self) -> Bert:
        """The student: what is exported and fine-tuned."""
        return self.student

    def parts(self) -> dict[str, nnx.Module]:
        """What has a HuggingFace form: the student alone (HF `BertForPreTraining`, as the
        authors save `TinyBertForPreTraining`); the projection is a training device, the
        teacher is where it came from."""
        return {"": self.student}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TinyBertTaskOutput:
    """The layers' `TinyBertOutput` and both classifiers' logits [B, num_labels] (the
    teacher's constant to differentiation)."""

    layers: TinyBertOutput
    student_logits: jax.Array
    teacher_logits: jax.Array


class TinyBertTask(nnx.Module):
    """task_distill.py's pair: the `student` classifier and `fit` (parameters), the fine-tuned
    `teacher` classifier (`Frozen` Variables)."""

    def __init__(self, config: TinyBertTaskConfig, *, rngs: nnx.Rngs):
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self.student = SequenceClassifier(config.student_config(), rngs=rngs)
            self.fit = Fit(config, rngs=rngs)
            self.teacher = params_as(SequenceClassifier(config.teacher_config(), rngs=rngs),
                                     Frozen)

    def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array,
                 attention_mask: jax.Array, rng: jax.Array | None = None
                 ) -> TinyBertTaskOutput:
        """Both classifiers on the same inputs [B, T], traced layer by layer; `rng` is the
        student's dropout (split as `SequenceClassifier` splits it)."""
        encoder_rng, first_rng, second_rng = split_rng(rng, 3)
        states, scores = traced(self.student.encoder, input_ids, token_type_ids,
                                attention_mask, encoder_rng)
        logits = self.student.logits(states[-1], first_rng, second_rng)
        t_states, t_scores = traced(self.teacher.encoder, input_ids, token_type_ids,
                                    attention_mask, None)
        teacher = jax.lax.stop_gradient(
            (t_states, t_scores, self.teacher.logits(t_states[-1], None, None)))
        return TinyBertTaskOutput(
            layers=TinyBertOutput(student_states=self.fit(states), student_scores=scores,
                                  teacher_states=teacher[0], teacher_scores=teacher[1]),
            student_logits=logits, teacher_logits=teacher[2])

    def downstream_model(self) -> SequenceClassifier:
        """The student classifier: what is exported, evaluated and distilled further."""
        return self.student

    def parts(self) -> dict[str, nnx.Module]:
        """The student alone (HF `BertForSequenceClassification`)."""
        return {"": self.student}
