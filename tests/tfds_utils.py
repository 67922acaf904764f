"""Small datasets on disk: CIFAR-10-format folders (`write_cifar10_folder`), and TFDS datasets
prepared in ArrayRecord as `tfds build NAME --file_format=array_record` writes them
(`dataset_info.json`, `features.json` and `NAME-SPLIT.array_record-0000i-of-0000n` under
`DATA_DIR/NAME[/CONFIG]/VERSION`), by a `GeneratorBasedBuilder` of the tests' own: no network,
no TensorFlow.

`tfds.dataset_builders.store_as_tfds_dataset` would be shorter but checks its inputs against
`tf.data.Dataset`, which needs TensorFlow.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def build_tfds(data_dir: Path, name: str, features: dict[str, Any],
               splits: dict[str, list[dict[str, Any]]], *, config: str | None = None,
               version: str = "1.0.0", metadata: dict[str, Any] | None = None) -> Path:
    """Prepares `splits` (rows of `features`, TFDS feature connectors) as dataset `name`
    (config `config`) in `data_dir`, records in the order given, with the dataset-level
    `metadata` (`DatasetInfo.metadata`, metadata.json) if given; returns its version folder."""
    import tensorflow_datasets as tfds

    dataset_name = name

    class Builder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        name = dataset_name
        VERSION = tfds.core.Version(version)
        BUILDER_CONFIGS = [tfds.core.BuilderConfig(name=config)] if config else []

        def _info(self) -> Any:
            return tfds.core.DatasetInfo(
                builder=self, disable_shuffling=True,
                features=tfds.features.FeaturesDict(features),
                metadata=tfds.core.MetadataDict(metadata) if metadata else None)

        def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
            return {split: self._generate_examples(rows) for split, rows in splits.items()}

        def _generate_examples(self, rows: list[dict[str, Any]]) -> Any:
            yield from enumerate(rows)

    builder = Builder(data_dir=str(data_dir), config=config, file_format="array_record")
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    return Path(builder.data_dir)


def build_text_dataset(data_dir: Path, name: str, documents: list[str]) -> Path:
    """A text dataset of one `text` feature, one record per document, all in `train`."""
    import tensorflow_datasets as tfds

    return build_tfds(data_dir, name, {"text": tfds.features.Text()},
                      {"train": [{"text": document} for document in documents]})


def png(image: np.ndarray) -> bytes:
    """`image` (uint8 [H, W, 3]) encoded as PNG by Pillow (TFDS encodes arrays with
    TensorFlow; builders of real datasets pass it encoded files, as here)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def build_image_dataset(data_dir: Path, name: str, counts: dict[str, int], *,
                        sizes: tuple[int, int] = (16, 16), classes: int = 2,
                        seed: int = 0) -> Path:
    """Random RGB images (PNG) with `image` and `label` features: `counts[split]` images of
    that split, of heights and widths drawn in [sizes[0], sizes[1]] (equal bounds: all one
    size)."""
    import tensorflow_datasets as tfds

    rng = np.random.default_rng(seed)
    rows = {split: [{"image": png(rng.integers(0, 256, (*rng.integers(sizes[0], sizes[1] + 1, 2),
                                                        3), dtype=np.uint8)),
                     "label": int(rng.integers(classes))} for _ in range(count)]
            for split, count in counts.items()}
    shape = (sizes[0], sizes[0], 3) if sizes[0] == sizes[1] else (None, None, 3)
    return build_tfds(data_dir, name, {"image": tfds.features.Image(shape=shape),
                                       "label": tfds.features.ClassLabel(num_classes=classes)},
                      rows)


def build_glue_dataset(data_dir: Path, task: str, splits: dict[str, list[dict[str, Any]]]
                       ) -> Path:
    """TFDS `glue/<task>` with GLUE's features (`idx`, the task's sentences, `label`: class
    ids, or a float score for stsb); rows give the sentences and labels, `idx` is added."""
    import tensorflow_datasets as tfds

    from pretext_jax.input_pipeline.glue import glue_task

    spec = glue_task(task)
    texts = [spec.tfds_text_a, *([spec.tfds_text_b] if spec.tfds_text_b else [])]
    label = (tfds.features.Scalar(np.float32) if spec.is_regression
             else tfds.features.ClassLabel(num_classes=spec.num_labels))
    features = {"idx": tfds.features.Scalar(np.int32), "label": label,
                **{text: tfds.features.Text() for text in texts}}
    return build_tfds(data_dir, "glue", features,
                      {split: [{"idx": i, **row} for i, row in enumerate(rows)]
                       for split, rows in splits.items()}, config=spec.name)


def build_audio_dataset(data_dir: Path, name: str, splits: dict[str, list[np.ndarray]], *,
                        sample_rate: int, classes: int = 10) -> Path:
    """An audio dataset like TFDS's `spoken_digit`: `audio` (int16 samples, mono) and `label`
    (record i of a split: class i % classes). TFDS's `Audio` feature needs TensorFlow even to
    be constructed, so `audio` is a `Tensor` and the rate is `metadata["sample_rate"]`."""
    import tensorflow_datasets as tfds

    rows = {split: [{"audio": np.asarray(waveform, np.int16), "label": i % classes}
                    for i, waveform in enumerate(waveforms)]
            for split, waveforms in splits.items()}
    return build_tfds(data_dir, name, {
        "audio": tfds.features.Tensor(shape=(None,), dtype=np.int16),
        "label": tfds.features.ClassLabel(num_classes=classes)}, rows,
        metadata={"sample_rate": sample_rate})


CIFAR10_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)


def write_cifar10_batch(path: Path, images: np.ndarray, labels: Any) -> None:
    """One CIFAR-10 python pickle: NHWC uint8 `images` as channel-major rows (R plane, G plane,
    B plane), and their labels."""
    rows = images.astype(np.uint8).transpose(0, 3, 1, 2).reshape(len(images), -1)
    with path.open("wb") as f:
        pickle.dump({b"data": rows, b"labels": [int(label) for label in labels]}, f)


def write_cifar10_folder(root: Path, batch: Callable[[], tuple[np.ndarray, Any]]) -> str:
    """A CIFAR-10-format folder: five training files and a test file, each holding the
    (images, labels) of one call of `batch`, in that order. Returns the folder."""
    for name in CIFAR10_FILES:
        write_cifar10_batch(root / name, *batch())
    return str(root)


def write_colour_folder(root: Path, colours: int = 8, seed: int = 0) -> str:
    """A CIFAR-10-format folder (`write_cifar10_folder`) of 6 x 32 images, each one of
    `colours` random colours (its label) with Gaussian pixel noise of 12: 160 training images,
    32 held out."""
    rng = np.random.default_rng(seed)
    palette = rng.integers(0, 256, (colours, 1, 1, 3))

    def batch() -> tuple[np.ndarray, np.ndarray]:
        classes = rng.integers(0, colours, 32)
        return np.clip(palette[classes] + rng.normal(0, 12, (32, 32, 32, 3)), 0, 255), classes

    return write_cifar10_folder(root, batch)
