"""MT-DNN's training order (Liu et al. 2019, Algorithm 1; namisan/mt-dnn
mt_dnn/batcher.py `MultiTaskBatchSampler`): every task's training rows are packed once into
mini-batches of consecutive rows, and each epoch the batches of all tasks are merged and
shuffled, so every step reads one task and the tasks come in proportion to their batch counts
(the mix ratio 0, `mix_opt` 0, of mt-dnn's `_gen_task_indices`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import grain
import numpy as np

from pretext_jax.input_pipeline.descriptions import describe
from pretext_jax.input_pipeline.records import UNENDING, RecordDirectory


class MultiTaskBatches:
    """A random-access source for `records.make_loader`, read in order: each `batch_size`
    consecutive keys are one step, whose rows are one batch of one task. The records hold the
    tasks' training rows one task after another (`sizes`: each task's row count, in order).
    Task t's batches are its rows [bB, (b + 1)B) for b < ceil(n_t / B); the last one, short in
    mt-dnn, takes the task's first rows to fill it (a batch has one shape). Epoch e's order of
    all tasks' batches is a permutation drawn from (seed, e), so key k's record depends on
    (seed, batch_size, k) only and a resumed loader continues the schedule."""

    def __init__(self, records: RecordDirectory, sizes: Sequence[int], seed: int,
                 batch_size: int = 1):
        self.records, self.sizes = records, tuple(int(n) for n in sizes)
        self.seed, self.batch_size = seed, batch_size
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.batches = [math.ceil(n / batch_size) for n in self.sizes]
        # (task, batch) of every batch of an epoch, before the epoch's shuffle
        self.pairs = np.array([(task, b) for task, count in enumerate(self.batches)
                               for b in range(count)], np.int64)
        self.order = records.written_order()  # example position -> record index
        self.length = UNENDING // batch_size * batch_size
        self.source = self

    def for_global_batch(self, batch_size: int) -> MultiTaskBatches:
        """The same schedule with steps of `batch_size` records."""
        return MultiTaskBatches(self.records, self.sizes, self.seed, batch_size)

    def __len__(self) -> int:
        return self.length

    def epoch(self, index: int) -> np.ndarray:
        """int64 [batches, 2]: the (task, batch) of epoch `index`'s steps, in order."""
        rng = np.random.default_rng([self.seed, index])
        return self.pairs[rng.permutation(len(self.pairs))]

    def step_batch(self, step: int) -> tuple[int, int]:
        """(task, batch) of step `step` (0-based)."""
        index, position = divmod(step, len(self.pairs))
        task, batch = self.epoch(index)[position]
        return int(task), int(batch)

    def position(self, key: int) -> int:
        """The example position (in the order the tasks' rows were written) of key `key`."""
        step, row = divmod(int(key), self.batch_size)
        task, batch = self.step_batch(step)
        return int(self.offsets[task] + (batch * self.batch_size + row) % self.sizes[task])

    def __getitem__(self, key: int) -> bytes:
        return self.records.source[int(self.order[self.position(key)])]

    def load_transforms(self) -> list[grain.transforms.Map]:
        return self.records.load_transforms()

    def __repr__(self) -> str:
        return describe("MT-DNN task batches", seed=self.seed, batch=self.batch_size,
                        sizes=list(self.sizes), records=repr(self.records.source))

