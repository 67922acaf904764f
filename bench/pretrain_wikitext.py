"""Pre-train a small model on WikiText-2 and report its held-out (valid split) metrics.

    python -m bench.pretrain_wikitext [--preset bert_tiny|electra_tiny|xlnet_tiny|unilm_tiny|
        mass_tiny|elmo_tiny|...] [--steps N]
        [--workdir DIR] [section.key=value ...]

Data: $PRETEXT_SHARED_DATA/wikitext-2 or ../shared/data/wikitext-2 (train.txt for training,
valid.txt held out), sentencepiece 8k, sequences of 128. Prints one JSON line and writes the
Markdown row of docs/benchmarks.md ("Small models on WikiText-2"): every held-out metric and the
data's baselines (`bench.report`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax

from bench import report
from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent
# Sequence-128 settings per method: BERT/ELECTRA's masking budget; XLNet's half-reused segments
# with 21 targets (128 / 6, as 85 of 512) and memory of 96 (384 / 512 of the sequence);
# ProphetNet's learned positions cover the sequence; ELMo's windows of bilm-tf's 20 unrolled
# steps (its vocabulary is words: the 8,000 most frequent).
METHOD_OVERRIDES = {
    "bert": ["examples.max_predictions_per_seq=20", "examples.dupe_factor=5",
             "model.max_position_embeddings=128"],
    "electra": ["examples.max_predictions_per_seq=19", "model.max_position_embeddings=128"],
    "xlnet": ["examples.reuse_len=64", "examples.perm_size=64", "examples.num_predict=21",
              "model.reuse_len=64", "model.mem_len=96"],
    "unilm": ["examples.max_predictions_per_seq=20"],
    "prophetnet": ["model.max_position_embeddings=130"],  # see check_prophetnet
    "elmo": ["examples.max_seq_length=20"],
}


def shared_data_dir() -> Path:
    """$PRETEXT_SHARED_DATA, else ../shared/data beside the repository."""
    return Path(os.environ.get("PRETEXT_SHARED_DATA", REPO.parent / "shared" / "data"))


def wikitext_dir() -> Path:
    path = shared_data_dir() / "wikitext-2"
    if not (path / "train.txt").is_file():
        sys.exit(f"WikiText-2 not found at {path}; set PRETEXT_SHARED_DATA")
    return path


TABLE = report.Table("pretrain_wikitext", (
    "preset", "steps", "batch x seq", "held-out (valid.txt)", "baselines", "wall s"))


def markdown_cells(result: dict) -> list:
    """The row's cells: every held-out metric, and the report's baselines (majority token,
    unigram) beside them."""
    baselines = {k: v for k, v in result.items() if "baseline" in k and isinstance(v, float)}
    return [f"`{result['preset']}`", result["steps"],
            f"{result['batch_size']} x {result['seq_len']}", report.figures(result["held_out"]),
            report.figures(baselines) or None, f"{result['wall_clock_s']:.0f}"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--preset", default="bert_tiny")
    parser.add_argument("--workdir", default="runs/bench_wikitext")
    parser.add_argument("overrides", nargs="*")
    report.add_markdown_argument(parser, "pretrain_wikitext")
    args = parser.parse_args(argv)
    data = wikitext_dir()
    method = make_config(args.preset).method
    overrides = [
        f"data.source={data / 'train.txt'}", f"data.eval_source={data / 'valid.txt'}",
        "data.vocab_size=8000", "examples.max_seq_length=128", *METHOD_OVERRIDES.get(method, []),
        f"train.steps={args.steps}",
        f"train.eval_every={max(args.steps // 5, 1)}", "train.eval_batches=40",
        f"train.checkpoint_every={args.steps}", "train.log_every=100",
        f"optim.warmup_steps={args.steps // 10}", *args.overrides,
    ]
    config = make_config(args.preset, overrides)
    start = time.perf_counter()
    summary = Trainer(config, args.workdir).run()
    seconds = time.perf_counter() - start
    result = {
        "benchmark": f"{method}_wikitext2", "preset": args.preset, "steps": summary["step"],
        "batch_size": config.train.batch_size, "seq_len": config.examples.max_seq_length,
        "held_out": {k: round(v, 4) for k, v in summary["eval"].items()},
        **summary["report"],
        "wall_clock_s": round(seconds, 1),
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
    }
    print(json.dumps(result))
    report.write_row(TABLE, markdown_cells(result),
                     report.command_line("bench.pretrain_wikitext", argv), args.markdown)
    return result


if __name__ == "__main__":
    main()
