"""Training batches sized by a token budget with a varying number of rows (XLM's
`tokens_per_batch`, `src/data/dataset.py` `get_iterator` with `group_by_size`; fairseq's
`max_tokens`, `data_utils.batch_by_size`), in a bounded set of shapes.

Each record has a length in the budget's units (its row's tokens). A bounded set of bucket
lengths (`bucket_lengths`: percentiles of the records' lengths, the longest included, as
fairseq's `get_buckets`) gives the batch shapes: a batch of bucket length L has
`rows_per_bucket` rows, the most that fit rows x L <= budget in a multiple of what the mesh
needs (data x fsdp shards x gradient-accumulation steps, and the process count), so each
bucket's shape compiles once and at most `length_buckets` shapes exist.

Each epoch's plan (`plan_epoch`) is a function of (seed, epoch): records go to the shortest
bucket that holds them (grouped by length, as XLM's and fairseq's length-sorted order); going up
from the shortest bucket, its records and those the bucket below left over are shuffled
together and cut into full batches, whose rows are padded to the bucket's length; what is left
moves up a bucket (a shorter record fits a longer batch). Only the longest bucket's remainder
(fewer than its row count) is dropped, a random choice each epoch. The batches are read in a
random order (XLM shuffles its batches; fairseq's `EpochBatchIterator` too). Rows cropped to
their batch's length instead (`crop`: wav2vec 2.0's audio, cut to the batch's shortest) go the
other way: each record to the longest bucket not above it, remainders down a bucket, and only
the shortest bucket's remainder dropped.

`TokenBudgetBatches` is the source a loader reads in order: key k is the whole batch k, this
process's share of its rows (each process takes its own consecutive rows), decoded, cut to the
batch's length by the method's `fit`, and through the method's per-record transforms with an RNG
of (seed, stream, k, row), so that a batch depends on (seed, k) alone and the loader's position
resumes it exactly (`ScheduledBatches` reads several such sources, one per language, in a step
schedule's order); `BATCH_UNITS` carries the real tokens of the whole batch (for the logged rate:
the rows' unpadded lengths, or rows x length where rows are cropped).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import grain
import jax
import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.descriptions import describe
from pretext_jax.input_pipeline.records import UNENDING

BATCH_UNITS = "batch_units"
"""A host-only entry of a whole batch: the real tokens of the global batch (the feed takes it
out before the batch goes to the devices)."""

Fit = Callable[[dict[str, np.ndarray], int, np.random.Generator], dict[str, np.ndarray]]
Finish = Callable[[dict[str, np.ndarray], int, int, int], dict[str, np.ndarray]]


def bucket_lengths(sizes: np.ndarray, count: int) -> np.ndarray:
    """The at most `count` lengths (ascending) that batch lengths are rounded to: the
    percentiles 0, 100 / (count - 1), ..., 100 of `sizes` (lower values, so each is a size and
    the longest is the largest size; fairseq `get_buckets` takes percentiles the same way);
    empty for `count` 0 (no rounding)."""
    if count == 0:
        return np.zeros(0, np.int64)
    return np.unique(np.percentile(sizes, np.linspace(0, 100, count), method="lower")
                     ).astype(np.int64)


def rows_per_bucket(buckets: np.ndarray, budget: int, multiple: int,
                    setting: str = "examples.tokens_per_batch") -> np.ndarray:
    """int64 [buckets]: the most rows of each bucket length within `budget` tokens, in a
    multiple of `multiple`; a UserError (naming the budget's `setting`) when the longest bucket
    holds no such multiple."""
    rows = budget // np.asarray(buckets, np.int64) // multiple * multiple
    if rows[-1] == 0:
        raise UserError(
            f"{setting}={budget} holds no batch of the longest rows "
            f"({buckets[-1]} tokens): a batch has a multiple of {multiple} rows (data x fsdp "
            "shards x optim.grad_accum_steps, and the processes); raise it to at least "
            f"{multiple * int(buckets[-1])}")
    return rows


def plan_epoch(lengths: np.ndarray, buckets: np.ndarray, rows: np.ndarray,
               rng: np.random.Generator, crop: bool = False
               ) -> tuple[list[np.ndarray], np.ndarray]:
    """(the batches' record indices, each batch's bucket index), in reading order (module
    docstring): records grouped by the shortest bucket that holds them, each bucket's pool
    (its records and the bucket below's remainder) shuffled and cut into `rows[b]`-row batches,
    the remainder moving up; the batches shuffled. `crop`: rows are cropped to their batch's
    length instead of padded (audio), so records go to the longest bucket not above them and
    the remainders move down, from the longest bucket to the shortest."""
    bucket_of = (np.searchsorted(buckets, lengths, side="right") - 1 if crop
                 else np.searchsorted(buckets, lengths, side="left"))
    batches: list[np.ndarray] = []
    shapes: list[int] = []
    carry = np.zeros(0, np.int64)
    for bucket in (range(len(rows) - 1, -1, -1) if crop else range(len(rows))):
        count = rows[bucket]
        pool = rng.permutation(np.concatenate([carry, np.flatnonzero(bucket_of == bucket)]))
        full = len(pool) // int(count) * int(count)
        batches += list(pool[:full].reshape(-1, int(count)))
        shapes += [bucket] * (full // int(count))
        carry = pool[full:]
    order = rng.permutation(len(batches))
    return [batches[i] for i in order], np.asarray(shapes, np.int64)[order]


def cut_rows(element: dict[str, np.ndarray], length: int, rng: np.random.Generator
             ) -> dict[str, np.ndarray]:
    """A record of padded fields as a row of a batch `length` long: every field cut to its first
    `length` entries (a shorter one kept whole), e.g. both sides of a translation pair whose
    longer side fits `length` (`TokenBudgetBatches`' `fit`; nothing drawn)."""
    del rng
    return {name: value[:length] for name, value in element.items()}


def _apply(transforms: Sequence[Any], element: dict[str, np.ndarray],
           rng: np.random.Generator) -> dict[str, np.ndarray]:
    for transform in transforms:
        element = (transform.random_map(element, rng)
                   if isinstance(transform, grain.transforms.RandomMap) else transform.map(element))
    return element


class TokenBudgetBatches:
    """Whole training batches within a token budget (module docstring), a source that a loader
    reads in order, one key per batch (`Segment.whole_batches`).

    `records`: a `records.RecordDirectory`; `lengths`: each record's row tokens (what the
    budget counts); `fit(element, length, rng)`: the decoded record as a row of a batch of
    `length` tokens (its padded tokens cut to it; with `crop`, a random window of it);
    `transforms`: the per-record Grain maps applied after it (a method's masking);
    `finish(example, key, row, rows)`, if given, adds what a method draws per row from its place
    `row` of the `rows` rows of batch `key` (wav2vec 2.0: masks equal within groups). `setting`
    names the budget in messages; `units`: each record's real tokens as the logged rate counts
    them (default `lengths`; a translation pair: both sides)."""

    def __init__(self, records: Any, lengths: np.ndarray, *, budget: int, length_buckets: int,
                 multiple: int, seed: int, fit: Fit, transforms: Sequence[Any] = (),
                 finish: Finish | None = None, crop: bool = False, stream: int = 0,
                 setting: str = "examples.tokens_per_batch", units: np.ndarray | None = None):
        self.records, self.seed, self.fit, self.transforms = records, seed, fit, tuple(transforms)
        self.finish, self.crop, self.setting = finish, crop, setting
        self.stream = stream  # told apart in the RNG: one source of several (`ScheduledBatches`)
        self.lengths = np.asarray(lengths, np.int64)
        self.units = self.lengths if units is None else np.asarray(units, np.int64)
        self.budget, self.length_buckets = budget, length_buckets
        # This process's place, taken here: Grain's worker processes see no JAX processes.
        self.process, self.processes = jax.process_index(), jax.process_count()
        self.multiple = math.lcm(multiple, self.processes)
        self.buckets = bucket_lengths(self.lengths, length_buckets)
        self.rows = rows_per_bucket(self.buckets, budget, self.multiple, setting)
        self.batches_per_epoch = len(self.plan(0)[0])
        if not self.batches_per_epoch:
            raise UserError(f"{len(self.lengths)} training records are fewer than one batch of "
                            f"{setting}={budget}; lower it or give more data")
        self.source = self

    def __len__(self) -> int:
        return UNENDING

    def plan(self, epoch: int) -> tuple[list[np.ndarray], np.ndarray]:
        """Epoch `epoch`'s batches: record indices per batch and each batch's length."""
        cached = getattr(self, "_plan", None)
        if cached is not None and cached[0] == epoch:
            return cached[1], cached[2]
        batches, shapes = plan_epoch(self.lengths, self.buckets, self.rows,
                                     np.random.default_rng([self.seed, self.stream, epoch]),
                                     self.crop)
        self._plan = (epoch, batches, self.buckets[shapes])
        return batches, self.buckets[shapes]

    def batch(self, key: int) -> tuple[np.ndarray, int]:
        """(record indices, length) of batch `key` of the run."""
        epoch, index = divmod(int(key), self.batches_per_epoch)
        batches, lengths = self.plan(epoch)
        return batches[index], int(lengths[index])

    def shapes(self) -> list[tuple[int, int]]:
        """The (rows, length) of every batch shape: one per bucket."""
        return [(int(r), int(b)) for r, b in zip(self.rows, self.buckets, strict=True)]

    def __getitem__(self, key: int) -> dict[str, np.ndarray]:
        indices, length = self.batch(key)
        share = len(indices) // self.processes
        first = self.process * share
        rows = []
        for row in range(first, first + share):
            element = self.records.spec.decode(self.records.source[int(indices[row])])
            rng = np.random.default_rng([self.seed, self.stream, int(key), row])
            example = _apply(self.transforms, self.fit(element, length, rng), rng)
            if self.finish is not None:
                example = self.finish(example, int(key), row, len(indices))
            rows.append(example)
        out = {name: np.stack([row[name] for row in rows]) for name in rows[0]}
        real = len(indices) * length if self.crop else self.units[indices].sum()
        out[BATCH_UNITS] = np.asarray(real, np.int64)
        return out

    def load_transforms(self) -> list[grain.transforms.Map]:
        return []  # the rows are decoded, cut and transformed here

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_plan": None}  # workers plan their own epochs

    def __repr__(self) -> str:
        return describe("batches within a token budget", records=repr(self.records.source),
                        seed=self.seed, stream=self.stream, rows_multiple=self.multiple,
                        crop=self.crop, **{self.setting: self.budget,
                                           "examples.length_buckets": self.length_buckets})


class ScheduledBatches:
    """Whole batches of several sources in a schedule's order (XLM's one language per step,
    `xlm_examples.StepSchedule`): step k (0-based) reads the next batch of source
    `schedule.step_set(k)`, each source's batches in its own order, as XLM's `get_batch` takes
    the next batch of that language's iterator. Which batch of its source a step reads is
    counted over the steps before it (cached, so a loader reading in order pays once per step
    and a resume once per run)."""

    def __init__(self, schedule: Any, sources: Sequence[TokenBudgetBatches]):
        self.schedule, self.sources = schedule, list(sources)
        self.source = self
        self._counted: tuple[int, np.ndarray] = (0, np.zeros(len(self.sources), np.int64))

    def __len__(self) -> int:
        return UNENDING

    def position(self, key: int) -> tuple[int, int]:
        """(source, its batch) that step `key` reads."""
        step, counts = self._counted
        if key < step:
            step, counts = 0, np.zeros(len(self.sources), np.int64)
        counts = counts.copy()
        for earlier in range(step, key):
            counts[self.schedule.step_set(earlier)] += 1
        self._counted = (key, counts)
        which = self.schedule.step_set(key)
        return which, int(counts[which])

    def __getitem__(self, key: int) -> dict[str, np.ndarray]:
        which, index = self.position(int(key))
        return self.sources[which][index]

    def load_transforms(self) -> list[grain.transforms.Map]:
        return []

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_counted": (0, np.zeros(len(self.sources), np.int64))}

    def __repr__(self) -> str:
        return describe("scheduled batches within a token budget", schedule=repr(self.schedule),
                        sources=[repr(source) for source in self.sources])
