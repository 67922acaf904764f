"""GPT pre-training objective: causal language modelling, the next token's cross-entropy
(Radford et al. 2018 §3.1 L1; 2019 §2).

On a block of `input_pipeline.examples.gpt` (T + 1 tokens), the model reads tokens 0..T-1 and
token t + 1 is the target at position t; padding (the last block's tail) is neither read as a
key nor counted as a target. The loss is the mean negative log-likelihood over targets,
computed in float32 (`weighted_cross_entropy`); metrics are exact (sum, count) pairs, so
`loss` is the per-token NLL in nats over any window (perplexity = exp(loss)) and `accuracy`
the next-token top-1 accuracy.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from pretext_jax.input_pipeline.examples import gpt as gpt_examples
from pretext_jax.input_pipeline.prepare import DataConfig, prepare_text
from pretext_jax.models.gpt import GPT, GPTConfig
from pretext_jax.objectives.common.held_out import held_out_examples
from pretext_jax.objectives.common.losses import weighted_cross_entropy
from pretext_jax.objectives.common.masked_lm import check_max_seq_length
from pretext_jax.objectives.common.preset_parts import (
    NO_DROPOUT,
    TINY_TEXT_MODEL,
    TINY_TEXT_OPTIM,
    TINY_TEXT_TRAIN,
)
from pretext_jax.objectives.registry import (
    Batch,
    Method,
    Metrics,
    PreparedData,
    Resolution,
    Start,
    register,
)


def causal_lm_loss(model: GPT, batch: Batch, rng: jax.Array | None
                   ) -> tuple[jax.Array, Metrics]:
    """Next-token cross-entropy on a batch of `tokens` / `token_mask` [B, T + 1]."""
    tokens, mask = batch["tokens"], batch["token_mask"]
    logits = model(tokens[:, :-1], mask[:, :-1], rng=rng)
    loss, metrics = weighted_cross_entropy(logits, tokens[:, 1:], mask[:, 1:])
    return loss, {"loss": metrics["loss"], "accuracy": metrics["accuracy"]}


def build_gpt(config: GPTConfig, seed: int) -> GPT:
    return GPT(config, rngs=nnx.Rngs(seed))


def build_blocks(examples: gpt_examples.GPTExampleConfig, documents: Any, tokenizer: Any,
                 seed: int) -> Iterable[dict[str, np.ndarray]]:
    """`prepare_text`'s builder: blocks of the documents in their order (nothing is random)."""
    del seed
    return gpt_examples.create_training_examples(documents, tokenizer, examples)


def prepare_gpt(data: DataConfig, examples: gpt_examples.GPTExampleConfig, cache_dir: Path,
                seed: int) -> PreparedData:
    """Corpus -> tokenizer -> one stream with end-of-text between documents -> blocks (one
    stream per input shard)."""
    build = functools.partial(build_blocks, examples)
    train, held_out, tokenizer = prepare_text(data, build, examples, cache_dir, seed)
    eval_examples = held_out_examples(held_out)
    return PreparedData(
        train=train, eval=eval_examples,
        model_fields={"vocab_size": tokenizer.vocab_size, "eos_token_id": tokenizer.eos_id},
        report={"train_blocks": len(train), "end_of_text_id": tokenizer.eos_id},
        tokenizer=tokenizer,
    )


PRESETS = {
    # GPT at the demo/test size: no dropout, bias-corrected Adam, cosine decay (as gpt2_small).
    "gpt_tiny": {
        "model": {**TINY_TEXT_MODEL, "vocab_size": 0, **NO_DROPOUT, "embedding_dropout": 0.0},
        "examples": {"max_seq_length": 64},
        "data": {"vocab_size": 4000},
        "optim": {**TINY_TEXT_OPTIM, "schedule": "cosine", "eps": 1e-8},
        "train": {**TINY_TEXT_TRAIN, "batch_size": 32},
    },
    # GPT-2 small, 124M (Radford et al. 2019, Table 2 and §2.3: 12 layers, d_model 768, context
    # 1024, batch 512, vocabulary 50,257 with GPT-2's BPE: pass --tokenizer <a GPT-2 folder>;
    # without it a 50,257-piece sentencepiece model is trained). The paper gives no optimiser
    # details; these are GPT-1's (Radford et al. 2018 §4.1): Adam, max lr 2.5e-4, linear warmup
    # over 2,000 updates then cosine to 0, decoupled weight decay 0.01 on non-bias/gain
    # weights, dropout 0.1. 100k steps (52B tokens) is our choice, not the paper's.
    "gpt2_small": {
        "model": {"vocab_size": 0, "hidden_size": 768, "num_layers": 12, "num_heads": 12,
                  "intermediate_size": 3072, "max_position_embeddings": 1024},
        "examples": {"max_seq_length": 1024},
        "data": {"vocab_size": 50257},
        "optim": {"learning_rate": 2.5e-4, "schedule": "cosine", "warmup_steps": 2000,
                  "weight_decay": 0.01, "bias_correction": True, "eps": 1e-8},
        "train": {"steps": 100000, "batch_size": 512},
    },
}


register(Method(
    name="gpt",
    model_config=GPTConfig,
    example_config=gpt_examples.GPTExampleConfig,
    build_model=build_gpt,
    loss=causal_lm_loss,
    prepare=prepare_gpt,
    units_per_example=lambda examples: examples.max_seq_length,
    description="GPT-2: causal language model, next-token prediction (Radford et al. 2019)",
    presets=PRESETS,
    resolution=Resolution(check=check_max_seq_length),
    start=Start(hf_models=(GPT,)),
))
