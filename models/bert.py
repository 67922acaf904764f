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
from pretext_jax.models.layers import ACTIVATIONS, dense, layer_norm


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BertOutput:
    """What BERT returns: last-layer `hidden_states` [B, T, H], `pooled_output` [B, H],
    `mlm_logits` [B, T, V] (or [B, P, V] at `masked_positions`) and `nsp_logits` [B, 2]."""

    hidden_states: jax.Array
    pooled_output: jax.Array
    mlm_logits: jax.Array
    nsp_logits: jax.Array


class Bert(nnx.Module):
    """BERT with both pre-training heads (HF `BertForPreTraining`)."""

    def __init__(self, config: EncoderConfig, *, rngs: nnx.Rngs):
        h = config.hidden_size
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self.encoder = Encoder(config, rngs=rngs)
            self.pooler = dense(config, h, h, ("embed", "mlp"), rngs)
            self.mlm_transform = dense(config, h, h, ("embed", "mlp"), rngs)
            self.mlm_layer_norm = layer_norm(config, h, rngs)
            self.mlm_bias = nnx.Param(jnp.zeros((config.vocab_size,)), out_sharding=("vocab",))
            self.nsp = dense(config, h, 2, ("embed", None), rngs)

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
        mlm_input = hidden
        if masked_positions is not None:
            mlm_input = jnp.take_along_axis(hidden, masked_positions[..., None], axis=1)
        return BertOutput(
            hidden_states=hidden,
            pooled_output=pooled,
            mlm_logits=self.mlm_logits(mlm_input),
            nsp_logits=self.nsp(pooled),
        )

    def mlm_logits(self, hidden: jax.Array) -> jax.Array:
        """Transform (dense + activation + LayerNorm), then the tied word embedding + bias."""
        act = ACTIVATIONS[self.config.hidden_act]
        x = self.mlm_layer_norm(act(self.mlm_transform(hidden)))
        logits = self.encoder.embeddings.word_embeddings.attend(x)
        return logits + self.mlm_bias[...].astype(logits.dtype)
