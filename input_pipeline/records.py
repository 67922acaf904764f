"""Prepared examples on disk (ArrayRecord) and their Grain loader, sharded per JAX process.

Every example of a method has the same fixed-shape numpy features, so a record is the raw bytes
of those arrays back to back, described once by a `features.json` spec beside the shards; one
feature may vary in its first dimension (an audio waveform), stored last so that its length
is what the record's other bytes leave (no per-record header; fixed specs are unchanged). That is
decoded with `np.frombuffer` (no protobuf, no TensorFlow) and is the layout `tfds.data_source`
users know: ArrayRecord files, read here by `ShardSource` (random access like
`grain.sources.ArrayRecordDataSource`, at a constant cost per record).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import errno
import functools
import hashlib
import json
import math
import os
import shutil
import socket
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.descriptions import describe

SPEC_FILE = "features.json"
LENGTHS_FILE = "lengths.npy"  # the variable feature's length per record, in source order
UNENDING = 2 ** 40
"""Keys of a source read in order that draws its own order (XLM's step schedule, audio batches
cropped to their shortest): a run never reaches its end."""
VARIABLE = -1  # a first dimension that varies between records (FeatureSpec)
# One record per chunk (random access for the shuffling loader), snappy-compressed: writing is
# ~2.3x faster than ArrayRecord's default zstd:3 (9 vs 20 us per BERT record) for files ~1.5x
# larger (760 vs 500 bytes per 128-token record; 1,870 uncompressed).
SHARD_OPTIONS = "group_size:1,snappy"
# Reading: no readahead (random access) and no parallel chunk reads, so `seek` + `read` costs
# ~5 us per record. ArrayRecordDataSource's `reader.read([i])` costs time in proportion to the
# records in the shard (array_record 0.8.6: 14 us at 9k records, 250 us at 216k, the size of a
# prepared BERT shard), which held the BERT-base loader to 8 batches of 256 per second per core.
READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:1"
# Grain's read threads (default 16 threads, 500 records ahead) cost the consuming process more
# than they save for records on local disk: the prefetch scans its buffer of futures on every
# record (~0.2 ms per record once 500 are ready). Records are read in the process that
# transforms them; Grain's worker processes (`data.worker_count`) give the parallelism.
LOADER_READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """Name, dtype and shape of every feature in a record, in storage order. A first dimension
    of -1 (`VARIABLE`, only in the last feature) takes whatever length each record has."""

    features: tuple[tuple[str, str, tuple[int, ...]], ...]

    @classmethod
    def of(cls, example: dict[str, np.ndarray], variable: str | None = None) -> FeatureSpec:
        """The spec of `example`'s features; `variable` names one whose first dimension varies
        between records (stored last)."""
        names = [k for k in example if k != variable] + ([variable] if variable else [])
        if variable is not None and (variable not in example or np.ndim(example[variable]) < 1):
            raise ValueError(f"variable-length feature {variable} must be an array in the example")
        return cls(tuple((k, np.asarray(example[k]).dtype.str,
                          (VARIABLE, *np.shape(example[k])[1:]) if k == variable
                          else np.shape(example[k])) for k in names))

    @functools.cached_property
    def dtypes(self) -> tuple[np.dtype, ...]:
        return tuple(np.dtype(dtype) for _, dtype, _ in self.features)

    def encode(self, example: dict[str, np.ndarray]) -> bytes:
        parts = []
        for (name, _, shape), dtype in zip(self.features, self.dtypes, strict=True):
            value = example[name]
            if not (isinstance(value, np.ndarray) and value.dtype == dtype):
                value = np.asarray(value, dtype=dtype)
            if value.shape != shape and not (shape[:1] == (VARIABLE,) and value.ndim == len(shape)
                                              and value.shape[1:] == shape[1:]):
                raise ValueError(f"feature {name} has shape {value.shape}, spec says {shape}")
            parts.append(value.tobytes())
        return b"".join(parts)

    @functools.cached_property
    def _layout(self) -> tuple[tuple[str, np.dtype, tuple[int, ...], int], ...]:
        """(name, dtype, shape, elements) per feature; elements -1: the variable last one."""
        return tuple((name, dtype, shape, -1 if shape[:1] == (VARIABLE,) else math.prod(shape))
                     for (name, _, shape), dtype in zip(self.features, self.dtypes, strict=True))

    def decode(self, record: bytes) -> dict[str, np.ndarray]:
        out, offset = {}, 0
        for name, dtype, shape, count in self._layout:  # a variable feature is the rest
            out[name] = np.frombuffer(record, dtype, count, offset).reshape(shape)
            offset += count * dtype.itemsize
        return out

    def variable_length(self, record: bytes) -> int:
        """The first dimension of a record's variable feature, from the record's size alone."""
        fixed = sum(count * dtype.itemsize for _, dtype, _, count in self._layout if count >= 0)
        _, dtype, shape, _ = self._layout[-1]
        return (len(record) - fixed) // (dtype.itemsize * math.prod(shape[1:]))

    def decode_stacked(self, records: Sequence[bytes]) -> dict[str, np.ndarray]:
        """Records decoded and stacked (a variable-length feature must have one length)."""
        if any(count < 0 for *_, count in self._layout):
            rows = [self.decode(record) for record in records]
            return {name: np.stack([row[name] for row in rows]) for name in rows[0]}
        width = sum(count * dtype.itemsize for _, dtype, _, count in self._layout)
        table = np.frombuffer(b"".join(records), np.uint8).reshape(len(records), width)
        out, offset = {}, 0
        for name, dtype, shape, count in self._layout:
            width = count * dtype.itemsize
            out[name] = table[:, offset:offset + width].copy().view(dtype).reshape(
                len(records), *shape)
            offset += width
        return out

    def to_json(self) -> str:
        return json.dumps([[n, d, list(s)] for n, d, s in self.features])

    @classmethod
    def from_json(cls, text: str) -> FeatureSpec:
        return cls(tuple((n, d, tuple(s)) for n, d, s in json.loads(text)))


@dataclasses.dataclass(frozen=True)
class ExampleBatch:
    """Examples as arrays with a leading example dimension, one record per row: what a builder
    yields instead of single examples where it makes them in bulk (BERT's `bert_batches`), so
    that they are encoded in one pass. Every row has the same fixed-shape features."""

    features: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(next(iter(self.features.values())))

    def rows(self) -> Iterator[dict[str, np.ndarray]]:
        """The examples one by one (views into the arrays)."""
        for index in range(len(self)):
            yield {name: value[index] for name, value in self.features.items()}

    def encode(self, spec: FeatureSpec) -> list[bytes]:
        """Each row as `spec.encode` would write it."""
        count, columns = len(self), []
        for (name, _, shape), dtype in zip(spec.features, spec.dtypes, strict=True):
            value = np.ascontiguousarray(self.features[name], dtype)
            if value.shape != (count, *shape):
                raise ValueError(f"feature {name} has shape {value.shape[1:]}, spec says {shape}")
            columns.append(value.reshape(count, -1).view(np.uint8))
        table = np.concatenate(columns, axis=1)
        width, data = table.shape[1], table.tobytes()
        return [data[i * width:(i + 1) * width] for i in range(count)]


def temporary_path(path: Path) -> Path:
    """Where a file is written before it is renamed to `path`: a hidden name that says which
    host and process writes it. Temporaries of `path` that a killed process of this host left
    are removed first (those of live processes, or of other hosts, are left alone)."""
    host = socket.gethostname()
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        writer_host, _, pid = stale.name[len(path.name) + 2:-4].rpartition("-")[0].rpartition("-")
        if writer_host == host and pid.isdigit() and not _alive(int(pid)):
            stale.unlink(missing_ok=True)
    return path.with_name(f".{path.name}.{host}-{os.getpid()}-{uuid.uuid4().hex}.tmp")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_shard(examples: Iterable[dict[str, np.ndarray] | ExampleBatch], path: str | Path
                ) -> tuple[int, FeatureSpec | None]:
    """Writes examples (or `ExampleBatch`es of them) into one ArrayRecord file as they come,
    under a temporary name renamed at the end (a half-written file is never read). Returns
    (count, spec); nothing is written for no examples. A full disk or write error is a
    UserError naming the directory."""
    path = Path(path)
    tmp = temporary_path(path)
    writer, spec, count = None, None, 0
    try:
        for example in examples:
            batch = example if isinstance(example, ExampleBatch) else None
            if batch is not None and not len(batch):
                continue
            if writer is None:
                spec = FeatureSpec.of(example if batch is None else next(batch.rows()))
                writer = ArrayRecordWriter(str(tmp), SHARD_OPTIONS)
            for record in ([spec.encode(example)] if batch is None else batch.encode(spec)):
                writer.write(record)
            count += 1 if batch is None else len(batch)
        if writer is not None:
            writer.close()
            writer = None
            os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        raise UserError(f"could not write records in {path.parent} ({_reason(e)}); free space "
                        "there or choose another data.cache_dir, then rerun (finished shards "
                        "are kept)") from None
    finally:
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()
        tmp.unlink(missing_ok=True)
    return count, spec


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.errno == errno.ENOSPC or "No space" in str(error):
        return "no space left on the device"
    return (getattr(error, "strerror", None) or str(error).splitlines()[0])[:160]


def write_records(
    examples: Iterable[dict[str, np.ndarray]], directory: str | Path, *, num_shards: int = 4,
    metadata: dict[str, Any] | None = None, variable: str | None = None,
) -> int:
    """Writes examples round-robin into `num_shards` ArrayRecord files plus `features.json`;
    `variable` names a feature whose first dimension varies (`FeatureSpec.of`), whose length
    per record is stored too (`LENGTHS_FILE`, in the order `RecordDirectory.source` reads).

    Written to a temporary sibling of a unique name and renamed at the end, so an interrupted
    preparation never leaves a directory that looks complete, and two processes writing the same
    records at once leave one copy. Returns the number of examples.
    """
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.{uuid.uuid4().hex}.tmp")
    tmp.mkdir(parents=True)
    writers: list[ArrayRecordWriter] = []
    spec = None
    count = 0
    lengths: list[list[int]] = [[] for _ in range(num_shards)]
    try:
        for example in examples:
            if spec is None:
                spec = FeatureSpec.of(example, variable)
                writers = [
                    ArrayRecordWriter(
                        str(tmp / f"records-{i:05d}-of-{num_shards:05d}.array_record"),
                        "group_size:1")
                    for i in range(num_shards)
                ]
            writers[count % num_shards].write(spec.encode(example))
            if variable is not None:
                lengths[count % num_shards].append(len(example[variable]))
            count += 1
    except BaseException:  # the examples' source failed (e.g. a bad file): leave nothing
        for writer in writers:
            with contextlib.suppress(Exception):
                writer.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for writer in writers:
        writer.close()
    if spec is None:
        shutil.rmtree(tmp)
        raise UserError(f"no examples could be built for {directory.name}: the corpus is too "
                        "small or its documents too short; give more text")
    if variable is not None:  # shard files are read in order: shard 0's records first
        np.save(tmp / LENGTHS_FILE, np.concatenate([np.asarray(shard, np.int64)
                                                     for shard in lengths]))
    (tmp / SPEC_FILE).write_text(json.dumps({"spec": json.loads(spec.to_json()), "count": count,
                                             "metadata": metadata or {}}))
    if (directory / SPEC_FILE).is_file():  # another process finished the same records first
        shutil.rmtree(tmp)
        return count
    shutil.rmtree(directory, ignore_errors=True)
    try:
        os.replace(tmp, directory)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (directory / SPEC_FILE).is_file():
            raise
    return count


class RecordDirectory:
    """A prepared directory: its ArrayRecord data source, feature spec and metadata. The source's
    `repr` describes the records by content (`descriptions.describe`): the directory's name and
    its parent's, which preparation derives from a fingerprint of the data and settings, and
    the record count; `earlier_descriptions` holds what older versions stored for the same
    records (a digest of the absolute file paths), so their checkpoints still resume."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        spec_path = directory / SPEC_FILE
        if not spec_path.is_file():
            raise UserError(f"{directory} holds no prepared examples ({SPEC_FILE} missing); "
                            "prepare them again by deleting the folder and re-running")
        info = json.loads(spec_path.read_text())
        self.directory = directory
        self.spec = FeatureSpec.from_json(json.dumps(info["spec"]))
        self.metadata: dict[str, Any] = info["metadata"]
        # Shard files in their order (prepare.py's index), else every file of the folder.
        paths = ([str(directory / name) for name in info["files"]] if "files" in info
                 else sorted(str(p) for p in directory.glob("*.array_record")))
        self.source = ShardSource(paths, describe(
            "prepared records", **{"data.source": self.metadata.get("source")},
            records=f"{directory.parent.name}/{directory.name}", count=info["count"]))
        self.earlier_descriptions = (self.source.paths_description(),)
        if len(self.source) != info["count"]:
            raise UserError(f"{directory} is incomplete ({len(self.source)} of {info['count']} "
                            "records); delete it and prepare the data again")

    def __len__(self) -> int:
        return len(self.source)

    def load_transforms(self) -> list[grain.transforms.Map]:
        """What the loader applies to a stored record first: decoding its bytes."""
        return [_Decode(self.spec)]

    def examples(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        """Decoded examples at `indices`, stacked (used for evaluation sets and tests)."""
        return self.spec.decode_stacked([self.source[int(i)] for i in indices])

    def written_order(self) -> np.ndarray:
        """int64 [records]: the record index of each example in the order `write_records` was
        given them (it deals them round-robin over its shards, so example p is record p // n of
        shard p % n, n shards); a stream cut into windows reads back in stream order by it."""
        ends = np.cumsum(self.source.shard_lengths(), dtype=np.int64)
        starts = np.concatenate([[0], ends[:-1]])
        position = np.arange(len(self), dtype=np.int64)
        shard, offset = position % len(ends), position // len(ends)
        if np.any(offset >= ends[shard] - starts[shard]):
            raise ValueError(f"{self.directory}'s shards were not written round-robin")
        return starts[shard] + offset

    def token_lengths(self, feature: str) -> np.ndarray:
        """int64 [records]: the non-zero entries of `feature` per record (a padded token row's
        length), in source order; counted once and saved beside the records."""
        return self._cached_lengths(
            self.directory / f"lengths-{feature}.npy",
            lambda record: np.count_nonzero(self.spec.decode(record)[feature]))

    def variable_lengths(self) -> np.ndarray:
        """int64 [records]: the variable feature's first dimension per record, in source
        order, as preparation stored it (`LENGTHS_FILE`); records written before it was stored
        are read once and their lengths saved beside them."""
        return self._cached_lengths(self.directory / LENGTHS_FILE, self.spec.variable_length)

    def _cached_lengths(self, path: Path, length: Callable[[bytes], int]) -> np.ndarray:
        """`length` of every stored record, in source order, from `path` if saved, else
        counted in one pass and saved there (atomically)."""
        if path.is_file():
            return np.load(path)
        lengths = np.fromiter((length(self.source[i]) for i in range(len(self))), np.int64,
                              len(self))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.npy")
        np.save(tmp, lengths)
        tmp.replace(path)
        return lengths


def _record_count(path: str) -> int:
    reader = ArrayRecordReader(path, READER_OPTIONS)
    try:
        return reader.num_records()
    finally:
        reader.close()


class ShardSource:
    """Random access to the records of ArrayRecord shards in order, for Grain: record k of the
    concatenated shards by `seek` + `read` on one reader per shard (a lock per reader, as Grain
    may read from threads), at a constant ~5 us per record (see `READER_OPTIONS`). Readers open
    lazily and are not pickled (Grain's worker processes open their own). Its repr, which
    Grain keeps in checkpoints and compares when it restores a loader's state, is
    `description` (`descriptions.describe`: what the records are), else
    `grain.sources.ArrayRecordDataSource`'s for the same paths (`paths_description`)."""

    def __init__(self, paths: Sequence[str], description: str = ""):
        if not paths:
            raise UserError("no ArrayRecord shards to read; prepare the data again")
        self.paths = [str(p) for p in paths]
        self.description = description
        with ThreadPoolExecutor(min(len(self.paths), 16)) as pool:  # ~17 ms per 200k records
            counts = list(pool.map(_record_count, self.paths))
        self._ends = np.cumsum(counts).tolist()
        self._open()

    def _open(self) -> None:
        self._readers: list[Any] = [None] * len(self.paths)
        self._locks = [threading.Lock() for _ in self.paths]

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def shard_lengths(self) -> list[int]:
        """The record count of each shard, in order."""
        return np.diff([0, *self._ends]).tolist()

    def __getitem__(self, record_key: Any) -> bytes:
        key = int(record_key)
        if not 0 <= key < len(self):
            raise IndexError(f"record {key} of {len(self)}")
        shard = bisect.bisect_right(self._ends, key)
        position = key - (self._ends[shard - 1] if shard else 0)
        with self._locks[shard]:
            reader = self._readers[shard]
            if reader is None:
                reader = self._readers[shard] = ArrayRecordReader(self.paths[shard],
                                                                  READER_OPTIONS)
            reader.seek(position)
            return reader.read()

    def __getstate__(self) -> dict[str, Any]:
        return {"paths": self.paths, "_ends": self._ends, "description": self.description}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._open()

    def paths_description(self) -> str:
        """`grain.sources.ArrayRecordDataSource`'s repr: a digest of the absolute paths (what
        checkpoints written before content descriptions hold)."""
        digest = hashlib.sha1()
        for path in self.paths:
            digest.update(path.encode())
        return f"ArrayRecordDataSource(hash_of_paths={digest.hexdigest()})"

    def __repr__(self) -> str:
        return self.description or self.paths_description()


class _Decode(grain.transforms.Map):
    def __init__(self, spec: FeatureSpec):
        self.spec = spec

    def map(self, element: bytes) -> dict[str, np.ndarray]:
        return self.spec.decode(element)


def make_loader(
    records: RecordDirectory | Any,
    *,
    batch_size: int | None,
    seed: int,
    shuffle: bool = True,
    num_epochs: int | None = None,
    transforms: Sequence[grain.transforms.Map | grain.transforms.RandomMap] = (),
    worker_count: int = 0,
) -> grain.DataLoader:
    """A Grain DataLoader over the records (a `RecordDirectory`, or any object with a
    random-access `source` and `load_transforms()`, e.g. `images.ImageSource`): global shuffle
    per epoch with `seed`; this JAX process's rows of every global batch only
    (`ProcessRowsSampler`); per-record transforms (e.g. dynamic masking,
    whose RNG Grain derives from `seed` and the record's stream position, so it is reproducible,
    resumable and independent of the process count); batches of `batch_size` (the per-process
    batch). `batch_size=None`: every key of the source is already a whole batch of this
    process's rows (`token_batches.TokenBudgetBatches`), read by every process in order (no
    Batch). `num_epochs=None` repeats forever. Records are read without Grain's read threads
    (`LOADER_READ_OPTIONS`); `worker_count` processes read and transform in parallel."""
    if worker_count > 0:
        from absl import flags

        if not flags.FLAGS.is_parsed():  # Grain's worker processes read absl flags
            flags.FLAGS.mark_as_parsed()
    stream = grain.samplers.IndexSampler(
        num_records=len(records), shuffle=shuffle, num_epochs=num_epochs, seed=seed)
    operations = [*records.load_transforms(), *transforms]
    if batch_size is not None:
        operations.append(grain.transforms.Batch(batch_size, drop_remainder=True))
        stream = ProcessRowsSampler(stream, batch_size, jax.process_index(),
                                    jax.process_count())
    return grain.DataLoader(
        data_source=records.source, operations=operations, worker_count=worker_count,
        sampler=stream, shard_options=grain.sharding.NoSharding(),
        read_options=LOADER_READ_OPTIONS)


class ProcessRowsSampler:
    """One process's rows of every global batch of a record stream: local record k is stream
    position (k // b) P b + p b + k % b for process p of P with per-process batch b, so the
    processes' batch t, stacked in process order, is the single-process batch t row for row.
    Records keep the stream position's metadata (Grain derives per-record RNG from it)."""

    def __init__(self, stream: grain.samplers.IndexSampler, rows: int, process: int,
                 processes: int):
        self.stream, self.rows, self.process, self.processes = stream, rows, process, processes

    def __len__(self) -> int:
        return len(self.stream) // self.processes

    def __getitem__(self, index: int) -> Any:
        batch, row = divmod(index, self.rows)
        return self.stream[(batch * self.processes + self.process) * self.rows + row]

    def __repr__(self) -> str:  # the same for every process: checkpoints compare it
        return repr(self.stream)
