"""Speech recognition with CTC on the Free Spoken Digit Dataset: word error rate of a
`wav2vec2_digits` network fine-tuned with `run.py finetune --task ctc`, against the same
network fine-tuned from its random initialisation (wav2vec 2.0 §5: what pre-training buys the
CTC fine-tuning).

    python -m bench.ctc_fsdd [--init runs/bench_wav2vec2_digits] [--steps 4000]
        [--workdir runs/bench_ctc_fsdd] [--data FOLDER] [key=value ...]

`--init`: a `wav2vec2_digits` workdir, e.g. from `python -m bench.speech_fsdd --preset
wav2vec2_digits`. Data: $PRETEXT_SHARED_DATA/fsdd/recordings or ../shared/data/fsdd/recordings
(or --data); each recording's transcript is its digit's English word ("seven"), FSDD's official
split (recordings 0-4 of each speaker and digit are the 300 dev utterances). The manifests are
written to `<workdir>/manifests`. The recipe is fairseq `base_10h`'s shape (`run.py finetune
--task ctc`: tri-stage schedule, feature encoder frozen, time and channel masks) scaled to
`--steps`: warmup 10 %, hold 40 %, decay 50 %, the transformer frozen for the first 10 %
(base_10h freezes it for half of its 20,000 updates), peak rate 2e-3 for the tiny network
(base_10h: 5e-5 for BASE; at 5e-4 for 2,000 steps both runs stayed at the blank-only plateau,
WER 1.0), utterances up to 1 s (16,000 samples, as pre-training: the longer ones are dropped
and counted), 8 utterances per update (base_10h: 96 padded rows of 250,000 samples). Overrides
after it win. Each run has its own workdir (`pretrained`, `random`), so an interrupted bench
resumes. Prints one JSON line and writes the Markdown row (`bench.report`).
Needs the `audio` and `ctc` extras.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench import report
from bench.pretrain_wikitext import shared_data_dir
from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.pretrain.finetune import finetune, finetune_config

TABLE = report.Table("ctc_fsdd", (
    "starting network", "steps x batch", "dev WER / CER from pre-trained",
    "dev WER / CER from random init", "empty transcript", "fine-tuning s"))
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
DEV_INDICES = range(5)  # FSDD's official split: recordings 0-4 of each speaker and digit


def write_manifests(recordings: Path, folder: Path) -> tuple[Path, Path]:
    """FSDD's `{digit}_{speaker}_{index}.wav` files as TSV manifests (absolute path, the
    digit's word): (train, dev)."""
    rows: dict[str, list[str]] = {"train": [], "dev": []}
    for path in sorted(recordings.glob("*.wav")):
        digit, _, index = path.stem.split("_")
        split = "dev" if int(index) in DEV_INDICES else "train"
        rows[split].append(f"{path.absolute()}\t{WORDS[int(digit)]}\n")
    if not rows["train"] or not rows["dev"]:
        raise SystemExit(f"{recordings} holds no FSDD recordings ({{digit}}_{{speaker}}_"
                         "{index}.wav); give --data the recordings folder")
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, lines in rows.items():
        path = folder / f"{split}.tsv"
        path.write_text("".join(lines), encoding="utf-8")
        paths.append(path)
    return paths[0], paths[1]


def recipe(steps: int) -> list[str]:
    """base_10h's schedule shape scaled to `steps` (see the module docstring)."""
    return [f"train.steps={steps}", f"optim.warmup_steps={steps // 10}",
            f"optim.hold_steps={steps * 4 // 10}", f"objective.freeze_updates={steps // 10}",
            "optim.learning_rate=2e-3", "examples.max_samples=16000", "train.batch_size=8",
            f"train.eval_every={steps}", f"train.checkpoint_every={max(steps // 4, 1)}",
            "train.log_every=50", "train.progress=false"]


def fine_tune(init: str, architecture: str, data: str, workdir: Path, overrides: list[str]
              ) -> tuple[dict[str, Any], Any, float]:
    """One fine-tuning run: its result, config and wall-clock seconds."""
    config = finetune_config("ctc", init, data, overrides, architecture=architecture)
    start = time.perf_counter()
    result = finetune(config, workdir)
    return result, config, time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", default="runs/bench_wav2vec2_digits",
                        help="a wav2vec2_digits workdir")
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--workdir", default="runs/bench_ctc_fsdd")
    parser.add_argument("--data", default="", help="default: the shared FSDD recordings")
    parser.add_argument("overrides", nargs="*")
    report.add_markdown_argument(parser, "ctc_fsdd")
    args = parser.parse_args(argv)
    if not (Path(args.init) / "config.json").is_file():
        raise SystemExit(f"{args.init} is no pre-trained workdir; run `python -m "
                         "bench.speech_fsdd --preset wav2vec2_digits` first or give --init")
    root = Path(args.workdir)
    train, dev = write_manifests(
        Path(args.data) if args.data else shared_data_dir() / "fsdd" / "recordings",
        root / "manifests")
    data = f"{train},{dev}"
    overrides = [*recipe(args.steps), *args.overrides]
    trained, config, seconds = fine_tune(args.init, "", data, root / "pretrained", overrides)
    untrained, _, random_seconds = fine_tune("", args.init, data, root / "random", overrides)
    result = {
        "benchmark": "ctc_fsdd", "init": args.init, "steps": trained["steps"],
        "batch_size": config.train.batch_size, "dev_pretrained": trained["dev"],
        "dev_random_init": untrained["dev"], "empty_transcript": trained["empty_baseline"],
        "fine_tuning_s": round(seconds + random_seconds, 1),
        "command": report.command_line("bench.ctc_fsdd", argv),
    }
    print(json.dumps(result))

    def rates(dev: dict[str, float]) -> str:
        return f"{dev['wer']:.3f} / {dev['cer']:.3f}"

    report.write_row(TABLE, [f"`wav2vec2_digits` ({args.init})",
                             f"{result['steps']} x {result['batch_size']}",
                             rates(trained["dev"]), rates(untrained["dev"]),
                             rates(trained["empty_baseline"]), f"{result['fine_tuning_s']:.0f}"],
                     result["command"], args.markdown)
    return result


if __name__ == "__main__":
    main()
