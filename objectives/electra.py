"""ELECTRA pre-training objective: generator MLM + replaced-token detection (Clark et al. 2020).

Reference: google-research/electra run_pretraining.py (`PretrainingModel.__init__`,
`_get_masked_lm_output`, `_get_fake_data`, `_get_discriminator_output`) and
pretrain/pretrain_helpers.py (`sample_from_softmax`, `scatter_update`, `unmask`):

1. The generator predicts the masked tokens: sum(w * nll) / (sum(w) + 1e-6).
2. At every masked position a token is sampled from the generator by the Gumbel-max trick at
   `temperature` (1.0), under stop_gradient, and written into the *original* sequence (the
   positions kept unmasked are sampled too).
3. A position is "replaced" when it was masked and its sample differs from the original: a
   sample equal to the original counts as real.
4. The discriminator classifies every non-pad token (sigmoid cross-entropy, mean over non-pad
   tokens with epsilon 1e-6). Total = generator_weight (1) x MLM + discriminator_weight (50)
   x RTD. Gradients reach the shared embeddings from both terms.

The weights and the temperature are the `objective` section (`ElectraLossSettings`).

Masked positions are drawn without replacement on the host (`DynamicMasking`); the reference
draws them with `tf.random.categorical`, i.e. with replacement, so a duplicate there masks one
position fewer than intended.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from pretext_jax.input_pipeline.examples import electra as electra_examples
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.models.electra import (
    Electra,
    ElectraConfig,
    ElectraDiscriminator,
    ElectraGenerator,
)
from pretext_jax.models.layers import split_rng
from pretext_jax.objectives.common.classifier_recipes import ClassifierSettings, claims_encoders
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
    Start,
    register,
    summary_of,
)

# Held-out evaluation has no step rng; the generator's samples then come from this fixed key.
EVAL_SAMPLING_SEED = 0


@dataclasses.dataclass(frozen=True)
class ElectraLossSettings:
    """The objective's weights and sampling temperature (configure_pretraining.py: gen_weight
    1.0, disc_weight 50.0, temperature 1.0)."""

    generator_weight: float = 1.0
    """Weight of the generator's masked-LM loss in the total (ELECTRA `gen_weight` 1.0)."""
    discriminator_weight: float = 50.0
    """Weight of the replaced-token-detection loss (ELECTRA `disc_weight` 50.0)."""
    temperature: float = 1.0
    """Temperature of the generator's Gumbel-max sampling of replacements, > 0 (ELECTRA 1.0)."""

    def __post_init__(self) -> None:
        if self.temperature <= 0.0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (ELECTRA samples at "
                             "1.0)")


def gumbel_noise(rng: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """-log(-log(u + 1e-9) + 1e-9), u ~ U[0, 1) (pretrain_helpers.py `sample_from_softmax`)."""
    uniform = jax.random.uniform(rng, shape, jnp.float32)
    return -jnp.log(-jnp.log(uniform + 1e-9) + 1e-9)


def sample_tokens(logits: jax.Array, temperature: float, noise: jax.Array) -> jax.Array:
    """Gumbel-max sample of logits / temperature, with no gradient."""
    scaled = jax.lax.stop_gradient(logits.astype(jnp.float32)) / temperature
    return jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)


def scatter_positions(ids: jax.Array, positions: jax.Array, values: jax.Array,
                      weights: jax.Array) -> jax.Array:
    """`ids` [B, T] with `values` [B, P] written at `positions` [B, P] where `weights` > 0
    (padding predictions, whose position is 0, leave the sequence alone)."""
    seq_len = ids.shape[1]
    target = jnp.where(weights > 0, positions, seq_len)  # out of range -> dropped
    rows = jnp.arange(ids.shape[0])[:, None]
    return ids.at[rows, target].set(values.astype(ids.dtype), mode="drop")


def replaced_token_batch(batch: Batch, sampled: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(corrupted ids, replaced labels): the original sequence (masked positions restored) with
    the samples written in; a position is replaced only if its sample differs from the
    original (run_pretraining.py `_get_fake_data`)."""
    positions, weights = batch["masked_lm_positions"], batch["masked_lm_weights"]
    original = scatter_positions(batch["input_ids"], positions, batch["masked_lm_ids"], weights)
    corrupted = scatter_positions(original, positions, sampled, weights)
    return corrupted, (corrupted != original).astype(jnp.int32)


def replaced_token_detection_loss(
    logits: jax.Array, labels: jax.Array, input_mask: jax.Array
) -> tuple[jax.Array, Metrics]:
    """Mean sigmoid cross-entropy over non-pad tokens, and the discriminator's metrics."""
    logits = logits.astype(jnp.float32)
    weights = input_mask.astype(jnp.float32)
    labels_f = labels.astype(jnp.float32)
    losses = optax.sigmoid_binary_cross_entropy(logits, labels_f) * weights
    total_weight = jnp.sum(weights)
    loss = jnp.sum(losses) / (total_weight + 1e-6)
    predicted = (logits > 0).astype(jnp.float32) * weights
    actual = labels_f * weights
    true_positive = jnp.sum(predicted * actual)
    correct = jnp.sum(weights * (predicted == actual))
    return loss, {
        "loss": (jnp.sum(losses), total_weight),
        "accuracy": (correct, total_weight),
        "precision": (true_positive, jnp.sum(predicted)),
        "recall": (true_positive, jnp.sum(actual)),
        "replaced_fraction": (jnp.sum(actual), total_weight),
    }


def electra_loss(
    model: Electra, batch: Batch, rng: jax.Array | None, noise: jax.Array | None = None, *,
    objective: ElectraLossSettings | None = None,
) -> tuple[jax.Array, Metrics]:
    """`generator_weight` x generator MLM + `discriminator_weight` x RTD on a batch of masked
    ELECTRA features; `objective` None is ELECTRA's settings.

    `rng=None` (evaluation) disables dropout and samples with a fixed key. `noise` [B, P, V]
    replaces the Gumbel noise (tests use it to check the loss by hand).
    """
    objective = objective or ElectraLossSettings()
    generator_rng, discriminator_rng, sample_rng = split_rng(rng, 3)
    inputs = (batch["segment_ids"], batch["input_mask"])
    generated = model.generator(batch["input_ids"], *inputs,
                                masked_positions=batch["masked_lm_positions"], rng=generator_rng)
    mlm_loss, mlm = weighted_cross_entropy(generated.mlm_logits, batch["masked_lm_ids"],
                                           batch["masked_lm_weights"], epsilon=1e-6)
    if noise is None:
        key = sample_rng if sample_rng is not None else jax.random.key(EVAL_SAMPLING_SEED)
        noise = gumbel_noise(key, generated.mlm_logits.shape)
    sampled = sample_tokens(generated.mlm_logits, objective.temperature, noise)
    corrupted, replaced = replaced_token_batch(batch, sampled)
    discriminated = model.discriminator(corrupted, *inputs, rng=discriminator_rng)
    rtd_loss, rtd = replaced_token_detection_loss(discriminated.rtd_logits, replaced,
                                                  batch["input_mask"])
    total = objective.generator_weight * mlm_loss + objective.discriminator_weight * rtd_loss
    one = jnp.ones((), jnp.float32)
    return total, {
        "loss": (total, one),
        "mlm_loss": mlm["loss"],
        "mlm_accuracy": mlm["accuracy"],
        "rtd_loss": rtd["loss"],
        "rtd_accuracy": rtd["accuracy"],
        "rtd_precision": rtd["precision"],
        "rtd_recall": rtd["recall"],
        "replaced_fraction": rtd["replaced_fraction"],
    }


def build_electra(config: ElectraConfig, seed: int) -> Electra:
    return Electra(config, rngs=nnx.Rngs(seed))


def prepare_electra(
    data: DataConfig, examples: electra_examples.ElectraExampleConfig, cache_dir: Path, seed: int
) -> PreparedData:
    """Corpus -> tokenizer -> packed one/two-segment examples -> ArrayRecord; masked while
    loading (build_pretraining_dataset.py, then the in-graph masking of run_pretraining.py)."""
    return prepare_masked_lm(data, examples, cache_dir, seed,
                             electra_examples.create_training_examples, dynamic_masking=True)


# ELECTRA (configure_pretraining.py): a generator of 1/4 (Small) or 1/3 (Base) of the
# discriminator's hidden size, embeddings shared; AdamWeightDecay, warmup 10k, linear decay
# multiplied by the warmup ramp (optimization.py, `electra_linear`).
PRESETS = {
    "electra_tiny": {
        "model": {**TINY_TEXT_MODEL, "embedding_size": 32, "vocab_size": 0, **NO_DROPOUT},
        "examples": {"max_seq_length": 64, "max_predictions_per_seq": 9},
        "data": {"vocab_size": 4000},
        "optim": {**TINY_TEXT_OPTIM, "schedule": "electra_linear"},
        "train": TINY_TEXT_TRAIN,
    },
    "electra_small": {
        "model": {"hidden_size": 256, "embedding_size": 128, "num_layers": 12, "num_heads": 4,
                  "intermediate_size": 1024, "generator_hidden_size": 0.25, "vocab_size": 0},
        "examples": {"max_seq_length": 128, "max_predictions_per_seq": 19},
        "data": {"vocab_size": 30522},
        "optim": {"learning_rate": 5e-4, "schedule": "electra_linear", "warmup_steps": 10000},
        "train": {"steps": 1000000, "batch_size": 128},
    },
    "electra_base": {
        "model": {"hidden_size": 768, "embedding_size": 768, "num_layers": 12, "num_heads": 12,
                  "intermediate_size": 3072, "generator_hidden_size": 1 / 3, "vocab_size": 0},
        "examples": {"max_seq_length": 512, "max_predictions_per_seq": 79},
        "data": {"vocab_size": 30522},
        "optim": {"learning_rate": 2e-4, "schedule": "electra_linear", "warmup_steps": 10000},
        "train": {"steps": 766000, "batch_size": 256},
    },
}



def glue_settings(hidden_size: int, task: str) -> ClassifierSettings:
    """ELECTRA's GLUE fine-tuning (Clark et al. 2020, Table 7): batch 32, lr 3e-4 (Small) /
    1e-4 (Base) / 5e-5 (Large), layer-wise lr decay 0.8 (0.9 Large), warmup 10%, no weight
    decay, 3 epochs, 10 for RTE and STS-B; the schedule is ELECTRA's own
    (`optim.schedule=electra_linear`: the linear decay over the run multiplied by the warmup
    ramp, model/optimization.py, which its run_finetuning.py uses), not BERT's. SQuAD
    (configure_finetuning.py): the same rates and decay, 2 epochs, windows of 512, ELECTRA's
    joint head with its answerability classifier (`model.span_head=joint`, finetune/qa/
    qa_tasks.py) and a beam of 20 (`beam_size`)."""
    learning_rate = 3e-4 if hidden_size <= 256 else 1e-4 if hidden_size <= 768 else 5e-5
    squad = task in ("squad", "squad2")
    return ClassifierSettings(
        learning_rate=learning_rate, epochs=2 if squad else 10 if task in ("rte", "stsb") else 3,
        weight_decay=0.0, layerwise_lr_decay=0.8 if hidden_size <= 768 else 0.9,
        schedule="electra_linear", max_seq_length=512 if squad else 0,
        span_head="joint" if squad else "", beam_size=20 if squad else 0)


register(Method(
    name="electra",
    model_config=ElectraConfig,
    example_config=electra_examples.ElectraExampleConfig,
    objective_config=ElectraLossSettings,
    build_model=build_electra,
    loss=electra_loss,
    prepare=prepare_electra,
    units_per_example=lambda examples: examples.max_seq_length,
    description="ELECTRA: generator MLM + replaced-token detection (Clark et al. 2020)",
    presets=PRESETS,
    resolution=Resolution(check=check_max_seq_length),
    evaluation=Evaluation(summarize=summary_of(accuracy="mlm", metrics=("loss", "rtd_accuracy"))),
    start=Start(hf_models=(Electra, ElectraDiscriminator, ElectraGenerator),
                hf_parts=("discriminator", "generator"),
                finetunes=claims_encoders("electra", glue_settings)),
))
