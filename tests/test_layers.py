"""The dependency direction (README, "Layout"): `run.py` -> `pretrain/` -> `objectives/` ->
`models/` and `input_pipeline/`, `errors.py` and `progress.py` under all of them; a method's file
imports no other method's; `pretrain/` names methods only where they are registered. Checked on
the source (ast, nothing imported), each check with a planted violation that it must catch.
Also: the CLI's summary lines come from the methods, unchanged."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.objectives import registry

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "pretext_jax"
# objectives/ modules that every method may import (no method is registered in them)
SHARED_OBJECTIVES = {"registry", "text", "two_view", "contrastive", "evaluation",
                     "glue_metrics", "preset_parts", "speech", "masked_span", "clustering"}
# the package-root modules below every layer
ROOT_MODULES = ("errors", "progress")
# what each layer may import from the package, besides itself and `ROOT_MODULES`
# pretrain/ modules that drive one method's workflow, and that method's objectives/ module:
# finetune.py holds the GLUE recipes and sweeps of `classify` (objectives/classification.py),
# translate.py the translation runs from a pre-trained encoder-decoder (objectives/translation.py)
DRIVERS = {"finetune.py": "classification", "translate.py": "translation"}
ALLOWED = {"models": set(), "input_pipeline": set(), "objectives": {"models", "input_pipeline"},
           "pretrain": {"models", "input_pipeline", "objectives"}}


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in `source`, top-level or inside functions;
    `from pretext_jax.x import y` counts as `pretext_jax.x.y` (y may be a module)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def layer_violations(layer: str, module: str, source: str) -> list[str]:
    """Imports of `layer/module.py` that run up or sideways."""
    problems = []
    for line, name in imported_modules(source):
        parts = name.split(".")
        if parts[0] != PACKAGE or len(parts) < 2:
            continue
        target = parts[1]
        if target in (*ROOT_MODULES, layer):
            if (layer == "objectives" and target == layer and len(parts) > 2
                    and parts[2] not in SHARED_OBJECTIVES and parts[2] != module):
                problems.append(f"{layer}/{module}.py:{line} imports the method module {name}")
            continue
        if target not in ALLOWED[layer]:
            problems.append(f"{layer}/{module}.py:{line} imports {name} ({layer} -> {target})")
    return problems


def all_layer_violations(root: Path) -> list[str]:
    problems = []
    for layer in ALLOWED:
        for path in sorted((root / layer).glob("*.py")):
            if layer == "objectives" and path.stem == "__init__":
                continue  # the package's one job: import every method to register it
            problems += layer_violations(layer, path.stem, path.read_text())
    return problems


def test_no_import_runs_up_or_sideways():
    assert all_layer_violations(ROOT) == []


@pytest.mark.parametrize("layer,module,line", [
    ("models", "bert", "from pretext_jax.input_pipeline import bert_examples"),
    ("input_pipeline", "glue", "from pretext_jax.models.bert import Bert"),
    ("objectives", "bert", "from pretext_jax.pretrain import export"),
    ("objectives", "mpnet", "from pretext_jax.objectives.xlnet import unigram_baselines"),
    ("objectives", "classification", "def f():\n    from pretext_jax.pretrain import hf"),
    ("objectives", "moco", "from pretext_jax import run"),
])
def test_layer_check_catches_a_planted_import(layer, module, line):
    assert len(layer_violations(layer, module, line)) == 1
    assert layer_violations(layer, module, "from pretext_jax.errors import UserError") == []


def method_names() -> set[str]:
    return set(registry.names())


def method_mentions(source: str, names: set[str], driven: str = "") -> list[int]:
    """Lines of `source` (code, not prose) that name a method outside a `register(...)` call:
    an import of a method's module (`objectives/<file>.py` other than the shared ones and
    `driven`, the method a driver module exists for), or a method name as a string in a
    method's place: `method=...`, a `"method": ...` entry, a comparison with something called
    method, `registry.get(...)`, `.get("method", ...)`, or the default of a `method` field."""
    tree = ast.parse(source)
    registering = {n for call in ast.walk(tree) if isinstance(call, ast.Call)
                   and getattr(call.func, "id", getattr(call.func, "attr", "")) == "register"
                   for n in ast.walk(call)}
    method_modules = {path.stem for path in (ROOT / "objectives").glob("*.py")} - {
        *SHARED_OBJECTIVES, "__init__", driven}

    def named(node: ast.AST | None) -> bool:
        return isinstance(node, ast.Constant) and node.value in names

    def about_methods(node: ast.AST) -> bool:
        return "method" in ast.unparse(node)

    lines = []
    for node in ast.walk(tree):
        if node in registering:
            continue
        hit = False
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = [*node.module.split("."), *(a.name for a in node.names)]
            hit = parts[:2] == [PACKAGE, "objectives"] and any(
                part in method_modules for part in parts[2:])
        elif isinstance(node, ast.keyword):
            hit = node.arg == "method" and named(node.value)
        elif isinstance(node, ast.Dict):
            hit = any(isinstance(k, ast.Constant) and k.value == "method" and named(v)
                      for k, v in zip(node.keys, node.values, strict=True))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            hit = any(named(s) for s in sides) and any(about_methods(s) for s in sides
                                                       if not named(s))
        elif isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            hit = (func.endswith("registry.get") and any(named(a) for a in node.args)) or (
                func.endswith(".get") and len(node.args) == 2 and named(node.args[1])
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == "method")
        elif isinstance(node, ast.AnnAssign):
            hit = getattr(node.target, "id", "") == "method" and named(node.value)
        if hit:
            lines.append(node.lineno)
    return sorted(set(lines))


def pretrain_mentions() -> dict[str, list[int]]:
    names = method_names()
    found = {path.name: method_mentions(path.read_text(), names, DRIVERS.get(path.name, ""))
             for path in sorted((ROOT / "pretrain").glob("*.py"))}
    return {name: lines for name, lines in found.items() if lines}


def test_pretrain_names_methods_only_in_registrations():
    assert pretrain_mentions() == {}


@pytest.mark.parametrize("planted", [
    'config = {"method": "bert", "steps": 3}',
    'if config.method == "simclr":\n    pass',
    'x = Converter(method="xlnet")',
    'method = registry.get("moco")',
    'tree.get("method", "bert")',
    "from pretext_jax.objectives import electra",
    "from pretext_jax.objectives.byol import byol_loss",
    "class Config:\n    method: str = 'gpt'",
])
def test_method_name_check_catches_a_planted_mention(planted):
    assert method_mentions(planted, method_names()) != []


def test_method_name_check_allows_registrations_and_other_vocabularies():
    allowed = ('register(Method(name="bert", description="masked LM"))\n'
               'if head == "xlnet":\n    pass\n'
               '"""the bert recipe"""\n'
               "from pretext_jax.objectives import registry, text\n"
               "from pretext_jax.objectives.classification import METHOD\n")
    assert method_mentions(allowed, method_names(), driven="classification") == []


def untrained() -> dict[str, float]:
    return {"knn_accuracy": 0.25, "few_label_probe_accuracy": 0.125}


@pytest.mark.parametrize("method,evaluation,report,expected", [
    ("bert", {"mlm_accuracy": 0.5, "loss": 2.0, "nsp_accuracy": 0.75},
     {"majority_baseline_mlm_accuracy": 0.125},
     ["  held-out MLM accuracy 0.500 vs majority-token baseline 0.125",
      "  held-out loss: 2.000", "  held-out nsp_accuracy: 0.750"]),
    ("albert", {"mlm_accuracy": 0.5, "loss": 2.0, "sop_accuracy": 0.75}, {},
     ["  held-out MLM accuracy 0.500", "  held-out loss: 2.000",
      "  held-out sop_accuracy: 0.750"]),
    ("electra", {"mlm_accuracy": 0.5, "loss": 2.0, "rtd_accuracy": 0.75, "accuracy": 0.1},
     {"majority_baseline_mlm_accuracy": 0.125},
     ["  held-out MLM accuracy 0.500 vs majority-token baseline 0.125",
      "  held-out loss: 2.000", "  held-out rtd_accuracy: 0.750"]),
    ("xlnet", {"plm_accuracy": 0.5, "loss": 2.0}, {"majority_baseline_plm_accuracy": 0.125},
     ["  held-out PLM accuracy 0.500 vs majority-token baseline 0.125",
      "  held-out loss: 2.000"]),
    ("gpt", {"loss": 2.0, "accuracy": 0.5}, {}, ["  held-out loss: 2.000"]),
    ("moco", {"loss": 2.0, "contrastive_accuracy": 0.75, "knn_accuracy": 0.5}, {},
     ["  held-out loss: 2.000", "  held-out contrastive_accuracy: 0.750",
      "  held-out kNN accuracy of the backbone's features 0.500 vs 0.250 for the same network "
      "untrained"]),
    ("byol", {"loss": 2.0}, {}, ["  held-out loss: 2.000"]),
    ("simclr", {"loss": 2.0, "knn_accuracy": 0.5, "few_label_probe_accuracy": 0.375},
     {"probe_labels_per_class": 10},
     ["  held-out loss: 2.000",
      "  held-out kNN accuracy of the backbone's features 0.500 vs 0.250 for the same network "
      "untrained",
      "  held-out accuracy of a linear probe on the backbone's features fitted to 10 labelled "
      "training images per class 0.375 vs 0.125 for the same network untrained"]),
])
def test_summaries_come_from_the_methods(method, evaluation, report, expected):
    assert registry.get(method).summarize(evaluation, report, untrained) == expected


def test_run_py_names_no_metric():
    source = (ROOT / "run.py").read_text()
    for metric in ("mlm", "plm", "nsp_accuracy", "sop_accuracy", "rtd_accuracy",
                   "contrastive_accuracy", "knn_accuracy"):
        assert metric not in source
