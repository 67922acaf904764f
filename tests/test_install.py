"""The package as users install it: a wheel built from the checkout holds one top-level package
(`pretext_jax`) and the licence, installs into a fresh virtual environment, and its console
command runs the demo from outside the repository."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def tracked_copy(destination: Path) -> Path:
    """The checkout's tracked files (what a clean clone holds) copied to `destination`, so the
    build writes nothing into the repository."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    for name in files.stdout.decode().split("\0"):
        if name and (REPO / name).is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, destination / name)
    return destination


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    source = tracked_copy(tmp_path_factory.mktemp("source"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(out), str(source)],
                   check=True, capture_output=True, cwd=out)
    (built,) = out.glob("pretext_jax-*.whl")
    return built


def test_wheel_installs_one_top_level_package_and_the_licence(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"pretext_jax", wheel.name.split("-py3")[0] + ".dist-info"}, top_level
    assert "pretext_jax/run.py" in names and "pretext_jax/pretrain/trainer.py" in names
    assert not any(part in name for name in names for part in ("/tests/", "/bench/", "/docs/"))
    metadata = next(name for name in names if name.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "Name: pretext-jax" in text and "License-Expression: Apache-2.0" in text
    assert any(name.endswith("licenses/LICENSE") for name in names)
    entry_points = next(name for name in names if name.endswith("entry_points.txt"))
    commands = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "pretext-jax = pretext_jax.run:main" in commands


def test_console_command_runs_the_demo_from_a_fresh_environment(wheel, tmp_path):
    """`pip install` of the wheel (dependencies from this interpreter's site-packages, as the
    index would give them) into a new venv, then `pretext-jax demo` run in an unrelated folder:
    it imports the installed copy, not the checkout."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python, command = venv / "bin" / "python", venv / "bin" / "pretext-jax"
    # This interpreter's packages (its own venv's too, which --system-site-packages would miss)
    # are the new venv's dependencies, behind its own site-packages.
    venv_site = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                               check=True, capture_output=True, text=True).stdout.strip()
    (Path(venv_site) / "_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    where = subprocess.run([python, "-c", "import pretext_jax; print(pretext_jax.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout
    run = subprocess.run(
        [command, "demo", "--workdir", "demo", "train.steps=20", "train.eval_every=20",
         "train.checkpoint_every=20", "train.progress=false", "model.num_layers=1"],
        cwd=elsewhere, env={**env, "PYTHONPROFILEIMPORTTIME": "1"}, capture_output=True,
        text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "held-out MLM accuracy" in run.stdout
    assert any((elsewhere / "demo" / "checkpoints").iterdir())
    assert any((elsewhere / "demo" / "tensorboard").iterdir())
    # Python's import log: the run (TensorBoard events included) loads neither torch nor
    # TensorFlow, though this environment has torch (tensorboardX imports it when it can; the
    # log also lists the refused attempt, `torch` alone, so the test looks for its submodules).
    imported = {line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines()
                if line.startswith("import time:")}
    assert {"tensorboardX.writer", "jax"} <= imported
    assert not [name for name in imported if name.startswith(("torch.", "tensorflow."))]


# A run in a process where the optional extras' packages cannot be imported (`None` in
# sys.modules makes `import` raise ModuleNotFoundError naming the package, as when it is absent).
WITHOUT_EXTRAS = """
import sys
for name in ("tensorflow_datasets", "tensorboardX", "matplotlib"):
    sys.modules[name] = None
from pretext_jax import run
sys.exit(run.main(sys.argv[1:]))
"""


def test_default_install_trains_without_the_extras_and_names_them(tmp_path):
    """Without tensorboardX and matplotlib a run still trains and writes metrics.jsonl, saying
    once which extra adds TensorBoard events and curves; a TFDS source without
    tensorflow-datasets is the one-line error naming the `tfds` extra, exit 2."""
    from resilience_utils import TINY_BERT, small_corpus

    settings = {**TINY_BERT, **small_corpus(tmp_path), "train.steps": 2}
    overrides = [f"{key}={value}" for key, value in settings.items()]
    command = [sys.executable, "-c", WITHOUT_EXTRAS, "pretrain", "--preset", "bert_tiny"]
    run = subprocess.run([*command, "--workdir", str(tmp_path / "w"), *overrides],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "pip install 'pretext-jax[tensorboard]'" in run.stdout
    assert "pip install 'pretext-jax[plots]'" in run.stdout
    assert (tmp_path / "w" / "metrics.jsonl").stat().st_size > 0
    assert not (tmp_path / "w" / "tensorboard").exists()
    assert not (tmp_path / "w" / "curves.png").exists()
    tfds = subprocess.run([*command, "--workdir", str(tmp_path / "t"), *overrides,
                           "data.source=tfds:wikipedia"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert tfds.returncode == 2 and len(tfds.stderr.strip().splitlines()) == 1, tfds.stderr
    assert "pip install 'pretext-jax[tfds]'" in tfds.stderr
