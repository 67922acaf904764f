"""Smoke test of `bench.host_input` on a few generated JPEGs (no shared data): both image
paths give two crops of the asked size per image, the loaders give full batches, the timing
helpers count what they ran. No timing is asserted."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from bench import host_input


@pytest.fixture
def jpeg_root(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (8, 20, 24, 3), dtype=np.uint8)
    paths = host_input.write_jpeg_folder(images, np.arange(8) % 2, tmp_path / "jpegs",
                                         size=(64, 48))
    assert len(paths) == 8 and all(p.suffix == ".jpg" for p in paths)
    assert sorted(p.name for p in (tmp_path / "jpegs").iterdir()) == ["class0", "class1"]
    return tmp_path / "jpegs"


def test_our_path_bare_and_through_the_loader(jpeg_root):
    source = host_input.our_source(jpeg_root, crop_size=32)
    assert len(source) == 7  # one image held out, as SimCLR's preparation does
    views = host_input.our_views(source)
    example = views(0, np.random.default_rng(0))
    assert example["image"].shape == (2, 32, 32, 3) and example["image"].dtype == np.uint8
    assert host_input.our_decode(source)(0).shape == (48, 64, 3)
    timed = host_input.time_per_item(lambda i: views(i, np.random.default_rng(i)), 5, warmup=1)
    assert timed["items"] == 5 and timed["per_s"] > 0
    result = host_input.time_batches(host_input.our_loader(source, 3, 0), 3, 2, warmup=1)
    assert result["items"] == 6 and result["per_s"] > 0
    assert result["shapes"] == {"image": [3, 2, 32, 32, 3], "label": [3]}


def test_reference_path_bare_and_through_torch(jpeg_root):
    paths = sorted(jpeg_root.rglob("*.jpg"))
    reference = host_input.ReferenceViews(paths, size=32, use_torchvision=False)
    views = reference[0]
    assert views.shape == (2, 3, 32, 32) and views.dtype == np.uint8  # PILToTensor: CHW
    assert not np.array_equal(views[0], views[1])  # two independent crops
    pytest.importorskip("torch")
    result = host_input.time_batches(host_input.reference_loader(reference, 4, 0), 4, 2,
                                     warmup=1)
    assert result["items"] == 8 and result["shapes"] == [4, 2, 3, 32, 32]


def test_torchvision_crop_parameters_fit_the_image():
    rng = np.random.default_rng(0)
    areas = []
    for _ in range(200):
        top, left, h, w = host_input.random_resized_crop_params(350, 400, (0.08, 1.0),
                                                                (3 / 4, 4 / 3), rng)
        assert 0 <= top <= 350 - h and 0 <= left <= 400 - w and h > 0 and w > 0
        areas.append(h * w / (350 * 400))
    assert min(areas) > 0.07 and max(areas) <= 1.0 and 0.4 < np.mean(areas) < 0.65


def test_cifar10_pickles_become_jpeg_inputs(tmp_path):
    rng = np.random.default_rng(1)
    for i in (1, 2):
        rows = rng.integers(0, 256, (3, 3072), dtype=np.uint8)
        (tmp_path / f"part{i}").mkdir()
        with (tmp_path / f"part{i}" / f"data_batch_{i}").open("wb") as f:
            pickle.dump({b"data": rows, b"labels": [i] * 3}, f)
    images, labels = host_input.cifar10_images(tmp_path, 5)
    assert images.shape == (5, 32, 32, 3) and labels.tolist() == [1, 1, 1, 2, 2]


def test_text_loader_gives_full_batches(tmp_path):
    from pretext_jax.input_pipeline.records import RecordDirectory, write_records

    write_records(({"input_ids": np.full(16, i, np.int32), "label": np.int32(i)}
                   for i in range(40)), tmp_path / "records")
    records = RecordDirectory(tmp_path / "records")
    for workers in (0,):
        result = host_input.time_batches(
            host_input.text_loader(records, (), 8, True, workers), 8, 3, warmup=1)
        assert result["items"] == 24
        assert result["shapes"] == {"input_ids": [8, 16], "label": [8]}
