"""StructBERT pre-training objective (Wang et al. 2020, §2.2-2.3): masked LM + the word
structural objective + the sentence structural objective, on BERT's encoder.

- Masked LM: BERT's weighted loss at the masked positions, sum(w * nll) / (sum(w) + 1e-5).
- Word structural: at every position of a shuffled trigram (`structbert_examples`), the
  original token predicted through the same masked-LM head (one gather of the masked and the
  shuffled positions); the same weighted loss over the shuffled positions. §2.2 trains it
  jointly with the masked LM at equal weight: total = MLM + `word_structural_weight` (1) x it.
- Sentence structural: a 3-way softmax (next / previous / random, labels 0 / 1 / 2) on the
  pooled [CLS], the plain batch mean of its loss as BERT's NSP, weight
  `sentence_structural_weight` (1).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import structbert as structbert_examples
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.models.bert import Bert
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.objectives.common.losses import weighted_cross_entropy
from pretext_jax.objectives.common.masked_lm import check_max_seq_length, prepare_masked_lm
from pretext_jax.objectives.common.preset_parts import (
    NO_DROPOUT,
    TINY_TEXT_MODEL,
    TINY_TEXT_OPTIM,
    TINY_TEXT_TRAIN,
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

SENTENCE_CLASSES = 3  # next, previous, random (§2.3)


@dataclasses.dataclass(frozen=True)
class StructBertSettings:
    """The weights of the structural objectives beside the masked LM (§2.2: equal weights)."""

    word_structural_weight: float = 1.0
    """Weight of the shuffled-trigram reconstruction loss, >= 0 (StructBERT 1)."""
    sentence_structural_weight: float = 1.0
    """Weight of the 3-way next / previous / random loss, >= 0 (StructBERT 1)."""

    def __post_init__(self) -> None:
        for name in ("word_structural_weight", "sentence_structural_weight"):
            if getattr(self, name) < 0:
                raise UserError(f"objective.{name}={getattr(self, name)} must be >= 0 (1 = "
                                "StructBERT's equal weighting)")


def structbert_loss(model: Bert, batch: Batch, rng: jax.Array | None, *,
                    objective: StructBertSettings) -> tuple[jax.Array, Metrics]:
    """MLM + word structural + sentence structural on one batch of `structbert_examples`
    features (module docstring); `rng=None` disables dropout."""
    masked = batch["masked_lm_positions"].shape[1]
    positions = jnp.concatenate([batch["masked_lm_positions"], batch["shuffled_positions"]], 1)
    out = model(batch["input_ids"], batch["segment_ids"], batch["input_mask"],
                masked_positions=positions, rng=rng)
    mlm_loss, mlm = weighted_cross_entropy(out.mlm_logits[:, :masked], batch["masked_lm_ids"],
                                           batch["masked_lm_weights"])
    word_loss, word = weighted_cross_entropy(out.mlm_logits[:, masked:], batch["shuffled_ids"],
                                             batch["shuffled_weights"])
    labels = batch["next_sentence_labels"]
    sentence_loss, sentence = weighted_cross_entropy(out.nsp_logits, labels,
                                                     jnp.ones(labels.shape), epsilon=0.0)
    total = (mlm_loss + objective.word_structural_weight * word_loss
             + objective.sentence_structural_weight * sentence_loss)
    return total, {"loss": (total, jnp.ones((), jnp.float32)), "mlm_loss": mlm["loss"],
                   "mlm_accuracy": mlm["accuracy"], "word_structural_loss": word["loss"],
                   "word_structural_accuracy": word["accuracy"],
                   "sentence_structural_loss": sentence["loss"],
                   "sentence_structural_accuracy": sentence["accuracy"]}


def build_structbert(config: EncoderConfig, seed: int) -> Bert:
    return Bert(config, rngs=nnx.Rngs(seed), pair_classes=SENTENCE_CLASSES)


def prepare_structbert(data: DataConfig,
                       examples: structbert_examples.StructBertExampleConfig,
                       cache_dir: Path, seed: int) -> PreparedData:
    """Corpus -> tokenizer -> next / previous / random pairs with static masks and trigram
    shuffles (`dupe_factor` passes) -> ArrayRecord."""
    return prepare_masked_lm(data, examples, cache_dir, seed,
                             structbert_examples.create_training_examples,
                             dynamic_masking=False)


# StructBERT-Base (Wang et al. 2020 §3.1): BERT-Base's network, WordPiece 30k, sequences of
# 512 on English Wikipedia + BookCorpus; Adam lr 1e-4 (b1 0.9, b2 0.999), weight decay 0.01,
# warmup over the first 10% of the steps then linear decay, dropout 0.1, GELU. The paper counts
# training in epochs (40), not in batches and steps: batch 256 and 1M steps are BERT's
# (Devlin et al. 2019 §A.2), with 10% of them as warmup.
PRESETS = {
    "structbert_tiny": {
        "model": {**TINY_TEXT_MODEL, "vocab_size": 0, **NO_DROPOUT},
        "examples": {"max_seq_length": 64, "max_predictions_per_seq": 10, "dupe_factor": 5},
        "data": {"vocab_size": 4000},
        "optim": TINY_TEXT_OPTIM,
        "train": TINY_TEXT_TRAIN,
    },
    "structbert_base": {
        "model": {"vocab_size": 30522},
        "examples": {"max_seq_length": 512, "max_predictions_per_seq": 80},
        "data": {"vocab_size": 30522},
        "optim": {"learning_rate": 1e-4, "warmup_steps": 100000},
        "train": {"steps": 1000000, "batch_size": 256},
    },
}


register(Method(
    name="structbert",
    model_config=EncoderConfig,
    example_config=structbert_examples.StructBertExampleConfig,
    objective_config=StructBertSettings,
    build_model=build_structbert,
    loss=structbert_loss,
    prepare=prepare_structbert,
    units_per_example=lambda examples: examples.max_seq_length,
    description="StructBERT: masked LM + shuffled-trigram reconstruction + next / previous / "
                "random sentence (Wang et al. 2020)",
    presets=PRESETS,
    resolution=Resolution(check=check_max_seq_length),
    evaluation=Evaluation(summarize=summary_of(accuracy="mlm", metrics=(
        "loss", "word_structural_accuracy", "sentence_structural_accuracy"))),
))
