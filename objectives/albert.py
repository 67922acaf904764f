"""ALBERT pre-training objective: masked LM + sentence-order prediction (Lan et al. 2020, §4.1).

Reference: google-research/albert run_pretraining.py (`get_masked_lm_output`,
`get_sentence_order_output`): the MLM loss over gathered n-gram-masked positions,
sum(w * nll) / (sum(w) + 1e-5); SOP is a 2-way softmax on the pooled first token (label 0 =
original order, 1 = swapped) with the plain mean over the batch as its loss
(`tf.reduce_mean`); total = MLM + SOP.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.input_pipeline.examples import albert as albert_examples
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.models.albert import Albert, AlbertConfig
from pretext_jax.objectives.common.classifier_recipes import ClassifierSettings, claims_encoders
from pretext_jax.objectives.common.losses import weighted_cross_entropy
from pretext_jax.objectives.common.masked_lm import check_max_seq_length, prepare_masked_lm
from pretext_jax.objectives.common.preset_parts import (
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


def albert_loss(model: Albert, batch: Batch, rng: jax.Array | None
                ) -> tuple[jax.Array, Metrics]:
    """MLM + SOP on one batch of `albert_examples` features; `rng=None` disables dropout. The
    records keep the reference's feature name `next_sentence_labels` for the SOP label."""
    out = model(batch["input_ids"], batch["segment_ids"], batch["input_mask"],
                masked_positions=batch["masked_lm_positions"], rng=rng)
    mlm_loss, mlm = weighted_cross_entropy(out.mlm_logits, batch["masked_lm_ids"],
                                           batch["masked_lm_weights"])
    labels = batch["next_sentence_labels"]
    sop_loss, sop = weighted_cross_entropy(out.sop_logits, labels, jnp.ones(labels.shape),
                                           epsilon=0.0)  # tf.reduce_mean(per_example_loss)
    total = mlm_loss + sop_loss
    return total, {"loss": (total, jnp.ones((), jnp.float32)), "mlm_loss": mlm["loss"],
                   "mlm_accuracy": mlm["accuracy"], "sop_loss": sop["loss"],
                   "sop_accuracy": sop["accuracy"]}


def build_albert(config: AlbertConfig, seed: int) -> Albert:
    return Albert(config, rngs=nnx.Rngs(seed))


def prepare_albert(data: DataConfig, examples: albert_examples.AlbertExampleConfig,
                   cache_dir: Path, seed: int) -> PreparedData:
    """Corpus -> tokenizer -> sentence-order pairs with static n-gram masks (`dupe_factor`
    passes) -> ArrayRecord, as albert's create_pretraining_data.py."""
    return prepare_masked_lm(data, examples, cache_dir, seed,
                             albert_examples.create_training_examples, dynamic_masking=False)


# ALBERT (Lan et al. 2020 §4.1; google-research/albert README's run_pretraining command):
# E = 128, H = 768, 12 shared layers, gelu_new, no dropout (v2), seq 512 (10% shorter),
# 20 predictions with n-gram masking (n <= 3), SOP; LAMB lr 0.00176, batch 4096, 125k
# steps, 3125 warmup steps then linear decay, weight decay 0.01; sentencepiece 30k.
PRESETS = {
    "albert_tiny": {
        "model": {**TINY_TEXT_MODEL, "embedding_size": 32, "vocab_size": 0},
        "examples": {"max_seq_length": 64, "max_predictions_per_seq": 10, "dupe_factor": 5},
        "data": {"vocab_size": 4000},
        "optim": TINY_TEXT_OPTIM,
        "train": TINY_TEXT_TRAIN,
    },
    "albert_base": {
        "model": {"vocab_size": 0, "embedding_size": 128, "hidden_size": 768, "num_layers": 12,
                  "num_heads": 12, "intermediate_size": 3072},
        "examples": {"max_seq_length": 512, "max_predictions_per_seq": 20},
        "data": {"vocab_size": 30000},
        "optim": {"optimizer": "lamb", "learning_rate": 0.00176, "warmup_steps": 3125,
                  "weight_decay": 0.01, "eps": 1e-6},
        "train": {"steps": 125000, "batch_size": 4096},
    },
}


# google-research/albert run_glue.sh, per task: lr, batch, epochs (train_step x batch over the
# task's training rows) and warmup (warmup_step / train_step).
ALBERT_GLUE = {
    "sst2": (1e-5, 32, 10, 0.06),  # 20,935 steps x 32 / 67,349 rows; 1,256 warmup steps
    "cola": (1e-5, 16, 10, 0.06),  # 5,336 x 16 / 8,551; 320
    "stsb": (2e-5, 16, 10, 0.06),  # 3,598 x 16 / 5,749; 214
    "rte": (3e-5, 32, 10, 0.25),  # 800 x 32 / 2,490 = 10.3; 200
    "mrpc": (2e-5, 32, 7, 0.25),  # 800 x 32 / 3,668 = 7.0; 200
}


def glue_settings(hidden_size: int, task: str) -> ClassifierSettings:
    """ALBERT's fine-tuning, as google-research/albert runs it: run_classifier.py with
    run_glue.sh's per-task flags (`ALBERT_GLUE`; other tasks, named entities, take SST-2's),
    `optimizer=adamw` (optimization.py: weight decay 0.01 not on LayerNorm or biases, eps 1e-6,
    clipping at 1.0, warmup then linear decay over the run), and classifier_utils.py's 0.1
    dropout before the output layer whatever the config's (v2: 0). SQuAD v1.1 and v2.0 (the
    README's run_squad_v1.py / run_squad_v2.py commands): lr 5e-5, batch 48, 2 epochs, warmup
    10 %, windows of 384; v2.0 with run_squad_v2.py's head, the beam head with its answer
    class (`model.span_head=beam`, squad_utils.py `create_v2_model`; start_n_top = end_n_top
    = 5 and `dropout_prob` 0.1 before the answer class's output, run_squad_v2.py's flags).
    The same for every size."""
    del hidden_size
    if task == "squad2":
        return ClassifierSettings(learning_rate=5e-5, epochs=2, weight_decay=0.01,
                                  batch_size=48, span_head="beam", classifier_dropout=0.1)
    if task == "squad":
        return ClassifierSettings(learning_rate=5e-5, epochs=2, weight_decay=0.01,
                                  batch_size=48)
    learning_rate, batch_size, epochs, warmup = ALBERT_GLUE.get(task, ALBERT_GLUE["sst2"])
    return ClassifierSettings(learning_rate=learning_rate, epochs=epochs, weight_decay=0.01,
                              batch_size=batch_size, warmup=warmup, classifier_dropout=0.1)


register(Method(
    name="albert",
    model_config=AlbertConfig,
    example_config=albert_examples.AlbertExampleConfig,
    build_model=build_albert,
    loss=albert_loss,
    prepare=prepare_albert,
    units_per_example=lambda examples: examples.max_seq_length,
    description="ALBERT: factorised embeddings, shared layers, n-gram MLM + sentence-order "
                "prediction (Lan et al. 2020)",
    presets=PRESETS,
    resolution=Resolution(check=check_max_seq_length),
    evaluation=Evaluation(summarize=summary_of(accuracy="mlm", metrics=("loss", "sop_accuracy"))),
    start=Start(hf_models=(Albert,), finetunes=claims_encoders("albert", glue_settings)),
))
