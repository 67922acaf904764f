"""InfoWord pre-training objective (Kong et al. 2020, "A Mutual Information Maximization
Perspective of Language Representation Learning", §4): BERT's masked LM plus a Deep-InfoMax
term between a sentence and one of its n-grams, on BERT's encoder.

- I_DIM (§4): for a sentence x with the n-gram x_{i:j} masked (x-hat_{i:j}),
  E[g(x-hat_{i:j})^T g(x_{i:j}) - log sum_{x~ in S~} exp(g(x-hat_{i:j})^T g(x~))], S~ the
  positive n-gram and negative n-grams of other sentences: here the other examples' n-grams of
  the (global) batch. One Transformer encodes both views (g_omega = g_psi); g is the final
  hidden state of the first token ([CLS]) of the masked sentence, and of the n-gram encoded on
  its own as [CLS] x_i..x_j [SEP] (`infoword_examples`). The loss is -I_DIM, the mean over the
  batch of `contrastive.in_batch_info_nce`.
- I_MLM: BERT's weighted loss at the masked positions (the n-gram's tokens and the rest of the
  15% budget), sum(w * nll) / (sum(w) + 1e-5), computed by BERT's own code
  (`losses.mlm_and_pair_terms`, which also gives BERT's next-sentence loss on the pooled [CLS]).
- Total (§4: lambda_MLM I_MLM + lambda_DIM I_DIM): mlm_weight x MLM + dim_weight x (-I_DIM),
  plus next_sentence_weight x NSP, 0 by default (the pairs keep BERT's layout and labels, so
  `next_sentence_weight=1` is BERT's loss plus the DIM term).
- Dropout: the masked sentence's pass uses the step's key itself (so the MLM part is exactly
  BERT's), the n-gram's pass a key folded from it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import infoword as infoword_examples
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.models.bert import Bert
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.objectives.common.contrastive import in_batch_info_nce
from pretext_jax.objectives.common.losses import mlm_and_pair_terms
from pretext_jax.objectives.common.masked_lm import check_max_seq_length, prepare_masked_lm
from pretext_jax.objectives.common.preset_parts import (
    BERT_RECIPE,
    TINY_MASKED_LM,
)
from pretext_jax.objectives.registry import (
    Batch,
    Evaluation,
    Method,
    Metrics,
    PreparedData,
    Resolution,
    register,
    summary_of,
)


@dataclasses.dataclass(frozen=True)
class InfoWordSettings:
    """The weights of InfoWord's two terms (§4: lambda_MLM, lambda_DIM) and of BERT's NSP."""

    mlm_weight: float = 1.0
    """lambda_MLM, the masked LM's weight, >= 0."""
    dim_weight: float = 1.0
    """lambda_DIM, the sentence / n-gram InfoNCE term's weight, >= 0."""
    next_sentence_weight: float = 0.0
    """Weight of BERT's next-sentence loss, >= 0 (InfoWord 0: §4's objective is the two terms
    above; 1 = BERT's)."""

    def __post_init__(self) -> None:
        for name in ("mlm_weight", "dim_weight", "next_sentence_weight"):
            if getattr(self, name) < 0:
                raise UserError(f"objective.{name}={getattr(self, name)} must be >= 0 "
                                "(InfoWord: mlm 1, dim 1, next_sentence 0)")


def infoword_loss(model: Bert, batch: Batch, rng: jax.Array | None, *,
                  objective: InfoWordSettings) -> tuple[jax.Array, Metrics]:
    """MLM + NSP + the DIM term on one batch of `infoword_examples` features (module
    docstring); `rng=None` disables dropout."""
    out = model(batch["input_ids"], batch["segment_ids"], batch["input_mask"],
                masked_positions=batch["masked_lm_positions"], rng=rng)
    mlm_loss, nsp_loss, metrics = mlm_and_pair_terms(out, batch)
    ngram_rng = None if rng is None else jax.random.fold_in(rng, 1)
    ngram = model.encoder(batch["ngram_ids"], jnp.zeros_like(batch["ngram_ids"]),
                          batch["ngram_mask"], ngram_rng)[:, 0]
    dim_loss, dim = in_batch_info_nce(out.hidden_states[:, 0], ngram)
    total = (objective.mlm_weight * mlm_loss + objective.dim_weight * dim_loss
             + objective.next_sentence_weight * nsp_loss)
    return total, {"loss": (total, jnp.ones((), jnp.float32)), **metrics,
                   "dim_loss": dim["contrastive_loss"], "dim_accuracy": dim["contrastive_accuracy"]}


def build_infoword(config: EncoderConfig, seed: int) -> Bert:
    return Bert(config, rngs=nnx.Rngs(seed))


def prepare_infoword(data: DataConfig, examples: infoword_examples.InfoWordExampleConfig,
                     cache_dir: Path, seed: int) -> PreparedData:
    """Corpus -> tokenizer -> NSP pairs, each with its masked n-gram and BERT's other masks
    (`dupe_factor` passes) -> ArrayRecord."""
    return prepare_masked_lm(data, examples, cache_dir, seed,
                             infoword_examples.create_training_examples, dynamic_masking=False)


def check_infoword(model: EncoderConfig, examples: infoword_examples.InfoWordExampleConfig,
                   objective: InfoWordSettings) -> None:
    """BERT's position check, and the n-gram view ([CLS] n-gram [SEP]) fits the positions."""
    check_max_seq_length(model, examples)
    if examples.ngram_max_length + 2 > model.max_position_embeddings:
        raise UserError(f"examples.ngram_max_length={examples.ngram_max_length} + 2 exceeds "
                        f"model.max_position_embeddings={model.max_position_embeddings}; "
                        "lower the first")


# InfoWord at BERT-Base (Kong et al. 2020 §5): BERT-Base's network and BERT's pre-training recipe
# (`preset_parts.BERT_RECIPE`); docs/methods/masked_lm.md's card says which of these the paper
# states.
PRESETS = {
    "infoword_tiny": TINY_MASKED_LM,
    "infoword_base": {"model": {"vocab_size": 30522}, **BERT_RECIPE},
}


register(Method(
    name="infoword",
    model_config=EncoderConfig,
    example_config=infoword_examples.InfoWordExampleConfig,
    objective_config=InfoWordSettings,
    build_model=build_infoword,
    loss=infoword_loss,
    prepare=prepare_infoword,
    units_per_example=lambda examples: examples.max_seq_length,
    description="InfoWord: masked LM + InfoNCE between a sentence and its masked n-gram "
                "(Kong et al. 2020)",
    presets=PRESETS,
    resolution=Resolution(check=check_infoword),
    evaluation=Evaluation(summarize=summary_of(accuracy="mlm", metrics=("loss", "dim_accuracy"))),
))
