"""ALBERT for pre-training: factorised embeddings, cross-layer parameter sharing, MLM + SOP heads.

Reference: Lan et al. 2020 §3.1 (embeddings of width E projected to the hidden size H; all
layers share one set of parameters), google-research/albert modeling.py and HF transformers
modeling_albert.py (`AlbertForPreTraining`, the parity oracle). The encoder is the shared BERT
encoder with `embedding_size` E (projection = HF `embedding_hidden_mapping_in`) and ONE
`EncoderLayer` applied `num_layers` times (`Encoder(shared_layers=True)`), i.e. HF's
num_hidden_groups = inner_group_num = 1. Heads: tanh pooler on the first token, the
sentence-order classifier (2-way) on it, and the MLM head dense(H -> E), activation,
LayerNorm(E), decoder tied to the word embeddings + bias.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.encoder import Encoder, EncoderConfig
from pretext_jax.models.layers import MaskedLMHead, dense


@dataclasses.dataclass(frozen=True)
class AlbertConfig(EncoderConfig):
    """`EncoderConfig` with ALBERT v2's defaults (albert_base_v2 albert_config.json): E = 128,
    `gelu_new` (our `gelu_tanh`), no dropout."""

    embedding_size: int = 128
    hidden_act: str = "gelu_tanh"
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.embedding_width == self.hidden_size:
            raise ValueError(f"embedding_size {self.embedding_width} equals hidden_size: ALBERT "
                             "factorises its embeddings (E < H, e.g. 128 for 768) and always "
                             "projects E -> H; choose a smaller embedding_size")
        if self.layers_to_keep:
            raise ValueError(f"layers_to_keep={self.layers_to_keep!r}: ALBERT's one shared "
                             "layer has no layers to prune; set layers_to_keep=''")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AlbertOutput:
    """`hidden_states` [B, T, H], `pooled_output` [B, H], `mlm_logits` [B, T, V] (or [B, P, V]
    at `masked_positions`) and `sop_logits` [B, 2] (0 = original order, 1 = swapped)."""

    hidden_states: jax.Array
    pooled_output: jax.Array
    mlm_logits: jax.Array
    sop_logits: jax.Array


class Albert(nnx.Module):
    """ALBERT with both pre-training heads (HF `AlbertForPreTraining`). The SOP head has no
    dropout, as the reference's `get_sentence_order_output` (HF adds classifier_dropout_prob)."""

    def __init__(self, config: AlbertConfig, *, rngs: nnx.Rngs):
        h = config.hidden_size
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self.encoder = Encoder(config, rngs=rngs, shared_layers=True)
            self.pooler = dense(config, h, h, ("embed", "mlp"), rngs)
            self.lm_head = MaskedLMHead(config, rngs=rngs)
            self.sop = dense(config, h, 2, ("embed", None), rngs)

    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        *,
        masked_positions: jax.Array | None = None,
        rng: jax.Array | None = None,
    ) -> AlbertOutput:
        """`masked_positions` [B, P] gathers those positions before the vocabulary projection;
        `rng` enables dropout (None = deterministic)."""
        hidden = self.encoder(input_ids, token_type_ids, attention_mask, rng)
        pooled = jnp.tanh(self.pooler(hidden[:, 0]))
        return AlbertOutput(
            hidden_states=hidden,
            pooled_output=pooled,
            mlm_logits=self.lm_head(hidden, self.encoder.embeddings.word_embeddings,
                                    masked_positions),
            sop_logits=self.sop(pooled),
        )
