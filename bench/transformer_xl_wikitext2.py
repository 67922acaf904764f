"""Train a small Transformer-XL on WikiText-2 and report the held-out perplexity with carried
memory beside the same model read without memory and the training unigram distribution.

    python -m bench.transformer_xl_wikitext2 [--steps N] [--workdir DIR] [section.key=value ...]

Data: $PRETEXT_SHARED_DATA/wikitext-2 or ../shared/data/wikitext-2 (train.txt for training,
valid.txt held out), a 4,000-piece sentencepiece vocabulary trained on train.txt (perplexities
are per piece, not per WikiText word, so they do not compare with word-level figures).
Settings: `transformer_xl_tiny` widened to 2 layers of 64 (4 heads of 16, d_inner 256),
segments of 64 tokens with 64 of memory in 8 streams, Adam at 1e-3 with 100 warmup steps and
cosine decay, 2,400 steps (1.2M tokens, about 0.4 of a pass over train.txt). The evaluation
reads the first 40,000 held-out pieces as 10 streams of 64-token segments, with 128 cached
states per layer (same_length) and without memory; the unigram baseline is the training
pieces' frequencies on all of valid.txt. Prints one JSON line and the Markdown row of
docs/benchmarks.md ("Transformer-XL on WikiText-2", `bench.report`).
"""

from __future__ import annotations

import argparse
import json
import math
import time

from bench import report
from bench.pretrain_wikitext import wikitext_dir
from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

TABLE = report.Table("transformer_xl_wikitext2", (
    "steps", "train pieces", "held-out pieces", "perplexity with memory",
    "without memory", "unigram", "wall s"))


def markdown_cells(result: dict) -> list:
    return [result["steps"], f"{result['train_tokens']:,}", f"{result['eval_tokens']:,}",
            f"{result['memory_perplexity']:.2f} (tgt_len {result['eval_tgt_len']}, mem_len "
            f"{result['eval_mem_len']})", f"{result['no_memory_perplexity']:.2f}",
            f"{result['unigram_perplexity']:.2f}", f"{result['wall_clock_s']:.0f}"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2400)
    parser.add_argument("--workdir", default="runs/bench_transformer_xl")
    parser.add_argument("overrides", nargs="*")
    report.add_markdown_argument(parser, "transformer_xl_wikitext2")
    args = parser.parse_args(argv)
    data = wikitext_dir()
    overrides = [
        f"data.source={data / 'train.txt'}", f"data.eval_source={data / 'valid.txt'}",
        "data.vocab_size=4000", "model.hidden_size=64", "model.num_heads=4",
        "model.intermediate_size=256", "model.mem_len=64", "examples.tgt_len=64",
        "examples.num_streams=8", "train.batch_size=8", "objective.eval_tgt_len=64",
        "objective.eval_mem_len=128", "objective.eval_clamp_len=-1",
        "objective.eval_batch_size=10", "objective.eval_max_tokens=40000",
        "optim.learning_rate=1e-3", "optim.warmup_steps=100", f"train.steps={args.steps}",
        f"train.eval_every={args.steps}", f"train.checkpoint_every={args.steps}",
        "train.eval_batches=20", "train.log_every=100", *args.overrides,
    ]
    config = make_config("transformer_xl_tiny", overrides)
    start = time.perf_counter()
    trainer = Trainer(config, args.workdir)
    summary = trainer.run()
    seconds = time.perf_counter() - start
    evaluation, facts = summary["eval"], trainer.data.report
    result = {
        "benchmark": "transformer_xl_wikitext2", "steps": summary["step"],
        "train_tokens": facts["train_tokens"], "eval_tokens": int(evaluation["long_text_tokens"]),
        "eval_tgt_len": config.objective.eval_tgt_len,
        "eval_mem_len": config.objective.eval_mem_len,
        "memory_perplexity": round(math.exp(evaluation["memory_loss"]), 3),
        "no_memory_perplexity": round(math.exp(evaluation["no_memory_loss"]), 3),
        "unigram_perplexity": round(math.exp(facts["unigram_baseline_loss"]), 3),
        "wall_clock_s": round(seconds, 1)}
    print(json.dumps(result))
    report.write_row(TABLE, markdown_cells(result),
                     report.command_line("bench.transformer_xl_wikitext2", argv), args.markdown)
    return result


if __name__ == "__main__":
    main()
