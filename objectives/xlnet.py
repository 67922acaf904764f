"""XLNet pre-training objective: permutation language modelling with partial prediction
(Yang et al. 2019 §2.2-2.3).

Reference: zihangdai/xlnet train_gpu.py / function_builder.py (`two_stream_loss`) and
data_utils.py (`_local_perm`). The loss is the cross-entropy of the query stream's logits at
the `num_predict` target slots, sum(w * nll) / sum(w). During training the recurrence memory
(`XLNet.memory`, [L, B, mem_len, H]) is read before and written after every step, so row b of
a batch attends to what row b saw at the previous step (the records are laid out for that);
evaluation runs without memory.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import xlnet as xlnet_examples
from pretext_jax.input_pipeline.examples.bert import MaskingVocab, build_with_vocab
from pretext_jax.input_pipeline.prepare import DataConfig, prepare_text
from pretext_jax.models.xlnet import XLNet, XLNetConfig
from pretext_jax.objectives.common.classifier_recipes import ClassifierSettings, claims_encoders
from pretext_jax.objectives.common.held_out import MAX_EVAL_EXAMPLES, mask_records
from pretext_jax.objectives.common.losses import weighted_cross_entropy
from pretext_jax.objectives.common.masked_lm import unigram_baselines
from pretext_jax.objectives.common.preset_parts import NO_DROPOUT, TINY_TEXT_OPTIM, TINY_TEXT_TRAIN
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
    whole_run,
)


def permutation_mask(rank: jax.Array, is_target: jax.Array, hidden: jax.Array,
                     reuse_len: int) -> jax.Array:
    """[B, T, T] float, 1 = i may not attend j (data_utils.py `_local_perm` + `parser`): within
    a half, j is hidden from i when j is subject to the order (`hidden`) and does not come
    strictly before i (targets also not seeing themselves); the reuse half sees nothing of the
    new half, the new half sees all of the reuse half."""
    self_rank = jnp.where(is_target.astype(bool), rank, rank + 1)
    within = (self_rank[:, :, None] <= rank[:, None, :]) & hidden.astype(bool)[:, None, :]
    half = jnp.arange(rank.shape[1]) >= reuse_len
    same_half = half[:, None] == half[None, :]
    return jnp.where(same_half[None], within, (half[:, None] < half[None, :])[None]).astype(
        jnp.float32)


def xlnet_loss(model: XLNet, batch: Batch, rng: jax.Array | None) -> tuple[jax.Array, Metrics]:
    """Permutation-LM loss on a batch of `PermutationSampling` features; `rng=None` is
    evaluation (no dropout, no memory)."""
    perm_mask = permutation_mask(batch["perm_rank"], batch["perm_target"],
                                 batch["perm_hidden"], model.config.reuse_len)
    weights = batch["target_weights"]
    carry = rng is not None and hasattr(model, "memory")
    out = model(batch["input_ids"], batch["segment_ids"], perm_mask=perm_mask,
                target_positions=batch["target_positions"],
                mems=model.memory[...] if carry else None,
                use_mems=carry, rng=rng)
    if carry:
        model.memory[...] = out.new_mems
    loss, plm = weighted_cross_entropy(out.lm_logits, batch["target_ids"], weights,
                                       epsilon=1e-6)
    one = jnp.ones((), jnp.float32)
    return loss, {"loss": (loss, one), "plm_loss": plm["loss"], "plm_accuracy": plm["accuracy"],
                  "targets_per_example": (jnp.sum(weights), jnp.float32(weights.shape[0]))}


def build_xlnet(config: XLNetConfig, seed: int) -> XLNet:
    return XLNet(config, rngs=nnx.Rngs(seed))


def prepare_xlnet(data: DataConfig, examples: xlnet_examples.XLNetExampleConfig,
                  cache_dir: Path, seed: int) -> PreparedData:
    """Corpus -> tokenizer -> parallel streams -> [reuse | A | SEP | B | SEP | CLS] records with
    span targets, stored in batch order; factorisation orders drawn while loading. The held-out
    records have the same layout (so bi_data halves line up in evaluation batches) and get one
    fixed draw of orders."""

    build = functools.partial(build_with_vocab, xlnet_examples.create_training_examples,
                              examples)
    train, held_out, tokenizer = prepare_text(data, build, examples, cache_dir, seed,
                                              ordered=True)
    sampling = xlnet_examples.PermutationSampling(MaskingVocab.from_tokenizer(tokenizer),
                                                  examples)
    count = min(len(held_out), MAX_EVAL_EXAMPLES) // examples.num_streams * examples.num_streams
    eval_examples = mask_records(held_out.examples(range(count)), sampling, seed + 2)
    return PreparedData(
        train=train, eval=eval_examples, transforms=(sampling,),
        model_fields={"vocab_size": tokenizer.vocab_size,
                      "memory_batch_size": examples.num_streams},
        report=unigram_baselines(eval_examples),
        segments=whole_run(train, shuffle=False, check=functools.partial(
            check_stream_layout, streams=examples.num_streams)),
        tokenizer=tokenizer)


def check_stream_layout(config: Any, streams: int) -> None:
    """Records laid out as consecutive batches of `streams` rows (row b of a batch continues
    row b of the previous one, which the recurrence memory needs) fix the batch: the global
    batch must be that layout's, one micro-batch, one process (rows are not split across
    processes in that layout)."""
    if config.train.batch_size != streams:
        raise UserError(f"train.batch_size={config.train.batch_size} must equal the records' "
                        f"batch layout ({streams} streams); set both to the same value")
    if config.optim.grad_accum_steps != 1 or jax.process_count() != 1:
        raise UserError("records laid out for recurrence memory need optim.grad_accum_steps"
                        "=1 and a single process; use a smaller batch or more devices")


def check_xlnet(model: XLNetConfig, examples: xlnet_examples.XLNetExampleConfig,
                objective: Any = None) -> None:
    """The memory's reuse length and bidirectional data agree between model and examples (no
    `objective` setting bears on it)."""
    if model.reuse_len != examples.reuse_len:
        raise UserError(f"model.reuse_len={model.reuse_len} differs from examples.reuse_len="
                        f"{examples.reuse_len}; the memory caches the reused part, so set both "
                        "to the same value")
    if model.bi_data != examples.bi_data:
        raise UserError(f"model.bi_data={model.bi_data} differs from examples.bi_data="
                        f"{examples.bi_data}; set both")


# XLNet (Yang et al. 2019, Table 7; train_gpu.py / data_utils.py): seq 512 of which 256 are
# reused, memory 384, 85 targets (K = 6), bi_data, AdamWeightDecay (weight decay 0.01, eps
# 1e-6; model_utils.py's, which also decays the r_w/r_r/r_s biases), warmup, then
# model_utils.py `get_train_op`'s poly decay from the peak at the end of warmup to lr x
# min_lr_ratio (0.001).
PRESETS = {
    "xlnet_tiny": {
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 256,
                  "vocab_size": 0, "mem_len": 48, "reuse_len": 32, **NO_DROPOUT},
        "examples": {"max_seq_length": 64, "reuse_len": 32, "perm_size": 32, "num_predict": 11,
                     "num_streams": 32},
        "data": {"vocab_size": 4000},
        "optim": TINY_TEXT_OPTIM,
        "train": {**TINY_TEXT_TRAIN, "batch_size": 32},
    },
    "xlnet_base": {
        "model": {"hidden_size": 768, "num_layers": 12, "num_heads": 12,
                  "intermediate_size": 3072, "vocab_size": 0, "mem_len": 384, "reuse_len": 256,
                  "bi_data": True},
        "examples": {"max_seq_length": 512, "reuse_len": 256, "perm_size": 256,
                     "num_predict": 85, "num_streams": 256, "bi_data": True},
        "data": {"vocab_size": 32000},
        "optim": {"learning_rate": 4e-4, "warmup_steps": 40000, "schedule": "linear_from_peak",
                  "end_learning_rate": 4e-7},
        "train": {"steps": 500000, "batch_size": 256},
    },
}



def glue_settings(hidden_size: int, task: str) -> ClassifierSettings:
    """XLNet's GLUE fine-tuning (Yang et al. 2019, Appendix A.3, Table 8, whose GLUE column is
    MNLI): sequence length 128, lr 2e-5 with linear decay, no weight decay, Adam epsilon 1e-6
    (run_classifier.py's flag default is 1e-8), layer-wise lr decay 1.0; Table 8's batch 128
    for 10K steps is ~3 epochs of MNLI, so 3 epochs here, at batch 32 as the zihangdai/xlnet
    README's STS-B run (4 GPUs x 8; it uses lr 5e-5 for XLNet-Large), with warmup over 10% of
    the steps as there (120 of 1200 steps). Adam with bias correction and gradient clipping
    at 1.0 (run_classifier.py: `clip`, and `tf.train.AdamOptimizer` when weight_decay is 0,
    whose epsilon is added before the bias correction); model_utils.py `get_train_op` decays
    linearly from the peak at the end of warmup (`optim.schedule=linear_from_peak`).

    SQuAD (`squad`, `squad2`; zihangdai/xlnet run_squad.py with scripts/tpu_squad_large.sh for
    XLNet-Large, hidden 1024: lr 3e-5, batch 48, 8000 steps with 1000 of warmup; with
    scripts/gpu_squad_base.sh for XLNet-Base: lr 2e-5, 3 GPUs x 8, 12000 steps with 1000 of
    warmup): sequence length 512, the same optimiser. The steps become epochs over SQuAD
    2.0's ~131K windows: 8000 x 48 ~ 3, 12000 x 24 ~ 2; run_squad.py's head, the beam head
    with its answer class (`model.span_head=beam`). run_squad.py's `lr_layer_decay_rate`
    0.75 is not applied (its rule, top layer undecayed and embeddings untouched, is not
    ELECTRA's that `optim.layerwise_lr_decay` implements)."""
    if task in ("squad", "squad2"):
        large = hidden_size >= 1024
        return ClassifierSettings(
            learning_rate=3e-5 if large else 2e-5, epochs=3 if large else 2, weight_decay=0.0,
            schedule="linear_from_peak", eps_before_bias_correction=True,
            batch_size=48 if large else 24, warmup=1000 / (8000 if large else 12000),
            max_seq_length=512, span_head="beam")
    return ClassifierSettings(learning_rate=2e-5, epochs=3, weight_decay=0.0,
                              schedule="linear_from_peak", eps_before_bias_correction=True)


register(Method(
    name="xlnet",
    model_config=XLNetConfig,
    example_config=xlnet_examples.XLNetExampleConfig,
    build_model=build_xlnet,
    loss=xlnet_loss,
    prepare=prepare_xlnet,
    units_per_example=lambda examples: examples.max_seq_length,
    description="XLNet: permutation LM with two-stream attention and memory (Yang et al. 2019)",
    presets=PRESETS,
    resolution=Resolution(check=check_xlnet),
    evaluation=Evaluation(summarize=summary_of(accuracy="plm")),
    start=Start(hf_models=(XLNet,), finetunes=claims_encoders("xlnet", glue_settings)),
))
