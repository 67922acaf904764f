"""BERT vs ELECTRA of the same size for the same pre-training compute on WikiText-2.

    python -m bench.electra_vs_bert [--bert-steps N] [--workdir DIR] [section.key=value ...]

Both models share one sentencepiece vocabulary trained on WikiText-2 train.txt and the same
encoder (bert_tiny's: hidden 64, 2 layers, 4 heads; ELECTRA's embedding_size = hidden, so its
discriminator is BERT's encoder exactly), optimizer and batch (64 x 128 tokens). BERT gets
`--bert-steps`; ELECTRA gets as many steps as fit in the same number of training FLOPs, counted
by XLA's cost analysis of each compiled train step (Clark et al. 2020 §3.3 compare at equal
compute the same way). Wall-clock is reported too.

The comparison downstream: a linear probe (logistic regression on frozen, mean-pooled final
hidden states) on GLUE SST-2, trained on `--probe-train` sentences of train.tsv and scored on
dev.tsv, for BERT's encoder, ELECTRA's discriminator, and a randomly initialised encoder.
Data: $PRETEXT_SHARED_DATA or ../shared/data (wikitext-2/, glue/SST-2/). Prints one JSON line
and writes the Markdown rows of docs/benchmarks.md ("BERT against ELECTRA at equal compute"):
one per model and one for the untrained encoder's probe.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from bench import report
from bench.pretrain_wikitext import shared_data_dir, wikitext_dir
from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.input_pipeline import sources, tokenizers
from pretext_jax.objectives import registry
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.loading import load_model
from pretext_jax.pretrain.trainer import Trainer

SEQ_LEN = 64  # SST-2 sentences are short; 64 pieces cover all but a handful
TABLE = report.Table("electra_vs_bert", (
    "model", "steps", "GFLOP/step", "FLOP budget", "held-out (valid.txt)",
    "SST-2 dev probe", "wall s"))


def markdown_rows(result: dict) -> list[list]:
    """The rows' cells: each pre-trained model, then the untrained encoder's probe."""
    rows = [[f"`{preset}`", run["steps"], f"{run['step_gflops']:.2f}",
             f"{result['flops_budget']:.2e}", report.figures(run["held_out"]),
             run["sst2_probe_dev_accuracy"], f"{run['wall_clock_s']:.0f}"]
            for preset, run in result.items() if isinstance(run, dict)]
    return [*rows, ["untrained `bert_tiny` encoder", 0, None, None, None,
                    result["random_init_sst2_probe_dev_accuracy"], None]]


def step_flops(trainer: Trainer) -> float:
    """FLOPs of one compiled train step, from XLA's cost analysis."""
    state = trainer.init_state()
    batch = trainer.to_global(next(trainer.data_iterator()))
    cost = trainer._train_step.lower(state, batch).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"])


def read_sst2(path: Path, limit: int | None = None) -> tuple[list[str], np.ndarray]:
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    rows = rows[:limit] if limit else rows
    return [r["sentence"] for r in rows], np.asarray([int(r["label"]) for r in rows])


def encode(sentences: list[str], tokenizer) -> dict[str, np.ndarray]:
    ids = np.zeros((len(sentences), SEQ_LEN), np.int32)
    for row, sentence in enumerate(sentences):
        pieces = [tokenizer.cls_id, *tokenizer.encode(sentence)[: SEQ_LEN - 2], tokenizer.sep_id]
        ids[row, : len(pieces)] = pieces
    return {"input_ids": ids, "input_mask": (ids != tokenizer.pad_id).astype(np.int32)}


def features(encoder, inputs: dict[str, np.ndarray], batch: int = 256) -> np.ndarray:
    """Mean of the final hidden states over non-pad tokens, frozen (no gradient is taken)."""
    run = nnx.jit(lambda module, ids, mask: module(ids, None, mask))
    out = []
    for start in range(0, len(inputs["input_ids"]), batch):
        ids = jnp.asarray(inputs["input_ids"][start:start + batch])
        mask = jnp.asarray(inputs["input_mask"][start:start + batch])
        hidden = run(encoder, ids, mask)
        weights = mask[..., None].astype(hidden.dtype)
        out.append(np.asarray((hidden * weights).sum(1) / weights.sum(1)))
    return np.concatenate(out)


def linear_probe(train_x, train_y, dev_x, dev_y, steps: int = 500) -> float:
    """Dev accuracy of an L2-regularised logistic regression (full-batch Adam)."""
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    train_x, dev_x = (train_x - mean) / std, (dev_x - mean) / std
    params = {"w": jnp.zeros((train_x.shape[1],)), "b": jnp.zeros(())}
    tx = optax.adam(0.05)

    def loss(p):
        logits = train_x @ p["w"] + p["b"]
        return optax.sigmoid_binary_cross_entropy(logits, train_y).mean() + 1e-3 * jnp.sum(
            p["w"] ** 2)

    @jax.jit
    def step(p, s):
        grads = jax.grad(loss)(p)
        updates, s = tx.update(grads, s)
        return optax.apply_updates(p, updates), s

    state = tx.init(params)
    for _ in range(steps):
        params, state = step(params, state)
    predictions = (dev_x @ params["w"] + params["b"]) > 0
    return float(np.mean(np.asarray(predictions) == dev_y))


def wikitext_tokenizer(workdir: Path, wikitext: Path) -> Path:
    """The sentencepiece 8k model trained on WikiText-2 train.txt that the compared models
    share, trained into `workdir` unless it is there already."""
    tokenizer_file = workdir / "wikitext2_8k.model"
    if not tokenizer_file.is_file():
        workdir.mkdir(parents=True, exist_ok=True)
        documents = sources.read_documents(str(wikitext / "train.txt"))
        tokenizers.SentencePieceTokenizer.train(
            (s for doc in documents for s in doc), workdir / "wikitext2_8k", vocab_size=8000)
    return tokenizer_file


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bert-steps", type=int, default=1200)
    parser.add_argument("--probe-train", type=int, default=8000)
    parser.add_argument("--workdir", default="runs/bench_electra_vs_bert")
    parser.add_argument("overrides", nargs="*")
    report.add_markdown_argument(parser, "electra_vs_bert")
    args = parser.parse_args(argv)
    workdir, wikitext = Path(args.workdir), wikitext_dir()
    sst2 = shared_data_dir() / "glue" / "SST-2"
    tokenizer_file = wikitext_tokenizer(workdir, wikitext)
    tokenizer = tokenizers.load_tokenizer(str(tokenizer_file))
    common = [
        f"data.source={wikitext / 'train.txt'}", f"data.eval_source={wikitext / 'valid.txt'}",
        f"data.tokenizer={tokenizer_file}", f"data.cache_dir={workdir / 'cache'}",
        "examples.max_seq_length=128", "model.max_position_embeddings=128",
        "train.eval_batches=40", "train.log_every=100", *args.overrides,
    ]
    specific = {"bert_tiny": ["examples.max_predictions_per_seq=20", "examples.dupe_factor=5"],
                "electra_tiny": ["examples.max_predictions_per_seq=19",
                                 "model.embedding_size=64"]}
    flops = {preset: step_flops(Trainer(make_config(preset, [*common, *extra]),
                                        workdir / f"{preset}_flops"))
             for preset, extra in specific.items()}
    budget = flops["bert_tiny"] * args.bert_steps
    train_x, train_y = read_sst2(sst2 / "train.tsv", args.probe_train)
    dev_x, dev_y = read_sst2(sst2 / "dev.tsv")
    train_inputs, dev_inputs = encode(train_x, tokenizer), encode(dev_x, tokenizer)

    def probe(encoder) -> float:
        return linear_probe(features(encoder, train_inputs), train_y,
                            features(encoder, dev_inputs), dev_y)

    result = {"benchmark": "electra_vs_bert_wikitext2", "flops_budget": budget,
              "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}"}
    for preset, extra in specific.items():
        steps = int(budget // flops[preset])
        run_dir = workdir / preset
        config = make_config(preset, [*common, *extra, f"train.steps={steps}",
                                      f"train.eval_every={steps}",
                                      f"train.checkpoint_every={steps}",
                                      f"optim.warmup_steps={steps // 10}"])
        start = time.perf_counter()
        summary = Trainer(config, run_dir).run()
        seconds = time.perf_counter() - start
        trained = load_model(run_dir, downstream=True)
        result[preset] = {
            "steps": steps, "step_gflops": round(flops[preset] / 1e9, 2),
            "wall_clock_s": round(seconds, 1),
            "held_out": {k: round(v, 4) for k, v in summary["eval"].items()},
            "sst2_probe_dev_accuracy": probe(trained.encoder),
        }
        if preset == "bert_tiny":  # the same encoder, untrained
            untrained = registry.get("bert").build_model(trained.config, 0)
            result["random_init_sst2_probe_dev_accuracy"] = probe(untrained.encoder)
    print(json.dumps(result))
    command = report.command_line("bench.electra_vs_bert", argv)
    for cells in markdown_rows(result):
        report.write_row(TABLE, cells, command, args.markdown)
    return result


if __name__ == "__main__":
    main()
