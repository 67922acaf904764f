"""Encoder-decoder denoising pre-training (method `t5`): T5's span corruption (Raffel et al.
2020, §3.1.4, §3.3.4) or BART's text infilling (Lewis et al. 2020, §2.2) on one T5 model,
chosen by `examples.noise` (see `input_pipeline.examples.seq2seq`).

The loss is teacher-forced cross-entropy on the target tokens in float32: the decoder reads the
targets shifted right with the start token 0 (= pad), pads (0) are ignored, and the loss is
the mean over the batch's target tokens (HF `T5ForConditionalGeneration`'s loss; metrics are
exact sums).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from pretext_jax.input_pipeline.examples import seq2seq as seq2seq_examples
from pretext_jax.input_pipeline.prepare import DataConfig, prepare_text
from pretext_jax.models.t5 import PAD_ID, T5, T5Config, shift_right
from pretext_jax.objectives.common.held_out import held_out_examples
from pretext_jax.objectives.common.losses import encoder_decoder_loss
from pretext_jax.objectives.common.preset_parts import T5_OPTIM, TINY_T5_MODEL, TINY_TEXT_TRAIN
from pretext_jax.objectives.registry import Batch, Method, Metrics, PreparedData, Start, register


def seq2seq_loss(model: T5, batch: Batch, rng: jax.Array | None) -> tuple[jax.Array, Metrics]:
    """Cross-entropy of the decoder's predictions of `targets` given `inputs`; `rng=None` is
    evaluation (no dropout)."""
    inputs, targets = batch["inputs"], batch["targets"]
    return encoder_decoder_loss(model, inputs, inputs != PAD_ID, shift_right(targets), targets,
                                rng)


def build_t5(config: T5Config, seed: int) -> T5:
    return T5(config, rngs=nnx.Rngs(seed))


def build_raw_pieces(examples: seq2seq_examples.Seq2SeqExampleConfig, documents: Any,
                     tokenizer: Any, seed: int) -> Iterable[dict[str, np.ndarray]]:
    """`prepare_text`'s builder: T5's raw pieces (the tokenizer is not needed)."""
    del tokenizer
    return seq2seq_examples.create_training_examples(documents, examples, seed)


def prepare_seq2seq(data: DataConfig, examples: seq2seq_examples.Seq2SeqExampleConfig,
                    cache_dir: Path, seed: int) -> PreparedData:
    """Corpus -> tokenizer -> T5's concatenated raw pieces -> ArrayRecord; the noise is drawn
    while loading. Held-out records get one fixed draw. The model's vocabulary is the
    tokenizer's plus `examples.extra_ids` sentinels; its EOS is the tokenizer's [SEP]."""

    build = functools.partial(build_raw_pieces, examples)
    train, held_out, tokenizer = prepare_text(data, build, examples, cache_dir, seed)
    vocab = seq2seq_examples.Seq2SeqVocab.from_tokenizer(tokenizer, examples.extra_ids)
    noising = seq2seq_examples.Seq2SeqNoising(vocab, examples)
    eval_examples = held_out_examples(held_out, noising, seed)
    return PreparedData(train=train, eval=eval_examples, transforms=(noising,),
                        model_fields={"vocab_size": vocab.vocab_size,
                                      "eos_token_id": vocab.eos_id},
                        tokenizer=tokenizer)


# T5 (Raffel et al. 2020): the v1.0 Base of §3.1.2 (12 + 12 blocks, d_model 768, d_ff 3072,
# ReLU, 12 heads of d_kv 64, 32 relative-position buckets up to offset 128, dropout 0.1,
# tied embeddings) pre-trained for 2^19 steps of 128 x 512 tokens with AdaFactor and the
# inverse square root schedule 1/sqrt(max(n, 10^4)) (= 0.01 for the first 10^4 steps), on
# span corruption (§3.3.4: 15% noise, mean span 3 -> 568 raw tokens, 114 targets); a
# 32,000-piece sentencepiece vocabulary + 100 sentinels.
PRESETS = {
    "t5_tiny": {
        "model": TINY_T5_MODEL,
        "examples": {"inputs_length": 64},
        "data": {"vocab_size": 4000},
        "optim": {**T5_OPTIM, "warmup_steps": 1000},
        "train": TINY_TEXT_TRAIN,
    },
    "t5_base": {
        "model": {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "head_size": 64,
                  "intermediate_size": 3072, "feed_forward_proj": "relu",
                  "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
                  "hidden_dropout": 0.1, "attention_dropout": 0.1, "tie_word_embeddings": True,
                  "vocab_size": 0, "eos_token_id": 0},
        "examples": {"noise": "span_corruption", "inputs_length": 512, "noise_density": 0.15,
                     "mean_noise_span_length": 3.0},
        "data": {"vocab_size": 32000},
        "optim": {**T5_OPTIM, "warmup_steps": 10000},
        "train": {"steps": 524288, "batch_size": 128},
    },
    # BART's text infilling (Lewis et al. 2020, §2.2: 30% of the words in Poisson(3)-long
    # spans, one mask token per span, the whole text as target) on the tiny T5 above.
    "bart_tiny": {
        "model": TINY_T5_MODEL,
        "examples": {"noise": "text_infilling", "inputs_length": 64, "mask_ratio": 0.3,
                     "poisson_lambda": 3.0},
        "data": {"vocab_size": 4000},
        "optim": {**T5_OPTIM, "warmup_steps": 1000},
        "train": TINY_TEXT_TRAIN,
    },
}


register(Method(
    name="t5",
    model_config=T5Config,
    example_config=seq2seq_examples.Seq2SeqExampleConfig,
    build_model=build_t5,
    loss=seq2seq_loss,
    prepare=prepare_seq2seq,
    units_per_example=lambda examples: examples.inputs_length,
    description="T5 span corruption / BART text infilling on an encoder-decoder (Raffel et al. "
                "2020; Lewis et al. 2020)",
    presets=PRESETS,
    start=Start(hf_models=(T5,)),
))
