"""Speech pre-training on the Free Spoken Digit Dataset, measured by linear probes.

    python -m bench.speech_fsdd [--preset cpc_digits] [--steps N] [--workdir DIR]
                                [--data FOLDER] [section.key=value ...]

Data: $PRETEXT_SHARED_DATA/fsdd/recordings or ../shared/data/fsdd/recordings (3,000 real 8 kHz
recordings, resampled to 16 kHz; FSDD's official split: index 0-4 held out, 300 utterances),
or --data (any folder of {digit}_{speaker}_{index}.wav files).
Pre-trains the preset (`cpc_digits`, `wav2vec_digits`, `wav2vec2_digits`, `hubert_digits` or
`hubert_digits_iter2`: each reads FSDD's labels from the file names; HuBERT's second iteration
clusters the first's hidden states, by default those of `hubert_digits`' bench workdir
runs/bench_hubert_digits, or `objective.target_model=DIR`) on the 2,700 training recordings,
then reports the linear probes of `objectives.common.speech` for the spoken digit and the
speaker on the held-out recordings: the trained network, the same network at its random
initialisation, and the MFCC baseline, with the steps and the wall-clock.
Prints one JSON line and writes the Markdown row of docs/benchmarks.md ("Speech on FSDD",
`bench.report`). Needs the `audio` extra.
"""

from __future__ import annotations

import argparse
import json
import time

import jax

from bench import report
from bench.pretrain_wikitext import shared_data_dir
from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.objectives import registry
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

TABLE = report.Table("speech_fsdd", (
    "preset", "steps x batch", "probes: trained / untrained / MFCC", "held-out loss", "wall s"))


def markdown_cells(result: dict) -> list:
    probes = "; ".join(
        f"{label} {p['trained']:.3f} / {p['untrained']:.3f} / {p['mfcc']:.3f}"
        for label, p in result["held_out_probe_accuracy"].items())
    return [f"`{result['preset']}`", f"{result['steps']} x {result['batch_size']}", probes,
            result["held_out_loss"], f"{result['wall_clock_s']:.0f}"]


def main(argv: list[str] | None = None) -> dict:
    """Runs the benchmark; returns (and prints as one JSON line) its result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpc_digits",
                        choices=("cpc_digits", "wav2vec_digits", "wav2vec2_digits",
                                 "hubert_digits", "hubert_digits_iter2"))
    parser.add_argument("--steps", type=int, default=0, help="default: the preset's")
    parser.add_argument("--workdir", default="")
    parser.add_argument("--data", default="", help="default: the shared FSDD recordings")
    parser.add_argument("overrides", nargs="*")
    report.add_markdown_argument(parser, "speech_fsdd")
    args = parser.parse_args(argv)
    overrides = [f"data.source={args.data or shared_data_dir() / 'fsdd' / 'recordings'}",
                 "train.progress=false", *args.overrides]
    if args.steps:
        overrides += [f"train.steps={args.steps}", f"train.eval_every={args.steps}",
                      f"train.checkpoint_every={args.steps}"]
    if args.preset == "hubert_digits_iter2" and not any(
            value.startswith("objective.target_model=") for value in args.overrides):
        overrides.append("objective.target_model=runs/bench_hubert_digits")
    config = make_config(args.preset, overrides)
    workdir = args.workdir or f"runs/bench_{args.preset}"
    start = time.perf_counter()
    trainer = Trainer(config, workdir)
    summary = trainer.run()
    seconds = time.perf_counter() - start
    method = registry.get(config.method)
    untrained = method.evaluation.monitor(
        method.build_model(trainer.model_config, config.train.seed), trainer.data,
        trainer.example_config, trainer.objective)
    probes = {}
    for key, value in summary["eval"].items():
        if key.startswith("probe_"):
            label = key.removeprefix("probe_").removesuffix("_accuracy")
            probes[label] = {"trained": value, "untrained": untrained[key],
                             "mfcc": summary["report"][f"mfcc_{key}"]}
    result = {
        "benchmark": "speech_fsdd", "preset": args.preset, "steps": summary["step"],
        "batch_size": config.train.batch_size, "probe_layer": config.examples.probe_layer,
        "held_out_probe_accuracy": probes,
        "held_out_loss": summary["eval"].get("loss"),
        "wall_clock_s": round(seconds, 1),
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
    }
    print(json.dumps(result))
    report.write_row(TABLE, markdown_cells(result), report.command_line("bench.speech_fsdd", argv),
                     args.markdown)
    return result


if __name__ == "__main__":
    main()
