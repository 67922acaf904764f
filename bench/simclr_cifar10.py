"""SimCLR on CIFAR-10: pre-train, then kNN and linear evaluation of the frozen backbone.

    python -m bench.simclr_cifar10 [--steps N] [--workdir DIR] [section.key=value ...]

Data: $PRETEXT_SHARED_DATA/cifar10 or ../shared/data/cifar10 (python pickles; rebuilt from
JPEG copies, so pixels are lossy). Defaults fit a CPU: `simclr_cifar10`'s recipe (CIFAR stem,
temperature 0.5, jitter 0.5, no blur, LARS, cosine) with a ResNet-18 of 16 base channels
(`model.base_width=16`), batch 256. After training: kNN (k 200, temperature 0.1) with the
50,000 training images as the bank, and a linear probe on frozen features (train 50,000, test
10,000), for the trained backbone and for the same backbone at its random initialisation (the
baseline any learning has to beat). Prints one JSON line with the throughput in augmented
views per second.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from bench.pretrain_wikitext import shared_data_dir
from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.input_pipeline.images import read_cifar10
from pretext_jax.objectives import registry
from pretext_jax.objectives.evaluation import extract_features, knn_accuracy, linear_probe_accuracy
from pretext_jax.objectives.two_view import backbone_features
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.export import load_model
from pretext_jax.pretrain.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--workdir", default="runs/bench_simclr_cifar10")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    data = shared_data_dir() / "cifar10"
    config = make_config("simclr_cifar10", [
        f"data.source={data}", "model.base_width=16", "train.batch_size=256",
        f"train.steps={args.steps}", f"optim.warmup_steps={args.steps // 20}",
        "optim.learning_rate=1.0", f"train.eval_every={args.steps}",
        f"train.checkpoint_every={args.steps}", "train.eval_batches=4", "train.log_every=50",
        "examples.knn_bank_size=10000", *args.overrides])
    start = time.perf_counter()
    summary = Trainer(config, args.workdir).run()
    seconds = time.perf_counter() - start
    train_images, train_labels = read_cifar10(data, "train")
    test_images, test_labels = read_cifar10(data, "test")
    view_size = config.objective_config().image_size

    def evaluate(model: nnx.Module) -> dict[str, float]:
        train_features, test_features = (
            extract_features(
                lambda x: backbone_features(model, x, view_size), images)
            for images in (train_images, test_images))
        return {"knn_accuracy_k200": knn_accuracy(train_features, train_labels, test_features,
                                                  test_labels, 10),
                "linear_probe_accuracy": linear_probe_accuracy(
                    train_features, train_labels, test_features, test_labels, 10)}

    trained = evaluate(load_model(args.workdir))
    untrained = evaluate(registry.get("simclr").build_model(config.model_config(),
                                                            config.train.seed))
    rows = [json.loads(line)
            for line in (Path(args.workdir) / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["views_per_s"] for r in rows if r["split"] == "train" and "views_per_s" in r]
    print(json.dumps({
        "benchmark": "simclr_cifar10", "steps": summary["step"],
        "batch_size": config.train.batch_size, "backbone": "ResNet-18, CIFAR stem, width 16",
        **trained,
        "untrained_backbone": untrained,
        "final_train_contrastive_accuracy": summary["train"].get("contrastive_accuracy"),
        "views_per_s_after_compile": float(np.median(speeds[1:] or speeds)) if speeds else None,
        "wall_clock_s": round(seconds, 1),
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "note": "CIFAR-10 pixels here are rebuilt from JPEG copies (lossy)",
    }))


if __name__ == "__main__":
    main()
