"""Transformer-XL (Dai et al. 2019): causal language modelling over consecutive segments with
segment-level recurrence (§3.2) and relative positional encodings (§3.3).

Reference: kimiyoung/transformer-xl pytorch/train.py (`train`, `evaluate`), eval.py,
mem_transformer.py (`MemTransformerLM.forward`: the loss is the mean NLL over the segment's
tokens) and data_utils.py (`LMOrderedIterator`). Training reads B streams of consecutive
segments in order (`input_pipeline.examples.transformer_xl.StreamSegments`); each step reads the
memory the previous step left in `TransformerXL.memory` and writes the new one (train.py: `mems`
handed from batch to batch, no gradient through them). A row's first segment (`stream_offset`
0: the start of the run, and of every pass over the data, where train.py starts `train()` with
empty `mems`) sees no memory.

Evaluation is the paper's over long text (`long_text_evaluation`, eval.py): the held-out
stream as `eval_batch_size` streams of `eval_tgt_len`-token segments, each attending to
`eval_mem_len` cached states (with its own `eval_clamp_len`, `eval_same_length`), the loss the
mean NLL over every held-out token (perplexity = exp(loss)); beside it the same model without
memory (each segment alone). The trainer's own held-out loss is that of the training segments
read without memory.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import transformer_xl as txl_examples
from pretext_jax.input_pipeline.prepare import DataConfig, prepare_text
from pretext_jax.models.transformer_xl import TransformerXL, TransformerXLConfig
from pretext_jax.objectives.common.held_out import MAX_EVAL_EXAMPLES
from pretext_jax.objectives.common.losses import weighted_cross_entropy
from pretext_jax.objectives.common.preset_parts import NO_DROPOUT, TINY_TEXT_OPTIM
from pretext_jax.objectives.registry import (
    Batch,
    Evaluation,
    Method,
    Metrics,
    PreparedData,
    Resolution,
    register,
    whole_run,
)
from pretext_jax.progress import progress


@dataclasses.dataclass(frozen=True)
class TransformerXLEvaluation:
    """The long-text evaluation (eval.py flags; run_wt103_base.sh eval: tgt_len 64, mem_len 640,
    clamp_len 400, same_length, batch 10)."""

    eval_tgt_len: int = 64
    """Tokens per evaluated segment (eval.py --tgt_len)."""
    eval_mem_len: int = 640
    """Cached states per layer in the evaluation with memory (eval.py --mem_len)."""
    eval_clamp_len: int = 400
    """Distances above it share its encoding in evaluation; <= 0 = none (eval.py --clamp_len)."""
    eval_same_length: bool = True
    """Every query attends over eval_mem_len keys in the evaluation with memory (--same_length)."""
    eval_batch_size: int = 10
    """Parallel held-out streams (eval.py --batch_size 10)."""
    eval_max_tokens: int = 0
    """Evaluate the first n held-out tokens only; 0 = all."""

    def __post_init__(self) -> None:
        if self.eval_tgt_len < 1 or self.eval_batch_size < 1:
            raise UserError(f"objective.eval_tgt_len={self.eval_tgt_len} and "
                            f"objective.eval_batch_size={self.eval_batch_size} must be >= 1 "
                            "(eval.py: 64 and 10)")
        if self.eval_mem_len < 1:
            raise UserError(f"objective.eval_mem_len={self.eval_mem_len} must be >= 1 (the "
                            "evaluation without memory is always reported beside it); e.g. 640")
        if self.eval_max_tokens < 0:
            raise UserError(f"objective.eval_max_tokens={self.eval_max_tokens} must be >= 0 "
                            "(0 = the whole held-out text)")


def segment_nll(model: TransformerXL, batch: Batch, mems: jax.Array | None,
                rng: jax.Array | None, **attention: Any) -> tuple[jax.Array, Metrics, Any]:
    """(mean NLL, metrics, new memory) of a batch of segments (`tokens`, `token_mask`,
    `stream_offset`) after the memory `mems` (None: none), whose first min(M, stream_offset)
    states per row hold earlier tokens of the row (the rest are empty)."""
    tokens, mask = batch["tokens"], batch["token_mask"]
    length = None if mems is None else jnp.minimum(batch["stream_offset"], mems.shape[2])
    out = model(tokens[:, :-1], mems=mems, memory_length=length, rng=rng, **attention)
    loss, metrics = weighted_cross_entropy(out.logits, tokens[:, 1:], mask[:, 1:], epsilon=0.0)
    return loss, metrics, out.new_mems


def transformer_xl_loss(model: TransformerXL, batch: Batch, rng: jax.Array | None, *,
                        objective: TransformerXLEvaluation) -> tuple[jax.Array, Metrics]:
    """Mean next-token NLL of the segments; in training (`rng` given) after the memory the
    previous step left, which this step replaces (`rng=None`: the held-out segments alone).
    `objective` holds only the long-text evaluation's settings."""
    del objective
    carry = rng is not None and hasattr(model, "memory")
    loss, metrics, new_mems = segment_nll(model, batch, model.memory[...] if carry else None,
                                          rng)
    if carry:
        model.memory[...] = new_mems
    return loss, {"loss": metrics["loss"], "accuracy": metrics["accuracy"]}


@functools.partial(nnx.jit, static_argnames=("clamp_len", "same_length"))
def _evaluation_step(model: TransformerXL, batch: Batch, mems: jax.Array | None,
                     clamp_len: int, same_length: bool) -> tuple[Metrics, Any]:
    _, metrics, new_mems = segment_nll(model, batch, mems, None, clamp_len=clamp_len,
                                       same_length=same_length)
    return metrics["loss"], new_mems


def long_text_nll(model: TransformerXL, stream: np.ndarray, settings: TransformerXLEvaluation,
                  memory: bool) -> tuple[float, float]:
    """(summed NLL, tokens) of `stream` read as `eval_batch_size` streams of `eval_tgt_len`
    segments in order (eval.py `evaluate`), with `eval_mem_len` states of memory carried from
    segment to segment, or (`memory=False`) each segment alone."""
    segments = txl_examples.StreamSegments(stream, settings.eval_batch_size,
                                           settings.eval_tgt_len, "held-out",
                                           "objective.eval_batch_size")
    c = model.config
    mems = (jnp.zeros((c.num_layers, settings.eval_batch_size, settings.eval_mem_len,
                       c.hidden_size), jnp.float32) if memory else None)
    totals = np.zeros(2)
    for step in progress(range(segments.batches), "held-out text", unit="segment"):
        pair, mems = _evaluation_step(model, segments.batch(step), mems,
                                      clamp_len=settings.eval_clamp_len,
                                      same_length=memory and settings.eval_same_length)
        totals += np.asarray(jax.device_get(pair), np.float64)
    return float(totals[0]), float(totals[1])


def long_text_evaluation(model: TransformerXL, data: PreparedData, examples: Any,
                         objective: TransformerXLEvaluation) -> dict[str, float]:
    """The held-out text's loss with memory (`memory_loss`) and without (`no_memory_loss`),
    per token, at the evaluation settings (`data.monitor_data`: the held-out stream). The
    evaluation without memory reads the segments without `same_length` (with no memory it
    would leave a query no key)."""
    del examples
    stream = data.monitor_data
    if objective.eval_max_tokens:
        stream = stream[:objective.eval_max_tokens]
    results = {}
    for name, memory in (("memory", True), ("no_memory", False)):
        total, count = long_text_nll(model, stream, objective, memory)
        results[f"{name}_loss"] = total / count
    results["long_text_tokens"] = count
    return results


def summarize_transformer_xl(evaluation: dict[str, float], report: dict[str, Any],
                             untrained: Callable[[], dict[str, float]]) -> list[str]:
    """Held-out perplexity with memory, without, and the training unigram distribution's."""
    del untrained
    if "memory_loss" not in evaluation:
        return []
    baseline = report.get("unigram_baseline_loss", float("nan"))
    return [f"  held-out perplexity with memory {math.exp(evaluation['memory_loss']):.2f}, "
            f"without {math.exp(evaluation['no_memory_loss']):.2f}, unigram baseline "
            f"{math.exp(baseline):.2f} ({evaluation['long_text_tokens']:.0f} tokens)"]


def unigram_baseline_loss(train: np.ndarray, held_out: np.ndarray, vocab_size: int) -> float:
    """Per-token NLL of the held-out stream's targets (all tokens but the first) under the
    training stream's token frequencies (add-one smoothed over the vocabulary)."""
    counts = np.bincount(train, minlength=vocab_size) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[held_out[1:]].mean())


def build_transformer_xl(config: TransformerXLConfig, seed: int) -> TransformerXL:
    return TransformerXL(config, rngs=nnx.Rngs(seed))


def prepare_transformer_xl(data: DataConfig,
                           examples: txl_examples.TransformerXLExampleConfig,
                           cache_dir: Path, seed: int) -> PreparedData:
    """Corpus -> tokenizer -> one token stream per split (documents in order, end-of-text after
    each), stored in chunks (the cache does not depend on the segment length or the stream
    count) -> the training stream's ordered segments; the held-out stream for the long-text
    evaluation, and its segments of `tgt_len` (at most `MAX_EVAL_EXAMPLES`, in up to
    `num_streams` rows) for the trainer's held-out loss."""
    train, held_out, tokenizer = prepare_text(
        data, txl_examples.create_training_examples, {"chunk": txl_examples.CHUNK},
        cache_dir, seed, ordered=True)
    streams = {name: txl_examples.token_stream(records.examples(range(len(records))))
               for name, records in (("train", train), ("eval", held_out))}
    segments = txl_examples.StreamSegments(streams["train"], examples.num_streams,
                                           examples.tgt_len, repr(train.source))
    rows = min(examples.num_streams, max(1, len(streams["eval"]) // (examples.tgt_len + 1)))
    held_out_segments = txl_examples.StreamSegments(streams["eval"], rows, examples.tgt_len,
                                                    "held-out")
    return PreparedData(
        train=segments,
        eval=held_out_segments.examples(range(min(len(held_out_segments), MAX_EVAL_EXAMPLES))),
        model_fields={"vocab_size": tokenizer.vocab_size,
                      "memory_batch_size": examples.num_streams},
        report={"train_tokens": len(streams["train"]), "held_out_tokens": len(streams["eval"]),
                "unigram_baseline_loss": unigram_baseline_loss(
                    streams["train"], streams["eval"], tokenizer.vocab_size)},
        segments=whole_run(segments, shuffle=False, check=functools.partial(
            check_streams, streams=examples.num_streams)),
        monitor_data=streams["eval"],
        tokenizer=tokenizer)


def check_streams(config: Any, streams: int) -> None:
    """The segments are laid out for `streams` rows whose memory carries from step to step: the
    global batch is that layout's, in one micro-batch and one process."""
    if config.train.batch_size != streams:
        raise UserError(f"train.batch_size={config.train.batch_size} must equal "
                        f"examples.num_streams={streams} (one batch row per stream, whose "
                        "memory carries to the next step); set both to the same value")
    if config.optim.grad_accum_steps != 1 or jax.process_count() != 1:
        raise UserError("Transformer-XL's carried memory needs optim.grad_accum_steps=1 and a "
                        "single process; use a smaller batch or more devices")


def check_transformer_xl(model: TransformerXLConfig,
                         examples: txl_examples.TransformerXLExampleConfig,
                         objective: TransformerXLEvaluation) -> None:
    """`same_length` needs memory (without it every query would see no key)."""
    del examples, objective
    if model.same_length and model.mem_len < 1:
        raise UserError("model.same_length=true needs model.mem_len >= 1 (with no memory it "
                        "masks every key); set model.mem_len or model.same_length=false")


# Transformer-XL at the test size: 2 layers of 32, segments of 16 tokens with 16 of memory.
TINY_MODEL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64,
              "vocab_size": 0, "mem_len": 16, **NO_DROPOUT}

PRESETS = {
    "transformer_xl_tiny": {
        "model": TINY_MODEL,
        "examples": {"tgt_len": 16, "num_streams": 8},
        "objective": {"eval_tgt_len": 8, "eval_mem_len": 32, "eval_clamp_len": 24,
                      "eval_batch_size": 4, "eval_max_tokens": 4096},
        "data": {"vocab_size": 2000},
        "optim": {**TINY_TEXT_OPTIM, "schedule": "cosine", "weight_decay": 0.0, "eps": 1e-8},
        "train": {"steps": 400, "batch_size": 8, "log_every": 25, "eval_every": 200,
                  "checkpoint_every": 200},
    },
    # run_wt103_base.sh (train): 16 layers, d_model 410, 10 heads of 41, d_inner 2100, dropout
    # 0.1, dropatt 0, segments of 150 with 150 of memory, batch 60, Adam (torch's: bias
    # correction, eps 1e-8, no weight decay) at 2.5e-4, no warmup, cosine to 0 over 200k steps
    # (train.py --scheduler cosine, eta_min 0), gradients clipped to norm 0.25 (--clip); (eval):
    # segments of 64 with 640 of memory, clamp_len 400, same_length, batch 10. A full softmax
    # over a 32,000-piece vocabulary instead of the adaptive input/softmax over WikiText-103's
    # 267,735 words (the recipe card's departures).
    "transformer_xl_wt103_base": {
        "model": {"hidden_size": 410, "num_layers": 16, "num_heads": 10,
                  "intermediate_size": 2100, "hidden_dropout": 0.1, "attention_dropout": 0.0,
                  "mem_len": 150, "vocab_size": 0},
        "examples": {"tgt_len": 150, "num_streams": 60},
        "objective": {"eval_tgt_len": 64, "eval_mem_len": 640, "eval_clamp_len": 400,
                      "eval_same_length": True, "eval_batch_size": 10},
        "data": {"vocab_size": 32000},
        "optim": {"learning_rate": 2.5e-4, "schedule": "cosine", "warmup_steps": 0,
                  "end_learning_rate": 0.0, "weight_decay": 0.0, "bias_correction": True,
                  "eps": 1e-8, "clip_norm": 0.25},
        "train": {"steps": 200000, "batch_size": 60},
    },
}

register(Method(
    name="transformer_xl",
    model_config=TransformerXLConfig,
    example_config=txl_examples.TransformerXLExampleConfig,
    objective_config=TransformerXLEvaluation,
    build_model=build_transformer_xl,
    loss=transformer_xl_loss,
    prepare=prepare_transformer_xl,
    units_per_example=lambda examples: examples.tgt_len,
    description="Transformer-XL: causal LM with segment-level recurrence (Dai et al. 2019)",
    presets=PRESETS,
    resolution=Resolution(check=check_transformer_xl),
    evaluation=Evaluation(monitor=long_text_evaluation, summarize=summarize_transformer_xl),
))
