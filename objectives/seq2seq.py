"""Encoder-decoder denoising pre-training (method `t5`): T5's span corruption (Raffel et al.
2020, §3.1.4, §3.3.4) or BART's text infilling (Lewis et al. 2020, §2.2) on one T5 model,
chosen by `examples.noise` (see `input_pipeline.seq2seq_examples`).

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
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.input_pipeline import seq2seq_examples
from pretext_jax.input_pipeline.prepare import DataConfig, prepare_text
from pretext_jax.models.t5 import PAD_ID, T5, T5Config, shift_right
from pretext_jax.objectives.registry import Batch, Method, Metrics, PreparedData, register
from pretext_jax.objectives.text import MAX_EVAL_EXAMPLES, mask_records, weighted_cross_entropy


def seq2seq_loss(model: T5, batch: Batch, rng: jax.Array | None) -> tuple[jax.Array, Metrics]:
    """Cross-entropy of the decoder's predictions of `targets` given `inputs`; `rng=None` is
    evaluation (no dropout)."""
    inputs, targets = batch["inputs"], batch["targets"]
    out = model(inputs, inputs != PAD_ID, shift_right(targets), rng=rng)
    weights = (targets != PAD_ID).astype(jnp.float32)
    loss, metrics = weighted_cross_entropy(out.logits, targets, weights, epsilon=1e-6)
    return loss, {"loss": metrics["loss"], "accuracy": metrics["accuracy"],
                  "target_tokens": (jnp.sum(weights), jnp.float32(targets.shape[0])),
                  "input_tokens": (jnp.sum((inputs != PAD_ID).astype(jnp.float32)),
                                   jnp.float32(inputs.shape[0]))}


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
    eval_examples = mask_records(held_out.examples(range(min(len(held_out),
                                                             MAX_EVAL_EXAMPLES))),
                                 noising, seed + 2)
    return PreparedData(train=train, eval=eval_examples, transforms=(noising,),
                        model_fields={"vocab_size": vocab.vocab_size,
                                      "eos_token_id": vocab.eos_id},
                        tokenizer=tokenizer)


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
))
