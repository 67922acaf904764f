"""ArrayRecord storage and the Grain loader: round trip, determinism, resumable iterator."""

from __future__ import annotations

import numpy as np
import pytest

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.records import RecordDirectory, make_loader, write_records


def examples(count: int):
    for i in range(count):
        yield {"ids": np.arange(i, i + 6, dtype=np.int32), "weight": np.float32(i) / 2,
               "label": np.asarray(i % 2, np.int32)}


def test_round_trip_and_spec(tmp_path):
    assert write_records(examples(10), tmp_path / "r", num_shards=3) == 10
    records = RecordDirectory(tmp_path / "r")
    assert len(records) == 10
    stacked = records.examples(range(10))
    got = sorted(zip(stacked["ids"][:, 0].tolist(), stacked["weight"].tolist(), strict=True))
    assert got == [(i, i / 2) for i in range(10)]
    assert stacked["ids"].dtype == np.int32 and stacked["label"].shape == (10,)


def test_loader_is_seeded_and_resumable(tmp_path):
    write_records(examples(40), tmp_path / "r")
    records = RecordDirectory(tmp_path / "r")
    first = [b["ids"][:, 0].tolist() for b, _ in zip(make_loader(records, batch_size=4, seed=1),
                                                     range(12), strict=False)]
    again = [b["ids"][:, 0].tolist() for b, _ in zip(make_loader(records, batch_size=4, seed=1),
                                                     range(12), strict=False)]
    other = [b["ids"][:, 0].tolist() for b, _ in zip(make_loader(records, batch_size=4, seed=2),
                                                     range(12), strict=False)]
    assert first == again and first != other
    epoch = sorted(x for batch in first[:10] for x in batch)
    assert epoch == list(range(40))  # one epoch is a permutation: nothing repeated or skipped
    iterator = iter(make_loader(records, batch_size=4, seed=1))
    for _ in range(5):
        next(iterator)
    state = iterator.get_state()
    resumed = iter(make_loader(records, batch_size=4, seed=1))
    resumed.set_state(state)
    assert [next(resumed)["ids"][:, 0].tolist() for _ in range(7)] == first[5:12]


def test_no_examples_and_incomplete_directories_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no examples"):
        write_records(iter(()), tmp_path / "empty")
    assert not (tmp_path / "empty").exists() and not (tmp_path / "empty.tmp").exists()
    with pytest.raises(UserError, match="features.json"):
        RecordDirectory(tmp_path)
    write_records(examples(8), tmp_path / "r", num_shards=2)
    next((tmp_path / "r").glob("*.array_record")).unlink()
    with pytest.raises(UserError, match="incomplete"):
        RecordDirectory(tmp_path / "r")


def test_worker_processes_give_the_same_stream(tmp_path):
    write_records(examples(24), tmp_path / "r")
    records = RecordDirectory(tmp_path / "r")
    inline = make_loader(records, batch_size=4, seed=3, num_epochs=1)
    workers = make_loader(records, batch_size=4, seed=3, num_epochs=1, worker_count=1)
    expected = [b["ids"].tolist() for b in inline]
    assert [b["ids"].tolist() for b in workers] == expected and len(expected) == 6


def test_shard_source_reads_what_array_record_data_source_reads(tmp_path):
    """`ShardSource` (seek + read, constant cost per record) gives ArrayRecordDataSource's
    record for every key, in any order and from threads, survives pickling (Grain workers) and
    has its repr (Grain compares it when restoring a checkpointed loader)."""
    import pickle
    from concurrent.futures import ThreadPoolExecutor

    import grain

    from pretext_jax.input_pipeline.records import ShardSource, write_shard

    write_records(examples(50), tmp_path / "r", num_shards=3)
    write_shard(examples(7), tmp_path / "r" / "extra.array_record")  # snappy, as prepare.py
    paths = sorted(str(p) for p in (tmp_path / "r").glob("*.array_record"))
    reference = grain.sources.ArrayRecordDataSource(paths)
    source = ShardSource(paths)
    assert len(source) == len(reference) == 57 and repr(source) == repr(reference)
    order = np.random.default_rng(0).permutation(57).tolist()
    assert [source[i] for i in order] == [reference[i] for i in order]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(source.__getitem__, order * 4)) == [reference[i] for i in order] * 4
    copy = pickle.loads(pickle.dumps(source))
    assert [copy[i] for i in order] == [reference[i] for i in order]
    with pytest.raises(IndexError):
        source[57]


def test_example_batches_are_written_as_their_rows(tmp_path):
    """A shard written from `ExampleBatch`es (and single examples between them) holds the same
    records as one written example by example; `decode_stacked` reads them back as the stack of
    `decode`; a batch whose feature has another shape is refused."""
    from pretext_jax.input_pipeline.records import ExampleBatch, ShardSource, write_shard

    rows = list(examples(11))
    stacked = {key: np.stack([row[key] for row in rows]) for key in rows[0]}
    batches = [ExampleBatch({k: v[:4] for k, v in stacked.items()}), rows[4],
               ExampleBatch({k: v[5:5] for k, v in stacked.items()}),
               ExampleBatch({k: v[5:] for k, v in stacked.items()})]
    assert write_shard(batches, tmp_path / "bulk.array_record")[0] == 11
    count, spec = write_shard(rows, tmp_path / "single.array_record")
    bulk, single = (ShardSource([str(tmp_path / f"{name}.array_record")])
                    for name in ("bulk", "single"))
    assert [bulk[i] for i in range(11)] == [single[i] for i in range(11)]
    decoded = spec.decode_stacked([bulk[i] for i in range(11)])
    for key, value in stacked.items():
        np.testing.assert_array_equal(decoded[key], value)
        assert decoded[key].dtype == value.dtype
    wrong = ExampleBatch({**stacked, "ids": stacked["ids"][:, :5]})
    with pytest.raises(ValueError, match="ids"):
        wrong.encode(spec)
