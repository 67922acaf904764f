"""Span extraction (SQuAD) on a pre-trained encoder: a linear layer to two units over every
final hidden state, the start and end logits of the answer span (google-research/bert
run_squad.py `create_model`; HF `*ForQuestionAnswering` of BERT, ELECTRA, RoBERTa, ALBERT and
MPNet, `XLNetForQuestionAnsweringSimple`, `XLMForQuestionAnsweringSimple`: `qa_outputs`). It
sits on the network each family pre-trains, held and run as `models.classifier` holds and runs
it (`EncoderHeads`), so a pre-trained model's weights move over unchanged (`span_extractor`);
the head has no dropout (no reference applies one).

`BeamSpanExtractor` is XLNet's SQuAD head (zihangdai/xlnet function_builder.py `get_qa_outputs`,
run by run_squad.py; HF `XLNetForQuestionAnswering`: `XLNetPoolerStartLogits`,
`XLNetPoolerEndLogits`, `XLNetPoolerAnswerClass`): start logits, end logits conditioned on a
start's state, and an answer class (whether the window holds no answer) from the <cls> state
and the start distribution's expected state; inference keeps the `start_n_top` best starts and
the `end_n_top` best ends of each (`beam`). ALBERT's SQuAD v2.0 head (google-research/albert
squad_utils.py `create_v2_model`) is the same network on ALBERT's encoder, its answer class
reading the first token's ([CLS]) state where XLNet's reads the last (<cls>): both come as
`cls_index`; ALBERT's has no HF class.

`AnswerableSpanExtractor` is RoBERTa's SQuAD v2.0 model (Liu et al. 2019 §5.2): the simple head
plus a classifier of whether the window holds an answer, trained jointly (the two losses
summed), the span predicted only where it says answerable. The paper gives neither the
classifier's form nor code; it is RoBERTa's own sentence classification head (fairseq
roberta/model.py `RobertaClassificationHead`: dense, tanh, dropout, dense) with one unit, on
the first token's (<s>, [CLS]) state. HF has no class for it (no HF export).

`JointSpanExtractor` is ELECTRA's SQuAD head (google-research/electra finetune/qa/qa_tasks.py
`get_prediction_module` with its defaults `joint_prediction`, `answerable_classifier` and
`answerable_uses_start_logits`): start logits; end logits from the start's state beside each
position's (a 512-wide GELU layer, then one unit); an answerability logit from the [CLS] state
beside the start distribution's expected state (another 512-wide GELU layer and one unit);
positions outside the context and [CLS] pushed down by 1000 (its `answer_mask`, from the token
types: BERT's layout). Its dense layers start as `tf.layers.dense`'s do (Glorot uniform
kernels, zero biases). No HF class (no HF export)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.classifier import (
    EncoderHeads,
    HeadConfig,
    XLNetClassifierConfig,
    move_encoder,
)
from pretext_jax.models.layers import dense, dropout, layer_norm, split_rng

SPAN_HEADS = ("simple", "beam", "answerable", "joint")
BEAM_HEADS = ("xlnet", "albert")  # the families whose authors use the beam head
JOINT_HEADS = ("electra", "bert", "albert")  # the joint head reads BERT's token types
JOINT_WIDTH = 512  # qa_tasks.py: the width of `qa_hidden` and of the answerability layer
ANSWER_CLASS_STARTS = ("expected", "gold")


@dataclasses.dataclass(frozen=True)
class BeamFields:
    """The span head's choice and XLNet's beam settings (zihangdai/xlnet run_squad.py flags
    `start_n_top`, `end_n_top`; HF `XLNetConfig.start_n_top`, `end_n_top`)."""

    span_head: str = "simple"
    """simple (a linear start/end layer, `SpanExtractor`), beam (XLNet's beam head with an
    answer class, `BeamSpanExtractor`; heads xlnet and albert only), answerable (the simple
    head and RoBERTa's answerability classifier, `AnswerableSpanExtractor`; SQuAD v2.0) or
    joint (ELECTRA's joint start/end head with its answerability classifier,
    `JointSpanExtractor`; heads of BERT's layout)."""
    start_n_top: int = 5
    """Beam and joint: starts kept per window at inference (run_squad.py `start_n_top`: 5;
    ELECTRA's `beam_size`: 20)."""
    end_n_top: int = 5
    """Beam and joint: ends kept per start at inference (run_squad.py `end_n_top`: 5;
    ELECTRA's `beam_size`: 20)."""
    answer_class_start: str = "expected"
    """Beam, training: the start state the answer class reads: expected (the start
    distribution's expected state, function_builder.py `get_qa_outputs`) or gold (the gold
    start's state, HF `XLNetForQuestionAnswering`); inference always reads the expected one."""


@dataclasses.dataclass(frozen=True)
class XLNetBeamConfig(XLNetClassifierConfig, BeamFields):
    """XLNet's config plus the beam head (HF `XLNetForQuestionAnswering`'s config)."""

    span_head: str = "beam"


class SpanExtractor(EncoderHeads):
    """Encoder + `qa_outputs` (dense to 2); returns (start_logits, end_logits), each [B, T].
    The config is a head config (`ClassifierConfig` for bert/electra/roberta/albert,
    `XLNetClassifierConfig`, `XLMClassifierConfig`, `MPNetClassifierConfig`; its `head` names
    the HF family; `num_labels` is 2, the start and end units)."""

    def __init__(self, config: HeadConfig, *, rngs: nnx.Rngs):
        if config.num_labels != 2:
            raise ValueError(f"num_labels={config.num_labels}: a span head has 2 (start, end)")
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self._build_encoder(config, rngs)
            self.qa_outputs = dense(config, config.hidden_size, 2, ("embed", None), rngs)

    def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array | None = None,
                 attention_mask: jax.Array | None = None, *, rng: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
        logits = self.qa_outputs(self.hidden(input_ids, token_type_ids, attention_mask, rng))
        return logits[..., 0], logits[..., 1]


class AnswerableSpanExtractor(SpanExtractor):
    """`SpanExtractor` + `answer_dense` (H -> H), tanh, dropout, `answer_out` (H -> 1) on the
    state at `cls_index` (the first token in the bert and roberta layouts): returns
    (start_logits, end_logits, answerable_logits [B]), the last in float32 (module
    docstring). The config is a head config with `BeamFields` (its `span_head` answerable)."""

    def __init__(self, config: HeadConfig, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        h = config.hidden_size
        with nnx.use_eager_sharding(False):
            self.answer_dense = dense(config, h, h, ("embed", "mlp"), rngs)
            self.answer_out = dense(config, h, 1, ("mlp", None), rngs)

    def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array | None = None,
                 attention_mask: jax.Array | None = None, *, cls_index: jax.Array,
                 rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        encoder_rng, answer_rng = split_rng(rng, 2)
        hidden = self.hidden(input_ids, token_type_ids, attention_mask, encoder_rng)
        logits = self.qa_outputs(hidden)
        x = jnp.tanh(self.answer_dense(_rows(hidden, cls_index[:, None])[:, 0]))
        x = dropout(x, self.config.head_dropout, answer_rng)
        return logits[..., 0], logits[..., 1], self.answer_out(x)[..., 0].astype(jnp.float32)


def _mask(logits: jax.Array, p_mask: jax.Array) -> jax.Array:
    """function_builder.py's masking of impossible positions (p_mask 1): logit * (1 - p) -
    1e30 * p."""
    p = p_mask.astype(jnp.float32)
    return logits.astype(jnp.float32) * (1 - p) - 1e30 * p


def _rows(states: jax.Array, index: jax.Array) -> jax.Array:
    """states[b, index[b, ...]]: [B, T, H], [B, K] -> [B, K, H]."""
    return jnp.take_along_axis(states, index[..., None].astype(jnp.int32), axis=1)


class BeamSpanExtractor(EncoderHeads):
    """Encoder + XLNet's beam head (module docstring). `start_logits`: dense to 1;
    `end_logits`: dense(2H -> H) on [state, start state], tanh, LayerNorm, dense to 1;
    `answer_class`: dense(2H -> H) on [start state, <cls> state], tanh, dropout, dense to 1
    without bias. Start and end logits of positions with `p_mask` 1 are -1e30. The config is a
    head config with `BeamFields` (`XLNetBeamConfig`; for ALBERT, `objectives.squad`'s)."""

    def __init__(self, config: HeadConfig, *, rngs: nnx.Rngs):
        if config.head not in BEAM_HEADS:
            raise ValueError(f"head={config.head}: the beam head is that of {BEAM_HEADS}")
        if config.start_n_top < 1 or config.end_n_top < 1:
            raise ValueError("start_n_top and end_n_top must be >= 1")
        if config.answer_class_start not in ANSWER_CLASS_STARTS:
            raise ValueError(f"answer_class_start={config.answer_class_start!r} must be one of "
                             f"{ANSWER_CLASS_STARTS}")
        self.config = config
        h = config.hidden_size
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self._build_encoder(config, rngs)
            self.start_dense = dense(config, h, 1, ("embed", None), rngs)
            self.end_dense_0 = dense(config, 2 * h, h, ("embed", "mlp"), rngs)
            self.end_norm = layer_norm(config, h, rngs)
            self.end_dense_1 = dense(config, h, 1, ("mlp", None), rngs)
            self.answer_dense_0 = dense(config, 2 * h, h, ("embed", "mlp"), rngs)
            self.answer_dense_1 = nnx.Linear(
                h, 1, use_bias=False, dtype=config.compute_dtype, rngs=rngs,
                kernel_init=nnx.with_partitioning(
                    nnx.initializers.truncated_normal(config.initializer_range),
                    ("mlp", None)))

    def _end_logits(self, hidden: jax.Array, start_states: jax.Array) -> jax.Array:
        """End logits [B, T, K] of K start states [B, K, H] (function_builder.py
        `end_logits` scope: dense_0 tanh, layer norm, dense_1)."""
        t, k = hidden.shape[1], start_states.shape[1]
        x = jnp.concatenate([jnp.broadcast_to(hidden[:, :, None], (*hidden.shape[:2], k,
                                                                   hidden.shape[-1])),
                             jnp.broadcast_to(start_states[:, None], (hidden.shape[0], t,
                                                                      *start_states.shape[1:]))],
                            axis=-1)
        x = self.end_norm(jnp.tanh(self.end_dense_0(x)))
        return self.end_dense_1(x)[..., 0]

    def _answer_class(self, hidden: jax.Array, start_state: jax.Array, cls_index: jax.Array,
                      rng: jax.Array | None) -> jax.Array:
        """cls_logits [B] (function_builder.py `answer_class` scope)."""
        cls_state = _rows(hidden, cls_index[:, None])[:, 0]
        x = jnp.tanh(self.answer_dense_0(jnp.concatenate([start_state, cls_state], axis=-1)))
        x = dropout(x, self.config.head_dropout, rng)
        return self.answer_dense_1(x)[..., 0].astype(jnp.float32)

    def _start(self, input_ids: jax.Array, token_type_ids: jax.Array | None,
               attention_mask: jax.Array | None, p_mask: jax.Array, rng: jax.Array | None
               ) -> tuple[jax.Array, jax.Array]:
        hidden = self.hidden(input_ids, token_type_ids, attention_mask, rng)
        return hidden, _mask(self.start_dense(hidden)[..., 0], p_mask)

    def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array | None,
                 attention_mask: jax.Array | None, *, p_mask: jax.Array,
                 start_positions: jax.Array, cls_index: jax.Array, rng: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Training: (start logits [B, T], end logits [B, T] given the gold start, cls_logits
        [B]), the start and end logits masked by `p_mask`."""
        encoder_rng, answer_rng = split_rng(rng, 2)
        hidden, starts = self._start(input_ids, token_type_ids, attention_mask, p_mask,
                                     encoder_rng)
        gold = _rows(hidden, start_positions[:, None])
        ends = _mask(self._end_logits(hidden, gold)[..., 0], p_mask)
        if self.config.answer_class_start == "gold":
            start_state = gold[:, 0]
        else:
            start_state = jnp.einsum("bth,bt->bh", hidden, jax.nn.softmax(starts, axis=-1))
        return starts, ends, self._answer_class(hidden, start_state, cls_index, answer_rng)

    def beam(self, input_ids: jax.Array, token_type_ids: jax.Array | None,
             attention_mask: jax.Array | None, *, p_mask: jax.Array, cls_index: jax.Array
             ) -> dict[str, jax.Array]:
        """Inference (function_builder.py `get_qa_outputs` without is_training): the
        `start_n_top` best start log-probabilities and positions [B, S], for each the
        `end_n_top` best end log-probabilities and positions [B, S, E], and cls_logits [B]
        from the expected start state."""
        hidden, starts = self._start(input_ids, token_type_ids, attention_mask, p_mask, None)
        start_log_probs = jax.nn.log_softmax(starts, axis=-1)
        start_top, start_index = jax.lax.top_k(start_log_probs, self.config.start_n_top)
        ends = self._end_logits(hidden, _rows(hidden, start_index))  # [B, T, S]
        ends = _mask(jnp.swapaxes(ends, 1, 2), p_mask[:, None])  # [B, S, T]
        end_top, end_index = jax.lax.top_k(jax.nn.log_softmax(ends, axis=-1),
                                           self.config.end_n_top)
        start_state = jnp.einsum("bth,bt->bh", hidden, jnp.exp(start_log_probs))
        return {"start_top_log_probs": start_top, "start_top_index": start_index,
                "end_top_log_probs": end_top, "end_top_index": end_index,
                "cls_logits": self._answer_class(hidden, start_state, cls_index, None)}


class JointSpanExtractor(EncoderHeads):
    """Encoder + ELECTRA's joint head (module docstring): `start_dense` (H -> 1), `end_hidden`
    (2H -> 512, GELU) and `end_dense` (512 -> 1) on [start state, state], `answer_hidden`
    (2H -> 512, GELU) and `answer_dense` (512 -> 1) on [[CLS] state, expected start state].
    The answerability logit is trained against the question having no answer
    (qa_tasks.py's `is_impossible`): high means unanswerable."""

    def __init__(self, config: HeadConfig, *, rngs: nnx.Rngs):
        if config.head not in JOINT_HEADS:
            raise ValueError(f"head={config.head}: the joint head reads BERT's token types "
                             f"(heads {JOINT_HEADS})")
        if config.start_n_top < 1 or config.end_n_top < 1:
            raise ValueError("start_n_top and end_n_top must be >= 1")
        self.config = config
        h, width = config.hidden_size, JOINT_WIDTH
        glorot = nnx.initializers.glorot_uniform()  # tf.layers.dense's kernel initializer
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self._build_encoder(config, rngs)
            self.start_dense = dense(config, h, 1, ("embed", None), rngs, glorot)
            self.end_hidden = dense(config, 2 * h, width, ("embed", "mlp"), rngs, glorot)
            self.end_dense = dense(config, width, 1, ("mlp", None), rngs, glorot)
            self.answer_hidden = dense(config, 2 * h, width, ("embed", "mlp"), rngs, glorot)
            self.answer_dense = dense(config, width, 1, ("mlp", None), rngs, glorot)

    @staticmethod
    def answer_mask(token_type_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """qa_tasks.py `answer_mask` [B, T]: 1 at the second segment's real tokens (the context
        and its closing [SEP]) and at position 0 ([CLS]), else 0."""
        mask = jnp.asarray(attention_mask, jnp.float32) * jnp.asarray(token_type_ids, jnp.float32)
        return mask.at[:, 0].add(1.0)

    def _end_logits(self, hidden: jax.Array, start_states: jax.Array) -> jax.Array:
        """End logits [B, K, T] of K start states [B, K, H], unmasked."""
        shape = (hidden.shape[0], start_states.shape[1], hidden.shape[1], hidden.shape[2])
        x = jnp.concatenate([jnp.broadcast_to(start_states[:, :, None], shape),
                             jnp.broadcast_to(hidden[:, None], shape)], axis=-1)
        return self.end_dense(jax.nn.gelu(self.end_hidden(x), approximate=False))[..., 0]

    def _start(self, input_ids: jax.Array, token_type_ids: jax.Array,
               attention_mask: jax.Array, rng: jax.Array | None
               ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """(final states, start logits [B, T] in float32, answerability logits [B], the
        mask's penalty 1000 (mask - 1) [B, T])."""
        hidden = self.hidden(input_ids, token_type_ids, attention_mask, rng)
        penalty = 1000.0 * (self.answer_mask(token_type_ids, attention_mask) - 1.0)
        starts = self.start_dense(hidden)[..., 0].astype(jnp.float32) + penalty
        expected = jnp.einsum("bth,bt->bh", hidden, jax.nn.softmax(starts, axis=-1))
        x = jnp.concatenate([hidden[:, 0], expected.astype(hidden.dtype)], axis=-1)
        answerable = self.answer_dense(jax.nn.gelu(self.answer_hidden(x), approximate=False))
        return hidden, starts, answerable[..., 0].astype(jnp.float32), penalty

    def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array,
                 attention_mask: jax.Array, *, start_positions: jax.Array,
                 rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Training: (start logits [B, T], end logits [B, T] given the gold start, the
        answerability logits [B]), the start and end logits masked."""
        hidden, starts, answerable, penalty = self._start(input_ids, token_type_ids,
                                                         attention_mask, rng)
        gold = _rows(hidden, start_positions[:, None])
        ends = self._end_logits(hidden, gold)[:, 0].astype(jnp.float32) + penalty
        return starts, ends, answerable

    def beam(self, input_ids: jax.Array, token_type_ids: jax.Array,
             attention_mask: jax.Array) -> dict[str, jax.Array]:
        """Inference (qa_tasks.py without is_training): the `start_n_top` best start
        log-probabilities and positions [B, S], for each the `end_n_top` best end
        log-probabilities and positions [B, S, E], and the answerability logits as
        `cls_logits` [B] (`BeamSpanExtractor.beam`'s fields)."""
        hidden, starts, answerable, penalty = self._start(input_ids, token_type_ids,
                                                         attention_mask, None)
        start_top, start_index = jax.lax.top_k(jax.nn.log_softmax(starts, axis=-1),
                                               self.config.start_n_top)
        ends = self._end_logits(hidden, _rows(hidden, start_index)).astype(jnp.float32)
        end_top, end_index = jax.lax.top_k(jax.nn.log_softmax(ends + penalty[:, None], axis=-1),
                                           self.config.end_n_top)
        return {"start_top_log_probs": start_top, "start_top_index": start_index,
                "end_top_log_probs": end_top, "end_top_index": end_index,
                "cls_logits": answerable}


SPAN_MODELS = {"simple": SpanExtractor, "beam": BeamSpanExtractor,
               "answerable": AnswerableSpanExtractor, "joint": JointSpanExtractor}


def span_model_class(config: HeadConfig) -> type[EncoderHeads]:
    """The span extractor of `config.span_head` (`SPAN_MODELS`; simple without the field)."""
    return SPAN_MODELS[getattr(config, "span_head", "simple")]


def span_extractor(pretrained: nnx.Module, config: HeadConfig, rngs: nnx.Rngs) -> EncoderHeads:
    """A span extractor of `config.span_head` whose encoder is the pre-trained model's (a
    family of `models.classifier.FAMILIES`, or a classifier or span extractor on one); its
    head is freshly initialised (run_squad.py: truncated normal, stddev 0.02; the joint head
    as `tf.layers.dense`)."""
    model = span_model_class(config)(config, rngs=rngs)
    move_encoder(model, pretrained)
    return model
