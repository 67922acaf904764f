"""An objective defined outside pretext: BERT's masked LM with label smoothing and no
next-sentence loss (Szegedy et al. 2016, §7; RoBERTa drops NSP too).

    python run.py --import docs/examples/smoothed_mlm.py pretrain --preset bert_tiny \
        --workdir runs/smoothed method=smoothed_mlm

It reuses BERT's model, example builder and data preparation, and changes only the loss, whose
setting is the `objective` section (`objective.label_smoothing=0.2` on the command line).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from pretext_jax.input_pipeline.examples.bert import BertExampleConfig
from pretext_jax.models.bert import Bert
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.objectives.bert import prepare_bert
from pretext_jax.objectives.common.masked_lm import check_max_seq_length
from pretext_jax.objectives.registry import Batch, Method, Metrics, Resolution, register


@dataclasses.dataclass(frozen=True)
class SmoothedMLMSettings:
    """The `objective` section: what only the loss reads."""

    label_smoothing: float = 0.1
    """Probability mass spread uniformly over the vocabulary, in [0, 1) (Szegedy et al. 0.1)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing={self.label_smoothing} must be in [0, 1)")


def smoothed_mlm_loss(model: Bert, batch: Batch, rng: jax.Array | None, *,
                      objective: SmoothedMLMSettings) -> tuple[jax.Array, Metrics]:
    """Label-smoothed cross-entropy at the masked positions, weighted as BERT's MLM loss."""
    out = model(batch["input_ids"], batch["segment_ids"], batch["input_mask"],
                masked_positions=batch["masked_lm_positions"], rng=rng)
    logits = out.mlm_logits.astype(jnp.float32)
    targets = optax.smooth_labels(jax.nn.one_hot(batch["masked_lm_ids"], logits.shape[-1]),
                                  objective.label_smoothing)
    weights = batch["masked_lm_weights"].astype(jnp.float32)
    per_token = optax.softmax_cross_entropy(logits, targets)
    loss = jnp.sum(weights * per_token) / (jnp.sum(weights) + 1e-5)
    correct = (jnp.argmax(logits, -1) == batch["masked_lm_ids"]).astype(jnp.float32)
    # Metrics are (numerator, denominator) sums, so averages over devices and steps are exact.
    return loss, {"loss": (loss, jnp.ones((), jnp.float32)),
                  "mlm_accuracy": (jnp.sum(weights * correct), jnp.sum(weights))}


register(Method(
    name="smoothed_mlm",
    model_config=EncoderConfig,
    example_config=BertExampleConfig,
    objective_config=SmoothedMLMSettings,
    build_model=lambda config, seed: Bert(config, rngs=nnx.Rngs(seed)),
    loss=smoothed_mlm_loss,
    prepare=prepare_bert,
    units_per_example=lambda examples: examples.max_seq_length,
    description="masked LM with label smoothing, no NSP (docs/examples/smoothed_mlm.py)",
    resolution=Resolution(check=check_max_seq_length),
))
