"""The translation check on Multi30K for MASS, ProphetNet and XLM: pre-training on the captions,
then supervised en -> de fine-tuning against the same fine-tuning from random weights.

    python -m bench.translation_multi30k [--method mass|prophetnet|xlm] [--steps N]
        [--finetune-steps M] [--data FOLDER] [--workdir DIR] [--bleu-sentences K]
        [--num-beams B] [--length-penalty A]

Data: $PRETEXT_SHARED_DATA/multi30k or ../shared/data/multi30k (or --data, a folder holding
train.{en,de} and val.{en,de}). 1. Pre-trains for N steps on train.en and train.de as
monolingual text (29,000 captions each, not used as pairs), held out on val.en and val.de
(XLM: a fraction of each language's training captions, in documents of 10):
`mass_bilingual_tiny` (MASS with language embeddings, one language per step), `xlm_tiny` (MLM
on the two languages, one language per step, language embeddings) or `prophetnet_tiny` (no
language embeddings: the two languages' captions as one corpus). 2. Fine-tunes it on the
29,000 en -> de training pairs for M steps (`translation_tiny`'s recipe, `run.py translate`'s
path; an XLM starts both encoder and decoder, §5.2), and, as the baseline, the same
architecture and tokenizer from random weights for the same M steps. 3. Decodes the 1,014
validation sources (or the first K) greedily, or with `--num-beams` B > 1 by beam search
(length penalty A, `models.beam_search`) and greedily beside it, and scores corpus BLEU with
sacrebleu against the German references. Prints one JSON line: both BLEUs (and the greedy
ones) and held-out losses, the steps, the wall-clock of each stage and sacrebleu's signature,
and the Markdown row of docs/benchmarks.md ("Translation on Multi30K", `bench.report`). Needs
the `translation` extra. A check of the methods at toy size, not a translation system.
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
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer
from pretext_jax.pretrain.translate import translate, translation_config

PRESETS = {"mass": "mass_bilingual_tiny", "prophetnet": "prophetnet_tiny", "xlm": "xlm_tiny"}
CAPTIONS_PER_DOCUMENT = 10
TABLE = report.Table("translation_multi30k", (
    "pre-training (preset)", "steps: pre-training + fine-tuning", "pre-training held-out loss",
    "held-out loss: pre-trained / random init", "BLEU: pre-trained / random init",
    "wall s: pre-training + 2 fine-tunings"))


def markdown_cells(result: dict) -> list:
    pre, loss, bleu, wall = (result["pretraining"], result["held_out_loss"], result["bleu"],
                             result["wall_clock_s"])
    scores = f"{bleu['pretrained']:.2f} / {bleu['random_init']:.2f}"
    if "bleu_greedy" in result:
        greedy = result["bleu_greedy"]
        scores += (f" ({result['decoding']}; greedy {greedy['pretrained']:.2f} / "
                   f"{greedy['random_init']:.2f})")
    return [f"`{pre['preset']}`", f"{pre['steps']} + {result['finetune_steps']}",
            pre["held_out_loss"], f"{loss['pretrained']:.2f} / {loss['random_init']:.2f}",
            scores,
            " + ".join(f"{wall[key]:.0f}" for key in (
                "pretraining_s", "finetune_pretrained_s", "finetune_random_init_s"))]


def pretraining_data(method: str, data: Path, root: Path) -> list[str]:
    """The pre-training corpus settings: the languages' captions as `en=...,de=...` (for XLM
    rewritten under `root` as documents of `CAPTIONS_PER_DOCUMENT` captions, which it holds out
    a fraction of), or for ProphetNet (one language-free corpus) both files' lines as one."""
    languages = f"data.source=en={data / 'train.en'},de={data / 'train.de'}"
    if method == "mass":
        return [languages, f"data.eval_source=en={data / 'val.en'},de={data / 'val.de'}"]
    root.mkdir(parents=True, exist_ok=True)
    if method == "xlm":  # XLM holds out `data.held_out_fraction` of each language's documents
        for language in ("en", "de"):
            lines = (data / f"train.{language}").read_text(encoding="utf-8").splitlines()
            (root / f"train.{language}.docs").write_text("".join(
                "\n".join(lines[i:i + CAPTIONS_PER_DOCUMENT]) + "\n\n"
                for i in range(0, len(lines), CAPTIONS_PER_DOCUMENT)), encoding="utf-8")
        return [f"data.source=en={root / 'train.en.docs'},de={root / 'train.de.docs'}"]
    for split in ("train", "val"):
        lines = [(data / f"{split}.{language}").read_text(encoding="utf-8")
                 for language in ("en", "de")]
        (root / f"{split}.en-de.txt").write_text("".join(lines), encoding="utf-8")
    return [f"data.source={root / 'train.en-de.txt'}",
            f"data.eval_source={root / 'val.en-de.txt'}"]


def schedule(steps: int) -> list[str]:
    """One evaluation and checkpoint, at the end; logs every 50 steps."""
    return [f"train.steps={steps}", f"train.eval_every={steps}",
            f"train.checkpoint_every={steps}", f"train.log_every={min(50, steps)}",
            "train.progress=false"]


def main(argv: list[str] | None = None) -> dict:
    """Runs the benchmark; returns (and prints as one JSON line) its result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=sorted(PRESETS), default="mass")
    parser.add_argument("--steps", type=int, default=1000, help="pre-training steps")
    parser.add_argument("--finetune-steps", type=int, default=1000,
                        help="translation fine-tuning steps (both runs)")
    parser.add_argument("--data", default="", help="default: the shared Multi30K folder")
    parser.add_argument("--workdir", default="runs/bench_translation_multi30k")
    parser.add_argument("--bleu-sentences", type=int, default=0,
                        help="validation pairs decoded for BLEU (default 0 = all 1,014)")
    parser.add_argument("--num-beams", type=int, default=1,
                        help="beams of the BLEU decoding (default 1 = greedy; more: beam "
                        "search, greedy BLEU reported beside it)")
    parser.add_argument("--length-penalty", type=float, default=1.0,
                        help="beam search's length penalty (default 1.0)")
    report.add_markdown_argument(parser, "translation_multi30k")
    args = parser.parse_args(argv)
    data = Path(args.data or shared_data_dir() / "multi30k")
    root = Path(args.workdir)
    cache = f"data.cache_dir={root / 'cache'}"
    timings = {}
    start = time.perf_counter()
    preset = PRESETS[args.method]
    pretraining = make_config(preset, [*pretraining_data(args.method, data, root), cache,
                                       *schedule(args.steps)])
    pretrained = root / args.method
    summary = Trainer(pretraining, pretrained).run()
    timings["pretraining_s"] = round(time.perf_counter() - start, 1)
    pairs = (f"{data / 'train.en'},{data / 'train.de'}", f"{data / 'val.en'},{data / 'val.de'}")
    finetune = [cache, f"examples.bleu_sentences={args.bleu_sentences}",
                f"examples.num_beams={args.num_beams}",
                f"examples.length_penalty={args.length_penalty}",
                *schedule(args.finetune_steps)]
    results = {}
    for name, init in (("pretrained", str(pretrained)), ("random_init", "")):
        start = time.perf_counter()
        config = translation_config(init, *pairs, finetune, architecture=str(pretrained))
        results[name] = translate(config, root / f"translation_{name}")
        timings[f"finetune_{name}_s"] = round(time.perf_counter() - start, 1)
    result = {
        "benchmark": "translation_multi30k", "direction": "en-de",
        "pretraining": {"preset": preset, "steps": summary["step"],
                        "batch_size": pretraining.train.batch_size,
                        "held_out_loss": summary["eval"].get("loss")},
        "finetune_steps": results["pretrained"]["steps"],
        "bleu": {name: r["bleu"] for name, r in results.items()},
        "held_out_loss": {name: r["held_out_loss"] for name, r in results.items()},
        "decoding": results["pretrained"]["decoding"],
        **({"bleu_greedy": {name: r["bleu_greedy"] for name, r in results.items()}}
           if args.num_beams > 1 else {}),
        "held_out_pairs": results["pretrained"]["held_out_pairs"],
        "bleu_signature": results["pretrained"]["bleu_signature"],
        "wall_clock_s": timings,
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
    }
    print(json.dumps(result))
    report.write_row(TABLE, markdown_cells(result),
                     report.command_line("bench.translation_multi30k", argv), args.markdown)
    return result


if __name__ == "__main__":
    main()
