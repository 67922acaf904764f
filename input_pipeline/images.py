"""Image sources for the image methods, all ending as uint8 NHWC images with int32 labels:

- CIFAR-10 in its python-pickle layout (`cifar-10-batches-py`: `data_batch_1..5`, `test_batch`,
  `batches.meta`, in one folder or spread over sub-folders), stored once as ArrayRecord;
- TFDS image datasets by name (`tfds:cifar10`, `tfds:imagenet2012`, ...) through
  `sources.open_tfds` (prepared as ArrayRecord, read without TensorFlow, never downloaded);
- an image folder (`root/<class>/<image>`, the ImageNet / torchvision layout, optionally with
  `train/` and `val/` inside), decoded with Pillow; with `skip_unreadable` every image is
  decoded once first and those Pillow cannot read are left out (listed in the data cache);
- `digits`: scikit-learn's 1,797 scanned 8x8 handwritten digits, the offline image demo.

Images of one fixed size go to the device whole and are cropped there
(`input_pipeline.image_augment`). Images of many sizes (ImageNet) are decoded on the host and
delivered as two random crops per image at `host_crop_size` (data_util.py `crop_and_resize`:
the same crop-window sampler as on device, then bicubic resize); evaluation uses the centre
crop (`center_crop`, crop_proportion 0.875).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import hashlib
import io
import json
import os
import pickle
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import grain
import numpy as np
from PIL import Image, UnidentifiedImageError

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.descriptions import describe, files_fingerprint
from pretext_jax.input_pipeline.image_augment import CropConfig, window_from_uniforms
from pretext_jax.input_pipeline.prepare import DEMO_CORPUS, fingerprint
from pretext_jax.input_pipeline.records import RecordDirectory, write_records
from pretext_jax.input_pipeline.sources import TfdsSplit, open_tfds
from pretext_jax.progress import progress

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".ppm", ".tif",
                            ".tiff"})
DIGITS_SOURCE = "digits"
EVAL_SPLIT_NAMES = ("val", "validation", "test")

CIFAR10_SPLITS = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
SKIP_OPTION = "examples.skip_unreadable_images=true"
# What Pillow raises for bytes it cannot read as an image.
_UNREADABLE = (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError)


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


def _cifar10_records(root: Path, cache_root: Path) -> RecordDirectory:
    """The training pickles as ArrayRecord {image, label}, written once under a fingerprint."""
    files = [_find(root, name) for names in CIFAR10_SPLITS.values() for name in names]
    key = fingerprint("cifar10", [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns]
                                  for p in files])
    train_dir = Path(cache_root) / key / "train"
    if not (train_dir / "features.json").is_file():
        images, labels = read_cifar10(root, "train")
        write_records(({"image": image, "label": label} for image, label in zip(images, labels,
                                                                                strict=True)),
                      train_dir, metadata={"source": str(root)})
    return RecordDirectory(train_dir)


# ------------------------------------------------------------------------- decode and crop
def _as_rgb_array(data: Any) -> np.ndarray | None:
    """An array that already is an image ([H, W] or [H, W, 1|3] uint8) as [H, W, 3] (no copy
    when it has 3 channels), else None."""
    if isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim in (2, 3) and (
            data.ndim == 2 or data.shape[2] in (1, 3)):
        return np.ascontiguousarray(np.broadcast_to(data.reshape(*data.shape[:2], -1),
                                                    (*data.shape[:2], 3)))
    return None


def _open(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def _reason(error: Exception) -> str:
    if isinstance(error, UnidentifiedImageError):
        return "not in a format Pillow reads"
    return str(error).splitlines()[0][:120] if str(error) else type(error).__name__


def load_image(data: bytes | np.ndarray, name: str) -> np.ndarray | Image.Image:
    """An image array as uint8 [H, W, 3] (see `decode_image`), or encoded bytes decoded to an
    RGB Pillow image (any format Pillow reads; grey, palette and alpha images become RGB; an
    RGB image is used as decoded, without a copy). `name` names the image in errors (its file)."""
    array = _as_rgb_array(data)
    if array is not None:
        return array
    try:
        image = _open(bytes(data))
        return image if image.mode == "RGB" else image.convert("RGB")
    except _UNREADABLE as e:
        raise UserError(f"{name} is not a readable image ({_reason(e)}); remove or re-encode "
                        "it (a run with checkpoints then starts again in a new --workdir), or "
                        f"start with {SKIP_OPTION} to leave out every unreadable image"
                        ) from None


def decode_image(data: bytes | np.ndarray, name: str) -> np.ndarray:
    """uint8 [H, W, 3] from encoded bytes (any format Pillow reads; grey, palette and alpha
    images become RGB) or from an array that already is an image ([H, W] or [H, W, 1|3])."""
    return np.asarray(load_image(data, name))


def resize_crop(image: np.ndarray | Image.Image, window: Sequence[float], size: int
                ) -> np.ndarray:
    """The window (top, left, height, width) cut out, then resized to size x size, bicubic
    (data_util.py: crop_to_bounding_box, then tf.image.resize BICUBIC; Pillow's bicubic also
    antialiases when it shrinks, TF's does not). `image` is uint8 [H, W, 3] or an RGB Pillow
    image (cropped without a copy of the whole image; the same pixels)."""
    top, left, height, width = (int(v) for v in window)
    if isinstance(image, Image.Image):
        crop = image.crop((left, top, left + width, top + height))
    else:
        crop = Image.fromarray(image[top:top + height, left:left + width])
    return np.asarray(crop.resize((size, size), Image.Resampling.BICUBIC))


def _height_width(image: np.ndarray | Image.Image) -> tuple[int, int]:
    return (image.height, image.width) if isinstance(image, Image.Image) else image.shape[:2]


def center_window(height: int, width: int, proportion: float) -> tuple[int, int, int, int]:
    """data_util.py `center_crop` for a square output: a square of round(proportion x the
    shorter side), offsets (size - crop + 1) // 2."""
    crop = int(np.rint(proportion * min(height, width)))
    return (height - crop + 1) // 2, (width - crop + 1) // 2, crop, crop


@dataclasses.dataclass(frozen=True)
class HostCrop:
    """Host-side cropping for images of many sizes: `size` (0 = images go whole to the
    device), the random crop's settings and the evaluation centre-crop proportion."""

    size: int = 0
    window: CropConfig = CropConfig()
    eval_proportion: float = 0.875

    def views(self, image: np.ndarray | Image.Image, rng: np.random.Generator) -> np.ndarray:
        """Two independent random crops, uint8 [2, size, size, 3]."""
        height, width = _height_width(image)
        return np.stack([
            resize_crop(image, window_from_uniforms(
                np, rng.random((4, self.window.attempts), np.float32), height, width,
                self.window), self.size)
            for _ in range(2)])

    def evaluation_view(self, image: np.ndarray | Image.Image) -> np.ndarray:
        return resize_crop(image, center_window(*_height_width(image), self.eval_proportion),
                           self.size)


_HEAP_KEPT = False


def keep_freed_heap() -> None:
    """Once per process, on glibc: heap memory freed by one batch stays for the next. Each
    image's crops are a 300 KB array until the batch is stacked; by default glibc then gives the
    batch's worth of freed heap back to the OS (M_TRIM_THRESHOLD starts at 128 KB) and the next
    batch faults every page in again: 74 page faults per image, 6-10% of the loader's CPU time.
    Allocations under 32 MiB come from the heap and up to 1 GiB of freed top-of-heap memory is
    kept (`mallopt` M_MMAP_THRESHOLD, M_TRIM_THRESHOLD; like MALLOC_TRIM_THRESHOLD_). Elsewhere
    (macOS, musl without mallopt) nothing changes."""
    global _HEAP_KEPT
    if _HEAP_KEPT:
        return
    _HEAP_KEPT = True
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD


class ImageReader(Protocol):
    """Image `index` as (encoded bytes or uint8 array, label), which images these are, and how
    errors name image `index` (its file, where it has one)."""

    def __call__(self, index: int) -> tuple[Any, int]: ...

    def identity(self) -> dict[str, Any]: ...

    def name(self, index: int) -> str: ...


class _TwoViews(grain.transforms.RandomMap):
    def __init__(self, crop: HostCrop, read: ImageReader):
        self.crop, self.read = crop, read

    def random_map(self, element: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        keep_freed_heap()
        image = load_image(element["image"], self.read.name(element["index"]))
        return {"image": self.crop.views(image, rng), "label": element["label"]}


class _WholeImage(grain.transforms.Map):
    def __init__(self, shape: tuple[int, ...], read: ImageReader):
        self.shape, self.read = shape, read

    def map(self, element: dict[str, Any]) -> dict[str, Any]:
        name = self.read.name(element["index"])
        image = decode_image(element["image"], name)
        if image.shape != self.shape:
            raise UserError(f"{name} is {image.shape[:2]}, others {self.shape[:2]}; images of "
                            "different sizes need examples.host_crop_size (e.g. 224)")
        return {"image": image, "label": element["label"]}


class ImageSource:
    """Random-access labelled images for Grain: `read(i)` gives (encoded bytes or uint8 array,
    label); `load_transforms()` turns a record into the fixed-shape example the device gets
    (whole image, or two host crops); `examples(indices)` gives stacked evaluation views.
    `repr` is the stable description Grain keeps in checkpoints (`descriptions.describe`): the
    reader's `identity()` (which images) and the image settings."""

    def __init__(self, name: str, count: int, read: ImageReader, crop: HostCrop):
        if count == 0:
            raise UserError(f"{name} holds no images; point data.source at a folder of images "
                            "or a TFDS image dataset")
        self.name, self.count, self.read, self.crop = name, count, read, crop
        self.source = self
        self._shape: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, Any]:
        image, label = self.read(int(index))
        return {"image": image, "label": np.int32(label), "index": int(index)}

    def _evaluation_view(self, index: int) -> np.ndarray:
        record = self[index]
        if self.crop.size:
            return self.crop.evaluation_view(load_image(record["image"], self.read.name(index)))
        return _WholeImage(self.image_shape(), self.read).map(record)["image"]

    @functools.cached_property
    def description(self) -> str:
        settings: dict[str, Any] = {"examples.host_crop_size": self.crop.size}
        if self.crop.size:
            settings["host_crop_area"] = list(self.crop.window.area)
        else:
            settings["image_shape"] = list(self.image_shape())
        return describe(**self.read.identity(), **settings)

    def __repr__(self) -> str:
        return self.description

    def image_shape(self) -> tuple[int, ...]:
        if self._shape is None:
            self._shape = decode_image(self[0]["image"], self.read.name(0)).shape
        return self._shape

    def load_transforms(self) -> list[grain.transforms.Map | grain.transforms.RandomMap]:
        if self.crop.size:
            return [_TwoViews(self.crop, self.read)]
        return [_WholeImage(self.image_shape(), self.read)]

    def examples(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        return {"image": np.stack([self._evaluation_view(i) for i in indices]),
                "label": np.array([self[i]["label"] for i in indices], np.int32)}


# ----------------------------------------------------------------------------- sources
def _image_files(root: Path) -> tuple[list[Path], list[int], list[str]]:
    """`root/<class>/**/<image>` with classes in sorted order, or images directly in `root`
    (unlabelled: label -1)."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        files = sorted(p for p in root.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        return files, [-1] * len(files), []
    files, labels = [], []
    for label, name in enumerate(classes):
        found = sorted(p for p in (root / name).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
        files.extend(found)
        labels.extend([label] * len(found))
    return files, labels, classes


@dataclasses.dataclass(frozen=True)
class _FileReader:
    root: Path
    files: list[Path]
    labels: list[int]

    def __call__(self, index: int) -> tuple[bytes, int]:
        return self.files[index].read_bytes(), self.labels[index]

    def identity(self) -> dict[str, Any]:
        """The folder and a digest of its images' relative paths, sizes, mtimes and labels."""
        return {"kind": "image folder", "data.source": str(self.root.resolve()),
                "images": len(self.files),
                "files": files_fingerprint(self.root, self.files, self.labels)}

    def name(self, index: int) -> str:
        return str(self.files[index])


@dataclasses.dataclass(frozen=True)
class _ArrayReader:
    images: np.ndarray
    labels: np.ndarray
    indices: np.ndarray

    def __call__(self, index: int) -> tuple[np.ndarray, int]:
        return self.images[self.indices[index]], int(self.labels[self.indices[index]])

    def identity(self) -> dict[str, Any]:
        """A digest of the chosen images and labels, in order."""
        digest = hashlib.sha1(np.ascontiguousarray(self.images[self.indices]).tobytes())
        digest.update(np.asarray(self.labels[self.indices], np.int64).tobytes())
        return {"kind": DIGITS_SOURCE, "images": len(self.indices),
                "content": digest.hexdigest()[:16]}

    def name(self, index: int) -> str:
        return f"{DIGITS_SOURCE} image {self.indices[index]}"


@dataclasses.dataclass(frozen=True)
class _TfdsReader:
    source: TfdsSplit

    def __call__(self, index: int) -> tuple[np.ndarray, int]:
        record = self.source[index]
        return record["image"], int(record["label"])

    def identity(self) -> dict[str, Any]:
        """The TFDS split's description: dataset, version, split, count."""
        return {"kind": "TFDS images", "data.source": f"tfds:{self.source.name}",
                **self.source.fields}

    def name(self, index: int) -> str:
        return (f"tfds:{self.source.name}[{self.source.fields['data.tfds_split']}] record "
                f"{index}")


def _is_readable(path: Path) -> bool:
    try:
        _open(path.read_bytes())
    except _UNREADABLE:
        return False
    return True


def _readable(files: list[Path], labels: list[int], cache_root: Path
              ) -> tuple[list[Path], list[int]]:
    """`files` (and their `labels`) without those Pillow cannot read, each decoded once on as
    many threads as cores; what was left out is printed and kept in
    `cache_root/unreadable-images-<digest of the files>.json`, which later runs over the same
    files read instead of decoding them again."""
    resolved = [str(p.resolve()) for p in files]
    key = fingerprint("unreadable images", [[path, p.stat().st_size, p.stat().st_mtime_ns]
                                            for path, p in zip(resolved, files, strict=True)])
    listing = Path(cache_root) / f"unreadable-images-{key}.json"
    if listing.is_file():
        unreadable = set(json.loads(listing.read_text()))
    else:
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            checked = list(progress(pool.map(_is_readable, files), "checking images",
                                    total=len(files), unit="image"))
        unreadable = {path for path, ok in zip(resolved, checked, strict=True) if not ok}
        listing.parent.mkdir(parents=True, exist_ok=True)
        staged = listing.with_suffix(f".{os.getpid()}.tmp")
        staged.write_text(json.dumps(sorted(unreadable)))
        os.replace(staged, listing)
    kept = [i for i, path in enumerate(resolved) if path not in unreadable]
    left_out = sorted(str(files[i]) for i in set(range(len(files))) - set(kept))
    if left_out:
        print(f"left out {len(left_out)} unreadable image{'s' if len(left_out) > 1 else ''} "
              f"({', '.join(left_out[:3])}{', ...' if len(left_out) > 3 else ''}; all listed "
              f"in {listing})", flush=True)
    return [files[i] for i in kept], [labels[i] for i in kept]


def _folder_source(root: Path, files: list[Path], labels: list[int], crop: HostCrop
                   ) -> ImageSource:
    return ImageSource(str(root), len(files), _FileReader(root, files, labels), crop)


def image_folder_sources(root: Path, eval_root: Path | None, held_out_fraction: float,
                         seed: int, crop: HostCrop, skipping_in: Path | None = None
                         ) -> tuple[ImageSource, ImageSource]:
    """(train, held out) from an image folder: `root/train` + `root/val|validation|test`,
    or `root` + `eval_root`, or `root` with `held_out_fraction` of its images held out.
    `skipping_in`: leave out the images Pillow cannot read, listed in this cache (`_readable`)."""
    splits = {d.name: d for d in root.iterdir() if d.is_dir()}
    if eval_root is None and "train" in splits and any(n in splits for n in EVAL_SPLIT_NAMES):
        eval_root = splits[next(n for n in EVAL_SPLIT_NAMES if n in splits)]
        root = splits["train"]
    files, labels, classes = _image_files(root)
    if skipping_in is not None:
        files, labels = _readable(files, labels, skipping_in)
    if not files:
        raise UserError(f"{root} has no images ({', '.join(sorted(IMAGE_SUFFIXES))}); use "
                        "root/<class>/<image> or point data.source at a CIFAR-10 folder")
    if eval_root is not None:
        eval_files, eval_labels, eval_classes = _image_files(eval_root)
        if skipping_in is not None:
            eval_files, eval_labels = _readable(eval_files, eval_labels, skipping_in)
        if eval_classes and eval_classes != classes:
            raise UserError(f"{eval_root} has classes {eval_classes[:5]}..., {root} has "
                            f"{classes[:5]}...; the held-out folder needs the same class "
                            "folders")
    else:
        order = np.random.default_rng(seed).permutation(len(files))
        count = min(max(1, round(len(files) * held_out_fraction)), len(files) - 1)
        held = set(order[:count].tolist())
        eval_files = [f for i, f in enumerate(files) if i in held]
        eval_labels = [y for i, y in enumerate(labels) if i in held]
        files = [f for i, f in enumerate(files) if i not in held]
        labels = [y for i, y in enumerate(labels) if i not in held]
    return (_folder_source(root, files, labels, crop),
            _folder_source(eval_root or root, eval_files, eval_labels, crop))


def tfds_image_sources(name: str, split: str, data_dir: str | None, crop: HostCrop
                       ) -> tuple[ImageSource, ImageSource]:
    """(train, held out) of a TFDS image dataset with `image` and `label` features; the held
    out split is `test` (cifar10) or else `validation` (imagenet2012)."""
    train = open_tfds(name, split, data_dir)
    held_out = None
    for eval_split in ("test", "validation"):
        try:
            held_out = open_tfds(name, eval_split, data_dir)
            break
        except UserError:
            continue
    if held_out is None:
        raise UserError(f"TFDS {name} has no test or validation split to evaluate on; prepare "
                        "one with tfds build")

    def source(split_source: TfdsSplit) -> ImageSource:
        first = split_source[0] if len(split_source) else {}
        if "image" not in first or "label" not in first:
            raise UserError(f"TFDS {name} records have {sorted(first)}, not image and label; "
                            "choose an image classification dataset")
        return ImageSource(f"tfds:{name}[{split_source.fields['data.tfds_split']}]",
                           len(split_source), _TfdsReader(split_source), crop)

    return source(train), source(held_out)


def digits_sources(held_out_fraction: float, seed: int, crop: HostCrop
                   ) -> tuple[ImageSource, ImageSource]:
    """scikit-learn's digits (UCI optical recognition of handwritten digits: 1,797 real 8x8
    scans, 16 grey levels), ships with scikit-learn (`pip install 'pretext-jax[demo]'`)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise UserError("the digits demo needs scikit-learn; pip install 'pretext-jax[demo]' or "
                        "scikit-learn") from None
    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    order = np.random.default_rng(seed).permutation(len(images))
    count = min(max(1, round(len(images) * held_out_fraction)), len(images) - 1)
    held, kept = np.sort(order[:count]), np.sort(order[count:])

    def source(indices: np.ndarray) -> ImageSource:
        return ImageSource(DIGITS_SOURCE, len(indices),
                           _ArrayReader(images, digits.target, indices), crop)

    return source(kept), source(held)


def prepare_images(source: str, eval_source: str, cache_root: Path, max_eval: int, *,
                   crop: HostCrop, held_out_fraction: float, seed: int,
                   tfds_split: str = "train", tfds_data_dir: str | None = None,
                   skip_unreadable: bool = False) -> tuple[Any, dict[str, np.ndarray]]:
    """(training images for the loader, the held-out evaluation views in memory, capped at
    `max_eval`) from any of the sources above; `skip_unreadable`: an image folder's unreadable
    images are left out (`image_folder_sources`)."""
    if not source or source == DEMO_CORPUS:
        raise UserError("data.source must be images: a CIFAR-10 python folder, tfds:NAME, an "
                        f"image folder or {DIGITS_SOURCE!r} (e.g. --data path/to/cifar10)")
    if source == DIGITS_SOURCE:
        train, held_out = digits_sources(held_out_fraction, seed, crop)
    elif source.startswith("tfds:"):
        train, held_out = tfds_image_sources(source[5:], tfds_split, tfds_data_dir, crop)
    else:
        root = Path(source)
        if not root.is_dir():
            raise UserError(f"data.source={source} is not a directory; pass a CIFAR-10 python "
                            "folder, an image folder or tfds:NAME")
        if list(root.rglob("data_batch_1")):
            if crop.size:
                raise UserError("CIFAR-10 images are all 32x32; set examples.host_crop_size=0")
            train = _cifar10_records(root, cache_root)
            images, labels = read_cifar10(root, "test")
            return train, {"image": images[:max_eval], "label": labels[:max_eval]}
        train, held_out = image_folder_sources(
            root, Path(eval_source) if eval_source else None, held_out_fraction, seed, crop,
            Path(cache_root) if skip_unreadable else None)
    return train, held_out.examples(range(min(len(held_out), max_eval)))
