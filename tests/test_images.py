"""CIFAR-10 pickles: the layout (channel-major rows -> NHWC), the real files when present,
and clear errors for bad folders."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from input_pipeline.errors import UserError
from input_pipeline.images import cifar10_label_names, read_cifar10


def write_batch(path, images: np.ndarray, labels: list[int]) -> None:
    rows = images.transpose(0, 3, 1, 2).reshape(len(images), -1)  # R plane, G plane, B plane
    with path.open("wb") as f:
        pickle.dump({b"data": rows, b"labels": labels}, f)


def test_rows_become_nhwc_images(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)
    for i in range(1, 6):
        part = tmp_path / f"part{i % 2}"
        part.mkdir(exist_ok=True)
        write_batch(part / f"data_batch_{i}", images, [i] * 5)
    got, labels = read_cifar10(tmp_path, "train")
    assert got.shape == (25, 32, 32, 3) and got.dtype == np.uint8
    np.testing.assert_array_equal(got[:5], images)
    np.testing.assert_array_equal(labels, np.repeat(np.arange(1, 6), 5))
    with pytest.raises(UserError, match="test_batch"):
        read_cifar10(tmp_path, "test")
    (tmp_path / "test_batch").write_bytes(b"not a pickle")
    with pytest.raises(UserError, match="not a CIFAR python pickle"):
        read_cifar10(tmp_path, "test")
    with pytest.raises(UserError, match="split"):
        read_cifar10(tmp_path, "validation")


def test_shared_cifar10(shared_data):
    root = shared_data / "cifar10"
    train_images, train_labels = read_cifar10(root, "train")
    test_images, test_labels = read_cifar10(root, "test")
    assert train_images.shape == (50000, 32, 32, 3) and test_images.shape == (10000, 32, 32, 3)
    assert (np.bincount(train_labels) == 5000).all() and (np.bincount(test_labels) == 1000).all()
    assert cifar10_label_names(root)[:2] == ["airplane", "automobile"]
    # Real photographs: channels vary, the mean is mid-grey-ish.
    assert 90 < train_images.mean() < 160 and train_images.std() > 40
