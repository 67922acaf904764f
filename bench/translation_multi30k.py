"""MASS's translation check on Multi30K: bilingual pre-training, then supervised fine-tuning.

    python -m bench.translation_multi30k [--steps N] [--finetune-steps M] [--data FOLDER]
                                         [--workdir DIR] [--bleu-sentences K]

Data: $PRETEXT_SHARED_DATA/multi30k or ../shared/data/multi30k (or --data, a folder holding
train.{en,de} and val.{en,de}). 1. Pre-trains `mass_bilingual_tiny` (MASS with language
embeddings, one language per batch in turn) for N steps on train.en and train.de as two
monolingual corpora (29,000 captions each, not used as pairs), held out on val.en and val.de.
2. Fine-tunes it on the 29,000 en -> de training pairs for M steps (`translation_tiny`'s
recipe, `run.py translate`'s path), and, as the baseline, the same architecture and tokenizer
from random weights for the same M steps. 3. Decodes the 1,014 validation sources greedily (or
the first K) and scores corpus BLEU with sacrebleu against the German references. Prints one
JSON line: both BLEUs and held-out losses, the steps, the wall-clock of each stage and
sacrebleu's signature. A check of the method at toy size, not a translation system.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax

from bench.pretrain_wikitext import shared_data_dir
from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer
from pretext_jax.pretrain.translate import translate, translation_config


def schedule(steps: int) -> list[str]:
    """One evaluation and checkpoint, at the end; logs every 50 steps."""
    return [f"train.steps={steps}", f"train.eval_every={steps}",
            f"train.checkpoint_every={steps}", f"train.log_every={min(50, steps)}",
            "train.progress=false"]


def main(argv: list[str] | None = None) -> dict:
    """Runs the benchmark; returns (and prints as one JSON line) its result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="MASS pre-training steps")
    parser.add_argument("--finetune-steps", type=int, default=1000,
                        help="translation fine-tuning steps (both runs)")
    parser.add_argument("--data", default="", help="default: the shared Multi30K folder")
    parser.add_argument("--workdir", default="runs/bench_translation_multi30k")
    parser.add_argument("--bleu-sentences", type=int, default=0,
                        help="validation pairs decoded for BLEU (default 0 = all 1,014)")
    args = parser.parse_args(argv)
    data = Path(args.data or shared_data_dir() / "multi30k")
    root = Path(args.workdir)
    cache = f"data.cache_dir={root / 'cache'}"
    timings = {}
    start = time.perf_counter()
    pretraining = make_config("mass_bilingual_tiny", [
        f"data.source=en={data / 'train.en'},de={data / 'train.de'}",
        f"data.eval_source=en={data / 'val.en'},de={data / 'val.de'}", cache,
        *schedule(args.steps)])
    mass = Trainer(pretraining, root / "mass").run()
    timings["pretraining_s"] = round(time.perf_counter() - start, 1)
    pairs = (f"{data / 'train.en'},{data / 'train.de'}", f"{data / 'val.en'},{data / 'val.de'}")
    finetune = [cache, f"examples.bleu_sentences={args.bleu_sentences}",
                *schedule(args.finetune_steps)]
    results = {}
    for name, init in (("mass", str(root / "mass")), ("random_init", "")):
        start = time.perf_counter()
        config = translation_config(init, *pairs, finetune, architecture=str(root / "mass"))
        results[name] = translate(config, root / f"translation_{name}")
        timings[f"finetune_{name}_s"] = round(time.perf_counter() - start, 1)
    result = {
        "benchmark": "translation_multi30k", "direction": "en-de",
        "pretraining": {"preset": "mass_bilingual_tiny", "steps": mass["step"],
                        "batch_size": pretraining.train.batch_size,
                        "held_out_loss": mass["eval"].get("loss")},
        "finetune_steps": results["mass"]["steps"],
        "bleu": {name: r["bleu"] for name, r in results.items()},
        "held_out_loss": {name: r["held_out_loss"] for name, r in results.items()},
        "held_out_pairs": results["mass"]["held_out_pairs"],
        "bleu_signature": results["mass"]["bleu_signature"],
        "wall_clock_s": timings,
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
