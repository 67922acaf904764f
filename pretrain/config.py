"""Run configuration: `section.key=value` overrides of a preset (declared by its method, see
`registry.Method.presets`), validation.

A config has generic sections (`data`, `optim`, `mesh`, `train`) and three method-owned
sections, `model`, `examples` and `objective` (the loss's settings), instances of the dataclasses
the method registers, each resolved and validated once (`make_config`, `config_from_dict`). The
dict form (`Config.to_dict`, every field of every section) exists for files: it is written to the
workdir and into every checkpoint, and `config_from_dict` reads it back, including configs
written by earlier versions (fields added since take their defaults; loss settings kept under
`model` before the `objective` section existed move there).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import json
import math
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.objectives import registry


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh axis sizes; -1 fills with the remaining devices (one axis at most)."""

    data: int = -1
    """Devices on the data-parallel axis (-1 = the devices the other axes leave)."""
    fsdp: int = 1
    """Devices over which parameters and optimizer state are sharded (ZeRO-3 style)."""
    tensor: int = 1
    """Devices over which large matrices are split (Megatron-style tensor parallelism)."""


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimizer and schedule. Defaults are BERT's AdamWeightDecay (optimization.py): lr 1e-4,
    wd 0.01 (not on LayerNorm or biases), b1 0.9, b2 0.999, eps 1e-6, no bias correction,
    global-norm clip 1.0, linear warmup then linear decay to 0. `optimizer` is adamw, lamb
    (ALBERT's lamb_optimizer.py: these Adam moments and decay times the trust ratio, which skips
    what the decay skips, per layer on stacked layers), lars (SimCLR, BYOL: `momentum` 0.9,
    `trust_coefficient` 0.001, neither decay nor adaptation on normalisation parameters and
    biases), sgd (MoCo: torch's SGD with `momentum`, decay on every parameter; `nesterov` as
    torch's SGD(nesterov=True)), adafactor (T5; `pretrain.optim.adafactor`) or adagrad (ELMo:
    bilm-tf's initial accumulator 1). `schedule`
    is linear (BERT: lr * step / warmup during warmup, then lr * (1 - step / steps)), electra_linear
    (ELECTRA's optimization.py: lr * (1 - step / steps) * min(1, step / warmup), the ramp
    multiplying the decayed value), cosine, constant, step (lr x `decay_factor` after each step
    of `decay_boundaries`: Caffe's step policy, RotNet's `LUT_lr`), inverse_sqrt (T5: lr *
    sqrt(warmup / max(step, warmup))), inverse_sqrt_warmup (fairseq's `inverse_sqrt` and XLM's
    `adam_inverse_sqrt`: linear from `warmup_init_learning_rate` to lr over the warmup, then lr *
    sqrt(warmup / step)), linear_from_peak (fairseq's polynomial_decay, XLNet's
    poly decay: lr * step / warmup, then linear from lr at the end of warmup to end_learning_rate at
    `steps`), tri_stage (fairseq's tri_stage, wav2vec 2.0 fine-tuning: linear from
    `warmup_init_learning_rate` to lr over the warmup, lr for `hold_steps`, then exponential
    decay to `end_learning_rate` at `steps`); `end_learning_rate` is where linear,
    electra_linear, linear_from_peak, cosine and tri_stage end. `eps_before_bias_correction`
    (with `bias_correction`): Adam's eps added to sqrt(v) before the bias correction, as
    fairseq's Adam and tf.train.AdamOptimizer do.
    `decay_norms_and_biases` (adamw, lamb): weight decay on every parameter, as fairseq's
    Adam, instead of skipping LayerNorm and biases. `layerwise_lr_decay` < 1 scales each
    Transformer layer's learning rate by decay^(depth from the top) (ELECTRA fine-tuning:
    0.8). `unfreeze_every_steps` > 0: gradual unfreezing (`pretrain.optim.gradually_unfrozen`).
    `prune_*` and `keep_pruned`: magnitude pruning (`pretrain.optim.magnitude_pruned`).
    """

    optimizer: str = "adamw"
    """adamw, lamb, lars (SimCLR, BYOL), sgd (MoCo), adafactor (T5) or adagrad (ELMo)."""
    learning_rate: float = 1e-4
    """Peak learning rate (BERT 1e-4)."""
    schedule: str = "linear"
    """linear, electra_linear, linear_from_peak, cosine, constant, step, inverse_sqrt (T5),
    inverse_sqrt_warmup (fairseq, XLM) or tri_stage (wav2vec 2.0 fine-tuning)."""
    warmup_steps: int = 10000
    """Steps of the linear warmup (BERT 10,000)."""
    end_learning_rate: float = 0.0
    """Where linear, electra_linear, linear_from_peak, cosine and tri_stage end."""
    warmup_init_learning_rate: float = 0.0
    """Where inverse_sqrt_warmup's and tri_stage's ramps start (fairseq and XLM
    `warmup_init_lr`; XLM 1e-7; tri_stage: fairseq `init_lr_scale` x lr)."""
    hold_steps: int = 0
    """tri_stage: steps at the peak after the warmup (fairseq `hold_steps`; wav2vec 2.0
    fine-tuning: 40 % of the steps)."""
    weight_decay: float = 0.01
    """Decoupled weight decay (BERT 0.01; not on LayerNorm or biases by default)."""
    b1: float = 0.9
    """Adam/LAMB first-moment decay."""
    b2: float = 0.999
    """Adam/LAMB second-moment decay (RoBERTa 0.98)."""
    eps: float = 1e-6
    """Adam/LAMB epsilon (BERT 1e-6)."""
    bias_correction: bool = False
    """Adam's bias correction (BERT's AdamWeightDecay has none; torch's AdamW has it)."""
    eps_before_bias_correction: bool = False
    """Add eps to sqrt(v) before the bias correction (fairseq, tf.train.AdamOptimizer)."""
    decay_norms_and_biases: bool = False
    """Weight decay on every parameter, as fairseq's Adam (adamw, lamb)."""
    clip_norm: float = 1.0
    """Clip gradients to this global norm (0 = no clipping)."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per step (train.batch_size is their total)."""
    momentum: float = 0.9
    """Momentum of lars and sgd."""
    trust_coefficient: float = 0.001
    """LARS trust coefficient (eta; SimCLR and BYOL 1e-3)."""
    learning_rate_after_momentum: bool = False
    """lars: v = m v + update, w -= lr v (BYOL's optimizers.py) instead of v = m v + lr update,
    w -= v (SimCLR's classic momentum); they differ while the rate changes."""
    layerwise_lr_decay: float = 1.0
    """Each Transformer layer's lr x decay^(depth from the top) (ELECTRA fine-tuning 0.8)."""
    unfreeze_every_steps: int = 0
    """Gradual unfreezing (ULMFiT): head only, then one more layer group from the top every
    this many updates (an epoch's: ULMFiT); 0 = all train from the start."""
    decay_boundaries: str = ""
    """Schedule `step`: steps, comma-separated, after which the lr is x decay_factor."""
    decay_factor: float = 0.1
    """Schedule `step`: the lr's factor at each boundary (Caffe gamma 0.1; RotNet 0.2)."""
    nesterov: bool = False
    """sgd: Nesterov momentum, as torch's SGD(nesterov=True) (RotNet true)."""
    prune_sparsity: float = 0.0
    """Gradual magnitude pruning (Gordon et al. 2020): the fraction of each encoder matrix's
    and the word embeddings' weights at 0 in the end (0 = off;
    `pretrain.optim.magnitude_pruned`)."""
    prune_initial_sparsity: float = 0.0
    """Magnitude pruning: the sparsity at update 0 (bert-prune's one-shot runs: = the target)."""
    prune_end_step: int = 10000
    """Magnitude pruning: the update at which the cubic ramp reaches the target (bert-prune:
    10,000; its one-shot runs: 1)."""
    prune_frequency: int = 10
    """Magnitude pruning: masks recomputed every this many updates (model_pruning's 10)."""
    prune_until_step: int = -1
    """Magnitude pruning: the last update that recomputes masks (-1: to the end, bert-prune's
    gradual runs; its one-shot runs: 200); later updates keep them."""
    keep_pruned: bool = False
    """Hold the encoder's and word embeddings' weights that are exactly 0 at the first update
    (a pruned checkpoint's) at 0, as bert-prune's fine-tuning keeps its pre-training masks."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Loop settings; `batch_size` is global (all processes and accumulation steps together).
    `on_nonfinite`: `stop` (raise at a step whose loss or gradients are not finite) or `skip`
    (leave the state unchanged for that step and go on; counted in the logged metrics)."""

    steps: int = 1000
    """Optimizer steps to train (the schedule spans them)."""
    batch_size: int = 256
    """Global batch: all processes, devices and accumulation steps together."""
    seed: int = 0
    """Seed of the initialisation, the data order, masking and dropout."""
    log_every: int = 50
    """Steps between training-metric lines (metrics.jsonl, TensorBoard, progress)."""
    eval_every: int = 500
    """Steps between held-out evaluations."""
    eval_batches: int = 20
    """Held-out batches per evaluation."""
    checkpoint_every: int = 1000
    """Steps between checkpoints (one is also written at the end and on SIGTERM)."""
    keep_checkpoints: int = 3
    """Checkpoints kept; older ones are deleted."""
    progress: bool = True
    """Show a tqdm progress bar with the latest loss and throughput (process 0)."""
    on_nonfinite: str = "stop"
    """stop at a non-finite loss or gradient, or skip that step and go on."""
    profile_steps: str = ""
    """FIRST:LAST steps to trace with jax.profiler into <workdir>/profile/; empty = none."""
    prefetch: bool = True
    """Read batch s+1 on the host while the devices run step s (same results either way)."""
    records_in_device_memory: bool = False
    """Keep every training record in device memory (replicated on each device) and read only
    their indices on the host; the step gathers its rows on the device (same results; for
    small fixed-shape data such as CIFAR-10's 150 MB, whose host loader would bound a GPU)."""


@dataclasses.dataclass(frozen=True)
class Config:
    """A run's settings. `model`, `examples` and `objective` are instances of the method's
    `model_config`, `example_config` and `objective_config` (`registry.Method`); one left out
    (None) takes its class's defaults, as `method` left out is the registry's default method."""

    method: str = dataclasses.field(default_factory=registry.default_method)
    model: Any = None
    examples: Any = None
    objective: Any = None
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    mesh: MeshConfig = MeshConfig()
    train: TrainConfig = TrainConfig()

    def __post_init__(self) -> None:
        method = registry.get(self.method)
        for section in METHOD_SECTIONS:
            cls, value = _method_section_class(section, method), getattr(self, section)
            if value is None:
                object.__setattr__(self, section, cls())
            elif type(value) is not cls:
                raise TypeError(f"Config.{section} of method {self.method!r} must be "
                                f"{cls.__name__}, not {type(value).__name__}")

    def to_dict(self) -> dict[str, Any]:
        """The dict form, every field of every section (`config_from_dict` reads it back)."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _parse_value(text: str, kind: Any, key: str) -> Any:
    if isinstance(kind, types.UnionType):  # e.g. `int | None`
        if text.lower() == "none":
            return None
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    try:
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
        if kind is str and text in ("''", '""'):  # `as_override("")`, quoted as in a shell
            return ""
        if kind in (int, float, str):
            return kind(text)
    except ValueError:
        raise UserError(f"{key}={text!r} is not a valid {kind.__name__}; "
                        f"give e.g. {key}={kind()!r}") from None
    return json.loads(text)


METHOD_SECTIONS = ("model", "examples", "objective")


def _method_section_class(section: str, method: registry.Method) -> type:
    return {"model": method.model_config, "examples": method.example_config,
            "objective": method.objective_config}[section]


def _section_class(section: str, method: str) -> type:
    if section in METHOD_SECTIONS:
        return _method_section_class(section, registry.get(method))
    return _field_types(Config)[section]


def _apply(tree: dict[str, Any], key: str, value: Any, method: str, parse: bool) -> None:
    if "." not in key:
        raise UserError(f"config key {key!r} needs a section, e.g. train.steps=100; sections: "
                        f"{[f.name for f in dataclasses.fields(Config) if f.name != 'method']}")
    section, name = key.split(".", 1)
    if section not in tree or section == "method":
        raise UserError(f"unknown config section {section!r} in {key!r}; use one of "
                        f"{[f.name for f in dataclasses.fields(Config) if f.name != 'method']}")
    kinds = _field_types(_section_class(section, method))
    if name not in kinds:
        if section == "model" and registry.get(method).split_model_section({name: None})[1]:
            raise UserError(f"{key} moved to the objective section; write "
                            f"objective.{name}={value}")
        raise UserError(f"unknown config key {key!r}; valid keys in {section}: {sorted(kinds)}")
    tree[section][name] = _parse_value(value, kinds[name], key) if parse else value


def make_config(preset: str | None = None, overrides: list[str] | dict[str, Any] = (),
                file: str | Path | None = None) -> Config:
    """A validated Config from a preset name, a config `file` (`read_config_file`; its
    `preset:` applies when `preset` is None) and `section.key=value` overrides (strings, parsed
    by field type) or a `{"section.key": value}` dict (values used as given), in that order:
    preset < file < overrides."""
    tree: dict[str, Any] = {"method": registry.default_method(), "model": {}, "examples": {},
                            "objective": {}, "data": {}, "optim": {}, "mesh": {}, "train": {}}
    items = overrides.items() if isinstance(overrides, dict) else None
    if items is None:
        items = []
        for text in overrides:
            if "=" not in text:
                raise UserError(f"override {text!r} is not key=value; write e.g. train.steps=100")
            items.append(tuple(text.split("=", 1)))
    settings = read_config_file(file) if file is not None else {}
    preset = settings.pop("preset", None) if preset is None else preset
    method_override = [v for k, v in items if k == "method"]
    if preset is not None:
        tree.update(registry.preset(preset))
    if "method" in settings:
        tree["method"] = settings["method"]
    if method_override:
        tree["method"] = method_override[-1]
    registry.get(tree["method"])
    if file is not None:
        _apply_file(tree, settings, file)
    for key, value in items:
        if key != "method":
            _apply(tree, key, value, tree["method"], parse=not isinstance(overrides, dict))
    return config_from_dict(tree)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The settings of a config file, sections as in a workdir's config.json (`method`,
    `model`, `objective`, `examples`, `data`, `optim`, `mesh`, `train`) plus an optional
    `preset`: a YAML file, or a Python file whose `get_config()` returns that dict (as
    big_vision's configs; its docstring can hold the command that runs it)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--config {path}: no such file; give a .yaml or .py config file")
    if path.suffix == ".py":
        settings = _python_config(path)
    else:
        import yaml

        try:
            settings = yaml.safe_load(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as error:
            problem = " ".join(str(error).split())
            raise UserError(f"--config {path} is not valid YAML ({problem}); fix the "
                            "file") from None
    if hasattr(settings, "to_dict"):  # an ml_collections.ConfigDict
        settings = settings.to_dict()
    if not isinstance(settings, dict):
        raise UserError(f"--config {path} must hold a mapping of sections (method, model, "
                        f"objective, examples, data, optim, mesh, train, preset), not a "
                        f"{type(settings).__name__}")
    sections = [f.name for f in dataclasses.fields(Config)]
    for key, value in settings.items():
        if key not in (*sections, "preset"):
            raise UserError(f"--config {path}: unknown section {key!r}; use {sections} or preset")
        if key in ("method", "preset"):
            if not isinstance(value, str):
                raise UserError(f"--config {path}: {key} must be a name, not {value!r}")
        elif not isinstance(value, dict):
            raise UserError(f"--config {path}: section {key} must map keys to values, e.g. "
                            f"{key}: {{...}}")
    return dict(settings)


def _python_config(path: Path) -> Any:
    """`get_config()` of a Python config file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"pretext_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        problem = " ".join(str(error).split())
        raise UserError(f"--config {path} failed to run ({type(error).__name__}: {problem}); "
                        "fix the file (--traceback shows where)") from error
    if not callable(getattr(module, "get_config", None)):
        raise UserError(f"--config {path} defines no get_config(); add one that returns a dict "
                        "of sections, e.g. {'train': {'steps': 100}}")
    try:
        return module.get_config()
    except Exception as error:
        problem = " ".join(str(error).split())
        raise UserError(f"--config {path}: get_config() raised {type(error).__name__}: "
                        f"{problem}; fix the file (--traceback shows where)") from error


def _apply_file(tree: dict[str, Any], settings: dict[str, Any], path: str | Path) -> None:
    """The sections of a config file over `tree`, each value checked against its field's type
    (YAML reads 1e-4 as a string and 3 as an int: those are converted)."""
    for section, values in settings.items():
        if section in ("method", "preset"):
            continue
        for name, value in values.items():
            key = f"{section}.{name}"
            try:
                _apply(tree, key, value, tree["method"], parse=False)
                kind = _field_types(_section_class(section, tree["method"]))[name]
                tree[section][name] = _file_value(value, kind, key)
            except UserError as error:
                raise UserError(f"--config {path}: {error}") from None


def _file_value(value: Any, kind: Any, key: str) -> Any:
    """`value` as a field of type `kind`: strings parsed as overrides are, ints widened to
    float, anything else of the wrong scalar type refused."""
    if isinstance(value, str) and kind is not str:
        return _parse_value(value, kind, key)
    if value is None and isinstance(kind, types.UnionType) and type(None) in typing.get_args(kind):
        return value
    if isinstance(kind, types.UnionType):
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind in (bool, int, float, str) and (
            not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise UserError(f"{key}={value!r} is not a valid {kind.__name__}; give e.g. "
                        f"{key}: {kind()!r}")
    return value


def config_from_dict(tree: dict[str, Any]) -> Config:
    """Builds and validates a Config from its dict form (as saved in a workdir and in
    checkpoints, or a preset's tree with only some keys); keys left out take their defaults.
    Loss settings that configs written before the `objective` section existed keep under
    `model` (e.g. `model.temperature`) move to `objective`
    (`registry.Method.split_model_section`)."""
    method = registry.get(tree["method"] if "method" in tree else registry.default_method())
    model, moved = method.split_model_section(tree.get("model", {}))
    values = {**tree, "model": model, "objective": {**moved, **tree.get("objective", {})}}
    sections = {}
    for section in (f.name for f in dataclasses.fields(Config) if f.name != "method"):
        cls = _section_class(section, method.name)
        given = values.get(section, {})
        unknown = set(given) - set(_field_types(cls))
        if unknown:
            raise UserError(f"unknown config keys {sorted(unknown)} in {section}; valid: "
                            f"{sorted(_field_types(cls))}")
        for name, value in given.items():  # before the sections' own range checks run
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"{section}.{name}={value} must be a finite number")
        try:
            sections[section] = cls(**given)
        except (TypeError, ValueError) as e:
            if section not in METHOD_SECTIONS:
                raise
            raise UserError(f"invalid {section} config ({section}.*): {e}") from None
    config = Config(method=method.name, **sections)
    validate(config)
    return config


# Settings that may change when a run is resumed; everything else must match the saved run.
RESUMABLE_KEYS = {"steps", "log_every", "eval_every", "eval_batches", "checkpoint_every",
                  "keep_checkpoints", "progress", "on_nonfinite", "profile_steps", "prefetch"}


def config_difference(recorded: dict[str, Any], config: Config) -> str | None:
    """The first setting in which a recorded run config differs from `config` (settings that
    may change on resume excepted). Read through the config types, so fields added since it
    was saved take their defaults; a config not valid in this version is compared as written
    (so it differs). Both sides as JSON values: a tuple in a preset is the list that
    config.json holds."""
    with contextlib.suppress(UserError, TypeError):
        recorded = config_from_dict(recorded).to_dict()
    saved, wanted = json.loads(json.dumps(recorded)), json.loads(config.to_json())
    for section, values in wanted.items():
        if not isinstance(values, dict):
            if saved.get(section) != values:
                return f"{section}: {saved.get(section)!r} vs {values!r}"
            continue
        for key, value in values.items():
            if section == "train" and key in RESUMABLE_KEYS:
                continue
            if saved.get(section, {}).get(key) != value:
                return f"{section}.{key}: {saved.get(section, {}).get(key)!r} vs {value!r}"
    return None


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's one-line doc: the string literal written right after the field (PEP 257's
    attribute docstrings, as Sphinx reads them), from the class and the dataclasses it
    extends."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError, IndexError, AttributeError):
            continue
        for node, following in zip(body, body[1:], strict=False):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def as_override(value: Any) -> str:
    """A value as `section.key=VALUE` takes it back (`_parse_value`)."""
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, str):
        return value if value else "''"
    return str(value) if isinstance(value, int | float) else json.dumps(value)


def describe(config: Config) -> str:
    """Every key of `config` with its value, the class default where it differs, and its doc
    (`run.py config`), section by section."""
    lines = [f"method={config.method}  ({registry.get(config.method).description})"]
    for section in ("data", "optim", "mesh", "train", *METHOD_SECTIONS):
        settings = getattr(config, section)
        cls = type(settings)
        lines.append(f"\n[{section}]  {cls.__module__}.{cls.__name__}")
        docs = field_docs(cls)
        defaults = dataclasses.asdict(cls())
        for name, value in dataclasses.asdict(settings).items():
            default = ("" if value == defaults[name]
                       else f"  (default {as_override(defaults[name])})")
            lines.append(f"  {section}.{name}={as_override(value)}{default}")
            lines.append(f"      {docs.get(name, 'undocumented')}")
    return "\n".join(lines)


# The valid range of every numeric key of the generic sections, in interval notation.
RANGES = {
    "optim.learning_rate": "[0, inf)", "optim.warmup_steps": "[0, inf)",
    "optim.end_learning_rate": "[0, inf)", "optim.warmup_init_learning_rate": "[0, inf)",
    "optim.hold_steps": "[0, inf)",
    "optim.weight_decay": "[0, inf)",
    "optim.b1": "[0, 1)", "optim.b2": "[0, 1)", "optim.eps": "[0, inf)",
    "optim.clip_norm": "[0, inf)", "optim.grad_accum_steps": "[1, inf)",
    "optim.momentum": "[0, 1)", "optim.trust_coefficient": "[0, inf)",
    "optim.layerwise_lr_decay": "(0, 1]", "optim.unfreeze_every_steps": "[0, inf)",
    "optim.prune_sparsity": "[0, 1)", "optim.prune_initial_sparsity": "[0, 1)",
    "optim.prune_end_step": "[1, inf)", "optim.prune_frequency": "[1, inf)",
    "optim.prune_until_step": "[-1, inf)",
    "train.steps": "[1, inf)", "train.batch_size": "[1, inf)", "train.seed": "[0, 4294967295]",
    "train.log_every": "[1, inf)", "train.eval_every": "[1, inf)", "train.eval_batches": "[1, inf)",
    "train.checkpoint_every": "[1, inf)", "train.keep_checkpoints": "[1, inf)",
    "data.vocab_size": "[8, inf)", "mesh.data": "[-1, inf)", "mesh.fsdp": "[-1, inf)",
    "mesh.tensor": "[-1, inf)",
}


def _inside(value: float, interval: str) -> bool:
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    return ((value >= low if interval[0] == "[" else value > low)
            and (value <= high if interval[-1] == "]" else value < high))


def check_numbers(config: Config) -> None:
    """Every float of every section finite, every key of `RANGES` inside its range, mesh sizes
    -1 or positive (the model configs check their own fields, e.g. `dtype`)."""
    sections = {name: dataclasses.asdict(getattr(config, name))
                for name in ("data", "optim", "mesh", "train", *METHOD_SECTIONS)}
    for section, values in sections.items():
        for name, value in values.items():
            key = f"{section}.{name}"
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"{key}={value} must be a finite number")
            interval = RANGES.get(key)
            if interval and isinstance(value, int | float) and not _inside(value, interval):
                raise UserError(f"{key}={value} is outside its valid range {interval}")
            if section == "mesh" and value == 0:
                raise UserError(f"{key}=0: a mesh axis needs at least 1 device (-1 = the rest)")


def parse_profile_steps(text: str) -> tuple[int, int]:
    """`a:b` -> (a, b), the first and last step to trace (1 <= a <= b); `a` alone is `a:a`."""
    first, _, last = text.partition(":")
    try:
        bounds = int(first), int(last or first)
    except ValueError:
        bounds = (0, -1)
    if not 1 <= bounds[0] <= bounds[1]:
        raise UserError(f"train.profile_steps={text!r} must be FIRST:LAST steps with "
                        "1 <= FIRST <= LAST, e.g. train.profile_steps=10:12")
    return bounds


def validate(config: Config) -> None:
    """Range checks (`check_numbers`) and cross-field checks that need no devices or data."""
    t, o = config.train, config.optim
    check_numbers(config)
    if t.profile_steps:
        parse_profile_steps(t.profile_steps)
    if t.on_nonfinite not in ("stop", "skip"):
        raise UserError(f"train.on_nonfinite={t.on_nonfinite!r} must be 'stop' or 'skip'")
    if o.eps_before_bias_correction and not o.bias_correction:
        raise UserError("optim.eps_before_bias_correction=true places eps relative to Adam's "
                        "bias correction; set optim.bias_correction=true as well")
    if t.batch_size % o.grad_accum_steps:
        raise UserError(f"train.batch_size={t.batch_size} is not divisible by "
                        f"optim.grad_accum_steps={o.grad_accum_steps}; change one of them")
    registry.get(config.method).resolution.check(config.model, config.examples,
                                                 config.objective)
