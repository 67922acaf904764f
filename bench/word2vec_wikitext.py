"""Train word2vec (skip-gram, negative sampling) on WikiText-2 and report its nearest neighbours
and the small analogy check against the same check on the untrained (random) vectors.

    python -m bench.word2vec_wikitext [--steps N] [--workdir DIR] [section.key=value ...]

Data: $PRETEXT_SHARED_DATA/wikitext-2 or ../shared/data/wikitext-2 (train.txt for training,
valid.txt held out), words as WikiText tokenises them (case kept, `<unk>` a word). Settings:
`word2vec_tiny` widened to 100 dimensions, window 5, 5 negatives, min_count 5, word2vec.c's
subsampling (t = 1e-3, its formula; the paper's 1e-5 would thin every word seen over 20 times),
8 windows of 128 words per step (64 diverge at this learning rate), SGD from 0.025 decaying
linearly, per-pair steps (reduction sum), 3,000 steps (about 1.5 passes over train.txt). The
analogy check is `objectives.word2vec.ANALOGY_CATEGORIES` restricted to the vocabulary.
Prints the neighbours, one JSON line and the Markdown row of docs/benchmarks.md ("word2vec on
WikiText-2", `bench.report`).
"""

from __future__ import annotations

import argparse
import json
import time

from bench import report
from bench.pretrain_wikitext import wikitext_dir
from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.objectives import word2vec as w2v
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

QUERIES = ("king", "France", "river", "music", "war", "game", "Sunday", "three")
TABLE = report.Table("word2vec_wikitext", (
    "steps", "vocabulary", "held-out loss / untrained", "analogy accuracy / untrained",
    "nearest neighbours (top 3)", "wall s"))


def markdown_cells(result: dict) -> list:
    neighbours = "; ".join(f"{query}: {', '.join(words[:3])}"
                           for query, words in result["neighbours"].items())
    return [result["steps"], f"{result['vocabulary']:,}",
            f"{result['held_out_loss']:.3f} / {result['untrained_loss']:.3f}",
            f"{result['analogy_accuracy']:.3f} / {result['untrained_analogy_accuracy']:.3f} "
            f"({result['analogy_questions']} questions)", neighbours,
            f"{result['wall_clock_s']:.0f}"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--workdir", default="runs/bench_word2vec")
    parser.add_argument("overrides", nargs="*")
    report.add_markdown_argument(parser, "word2vec_wikitext")
    args = parser.parse_args(argv)
    data = wikitext_dir()
    overrides = [
        f"data.source={data / 'train.txt'}", f"data.eval_source={data / 'valid.txt'}",
        "model.embedding_dim=100", "examples.max_seq_length=128", "examples.min_count=5",
        "objective.window=5", "objective.negatives=5", "objective.subsample=1e-3",
        "objective.subsampling=code", "train.batch_size=8", f"train.steps={args.steps}",
        f"train.eval_every={args.steps}", f"train.checkpoint_every={args.steps}",
        "train.eval_batches=20", "train.log_every=500", *args.overrides,
    ]
    config = make_config("word2vec_tiny", overrides)
    start = time.perf_counter()
    trainer = Trainer(config, args.workdir)
    summary = trainer.run()
    seconds = time.perf_counter() - start
    words = trainer.data.monitor_data
    questions = w2v.analogy_questions(words)
    trained = w2v.word_vectors(trainer.model_of(summary["state"]))
    untrained = w2v.word_vectors(trainer.method.build_model(trainer.model_config,
                                                            config.train.seed))
    neighbours = w2v.nearest_neighbours(trained, words, QUERIES)
    for query, near in neighbours.items():
        print(f"{query:>8}: " + ", ".join(f"{w} {s:.2f}" for w, s in near))
    result = {
        "benchmark": "word2vec_wikitext2", "steps": summary["step"],
        "vocabulary": len(words), "analogy_questions": len(questions),
        "analogy_accuracy": round(w2v.analogy_accuracy(trained, questions), 4),
        "untrained_analogy_accuracy": round(w2v.analogy_accuracy(untrained, questions), 4),
        "held_out_loss": round(summary["eval"]["loss"], 4),
        "untrained_loss": round(trainer.data.report["untrained_loss"], 4),
        "neighbours": {query: [w for w, _ in near] for query, near in neighbours.items()},
        "wall_clock_s": round(seconds, 1)}
    print(json.dumps(result))
    report.write_row(TABLE, markdown_cells(result),
                     report.command_line("bench.word2vec_wikitext", argv), args.markdown)
    return result


if __name__ == "__main__":
    main()
