"""LayerDrop (Fan et al. 2020): a tiny BERT pre-trained on WikiText-2 with and without it, then
pruned to every other layer without fine-tuning.

    python -m bench.layerdrop_wikitext2 [--steps N] [--workdir DIR] [section.key=value ...]

Two runs of the same 6-layer BERT of 64 (`bert_tiny` widened to 6 layers; sequences of 64,
batch 32, the same batches, optimizer and schedule) on WikiText-2 train.txt, one with
`model.layerdrop=0.2` (the paper's and fairseq's recommended rate), one with 0. Each trained
model is scored on valid.txt (held-out MLM accuracy and loss, `train.eval_batches` batches)
whole and pruned to layers 0, 2, 4 (`pretrain.loading.load_model(layers_to_keep=...)`,
fairseq's `--encoder-layers-to-keep`); the paper's point (§4, Figure 4) is that the LayerDrop
model loses far less when pruned. Data: $PRETEXT_SHARED_DATA or ../shared/data
(wikitext-2/). Prints one JSON line and writes the Markdown rows of docs/benchmarks.md
("LayerDrop: pruning a tiny BERT").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
from flax import nnx

from bench import report
from bench.pretrain_wikitext import wikitext_dir
from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.loading import load_model
from pretext_jax.pretrain.trainer import Trainer

TABLE = report.Table("layerdrop_wikitext2", (
    "trained with", "steps", "layers kept", "held-out (valid.txt)", "wall s"))
RATES = {"LayerDrop 0.2": 0.2, "no LayerDrop": 0.0}
KEEP = "0,2,4"


def pruned_metrics(overrides: dict, workdir: Path, trained: Path) -> dict[str, float]:
    """Held-out metrics of `trained` pruned to `KEEP`: a trainer of the pruned shape (same data)
    evaluates a state holding the pruned model's parameters."""
    pruned = load_model(trained, layers_to_keep=KEEP)
    config = make_config("bert_tiny", {**overrides,
                                       "model.num_layers": pruned.config.num_layers})
    trainer = Trainer(config, workdir)
    state = trainer.init_state()
    params = jax.device_put(nnx.state(pruned, nnx.Param), trainer.state_sharding.params)
    result = trainer.evaluate(dataclasses.replace(state, params=params))
    trainer.checkpoints.close()
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--workdir", default="runs/bench_layerdrop_wikitext2")
    parser.add_argument("overrides", nargs="*")
    report.add_markdown_argument(parser, "layerdrop_wikitext2")
    args = parser.parse_args(argv)
    workdir, wikitext = Path(args.workdir), wikitext_dir()
    common = {
        "data.source": str(wikitext / "train.txt"),
        "data.eval_source": str(wikitext / "valid.txt"),
        "data.cache_dir": str(workdir / "cache"), "model.num_layers": 6,
        "examples.max_seq_length": 64, "examples.max_predictions_per_seq": 10,
        "train.steps": args.steps, "train.batch_size": 32, "train.eval_every": args.steps,
        "train.checkpoint_every": args.steps, "train.eval_batches": 20,
        "train.log_every": 100, "train.progress": False, "optim.warmup_steps": args.steps // 10,
        **dict(item.split("=", 1) for item in args.overrides),
    }
    result = {"benchmark": "layerdrop_wikitext2", "steps": args.steps, "kept": KEEP,
              "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}"}
    for name, rate in RATES.items():
        start = time.perf_counter()
        run_dir = workdir / f"p{rate}"
        summary = Trainer(make_config("bert_tiny", {**common, "model.layerdrop": rate}),
                          run_dir).run()
        pruned = pruned_metrics(common, workdir / f"p{rate}_pruned", run_dir)
        keep = ("mlm_accuracy", "mlm_loss")
        result[name] = {"full": {k: round(summary["eval"][k], 4) for k in keep},
                        "pruned": {k: round(pruned[k], 4) for k in keep},
                        "wall_clock_s": round(time.perf_counter() - start, 1)}
    print(json.dumps(result))
    command = report.command_line("bench.layerdrop_wikitext2", argv)
    for name in RATES:
        run = result[name]
        for kept, metrics in (("all 6", run["full"]), (f"{KEEP} (3)", run["pruned"])):
            report.write_row(TABLE, [name, args.steps, kept, report.figures(metrics),
                                     run["wall_clock_s"]], command, args.markdown)
    return result


if __name__ == "__main__":
    main()
