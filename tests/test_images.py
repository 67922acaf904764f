"""Image sources: CIFAR-10 pickles (channel-major rows -> NHWC, the real files when present),
image folders, TFDS image datasets prepared on disk, the digits demo, host crops, their stable
descriptions, and clear errors for bad folders."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest
from tfds_utils import build_image_dataset, write_cifar10_batch, write_cifar10_folder

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.descriptions import difference
from pretext_jax.input_pipeline.images import cifar10_label_names, read_cifar10


def test_rows_become_nhwc_images(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)
    for i in range(1, 6):
        part = tmp_path / f"part{i % 2}"
        part.mkdir(exist_ok=True)
        write_cifar10_batch(part / f"data_batch_{i}", images, [i] * 5)
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


# ------------------------------------------------------------------ folders, TFDS, host crop
def write_image(path, size: tuple[int, int], seed: int, mode: str = "RGB") -> np.ndarray:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).convert(mode).save(path)
    return pixels


def image_folder(root, sizes) -> None:
    """root/train/<class>/ and root/val/<class>/ with PNGs of the given sizes."""
    for split, count in (("train", 6), ("val", 2)):
        for label in ("cat", "dog"):
            for i in range(count):
                write_image(root / split / label / f"{i}.png", sizes[i % len(sizes)],
                            hash((split, label, i)) % 1000)


def first_batch(train, batch_size: int, seed: int = 0) -> dict:
    from pretext_jax.input_pipeline.records import make_loader

    return next(iter(make_loader(train, batch_size=batch_size, seed=seed)))


def test_image_folder_with_host_crops(tmp_path):
    """Images of many sizes: two random crops per image on the host (uint8, the crop size),
    reproducible per seed; held-out images are data_util.py's centre crop."""
    from PIL import Image

    from pretext_jax.input_pipeline.images import HostCrop, center_window, prepare_images

    image_folder(tmp_path, [(40, 60), (75, 50), (33, 33)])
    crop = HostCrop(size=24)
    train, held_out = prepare_images(str(tmp_path), "", tmp_path / "cache", 100, crop=crop,
                                     held_out_fraction=0.1, seed=0)
    assert len(train) == 12 and held_out["image"].shape == (4, 24, 24, 3)
    np.testing.assert_array_equal(held_out["label"], [0, 0, 1, 1])
    batch = first_batch(train, 4)
    assert batch["image"].shape == (4, 2, 24, 24, 3) and batch["image"].dtype == np.uint8
    assert not np.array_equal(batch["image"][:, 0], batch["image"][:, 1])
    np.testing.assert_array_equal(batch["image"], first_batch(train, 4)["image"])
    assert not np.array_equal(batch["image"], first_batch(train, 4, seed=1)["image"])
    # Centre crop: 0.875 of the short side of the 75x50 image, offsets (size - crop + 1) // 2.
    assert center_window(75, 50, 0.875) == (16, 3, 44, 44)
    original = np.asarray(Image.open(tmp_path / "val" / "cat" / "1.png"))
    expected = np.asarray(Image.fromarray(original[16:60, 3:47]).resize(
        (24, 24), Image.Resampling.BICUBIC))
    np.testing.assert_array_equal(held_out["image"][1], expected)


def test_equal_size_folder_goes_whole_and_mixed_sizes_need_host_crop(tmp_path):
    from pretext_jax.input_pipeline.images import HostCrop, prepare_images

    image_folder(tmp_path / "same", [(20, 20)])
    train, held_out = prepare_images(str(tmp_path / "same" / "train"), "", tmp_path / "c", 100,
                                     crop=HostCrop(), held_out_fraction=0.25, seed=0)
    assert len(train) == 9 and held_out["image"].shape == (3, 20, 20, 3)
    assert first_batch(train, 3)["image"].shape == (3, 20, 20, 3)
    image_folder(tmp_path / "mixed", [(20, 20), (30, 20)])
    train, _ = prepare_images(str(tmp_path / "mixed"), "", tmp_path / "c", 1, crop=HostCrop(),
                              held_out_fraction=0.1, seed=0)
    with pytest.raises(Exception, match="examples.host_crop_size"):
        first_batch(train, 12)


def test_bad_image_folders_give_one_line_errors(tmp_path):
    from pretext_jax.input_pipeline.images import HostCrop, decode_image, prepare_images

    def prepare(source, eval_source=""):
        return prepare_images(str(source), eval_source, tmp_path / "c", 10, crop=HostCrop(8),
                              held_out_fraction=0.1, seed=0)

    (tmp_path / "empty" / "a").mkdir(parents=True)
    with pytest.raises(UserError, match="has no images"):
        prepare(tmp_path / "empty")
    with pytest.raises(UserError, match="not a directory"):
        prepare(tmp_path / "missing")
    write_image(tmp_path / "x" / "a" / "0.png", (9, 9), 0)
    write_image(tmp_path / "y" / "b" / "0.png", (9, 9), 0)
    with pytest.raises(UserError, match="same class folders"):
        prepare(tmp_path / "x", str(tmp_path / "y"))
    with pytest.raises(UserError, match="not a readable image.*re-encode"):
        decode_image(b"\x89PNG broken", "broken.png")
    # Grey and alpha images become RGB.
    write_image(tmp_path / "g.png", (5, 7), 1, mode="L")
    grey = decode_image((tmp_path / "g.png").read_bytes(), "g")
    assert grey.shape == (5, 7, 3) and (grey[..., 0] == grey[..., 2]).all()
    write_image(tmp_path / "a.png", (5, 7), 1, mode="RGBA")
    assert decode_image((tmp_path / "a.png").read_bytes(), "a").shape == (5, 7, 3)


@pytest.mark.parametrize("sizes, host_crop", [((12, 12), 0), ((10, 30), 16)])
def test_tfds_image_datasets_prepared_on_disk(sizes, host_crop, tmp_path):
    """TFDS image datasets prepared as ArrayRecord ({image, label}, PNG-encoded): images of one
    size (CIFAR-10) go whole, images of many sizes (ImageNet) are cropped on the host; the
    held-out split is `test`, else `validation`."""
    from pretext_jax.input_pipeline.images import HostCrop, prepare_images

    held_out_split = "validation" if host_crop else "test"
    build_image_dataset(tmp_path / "tfds", "tiny_images", {"train": 8, held_out_split: 6},
                        sizes=sizes)
    train, held_out = prepare_images("tfds:tiny_images", "", tmp_path, 5,
                                     crop=HostCrop(size=host_crop), held_out_fraction=0.1,
                                     seed=0, tfds_data_dir=str(tmp_path / "tfds"))
    batch = first_batch(train, 4)
    size = host_crop or 12
    assert len(train) == 8 and held_out["image"].shape == (5, size, size, 3)
    views = (4, 2, size, size, 3) if host_crop else (4, size, size, 3)
    assert batch["image"].shape == views and batch["label"].dtype == np.int32


def training_description(source: str, cache, crop=None, seed: int = 0, **kwargs) -> str:
    """What Grain keeps in a checkpoint about the training images of `source`."""
    from pretext_jax.input_pipeline.images import HostCrop, prepare_images

    train, _ = prepare_images(source, "", cache, 4, crop=crop or HostCrop(),
                              held_out_fraction=0.25, seed=seed, **kwargs)
    return repr(train.source)


def test_image_sources_describe_their_content_stably(tmp_path):
    """Every image source's description is the same when the same images are opened again (no
    object ids) and names what changed when they change: an image folder's files and image
    settings, a TFDS dataset's contents, the digits chosen, CIFAR-10's prepared records."""
    from pretext_jax.input_pipeline.images import HostCrop

    image_folder(tmp_path / "folder", [(20, 20)])
    source, cache = str(tmp_path / "folder"), tmp_path / "cache"
    folder = training_description(source, cache)
    assert folder == training_description(source, cache) and "0x" not in folder
    assert json.loads(folder) == {
        "kind": "image folder", "data.source": str((tmp_path / "folder" / "train").resolve()),
        "images": 12, "files": json.loads(folder)["files"], "examples.host_crop_size": 0,
        "image_shape": [20, 20, 3]}
    assert difference(folder, training_description(source, cache, HostCrop(16))).startswith(
        "examples.host_crop_size: 0 vs 16")
    edited = tmp_path / "folder" / "train" / "dog" / "3.png"
    write_image(edited, (20, 20), seed=99)
    os.utime(edited, ns=(1, 1))
    assert difference(folder, training_description(source, cache)).startswith("files: ")
    write_image(tmp_path / "folder" / "train" / "dog" / "9.png", (20, 20), seed=9)
    assert difference(folder, training_description(source, cache)) == "images: 12 vs 13"

    for name, count in (("v1", 8), ("v2", 9)):
        build_image_dataset(tmp_path / name, "tiny_images", {"train": count, "test": 2})
    tfds = training_description("tfds:tiny_images", cache, tfds_data_dir=str(tmp_path / "v1"))
    assert tfds == training_description("tfds:tiny_images", cache,
                                        tfds_data_dir=str(tmp_path / "v1"))
    fields = json.loads(tfds)
    assert (fields["kind"], fields["dataset"], fields["data.tfds_split"], fields["examples"]) == (
        "TFDS images", "tiny_images/1.0.0", "train", 8)
    assert difference(tfds, training_description(
        "tfds:tiny_images", cache, tfds_data_dir=str(tmp_path / "v2"))).startswith("dataset_info")

    (tmp_path / "cifar").mkdir()
    write_cifar10_folder(tmp_path / "cifar", lambda: (np.zeros((2, 32, 32, 3), np.uint8), [0, 1]))
    cifar = training_description(str(tmp_path / "cifar"), cache)
    assert cifar == training_description(str(tmp_path / "cifar"), cache)
    assert json.loads(cifar)["kind"] == "prepared records" and json.loads(cifar)["count"] == 10

    if importlib.util.find_spec("sklearn"):  # the digits demo needs scikit-learn
        digits = training_description("digits", cache)
        assert digits == training_description("digits", cache)
        assert json.loads(digits)["images"] == 1348
        assert difference(digits, training_description("digits", cache, seed=1)).startswith(
            "content: ")


def test_tfds_errors_name_the_fix(tmp_path):
    from pretext_jax.input_pipeline.images import HostCrop, prepare_images

    with pytest.raises(UserError, match="tfds build"):
        prepare_images("tfds:no_such_images_xyz", "", tmp_path, 5, crop=HostCrop(),
                       held_out_fraction=0.1, seed=0, tfds_data_dir=str(tmp_path))


def test_digits_demo_source(tmp_path):
    pytest.importorskip("sklearn", reason="the digits demo needs scikit-learn (demo extra)")
    from pretext_jax.input_pipeline.images import HostCrop, prepare_images

    train, held_out = prepare_images("digits", "", tmp_path, 10000, crop=HostCrop(),
                                     held_out_fraction=0.2, seed=0)
    assert len(train) + len(held_out["label"]) == 1797 and len(held_out["label"]) == 359
    assert held_out["image"].shape[1:] == (8, 8, 3) and held_out["image"].max() == 255
    assert sorted(np.unique(held_out["label"])) == list(range(10))
