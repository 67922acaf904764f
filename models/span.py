"""Span extraction (SQuAD) on a pre-trained encoder: a linear layer to two units over every
final hidden state, the start and end logits of the answer span (google-research/bert
run_squad.py `create_model`; HF `*ForQuestionAnswering` of BERT, ELECTRA, RoBERTa, ALBERT and
MPNet, `XLNetForQuestionAnsweringSimple`, `XLMForQuestionAnsweringSimple`: `qa_outputs`). It
sits on the network each family pre-trains, held and run as `models.classifier` holds and runs
it (`EncoderHeads`), so a pre-trained model's weights move over unchanged (`span_extractor`);
the head has no dropout (no reference applies one). XLNet's beam head (zihangdai/xlnet
run_squad.py's start/end top-n and answer class; ALBERT's run_squad_v2.py has the same) is not
built."""

from __future__ import annotations

import jax
from flax import nnx

from pretext_jax.models.classifier import EncoderHeads, HeadConfig, move_encoder
from pretext_jax.models.layers import dense


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


def span_extractor(pretrained: nnx.Module, config: HeadConfig, rngs: nnx.Rngs
                   ) -> SpanExtractor:
    """A span extractor whose encoder is the pre-trained model's (a family of
    `models.classifier.FAMILIES`, or a classifier or span extractor on one); `qa_outputs` is
    freshly initialised (run_squad.py: truncated normal, stddev 0.02)."""
    model = SpanExtractor(config, rngs=rngs)
    move_encoder(model, pretrained)
    return model
