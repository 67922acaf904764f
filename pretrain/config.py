"""Run configuration: presets per method and size, `section.key=value` overrides, validation.

A config has generic sections (`data`, `optim`, `mesh`, `train`) and two method-owned sections,
`model` and `examples`, validated against the dataclasses the method registers. The resolved
config is written to the workdir and into every checkpoint.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import math
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.objectives import registry


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh axis sizes; -1 fills with the remaining devices (one axis at most)."""

    data: int = -1
    """Devices on the data-parallel axis (-1 = the devices the other axes leave)."""
    fsdp: int = 1
    """Devices over which parameters and optimizer state are sharded (ZeRO-3 style)."""
    tensor: int = 1
    """Devices over which large matrices are split (Megatron-style tensor parallelism)."""


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimizer and schedule. Defaults are BERT's AdamWeightDecay (optimization.py): lr 1e-4,
    wd 0.01 (not on LayerNorm or biases), b1 0.9, b2 0.999, eps 1e-6, no bias correction,
    global-norm clip 1.0, linear warmup then linear decay to 0. `optimizer` is adamw, lamb,
    lars (SimCLR, BYOL: `momentum` 0.9, `trust_coefficient` 0.001, neither decay nor adaptation
    on normalisation parameters and biases), sgd (MoCo: torch's SGD with `momentum`, decay on
    every parameter) or adafactor (T5; `pretrain.optim.adafactor`). `schedule` is linear
    (BERT: lr * step / warmup during warmup, then lr * (1 - step / steps)), electra_linear
    (ELECTRA's optimization.py: lr * (1 - step / steps) * min(1, step / warmup), the ramp
    multiplying the decayed value), cosine, constant or inverse_sqrt (T5: lr * sqrt(warmup /
    max(step, warmup))), linear_from_peak (fairseq's polynomial_decay, XLNet's poly decay:
    lr * step / warmup, then linear from lr at the end of warmup to end_learning_rate at
    `steps`); `end_learning_rate` is where linear, electra_linear, linear_from_peak and cosine
    end. `eps_before_bias_correction` (with `bias_correction`): Adam's eps added to sqrt(v)
    before the bias correction, as fairseq's Adam and tf.train.AdamOptimizer do.
    `decay_norms_and_biases` (adamw, lamb): weight decay on every parameter, as fairseq's
    Adam, instead of skipping LayerNorm and biases. `layerwise_lr_decay` < 1 scales each
    Transformer layer's learning rate by decay^(depth from the top) (ELECTRA fine-tuning:
    0.8)."""

    optimizer: str = "adamw"
    """adamw, lamb, lars (SimCLR, BYOL), sgd (MoCo) or adafactor (T5)."""
    learning_rate: float = 1e-4
    """Peak learning rate (BERT 1e-4)."""
    schedule: str = "linear"
    """linear, electra_linear, linear_from_peak, cosine, constant or inverse_sqrt."""
    warmup_steps: int = 10000
    """Steps of the linear warmup (BERT 10,000)."""
    end_learning_rate: float = 0.0
    """Where linear, electra_linear, linear_from_peak and cosine end."""
    weight_decay: float = 0.01
    """Decoupled weight decay (BERT 0.01; not on LayerNorm or biases by default)."""
    b1: float = 0.9
    """Adam/LAMB first-moment decay."""
    b2: float = 0.999
    """Adam/LAMB second-moment decay (RoBERTa 0.98)."""
    eps: float = 1e-6
    """Adam/LAMB epsilon (BERT 1e-6)."""
    bias_correction: bool = False
    """Adam's bias correction (BERT's AdamWeightDecay has none; torch's AdamW has it)."""
    eps_before_bias_correction: bool = False
    """Add eps to sqrt(v) before the bias correction (fairseq, tf.train.AdamOptimizer)."""
    decay_norms_and_biases: bool = False
    """Weight decay on every parameter, as fairseq's Adam (adamw, lamb)."""
    clip_norm: float = 1.0
    """Clip gradients to this global norm (0 = no clipping)."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per step (train.batch_size is their total)."""
    momentum: float = 0.9
    """Momentum of lars and sgd."""
    trust_coefficient: float = 0.001
    """LARS trust coefficient (eta; SimCLR and BYOL 1e-3)."""
    layerwise_lr_decay: float = 1.0
    """Each Transformer layer's lr x decay^(depth from the top) (ELECTRA fine-tuning 0.8)."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Loop settings; `batch_size` is global (all processes and accumulation steps together).
    `on_nonfinite`: `stop` (raise at a step whose loss or gradients are not finite) or `skip`
    (leave the state unchanged for that step and go on; counted in the logged metrics)."""

    steps: int = 1000
    """Optimizer steps to train (the schedule spans them)."""
    batch_size: int = 256
    """Global batch: all processes, devices and accumulation steps together."""
    seed: int = 0
    """Seed of the initialisation, the data order, masking and dropout."""
    log_every: int = 50
    """Steps between training-metric lines (metrics.jsonl, TensorBoard, progress)."""
    eval_every: int = 500
    """Steps between held-out evaluations."""
    eval_batches: int = 20
    """Held-out batches per evaluation."""
    checkpoint_every: int = 1000
    """Steps between checkpoints (one is also written at the end and on SIGTERM)."""
    keep_checkpoints: int = 3
    """Checkpoints kept; older ones are deleted."""
    progress: bool = True
    """Show a tqdm progress bar with the latest loss and throughput (process 0)."""
    on_nonfinite: str = "stop"
    """stop at a non-finite loss or gradient, or skip that step and go on."""
    profile_steps: str = ""
    """FIRST:LAST steps to trace with jax.profiler into <workdir>/profile/; empty = none."""
    prefetch: bool = True
    """Read batch s+1 on the host while the devices run step s (same results either way)."""


@dataclasses.dataclass(frozen=True)
class Config:
    method: str = "bert"
    model: dict[str, Any] = dataclasses.field(default_factory=dict)
    examples: dict[str, Any] = dataclasses.field(default_factory=dict)
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    mesh: MeshConfig = MeshConfig()
    train: TrainConfig = TrainConfig()

    def model_config(self) -> Any:
        return registry.get(self.method).model_config(**self.model)

    def example_config(self) -> Any:
        return registry.get(self.method).example_config(**self.examples)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


_TINY_MODEL = dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256,
                   max_position_embeddings=128)

PRESETS: dict[str, dict[str, Any]] = {
    # The demo/test size. It departs from BERT where a few hundred steps demand it: no dropout
    # and bias-corrected Adam (with them a 2-layer model stays at the unigram plateau longer).
    "bert_tiny": {
        "method": "bert",
        "model": {**_TINY_MODEL, "vocab_size": 0, "hidden_dropout": 0.0,
                  "attention_dropout": 0.0},
        "examples": {"max_seq_length": 64, "max_predictions_per_seq": 10, "dupe_factor": 5},
        "data": {"vocab_size": 4000},
        "optim": {"learning_rate": 2e-3, "warmup_steps": 30, "bias_correction": True},
        "train": {"steps": 600, "batch_size": 64, "log_every": 25, "eval_every": 200,
                  "checkpoint_every": 200},
    },
    "bert_small": {
        "method": "bert",
        "model": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "intermediate_size": 1024,
                  "vocab_size": 0},
        "examples": {"max_seq_length": 128, "max_predictions_per_seq": 20},
        "data": {"vocab_size": 16000},
        "optim": {"learning_rate": 5e-4, "warmup_steps": 1000},
        "train": {"steps": 20000, "batch_size": 128},
    },
    "bert_base": {
        "method": "bert",
        "model": {"vocab_size": 30522},
        "examples": {"max_seq_length": 128, "max_predictions_per_seq": 20},
        "data": {"vocab_size": 30522},
        "optim": {"learning_rate": 1e-4, "warmup_steps": 10000},
        "train": {"steps": 1000000, "batch_size": 256},
    },
    "bert_large": {
        "method": "bert",
        "model": {"vocab_size": 30522, "hidden_size": 1024, "num_layers": 24, "num_heads": 16,
                  "intermediate_size": 4096},
        "examples": {"max_seq_length": 128, "max_predictions_per_seq": 20},
        "data": {"vocab_size": 30522},
        "optim": {"learning_rate": 1e-4, "warmup_steps": 10000},
        "train": {"steps": 1000000, "batch_size": 256},
    },
    # ELECTRA (configure_pretraining.py): a generator of 1/4 (Small) or 1/3 (Base) of the
    # discriminator's hidden size, embeddings shared; AdamWeightDecay, warmup 10k, linear decay
    # multiplied by the warmup ramp (optimization.py, `electra_linear`).
    "electra_tiny": {
        "method": "electra",
        "model": {**_TINY_MODEL, "embedding_size": 32, "vocab_size": 0, "hidden_dropout": 0.0,
                  "attention_dropout": 0.0},
        "examples": {"max_seq_length": 64, "max_predictions_per_seq": 9},
        "data": {"vocab_size": 4000},
        "optim": {"learning_rate": 2e-3, "schedule": "electra_linear", "warmup_steps": 30,
                  "bias_correction": True},
        "train": {"steps": 600, "batch_size": 64, "log_every": 25, "eval_every": 200,
                  "checkpoint_every": 200},
    },
    "electra_small": {
        "method": "electra",
        "model": {"hidden_size": 256, "embedding_size": 128, "num_layers": 12, "num_heads": 4,
                  "intermediate_size": 1024, "generator_hidden_size": 0.25, "vocab_size": 0},
        "examples": {"max_seq_length": 128, "max_predictions_per_seq": 19},
        "data": {"vocab_size": 30522},
        "optim": {"learning_rate": 5e-4, "schedule": "electra_linear", "warmup_steps": 10000},
        "train": {"steps": 1000000, "batch_size": 128},
    },
    "electra_base": {
        "method": "electra",
        "model": {"hidden_size": 768, "embedding_size": 768, "num_layers": 12, "num_heads": 12,
                  "intermediate_size": 3072, "generator_hidden_size": 1 / 3, "vocab_size": 0},
        "examples": {"max_seq_length": 128, "max_predictions_per_seq": 19},
        "data": {"vocab_size": 30522},
        "optim": {"learning_rate": 2e-4, "schedule": "electra_linear",
                  "warmup_steps": 10000},
        "train": {"steps": 766000, "batch_size": 256},
    },
    # XLNet (Yang et al. 2019, Table 7; train_gpu.py / data_utils.py): seq 512 of which 256 are
    # reused, memory 384, 85 targets (K = 6), bi_data, AdamWeightDecay, warmup, linear decay.
    "xlnet_tiny": {
        "method": "xlnet",
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 256,
                  "vocab_size": 0, "mem_len": 48, "reuse_len": 32, "hidden_dropout": 0.0,
                  "attention_dropout": 0.0},
        "examples": {"max_seq_length": 64, "reuse_len": 32, "perm_size": 32, "num_predict": 11,
                     "num_streams": 32},
        "data": {"vocab_size": 4000},
        "optim": {"learning_rate": 2e-3, "warmup_steps": 30, "bias_correction": True},
        "train": {"steps": 600, "batch_size": 32, "log_every": 25, "eval_every": 200,
                  "checkpoint_every": 200},
    },
    "xlnet_base": {
        "method": "xlnet",
        "model": {"hidden_size": 768, "num_layers": 12, "num_heads": 12,
                  "intermediate_size": 3072, "vocab_size": 0, "mem_len": 384, "reuse_len": 256,
                  "bi_data": True},
        "examples": {"max_seq_length": 512, "reuse_len": 256, "perm_size": 256,
                     "num_predict": 85, "num_streams": 256, "bi_data": True},
        "data": {"vocab_size": 32000},
        "optim": {"learning_rate": 4e-4, "warmup_steps": 40000},
        "train": {"steps": 500000, "batch_size": 256},
    },
    # MPNet (Song et al. 2020, §3.1; microsoft/MPNet README's fairseq-train command): BERT-Base
    # size with 512 positions (+2), relative position bias, whole-word permutations, 15%
    # predicted with 80/10/10 inputs; batch 8192, 500k steps, Adam (bias-corrected) b2 0.98,
    # eps 1e-6, lr 6e-4 with warmup (24k as RoBERTa-Base's Table 9 schedule, which MPNet
    # follows) then linear decay, weight decay 0.01, no clipping (--clip-norm 0.0); fairseq's
    # Adam (eps before the bias correction, decay on every parameter) and polynomial_decay
    # (from the peak at the end of warmup), as roberta_base.
    "mpnet_tiny": {
        "method": "mpnet",
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 256,
                  "max_position_embeddings": 130, "vocab_size": 0, "hidden_dropout": 0.0,
                  "attention_dropout": 0.0},
        "examples": {"max_seq_length": 64},
        "data": {"vocab_size": 4000},
        "optim": {"learning_rate": 2e-3, "warmup_steps": 30, "bias_correction": True},
        "train": {"steps": 600, "batch_size": 64, "log_every": 25, "eval_every": 200,
                  "checkpoint_every": 200},
    },
    "mpnet_base": {
        "method": "mpnet",
        "model": {"vocab_size": 0, "max_position_embeddings": 514},
        "examples": {"max_seq_length": 512, "pred_prob": 0.15, "whole_word_mask": True},
        "data": {"vocab_size": 30522},
        "optim": {"learning_rate": 6e-4, "schedule": "linear_from_peak", "warmup_steps": 24000,
                  "b2": 0.98, "eps": 1e-6, "weight_decay": 0.01, "bias_correction": True,
                  "eps_before_bias_correction": True, "decay_norms_and_biases": True,
                  "clip_norm": 0.0},
        "train": {"steps": 500000, "batch_size": 8192},
    },
    # GPT at the demo/test size: no dropout, bias-corrected Adam, cosine decay (as gpt2_small).
    "gpt_tiny": {
        "method": "gpt",
        "model": {**_TINY_MODEL, "vocab_size": 0, "hidden_dropout": 0.0,
                  "attention_dropout": 0.0, "embedding_dropout": 0.0},
        "examples": {"max_seq_length": 64},
        "data": {"vocab_size": 4000},
        "optim": {"learning_rate": 2e-3, "schedule": "cosine", "warmup_steps": 30,
                  "bias_correction": True, "eps": 1e-8},
        "train": {"steps": 600, "batch_size": 32, "log_every": 25, "eval_every": 200,
                  "checkpoint_every": 200},
    },
    # GPT-2 small, 124M (Radford et al. 2019, Table 2 and §2.3: 12 layers, d_model 768, context
    # 1024, batch 512, vocabulary 50,257 with GPT-2's BPE: pass --tokenizer <a GPT-2 folder>;
    # without it a 50,257-piece sentencepiece model is trained). The paper gives no optimiser
    # details; these are GPT-1's (Radford et al. 2018 §4.1): Adam, max lr 2.5e-4, linear warmup
    # over 2,000 updates then cosine to 0, decoupled weight decay 0.01 on non-bias/gain
    # weights, dropout 0.1. 100k steps (52B tokens) is our choice, not the paper's.
    "gpt2_small": {
        "method": "gpt",
        "model": {"vocab_size": 0, "hidden_size": 768, "num_layers": 12, "num_heads": 12,
                  "intermediate_size": 3072, "max_position_embeddings": 1024},
        "examples": {"max_seq_length": 1024},
        "data": {"vocab_size": 50257},
        "optim": {"learning_rate": 2.5e-4, "schedule": "cosine", "warmup_steps": 2000,
                  "weight_decay": 0.01, "bias_correction": True, "eps": 1e-8},
        "train": {"steps": 100000, "batch_size": 512},
    },
    # RoBERTa (Liu et al. 2019, Table 9 and §5; fairseq README.pretraining.md): BERT-Base size,
    # 514 positions (512 + padding id + 1), one token type, FULL-SENTENCES inputs of 512 tokens,
    # dynamic masking, no NSP; batch 8k, 500k steps, Adam (bias-corrected) b2 0.98, eps 1e-6,
    # peak lr 6e-4 after 24k warmup steps then linear decay, weight decay 0.01, no clipping.
    # roberta_base trains as fairseq-train does: its Adam (fairseq/optim/adam.py) adds eps to
    # sqrt(v) before the bias correction and decays every parameter (LayerNorm and biases too),
    # and polynomial_decay falls linearly from the peak at the end of warmup (BERT's `linear`
    # decays from step 0 and so would start at 0.952 x peak after 24k of 500k steps).
    "roberta_tiny": {
        "method": "roberta",
        "model": {**_TINY_MODEL, "vocab_size": 0, "hidden_dropout": 0.0,
                  "attention_dropout": 0.0},
        "examples": {"max_seq_length": 64, "max_predictions_per_seq": 10},
        "data": {"vocab_size": 4000},
        "optim": {"learning_rate": 2e-3, "warmup_steps": 30, "bias_correction": True,
                  "b2": 0.98},
        "train": {"steps": 600, "batch_size": 64, "log_every": 25, "eval_every": 200,
                  "checkpoint_every": 200},
    },
    "roberta_base": {
        "method": "roberta",
        "model": {"vocab_size": 0, "max_position_embeddings": 514},
        "examples": {"max_seq_length": 512, "max_predictions_per_seq": 77},
        "data": {"vocab_size": 50265},
        "optim": {"learning_rate": 6e-4, "schedule": "linear_from_peak", "warmup_steps": 24000,
                  "b2": 0.98, "eps": 1e-6, "weight_decay": 0.01, "bias_correction": True,
                  "eps_before_bias_correction": True, "decay_norms_and_biases": True,
                  "clip_norm": 0.0},
        "train": {"steps": 500000, "batch_size": 8192},
    },
    # ALBERT (Lan et al. 2020 §4.1; google-research/albert README's run_pretraining command):
    # E = 128, H = 768, 12 shared layers, gelu_new, no dropout (v2), seq 512 (10% shorter),
    # 20 predictions with n-gram masking (n <= 3), SOP; LAMB lr 0.00176, batch 4096, 125k
    # steps, 3125 warmup steps then linear decay, weight decay 0.01; sentencepiece 30k.
    "albert_tiny": {
        "method": "albert",
        "model": {**_TINY_MODEL, "embedding_size": 32, "vocab_size": 0},
        "examples": {"max_seq_length": 64, "max_predictions_per_seq": 10, "dupe_factor": 5},
        "data": {"vocab_size": 4000},
        "optim": {"learning_rate": 2e-3, "warmup_steps": 30, "bias_correction": True},
        "train": {"steps": 600, "batch_size": 64, "log_every": 25, "eval_every": 200,
                  "checkpoint_every": 200},
    },
    "albert_base": {
        "method": "albert",
        "model": {"vocab_size": 0, "embedding_size": 128, "hidden_size": 768, "num_layers": 12,
                  "num_heads": 12, "intermediate_size": 3072},
        "examples": {"max_seq_length": 512, "max_predictions_per_seq": 20},
        "data": {"vocab_size": 30000},
        "optim": {"optimizer": "lamb", "learning_rate": 0.00176, "warmup_steps": 3125,
                  "weight_decay": 0.01, "eps": 1e-6},
        "train": {"steps": 125000, "batch_size": 4096},
    },
    # T5 (Raffel et al. 2020): the v1.0 Base of §3.1.2 (12 + 12 blocks, d_model 768, d_ff 3072,
    # ReLU, 12 heads of d_kv 64, 32 relative-position buckets up to offset 128, dropout 0.1,
    # tied embeddings) pre-trained for 2^19 steps of 128 x 512 tokens with AdaFactor and the
    # inverse square root schedule 1/sqrt(max(n, 10^4)) (= 0.01 for the first 10^4 steps), on
    # span corruption (§3.3.4: 15% noise, mean span 3 -> 568 raw tokens, 114 targets); a
    # 32,000-piece sentencepiece vocabulary + 100 sentinels.
    "t5_tiny": {
        "method": "t5",
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "head_size": 16,
                  "intermediate_size": 256, "vocab_size": 0, "eos_token_id": 0,
                  "hidden_dropout": 0.0, "attention_dropout": 0.0},
        "examples": {"inputs_length": 64},
        "data": {"vocab_size": 4000},
        "optim": {"optimizer": "adafactor", "schedule": "inverse_sqrt", "learning_rate": 0.01,
                  "warmup_steps": 1000, "weight_decay": 0.0, "clip_norm": 0.0},
        "train": {"steps": 600, "batch_size": 64, "log_every": 25, "eval_every": 200,
                  "checkpoint_every": 200},
    },
    "t5_base": {
        "method": "t5",
        "model": {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "head_size": 64,
                  "intermediate_size": 3072, "feed_forward_proj": "relu",
                  "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
                  "hidden_dropout": 0.1, "attention_dropout": 0.1, "tie_word_embeddings": True,
                  "vocab_size": 0, "eos_token_id": 0},
        "examples": {"noise": "span_corruption", "inputs_length": 512, "noise_density": 0.15,
                     "mean_noise_span_length": 3.0},
        "data": {"vocab_size": 32000},
        "optim": {"optimizer": "adafactor", "schedule": "inverse_sqrt", "learning_rate": 0.01,
                  "warmup_steps": 10000, "weight_decay": 0.0, "clip_norm": 0.0},
        "train": {"steps": 524288, "batch_size": 128},
    },
    # BART's text infilling (Lewis et al. 2020, §2.2: 30% of the words in Poisson(3)-long
    # spans, one mask token per span, the whole text as target) on the tiny T5 above.
    "bart_tiny": {
        "method": "t5",
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "head_size": 16,
                  "intermediate_size": 256, "vocab_size": 0, "eos_token_id": 0,
                  "hidden_dropout": 0.0, "attention_dropout": 0.0},
        "examples": {"noise": "text_infilling", "inputs_length": 64, "mask_ratio": 0.3,
                     "poisson_lambda": 3.0},
        "data": {"vocab_size": 4000},
        "optim": {"optimizer": "adafactor", "schedule": "inverse_sqrt", "learning_rate": 0.01,
                  "warmup_steps": 1000, "weight_decay": 0.0, "clip_norm": 0.0},
        "train": {"steps": 600, "batch_size": 64, "log_every": 25, "eval_every": 200,
                  "checkpoint_every": 200},
    },
    # SimCLR on CIFAR-10 (simclr tf2 README command): ResNet-18 with the CIFAR stem, batch 512,
    # 1000 epochs (97,656 steps) with 10 of warmup, LARS lr 1.0 x 512/256, weight decay 1e-4,
    # temperature 0.5, jitter strength 0.5, no blur.
    "simclr_tiny": {
        "method": "simclr",
        "model": {"depth": 18, "stem": "cifar", "base_width": 8, "image_size": 32,
                  "temperature": 0.5, "jitter_strength": 0.5, "blur_probability": 0.0},
        "optim": {"optimizer": "lars", "learning_rate": 0.5, "schedule": "cosine",
                  "warmup_steps": 10, "weight_decay": 1e-4, "clip_norm": 0.0},
        "train": {"steps": 200, "batch_size": 64, "log_every": 25, "eval_every": 100,
                  "checkpoint_every": 100},
    },
    "simclr_cifar10": {
        "method": "simclr",
        "model": {"depth": 18, "stem": "cifar", "image_size": 32, "temperature": 0.5,
                  "jitter_strength": 0.5, "blur_probability": 0.0},
        "data": {"source": ""},
        "optim": {"optimizer": "lars", "learning_rate": 2.0, "schedule": "cosine",
                  "warmup_steps": 977, "weight_decay": 1e-4, "clip_norm": 0.0},
        "train": {"steps": 97656, "batch_size": 512, "eval_every": 2000},
    },
    # The offline image demo: scikit-learn's 1,797 scanned 8x8 digits, upsampled to 16 px by the
    # random resized crop, a narrow ResNet-18 with the CIFAR stem, CIFAR's augmentation settings.
    "simclr_digits": {
        "method": "simclr",
        "model": {"depth": 18, "stem": "cifar", "base_width": 16, "image_size": 16,
                  "temperature": 0.5, "jitter_strength": 0.5, "blur_probability": 0.0},
        "examples": {"knn_k": 20},
        "data": {"source": "digits", "held_out_fraction": 0.2},
        "optim": {"optimizer": "lars", "learning_rate": 1.0, "schedule": "cosine",
                  "warmup_steps": 20, "weight_decay": 1e-4, "clip_norm": 0.0},
        "train": {"steps": 400, "batch_size": 256, "log_every": 25, "eval_every": 100,
                  "checkpoint_every": 200, "eval_batches": 1},
    },
    # SimCLR on ImageNet (Chen et al. 2020, Appendix B.1): ResNet-50, batch 4096, 100 epochs of
    # 1,281,167 images (31,278 steps) with 10 of warmup, LARS lr 4.8 (= 0.3 x 4096/256), weight
    # decay 1e-6, temperature 0.1, jitter strength 1.0, blur p 0.5; two random crops per image
    # made on the host, the rest of the augmentation on device.
    "simclr_imagenet": {
        "method": "simclr",
        "model": {"depth": 50, "stem": "imagenet", "image_size": 224, "temperature": 0.1,
                  "dtype": "bfloat16",
                  "jitter_strength": 1.0, "blur_probability": 0.5},
        "examples": {"host_crop_size": 224},
        "data": {"source": "tfds:imagenet2012", "worker_count": 16},
        "optim": {"optimizer": "lars", "learning_rate": 4.8, "schedule": "cosine",
                  "warmup_steps": 3128, "weight_decay": 1e-6, "clip_norm": 0.0},
        "train": {"steps": 31278, "batch_size": 4096, "eval_every": 5000},
    },
    # MoCo v2 at test size: the settings of facebookresearch/moco's CIFAR-10 demo notebook
    # (K 4096, m 0.99, BatchNorm split 8 ways, SGD lr 0.06 x batch/512, weight decay 5e-4) with
    # v2's temperature 0.2 and a narrow ResNet-18 with the CIFAR stem.
    "moco_tiny": {
        "method": "moco",
        "model": {"depth": 18, "stem": "cifar", "base_width": 8, "image_size": 32,
                  "projection_dim": 64, "queue_size": 4096, "momentum": 0.99,
                  "crop_area_min": 0.2, "blur_probability": 0.0,
                  "second_blur_probability": 0.0},
        "optim": {"optimizer": "sgd", "learning_rate": 0.0075, "schedule": "cosine",
                  "warmup_steps": 0, "weight_decay": 5e-4, "clip_norm": 0.0},
        "train": {"steps": 200, "batch_size": 64, "log_every": 25, "eval_every": 100,
                  "checkpoint_every": 100},
    },
    # MoCo v2 on ImageNet (Chen et al. 2020 "Improved Baselines" §3 and Table 1; main_moco.py
    # --mlp --aug-plus --cos): ResNet-50, 2048-wide MLP head to 128, K 65536, m 0.999, T 0.2,
    # BatchNorm per 8 GPUs with shuffled keys, SGD lr 0.03 (x batch/256), momentum 0.9,
    # weight decay 1e-4 on every parameter, cosine over 200 epochs of 5,004 steps (1,281,167
    # images, batch 256, last partial batch dropped), no warmup; crops of area 0.2-1.
    "moco_v2_imagenet": {
        "method": "moco",
        "model": {"depth": 50, "stem": "imagenet", "image_size": 224, "dtype": "bfloat16",
                  "projection_dim": 128, "queue_size": 65536, "momentum": 0.999,
                  "temperature": 0.2, "shuffle_bn_groups": 8, "crop_area_min": 0.2},
        "examples": {"host_crop_size": 224, "host_crop_area_min": 0.2},
        "data": {"source": "tfds:imagenet2012", "worker_count": 16},
        "optim": {"optimizer": "sgd", "learning_rate": 0.03, "schedule": "cosine",
                  "warmup_steps": 0, "weight_decay": 1e-4, "momentum": 0.9, "clip_norm": 0.0},
        "train": {"steps": 1000800, "batch_size": 256, "eval_every": 25020},
    },
    # BYOL at test size: a narrow ResNet-18 with the CIFAR stem, small MLPs, the paper's
    # augmentations and target schedule (K = train.steps), LARS with 10 warmup steps.
    "byol_tiny": {
        "method": "byol",
        "model": {"depth": 18, "stem": "cifar", "base_width": 8, "image_size": 32,
                  "projection_hidden_dim": 256, "projection_dim": 64,
                  "predictor_hidden_dim": 256, "base_target_decay": 0.99},
        "optim": {"optimizer": "lars", "learning_rate": 0.5, "schedule": "cosine",
                  "warmup_steps": 10, "weight_decay": 1.5e-6, "clip_norm": 0.0},
        "train": {"steps": 200, "batch_size": 64, "log_every": 25, "eval_every": 100,
                  "checkpoint_every": 100},
    },
    # BYOL on ImageNet (Grill et al. 2020 §3.3 and Appendix J; configs/byol.py for 1000
    # epochs): ResNet-50, projector and predictor 4096 -> 256, tau_base 0.996 with the cosine
    # schedule over the whole run, LARS (trust 1e-3, momentum 0.9, neither decay nor adaptation
    # on biases and BatchNorm) lr 0.2 x 4096/256 = 3.2, weight decay 1.5e-6, batch 4096, 1000
    # epochs = 312,785 steps with 10 of warmup (3,127), cosine; crops of area 0.08-1.
    "byol_imagenet": {
        "method": "byol",
        "model": {"depth": 50, "stem": "imagenet", "image_size": 224, "dtype": "bfloat16",
                  "projection_hidden_dim": 4096, "projection_dim": 256,
                  "predictor_hidden_dim": 4096, "base_target_decay": 0.996},
        "examples": {"host_crop_size": 224, "host_crop_area_min": 0.08},
        "data": {"source": "tfds:imagenet2012", "worker_count": 16},
        "optim": {"optimizer": "lars", "learning_rate": 3.2, "schedule": "cosine",
                  "warmup_steps": 3127, "weight_decay": 1.5e-6, "momentum": 0.9,
                  "trust_coefficient": 1e-3, "clip_norm": 0.0},
        "train": {"steps": 312785, "batch_size": 4096, "eval_every": 5000},
    },
}


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _parse_value(text: str, kind: Any, key: str) -> Any:
    if isinstance(kind, types.UnionType):  # e.g. `int | None`
        if text.lower() == "none":
            return None
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    try:
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
        if kind in (int, float, str):
            return kind(text)
    except ValueError:
        raise UserError(f"{key}={text!r} is not a valid {kind.__name__}; "
                        f"give e.g. {key}={kind()!r}") from None
    return json.loads(text)


def _section_class(section: str, method: str) -> type:
    if section == "model":
        return registry.get(method).model_config
    if section == "examples":
        return registry.get(method).example_config
    return _field_types(Config)[section]


def _apply(tree: dict[str, Any], key: str, value: Any, method: str, parse: bool) -> None:
    if "." not in key:
        raise UserError(f"config key {key!r} needs a section, e.g. train.steps=100; sections: "
                        f"{[f.name for f in dataclasses.fields(Config) if f.name != 'method']}")
    section, name = key.split(".", 1)
    if section not in tree or section == "method":
        raise UserError(f"unknown config section {section!r} in {key!r}; use one of "
                        f"{[f.name for f in dataclasses.fields(Config) if f.name != 'method']}")
    kinds = _field_types(_section_class(section, method))
    if name not in kinds:
        raise UserError(f"unknown config key {key!r}; valid keys in {section}: {sorted(kinds)}")
    tree[section][name] = _parse_value(value, kinds[name], key) if parse else value


def make_config(preset: str | None = None, overrides: list[str] | dict[str, Any] = (),
                file: str | Path | None = None) -> Config:
    """A validated Config from a preset name, a config `file` (`read_config_file`; its
    `preset:` applies when `preset` is None) and `section.key=value` overrides (strings, parsed
    by field type) or a `{"section.key": value}` dict (values used as given), in that order:
    preset < file < overrides."""
    tree: dict[str, Any] = {"method": "bert", "model": {}, "examples": {}, "data": {},
                            "optim": {}, "mesh": {}, "train": {}}
    items = overrides.items() if isinstance(overrides, dict) else None
    if items is None:
        items = []
        for text in overrides:
            if "=" not in text:
                raise UserError(f"override {text!r} is not key=value; write e.g. train.steps=100")
            items.append(tuple(text.split("=", 1)))
    settings = read_config_file(file) if file is not None else {}
    preset = settings.pop("preset", None) if preset is None else preset
    method_override = [v for k, v in items if k == "method"]
    if preset is not None:
        if preset not in PRESETS:
            raise UserError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        for section, values in PRESETS[preset].items():
            tree[section] = values if section == "method" else dict(values)
    if "method" in settings:
        tree["method"] = settings["method"]
    if method_override:
        tree["method"] = method_override[-1]
    registry.get(tree["method"])
    if file is not None:
        _apply_file(tree, settings, file)
    for key, value in items:
        if key != "method":
            _apply(tree, key, value, tree["method"], parse=not isinstance(overrides, dict))
    return config_from_dict(tree)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The settings of a config file, sections as in a workdir's config.json (`method`,
    `model`, `examples`, `data`, `optim`, `mesh`, `train`) plus an optional `preset`: a YAML
    file, or a Python file whose `get_config()` returns that dict (as big_vision's configs;
    its docstring can hold the command that runs it)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--config {path}: no such file; give a .yaml or .py config file")
    if path.suffix == ".py":
        settings = _python_config(path)
    else:
        import yaml

        try:
            settings = yaml.safe_load(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as error:
            problem = " ".join(str(error).split())
            raise UserError(f"--config {path} is not valid YAML ({problem}); fix the "
                            "file") from None
    if hasattr(settings, "to_dict"):  # an ml_collections.ConfigDict
        settings = settings.to_dict()
    if not isinstance(settings, dict):
        raise UserError(f"--config {path} must hold a mapping of sections (method, model, "
                        f"examples, data, optim, mesh, train, preset), not a "
                        f"{type(settings).__name__}")
    sections = [f.name for f in dataclasses.fields(Config)]
    for key, value in settings.items():
        if key not in (*sections, "preset"):
            raise UserError(f"--config {path}: unknown section {key!r}; use {sections} or preset")
        if key in ("method", "preset"):
            if not isinstance(value, str):
                raise UserError(f"--config {path}: {key} must be a name, not {value!r}")
        elif not isinstance(value, dict):
            raise UserError(f"--config {path}: section {key} must map keys to values, e.g. "
                            f"{key}: {{...}}")
    return dict(settings)


def _python_config(path: Path) -> Any:
    """`get_config()` of a Python config file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"pretext_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        problem = " ".join(str(error).split())
        raise UserError(f"--config {path} failed to run ({type(error).__name__}: {problem}); "
                        "fix the file (--traceback shows where)") from error
    if not callable(getattr(module, "get_config", None)):
        raise UserError(f"--config {path} defines no get_config(); add one that returns a dict "
                        "of sections, e.g. {'train': {'steps': 100}}")
    try:
        return module.get_config()
    except Exception as error:
        problem = " ".join(str(error).split())
        raise UserError(f"--config {path}: get_config() raised {type(error).__name__}: "
                        f"{problem}; fix the file (--traceback shows where)") from error


def _apply_file(tree: dict[str, Any], settings: dict[str, Any], path: str | Path) -> None:
    """The sections of a config file over `tree`, each value checked against its field's type
    (YAML reads 1e-4 as a string and 3 as an int: those are converted)."""
    for section, values in settings.items():
        if section in ("method", "preset"):
            continue
        for name, value in values.items():
            key = f"{section}.{name}"
            try:
                _apply(tree, key, value, tree["method"], parse=False)
                kind = _field_types(_section_class(section, tree["method"]))[name]
                tree[section][name] = _file_value(value, kind, key)
            except UserError as error:
                raise UserError(f"--config {path}: {error}") from None


def _file_value(value: Any, kind: Any, key: str) -> Any:
    """`value` as a field of type `kind`: strings parsed as overrides are, ints widened to
    float, anything else of the wrong scalar type refused."""
    if isinstance(value, str) and kind is not str:
        return _parse_value(value, kind, key)
    if value is None and isinstance(kind, types.UnionType) and type(None) in typing.get_args(kind):
        return value
    if isinstance(kind, types.UnionType):
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind in (bool, int, float, str) and (
            not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise UserError(f"{key}={value!r} is not a valid {kind.__name__}; give e.g. "
                        f"{key}: {kind()!r}")
    return value


def config_from_dict(tree: dict[str, Any]) -> Config:
    """Builds and validates a Config from its dict form (as saved in a workdir)."""
    method = registry.get(tree.get("method", "bert"))
    sections = {}
    for f in dataclasses.fields(Config):
        if f.name in ("method", "model", "examples"):
            continue
        cls = _field_types(Config)[f.name]
        values = tree.get(f.name, {})
        unknown = set(values) - set(_field_types(cls))
        if unknown:
            raise UserError(f"unknown config keys {sorted(unknown)} in {f.name}; valid: "
                            f"{sorted(_field_types(cls))}")
        sections[f.name] = cls(**values)
    config = Config(method=method.name, model=dict(tree.get("model", {})),
                    examples=dict(tree.get("examples", {})), **sections)
    for section, cls in (("model", method.model_config), ("examples", method.example_config)):
        unknown = set(getattr(config, section)) - set(_field_types(cls))
        if unknown:
            raise UserError(f"unknown config keys {sorted(unknown)} in {section}; valid: "
                            f"{sorted(_field_types(cls))}")
    validate(config)
    return config


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's one-line doc: the string literal written right after the field (PEP 257's
    attribute docstrings, as Sphinx reads them), from the class and the dataclasses it
    extends."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError, IndexError, AttributeError):
            continue
        for node, following in zip(body, body[1:], strict=False):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _as_override(value: Any) -> str:
    """A value as `section.key=VALUE` takes it back (`_parse_value`)."""
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, str):
        return value if value else "''"
    return str(value) if isinstance(value, int | float) else json.dumps(value)


def describe(config: Config) -> str:
    """Every key of `config` with its value, the class default where it differs, and its doc
    (`run.py config`), section by section."""
    method = registry.get(config.method)
    lines = [f"method={config.method}  ({method.description})"]
    sections = [(name, _field_types(Config)[name], dataclasses.asdict(getattr(config, name)))
                for name in ("data", "optim", "mesh", "train")]
    sections += [("model", method.model_config,
                  dataclasses.asdict(method.model_config(**config.model))),
                 ("examples", method.example_config,
                  dataclasses.asdict(method.example_config(**config.examples)))]
    for section, cls, values in sections:
        lines.append(f"\n[{section}]  {cls.__module__}.{cls.__name__}")
        docs = field_docs(cls)
        defaults = dataclasses.asdict(cls())
        for name, value in values.items():
            default = ("" if value == defaults[name]
                       else f"  (default {_as_override(defaults[name])})")
            lines.append(f"  {section}.{name}={_as_override(value)}{default}")
            lines.append(f"      {docs.get(name, 'undocumented')}")
    return "\n".join(lines)


# The valid range of every numeric key of the generic sections, in interval notation.
RANGES = {
    "optim.learning_rate": "[0, inf)", "optim.warmup_steps": "[0, inf)",
    "optim.end_learning_rate": "[0, inf)", "optim.weight_decay": "[0, inf)",
    "optim.b1": "[0, 1)", "optim.b2": "[0, 1)", "optim.eps": "[0, inf)",
    "optim.clip_norm": "[0, inf)", "optim.grad_accum_steps": "[1, inf)",
    "optim.momentum": "[0, 1)", "optim.trust_coefficient": "[0, inf)",
    "optim.layerwise_lr_decay": "(0, 1]",
    "train.steps": "[1, inf)", "train.batch_size": "[1, inf)", "train.seed": "[0, 4294967295]",
    "train.log_every": "[1, inf)", "train.eval_every": "[1, inf)", "train.eval_batches": "[1, inf)",
    "train.checkpoint_every": "[1, inf)", "train.keep_checkpoints": "[1, inf)",
    "data.vocab_size": "[8, inf)", "mesh.data": "[-1, inf)", "mesh.fsdp": "[-1, inf)",
    "mesh.tensor": "[-1, inf)",
}


def _inside(value: float, interval: str) -> bool:
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    return ((value >= low if interval[0] == "[" else value > low)
            and (value <= high if interval[-1] == "]" else value < high))


def check_numbers(config: Config) -> None:
    """Every float of every section finite, every key of `RANGES` inside its range, mesh sizes
    -1 or positive (the model configs check their own fields, e.g. `dtype`)."""
    sections = {name: dataclasses.asdict(getattr(config, name))
                for name in ("data", "optim", "mesh", "train")}
    sections.update(model=config.model, examples=config.examples)
    for section, values in sections.items():
        for name, value in values.items():
            key = f"{section}.{name}"
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"{key}={value} must be a finite number")
            interval = RANGES.get(key)
            if interval and isinstance(value, int | float) and not _inside(value, interval):
                raise UserError(f"{key}={value} is outside its valid range {interval}")
            if section == "mesh" and value == 0:
                raise UserError(f"{key}=0: a mesh axis needs at least 1 device (-1 = the rest)")


def parse_profile_steps(text: str) -> tuple[int, int]:
    """`a:b` -> (a, b), the first and last step to trace (1 <= a <= b); `a` alone is `a:a`."""
    first, _, last = text.partition(":")
    try:
        bounds = int(first), int(last or first)
    except ValueError:
        bounds = (0, -1)
    if not 1 <= bounds[0] <= bounds[1]:
        raise UserError(f"train.profile_steps={text!r} must be FIRST:LAST steps with "
                        "1 <= FIRST <= LAST, e.g. train.profile_steps=10:12")
    return bounds


def validate(config: Config) -> None:
    """Range checks (`check_numbers`) and cross-field checks that need no devices or data."""
    t, o = config.train, config.optim
    check_numbers(config)
    if t.profile_steps:
        parse_profile_steps(t.profile_steps)
    if t.on_nonfinite not in ("stop", "skip"):
        raise UserError(f"train.on_nonfinite={t.on_nonfinite!r} must be 'stop' or 'skip'")
    if o.eps_before_bias_correction and not o.bias_correction:
        raise UserError("optim.eps_before_bias_correction=true places eps relative to Adam's "
                        "bias correction; set optim.bias_correction=true as well")
    if t.batch_size % o.grad_accum_steps:
        raise UserError(f"train.batch_size={t.batch_size} is not divisible by "
                        f"optim.grad_accum_steps={o.grad_accum_steps}; change one of them")
    configs = {}
    for section, build in (("model", config.model_config), ("examples", config.example_config)):
        try:
            configs[section] = build()
        except (TypeError, ValueError) as e:
            raise UserError(f"invalid {section} config ({section}.*): {e}") from None
    model_config, example_config = configs["model"], configs["examples"]
    registry.get(config.method).check(model_config, example_config)
