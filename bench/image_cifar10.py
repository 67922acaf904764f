"""Any image method on CIFAR-10: pre-train a preset for N steps, then kNN and linear evaluation
of its frozen backbone against the same backbone untrained.

    python -m bench.image_cifar10 --preset PRESET [--steps N] [--workdir DIR] [--recipe]
        [--train-seconds S] [key=value ...]

Data: $PRETEXT_SHARED_DATA/cifar10 or ../shared/data/cifar10 (python pickles; rebuilt from JPEG
copies, so pixels are lossy). Every preset runs with CPU-sized defaults: a ResNet of 16 base
channels (`model.base_width=16`; AMDIM's encoder: `model.ndf=16`, `model.n_rkhs=256`, the
reference's 3 layers a block), evaluation and a checkpoint at the last step on 4 held-out
batches, and a kNN bank of 10,000 training images during training; the presets below also get
their own (SimCLR: batch 256, LARS lr 1.0 with 5% warmup; RotNet: batch 128 images = 512
rotated copies, the lr steps at 30/60/80% of the run as the paper's 60/120/160 of 200 epochs;
MoCo: batch 128 at the CIFAR demo's lr scaled to it; DeepCluster: batch 128, re-clustering 4
times in the run, PCA to 64 of the 128 features; CMC: two ResNets of 8 base channels, the L and
ab halves of one 16-wide network as the reference's half-width `v1` models, its lr steps at
50/67/83% as 120/160/200 of 240 epochs; AMDIM: warmup min(500, 5% of the run), the lr steps at
epochs 250 and 280 of 300 as fractions of the run; Local Aggregation: batch 128, half the run
instance recognition, then two rounds of 3 clusterings, the lr steps at 80/93.5% as 160/187 of
200 epochs); `--recipe` keeps the preset's own model
and recipe instead (GPU runs). Overrides after them win. `--train-seconds` stops pre-training
with a checkpoint after that long (printing a JSON line with `stopped_by`, evaluating nothing);
the same command resumes the workdir exactly. After training:
kNN (k 200, temperature 0.1) with the 50,000 training images as the bank, and a linear probe on
frozen features (train 50,000, test 10,000), for the trained backbone and for the same backbone
at its random initialisation (the baseline any learning has to beat). Prints one JSON line
and writes the Markdown row of docs/benchmarks.md ("Image methods on CIFAR-10", `bench.report`);
`main(argv)` returns the result as a dict, with the row's machine, date and command in it
(`bench.image_table` builds its table from those).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from bench import report
from bench.pretrain_wikitext import shared_data_dir
from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.input_pipeline.images import read_cifar10
from pretext_jax.models.cmc import CMCConfig
from pretext_jax.objectives import registry
from pretext_jax.objectives.common.evaluation import (
    extract_features,
    knn_accuracy,
    linear_probe_accuracy,
)
from pretext_jax.objectives.common.two_view import backbone_features
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.loading import load_model
from pretext_jax.pretrain.trainer import Trainer

TABLE = report.Table("image_cifar10", (
    "method (preset)", "backbone", "steps x batch", "kNN k=200", "linear",
    "untrained kNN / linear", "pre-training s"))


def markdown_cells(result: dict[str, Any]) -> list:
    untrained = result["untrained_backbone"]
    return [f"{result['method']} (`{result['preset']}`)", result["backbone"],
            f"{result['steps']} x {result['batch_size']}", result["knn_accuracy_k200"],
            result["linear_probe_accuracy"],
            f"{untrained['knn_accuracy_k200']:.3f} / {untrained['linear_probe_accuracy']:.3f}",
            f"{result['pretrain_wall_clock_s']:.0f}"]


def markdown_row(result: dict[str, Any]) -> str:
    """The result's row, with the machine, date and command recorded in it."""
    return TABLE.row(markdown_cells(result), result["command"], result.get("machine"),
                     result.get("date"))


def decay_boundaries(steps: int, *fractions: float) -> str:
    """The override putting a step schedule's lr drops at these fractions of a run; in a run
    too short to tell them apart, each drop at least one step after the one before (the
    schedule wants increasing steps)."""
    boundaries: list[int] = []
    for fraction in fractions:
        boundaries.append(max(round(steps * fraction), boundaries[-1] + 1 if boundaries else 1))
    return "optim.decay_boundaries=" + ",".join(map(str, boundaries))


def preset_defaults(preset: str, steps: int, cpu_sized: bool = True) -> list[str]:
    """The settings of `preset` for a run of `steps`: the run length and evaluation settings,
    and unless `cpu_sized` is False the CPU-sized model and recipe (module docstring)."""
    run = [f"train.steps={steps}", f"train.eval_every={steps}", f"train.checkpoint_every={steps}",
           "train.eval_batches=4", "train.log_every=50", "examples.knn_bank_size=10000"]
    if not cpu_sized:
        return run
    width = (["model.ndf=16", "model.n_rkhs=256"] if preset.startswith("amdim")
             else ["model.base_width=16"])
    own = {
        "simclr_cifar10": ["train.batch_size=256", "optim.learning_rate=1.0",
                           f"optim.warmup_steps={steps // 20}"],
        "rotation_cifar10": ["train.batch_size=128", decay_boundaries(steps, 0.3, 0.6, 0.8)],
        "cmc_cifar10": ["model.base_width=8", decay_boundaries(steps, 0.5, 2 / 3, 5 / 6)],
        # The CIFAR-10 demo's lr 0.06 at batch 512, scaled to the bench's batch 128.
        "moco_tiny": ["train.batch_size=128", "optim.learning_rate=0.015"],
        # Four re-clusterings in the run instead of one per epoch; PCA to half the features
        # (the preset's 256 of ResNet-18's 512; width 16 gives 128).
        "deepcluster_cifar10": ["train.batch_size=128", "objective.pca_dim=64",
                                f"objective.recluster_every={max(1, steps // 4)}"],
        # Half the run instance recognition, then two rounds of local aggregation (the
        # preset's 10 of 200 epochs would leave 10 steps of warm-up), 3 clusterings instead of
        # 10 (host k-means over the 50,000-row bank), the lr drops at 160/200 and 187/200.
        "local_aggregation_cifar10": [
            "train.batch_size=128", f"objective.instance_steps={steps // 2}",
            f"objective.recluster_every={max(1, (steps - steps // 2) // 2)}",
            "model.num_clusterings=3", decay_boundaries(steps, 160 / 200, 187 / 200)],
        "amdim_cifar10": [f"optim.warmup_steps={min(500, steps // 20)}",
                          decay_boundaries(steps, 250 / 300, 280 / 300)],
    }
    return [*width, *run, *own.get(preset, [])]


def describe(model: Any) -> str:
    """The backbone in words: a ResNet's depth, stem and width (CMC: two of them, on L and on
    ab; DeepCluster: behind the Sobel filter where it has one), or AMDIM's encoder sizes."""
    if hasattr(model, "depth"):
        resnet = f"ResNet-{model.depth}, {model.stem} stem, width {model.base_width}"
        if isinstance(model, CMCConfig):
            return f"2 x {resnet} (L, ab)"
        return f"Sobel + {resnet}" if getattr(model, "sobel", False) else resnet
    return f"AMDIM encoder, ndf {model.ndf}, n_rkhs {model.n_rkhs}, n_depth {model.n_depth}"


def frozen_evaluation(model: nnx.Module, view_size: int, data: Path) -> dict[str, float]:
    """kNN (bank: the 50,000 training images) and linear-probe test accuracy of the
    backbone's features of CIFAR-10 at `view_size`."""
    (train, train_labels), (test, test_labels) = (read_cifar10(data, split)
                                                  for split in ("train", "test"))
    train_features, test_features = (
        extract_features(lambda x: backbone_features(model, x, view_size), images)
        for images in (train, test))
    return {"knn_accuracy_k200": knn_accuracy(train_features, train_labels, test_features,
                                              test_labels, 10),
            "linear_probe_accuracy": linear_probe_accuracy(train_features, train_labels,
                                                           test_features, test_labels, 10)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True, help="an image preset, e.g. simclr_cifar10")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--workdir", default="", help="default runs/bench_<preset>")
    parser.add_argument("--recipe", action="store_true",
                        help="keep the preset's own model and recipe (a GPU run) instead of the "
                             "CPU-sized defaults; only the run length and evaluation are set")
    parser.add_argument("--train-seconds", type=float, default=None,
                        help="stop pre-training after this many seconds with a checkpoint and "
                             "evaluate nothing; the same command again resumes the workdir")
    parser.add_argument("overrides", nargs="*")
    report.add_markdown_argument(parser, "image_cifar10")
    args = parser.parse_args(argv)
    data = shared_data_dir() / "cifar10"
    workdir = Path(args.workdir or f"runs/bench_{args.preset}")
    config = make_config(args.preset, [f"data.source={data}",
                                       *preset_defaults(args.preset, args.steps,
                                                        cpu_sized=not args.recipe),
                                       *args.overrides])
    method = registry.get(config.method)
    start = time.perf_counter()
    deadline = None if args.train_seconds is None else time.monotonic() + args.train_seconds
    summary = Trainer(config, workdir).run(deadline=deadline)
    seconds = time.perf_counter() - start
    if summary["stopped_by"]:
        stopped = {"benchmark": "image_cifar10", "preset": args.preset,
                   "stopped_by": summary["stopped_by"], "step": summary["step"],
                   "steps": config.train.steps, "workdir": str(workdir),
                   "pretrain_wall_clock_s": round(seconds, 1)}
        print(json.dumps(stopped))
        return stopped
    view_size = config.objective.image_size
    trained = frozen_evaluation(load_model(workdir), view_size, data)
    untrained = frozen_evaluation(method.build_model(config.model, config.train.seed),
                                  view_size, data)
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    speed = f"{method.unit}_per_s"
    speeds = [r[speed] for r in rows if r["split"] == "train" and speed in r]
    model = config.model
    result = {
        "benchmark": "image_cifar10", "preset": args.preset, "method": config.method,
        "steps": summary["step"], "batch_size": config.train.batch_size,
        "backbone": describe(model),
        **trained, "untrained_backbone": untrained,
        "final_train": summary["train"],
        f"{speed}_after_compile": float(np.median(speeds[1:] or speeds)) if speeds else None,
        "pretrain_wall_clock_s": round(seconds, 1),
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "command": report.command_line("bench.image_cifar10", argv),
        "note": "CIFAR-10 pixels here are rebuilt from JPEG copies (lossy)",
    }
    print(json.dumps(result))
    result |= {"machine": report.this_machine(), "date": time.strftime("%Y-%m-%d")}
    report.write_row(TABLE, markdown_cells(result), result["command"], args.markdown,
                     machine=result["machine"], date=result["date"])
    return result


if __name__ == "__main__":
    main()
