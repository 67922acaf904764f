"""RoBERTa for pre-training: the BERT encoder with RoBERTa's positions and a masked-LM head.

Reference: Liu et al. 2019 (§4: no NSP, one segment, dynamic masking) and fairseq
`RobertaModel` / HF transformers modeling_roberta.py (`RobertaForMaskedLM`, the parity oracle):
positions are counted over non-padding tokens starting at pad + 1 (`EncoderConfig.
position_padding_id`), one token type, no pooler, and the LM head dense -> GELU -> LayerNorm ->
decoder tied to the word embeddings + bias.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.models.encoder import Encoder, EncoderConfig
from pretext_jax.models.layers import MaskedLMHead


@dataclasses.dataclass(frozen=True)
class RobertaConfig(EncoderConfig):
    """`EncoderConfig` with RoBERTa's defaults: one token type, LayerNorm epsilon 1e-5
    (fairseq), and positions counted from the padding id (0 here: our tokenizers put [PAD] at
    0, and pre-training fills it in from the tokenizer; HF's byte-level BPE vocabulary has
    `<pad>` at 1). `max_position_embeddings` must cover max_seq_length + padding id + 1
    (roberta-base: 514 = 512 + 2)."""

    max_position_embeddings: int = 514
    type_vocab_size: int = 1
    layer_norm_eps: float = 1e-5
    position_padding_id: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.position_padding_id < 0:
            raise ValueError(f"position_padding_id={self.position_padding_id} must be the "
                             "tokenizer's padding id (>= 0): RoBERTa's positions count from it")


def check_positions(config: RobertaConfig, seq_len: int) -> None:
    """Position ids reach padding id + `seq_len`; a table too short for them would be read
    out of range (clamped by XLA) without a word, so it is refused here."""
    needed = seq_len + config.position_padding_id + 1
    if needed > config.max_position_embeddings:
        raise UserError(
            f"{seq_len} tokens with padding id {config.position_padding_id} need "
            f"{needed} RoBERTa positions but model.max_position_embeddings="
            f"{config.max_position_embeddings}; raise it to {needed} (max_seq_length + padding "
            "id + 1) or shorten examples.max_seq_length")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RobertaOutput:
    """`hidden_states` [B, T, H] and `mlm_logits` [B, T, V] (or [B, P, V] at
    `masked_positions`)."""

    hidden_states: jax.Array
    mlm_logits: jax.Array


class Roberta(nnx.Module):
    """RoBERTa with its masked-LM head (HF `RobertaForMaskedLM`). The head's activation is the
    exact GELU whatever `hidden_act` says, as in HF `RobertaLMHead`."""

    def __init__(self, config: RobertaConfig, *, rngs: nnx.Rngs):
        self.config = config
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self.encoder = Encoder(config, rngs=rngs)
            self.lm_head = MaskedLMHead(config, rngs=rngs, activation="gelu")

    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        *,
        masked_positions: jax.Array | None = None,
        rng: jax.Array | None = None,
    ) -> RobertaOutput:
        """`masked_positions` [B, P] gathers those positions before the vocabulary projection;
        `rng` enables dropout (None = deterministic)."""
        check_positions(self.config, input_ids.shape[1])
        hidden = self.encoder(input_ids, token_type_ids, attention_mask, rng)
        return RobertaOutput(
            hidden_states=hidden,
            mlm_logits=self.lm_head(hidden, self.encoder.embeddings.word_embeddings,
                                    masked_positions))
