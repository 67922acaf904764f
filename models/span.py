"""Span extraction (SQuAD) on a pre-trained encoder: a linear layer to two units over every
final hidden state, the start and end logits of the answer span (google-research/bert
run_squad.py `create_model`; HF `BertForQuestionAnswering`, `ElectraForQuestionAnswering`,
`XLNetForQuestionAnsweringSimple`, `XLMForQuestionAnsweringSimple`: `qa_outputs`). It sits on
the encoder each family pre-trains (`Encoder` for the bert and electra heads, `XLNetModel` for
xlnet, `XLM` without its prediction layer for xlm, run as `models.classifier` runs them), so a
pre-trained model's weights move over unchanged (`span_extractor`); the head has no dropout
(no reference applies one). XLNet's beam head (zihangdai/xlnet run_squad.py's start/end top-n
and answer class) is not built."""

from __future__ import annotations

import jax
from flax import nnx

from pretext_jax.models.classifier import HeadConfig, copy_params
from pretext_jax.models.encoder import Encoder
from pretext_jax.models.layers import dense
from pretext_jax.models.xlm import XLM
from pretext_jax.models.xlnet import XLNetModel


class SpanExtractor(nnx.Module):
    """Encoder + `qa_outputs` (dense to 2); returns (start_logits, end_logits), each [B, T].
    The config is a head config (`ClassifierConfig` for bert/electra, `XLNetClassifierConfig`,
    `XLMClassifierConfig`; its `head` names the HF family; `num_labels` is 2, the start and
    end units)."""

    def __init__(self, config: HeadConfig, *, rngs: nnx.Rngs):
        if config.num_labels != 2:
            raise ValueError(f"num_labels={config.num_labels}: a span head has 2 (start, end)")
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            if config.head == "xlnet":
                self.transformer = XLNetModel(config, rngs=rngs)
            elif config.head == "xlm":
                self.transformer = XLM(config, rngs=rngs, with_output=False)
            else:
                self.encoder = Encoder(config, rngs=rngs)
            self.qa_outputs = dense(config, config.hidden_size, 2, ("embed", None), rngs)

    def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array | None = None,
                 attention_mask: jax.Array | None = None, *, rng: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
        if self.config.head == "xlnet":
            hidden, _ = self.transformer.encode(input_ids, token_type_ids, attention_mask,
                                                rng=rng)
        elif self.config.head == "xlm":  # token types unused, as the xlm classifier
            hidden = self.transformer.hidden(input_ids, attention_mask, rng=rng)
        else:
            hidden = self.encoder(input_ids, token_type_ids, attention_mask, rng)
        logits = self.qa_outputs(hidden)
        return logits[..., 0], logits[..., 1]


def span_extractor(pretrained: nnx.Module, config: HeadConfig, rngs: nnx.Rngs
                   ) -> SpanExtractor:
    """A span extractor whose encoder is the pre-trained model's (BERT, an ELECTRA
    discriminator, XLNet, XLM, a classifier or span extractor on one); `qa_outputs` is freshly
    initialised (run_squad.py: truncated normal, stddev 0.02)."""
    model = SpanExtractor(config, rngs=rngs)
    if config.head in ("xlnet", "xlm"):  # all but the pre-trained LM head's bias
        copy_params(model.transformer, getattr(pretrained, "transformer", pretrained))
    else:
        nnx.update(model.encoder, nnx.state(pretrained.encoder, nnx.Param))
    return model
