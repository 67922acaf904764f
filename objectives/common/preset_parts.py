"""Pieces the built-in presets share. Each method's module declares its presets next to its loss
and registers them with its `Method` (`registry.Method.presets`)."""

from __future__ import annotations

# The text methods' demo/test size: 2 layers of 64 (4 heads, FFN 256), 128 positions.
TINY_TEXT_MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 256,
                   "max_position_embeddings": 128}
NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
# Devlin et al. 2019 §A.2: 1M steps of 256 sequences, lr 1e-4, 10k warmup; 90 % of the steps
# at 128 tokens (20 predictions), the last 10 % at 512 (80), the google-research/bert README's
# recipe "so that positions 128-511 are learned" (run_pretraining.py run again from the 128
# checkpoint on 512-token data, its schedule continuing: here one run of two phases). BERT's
# and InfoWord's paper presets.
BERT_RECIPE = {
    "examples": {"max_seq_length": 128, "max_predictions_per_seq": 20,
                 "long_phase_fraction": 0.1, "long_max_seq_length": 512,
                 "long_max_predictions_per_seq": 80},
    "data": {"vocab_size": 30522},
    "optim": {"learning_rate": 1e-4, "warmup_steps": 10000},
    "train": {"steps": 1000000, "batch_size": 256},
}

# The encoder-decoder methods' (T5, BART, MASS) demo/test size, and T5's optimiser: Adafactor
# with the inverse square root schedule, no decay or clipping (Raffel et al. 2020 §3.1.2).
TINY_T5_MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "head_size": 16,
                 "intermediate_size": 256, "vocab_size": 0, "eos_token_id": 0, **NO_DROPOUT}
T5_OPTIM = {"optimizer": "adafactor", "schedule": "inverse_sqrt", "learning_rate": 0.01,
            "weight_decay": 0.0, "clip_norm": 0.0}
# At the tiny size the text presets depart from their papers where a few hundred steps demand it:
# no dropout and bias-corrected Adam (with them a 2-layer model stays at the unigram plateau
# longer), a large learning rate and a short warmup.
TINY_TEXT_OPTIM = {"learning_rate": 2e-3, "warmup_steps": 30, "bias_correction": True}
TINY_TEXT_TRAIN = {"steps": 600, "batch_size": 64, "log_every": 25, "eval_every": 200,
                   "checkpoint_every": 200}
# The memory-bank methods' optimiser, Wu et al. 2018's as CMC (train_CMC.py) and Local
# Aggregation (param_setter.py) run it: SGD lr 0.03, momentum 0.9, weight decay 1e-4, lr x0.1
# at each of the preset's `decay_boundaries`, no warmup or clipping.
MEMORY_BANK_SGD = {"optimizer": "sgd", "learning_rate": 0.03, "momentum": 0.9,
                   "weight_decay": 1e-4, "schedule": "step", "decay_factor": 0.1,
                   "warmup_steps": 0, "clip_norm": 0.0}
TINY_IMAGE_TRAIN = {"steps": 200, "batch_size": 64, "log_every": 25, "eval_every": 100,
                    "checkpoint_every": 100}
# RoBERTa-Base as fairseq-train runs it (Liu et al. 2019, Table 9; fairseq
# README.pretraining.md), which MPNet follows: Adam (bias-corrected) b2 0.98, eps 1e-6, peak lr
# 6e-4 after 24k warmup steps then linear decay, weight decay 0.01, no clipping. fairseq's Adam
# (fairseq/optim/adam.py) adds eps to sqrt(v) before the bias correction and decays every
# parameter (LayerNorm and biases too), and polynomial_decay falls linearly from the peak at the
# end of warmup (BERT's `linear` decays from step 0 and so would start at 0.952 x peak after 24k
# of 500k steps).
FAIRSEQ_ROBERTA_OPTIM = {"learning_rate": 6e-4, "schedule": "linear_from_peak",
                         "warmup_steps": 24000, "b2": 0.98, "eps": 1e-6, "weight_decay": 0.01,
                         "bias_correction": True, "eps_before_bias_correction": True,
                         "decay_norms_and_biases": True, "clip_norm": 0.0}
# The Free Spoken Digit Dataset's recordings/ folder (3,000 8 kHz wav files named
# {digit}_{speaker}_{index}.wav; indices 0-4 are its official test set): labels from the names,
# the official split, and the probes' windows of 1 s at 16 kHz (recordings last 0.14-2.28 s,
# 0.44 s on average). Probed labels: digit and speaker (index splits).
# The speech methods' test/demo encoder (wav2vec 2.0, HuBERT): a 3-convolution feature encoder
# of 80 samples a frame (5 ms at 16 kHz), 2 Transformer blocks of 64, no dropout. Lists, as
# config.json holds them.
TINY_SPEECH_ENCODER = {"conv_channels": [32, 32, 32], "conv_kernel_sizes": [10, 4, 4],
                       "conv_strides": [5, 4, 4], "hidden_size": 64, "num_layers": 2,
                       "num_heads": 4, "intermediate_size": 128, "position_conv_kernel": 16,
                       "position_conv_groups": 4, "hidden_dropout": 0.0,
                       "attention_dropout": 0.0, "feature_projection_dropout": 0.0,
                       "layerdrop": 0.0}
FSDD_EXAMPLES = {"label_pattern": r"(?P<digit>\d)_(?P<speaker>[a-z]+)_(?P<index>\d+)",
                 "held_out_rule": "index<5", "probe_samples": 16000}
# The masked-LM methods' demo/test preset on BERT's encoder (no dropout, bias-corrected Adam):
# `bert_tiny`, `infoword_tiny`.
TINY_MASKED_LM = {
    "model": {**TINY_TEXT_MODEL, "vocab_size": 0, **NO_DROPOUT},
    "examples": {"max_seq_length": 64, "max_predictions_per_seq": 10, "dupe_factor": 5},
    "data": {"vocab_size": 4000},
    "optim": TINY_TEXT_OPTIM,
    "train": TINY_TEXT_TRAIN,
}

_XLM_DATA_SIZED = {"vocab_size": 0, "n_langs": 0, "pad_token_id": 0}

# `xlm`'s presets, which `unicoder` (XLM's structure) shares. XLM (Lample & Conneau 2019 §5.1;
# facebookresearch/XLM README and train.py): 1024 hidden, 8 heads, GELU, dropout and attention
# dropout 0.1, learned positions (512), streams of 256 tokens, batches of 64, languages and masks
# sampled with alpha 0.5, Adam (b2 0.98 as the README's
# `adam_inverse_sqrt,beta1=0.9,beta2=0.98,lr=0.0001`; bias-corrected, eps 1e-8, no weight
# decay) with gradients clipped at norm 5 (train.py `clip_grad_norm`). 6 layers as the
# unsupervised-MT models (12 for XNLI); the rate ramps from 1e-7 over 4,000 updates, then
# decays as 1/sqrt(step) (src/optim.py `AdamInverseSqrtWithWarmup`). Departures: the vocabulary
# is sentencepiece (XLM: fastBPE, 95k codes for XNLI-15), and the step count is ours (XLM stops
# on held-out perplexity).
XLM_TINY = {
    "model": {**TINY_TEXT_MODEL, **NO_DROPOUT, **_XLM_DATA_SIZED,
              "embed_init_std": TINY_TEXT_MODEL["hidden_size"] ** -0.5},
    "examples": {"stream_length": 64, "max_sentence_length": 30,
                 "max_predictions_per_seq": 10},
    "data": {"vocab_size": 4000},
    "optim": {**TINY_TEXT_OPTIM, "b2": 0.98},
    "train": TINY_TEXT_TRAIN,
}
XLM_BASE = {
    "model": {"hidden_size": 1024, "num_layers": 6, "num_heads": 8,
              "intermediate_size": 4096, "hidden_act": "gelu", "hidden_dropout": 0.1,
              "attention_dropout": 0.1, "max_position_embeddings": 512,
              "embed_init_std": 1024 ** -0.5, "initializer_range": 0.02, **_XLM_DATA_SIZED},
    "examples": {"stream_length": 256, "max_sentence_length": 100, "language_alpha": 0.5,
                 "mask_alpha": 0.5},
    "data": {"vocab_size": 95000},
    "optim": {"optimizer": "adamw", "learning_rate": 1e-4, "schedule": "inverse_sqrt_warmup",
              "warmup_steps": 4000, "warmup_init_learning_rate": 1e-7,
              "b1": 0.9, "b2": 0.98, "eps": 1e-8,
              "weight_decay": 0.0, "bias_correction": True, "clip_norm": 5.0},
    "train": {"steps": 500000, "batch_size": 64},
}
