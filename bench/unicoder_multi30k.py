"""Unicoder on Multi30K en-de against the same encoder untrained.

    python -m bench.unicoder_multi30k [--steps N] [--workdir DIR] [section.key=value ...]

`unicoder_tiny` (XLM's structure: hidden 64, 2 layers, 4 heads; one sentencepiece vocabulary
of 4,000 pieces shared by English and German) trained N steps on Multi30K's 29,000 training
pairs (batch 64: every batch trains all five tasks), and the same network at its initial
parameters (the same seed). Both are scored on the 1,000 pairs of Multi30K's 2016 Flickr test
set, records built as for training (paraphrase negatives drawn once, masks once, fixed seeds):
held-out paraphrase accuracy (positives and random negatives, 1/2 each), word-recovery accuracy
and masked-LM accuracy on monolingual, TLM and cross-lingual documents; then cross-lingual
sentence retrieval: each English test sentence (`</s> s </s>`, mean-pooled final states) picks
the German sentence of largest cosine similarity among the 1,000, top-1 accuracy (chance
0.001). Data: $PRETEXT_SHARED_DATA or ../shared/data (multi30k/). Prints one JSON line and
writes the Markdown rows of docs/benchmarks.md ("Unicoder on Multi30K").
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
from bench.pretrain_wikitext import shared_data_dir
from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.objectives.unicoder import unicoder_loss
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.loading import load_model
from pretext_jax.pretrain.metrics import reduce_metrics
from pretext_jax.pretrain.trainer import Trainer

TABLE = report.Table("unicoder_multi30k", (
    "model", "steps", "paraphrase acc.", "word recovery acc.", "MLM acc.", "TLM acc.",
    "cross-lingual MLM acc.", "en->de retrieval top-1", "wall s"))
TASKS = ("pc", "wr", "mlm", "tlm", "xmlm")


def held_out_metrics(model: nnx.Module, records: dict[str, np.ndarray], batch: int = 50
                     ) -> dict[str, float]:
    """Each task's held-out accuracy over all of `records` (exact sums)."""
    run = nnx.jit(lambda module, rows: unicoder_loss(module, rows, None)[1])
    sums = None
    for start in range(0, len(records["pc_label"]) // batch * batch, batch):
        metrics = run(model, {k: jnp.asarray(v[start:start + batch]) for k, v in records.items()})
        sums = metrics if sums is None else jax.tree.map(jnp.add, sums, metrics)
    reduced = reduce_metrics(jax.device_get(sums))
    return {task: round(reduced[f"{task}_accuracy"], 4) for task in TASKS}


def retrieval_accuracy(model: nnx.Module, tokenizer, english: list[str], german: list[str],
                       ids: dict[str, int], length: int) -> float:
    """Top-1 accuracy of English -> German retrieval by the cosine of mean-pooled final
    states of `</s> sentence </s>` (its language id on every token)."""
    def encode(sentences: list[str], language: str) -> np.ndarray:
        rows = np.full((len(sentences), length), tokenizer.pad_id, np.int32)
        mask = np.zeros_like(rows)
        for i, sentence in enumerate(sentences):
            tokens = [tokenizer.eos_id, *tokenizer.encode(sentence)[:length - 2], tokenizer.eos_id]
            rows[i, :len(tokens)], mask[i, :len(tokens)] = tokens, 1
        hidden = nnx.jit(lambda m, r, k: m.transformer.hidden(
            r, k, langs=jnp.full(r.shape, ids[language])))(model, rows, mask)
        pooled = np.asarray(hidden).sum(1) / mask.sum(1, keepdims=True)
        return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)

    similarity = encode(english, "en") @ encode(german, "de").T
    return round(float((similarity.argmax(1) == np.arange(len(english))).mean()), 4)


def markdown_rows(result: dict) -> list[list]:
    return [[f"`{name}`" if name == "unicoder_tiny" else name, run["steps"],
             *(run["held_out"][task] for task in TASKS), run["retrieval_top1"],
             run["wall_clock_s"]] for name, run in result["models"].items()]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workdir", default="runs/bench_unicoder")
    parser.add_argument("overrides", nargs="*")
    report.add_markdown_argument(parser, "unicoder_multi30k")
    args = parser.parse_args(argv)
    workdir, folder = Path(args.workdir), shared_data_dir() / "multi30k"
    test = [folder / f"test_2016_flickr.{language}" for language in ("en", "de")]
    config = make_config("unicoder_tiny", [
        f"data.source={folder / 'train.en'},{folder / 'train.de'}",
        f"data.eval_source={test[0]},{test[1]}", f"data.cache_dir={workdir / 'cache'}",
        f"train.steps={args.steps}", f"train.eval_every={args.steps}",
        f"train.checkpoint_every={args.steps}", "train.log_every=50", "train.eval_batches=8",
        f"optim.warmup_steps={args.steps // 10}", *args.overrides])
    trainer = Trainer(config, workdir / "unicoder_tiny")
    held_out, tokenizer = trainer.data.eval, trainer.data.tokenizer
    english, german = ([line.strip() for line in path.read_text().splitlines()]
                       for path in test)
    ids = {"de": 0, "en": 1}
    length = config.examples.stream_length

    def score(model: nnx.Module) -> tuple[dict[str, float], float]:
        return (held_out_metrics(model, held_out),
                retrieval_accuracy(model, tokenizer, english, german, ids, length))

    untrained = trainer.method.build_model(trainer.model_config, config.train.seed)
    models: dict[str, dict] = {}
    metrics, retrieval = score(untrained)
    models["untrained network"] = {"steps": 0, "held_out": metrics, "retrieval_top1": retrieval,
                                   "wall_clock_s": None}
    start = time.perf_counter()
    summary = trainer.run()
    seconds = round(time.perf_counter() - start)
    metrics, retrieval = score(load_model(workdir / "unicoder_tiny"))
    models["unicoder_tiny"] = {"steps": summary["step"], "held_out": metrics,
                               "retrieval_top1": retrieval, "wall_clock_s": seconds}
    result = {"benchmark": "unicoder_multi30k", "held_out_pairs": len(held_out["pc_label"]),
              "models": models, "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}"}
    print(json.dumps(result))
    command = report.command_line("bench.unicoder_multi30k", argv)
    for cells in markdown_rows(result):
        report.write_row(TABLE, cells, command, args.markdown)
    return result


if __name__ == "__main__":
    main()
