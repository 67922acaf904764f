"""ERNIE 1.0 pre-training (Sun et al. 2019, §3.1-3.3): BERT's network and loss (masked LM +
next-sentence prediction, `text.mlm_and_pair_loss`) on knowledge-masked examples
(`input_pipeline.examples.ernie`: basic, phrase or entity units masked whole, from inline
[[ENT:...]] / [[PHR:...]] annotations or the built-in phrase chunker). The model is
`models.bert.Ernie`, which converts to HF `ErnieForPreTraining`; `model.task_type_vocab_size`
adds ERNIE 2.0's task-type embeddings (task 0 in pre-training) for HF checkpoints that have them.
"""

from __future__ import annotations

from pathlib import Path

import jax
from flax import nnx

from pretext_jax.input_pipeline.examples import ernie as ernie_examples
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.models.bert import Ernie
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.objectives.common.losses import mlm_and_pair_loss
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


def ernie_loss(model: Ernie, batch: Batch, rng: jax.Array | None) -> tuple[jax.Array, Metrics]:
    """MLM + NSP (BERT's) on one batch of knowledge-masked features."""
    return mlm_and_pair_loss(model, batch, rng)


def build_ernie(config: EncoderConfig, seed: int) -> Ernie:
    return Ernie(config, rngs=nnx.Rngs(seed))


def prepare_ernie(data: DataConfig, examples: ernie_examples.ErnieExampleConfig,
                  cache_dir: Path, seed: int) -> PreparedData:
    """Corpus (with its inline spans) -> tokenizer -> NSP pairs with static unit masks
    (`dupe_factor` passes) -> ArrayRecord."""
    return prepare_masked_lm(data, examples, cache_dir, seed,
                             ernie_examples.create_training_examples, dynamic_masking=False,
                             markup=ernie_examples.ErnieMarkup(examples.phrases == "chunker"))


# ERNIE 1.0 (Sun et al. 2019 §3.1, §4.1): BERT-Base's size (12 layers, 768 hidden, 12 heads),
# trained on Chinese Wikipedia and Baidu Baike / News / Tieba. The paper gives no optimiser
# settings; `ernie_base` takes them from the released code (PaddlePaddle/ERNIE, ERNIE 1.0:
# config/ernie_config.json, script/zh_task/pretrain.sh, ernie/pretrain_args.py,
# optimization.py): ReLU feed-forward, 18,000-entry vocabulary, 513 positions, Paddle's
# LayerNorm epsilon 1e-5; lr 1e-4, linear warmup over 5,000 steps then linear decay to 0 at
# 1M steps, weight decay 0.01 (not on LayerNorm or biases), global-norm clipping at 1;
# fluid.optimizer.Adam's defaults (betas 0.9 / 0.999, eps 1e-8, bias-corrected, eps added to
# sqrt(v) before the correction as Paddle 1.x's kernel did); length 512 and `--in_tokens
# --batch_size 8192` (tokens per card) on 8 cards, ~65,536 tokens = 128 sequences of 512 per
# step. The stages run in sequence in the paper (the code has no stage schedule); the preset's
# stage is the last one, entity-level.
PRESETS = {
    "ernie_tiny": {
        "model": {**TINY_TEXT_MODEL, "vocab_size": 0, **NO_DROPOUT},
        "examples": {"max_seq_length": 64, "max_predictions_per_seq": 10, "dupe_factor": 5},
        "data": {"vocab_size": 4000},
        "optim": TINY_TEXT_OPTIM,
        "train": TINY_TEXT_TRAIN,
    },
    "ernie_base": {
        "model": {"vocab_size": 0, "hidden_act": "relu", "layer_norm_eps": 1e-5,
                  "max_position_embeddings": 513},
        "examples": {"max_seq_length": 512, "max_predictions_per_seq": 160, "masking": "entity",
                     "unit_selection": "bernoulli"},
        "data": {"vocab_size": 18000},
        "optim": {"learning_rate": 1e-4, "warmup_steps": 5000, "eps": 1e-8,
                  "bias_correction": True, "eps_before_bias_correction": True},
        "train": {"steps": 1000000, "batch_size": 128},
    },
}


register(Method(
    name="ernie",
    model_config=EncoderConfig,
    example_config=ernie_examples.ErnieExampleConfig,
    build_model=build_ernie,
    loss=ernie_loss,
    prepare=prepare_ernie,
    units_per_example=lambda examples: examples.max_seq_length,
    description="ERNIE 1.0: BERT with knowledge masking of whole phrases and entities "
                "(Sun et al. 2019)",
    presets=PRESETS,
    resolution=Resolution(check=check_max_seq_length),
    evaluation=Evaluation(summarize=summary_of(accuracy="mlm", metrics=("loss", "nsp_accuracy"))),
    start=Start(hf_models=(Ernie,)),
))
