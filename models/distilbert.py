"""DistilBERT (Sanh et al. 2019) and the student-teacher pair that distils it.

- `DistilBert` is HF transformers modeling_distilbert.py `DistilBertForMaskedLM`: BERT's
  post-LN encoder without token-type embeddings (word + learned position embeddings,
  LayerNorm), no pooler, and the LM head `vocab_transform` -> activation -> `vocab_layer_norm`
  -> `vocab_projector` tied to the word embeddings + bias (our `MaskedLMHead`). HF fixes every
  LayerNorm epsilon at 1e-12 and uses `activation` in the feed-forward block and the head.
- `Distillation` holds the student and a frozen BERT teacher (`Teacher`: the encoder and,
  when the teacher has one, BERT's masked-LM head), its weights `Frozen` Variables, not
  parameters (as MoCo's and BYOL's targets are `EMA` Variables: `models/momentum.py`), so no
  gradient or optimizer state is ever made for them; they are sharded like the student's by
  the same logical axis names and compute in the student's dtype.
- `student_from_teacher` is the research project's scripts/extract_distilbert.py: the student
  starts from the teacher's word and position embeddings, their LayerNorm, a subset of its
  layers, and the LM head's output bias (with `init_vocab_transform`, its transform too).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.encoder import Encoder, EncoderConfig
from pretext_jax.models.layers import Frozen, MaskedLMHead, params_as

# HF DistilBERT's LayerNorms are built with eps=1e-12 whatever the config says.
LAYER_NORM_EPS = 1e-12


@dataclasses.dataclass(frozen=True)
class DistilBertConfig(EncoderConfig):
    """`EncoderConfig` with DistilBERT's layout: 6 layers, no token types, BERT's positions
    and LayerNorm epsilon 1e-12 (HF `DistilBertConfig`: dim 768, n_layers 6, n_heads 12,
    hidden_dim 3072)."""

    num_layers: int = 6
    type_vocab_size: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        fixed = {"type_vocab_size": 0, "position_padding_id": -1, "task_type_vocab_size": 0,
                 "layer_norm_eps": LAYER_NORM_EPS}
        for name, value in fixed.items():
            if getattr(self, name) != value:
                raise ValueError(f"DistilBERT has {name}={value} (HF DistilBertModel), not "
                                 f"{getattr(self, name)}")
        if self.embedding_width != self.hidden_size:
            raise ValueError("DistilBERT's embeddings have the hidden size; set "
                             "embedding_size=0")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DistilBertOutput:
    """`hidden_states` [B, T, H] and `mlm_logits` [B, T, V] (or [B, P, V] at
    `masked_positions`)."""

    hidden_states: jax.Array
    mlm_logits: jax.Array


class DistilBert(nnx.Module):
    """DistilBERT with its masked-LM head (HF `DistilBertForMaskedLM`)."""

    def __init__(self, config: DistilBertConfig, *, rngs: nnx.Rngs):
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self.encoder = Encoder(config, rngs=rngs)
            self.lm_head = MaskedLMHead(config, rngs=rngs)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None, *,
                 masked_positions: jax.Array | None = None,
                 rng: jax.Array | None = None) -> DistilBertOutput:
        """`input_ids` [B, T], `attention_mask` [B, T] (1 = token); `masked_positions` [B, P]
        gathers those positions before the vocabulary projection; `rng` enables dropout."""
        hidden = self.encoder(input_ids, None, attention_mask, rng)  # [B, T, H]
        return DistilBertOutput(
            hidden_states=hidden,
            mlm_logits=self.lm_head(hidden, self.encoder.embeddings.word_embeddings,
                                    masked_positions))


@dataclasses.dataclass(frozen=True)
class DistillationConfig(DistilBertConfig):
    """The student (`DistilBertConfig`'s fields) and the shape of its BERT teacher, whose
    hidden size and vocabulary are the student's (the cosine loss compares hidden states, the
    soft targets are distributions over one vocabulary). `teacher` is the teacher's pretext
    workdir, model directory or HF folder (`BertForMaskedLM`, `BertForPreTraining`, or a bare
    `BertModel` with `teacher_mlm_head=False`); the `teacher_*` fields must match it (a run
    refuses, naming the settings, where they do not)."""

    teacher: str = ""
    """The BERT teacher: a pretext workdir or model directory, or a HuggingFace folder."""
    teacher_num_layers: int = 12
    """Layers of the teacher (bert-base 12)."""
    teacher_num_heads: int = 12
    """Attention heads of the teacher (bert-base 12)."""
    teacher_intermediate_size: int = 3072
    """Feed-forward width of the teacher (bert-base 3072)."""
    teacher_max_position_embeddings: int = 512
    """Position embeddings of the teacher (bert-base 512)."""
    teacher_type_vocab_size: int = 2
    """Token types of the teacher (bert-base 2; every token gets type 0, as distiller.py's)."""
    teacher_hidden_act: str = "gelu"
    """The teacher's activation: gelu, gelu_tanh or relu."""
    teacher_layer_norm_eps: float = 1e-12
    """The teacher's LayerNorm epsilon (BERT 1e-12)."""
    teacher_mlm_head: bool = True
    """Whether the teacher has BERT's masked-LM head (false: a bare `BertModel`, no soft
    targets)."""
    init_layers: tuple[int, ...] = ()
    """The teacher layer that initialises each student layer; () = every other one, 0, 2, 4,
    ... (extract_distilbert.py takes 0, 2, 4, 7, 9, 11 of bert-base's 12)."""
    init_vocab_transform: bool = False
    """Copy the teacher's LM-head transform into the student's (extract_distilbert.py
    `--vocab_transform`; its default: only the output bias)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "init_layers", tuple(int(i) for i in self.init_layers))
        layers = self.student_init_layers
        if len(layers) != self.num_layers or not all(
                0 <= i < self.teacher_num_layers for i in layers):
            raise ValueError(f"init_layers {list(layers)} must name one teacher layer (0 to "
                             f"{self.teacher_num_layers - 1}) for each of the "
                             f"{self.num_layers} student layers")
        self.teacher_config()  # the teacher's own checks

    @property
    def student_init_layers(self) -> tuple[int, ...]:
        return self.init_layers or tuple(2 * i for i in range(self.num_layers))

    def student_config(self) -> DistilBertConfig:
        """The student's own fields."""
        names = {f.name for f in dataclasses.fields(DistilBertConfig)}
        return DistilBertConfig(**{n: getattr(self, n) for n in names})

    def teacher_config(self) -> EncoderConfig:
        """The teacher's encoder: the `teacher_*` fields, the student's width, vocabulary,
        dtype and layer execution, no dropout (distiller.py runs it in eval mode)."""
        return EncoderConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            num_layers=self.teacher_num_layers, num_heads=self.teacher_num_heads,
            intermediate_size=self.teacher_intermediate_size,
            max_position_embeddings=self.teacher_max_position_embeddings,
            type_vocab_size=self.teacher_type_vocab_size, hidden_act=self.teacher_hidden_act,
            layer_norm_eps=self.teacher_layer_norm_eps, hidden_dropout=0.0,
            attention_dropout=0.0, dtype=self.dtype, scan_layers=self.scan_layers,
            attention_implementation=self.attention_implementation)


class Teacher(nnx.Module):
    """A BERT encoder and, with `mlm_head`, BERT's masked-LM head (HF `BertForMaskedLM`)."""

    def __init__(self, config: EncoderConfig, mlm_head: bool, *, rngs: nnx.Rngs):
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self.encoder = Encoder(config, rngs=rngs)
            self.lm_head = MaskedLMHead(config, rngs=rngs) if mlm_head else None

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array, *, logits: bool = True
                 ) -> tuple[jax.Array, jax.Array | None]:
        """Last hidden states [B, T, H] and, with `logits` and a head, logits [B, T, V] (else
        None); token type 0 everywhere, no dropout."""
        hidden = self.encoder(input_ids, None, attention_mask, None)
        if not logits or self.lm_head is None:
            return hidden, None
        return hidden, self.lm_head(hidden, self.encoder.embeddings.word_embeddings)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DistillationOutput:
    """The student's last hidden states [B, T, H], its logits at the masked positions
    `mlm_logits` [B, P, V] and, with soft targets, at every position `student_logits`
    [B, T, V]; the teacher's last hidden states and, with soft targets, logits [B, T, V]
    (constants to differentiation). Without soft targets the two [B, T, V] fields are None."""

    student_hidden: jax.Array
    mlm_logits: jax.Array
    student_logits: jax.Array | None
    teacher_hidden: jax.Array
    teacher_logits: jax.Array | None


class Distillation(nnx.Module):
    """The DistilBERT `student` (parameters) and its BERT `teacher` (`Frozen` Variables)."""

    def __init__(self, config: DistillationConfig, *, rngs: nnx.Rngs):
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self.student = DistilBert(config.student_config(), rngs=rngs)
            self.teacher = params_as(
                Teacher(config.teacher_config(), config.teacher_mlm_head, rngs=rngs), Frozen)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array,
                 masked_positions: jax.Array, *, soft_targets: bool,
                 rng: jax.Array | None = None) -> DistillationOutput:
        """Both networks on the same (masked) `input_ids` [B, T]; `masked_positions` [B, P];
        `soft_targets`: logits over every position from both (the teacher needs its MLM
        head); else the student's only at `masked_positions`, the teacher's head not run.
        `rng` is the student's dropout."""
        if soft_targets and self.teacher.lm_head is None:
            raise ValueError("soft targets need a teacher with an MLM head")
        student = self.student(input_ids, attention_mask,
                               masked_positions=None if soft_targets else masked_positions,
                               rng=rng)
        hidden, logits = jax.lax.stop_gradient(self.teacher(input_ids, attention_mask,
                                                            logits=soft_targets))
        full = student.mlm_logits if soft_targets else None
        mlm = (jnp.take_along_axis(full, masked_positions[..., None], axis=1) if soft_targets
               else student.mlm_logits)  # [B, P, V]
        return DistillationOutput(student_hidden=student.hidden_states, mlm_logits=mlm,
                                  student_logits=full, teacher_hidden=hidden,
                                  teacher_logits=logits)

    def downstream_model(self) -> DistilBert:
        """The student: what is exported and fine-tuned."""
        return self.student

    def parts(self) -> dict[str, nnx.Module]:
        """What has a HuggingFace form: the student alone, as the whole export ("": no
        sub-folder; HF `DistilBertForMaskedLM`); the teacher is where it came from."""
        return {"": self.student}


def student_from_teacher(student: DistilBert, teacher: nnx.Module,
                         layers: tuple[int, ...], vocab_transform: bool) -> None:
    """Sets `student`'s parameters from a BERT `teacher` (its `encoder`, and `lm_head` if it is
    not None) as extract_distilbert.py does: word and position embeddings and their LayerNorm,
    student layer i <- teacher layer `layers[i]` (every weight of the block), the LM head's
    output bias, and with `vocab_transform` the head's dense + LayerNorm. The teacher's
    token-type table has no place in the student. Values are read whatever the teacher's
    Variable kind (`nnx.Param` or `Frozen`)."""

    def values(module: nnx.Module) -> dict[tuple, nnx.Variable]:
        return dict(nnx.to_flat_state(nnx.state(module, nnx.Variable)))

    theirs, ours = values(teacher), values(student)
    index = jnp.asarray(layers)
    for path, variable in ours.items():
        if path[0] == "lm_head" and (getattr(teacher, "lm_head", None) is None or (
                path[1] != "bias" and not vocab_transform)):
            continue
        value = theirs[path][...]
        if path[:3] == ("encoder", "stack", "layers"):
            value = value[index]
        # A copy: the student's buffers must not be the teacher's (a training step donates
        # its parameters).
        variable.set_value(jnp.array(value, variable.get_value().dtype, copy=True))
