"""Pre-train a small BERT on WikiText-2 and report held-out (valid split) MLM accuracy.

    python -m bench.pretrain_wikitext [--steps N] [--workdir DIR] [section.key=value ...]

Data: $PRETEXT_SHARED_DATA/wikitext-2 or ../shared/data/wikitext-2 (train.txt for training,
valid.txt held out). Prints one JSON line with the figures quoted in README.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax

import objectives  # noqa: F401  (registers the methods)
from pretrain.config import make_config
from pretrain.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent


def shared_data_dir() -> Path:
    """$PRETEXT_SHARED_DATA, else ../shared/data beside the repository."""
    return Path(os.environ.get("PRETEXT_SHARED_DATA", REPO.parent / "shared" / "data"))


def wikitext_dir() -> Path:
    path = shared_data_dir() / "wikitext-2"
    if not (path / "train.txt").is_file():
        sys.exit(f"WikiText-2 not found at {path}; set PRETEXT_SHARED_DATA")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--preset", default="bert_tiny")
    parser.add_argument("--workdir", default="runs/bench_wikitext")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    data = wikitext_dir()
    overrides = [
        f"data.source={data / 'train.txt'}", f"data.eval_source={data / 'valid.txt'}",
        "data.vocab_size=8000", "examples.max_seq_length=128",
        "examples.max_predictions_per_seq=20", "examples.dupe_factor=5",
        "model.max_position_embeddings=128", f"train.steps={args.steps}",
        f"train.eval_every={max(args.steps // 5, 1)}", "train.eval_batches=40",
        f"train.checkpoint_every={args.steps}", "train.log_every=100",
        f"optim.warmup_steps={args.steps // 10}", *args.overrides,
    ]
    config = make_config(args.preset, overrides)
    start = time.perf_counter()
    summary = Trainer(config, args.workdir).run()
    seconds = time.perf_counter() - start
    result = {
        "benchmark": "bert_wikitext2", "preset": args.preset, "steps": summary["step"],
        "batch_size": config.train.batch_size, "seq_len": config.example_config().max_seq_length,
        "held_out_mlm_accuracy": summary["eval"].get("mlm_accuracy"),
        "held_out_mlm_loss": summary["eval"].get("mlm_loss"),
        "held_out_nsp_accuracy": summary["eval"].get("nsp_accuracy"),
        "majority_baseline_mlm_accuracy":
            summary["report"].get("majority_baseline_mlm_accuracy"),
        "wall_clock_s": round(seconds, 1),
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
