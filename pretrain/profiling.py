"""`train.profile_steps`: a `jax.profiler` trace of chosen training steps."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from pretext_jax.pretrain.config import parse_profile_steps
from pretext_jax.pretrain.metrics import MetricWriter

PROFILE_DIR = "profile"


class Profile:
    """A `jax.profiler` trace of the steps `train.profile_steps` names (`a:b`, inclusive) into
    `<workdir>/profile/` (open it with TensorBoard's profile plugin or Perfetto); the device
    work of step b is waited for before the trace stops, and so is `settle` (the checkpoint
    writes in flight: once, stopping the trace while orbax's threads wrote a checkpoint crashed
    the process in `stop_trace`)."""

    def __init__(self, steps: str, directory: Path, writer: MetricWriter,
                 settle: Callable[[], None] = lambda: None):
        self.first, self.last = parse_profile_steps(steps) if steps else (0, -1)
        self.directory, self.writer, self.active = directory, writer, False
        self.settle = settle

    def before(self, step: int) -> None:
        if step == self.first:
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int, metrics: Any) -> None:
        if self.active and step >= self.last:
            jax.block_until_ready(metrics)
            self.settle()
            self.close()
            self.writer.print(f"profile of steps {self.first}-{self.last} in {self.directory}")

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
