"""The training batches, step by step: which records feed a step is the method's data's to say
(`registry.PreparedData.segments`); this module opens each segment's loader when its first
step comes (running the segment's `begin` on the model), reads batch s + 1 while the devices
run step s, and keeps the data position a checkpoint saves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import grain
import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.records import make_loader
from pretext_jax.input_pipeline.token_batches import BATCH_UNITS
from pretext_jax.objectives import registry
from pretext_jax.pretrain import resilience


def open_loader(data: registry.PreparedData, segment: registry.Segment, model: Any,
                config: Any, per_process_batch: int) -> grain.DataLoaderIterator:
    """An iterator over `segment`'s batches of this process, from the segment's start (a
    source of whole batches applies the transforms itself)."""
    whole = segment.whole_batches
    loader = make_loader(
        segment.records(model), batch_size=None if whole else per_process_batch,
        seed=config.train.seed, shuffle=segment.shuffle,
        transforms=() if whole else data.transforms, worker_count=config.data.worker_count)
    return iter(loader)


def resume_position(iterator: Any, data_states: list[str], earlier_descriptions: Any,
                    where: str) -> None:
    """Puts `iterator` where a checkpoint's loader was (`data_states`: every process's saved
    position); records that are not the checkpoint's (other data, or the same files changed)
    are a UserError naming what differs (`where`: the checkpoint, for the message)."""
    fresh = iterator.get_state()
    saved = resilience.data_state_for_this_process(data_states, fresh, earlier_descriptions)
    changed = resilience.data_state_difference(saved, fresh)
    try:
        if changed is None:
            iterator.set_state(saved)
    except ValueError as error:  # Grain refuses for a reason not described above
        changed = str(error).splitlines()[0]
    if changed is not None:
        raise UserError(f"{where} was written while reading other data records ({changed}); "
                        "restore that data or use a new --workdir")


INDEX_KEY = "record_index"


class RecordIndices:
    """A training source's record indices as records (`{INDEX_KEY: i}`), for a run whose
    records live in device memory (`train.records_in_device_memory`): the loader shuffles,
    splits over processes and resumes the indices exactly as it would the records, and the
    step gathers the rows on the device (`pretrain.step.gather_rows`)."""

    def __init__(self, records: Any):
        self.records, self.source = records, self
        self.description = f"indices of {records.source!r}"

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {INDEX_KEY: np.int32(index)}

    def __repr__(self) -> str:
        return self.description

    def load_transforms(self) -> list[Any]:
        return []

    def examples(self, indices: Any) -> dict[str, np.ndarray]:
        """The records themselves (monitors read them on the host: a kNN bank)."""
        return self.records.examples(indices)


def records_in_device_memory(data: registry.PreparedData
                             ) -> tuple[registry.PreparedData, dict[str, np.ndarray]]:
    """(`data` reading record indices, every training record stacked on the host) for
    `train.records_in_device_memory`; refused for data a host transform or a method's own
    layout feeds, whose records the device could not stand in for."""
    if data.transforms or data.segments is not None or not hasattr(data.train, "examples"):
        raise UserError("train.records_in_device_memory=true needs records fed as they are "
                        "stored (image methods); this method transforms or lays out its "
                        "records on the host: set it to false")
    rows = data.train.examples(range(len(data.train)))
    return dataclasses.replace(data, train=RecordIndices(data.train)), rows


class StepFeed:
    """The batch of every step of one run, segment by segment.

    `model_of(state)` gives the model a segment's `records` and `begin` see; `begin(state,
    segment)` runs the segment's `begin` and returns the new state. `position` is the data
    position after the last batch handed out for training (what a checkpoint keeps); `units`
    the real tokens of that batch where its source counts them (batches within a token
    budget: `token_batches.BATCH_UNITS`, taken out of the batch), else None."""

    def __init__(self, data: registry.PreparedData, config: Any, per_process_batch: int,
                 model_of: Callable[[Any], Any], begin: Callable[[Any, registry.Segment], Any]):
        self.data, self.config, self.per_process_batch = data, config, per_process_batch
        self.model_of, self.begin = model_of, begin
        self.segment: registry.Segment | None = None
        self.iterator: Any = None
        self.position: bytes | None = None
        self.units: int | None = None
        self._ahead: tuple[int, Any, bytes] | None = None  # (step, batch, position) read early

    def _holds(self, step: int) -> bool:
        return (self.segment is not None and self.segment.first_step <= step
                and (self.segment.last_step is None or step <= self.segment.last_step))

    def _open(self, state: Any, step: int) -> Any:
        self.segment = self.data.segment(step, self.config)
        if self.segment.begin is not None and step == self.segment.first_step:
            state = self.begin(state, self.segment)
        self.iterator = open_loader(self.data, self.segment, self.model_of(state), self.config,
                                    self.per_process_batch)
        self.position = self.iterator.get_state()
        return state

    def resume(self, state: Any, step: int, data_states: list[str], where: str) -> None:
        """Positions the feed for a run resumed before `step`: inside a segment, its loader
        continues from the checkpoint's position; at a segment's first step nothing is read
        until `batch` opens it."""
        if self.data.segment(step, self.config).first_step == step:
            return
        self._open(state, step)
        resume_position(self.iterator, data_states,
                        getattr(self.data.train, "earlier_descriptions", ()), where)
        self.position = self.iterator.get_state()

    def batch(self, state: Any, step: int) -> tuple[Any, Any]:
        """(state, batch of `step`): the batch read ahead, or the next one of the segment
        holding `step` (opened, and begun, when `step` is its first)."""
        if self._ahead is not None and self._ahead[0] == step:
            _, batch, self.position = self._ahead
            self._ahead = None
        else:
            if not self._holds(step):
                state = self._open(state, step)
            batch = next(self.iterator)
            self.position = self.iterator.get_state()
        units = batch.pop(BATCH_UNITS, None)
        self.units = None if units is None else int(units)
        return state, batch

    def read_ahead(self, step: int) -> None:
        """Reads the batch of `step` now (while the devices run the step before) when it comes
        from the open segment; a segment's first batch waits for the state it begins from."""
        if self._holds(step) and self._ahead is None:
            batch = next(self.iterator)
            self._ahead = (step, batch, self.iterator.get_state())
