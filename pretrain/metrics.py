"""Metric sinks for the trainer: progress bar, JSONL, TensorBoard, PNG curves (process 0 only),
and the estimate of a long run's duration from its first step after compilation.

TensorBoard events are written with tensorboardX, which needs no TensorFlow, imported without
torch (`import_tensorboardx`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from pretext_jax import progress as phase_progress
from pretext_jax.errors import optional_import

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
LONG_RUN_S = 3600.0
"""A run estimated to last longer than this says so after its first timed step."""
FULL_SIZE_PARAMETERS = 3_000_000
"""A network this large is noted before it trains on a CPU (`full_size_note`)."""


def import_tensorboardx() -> Any:
    """tensorboardX, or None when the `tensorboard` extra is not installed. Its writer module
    imports torch when torch is installed (to accept torch tensors: 1 s and hundreds of MB, for
    scalars pretext passes as floats), so torch is hidden while it is imported unless something
    imported it already."""
    hide_torch = "torch" not in sys.modules
    if hide_torch:
        sys.modules["torch"] = None  # `import torch` raises ImportError, which it catches
    try:
        return optional_import("tensorboardX", "tensorboard",
                               "TensorBoard events are not written (JSONL only)")
    finally:
        if hide_torch:
            del sys.modules["torch"]


def reduce_metrics(sums: dict[str, tuple[Any, Any]]) -> dict[str, float]:
    """(numerator, denominator) pairs -> floats."""
    return {k: float(n) / max(float(d), 1e-12) for k, (n, d) in sums.items()}


def read_rows(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The rows of a metrics file and the number of damaged lines skipped (a row a kill cut
    short, bytes that are not UTF-8 or not a JSON object with a step)."""
    rows, damaged = [], 0
    for line in path.read_bytes().splitlines():
        try:
            row = json.loads(line.decode("utf-8"))
            int(row["step"])
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError):
            damaged += bool(line.strip())
            continue
        rows.append(row)
    return rows, damaged


def truncate_after(path: Path, step: int) -> None:
    """Drops rows logged after `step` (they belong to a run that was interrupted and resumed)
    and damaged lines (with a warning naming how many); rewritten atomically."""
    if not path.is_file():
        return
    rows, damaged = read_rows(path)
    if damaged:
        print(f"warning: dropped {damaged} damaged line(s) of {path} (cut short or not JSON); "
              "the other rows are kept", file=sys.stderr, flush=True)
    kept = [row for row in rows if row["step"] <= step]
    if damaged or len(kept) < len(rows):
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text("".join(json.dumps(row) + "\n" for row in kept))
        os.replace(temporary, path)


class _CompileClock:
    """Seconds this process has spent tracing, lowering and compiling with JAX since the clock
    was first read (`jax.monitoring`'s compile-duration events)."""

    EVENTS = "/jax/core/compile/"

    def __init__(self) -> None:
        self.seconds = 0.0
        self.listening = False

    def read(self) -> float:
        if not self.listening:
            jax.monitoring.register_event_duration_secs_listener(self.count)
            self.listening = True
        return self.seconds

    def count(self, event: str, duration: float, **_: Any) -> None:
        if event.startswith(self.EVENTS):
            self.seconds += duration


COMPILE_CLOCK = _CompileClock()


def long_run_warning(step_seconds: float, steps: int) -> str | None:
    """The line saying how long `steps` more steps of `step_seconds` take, if that is longer
    than `LONG_RUN_S`; else None."""
    total = step_seconds * steps
    if total <= LONG_RUN_S:
        return None
    duration = f"{total / 3600:.1f} h" if total < 48 * 3600 else f"{total / 86400:.0f} days"
    return (f"warning: estimated {duration} for the {steps:,} steps left at "
            f"{step_seconds:.3g} s/step (step 2, after compilation) on this machine "
            f"({jax.default_backend()}); lower train.steps, choose a smaller preset or run on "
            "an accelerator")


def full_size_note(parameters: int) -> str | None:
    """One line before training, on a CPU backend, for a network of at least
    `FULL_SIZE_PARAMETERS` parameters (every full-size preset; the tiny ones have under a
    million); else None."""
    if parameters < FULL_SIZE_PARAMETERS or jax.default_backend() != "cpu":
        return None
    return (f"note: this network has {parameters / 1e6:.1f} M parameters, a full-size one; on a "
            "CPU its steps may take minutes (the *_tiny presets and `run.py demo` are sized for "
            "one); an estimate of the run's length follows step 2 if it is long")


class MetricWriter:
    """Writes every logged row to stdout (a tqdm bar), `metrics.jsonl` and TensorBoard; after
    the second step of the run (the first compiles and starts the loader), a line estimating
    the run's length if it is long (`long_run_warning`).
    `progress` also shows or hides the bars of long phases between steps (`pretext_jax.progress`:
    feature banks, probes, clustering)."""

    def __init__(self, workdir: Path, *, total_steps: int, start_step: int, enabled: bool,
                 progress: bool):
        self.workdir = workdir
        self.enabled = enabled
        self.bar = None
        self.tensorboard = None
        # Calls of `advance` so far, and (time, compile seconds) at the last of them.
        self.advances, self.timing = 0, None
        self.steps_left = total_steps - start_step
        phase_progress.set_enabled(enabled and progress)
        if not enabled:
            return
        truncate_after(workdir / METRICS_FILE, start_step)
        self.jsonl = (workdir / METRICS_FILE).open("a")
        tensorboard = import_tensorboardx()  # only on the writing process
        if tensorboard is not None:
            self.tensorboard = tensorboard.SummaryWriter(str(workdir / "tensorboard"),
                                                         purge_step=start_step + 1)
        if progress:
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def write(self, step: int, split: str, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, "split": split, **values}
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        for name, value in values.items():
            if self.tensorboard is not None:
                self.tensorboard.add_scalar(f"{split}/{name}", value, step)
        shown = {k: f"{v:.4g}" for k, v in values.items()  # the loss, accuracies, throughput
                 if k == "loss" or k.endswith(("_accuracy", "_per_s"))}
        if self.bar is not None and split == "train":
            self.bar.set_postfix(shown, refresh=False)
        elif split != "train":
            self.print(f"[{split} @ step {step}] " + " ".join(f"{k}={v:.4g}"
                                                              for k, v in values.items()))

    def advance(self, steps: int) -> None:
        if self.bar is not None:
            self.bar.update(steps)
        self.steps_left -= steps
        self.advances += 1
        if not self.enabled or self.advances > 2:
            return
        now = (time.perf_counter(), COMPILE_CLOCK.read())
        if self.advances == 2:  # the steps since the first: compiled, the loader running
            (started, compiling), (ended, compiled) = self.timing, now
            seconds = (ended - started - (compiled - compiling)) / steps
            warning = long_run_warning(seconds, self.steps_left)
            if warning:
                self.print(warning)
        self.timing = now

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        self.jsonl.close()


def plot_curves(workdir: Path) -> Path | None:
    """Loss and accuracy curves (train and eval) from metrics.jsonl into curves.png."""
    path = workdir / METRICS_FILE
    matplotlib = optional_import("matplotlib", "plots", "curves.png is not drawn")
    if not path.is_file() or matplotlib is None:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, _ = read_rows(path)
    names = sorted({k for r in rows for k in r if k.endswith(("loss", "accuracy"))})
    if not names:
        return None
    columns = 2
    fig, axes = plt.subplots(math.ceil(len(names) / columns), columns, squeeze=False,
                             figsize=(10, 3 * math.ceil(len(names) / columns)))
    for ax, name in zip(axes.flat, names, strict=False):
        for split in ("train", "eval"):
            points = np.array([(r["step"], r[name]) for r in rows
                               if r["split"] == split and name in r])
            if len(points):
                ax.plot(points[:, 0], points[:, 1], label=split, marker="." if split == "eval"
                        else None)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.legend()
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.tight_layout()
    out = workdir / CURVES_FILE
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
