"""Host input throughput: ImageNet-style JPEGs decoded and cropped, and text batches, per core.

    python -m bench.host_input [--images 2000] [--workers 0,1,2] [--photos]
                               [--text bert,xlnet] [--workdir DIR]

Images. `--images` JPEGs are written once into `--workdir` as an image folder
(`root/<class>/<image>.jpg`): CIFAR-10 training images (`$PRETEXT_SHARED_DATA/cifar10` or
`../shared/data/cifar10`, the python pickles) upsampled bicubically to 400x350 and saved at
quality 90, or with `--photos` random 400x350 windows of the two photographs that ship with
scikit-learn (china.jpg, flower.jpg), re-encoded at quality 90 (the upsampled CIFAR images are
smooth, so they decode faster than photographs of the same size). Then, on the same files:

- ours, bare: the per-record Grain transform SimCLR's ImageNet presets run
  (`images.ImageSource.load_transforms()`: read, Pillow decode, two random crops with
  data_util.py's window sampler, bicubic resize to 224), called image by image in this process;
- ours, loader: the same through the training loader (`objectives.simclr` preparation with
  `examples.host_crop_size=224`, `records.make_loader`, batches of `--batch`) with
  `data.worker_count` = each of `--workers`;
- reference, bare and through `torch.utils.data.DataLoader` with `num_workers` = each of
  `--workers`: torchvision's ImageFolder loader (`pil_loader`: Pillow open + convert("RGB"))
  then two `RandomResizedCrop(224, interpolation=BICUBIC)` + `PILToTensor`, the usual SimCLR
  two-view transform in PyTorch. When torchvision cannot be imported, the same steps are run
  from a copy of torchvision 0.28's `RandomResizedCrop.get_params` and its PIL
  `resized_crop` (crop, then resize), and the output says `torchvision: false`.

Text (`--text`, skipped with `--text=`): WikiText-2's train.txt prepared once into
`--workdir` (sentencepiece 8k pieces) with `bert_base`'s settings (seq 128, 20 predictions,
static masks, batch 256) and `xlnet_base`'s layout (seq 512, reuse 256, 85 targets, 256
streams = batch 256, bi_data), then batches per second through `make_loader` as training reads
them, for each worker count.

Per core: images (or batches) per second divided by the worker count (1 for worker_count 0 and
for the bare rows), and per CPU-second: of this process for the bare rows, of the whole process
tree (main + workers) for the loaders where psutil is installed; CPU-seconds are steadier than
wall-clock rates when other jobs share the host. SimCLR ResNet-50 at its target speed needs
about 430 images/s per core on a 16-core host (`TARGET_PER_CORE`). Prints a table and one
JSON line, then one Markdown row per measurement for docs/benchmarks.md ("Host input",
`bench.report`). Needs the shared data for the CIFAR JPEGs and the text (each part is skipped
with a message when it is absent); `--photos` needs none.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pickle
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from bench import report

REPO = Path(__file__).resolve().parent.parent
TARGET_PER_CORE = 430.0
JPEG_SIZE = (400, 350)  # width, height
CROP_SIZE = 224
TABLE = report.Table("host_input", (
    "what", "workers", "per s (wall)", "per core", "per CPU-second", "unit", "input"))


def shared_data_dir() -> Path:
    """$PRETEXT_SHARED_DATA, else ../shared/data beside the repository."""
    return Path(os.environ.get("PRETEXT_SHARED_DATA", REPO.parent / "shared" / "data"))


# ----------------------------------------------------------------------------- the JPEGs
def cifar10_images(folder: Path, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The first `count` CIFAR-10 training images (uint8 [N, 32, 32, 3]) and labels, read from
    data_batch_1, 2, ... (python pickles, in one folder or spread over sub-folders)."""
    images, labels = [], []
    for i in range(1, 6):
        if sum(len(x) for x in images) >= count:
            break
        paths = sorted(folder.rglob(f"data_batch_{i}"))
        if not paths:
            raise FileNotFoundError(f"{folder} has no data_batch_{i}")
        with paths[0].open("rb") as f:
            batch = pickle.load(f, encoding="bytes")
        images.append(np.asarray(batch[b"data"], np.uint8).reshape(-1, 3, 32, 32)
                      .transpose(0, 2, 3, 1))
        labels.append(np.asarray(batch[b"labels"], np.int32))
    return np.concatenate(images)[:count], np.concatenate(labels)[:count]


def photo_windows(count: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`count` random 400x350 windows (randomly mirrored) of scikit-learn's two sample photos
    (427x640), labelled by photo: real photographic detail for the decoder."""
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    rng = np.random.default_rng(seed)
    width, height = JPEG_SIZE
    out = np.empty((count, height, width, 3), np.uint8)
    labels = rng.integers(0, len(photos), count).astype(np.int32)
    for i, label in enumerate(labels):
        photo = photos[label]
        top = rng.integers(0, photo.shape[0] - height + 1)
        left = rng.integers(0, photo.shape[1] - width + 1)
        window = photo[top:top + height, left:left + width]
        out[i] = window[:, ::-1] if rng.random() < 0.5 else window
    return out, labels


def write_jpeg_folder(images: np.ndarray, labels: np.ndarray, root: Path,
                      size: tuple[int, int] = JPEG_SIZE, quality: int = 90) -> list[Path]:
    """Each image resized (bicubic) to `size` (width, height) and saved as
    `root/class<label>/<index>.jpg` at `quality`; the paths in order."""
    paths = []
    for index, (image, label) in enumerate(zip(images, labels, strict=True)):
        path = root / f"class{int(label)}" / f"{index:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        picture = Image.fromarray(image)
        if picture.size != size:
            picture = picture.resize(size, Image.Resampling.BICUBIC)
        picture.save(path, quality=quality)
        paths.append(path)
    return paths


def jpeg_folder(workdir: Path, count: int, photos: bool) -> Path | None:
    """The benchmark's image folder under `workdir`, written on first use; None (with a
    message) when CIFAR-10 is not in the shared data."""
    root = workdir / f"{'photos' if photos else 'cifar10'}-jpeg-{count}"
    done = root / ".complete"
    if done.is_file():
        return root
    if photos:
        images, labels = photo_windows(count)
    else:
        cifar = shared_data_dir() / "cifar10"
        if not cifar.is_dir():
            print(f"images skipped: CIFAR-10 not found at {cifar}; set PRETEXT_SHARED_DATA, or "
                  "use --photos (scikit-learn's sample photos, no shared data needed)")
            return None
        images, labels = cifar10_images(cifar, count)
    write_jpeg_folder(images, labels, root)
    done.write_text("")
    return root


# ------------------------------------------------------------------------ our host path
def our_source(root: Path, crop_size: int = CROP_SIZE, seed: int = 0) -> Any:
    """The training images of `root` as SimCLR's preparation hands them to the trainer
    (`objectives.common.two_view.prepare_two_view_images` with `examples.host_crop_size`; one image
    held out)."""
    from pretext_jax import objectives  # noqa: F401  (registers the methods)
    from pretext_jax.objectives import registry
    from pretext_jax.pretrain.config import make_config

    count = sum(1 for _ in root.rglob("*.jpg"))
    config = make_config("simclr_imagenet", [
        f"data.source={root}", f"data.held_out_fraction={0.5 / count}",
        f"examples.host_crop_size={crop_size}", f"objective.image_size={crop_size}",
        "examples.max_eval_examples=1"])
    method = registry.get(config.method)
    return method.prepare(config.data, config.examples, root / ".cache", seed).train


def our_views(source: Any) -> Callable[[int, np.random.Generator], dict[str, Any]]:
    """Record `index` of `source` through its per-record load transform(s), as the loader
    applies them (file read, decode, two crops): a function of (index, rng)."""
    transforms = source.load_transforms()

    def views(index: int, rng: np.random.Generator) -> dict[str, Any]:
        element = source[index]
        for transform in transforms:
            element = (transform.random_map(element, rng) if hasattr(transform, "random_map")
                       else transform.map(element))
        return element

    return views


def our_decode(source: Any) -> Callable[[int], np.ndarray]:
    """Decode alone (file read + Pillow decode to RGB), to split the time."""
    from pretext_jax.input_pipeline.images import decode_image

    return lambda index: decode_image(source[index]["image"], "bench")


def our_loader(source: Any, batch_size: int, workers: int, seed: int = 0) -> Iterator[Any]:
    """The training loader over `source` (`Trainer.data_iterator`'s call)."""
    from pretext_jax.input_pipeline.records import make_loader

    return iter(make_loader(source, batch_size=batch_size, seed=seed, worker_count=workers))


# ---------------------------------------------------------------------- the reference
def torchvision_available() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # absent, or a build that does not match the installed torch
        return False
    return True


def random_resized_crop_params(height: int, width: int, scale: tuple[float, float],
                               ratio: tuple[float, float], rng: np.random.Generator
                               ) -> tuple[int, int, int, int]:
    """torchvision 0.28 `RandomResizedCrop.get_params` (transforms.py), with numpy draws:
    (top, left, height, width)."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect_ratio = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class ReferenceViews:
    """torchvision's two-view ImageNet path for one file: `pil_loader`, then twice
    `RandomResizedCrop(size, scale, interpolation=BICUBIC)` + `PILToTensor` -> uint8
    [2, 3, size, size] (a torch tensor with torchvision, else numpy). Picklable, for
    DataLoader workers."""

    def __init__(self, paths: Sequence[Path], size: int = CROP_SIZE,
                 scale: tuple[float, float] = (0.08, 1.0), use_torchvision: bool | None = None):
        self.paths, self.size, self.scale = list(paths), size, scale
        self.use_torchvision = (torchvision_available() if use_torchvision is None
                                else use_torchvision)
        self._transform: Any = None
        self._rng: np.random.Generator | None = None  # per process: DataLoader workers fork

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Any:
        if self.use_torchvision:
            import torch
            from torchvision import transforms
            from torchvision.datasets.folder import pil_loader

            if self._transform is None:
                self._transform = transforms.Compose([
                    transforms.RandomResizedCrop(
                        self.size, scale=self.scale,
                        interpolation=transforms.InterpolationMode.BICUBIC),
                    transforms.PILToTensor()])
            image = pil_loader(str(self.paths[index]))
            return torch.stack([self._transform(image), self._transform(image)])
        if self._rng is None:
            self._rng = np.random.default_rng(os.getpid())
        with open(self.paths[index], "rb") as f:  # torchvision.datasets.folder.pil_loader
            image = Image.open(f).convert("RGB")
        views = []
        for _ in range(2):
            top, left, h, w = random_resized_crop_params(image.height, image.width, self.scale,
                                                         (3 / 4, 4 / 3), self._rng)
            view = image.crop((left, top, left + w, top + h)).resize(
                (self.size, self.size), Image.Resampling.BICUBIC)
            views.append(np.asarray(view).transpose(2, 0, 1))  # PILToTensor: CHW
        return np.stack(views)


def reference_loader(dataset: ReferenceViews, batch_size: int, workers: int) -> Iterator[Any]:
    """`torch.utils.data.DataLoader` over the reference views: shuffled, repeated without end,
    batches of `batch_size`, `workers` worker processes (spawned, kept for the whole run)."""
    import torch

    sampler = torch.utils.data.RandomSampler(dataset, num_samples=len(dataset) * 1000,
                                             generator=torch.Generator().manual_seed(0))
    return iter(torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=workers, drop_last=True,
        multiprocessing_context="spawn" if workers else None))


# ---------------------------------------------------------------------------- timing
def _tree_cpu_seconds() -> float | None:
    try:
        import psutil
    except ImportError:
        return None
    process = psutil.Process()
    total = 0.0
    for p in [process, *process.children(recursive=True)]:
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            continue
    return total


def time_per_item(function: Callable[[int], Any], count: int, warmup: int = 10
                  ) -> dict[str, float]:
    """`function(i)` for i in 0..count-1 in this process, after `warmup` calls: items per
    second and per CPU-second of this process."""
    for i in range(min(warmup, count)):
        function(i)
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(count):
        function(i)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    result = {"items": count, "seconds": round(seconds, 3), "per_s": count / seconds}
    if cpu_seconds > 0:
        result["per_cpu_s"] = count / cpu_seconds
    return result


def time_batches(batches: Iterator[Any], batch_size: int, count: int, warmup: int = 3
                 ) -> dict[str, Any]:
    """`count` batches drawn after `warmup` (worker start-up): items/s, and items per
    CPU-second of the process tree where psutil is present."""
    first = None
    for _ in range(warmup):
        first = next(batches)
    cpu = _tree_cpu_seconds()
    start = time.perf_counter()
    for _ in range(count):
        batch = next(batches)
    seconds = time.perf_counter() - start
    cpu_after = _tree_cpu_seconds()
    result: dict[str, Any] = {"items": count * batch_size, "seconds": round(seconds, 3),
                              "per_s": count * batch_size / seconds,
                              "shapes": _shapes(batch if count else first)}
    if cpu is not None and cpu_after is not None and cpu_after > cpu:
        result["per_cpu_s"] = count * batch_size / (cpu_after - cpu)
    return result


def close_loader(iterator: Any) -> None:
    """Stops a loader's worker processes before the next measurement (Grain: the wrapped
    dataset iterator's `close`; torch: `_shutdown_workers`)."""
    for target, method in ((iterator, "close"), (getattr(iterator, "_iterator", None), "close"),
                           (iterator, "_shutdown_workers")):
        if target is not None and callable(getattr(target, method, None)):
            getattr(target, method)()
            break
    gc.collect()


def measure_loader(iterator: Iterator[Any], batch_size: int, count: int) -> dict[str, Any]:
    """`time_batches`, then the loader's workers stopped."""
    try:
        return time_batches(iterator, batch_size, count)
    finally:
        close_loader(iterator)


def _shapes(batch: Any) -> Any:
    if isinstance(batch, dict):
        return {k: list(np.shape(v)) for k, v in batch.items()}
    return list(np.shape(batch))


# ------------------------------------------------------------------------------ text
TEXT_PRESETS = {
    "bert": ("bert_base", ["data.vocab_size=8000", "model.vocab_size=8000"]),
    "xlnet": ("xlnet_base", ["data.vocab_size=8000"]),
}


def prepare_text(method_name: str, corpus: Path, workdir: Path) -> tuple[Any, Any, int, bool]:
    """(records, per-record transforms, batch size, shuffle) of `method_name`'s preset
    prepared from `corpus` into `workdir` (cached there), as the trainer would read them."""
    from pretext_jax import objectives  # noqa: F401  (registers the methods)
    from pretext_jax.objectives import registry
    from pretext_jax.pretrain.config import make_config

    preset, overrides = TEXT_PRESETS[method_name]
    cache = workdir / f"text-{method_name}"
    config = make_config(preset, [f"data.source={corpus}", f"data.cache_dir={cache}",
                                  *overrides])
    method = registry.get(config.method)
    prepared = method.prepare(config.data, config.examples, cache, config.train.seed)
    batch = config.train.batch_size
    segment = prepared.segment(1, config)  # the records the trainer's first step reads
    return segment.records(None), prepared.transforms, batch, segment.shuffle


def text_loader(records: Any, transforms: Sequence[Any], batch_size: int, shuffle: bool,
                workers: int) -> Iterator[Any]:
    from pretext_jax.input_pipeline.records import make_loader

    return iter(make_loader(records, batch_size=batch_size, seed=0, shuffle=shuffle,
                            transforms=transforms, worker_count=workers))


# ------------------------------------------------------------------------------ main
def _row(rows: list[dict[str, Any]], what: str, workers: int | str, result: dict[str, Any],
         unit: str, per: int = 1) -> None:
    cores = max(int(workers), 1) if isinstance(workers, int) else 1
    row = {"what": what, "workers": workers, "unit": unit, "per_s": round(result["per_s"] / per,
                                                                            1),
           "per_core": round(result["per_s"] / per / cores, 1)}
    if "per_cpu_s" in result:
        row["per_cpu_s"] = round(result["per_cpu_s"] / per, 1)
    if "shapes" in result:
        row["shapes"] = result["shapes"]
    rows.append(row)
    print(f"{what:44s} {workers!s:>7} {row['per_s']:>10.1f} {row['per_core']:>10.1f} "
          f"{row.get('per_cpu_s', float('nan')):>10.1f}  {unit}", flush=True)


def markdown_cells(row: dict[str, Any], images: str) -> list:
    """A measurement's cells; `images` names the JPEGs (text rows: WikiText-2)."""
    return [row["what"], row["workers"], f"{row['per_s']:.1f}", f"{row['per_core']:.1f}",
            f"{row['per_cpu_s']:.1f}" if "per_cpu_s" in row else None, row["unit"],
            images if row["what"].startswith("images") else "WikiText-2 train.txt"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--workers", default="0,1,2")
    parser.add_argument("--batch", type=int, default=64, help="image batch size")
    parser.add_argument("--photos", action="store_true",
                        help="scikit-learn's sample photos instead of upsampled CIFAR-10")
    parser.add_argument("--text", default="bert,xlnet")
    parser.add_argument("--text-batches", type=int, default=40)
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--workdir", default="runs/bench_host_input")
    report.add_markdown_argument(parser, "host_input")
    args = parser.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",") if w.strip()]
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        torch = None

    rows: list[dict[str, Any]] = []
    print(f"{'what':44s} {'workers':>7} {'per s':>10} {'per core':>10} {'per cpu-s':>10}")
    root = jpeg_folder(workdir, args.images, args.photos) if args.images else None
    if root is not None:
        source = our_source(root)
        count = len(source)
        batches = max(10, 2 * count // args.batch)
        views = our_views(source)
        rng = np.random.default_rng(0)
        _row(rows, "images: ours, decode only", "bare", time_per_item(our_decode(source),
                                                                      count), "images")
        _row(rows, "images: ours, decode + 2 crops", "bare",
             time_per_item(lambda i: views(i, rng), count), "images")
        reference = ReferenceViews(sorted(root.rglob("*.jpg")))
        name = "torchvision" if reference.use_torchvision else "torchvision-equivalent PIL"
        if not args.skip_reference:
            _row(rows, f"images: {name}, decode + 2 crops", "bare",
                 time_per_item(reference.__getitem__, count), "images")
        for w in workers:
            _row(rows, "images: ours, Grain loader", w,
                 measure_loader(our_loader(source, args.batch, w), args.batch, batches),
                 "images")
            if torch is not None and not args.skip_reference:
                _row(rows, f"images: {name}, torch DataLoader", w,
                     measure_loader(reference_loader(reference, args.batch, w), args.batch,
                                    batches), "images")
    methods = [m for m in args.text.split(",") if m.strip()]
    if methods:
        corpus = shared_data_dir() / "wikitext-2" / "train.txt"
        if not corpus.is_file():
            print(f"text skipped: WikiText-2 not found at {corpus}; set PRETEXT_SHARED_DATA")
            methods = []
    for method_name in methods:
        records, transforms, batch_size, shuffle = prepare_text(method_name, corpus, workdir)
        for w in workers:
            result = measure_loader(text_loader(records, transforms, batch_size, shuffle, w),
                                    batch_size, args.text_batches)
            _row(rows, f"{method_name}: batches of {batch_size}", w, result, "batches",
                 per=batch_size)
    with_workers = [r.get("per_cpu_s", r["per_core"]) for r in rows
                    if r["what"] == "images: ours, Grain loader" and r["workers"]]
    print(json.dumps({
        "benchmark": "host_input", "images": args.images, "photos": args.photos,
        "image_batch": args.batch, "torchvision": torchvision_available(),
        "target_images_per_s_per_core": TARGET_PER_CORE,
        "ours_with_workers_per_cpu_s_min": min(with_workers, default=None),
        "meets_target": min(with_workers) >= TARGET_PER_CORE if with_workers else None,
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()], "rows": rows}))
    images = (f"{args.images} {'photo windows' if args.photos else 'upsampled CIFAR-10'} JPEGs "
              f"{JPEG_SIZE[0]}x{JPEG_SIZE[1]}, batch {args.batch}")
    for row in rows:
        report.write_row(TABLE, markdown_cells(row, images),
                         report.command_line("bench.host_input", argv), args.markdown,
                         devices=False)


if __name__ == "__main__":
    main()
