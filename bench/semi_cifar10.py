"""Semi-supervised fine-tuning on CIFAR-10 (SimCLR §4.2, B.5): an image method's backbone
fine-tuned on 1 % or 10 % of the labels against the same network fine-tuned from its random
initialisation, which is supervised training from scratch on the same labels with the same
recipe (the baseline pre-training has to beat).

    python -m bench.semi_cifar10 --init WORKDIR [--fractions 0.01,0.1] [--epochs E]
        [--workdir DIR] [key=value ...]

`--init`: an image method's workdir, e.g. `runs/bench_simclr_cifar10` from
`python -m bench.image_cifar10 --preset simclr_cifar10`. Data: $PRETEXT_SHARED_DATA/cifar10 or
../shared/data/cifar10. The recipe is `run.py finetune --task semi`'s (60 epochs for 1 %, 30
for 10 %; `--epochs` shortens it for a CPU budget); overrides after it win. Each fraction runs
in its own workdirs (`pretrained`, `random`), so an interrupted bench resumes. Prints one JSON
line per fraction and writes its Markdown row (`bench.report`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench import report
from bench.pretrain_wikitext import shared_data_dir
from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.pretrain.finetune import finetune, finetune_config

TABLE = report.Table("semi_cifar10", (
    "backbone (run)", "labels", "steps x batch", "top-1 from pre-trained",
    "top-1 from random init", "majority class", "fine-tuning s"))


def fine_tune(init: str, architecture: str, data: Path, fraction: float, workdir: Path,
              epochs: float | None, overrides: list[str]) -> tuple[dict[str, Any], Any, float]:
    """One fine-tuning run: its result, config and wall-clock seconds."""
    config = finetune_config("semi", init, str(data),
                             [f"examples.label_fraction={fraction}", *overrides],
                             epochs=epochs, architecture=architecture)
    start = time.perf_counter()
    result = finetune(config, workdir)
    return result, config, time.perf_counter() - start


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", required=True, help="an image method's workdir")
    parser.add_argument("--fractions", default="0.01,0.1")
    parser.add_argument("--epochs", type=float, default=None,
                        help="fine-tuning epochs (default: the recipe's, 60 for 1 %%, 30 for "
                             "10 %%)")
    parser.add_argument("--workdir", default="runs/bench_semi")
    parser.add_argument("overrides", nargs="*")
    report.add_markdown_argument(parser, "semi_cifar10")
    args = parser.parse_args(argv)
    data = shared_data_dir() / "cifar10"
    results = []
    for fraction in (float(f) for f in args.fractions.split(",")):
        root = Path(args.workdir) / f"labels{fraction:g}"
        trained, config, seconds = fine_tune(args.init, "", data, fraction, root / "pretrained",
                                             args.epochs, args.overrides)
        untrained, _, random_seconds = fine_tune("", args.init, data, fraction, root / "random",
                                                 args.epochs, args.overrides)
        result = {
            "benchmark": "semi_cifar10", "init": args.init, "label_fraction": fraction,
            "steps": trained["steps"], "batch_size": config.train.batch_size,
            "top1_pretrained": trained["dev"]["top1"], "top1_random_init": untrained["dev"]["top1"],
            "majority_class": trained["majority_baseline"]["top1"],
            "fine_tuning_s": round(seconds + random_seconds, 1),
            "command": report.command_line("bench.semi_cifar10", argv),
            "note": "CIFAR-10 pixels here are rebuilt from JPEG copies (lossy)",
        }
        print(json.dumps(result))
        report.write_row(TABLE, [args.init, f"{fraction:.0%}",
                                 f"{result['steps']} x {result['batch_size']}",
                                 result["top1_pretrained"], result["top1_random_init"],
                                 result["majority_class"], f"{result['fine_tuning_s']:.0f}"],
                         result["command"], args.markdown)
        results.append(result)
    return results


if __name__ == "__main__":
    main()
