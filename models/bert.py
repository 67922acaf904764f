"""BERT for pre-training: encoder + pooler + masked-LM head + next-sentence head.

Reference: google-research/bert modeling.py (`BertModel`, pooler) and run_pretraining.py
(`get_masked_lm_output`, `get_next_sentence_output`); HF transformers `BertForPreTraining` has the
same structure and is the parity oracle (tests/test_bert_parity.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.encoder import Encoder, EncoderConfig
from pretext_jax.models.layers import MaskedLMHead, dense


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BertOutput:
    """What BERT returns: last-layer `hidden_states` [B, T, H], `pooled_output` [B, H],
    `mlm_logits` [B, T, V] (or [B, P, V] at `masked_positions`) and `nsp_logits` [B, 2 or 3]."""

    hidden_states: jax.Array
    pooled_output: jax.Array
    mlm_logits: jax.Array
    nsp_logits: jax.Array


class Bert(nnx.Module):
    """BERT with both pre-training heads (HF `BertForPreTraining`): the tanh pooler, the
    masked-LM head (`MaskedLMHead` at `lm_head`: run_pretraining.py `get_masked_lm_output`'s
    transform, then the tied word embedding + bias) and the next-sentence head `nsp`, with
    `pair_classes` outputs (2; StructBERT's sentence structural head has 3)."""

    def __init__(self, config: EncoderConfig, *, rngs: nnx.Rngs, pair_classes: int = 2):
        h = config.hidden_size
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self.encoder = Encoder(config, rngs=rngs)
            self.pooler = dense(config, h, h, ("embed", "mlp"), rngs)
            self.lm_head = MaskedLMHead(config, rngs=rngs)
            self.nsp = dense(config, h, pair_classes, ("embed", None), rngs)

    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        *,
        masked_positions: jax.Array | None = None,
        rng: jax.Array | None = None,
    ) -> BertOutput:
        """Runs BERT. `masked_positions` [B, P] gathers those positions before the vocabulary
        projection (what pre-training needs: run_pretraining.py `gather_indexes`); `rng` enables
        dropout (None = deterministic)."""
        hidden = self.encoder(input_ids, token_type_ids, attention_mask, rng)
        pooled = jnp.tanh(self.pooler(hidden[:, 0]))
        return BertOutput(
            hidden_states=hidden,
            pooled_output=pooled,
            mlm_logits=self.lm_head(hidden, self.encoder.embeddings.word_embeddings,
                                    masked_positions),
            nsp_logits=self.nsp(pooled),
        )


class Ernie(Bert):
    """ERNIE 1.0's network (Sun et al. 2019 §3.1: BERT's encoder and pre-training heads; its
    novelty is the masking), optionally with ERNIE 2.0's task-type embeddings
    (`EncoderConfig.task_type_vocab_size`); a class of its own so that it converts to HF
    `ErnieForPreTraining` (`models/hf/ernie.py`)."""
