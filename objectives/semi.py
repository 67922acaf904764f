"""Semi-supervised fine-tuning of any image method's backbone (`semi`): the whole pre-trained
backbone under a new linear layer, trained on a class-balanced 1 % or 10 % of the training
labels, top-1 on the test set beside the majority class (Chen et al. 2020 "A Simple Framework
for Contrastive Learning of Visual Representations" §4.2 and Appendix B.5; google-research/simclr
`run.py` with `--train_mode=finetune`, `data_util.py` `preprocess_for_train`).

- The labelled subset: `round(label_fraction x n_c)` (at least 1) images of every class c,
  drawn with `examples.subset_seed` (`balanced_subset`); its indices are listed in the run's
  `label_subset.json` (`pretrain.finetune`). The paper uses ImageNet's fixed 1 %/10 % lists;
  on other data the seed fixes ours.
- Augmentation during fine-tuning is the reference's: a random resized crop (8-100 % of the
  area) and a horizontal flip, no colour change; evaluation sees the whole image.
- The recipe (B.5): Nesterov momentum 0.9, no weight decay, no warmup, cosine decay, 60 epochs
  for 1 % of the labels and 30 for 10 % (`EPOCHS`), the learning rate 0.05 x batch / 256.
  The head starts at zero (`--zero_init_logits_layer`). `model.projection_layers=1` keeps the
  first layer of SimCLR's projection head on the backbone, as SimCLR v2 fine-tunes (Chen et
  al. 2020c §2, tf2 `--ft_proj_selector=1`); 0 (the default) is v1's backbone alone.
- Any image method's backbone (`downstream_model()`: SimCLR, MoCo, BYOL, RotNet, Jigsaw,
  DeepCluster, CMC, DIM, AMDIM) starts it; with `--architecture` and no `--init` the same
  network at its random initialisation does (the baseline to beat).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.images import HostCrop, prepare_images
from pretext_jax.input_pipeline.indexed import SelectedRecords
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.models.image_classifier import ImageClassifier
from pretext_jax.objectives import registry
from pretext_jax.objectives.common.two_view import (
    ImageExampleConfig,
    ViewSettings,
    cropped_and_flipped,
    evaluation_view,
)
from pretext_jax.objectives.registry import (
    Batch,
    DownstreamTask,
    Evaluation,
    FinetuneRecipe,
    Method,
    Metrics,
    PreparedData,
    Start,
    register,
    register_task,
)
from pretext_jax.progress import progress

SEMI = "semi"
MODEL_FILE = "model.json"  # what a pretext workdir or model directory records of its network
# Fine-tuning epochs by label fraction (B.5: 60 for 1 %, 30 for 10 %).
EPOCHS = {0.01: 60, 0.1: 30}
BATCH_SIZE = 256
LABELS_PER_CHUNK = 1024


@dataclasses.dataclass(frozen=True)
class SemiModelConfig:
    """Where the backbone comes from, and the classes the data decides."""

    init: str = ""
    """The pre-trained image workdir or model directory; '' = random init of `architecture`."""
    architecture: str = ""
    """The pretext image workdir or model directory whose backbone the network is (run.py
    finetune sets it to --init, or to --architecture for a random start)."""
    num_classes: int = 0
    """Classes of the training labels (set from the data)."""
    projection_layers: int = 0
    """Projection-head layers kept on the backbone: 0 as SimCLR v1, 1 as SimCLR v2 (SimCLR's
    network only)."""

    def __post_init__(self) -> None:
        if self.projection_layers < 0:
            raise ValueError(f"projection_layers={self.projection_layers} must be >= 0 (0: the "
                             "backbone alone, 1: SimCLR v2's start)")


@dataclasses.dataclass(frozen=True)
class SemiExampleConfig:
    """The task, the labelled fraction and the seed that draws it, and the test images kept."""

    task: str = SEMI
    """Downstream task: semi (image classification from a fraction of the labels)."""
    label_fraction: float = 0.1
    """Fraction of every class's training labels used (SimCLR: 0.01 or 0.1)."""
    subset_seed: int = 0
    """Seed of the class-balanced draw of the labelled images."""
    max_eval_examples: int = 10000
    """Most test images kept for evaluation."""

    def __post_init__(self) -> None:
        if not 0.0 < self.label_fraction <= 1.0:
            raise ValueError(f"label_fraction={self.label_fraction} must be in (0, 1], e.g. "
                             "0.01 or 0.1")


# ---------------------------------------------------------------------------- labels
def balanced_subset(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Sorted indices of round(fraction x n_c) (at least 1) images of every class c of
    `labels`, drawn with `seed`."""
    rng = np.random.default_rng(seed)
    chosen = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        count = max(1, int(round(fraction * len(members))))
        chosen.append(rng.permutation(members)[:count])
    return np.sort(np.concatenate(chosen))


def training_labels(train: Any) -> np.ndarray:
    """Every training record's label, in record order."""
    starts = range(0, len(train), LABELS_PER_CHUNK)
    return np.concatenate([
        train.examples(range(start, min(start + LABELS_PER_CHUNK, len(train))))["label"]
        for start in progress(starts, "labels", total=len(starts), unit="chunk")])


def prepare_semi(data: DataConfig, examples: SemiExampleConfig, cache_dir: Path,
                 seed: int) -> PreparedData:
    """The labelled subset of the training images (whole images, augmented on device), the test
    images in memory, the class count, and the majority class of the subset scored on the
    test images; the subset is reported (`label_subset`) for the run's files."""
    train, test = prepare_images(
        data.source, data.eval_source, cache_dir, examples.max_eval_examples, crop=HostCrop(),
        held_out_fraction=data.held_out_fraction, seed=seed, tfds_split=data.tfds_split,
        tfds_data_dir=data.tfds_data_dir or None)
    labels = training_labels(train)
    if (labels < 0).any() or (test["label"] < 0).any():
        raise UserError(f"data.source={data.source} has unlabelled images; semi-supervised "
                        "fine-tuning needs labels (a CIFAR-10 folder, a folder of class folders "
                        "or a labelled TFDS set)")
    chosen = balanced_subset(labels, examples.label_fraction, examples.subset_seed)
    classes = int(max(labels.max(), test["label"].max())) + 1
    majority = int(np.bincount(labels[chosen], minlength=classes).argmax())
    per_class = np.bincount(labels[chosen], minlength=classes)
    return PreparedData(
        train=SelectedRecords(train, chosen), eval=test, model_fields={"num_classes": classes},
        report={"majority_baseline": {"top1": float(np.mean(test["label"] == majority))},
                "label_subset": {"label_fraction": examples.label_fraction,
                                 "subset_seed": examples.subset_seed,
                                 "training_images": len(labels),
                                 "per_class": per_class.tolist(),
                                 "indices": chosen.tolist()}})


# ---------------------------------------------------------------------------- the network
def source_network(path: str, seed: int, projection_layers: int = 0) -> nnx.Module:
    """The backbone (`downstream_model()`, with `projection_layers` of the projection head
    where that is > 0) of the image method's network that the workdir or model directory
    `path` records (its `model.json`), at random initialisation `seed`."""
    if not path:
        raise UserError("model.architecture is empty: start semi-supervised fine-tuning with "
                        "run.py finetune --task semi --init RUN (or --architecture RUN)")
    model_file = Path(path) / MODEL_FILE
    if not model_file.is_file():
        raise UserError(f"{path} is not a pretext workdir or model directory ({MODEL_FILE} "
                        "missing); semi-supervised fine-tuning starts from an image method's run")
    info = json.loads(model_file.read_text())
    method = registry.get(info.get("method", ""))
    if not issubclass(method.example_config, ImageExampleConfig):
        raise UserError(f"{path} holds a {method.name} model, not an image one; task {SEMI} "
                        "fine-tunes an image method's backbone (SimCLR, MoCo, BYOL, RotNet, "
                        "Jigsaw, DeepCluster, CMC, DIM, AMDIM)")
    config = method.model_config(**method.split_model_section(info["model"])[0])
    network = method.build_model(config, seed)
    if not projection_layers:
        return network.downstream_model()
    if "projection_layers" not in inspect.signature(network.downstream_model).parameters:
        raise UserError(f"model.projection_layers={projection_layers}: {method.name}'s network "
                        "keeps no projection layers for fine-tuning (SimCLR's does); use "
                        "model.projection_layers=0")
    try:
        return network.downstream_model(projection_layers=projection_layers)
    except ValueError as error:
        raise UserError(f"model.{error}; use fewer") from None


def build_semi(config: SemiModelConfig, seed: int) -> ImageClassifier:
    """The backbone of `config.architecture` at random init under a zero linear layer."""
    with nnx.use_eager_sharding(False):
        return ImageClassifier(source_network(config.architecture, seed,
                                              config.projection_layers), _image_size(config),
                               config.num_classes, rngs=nnx.Rngs(seed))


def _image_size(config: SemiModelConfig) -> int:
    """The side the backbone was pre-trained at (the source run's `objective.image_size`;
    32 where it recorded none)."""
    saved = Path(config.architecture) / "config.json"
    if saved.is_file():
        return int(json.loads(saved.read_text()).get("objective", {}).get("image_size", 32))
    return 32


def pretrained_semi(config: SemiModelConfig, seed: int, load: Callable[[str], nnx.Module]
                    ) -> ImageClassifier | None:
    """The pre-trained backbone of `config.init` under a zero linear layer (None: random)."""
    if not config.init:
        return None
    model = build_semi(config, seed)
    model.backbone = (load(config.init, projection_layers=config.projection_layers)
                      if config.projection_layers else load(config.init))
    return model


# ---------------------------------------------------------------------------- loss and metric
def semi_loss(model: ImageClassifier, batch: Batch, rng: jax.Array | None, *,
              objective: ViewSettings) -> tuple[jax.Array, Metrics]:
    """Mean cross-entropy of the labels, on a random crop + flip of every image (`rng`
    None: the whole image, evaluation)."""
    if rng is None:
        images = evaluation_view(batch["image"], objective.image_size)
    else:
        images = cropped_and_flipped(rng, batch["image"], objective)
    logits = model(images, train=rng is not None)
    labels = batch["label"].astype(jnp.int32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    correct = jnp.sum(jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    return loss, {"loss": (loss, jnp.ones((), jnp.float32)),
                  "accuracy": (correct, jnp.asarray(labels.shape[0], jnp.float32))}


@functools.partial(nnx.jit, static_argnames="size")
def _predict(model: ImageClassifier, images: jax.Array, size: int) -> jax.Array:
    return jnp.argmax(model(evaluation_view(images, size), train=False), -1)


def top1(model: ImageClassifier, images: np.ndarray, labels: np.ndarray, size: int,
         batch_size: int = 256) -> float:
    """Top-1 accuracy of `model` on whole uint8 `images` (evaluation mode)."""
    starts = range(0, len(images), batch_size)
    predicted = np.concatenate([np.asarray(_predict(model, images[i:i + batch_size], size))
                                for i in progress(starts, "test images", total=len(starts),
                                                  unit="batch")])
    return float(np.mean(predicted == labels))


def semi_monitor(model: ImageClassifier, data: PreparedData, examples: SemiExampleConfig,
                 objective: ViewSettings) -> dict[str, float]:
    """Top-1 on every kept test image."""
    return {"top1": top1(model, data.eval["image"], data.eval["label"], objective.image_size)}


# ---------------------------------------------------------------------------- the recipe
def epochs_for(label_fraction: float) -> float:
    """B.5's epochs for the nearest of its label fractions (60 for 1 %, 30 for 10 %)."""
    return EPOCHS[min(EPOCHS, key=lambda known: abs(math.log(known / label_fraction)))]


def semi_recipe(model: Any, task: DownstreamTask, source_config: Mapping[str, Any]
                ) -> FinetuneRecipe | None:
    """SimCLR's fine-tuning recipe (B.5) for an image method's backbone on task `semi`; a
    starting point that is no image method's is refused."""
    if task.method != SEMI:
        return None
    source = source_config.get("source", "")
    method = source_config.get("method", "")
    if not method or not issubclass(registry.get(method).example_config, ImageExampleConfig):
        raise UserError(f"{source} holds a {type(model).__name__}"
                        f"{f' ({method})' if method else ''}, not an image backbone; task "
                        f"{SEMI} fine-tunes an image method's run (SimCLR, MoCo, BYOL, RotNet, "
                        "Jigsaw, DeepCluster, CMC, DIM, AMDIM)")
    image_size = source_config.get("objective", {}).get("image_size", 32)
    recipe = {f"{section}.{key}": value for section, settings in PRESETS[RECIPE_PRESET].items()
              for key, value in settings.items() if f"{section}.{key}" != "train.steps"}
    values = {**recipe, "method": SEMI, "model.architecture": source,
              "objective.image_size": image_size}
    return FinetuneRecipe(values=values, epochs=EPOCHS[0.1], warmup=0.0,
                          epochs_of=lambda config: epochs_for(config.examples.label_fraction))


def semi_train_rows(data: str, config: Any) -> int:
    """Labelled training images an epoch holds: the balanced subset of the data's labels,
    prepared in `data.cache_dir`, or where that is unset (the run's cache is its workdir's,
    unknown here) in a temporary folder."""
    with tempfile.TemporaryDirectory() as scratch:
        prepared = prepare_semi(config.data, config.examples,
                                Path(config.data.cache_dir or scratch), config.train.seed)
        return len(prepared.train)


def _recipe(fraction: float) -> dict[str, dict[str, Any]]:
    """B.5's recipe on CIFAR-10's 50,000 training images at `fraction` of the labels."""
    per_epoch = math.ceil(round(50000 * fraction) / BATCH_SIZE)
    return {
        "examples": {"label_fraction": fraction},
        "objective": {"image_size": 32, "crop_area_min": 0.08},
        "optim": {"optimizer": "sgd", "nesterov": True, "momentum": 0.9,
                  "learning_rate": 0.05 * BATCH_SIZE / 256, "weight_decay": 0.0,
                  "schedule": "cosine", "warmup_steps": 0, "clip_norm": 0.0},
        "train": {"batch_size": BATCH_SIZE, "steps": per_epoch * EPOCHS[fraction]},
    }


PRESETS = {"semi_cifar10_1pct": _recipe(0.01), "semi_cifar10_10pct": _recipe(0.1)}
RECIPE_PRESET = "semi_cifar10_10pct"

register_task(DownstreamTask(  # `run.py finetune --task semi`
    name=SEMI, method=SEMI, num_labels=0, train_rows=semi_train_rows, metrics=("top1",),
    main_metric="top1", aliases=("semisupervised",)))

register(Method(
    name=SEMI,
    model_config=SemiModelConfig,
    example_config=SemiExampleConfig,
    objective_config=ViewSettings,
    build_model=build_semi,
    loss=semi_loss,
    prepare=prepare_semi,
    units_per_example=lambda examples: 1,
    unit="images",
    description="Fine-tuning: an image backbone on a fraction of the labels (SimCLR B.5)",
    presets=PRESETS,
    evaluation=Evaluation(monitor=semi_monitor),
    start=Start(pretrained=pretrained_semi, finetunes=semi_recipe),
))
