"""Every image method on the same CIFAR-10 budget: `bench.image_cifar10` for each preset with
the same steps and batch of images, then one Markdown table of kNN and linear-probe accuracy of
the frozen backbone beside the same backbone untrained.

    python -m bench.image_table [--steps 200] [--batch-size 128] [--results FILE] [--presets P,..]

Each finished preset is appended to `--results` (JSON lines) and skipped when the command runs
again, so an interrupted table resumes. The batch counts images: a method that makes several
inputs of each (two views, four rotations, nine tiles, two patches) sees the same images as one
that makes one. CIFAR-10 pixels here are rebuilt from JPEG copies (lossy). The table is
`bench.image_cifar10`'s (`bench.report`): each row names the machine, date and command of its
own run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import image_cifar10

PRESETS = ("simclr_cifar10", "moco_tiny", "byol_tiny", "rotation_cifar10", "jigsaw_tiny",
           "context_cifar10", "deepcluster_cifar10", "cmc_cifar10", "dim_cifar10", "amdim_cifar10",
           "local_aggregation_cifar10")


def table(rows: list[dict]) -> str:
    """The Markdown table of finished runs (`image_cifar10.TABLE`)."""
    return "\n".join([image_cifar10.TABLE.header(), *map(image_cifar10.markdown_row, rows)])


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--results", default="runs/image_table.jsonl")
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--workdir-root", default="runs/image_table")
    args = parser.parse_args(argv)
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    done = {row["preset"]: row for row in map(json.loads, results.read_text().splitlines())
            } if results.exists() else {}
    for preset in args.presets.split(","):
        if preset in done:
            continue
        row = image_cifar10.main([
            "--preset", preset, "--steps", str(args.steps),
            "--workdir", f"{args.workdir_root}/{preset}", f"train.batch_size={args.batch_size}"])
        with results.open("a") as f:
            f.write(json.dumps(row) + "\n")
        done[preset] = row
    rows = [done[preset] for preset in args.presets.split(",")]
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
