"""What keeps long runs alive on shared clusters: multi-controller start-up, preemption
signals, the data position across process counts, and non-finite steps.

- `initialize_distributed`: `jax.distributed.initialize` from arguments, the environment
  (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`) or JAX's own cluster
  detection (SLURM, TPU pod slices, Kubernetes, MPI); on CPU with Gloo collectives.
- `PreemptionWatch`: SIGTERM/SIGINT ask the loop to stop after the current step (with a
  checkpoint). With several processes JAX's preemption sync point makes every process stop
  at the same step.
- `data_state_for_this_process`: the saved Grain positions of every process, re-derived for
  another process count; `data_state_difference` says what makes one belong to other data.
- `NonFiniteStep`: the error of a step whose loss or gradients were not finite.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import descriptions


def _environment_count(name: str, minimum: int) -> int | None:
    """An integer environment variable (None when unset), or a UserError naming it."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < minimum:
        raise UserError(f"{name}={text!r} must be an integer >= {minimum}; fix or unset it")
    return int(text)


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *, auto: bool = False) -> bool:
    """Starts JAX's multi-controller runtime when asked: explicit arguments, the JAX_*
    environment variables, or `auto` (JAX detects SLURM/TPU/Kubernetes/MPI). Returns whether
    it did. Must run before anything touches a JAX backend."""
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None:
        num_processes = _environment_count("JAX_NUM_PROCESSES", 1)
    if process_id is None:
        process_id = _environment_count("JAX_PROCESS_ID", 0)
    if num_processes is not None and num_processes < 1:
        raise UserError(f"--num-processes {num_processes} must be at least 1")
    if not (coordinator or auto):
        return False
    if coordinator and (num_processes is None or process_id is None):
        raise UserError("a coordinator address needs the process count and this process's "
                        "id too: give --num-processes and --process-id (or JAX_NUM_PROCESSES "
                        "and JAX_PROCESS_ID)")
    if num_processes is not None and not 0 <= (process_id or 0) < num_processes:
        raise UserError(f"--process-id {process_id} must be in [0, {num_processes})")
    if (os.environ.get("JAX_PLATFORMS") or "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)
    return True


class PreemptionWatch:
    """Records SIGTERM/SIGINT so the loop can finish its step, checkpoint and return.

    Single process: Python handlers (restored by `close`). Several processes: JAX's
    preemption notifier (installed by `jax.distributed.initialize`, which already handles
    SIGTERM) and `reached_preemption_sync_point`, so all processes stop at one step."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}
        self._multi = jax.process_count() > 1
        if self._multi:
            return
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                break

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signal.Signals(signum).name

    def should_stop(self, step: int) -> bool:
        if self._multi:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                self.received = "preemption notice"
        return self.received is not None

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def gather_strings(text: str) -> list[str]:
    """Every process's `text`, in process order (a collective: all processes must call it)."""
    if jax.process_count() == 1:
        return [text]
    from jax.experimental import multihost_utils

    data = np.frombuffer(text.encode(), np.uint8)
    lengths = multihost_utils.process_allgather(np.int32(len(data)))
    padded = np.zeros(int(np.max(lengths)), np.uint8)
    padded[:len(data)] = data
    rows = multihost_utils.process_allgather(padded)
    return [bytes(row[:n]).decode() for row, n in zip(rows, lengths, strict=True)]


def data_state_for_this_process(saved: list[str], template: bytes,
                                earlier_sources: Sequence[str] = ()) -> bytes:
    """This process's Grain iterator state from the states every process saved.

    Same process count: its own. Another count: each process reads its rows of every global
    batch (`input_pipeline.records.ProcessRowsSampler`), so after t global batches of B each
    of P processes has read t B / P records, and a process of the new count P' resumes after
    its t B / P'. That needs loaders without Grain workers on both sides (a worker's position
    is not a single count); `template` is this process's fresh iterator state.
    `earlier_sources`: how older versions described the current records (`_in_current_terms`)."""
    count = jax.process_count()
    fresh = json.loads(template)
    if len(saved) == count:
        return _in_current_terms(json.loads(saved[jax.process_index()]), fresh, earlier_sources)
    states = [json.loads(state) for state in saved]
    if any(state.get("worker_count", 0) for state in states) or fresh.get("worker_count", 0):
        raise UserError(f"the checkpoint's data position was written by {len(saved)} processes "
                        f"with Grain workers; resume with {len(saved)} processes, or with "
                        "data.worker_count=0 on both sides")
    read_per_process = {int(state["last_seen_indices"]["0"]) + 1 for state in states}
    if len(read_per_process) != 1:
        raise UserError("the checkpoint's processes stopped at different data positions; "
                        f"resume with {len(saved)} processes")
    consumed = read_per_process.pop() * len(saved)
    state = {**states[0], "last_seen_indices": {"0": consumed // count - 1}}
    return _in_current_terms(state, fresh, earlier_sources)


def _settings(sampler: str) -> dict[str, str]:
    """`name=value` pairs of a sampler description such as `IndexSampler(num_records=8, ...)`."""
    return dict(re.findall(r"(\w+)=([^,()]*)", sampler))


def _in_current_terms(state: dict[str, Any], fresh: dict[str, Any],
                      earlier_sources: Sequence[str]) -> bytes:
    """`state` with the current loader's descriptions where an older version described the same
    thing otherwise: a sampler that differs only in its shard options (checkpoints written
    before the loader stopped using Grain's `ShardByJaxProcess`), a data source described as
    one of `earlier_sources` (checkpoints written before sources described their content).
    Grain compares the descriptions and refuses other records."""
    def unsharded(sampler: str) -> str:
        return re.sub(r"shard_options=\w+\([^)]*\), ", "", sampler)

    if unsharded(state.get("sampler", "")) == unsharded(fresh.get("sampler", "")):
        state = {**state, "sampler": fresh["sampler"]}
    if state.get("data_source") in earlier_sources:
        state = {**state, "data_source": fresh["data_source"]}
    return json.dumps(state).encode()


def data_state_difference(saved: bytes, fresh: bytes) -> str | None:
    """What Grain would refuse in a saved data position, in words: the first fact in which the
    saved source's description differs from the current one (`descriptions.difference`), a
    sampler setting, or the worker count; None when the two agree."""
    old, new = json.loads(saved), json.loads(fresh)
    changed = descriptions.difference(old.get("data_source", ""), new.get("data_source", ""))
    if changed:
        return changed
    before, now = _settings(old.get("sampler", "")), _settings(new.get("sampler", ""))
    for key in dict.fromkeys([*now, *before]):
        if before.get(key) != now.get(key):
            return f"sampler {key}: {before.get(key)} vs {now.get(key)}"
    if old.get("worker_count") != new.get("worker_count"):
        return f"data.worker_count: {old.get('worker_count')} vs {new.get('worker_count')}"
    return None


class NonFiniteStep(UserError):
    """A step's loss or gradients were not finite (the update was not applied)."""
