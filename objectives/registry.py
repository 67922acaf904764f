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
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from pretext_jax.errors import UserError

Batch = dict[str, jax.Array]
Metrics = dict[str, tuple[jax.Array, jax.Array]]
LossFn = Callable[[Any, Batch, jax.Array | None], tuple[jax.Array, Metrics]]
# The trainer's reader of a pretext workdir, model directory or HF folder (`Start.pretrained`).
Loader = Callable[..., Any]
# (held-out metrics, PreparedData.report, the monitor's metrics of the untrained network) -> lines
Summarize = Callable[[dict[str, float], dict[str, Any], Callable[[], dict[str, float]]],
                     list[str]]


def summary_of(*, accuracy: str = "", metrics: Sequence[str] = ("loss",)) -> Summarize:
    """An `Evaluation.summarize` that prints the held-out `{accuracy}_accuracy` beside the data's
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
class Segment:
    """Consecutive training steps that read one source: steps `first_step`..`last_step`
    (1-based, inclusive; None: to the end of the run) take their batches from `records(model)`,
    a random-access source (as `PreparedData.train`), shuffled by seed or in the source's own
    order. `records` gets the model as the segment's first step finds it, so that a source may
    depend on the network (DeepCluster: pseudo-labels); it must depend only on what a checkpoint
    holds, so that a resume is exact. `begin(model)`, if set, runs before the segment's first
    step (not when a run resumes inside the segment): it changes the model in place and returns
    the names of the top-level submodules whose optimizer state restarts at zero.
    `whole_batches`: each key of the source is a whole batch, this process's rows of it with the
    per-record transforms applied, read in order (`token_batches.TokenBudgetBatches`: batches
    whose row count varies from step to step)."""

    first_step: int
    last_step: int | None
    records: Callable[[Any], Any]
    shuffle: bool = True
    begin: Callable[[Any], tuple[str, ...]] | None = None
    whole_batches: bool = False


# (step, run config) -> the segment that holds `step`. The config is the trainer's resolved run
# config; a segment function may refuse it (UserError), e.g. a batch size its layout cannot take.
Segments = Callable[[int, Any], Segment]


def whole_run(source: Any, *, shuffle: bool = True,
              check: Callable[[Any], None] | None = None) -> Segments:
    """`PreparedData.segments` for a run that reads one source throughout (`shuffle=False`: in
    the source's order, e.g. XLNet's consecutive batches, XLM's per-step schedule); `check(config)`
    refuses run configs the source cannot serve."""

    def segment(step: int, config: Any) -> Segment:
        del step
        if check is not None:
            check(config)
        return Segment(first_step=1, last_step=None, records=lambda model: source,
                       shuffle=shuffle)

    return segment


def per_step_source(source_for_batch: Callable[[int], Any]) -> Segments:
    """`PreparedData.segments` for a source that draws every step's records itself, given the
    global batch size (XLM: one language or language pair per step), read in order, so that its
    position is the loader's."""

    def segment(step: int, config: Any) -> Segment:
        del step
        source = source_for_batch(config.train.batch_size)
        return Segment(first_step=1, last_step=None, records=lambda model: source,
                       shuffle=False)

    return segment


def row_multiple(config: Any) -> int:
    """What every batch's row count must be a multiple of under the run config `config`: its
    data x fsdp shards for each of the `optim.grad_accum_steps` micro-batches (the trainer
    hands segments its mesh's sizes; a -1 left in `config.mesh` takes what all devices leave)."""
    mesh = config.mesh
    sizes = (mesh.data, mesh.fsdp, mesh.tensor)
    rest = jax.device_count() // max(1, -math.prod(sizes)) if -1 in sizes else 0
    data, fsdp = (rest if size == -1 else size for size in sizes[:2])
    return data * fsdp * config.optim.grad_accum_steps


def budget_batches(source_for_run: Callable[[int, Any], Any]) -> Segments:
    """`PreparedData.segments` for one source of whole batches read in order,
    `source_for_run(multiple, config)` built for the run config's row multiple (`row_multiple`;
    once per multiple): batches within a token budget."""
    sources: dict[int, Any] = {}

    def segment(step: int, config: Any) -> Segment:
        del step
        multiple = row_multiple(config)
        if multiple not in sources:
            sources[multiple] = source_for_run(multiple, config)
        source = sources[multiple]
        return Segment(first_step=1, last_step=None, records=lambda model: source,
                       shuffle=False, whole_batches=True)

    return segment


@dataclasses.dataclass(frozen=True)
class PreparedData:
    """What a method's preparation hands the trainer: record sources for training and held-out
    evaluation, per-record Grain transforms applied while loading (e.g. dynamic masking), the
    model-config fields the data decides (e.g. `vocab_size`), and facts to report (e.g. the
    majority-token baseline). `segments`: which source feeds each training step (`Segments`);
    None: `train`, shuffled, for the whole run. `tokenizer`: the text methods' tokenizer
    (`input_pipeline.tokenizers`), which the trainer records in the workdir; None for images.
    `monitor_data`: what the method's monitor reads beyond `train` and `eval` (the speech
    methods: both splits' records for the linear probes); None if nothing. `model_variables`:
    values of the model's non-parameter variables that the data decides, by top-level attribute
    name (word2vec: the vocabulary's `word_counts`), which the trainer puts into a fresh run's
    initial state (a resumed run restores them)."""

    train: Any
    eval: Any
    transforms: Sequence[Any] = ()
    model_fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    report: dict[str, Any] = dataclasses.field(default_factory=dict)
    segments: Segments | None = None
    tokenizer: Any = None
    monitor_data: Any = None
    model_variables: dict[str, Any] = dataclasses.field(default_factory=dict)

    def segment(self, step: int, config: Any) -> Segment:
        """The segment that holds `step` (1-based) under the run config `config`."""
        return (self.segments or whole_run(self.train))(step, config)


@dataclasses.dataclass(frozen=True)
class FinetuneRecipe:
    """A downstream run on one task (`Start.finetunes`): its config values (`section.key`,
    `method` included) and the length of its schedule, which `pretrain.finetune` turns into
    steps: `epochs` over the task's training rows and `warmup`, a fraction of those steps.
    `tokenizer_from_init`: the run reads text with the tokenizer the starting point was trained
    with (found by `pretrain.finetune`, unless the user names one). A recipe that counts updates
    gives `steps` and `warmup_steps` instead."""

    values: dict[str, Any]
    epochs: float
    warmup: float
    tokenizer_from_init: bool = False
    steps: int = 0
    """A recipe that counts updates, not epochs (BART's `--total-num-update`): that many steps
    unless `run.py finetune --epochs` is given; 0: `epochs`."""
    warmup_steps: int = 0
    """Warmup updates (fairseq's `--warmup-updates`) where `warmup` is 0."""
    epochs_of: Callable[[Any], float] | None = None
    """The epochs for the run's config with the user's settings applied, where they depend on
    them (semi-supervised fine-tuning: 60 for 1 % of the labels, 30 for 10 %); None: `epochs`."""
    recipes: tuple[str, ...] = ()
    """Presets of the run's method that `run.py finetune --recipe NAME` may choose instead of
    this recipe (wav2vec 2.0's per labelled-data size): each is layered over `values` and its
    `train.steps` and `optim.warmup_steps` count the updates. Empty: no choice."""


@dataclasses.dataclass(frozen=True)
class DownstreamTask:
    """A task `run.py finetune --task NAME` runs (GLUE's five, and any task a downstream method
    registers with `register_task`): what fine-tuning needs to know of it beyond its method.

    - `name`: the canonical name (`examples.task` of the run); `aliases`: other spellings
      `--task` accepts (matched ignoring case, `-` and `_`).
    - `method`: the downstream method that fine-tunes a transformer encoder on it (`classify`
      for GLUE); a family's `Start.finetunes` puts it in its recipe, or gives its own method
      (ELMo's scalar mix) or None for tasks it does not fine-tune.
    - `num_labels`: the head's output units (1 for a regression).
    - `max_seq_length`: the input length the encoder families use for it (0: their default).
    - `train_rows(data, config)`: how many training rows an epoch holds for the run `config`
      on the data `data` (`--data`), from which fine-tuning counts its steps.
    - `metrics`: the dev metrics reported, `main_metric` the one that ranks runs and learning
      rates; `baseline`: the `PreparedData.report` entry with the trivial predictor's dev
      metrics (majority class, no answer, all-O, the empty transcript), `baseline_name` what
      that predictor is; `lower_is_better`: the main metric is an error rate (CTC's WER), so a
      run is at the baseline when it is no lower.
    - `spec`: the task's own description (`input_pipeline.glue.GlueTask`, ...), for its method.
    - `train_text(data, config)`: the training rows the run `config` reads, without their
      labels, each a list of sentences: the corpus of within-task continued pre-training
      (`pretrain.transfer`); None where the task has none.
    """

    name: str
    method: str
    num_labels: int
    train_rows: Callable[[str, Any], int]
    metrics: tuple[str, ...]
    main_metric: str
    baseline: str = "majority_baseline"
    baseline_name: str = "majority class"
    max_seq_length: int = 0
    aliases: tuple[str, ...] = ()
    spec: Any = None
    lower_is_better: bool = False
    train_text: Callable[[str, Any], list[list[str]]] | None = None


@dataclasses.dataclass(frozen=True)
class NoObjectiveSettings:
    """The `objective` section of a method whose loss takes no settings."""


def no_check(model_config: Any, example_config: Any, objective: Any) -> None:
    """The `Resolution.check` of a method whose settings need no cross-field check."""


@dataclasses.dataclass(frozen=True)
class Resolution:
    """How a method's settings are checked and completed for a run (every part optional).

    - `check(model_config, example_config, objective)`: cross-field validation, raising
      UserError; `objective` is the `objective_config` (SimCLR: host crops of the views' size).
    - `run_settings(objective, config)`: the objective settings with the fields that depend on
      the run's settings filled in (BYOL: the target schedule spans train.steps x
      optim.grad_accum_steps loss calls).
    - `complete_data(prepared_data, model_config, objective, load)`: the prepared data with
      what depends on the network and the loss's settings added, once both are resolved
      (wav2vec 2.0: span masks and distractors drawn per record over the feature encoder's
      frames; DeepCluster: its rounds as `PreparedData.segments`; HuBERT's second iteration:
      targets from a model that `load`, the trainer's reader as `Start.pretrained` gets it,
      reads).
    """

    check: Callable[[Any, Any, Any], None] = no_check
    run_settings: Callable[[Any, Any], Any] | None = None
    complete_data: Callable[[PreparedData, Any, Any, Loader], PreparedData] | None = None


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """What a method measures beyond its loss, and how the CLI reports it.

    - `monitor(model, prepared_data, example_config, objective)`: held-out metrics beyond the
      loss's, computed at every evaluation (SimCLR: the kNN accuracy of the features at the
      views' size, `objective.image_size`); None: none.
    - `summarize(evaluation, report, untrained)`: the lines the CLI prints about the final
      held-out metrics (`evaluation`) beside the data's baselines (`report`); `untrained()`
      computes the `monitor` metrics of the same network at its random initialisation.
      Default: the held-out loss (`summary_of`).
    """

    monitor: Callable[[Any, PreparedData, Any, Any], dict[str, float]] | None = None
    summarize: Summarize = dataclasses.field(default_factory=summary_of)


@dataclasses.dataclass(frozen=True)
class Start:
    """Starting from a pre-trained model (every part optional).

    - `pretrained(model_config, seed, load)`: the model a fresh run starts from instead of
      `build_model`'s random one (fine-tuning: the pre-trained encoder plus a new head), or
      None for a random start. `load(path, **choices)` is the trainer's reader of a pretext
      workdir, model directory or HuggingFace folder (`choices`: for the model's
      `downstream_model`, e.g. SimCLR's `projection_layers`), passed in so that objectives
      never import the trainer's layer. Its parameters are placed on the mesh after the
      sharded init, so they never become constants of a compiled function.
    - `finetunes(pretrained_model, task, source_config)`: how a model this method's family
      made is fine-tuned on the downstream `task` (`DownstreamTask`): the
      `FinetuneRecipe` of the downstream run from `pretrained_model` (as `load` reads it), given
      the saved run config of the starting point (`source_config`; {} when it has none; its
      `source`: the starting point's path), or
      None when the model is not this family's or the family does not fine-tune on that task.
      `run.py finetune` / `glue` ask every method (`downstream_recipe`): BERT, ELECTRA, RoBERTa,
      ALBERT, MPNet, XLNet and XLM give their paper's recipe for the task's method, ELMo's its
      scalar mix on GLUE.
    - `hf_models`: our model classes that HuggingFace checkpoints convert to and that belong to
      this method (`run.py convert --to pretext` records it as the model's method).
    - `hf_parts`: for a model joined from several stand-alone HF models (ELECTRA's generator
      and discriminator), the sub-folders its parts are saved in, in order; its model config
      derives from theirs (`model_config.from_parts`) and the model copies their weights in
      (`load_parts`).
    """

    pretrained: Callable[[Any, int, Callable[[str], Any]], Any] | None = None
    finetunes: Callable[[Any, Any, Mapping[str, Any]], FinetuneRecipe | None] | None = None
    hf_models: tuple[type, ...] = ()
    hf_parts: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Method:
    """One pre-training (or downstream) method: what every method has, then three optional parts.

    - `model_config` / `example_config` / `objective_config`: the dataclass types of the run
      config's `model`, `examples` and `objective` sections (`objective`: the loss's settings,
      what only the loss reads: loss weights, temperatures, momentum schedules, the image
      methods' view augmentations; fields that shape the network belong to `model_config`).
    - `build_model(model_config, seed)`: a fresh Flax NNX module.
    - `loss(model, batch, rng)`: pure; `rng=None` means evaluation (no dropout, no sampling).
      A method with an `objective_config` gets its settings as the keyword `objective`
      (`bind_loss`).
    - `prepare(data_config, example_config, cache_dir, seed)`: builds the records on the host
      (`PreparedData`, whose `segments` say which records feed each step).
    - `units_per_example(example_config)`: `unit`s (tokens, images, views, samples) per
      example, for throughput.
    - `presets`: named starting configs, `{name: {section: {key: value}}}` without `method`
      (`make_config(name)`); a preset name is unique over all methods.
    - `resolution` (`Resolution`): cross-field checks, and what the run's settings, network
      and loss settings complete.
    - `evaluation` (`Evaluation`): held-out metrics beyond the loss, the CLI's summary lines.
    - `start` (`Start`): starting from a pre-trained model, and how this family fine-tunes.
    """

    name: str
    model_config: type
    example_config: type
    build_model: Callable[[Any, int], Any]
    loss: LossFn
    prepare: Callable[[Any, Any, Any, int], PreparedData]
    units_per_example: Callable[[Any], int]
    unit: str = "tokens"
    objective_config: type = NoObjectiveSettings
    description: str = ""
    presets: Mapping[str, Mapping[str, Mapping[str, Any]]] = dataclasses.field(
        default_factory=dict)
    resolution: Resolution = Resolution()
    evaluation: Evaluation = Evaluation()
    start: Start = Start()

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
_TASKS: dict[str, DownstreamTask] = {}  # every accepted spelling (`task_key`) -> its task


def task_key(name: str) -> str:
    """A task name as `--task` matches it: lower case, without `-` and `_`."""
    return name.lower().replace("-", "").replace("_", "")


def register_task(task: DownstreamTask) -> DownstreamTask:
    """Adds a downstream task under its name and aliases; a name another task holds is an
    error."""
    keys = {task_key(name) for name in (task.name, *task.aliases)}
    taken = sorted(key for key in keys if key in _TASKS)
    if taken:
        raise ValueError(f"task names {taken} of {task.name!r} are already registered")
    _TASKS.update(dict.fromkeys(keys, task))
    return task


def task_names() -> list[str]:
    """The registered downstream tasks' canonical names."""
    return sorted({task.name for task in _TASKS.values()})


def downstream_task(name: str) -> DownstreamTask:
    """The registered task `name` (any of its spellings)."""
    task = _TASKS.get(task_key(name))
    if task is None:
        raise UserError(f"unknown task {name!r}; use one of {', '.join(task_names())}")
    return task


# Each hook's positional arguments, as the trainer passes them (the docstrings above).
_HOOK_ARITY = {
    "build_model": 2, "prepare": 4, "units_per_example": 1,
    "resolution.check": 3, "resolution.run_settings": 2, "resolution.complete_data": 4,
    "evaluation.monitor": 4, "evaluation.summarize": 3,
    "start.pretrained": 3, "start.finetunes": 3,
}


def check_hooks(method: Method) -> None:
    """Every hook of `method` accepts the positional arguments the trainer passes it, checked
    when it registers rather than when a run first calls it."""
    for hook, arity in _HOOK_ARITY.items():
        function: Any = method
        for part in hook.split("."):
            function = getattr(function, part)
        if function is None:
            continue
        try:
            inspect.signature(function).bind(*range(arity))
        except TypeError as error:
            raise TypeError(f"method {method.name!r}: {hook} must accept {arity} positional "
                            f"arguments ({error})") from None


def register(method: Method) -> Method:
    """Adds a method and its presets; a second method of the same name, a preset name another
    method already declares or a hook of the wrong arity (`check_hooks`) is an error."""
    check_hooks(method)
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


def downstream_recipe(pretrained_model: Any, task: DownstreamTask,
                      source_config: Mapping[str, Any]) -> FinetuneRecipe | None:
    """The recipe of the downstream run that starts from `pretrained_model` on `task`
    (`Start.finetunes` of the family that made it); None when no method claims it."""
    for method in _METHODS.values():
        if method.start.finetunes is not None:
            recipe = method.start.finetunes(pretrained_model, task, source_config)
            if recipe is not None:
                return recipe
    return None


def method_of_model(model: Any) -> str:
    """The method a model read from HuggingFace belongs to (`Start.hf_models`: the method
    that lists its class, else one that lists a base class of it)."""
    for method in _METHODS.values():
        if type(model) in method.start.hf_models:
            return method.name
    for method in _METHODS.values():
        if isinstance(model, method.start.hf_models):
            return method.name
    raise UserError(f"no method trains a {type(model).__name__}; declare it in a method's "
                    "Start(hf_models=...)")


def joint_methods() -> dict[str, tuple[str, ...]]:
    """The methods whose model joins several HF models, with their parts' sub-folders
    (`Start.hf_parts`)."""
    return {name: method.start.hf_parts for name, method in _METHODS.items()
            if method.start.hf_parts}


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
