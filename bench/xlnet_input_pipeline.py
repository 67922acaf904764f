"""Host throughput of XLNet's input pipeline at XLNet-Base shapes, one CPU core.

    python -m bench.xlnet_input_pipeline [--batches N] [--workdir DIR]

Prepares WikiText-2 train.txt as XLNet records (seq 512, reuse 256, 85 targets, perm_size 256,
32 streams, bi_data), timing the one-off preparation, then times the loader that a training
run uses (decode + per-record factorisation orders + batching of 32, Grain, no worker
processes) over `--batches` batches. Prints one JSON line and the Markdown row of
docs/benchmarks.md ("XLNet input pipeline", `bench.report`); the figure to compare is sequences/s
against the GPU's consumption (`bench.throughput`'s reference for `xlnet_base`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench import report
from bench.pretrain_wikitext import wikitext_dir
from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.input_pipeline.records import make_loader
from pretext_jax.objectives import registry
from pretext_jax.pretrain.config import make_config

TABLE = report.Table("xlnet_input_pipeline", (
    "records", "preparation s (first run, tokenizer included)", "loader sequences/s"))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--workdir", default="runs/bench_xlnet_input")
    report.add_markdown_argument(parser, "xlnet_input_pipeline")
    args = parser.parse_args(argv)
    data = wikitext_dir()
    config = make_config("xlnet_base", [
        f"data.source={data / 'train.txt'}", f"data.eval_source={data / 'valid.txt'}",
        "data.vocab_size=8000", f"data.cache_dir={args.workdir}", "examples.num_streams=32",
        "train.batch_size=32"])
    method = registry.get(config.method)
    start = time.perf_counter()
    prepared = method.prepare(config.data, config.examples, Path(args.workdir),
                              config.train.seed)
    prepare_seconds = time.perf_counter() - start
    loader = iter(make_loader(prepared.train, batch_size=32, seed=0, shuffle=False,
                              transforms=prepared.transforms))
    next(loader)  # first batch: file opening
    start = time.perf_counter()
    for _ in range(args.batches):
        batch = next(loader)
    seconds = time.perf_counter() - start
    result = {
        "benchmark": "xlnet_input_pipeline", "records": len(prepared.train),
        "prepare_s (incl. tokenizer training, first run only)": round(prepare_seconds, 1),
        "loader_sequences_per_s": round(args.batches * 32 / seconds, 1),
        "batch_shapes": {k: list(v.shape) for k, v in batch.items()},
    }
    print(json.dumps(result))
    report.write_row(TABLE, [f"{len(prepared.train):,}", f"{prepare_seconds:.1f}",
                             f"{args.batches * 32 / seconds:.0f}"],
                     report.command_line("bench.xlnet_input_pipeline", argv), args.markdown,
                     devices=False)
    return result


if __name__ == "__main__":
    main()
