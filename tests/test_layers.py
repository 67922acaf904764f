"""The dependency direction (README, "Layout"): `run.py` -> `pretrain/` -> `objectives/` ->
`models/` and `input_pipeline/`, `errors.py` and `progress.py` under all of them; a method's file
imports no other method's; `pretrain/` names methods only where they are registered; no two
modules of the package import each other, directly or in a loop. Checked on the source (ast,
nothing imported), each check with a planted violation that it must catch. Also: the CLI's
summary lines come from the methods, unchanged."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

import pytest

from pretext_jax import objectives  # noqa: F401  (registers the methods)
from pretext_jax.objectives import registry

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "pretext_jax"
# what every method may import from objectives/: the registry and the shared folder (no method
# is registered in them); every other module of objectives/ is one method family
SHARED_OBJECTIVES = {"registry", "common"}
# the package-root modules below every layer
ROOT_MODULES = ("errors", "progress")
# what each layer may import from the package, besides itself and `ROOT_MODULES`
# pretrain/ modules that drive one method's workflow, and that method's objectives/ module:
# finetune.py holds the GLUE recipes and sweeps of `classify` (objectives/classification.py),
# translate.py the translation runs from a pre-trained encoder-decoder (objectives/translation.py)
DRIVERS = {"finetune.py": "classification", "translate.py": "translation", "transfer.py": "mtdnn"}
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
        for path in sorted((root / layer).rglob("*.py")):
            module = path.relative_to(root / layer).parts[0].removesuffix(".py")
            problems += layer_violations(layer, module, path.read_text())
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


def package_sources(root: Path) -> dict[str, str]:
    """The source of every module of the package by dotted name (a package's `__init__.py`
    under the package's name): the `.py` files of `root` and of its folders that are packages
    (tests/ and docs/ are not, and nothing imports them)."""
    sources = {}
    for path in sorted(root.rglob("*.py")):
        folders = path.relative_to(root).parts[:-1]
        if all((root.joinpath(*folders[:i + 1]) / "__init__.py").is_file()
               for i in range(len(folders))):
            parts = [PACKAGE, *folders, *([] if path.stem == "__init__" else [path.stem])]
            sources[".".join(parts)] = path.read_text()
    return sources


def import_graph(sources: Mapping[str, str]) -> dict[str, set[str]]:
    """Module -> the modules of `sources` that its imports name, top-level or inside functions,
    relative ones resolved: `from pretext_jax.x import y` names module `pretext_jax.x.y` when
    that is a module, else `pretext_jax.x`; `import pretext_jax.x.y` names the longest module
    prefix; `bench.x` (imported from the checkout root, where `bench` is not installed) is
    `pretext_jax.bench.x`. (Python also runs a package's `__init__` before a module of it; that
    edge is left out: the `objectives` package's registration list imports every method by
    design.)"""
    packages = {name.rsplit(".", 1)[0] for name in sources if "." in name}
    subpackages = {name.split(".")[1] for name in packages if name.count(".") == 1}

    def module_of(dotted: str) -> str | None:
        if dotted.split(".")[0] in subpackages:
            dotted = f"{PACKAGE}.{dotted}"
        while dotted and dotted not in sources:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph = {}
    for name, source in sources.items():
        here = name if name in packages else name.rpartition(".")[0]
        named = []
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                named += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                named += [f"{base}.{alias.name}" for alias in node.names]
        graph[name] = {target for target in map(module_of, named) if target} - {name}
    return graph


def find_cycle(graph: Mapping[str, set[str]]) -> list[str]:
    """One import cycle of `graph` as [a, b, ..., a] (a imports b, ...), or [] when there is
    none; depth first, in sorted order."""
    done: set[str] = set()
    for start in sorted(graph):
        path, branches = [start], [iter(sorted(graph[start]))]
        while path:
            following = next(branches[-1], None)
            if following is None:
                done.add(path.pop())
                branches.pop()
            elif following in path:
                return [*path[path.index(following):], following]
            elif following not in done:
                path.append(following)
                branches.append(iter(sorted(graph.get(following, ()))))
    return []


def test_no_two_modules_import_each_other():
    sources = package_sources(ROOT)
    assert {"pretext_jax.run", "pretext_jax.pretrain.hf", "pretext_jax.objectives",
            "pretext_jax.bench.throughput"} <= set(sources)
    cycle = find_cycle(import_graph(sources))
    assert cycle == [], " -> ".join(cycle)


@pytest.mark.parametrize("planted,cycle", [
    ({"pretext_jax.pretrain.a": "from pretext_jax.pretrain import b",
      "pretext_jax.pretrain.b": "from pretext_jax.pretrain.a import x"},
     ["pretext_jax.pretrain.a", "pretext_jax.pretrain.b", "pretext_jax.pretrain.a"]),
    ({"pretext_jax.models.a": "import pretext_jax.models.b as b",
      "pretext_jax.models.b": "def f():\n    from pretext_jax.models.c import y",
      "pretext_jax.models.c": "from pretext_jax.models import a"},
     ["pretext_jax.models.a", "pretext_jax.models.b", "pretext_jax.models.c",
      "pretext_jax.models.a"]),
    ({"pretext_jax.bench": "", "pretext_jax.bench.a": "from .b import x",
      "pretext_jax.bench.b": "from bench import a"},
     ["pretext_jax.bench.a", "pretext_jax.bench.b", "pretext_jax.bench.a"]),
])
def test_cycle_check_catches_a_planted_cycle(planted, cycle):
    assert find_cycle(import_graph(planted)) == cycle
    acyclic = {**planted, cycle[0]: "from pretext_jax.errors import UserError"}
    assert find_cycle(import_graph(acyclic)) == []


def test_cycle_check_catches_a_planted_cycle_in_the_package():
    """hf.py importing export.py inside a function (as `make_readable` once did) closes the loop
    export -> hf -> export."""
    sources = package_sources(ROOT)
    hf = "pretext_jax.pretrain.hf"
    sources[hf] += "\n\ndef f():\n    from pretext_jax.pretrain.export import convert\n"
    cycle = find_cycle(import_graph(sources))
    assert len(cycle) >= 3 and cycle[0] == cycle[-1] and hf in cycle, cycle
    assert "pretext_jax.pretrain.export" in cycle


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
               "from pretext_jax.objectives import registry\n"
               "from pretext_jax.objectives.common import losses\n"
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
    assert registry.get(method).evaluation.summarize(evaluation, report, untrained) == expected


def test_run_py_names_no_metric():
    source = (ROOT / "run.py").read_text()
    for metric in ("mlm", "plm", "nsp_accuracy", "sop_accuracy", "rtd_accuracy",
                   "contrastive_accuracy", "knn_accuracy"):
        assert metric not in source


def model_method_fields(source: str) -> list[int]:
    """Lines of a models/ file that speak of methods: a `method=` keyword (inside a
    registration too) or a field or variable called `method`; the models layer knows model
    families, and which method a model belongs to is the method's to say
    (`registry.Start.hf_models`)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.keyword) and node.arg == "method":
            lines.append(node.value.lineno)
        elif isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(getattr(t, "id", getattr(t, "attr", "")) == "method" for t in targets):
                lines.append(node.lineno)
    return sorted(set(lines))


def test_models_name_no_method():
    found = {str(path.relative_to(ROOT)): model_method_fields(path.read_text())
             for path in sorted((ROOT / "models").rglob("*.py"))}
    assert {name: lines for name, lines in found.items() if lines} == {}


@pytest.mark.parametrize("planted", [
    'register("bert", Converter(method="bert", model_type="bert"))',
    "class Converter:\n    method: str",
    "JOINT = {}\nmethod = 'electra'",
])
def test_model_method_check_catches_a_planted_field(planted):
    assert model_method_fields(planted) != []
    assert model_method_fields('register("bert", Converter(model_type="bert"))') == []


def test_trainer_keeps_to_building_the_step_and_the_loop():
    """Issue 33: the trainer's file stays under 500 lines; checkpoints (`checkpoints.py`), the
    batches of each step (`feed.py`), the step's body (`step.py`) and the workdir's files
    (`directories.py`) live in their own modules."""
    lines = (ROOT / "pretrain" / "trainer.py").read_text().count("\n")
    assert lines < 500, f"pretrain/trainer.py has {lines} lines"
    for module in ("checkpoints", "feed", "step", "directories"):
        assert (ROOT / "pretrain" / f"{module}.py").is_file()
