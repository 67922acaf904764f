"""Training records read with one more field per record, for methods that keep state per
training example: its position in the records (`IndexedRecords`: CMC's memory-bank rows) or a
value from a table (`WithField`: DeepCluster's pseudo-labels); and a chosen subset of the
records (`SelectedRecords`: semi-supervised fine-tuning's labelled images).

Records here are a `records.RecordDirectory` or an `images.ImageSource`: a random-access
`source` and the Grain transforms that load a stored record (`load_transforms()`). A wrapper
reads (stored record, value) pairs and applies those transforms to the record, then adds the
value, so the loader, its checkpointed position and the per-record random draws are as for the
records alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from pretext_jax.input_pipeline.descriptions import describe


class WithField(grain.transforms.RandomMap):
    """The records' own loading `transforms` on a (record, value) pair, then the value as
    `field`."""

    def __init__(self, transforms: list[Any], field: str):
        self.transforms, self.field = transforms, field

    def random_map(self, element: tuple[Any, Any], rng: np.random.Generator) -> dict[str, Any]:
        record, value = element
        for transform in self.transforms:
            record = (transform.random_map(record, rng)
                      if isinstance(transform, grain.transforms.RandomMap)
                      else transform.map(record))
        return {**record, self.field: value}


class IndexedRecords:
    """`records` with each one's position in them as `index` (int32). Its description (kept
    in checkpoints) is that of `records` inside an `indexed records` one; `examples` (the
    evaluation views) and the length are those of `records`."""

    def __init__(self, records: Any):
        self.records = records
        self.source = self
        self.description = describe("indexed records", records=repr(records.source))

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> tuple[Any, np.int32]:
        return self.records.source[int(index)], np.int32(index)

    def __repr__(self) -> str:
        return self.description

    def load_transforms(self) -> list[Any]:
        return [WithField(self.records.load_transforms(), "index")]

    def examples(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        return self.records.examples(indices)


class SelectedRecords:
    """The records of `records` at `indices` only, in that order (a labelled subset). Its
    description (kept in checkpoints) names `records` and a digest of the indices, so a resume
    with another subset is refused; `examples(i)` are those of the i-th selected records."""

    def __init__(self, records: Any, indices: Sequence[int]):
        self.records = records
        self.indices = np.asarray(indices, np.int64)
        self.source = self
        self.description = describe(
            "selected records", records=repr(records.source), count=len(self.indices),
            indices=hashlib.sha256(self.indices.tobytes()).hexdigest()[:16])

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> Any:
        return self.records.source[int(self.indices[int(index)])]

    def __repr__(self) -> str:
        return self.description

    def load_transforms(self) -> list[Any]:
        return self.records.load_transforms()

    def examples(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        return self.records.examples(self.indices[np.asarray(indices, np.int64)])
