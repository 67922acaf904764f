"""word2vec's skip-gram model: an input (centre-word) and an output (context-word) embedding
table (Mikolov et al. 2013b §2; tmikolov/word2vec word2vec.c `InitNet`: `syn0` uniform in
(-0.5/dim, 0.5/dim), `syn1neg` zeros), and the vocabulary's word counts, from which the loss
draws subsampling and negatives on device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Word2VecConfig:
    """The vocabulary size (from the data) and the embedding width."""

    vocab_size: int = 0
    """Words in the vocabulary; 0 = from the data."""
    embedding_dim: int = 300
    """Width of both tables (word2vec.c -size; the paper's 300)."""

    def __post_init__(self) -> None:
        if self.vocab_size < 0 or self.embedding_dim < 1:
            raise UserError(f"model.vocab_size={self.vocab_size} must be >= 0 (0 = from the "
                            f"data) and model.embedding_dim={self.embedding_dim} >= 1; e.g. 300")


class WordCounts(nnx.Variable):
    """The training split's count of every vocabulary word (not a parameter: set from the data
    by the trainer, `PreparedData.model_variables`; checkpointed with the model)."""


class SkipGram(nnx.Module):
    """`input_embeddings` [V, D] (the word vectors one keeps), `output_embeddings` [V, D] (the
    context vectors of the negative-sampling objective) and `word_counts` [V]."""

    def __init__(self, config: Word2VecConfig, *, rngs: nnx.Rngs):
        self.config = config
        v, d = max(config.vocab_size, 1), config.embedding_dim
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            self.input_embeddings = nnx.Param(
                (jax.random.uniform(rngs.params(), (v, d)) - 0.5) / d,
                out_sharding=("vocab", "embed"))
            self.output_embeddings = nnx.Param(jnp.zeros((v, d)),
                                               out_sharding=("vocab", "embed"))
        self.word_counts = WordCounts(jnp.zeros((v,), jnp.float32))
