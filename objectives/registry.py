"""The registry of pre-training methods: what the trainer asks for by name.

A method binds a model builder, a pure loss `(model, batch, rng) -> (loss, metrics)` (with the
method's objective settings bound, `Method.bind_loss`), host-side data preparation, its config
types and its presets. The trainer never names a method; adding one
is a file in `objectives/` that calls `register` (see docs/add_your_own_objective.md).

Metrics are `{name: (numerator, denominator)}` pairs of scalars, so that averages over devices,
steps and evaluation batches are exact ratios of sums rather than means of means.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from pretext_jax.errors import UserError

Batch = dict[str, jax.Array]
Metrics = dict[str, tuple[jax.Array, jax.Array]]
LossFn = Callable[[Any, Batch, jax.Array | None], tuple[jax.Array, Metrics]]
# (held-out metrics, PreparedData.report, the monitor's metrics of the untrained network) -> lines
Summarize = Callable[[dict[str, float], dict[str, Any], Callable[[], dict[str, float]]],
                     list[str]]


def summary_of(*, accuracy: str = "", metrics: Sequence[str] = ("loss",)) -> Summarize:
    """A `Method.summarize` that prints the held-out `{accuracy}_accuracy` beside the data's
    `majority_baseline_{accuracy}_accuracy` (e.g. accuracy="mlm"), then each of `metrics`
    that the evaluation has."""

    def summarize(evaluation: dict[str, float], report: dict[str, Any],
                  untrained: Callable[[], dict[str, float]]) -> list[str]:
        del untrained
        lines = []
        if f"{accuracy}_accuracy" in evaluation:
            value = evaluation[f"{accuracy}_accuracy"]
            line = f"  held-out {accuracy.upper()} accuracy {value:.3f}"
            baseline = report.get(f"majority_baseline_{accuracy}_accuracy")
            if baseline is not None:
                line += f" vs majority-token baseline {baseline:.3f}"
            lines.append(line)
        return lines + [f"  held-out {key}: {evaluation[key]:.3f}" for key in metrics
                        if key in evaluation]

    return summarize


@dataclasses.dataclass(frozen=True)
class PreparedData:
    """What a method's preparation hands the trainer: record directories for training and
    held-out evaluation, per-record Grain transforms applied while loading (e.g. dynamic
    masking), the model-config fields the data decides (e.g. `vocab_size`), and facts to report
    (e.g. the majority-token baseline). `batch_layout` > 0 means the training records are
    consecutive global batches of that many rows, to be read in order without shuffling (XLNet:
    row b of a batch continues row b of the previous one, which the recurrence memory needs);
    `train.batch_size` must then equal it. `tokenizer`: the text methods' tokenizer
    (`input_pipeline.tokenizers`), which the trainer records in the workdir; None for images.
    `monitor_data`: what the method's `monitor` reads beyond `train` and `eval` (the speech
    methods: both splits' records for the linear probes); None if nothing. `step_source`: for
    a method whose every step reads one kind of record (XLM: one language or language pair per
    step), given the global batch size, the training source the trainer reads in order instead
    of shuffling `train`: it draws each step's records itself, so its position is the
    loader's. `model_variables`: values of the model's non-parameter variables that the data
    decides, by top-level attribute name (word2vec: the vocabulary's `word_counts`), which the
    trainer puts into a fresh run's initial state (a resumed run restores them)."""

    train: Any
    eval: Any
    transforms: Sequence[Any] = ()
    model_fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    report: dict[str, Any] = dataclasses.field(default_factory=dict)
    batch_layout: int = 0
    tokenizer: Any = None
    monitor_data: Any = None
    step_source: Callable[[int], Any] | None = None
    model_variables: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Rounds:
    """Training in rounds whose data depend on the network (DeepCluster: every round clusters the
    training set's features and trains on the pseudo-labels). Before step r x `every(objective)`
    + 1 the trainer calls `begin(model, data, examples, objective, seed, r)`, which updates the
    model in place (pseudo-labels, a re-initialised head) and returns the names of the
    top-level submodules whose optimizer state restarts at zero (the reference's new top-layer
    optimizer); then, and when resuming inside round r, it reads the round's training records in
    order from `source(model, data, objective, seed, r, global_batch_size)` (a random-access
    source as `PreparedData.train`, holding `every x global_batch_size` records), which must
    depend only on what the checkpoint holds (the model's state, the seed and r), so that a
    resume is exact."""

    every: Callable[[Any], int]
    begin: Callable[[Any, PreparedData, Any, Any, int, int], tuple[str, ...]]
    source: Callable[[Any, PreparedData, Any, int, int, int], Any]


@dataclasses.dataclass(frozen=True)
class FinetuneRecipe:
    """A downstream method's run on one GLUE task (`Method.finetunes`): its config values
    (`section.key`, `method` included) and the length of its schedule, which
    `pretrain.finetune` turns into steps: `epochs` over the task's training rows and `warmup`,
    a fraction of those steps."""

    values: dict[str, Any]
    epochs: float
    warmup: float


@dataclasses.dataclass(frozen=True)
class NoObjectiveSettings:
    """The `objective` section of a method whose loss takes no settings."""


@dataclasses.dataclass(frozen=True)
class Method:
    """One pre-training method.

    - `model_config` / `example_config`: dataclass types that `config.model` / `config.examples`
      are validated against.
    - `objective_config`: the dataclass type of `config.objective`, the loss's settings (what
      only the loss reads: loss weights, temperatures, momentum schedules, the image methods'
      view augmentations; fields that shape the network or its parameters belong to
      `model_config`).
    - `build_model(model_config, seed)`: a fresh Flax NNX module.
    - `loss(model, batch, rng)`: pure; `rng=None` means evaluation (no dropout, no sampling).
      A method with an `objective_config` gets its settings as the keyword `objective`
      (`bind_loss`).
    - `prepare(data_config, example_config, cache_dir, seed)`: builds the records on the host.
    - `units_per_example(example_config)`: tokens (or images) per example, for throughput.
    - `check(model_config, example_config, objective)`: cross-field validation, raising
      UserError; `objective` is the `objective_config` (SimCLR: host crops of the views' size).
    - `monitor(model, prepared_data, example_config, objective)`: optional held-out metrics
      beyond the loss's, computed at every evaluation (SimCLR: the kNN accuracy of the features
      at the views' size, `objective.image_size`).
    - `run_settings(objective, config)`: optional; the objective settings with the fields that
      depend on the run's settings filled in (BYOL: the target schedule spans
      train.steps x optim.grad_accum_steps loss calls), applied by the trainer.
    - `complete_data(prepared_data, model_config, objective)`: optional; the prepared data
      with what depends on the network and the loss's settings added, applied by the trainer
      once both are resolved (wav2vec 2.0: span masks and distractors are drawn per record on
      the host over the feature encoder's frames, with the objective's masking settings).
    - `pretrained(model_config, seed, load)`: optional; the model a fresh run starts from
      instead of `build_model`'s random one (fine-tuning: the pre-trained encoder plus a new
      head). `load(path)` is the trainer's reader of a pretext workdir, model directory or
      HuggingFace folder (`pretrain.export.load_pretrained`), passed in so that objectives
      never import the trainer's layer. Its parameters are placed on the mesh after the
      sharded init, so they never become constants of a compiled function.
    - `finetunes(pretrained_model, task, source_config)`: optional, for a downstream method
      that `run.py finetune` / `glue` choose by what the starting point holds: the
      `FinetuneRecipe` of a run of this method from `pretrained_model` (as `load` reads it) on
      the GLUE `task` (`input_pipeline.glue.GlueTask`), given the saved run config of the
      starting point (`source_config`; {} when it has none), or None when this method does not
      start from such a model (ELMo's scalar mix: a biLM). Models that no method claims go to
      the transformer classifier (`classify`).
    - `summarize(evaluation, report, untrained)`: the lines the CLI prints about the final
      held-out metrics (`evaluation`), beside the data's baselines (`report`); `untrained()`
      computes the `monitor` metrics of the same network at its random initialisation.
      Default: the held-out loss (`summary_of`).
    - `rounds`: optional; training in rounds whose data the network decides (`Rounds`:
      DeepCluster's re-clustering).
    - `presets`: named starting configs, `{name: {section: {key: value}}}` without `method`
      (`make_config(name)`); a preset name is unique over all methods.
    """

    name: str
    model_config: type
    example_config: type
    build_model: Callable[[Any, int], Any]
    loss: LossFn
    prepare: Callable[[Any, Any, Any, int], PreparedData]
    units_per_example: Callable[[Any], int]
    check: Callable[[Any, Any, Any], None] = (
        lambda model_config, example_config, objective: None)
    monitor: Callable[[Any, PreparedData, Any, Any], dict[str, float]] | None = None
    run_settings: Callable[[Any, Any], Any] | None = None
    complete_data: Callable[[PreparedData, Any, Any], PreparedData] | None = None
    pretrained: Callable[[Any, int, Callable[[str], Any]], Any] | None = None
    finetunes: Callable[[Any, Any, Mapping[str, Any]], FinetuneRecipe | None] | None = None
    summarize: Summarize = dataclasses.field(default_factory=summary_of)
    rounds: Rounds | None = None
    unit: str = "tokens"
    description: str = ""
    presets: Mapping[str, Mapping[str, Mapping[str, Any]]] = dataclasses.field(
        default_factory=dict)
    objective_config: type = NoObjectiveSettings

    def bind_loss(self, objective: Any) -> LossFn:
        """The loss as the trainer calls it, `(model, batch, rng)`: `loss` with `objective` (an
        `objective_config`) bound as its keyword `objective`, or `loss` itself for a method
        without objective settings."""
        if self.objective_config is NoObjectiveSettings:
            return self.loss
        return functools.partial(self.loss, objective=objective)

    def split_model_section(self, model: Mapping[str, Any]
                            ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(model, objective) from a `model` section as configs written before the `objective`
        section existed hold it: objective settings (fields of `objective_config` that are no
        fields of `model_config`: loss weights, temperatures, the image methods' view
        augmentations) move to `objective`; everything else stays."""
        moved = ({f.name for f in dataclasses.fields(self.objective_config)}
                 - {f.name for f in dataclasses.fields(self.model_config)})
        return ({k: v for k, v in model.items() if k not in moved},
                {k: v for k, v in model.items() if k in moved})


_METHODS: dict[str, Method] = {}
_PRESET_METHODS: dict[str, str] = {}  # preset name -> the method that declares it


def register(method: Method) -> Method:
    """Adds a method and its presets; a second method of the same name, or a preset name another
    method already declares, is an error."""
    if method.name in _METHODS:
        raise ValueError(f"method {method.name!r} is already registered")
    taken = sorted(set(method.presets) & set(_PRESET_METHODS))
    if taken:
        raise ValueError(f"presets {taken} of method {method.name!r} are already declared by "
                         f"{sorted({_PRESET_METHODS[name] for name in taken})}")
    _METHODS[method.name] = method
    _PRESET_METHODS.update(dict.fromkeys(method.presets, method.name))
    return method


def get(name: str) -> Method:
    if name not in _METHODS:
        raise UserError(f"unknown method {name!r}; choose one of {sorted(_METHODS)} or register "
                        "yours with pretext_jax.objectives.registry.register")
    return _METHODS[name]


def names() -> list[str]:
    return sorted(_METHODS)


def downstream_recipe(pretrained_model: Any, task: Any, source_config: Mapping[str, Any]
                      ) -> FinetuneRecipe | None:
    """The recipe of the downstream method that starts from `pretrained_model` on `task`
    (`Method.finetunes`); None when no method claims it."""
    for method in _METHODS.values():
        if method.finetunes is not None:
            recipe = method.finetunes(pretrained_model, task, source_config)
            if recipe is not None:
                return recipe
    return None


def preset_names() -> list[str]:
    return sorted(_PRESET_METHODS)


def preset(name: str) -> dict[str, Any]:
    """The preset `name` as a config tree, `{"method": ..., section: {key: value}}` (a copy)."""
    if name not in _PRESET_METHODS:
        raise UserError(f"unknown preset {name!r}; choose one of {preset_names()}")
    method = _METHODS[_PRESET_METHODS[name]]
    return {"method": method.name,
            **{section: dict(values) for section, values in method.presets[name].items()}}


_default_method: str | None = None  # the method a config that names none gets


def declare_default(method: Method) -> Method:
    """Makes the registered `method` the one a config that names no method gets (configs and
    presets written before `method` was saved); declaring a second, other one is an error."""
    global _default_method
    if _METHODS.get(method.name) is not method:
        raise ValueError(f"register method {method.name!r} before declaring it the default")
    if _default_method not in (None, method.name):
        raise ValueError(f"method {_default_method!r} is already the default; "
                         f"{method.name!r} cannot be too")
    _default_method = method.name
    return method


def default_method() -> str:
    """The name of the method a config that names none gets (`declare_default`)."""
    if _default_method is None:
        raise UserError("no default method is declared yet, so a config must name its method; "
                        "import pretext_jax.objectives first (it registers the built-in methods, "
                        "BERT the default)")
    return _default_method
