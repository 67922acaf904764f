"""BERT pre-training objective: masked LM + next-sentence prediction (Devlin et al. 2019, §3.1).

Reference: google-research/bert run_pretraining.py (`get_masked_lm_output`,
`get_next_sentence_output`): the MLM loss is over gathered masked positions, weighted,
sum(w * nll) / (sum(w) + 1e-5); NSP is a 2-way softmax on the pooled [CLS] whose loss is the
plain mean over the batch (`tf.reduce_mean`, no epsilon); total = MLM + NSP.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
from flax import nnx

from pretext_jax.input_pipeline.examples import bert as bert_examples
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.models.bert import Bert
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.objectives.common.classifier_recipes import ClassifierSettings, claims_encoders
from pretext_jax.objectives.common.losses import mlm_and_pair_loss
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
    Start,
    declare_default,
    register,
    summary_of,
)


@dataclasses.dataclass(frozen=True)
class BertLossSettings:
    """The `objective` section: the weight of next-sentence prediction."""

    next_sentence_weight: float = 1.0
    """NSP's weight in the loss: 1 is BERT's MLM + NSP (run_pretraining.py adds the two); 0
    trains the MLM alone (NSP's accuracy is still reported), as RoBERTa drops NSP (Liu et al.
    2019 §4.2), e.g. to continue pre-training on a task's one-sentence rows, where every NSP
    pair is a random one (create_pretraining_data.py: a one-segment chunk takes a random B)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.next_sentence_weight < float("inf"):
            raise ValueError(f"next_sentence_weight={self.next_sentence_weight} must be >= 0 "
                             "(1: BERT's loss; 0: MLM only)")


def bert_loss(model: Bert, batch: Batch, rng: jax.Array | None, *,
              objective: BertLossSettings = BertLossSettings()) -> tuple[jax.Array, Metrics]:
    """MLM + NSP (weighted by `objective.next_sentence_weight`) on one batch of `bert_examples`
    features (`losses.mlm_and_pair_loss`); `rng=None` disables dropout."""
    return mlm_and_pair_loss(model, batch, rng, pair_weight=objective.next_sentence_weight)


def build_bert(config: EncoderConfig, seed: int) -> Bert:
    return Bert(config, rngs=nnx.Rngs(seed))


def prepare_bert(
    data: DataConfig, examples: bert_examples.BertExampleConfig, cache_dir: Path, seed: int
) -> PreparedData:
    """Corpus -> tokenizer -> NSP pairs (+ static masks with dupe_factor, or dynamic masking
    while loading) -> ArrayRecord, as create_pretraining_data.py does (and again at the long
    phase's length with `examples.long_phase_fraction`: `masked_lm.prepare_masked_lm`)."""
    return prepare_masked_lm(data, examples, cache_dir, seed,
                             bert_examples.bert_training_examples, examples.dynamic_masking)


PRESETS = {
    # The demo/test size (`preset_parts`: no dropout, bias-corrected Adam).
    "bert_tiny": TINY_MASKED_LM,
    "bert_small": {
        "model": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "intermediate_size": 1024,
                  "vocab_size": 0},
        "examples": {"max_seq_length": 128, "max_predictions_per_seq": 20},
        "data": {"vocab_size": 16000},
        "optim": {"learning_rate": 5e-4, "warmup_steps": 1000},
        "train": {"steps": 20000, "batch_size": 128},
    },
    "bert_base": {"model": {"vocab_size": 30522}, **BERT_RECIPE},
    "bert_large": {
        "model": {"vocab_size": 30522, "hidden_size": 1024, "num_layers": 24, "num_heads": 16,
                  "intermediate_size": 4096},
        **BERT_RECIPE,
    },
}


def glue_settings(hidden_size: int, task: str) -> ClassifierSettings:
    """BERT's GLUE fine-tuning (Devlin et al. 2019, §4.1 and A.3): sequence length 128, batch
    32, 3 epochs, lr 2e-5 (the paper picks from {5, 4, 3, 2}e-5 on dev), warmup over 10% of
    the steps then linear decay, weight decay 0.01. Encoders narrower than BERT-Base (the
    compact BERTs of Turc et al. 2019, MiniLM): 4 epochs at lr 1e-4, from the grid {3e-4,
    1e-4, 5e-5, 3e-5} that the google-research/bert README gives for them (2e-5 barely moves
    a 2-layer, 64-wide model). SQuAD (google-research/bert README, run_squad.py): lr 3e-5,
    batch 24, 2 epochs. Named entities (task `ner`, §5.3 with the A.3 grid: lr {5, 3, 2}e-5,
    batch {16, 32}, {2, 3, 4} epochs): lr 5e-5, batch 32, 3 epochs for BERT-Base and up. The
    compact encoders keep their 1e-4 (and 4 epochs outside SQuAD)."""
    compact = hidden_size < 768
    if task in ("squad", "squad2"):  # google-research/bert README, run_squad.py
        return ClassifierSettings(learning_rate=1e-4 if compact else 3e-5, epochs=2,
                                  weight_decay=0.01, batch_size=24)
    return ClassifierSettings(
        learning_rate=1e-4 if compact else 5e-5 if task == "ner" else 2e-5,
        epochs=4 if compact else 3, weight_decay=0.01)


# The default method: a config that names none (written before `method` was saved) is BERT's.
METHOD = declare_default(register(Method(
    name="bert",
    model_config=EncoderConfig,
    example_config=bert_examples.BertExampleConfig,
    objective_config=BertLossSettings,
    build_model=build_bert,
    loss=bert_loss,
    prepare=prepare_bert,
    units_per_example=lambda examples: examples.max_seq_length,
    description="BERT: masked LM + next-sentence prediction (Devlin et al. 2019)",
    presets=PRESETS,
    resolution=Resolution(check=check_max_seq_length),
    evaluation=Evaluation(summarize=summary_of(accuracy="mlm", metrics=("loss", "nsp_accuracy"))),
    start=Start(hf_models=(Bert,), finetunes=claims_encoders("bert", glue_settings)),
)))
