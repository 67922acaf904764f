"""Image sources: CIFAR-10 in its python-pickle layout (the `cifar-10-batches-py` files
`data_batch_1..5`, `test_batch`, `batches.meta`, in one folder or spread over sub-folders).

Images come back as uint8 [N, 32, 32, 3] (NHWC) with int32 labels; augmentation and scaling
happen on device (`input_pipeline.image_augment`).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from input_pipeline.errors import UserError
from input_pipeline.prepare import DEMO_CORPUS, fingerprint
from input_pipeline.records import RecordDirectory, write_records

CIFAR10_SPLITS = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}


def _find(root: Path, name: str) -> Path:
    matches = sorted(root.rglob(name))
    if not matches:
        raise UserError(f"{root} has no {name}; pass the folder of CIFAR-10's python version "
                        "(cifar-10-batches-py: data_batch_1..5, test_batch, batches.meta)")
    return matches[0]


def _unpickle(path: Path) -> dict:
    try:
        with path.open("rb") as f:
            return pickle.load(f, encoding="bytes")
    except (pickle.UnpicklingError, EOFError, ValueError) as e:
        raise UserError(f"{path} is not a CIFAR python pickle ({e}); re-download it") from None


def read_cifar10(root: str | Path, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [N, 32, 32, 3], labels int32 [N]) of the `train` (50,000) or `test`
    (10,000) split. Each pickle row is 3072 bytes, channel-major (1024 R, 1024 G, 1024 B)."""
    if split not in CIFAR10_SPLITS:
        raise UserError(f"split {split!r} must be one of {sorted(CIFAR10_SPLITS)}")
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"{root} is not a directory; pass the CIFAR-10 python folder")
    images, labels = [], []
    for name in CIFAR10_SPLITS[split]:
        path = _find(root, name)
        batch = _unpickle(path)
        data = np.asarray(batch.get(b"data", []), np.uint8)
        if data.ndim != 2 or data.shape[1] != 3072 or len(batch.get(b"labels", [])) != len(data):
            raise UserError(f"{path} does not hold CIFAR-10 rows of 3072 bytes with labels; "
                            "re-download it")
        images.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        labels.append(np.asarray(batch[b"labels"], np.int32))
    return np.concatenate(images), np.concatenate(labels)


def cifar10_label_names(root: str | Path) -> list[str]:
    meta = _unpickle(_find(Path(root), "batches.meta"))
    return [name.decode() for name in meta[b"label_names"]]


def prepare_cifar10(source: str, cache_root: Path, max_eval: int
                    ) -> tuple[RecordDirectory, dict[str, np.ndarray]]:
    """(train records of {image, label}, the test split in memory, capped at `max_eval`),
    written once under a fingerprint of the pickle files."""
    if not source or source == DEMO_CORPUS:
        raise UserError("data.source must be a CIFAR-10 python folder (cifar-10-batches-py, "
                        "e.g. --data path/to/cifar10)")
    root = Path(source)
    if not root.is_dir():
        raise UserError(f"data.source={source} is not a directory; pass the CIFAR-10 python "
                        "folder")
    files = [_find(root, name) for names in CIFAR10_SPLITS.values() for name in names]
    key = fingerprint("cifar10", [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns]
                                  for p in files])
    train_dir = Path(cache_root) / key / "train"
    if not (train_dir / "features.json").is_file():
        images, labels = read_cifar10(root, "train")
        write_records(({"image": image, "label": label} for image, label in zip(images, labels,
                                                                                strict=True)),
                      train_dir, metadata={"source": source})
    images, labels = read_cifar10(root, "test")
    return RecordDirectory(train_dir), {"image": images[:max_eval], "label": labels[:max_eval]}
