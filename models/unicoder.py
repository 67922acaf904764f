"""Unicoder (Huang et al. 2019, §2-3): XLM's Transformer (`models.xlm.XLM`, the same
structure and prediction layer) with the two parts its new tasks add.

- Cross-lingual word recovery (§3.1): for a pair (X, Y) with word embeddings x_i, y_j (the
  shared token table), A_ij = W [x_i; y_j; x_i * y_j] with a trainable W in R^{3h}; each x_i is
  re-represented as x_i^t = sum_j softmax_j(A_ij) y_j over Y's real words, and the Transformer
  reads X^t (in place of X's token embeddings; positions and X's language added as for tokens)
  to predict X at every position (`recover`).
- Cross-lingual paraphrase classification (§3.2): a linear layer on the first token's final
  state of a sentence pair, two classes (translation or not), as XLM's classifier, the last
  dense alone (`paraphrase_logits`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.models.layers import dense
from pretext_jax.models.xlm import XLM, XLMConfig


class Unicoder(nnx.Module):
    """An XLM (`transformer`) with the word-recovery attention weight W (`recovery_weight`, [3,
    H]: the rows multiplying x_i, y_j and x_i * y_j) and the paraphrase classifier
    (`paraphrase`)."""

    def __init__(self, config: XLMConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.transformer = XLM(config, rngs=rngs)
        h = config.hidden_size
        with nnx.use_eager_sharding(False):  # placement is pretrain.mesh's job
            init = nnx.initializers.truncated_normal(config.initializer_range)
            self.recovery_weight = nnx.Param(init(rngs.params(), (3, h)),
                                             out_sharding=(None, "embed"))
            self.paraphrase = dense(config, h, 2, ("embed", None), rngs)

    def recovery_inputs(self, source: jax.Array, source_mask: jax.Array, target: jax.Array,
                        target_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(X^t [B, S, H], the attention softmax_j(A) [B, S, T]) of source ids [B, S] over
        target ids [B, T] (`target_mask` 1 = a word); padded source rows are zeroed."""
        table = self.transformer.word_embeddings
        x, y = table(source), table(target)
        w = self.recovery_weight[...].astype(x.dtype)
        scores = ((x @ w[0])[:, :, None] + (y @ w[1])[:, None, :]
                  + jnp.einsum("bsh,bth->bst", x * w[2], y)).astype(jnp.float32)
        # A finite floor, so an all-padding row (no target word) stays finite.
        scores = jnp.where(target_mask[:, None, :] > 0, scores, jnp.finfo(jnp.float32).min)
        attention = jax.nn.softmax(scores, axis=-1)
        mixed = jnp.einsum("bst,bth->bsh", attention.astype(y.dtype), y)
        return mixed * source_mask[..., None].astype(mixed.dtype), attention

    def recover(self, source: jax.Array, source_mask: jax.Array, target: jax.Array,
                target_mask: jax.Array, source_language: jax.Array,
                rng: jax.Array | None = None) -> jax.Array:
        """The word-recovery logits [B, S, V] of every source position: X^t through the
        Transformer (positions 0.., `source_language` [B] on every position), then the tied
        prediction layer."""
        inputs, _ = self.recovery_inputs(source, source_mask, target, target_mask)
        langs = jnp.broadcast_to(source_language[:, None], source.shape)
        hidden = self.transformer.hidden(source, source_mask, langs=langs, rng=rng,
                                         inputs_embeds=inputs)
        return self.transformer.logits(hidden)

    def paraphrase_logits(self, input_ids: jax.Array, input_mask: jax.Array, langs: jax.Array,
                          positions: jax.Array, rng: jax.Array | None = None) -> jax.Array:
        """[B, 2] logits (0: not a translation, 1: a translation) on the first token's final
        state of a sentence pair."""
        hidden = self.transformer.hidden(input_ids, input_mask, langs=langs,
                                         position_ids=positions, rng=rng)
        return self.paraphrase(hidden[:, 0]).astype(jnp.float32)
