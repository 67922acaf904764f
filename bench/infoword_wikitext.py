"""InfoWord against BERT for the same number of steps on WikiText-2, and the untrained network.

    python -m bench.infoword_wikitext [--steps N] [--probe-train N] [--workdir DIR]
        [section.key=value ...]

`bert_tiny` and `infoword_tiny` (the same encoder: hidden 64, 2 layers, 4 heads) share one
sentencepiece vocabulary trained on WikiText-2 train.txt, the optimizer, the batch (64 x 128
tokens), the seed (so the same initial parameters) and the step count. Both trained models and
the untrained one are scored on the same held-out records: BERT's (valid.txt, static 15% masks
drawn once with a fixed seed), 40 batches, MLM accuracy through BERT's own loss code
(`losses.mlm_and_pair_loss`). InfoWord's own held-out metrics (its n-gram-masked records,
`dim_accuracy`: the sentence picks its own n-gram among the batch's 64) are reported beside.
Then a linear probe on GLUE SST-2 (logistic regression on frozen, mean-pooled final states;
`bench.electra_vs_bert`'s probe) for each encoder. Data: $PRETEXT_SHARED_DATA or
../shared/data (wikitext-2/, glue/SST-2/). Prints one JSON line and writes the Markdown rows
of docs/benchmarks.md ("InfoWord against BERT"): one per model.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench import report
from bench.electra_vs_bert import (
    encode,
    features,
    linear_probe,
    read_sst2,
    wikitext_tokenizer,
)
from bench.pretrain_wikitext import shared_data_dir, wikitext_dir
from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.input_pipeline import tokenizers
from pretext_jax.objectives import registry
from pretext_jax.objectives.common.losses import mlm_and_pair_loss
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.loading import load_model
from pretext_jax.pretrain.metrics import reduce_metrics
from pretext_jax.pretrain.trainer import Trainer

TABLE = report.Table("infoword_wikitext", (
    "model", "steps", "held-out MLM accuracy (BERT's masks)", "own held-out metrics",
    "SST-2 dev probe", "wall s"))


def markdown_rows(result: dict) -> list[list]:
    """One row per model: the two trained presets, then the untrained network."""
    return [[f"`{name}`" if name in ("bert_tiny", "infoword_tiny") else name, run["steps"],
             run["mlm_accuracy"], report.figures(run["own_held_out"]) or None,
             run["sst2_probe_dev_accuracy"], run["wall_clock_s"]]
            for name, run in result["models"].items()]


def mlm_accuracy(model: nnx.Module, records: dict[str, np.ndarray], batches: int,
                 batch: int = 64) -> float:
    """Held-out MLM accuracy of a `Bert` on BERT's records (exact sums over `batches`)."""
    run = nnx.jit(lambda module, rows: mlm_and_pair_loss(module, rows, None)[1])
    sums = None
    for start in range(0, min(len(records["input_ids"]) // batch, batches) * batch, batch):
        metrics = run(model, {k: jnp.asarray(v[start:start + batch]) for k, v in records.items()})
        sums = metrics if sums is None else jax.tree.map(jnp.add, sums, metrics)
    return round(reduce_metrics(jax.device_get(sums))["mlm_accuracy"], 4)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--probe-train", type=int, default=4000)
    parser.add_argument("--workdir", default="runs/bench_infoword")
    parser.add_argument("overrides", nargs="*")
    report.add_markdown_argument(parser, "infoword_wikitext")
    args = parser.parse_args(argv)
    workdir, wikitext = Path(args.workdir), wikitext_dir()
    sst2 = shared_data_dir() / "glue" / "SST-2"
    tokenizer_file = wikitext_tokenizer(workdir, wikitext)
    tokenizer = tokenizers.load_tokenizer(str(tokenizer_file))
    steps = args.steps
    common = [
        f"data.source={wikitext / 'train.txt'}", f"data.eval_source={wikitext / 'valid.txt'}",
        f"data.tokenizer={tokenizer_file}", f"data.cache_dir={workdir / 'cache'}",
        "examples.max_seq_length=128", "model.max_position_embeddings=128",
        "examples.max_predictions_per_seq=20", "examples.dupe_factor=2",
        "train.eval_batches=40", "train.log_every=50", f"train.steps={steps}",
        f"train.eval_every={steps}", f"train.checkpoint_every={steps}",
        f"optim.warmup_steps={steps // 10}", *args.overrides,
    ]
    train_x, train_y = read_sst2(sst2 / "train.tsv", args.probe_train)
    dev_x, dev_y = read_sst2(sst2 / "dev.tsv")
    train_inputs, dev_inputs = encode(train_x, tokenizer), encode(dev_x, tokenizer)

    def probe(encoder: nnx.Module) -> float:
        return round(linear_probe(features(encoder, train_inputs), train_y,
                                  features(encoder, dev_inputs), dev_y), 4)

    models: dict[str, dict] = {}
    held_out = None
    for preset in ("bert_tiny", "infoword_tiny"):
        config = make_config(preset, common)
        trainer = Trainer(config, workdir / preset)
        if held_out is None:  # BERT's held-out records score every model
            held_out = trainer.data.eval
            untrained = registry.get("bert").build_model(trainer.model_config, config.train.seed)
            models["untrained network"] = {
                "steps": 0, "mlm_accuracy": mlm_accuracy(untrained, held_out, 40),
                "own_held_out": {}, "sst2_probe_dev_accuracy": probe(untrained.encoder),
                "wall_clock_s": None}
        start = time.perf_counter()
        summary = trainer.run()
        seconds = time.perf_counter() - start
        trained = load_model(workdir / preset)
        models[preset] = {
            "steps": summary["step"], "mlm_accuracy": mlm_accuracy(trained, held_out, 40),
            "own_held_out": {k: round(v, 4) for k, v in summary["eval"].items()
                             if k in ("mlm_accuracy", "dim_accuracy")},
            "sst2_probe_dev_accuracy": probe(trained.encoder),
            "wall_clock_s": round(seconds)}
    result = {"benchmark": "infoword_vs_bert_wikitext2", "models": models,
              "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}"}
    print(json.dumps(result))
    command = report.command_line("bench.infoword_wikitext", argv)
    for cells in markdown_rows(result):
        report.write_row(TABLE, cells, command, args.markdown)
    return result


if __name__ == "__main__":
    main()
