"""Span extraction (SQuAD) on a pre-trained encoder: a linear layer to two units over every
final hidden state, the start and end logits of the answer span (google-research/bert
run_squad.py `create_model`; HF `BertForQuestionAnswering` / `ElectraForQuestionAnswering`,
`qa_outputs`). It sits on the `Encoder` that BERT and ELECTRA pre-train, so a pre-trained
model's weights move over unchanged (`span_extractor`); the head has no dropout (neither
reference applies one)."""

from __future__ import annotations

import jax
from flax import nnx

from pretext_jax.models.classifier import ClassifierConfig
from pretext_jax.models.encoder import Encoder
from pretext_jax.models.layers import dense


class SpanExtractor(nnx.Module):
    """Encoder + `qa_outputs` (dense to 2); returns (start_logits, end_logits), each [B, T].
    The config is a `ClassifierConfig` (its `head`, bert or electra, names the HF family;
    `num_labels` is 2, the start and end units)."""

    def __init__(self, config: ClassifierConfig, *, rngs: nnx.Rngs):
        if config.num_labels != 2:
            raise ValueError(f"num_labels={config.num_labels}: a span head has 2 (start, end)")
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self.encoder = Encoder(config, rngs=rngs)
            self.qa_outputs = dense(config, config.hidden_size, 2, ("embed", None), rngs)

    def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array | None = None,
                 attention_mask: jax.Array | None = None, *, rng: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
        logits = self.qa_outputs(self.encoder(input_ids, token_type_ids, attention_mask, rng))
        return logits[..., 0], logits[..., 1]


def span_extractor(pretrained: nnx.Module, config: ClassifierConfig, rngs: nnx.Rngs
                   ) -> SpanExtractor:
    """A span extractor whose encoder is the pre-trained model's (BERT, an ELECTRA
    discriminator, a classifier or span extractor on one); `qa_outputs` is freshly
    initialised (run_squad.py: truncated normal, stddev 0.02)."""
    model = SpanExtractor(config, rngs=rngs)
    nnx.update(model.encoder, nnx.state(pretrained.encoder, nnx.Param))
    return model

