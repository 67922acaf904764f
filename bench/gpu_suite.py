"""One command for a lent GPU: the throughput table, its torch references and the CIFAR-10
reproductions, prepared and smoke-tested on CPU (issue 32).

    python -m bench.gpu_suite wheels [--cifar10]   # here, where pip reaches an index: fills .whl/
    python -m bench.gpu_suite [run]                # on the GPU machine, in the checkout root
    python -m bench.gpu_suite smoke                # the smoke phase alone (CPU: what CI runs)
    python -m bench.gpu_suite profile [--workloads bert_base ...]  # GPU: where steps go
    python -m bench.gpu_suite cifar10-stage .cifar10/partN   # on the GPU machine, once per part
    python -m bench.gpu_suite cifar10 --method simclr        # then this, on the same machine
    python -m bench.gpu_suite semi                           # then 1 % / 10 % label fine-tuning

The GPU machine (device README, KINDS.md): Python 3.12 with jax 0.11.x (CUDA 13), flax, optax,
orbax-checkpoint, torch, torchvision and transformers, but not grain, array-record, portpicker
nor this package; no network; 64 MiB of files per command, 10 minutes per command, 15 minutes of
device time in all. So:

- `wheels` (here) downloads the cp312 manylinux x86_64 wheels of what our runtime needs and the
  image lacks (`MISSING_ON_GPU_IMAGE`, pinned to the versions installed here) into the
  git-ignored `.whl/`, copies `../shared/bench` (torch references, roofline) to
  `.whl/shared_bench/`, prints the total (about 4.5 MB); `--cifar10` also copies
  `../shared/data/cifar10/part1..3` into the git-ignored `.cifar10/`. A wheel pip cannot get is
  named on a `MISSING:` line and the exit status is 1.
- `run` (default) installs those wheels with `pip install --no-index --no-deps --target` into a
  scratch folder, makes `pretext_jax` importable through a `pretext_jax` symlink to the checkout
  (as the tests do; `pip install -e .` would need setuptools >= 77 from an index), and runs, each
  in its own process with a time box from one budget (`--budget`, 540 s): the versions and the
  device; a smoke of every workload at tiny size (bf16, scan and donation as the real ones) plus
  the GPU-only checks below; the five throughput workloads of `bench.throughput` (BERT-base first:
  one process each, so `peak_memory_gib` is that workload's own); the torch references of
  `.whl/shared_bench` (BERT first, then ELECTRA, XLNet and vision while time is left); the JAX
  roofline. A part that fails or runs out of time writes its error line and the suite goes on; a
  part that no longer fits is recorded as skipped with the reason.
- Every result is one JSON line of `results.jsonl` in `--out` (default `$OUT`, else
  runs/gpu_suite), beside `suite.log` (all output), `throughput.md` (`bench.throughput`'s rows)
  and `summary.md` (smoke table, ratio table ours / torch, skips and errors), which is also
  printed last.
- `profile` traces a few steps of each of `--workloads` (default `PROFILED`, the rows under
  their target last time) with `bench.profile_step`, one process each: `profile_<w>.md` (kernel
  time per step by kind and the top kernels, each named by its JAX operation) and the raw
  `profile_<w>.trace.json.gz`, about 1-2 minutes a workload; after `run` in the same lease.
- CIFAR-10 (issue step 2): the data (177 MiB of pickles) cannot travel in one command, so three
  commands on a warm machine each carry one part (`carry=[".cifar10/partN"]`, 59 MiB) and
  `cifar10-stage` copies it to `--data` (default /tmp/pretext_data) there; then `cifar10` runs
  `bench.image_cifar10 --recipe` (the preset's own model and recipe at batch 512 for `--epochs`)
  with a workdir outside the checkout, stops with a checkpoint before its budget runs out, and
  the same command resumes it exactly, on the same warm machine, until kNN (k 200) and the linear
  probe are written. The pixels are rebuilt from JPEG copies (lossy). `--method moco` and
  `byol` run `moco_cifar10` and `byol_cifar10`, lightly's CIFAR-10 benchmark settings, whose
  kNN figures stand beside ours. The 50,000 images (150 MB) are kept in device memory
  (`train.records_in_device_memory=true`: the host loader reads only their indices and the step
  gathers and augments them on the device). `semi` then fine-tunes that
  run's backbone on 1 % and 10 % of the labels beside the same network from its random
  initialisation (`bench.semi_cifar10`, `run.py finetune --task semi`'s recipe: 60 and 30
  epochs at batch 256), its own command on the same warm machine (`--init`, default the
  `cifar10 --method simclr` workdir), resuming its workdirs if the budget stops it.

Through the device tool, from the session's own checkout after `wheels --cifar10` there:
`run(command="python3 -m bench.gpu_suite", carry=[".whl"], timeout_s=600)` (about 10 of the 15
minutes of a lease with the machine's start). CIFAR-10 in a later lease: three calls back to
back (a machine goes back 30 s after a call) `run(command="python3 -m bench.gpu_suite
cifar10-stage .cifar10/partN", carry=[".cifar10/partN"])` for N = 1, 2, 3 (59 MiB each beside
the working tree's 3.5 MiB, under the 64 MiB), then `run(command="python3 -m bench.gpu_suite
cifar10 --method simclr", carry=[".whl"], timeout_s=600)`, again while it ends `stopped`.

What runs differently on the GPU than on CPU, and how the suite checks it:
- bf16: the workloads compute in bfloat16 (float32 parameters); on CPU XLA emulates it. The
  smoke requires a finite loss for every workload, and on GPU compares a 30-step bf16 loss curve
  with the float32 path (`bench.throughput.loss_curves`; within 2 %, as the CPU test).
- cuDNN attention: `model.attention_implementation=cudnn` exists only on GPU. On GPU the smoke
  compiles a BERT step with it (no attention dropout) and requires a cuDNN fused-attention call
  in the compiled program; the throughput workloads keep XLA attention.
- Donation: the step donates its state. Every smoke and throughput line has `state_donated`
  (whether the step freed the state it was given); on GPU a smoke with it false is an error.
- Memory statistics: only GPUs report `peak_bytes_in_use` (CPU: none); each throughput workload
  runs in its own process, so its `peak_memory_gib` is its own, not a running maximum.
- Versions: the machine has jax 0.11.x on Python 3.12; here (and in CI) the package index has
  jax 0.10.2 on Python 3.11 only, so the smoke has never run under jax 0.11 and the GPU's first
  minute is that check: the environment line prints every version.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from bench import report

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
WHEELS = REPO / ".whl"
REFERENCE_SCRIPTS = "shared_bench"  # the copies of ../shared/bench inside the wheels folder
CIFAR10_PARTS = REPO / ".cifar10"
SCRATCH = Path(tempfile.gettempdir()) / "pretext_gpu_suite"
DATA = Path(tempfile.gettempdir()) / "pretext_data"

# pyproject's runtime dependencies that the GPU image lacks (device KINDS.md's package list; the
# others, and grain's own needs, are there): distribution -> import name.
MISSING_ON_GPU_IMAGE = {"grain": "grain", "array-record": "array_record",
                        "portpicker": "portpicker"}
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                   "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
MAX_WHEELS_MIB = 16  # of the 64 MiB a command carries
ENVIRONMENT_PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax",
                        "optax", "orbax-checkpoint", "grain", "array-record", "numpy", "torch",
                        "torchvision", "transformers")

# bench.throughput's workloads of the GPU table, headline first.
THROUGHPUT = ("bert_base", "electra_base", "xlnet_base", "simclr_resnet50", "simclr_cifar")
# The workloads `profile` traces by default: under their target in the last sitting
# (2026-11-28, H200: BERT-base 0.29x and ELECTRA-base 0.37x of torch compiled).
PROFILED = ("bert_base", "electra_base")
_TEXT_SMOKE = ("train.batch_size=8", "model.hidden_size=32", "model.num_layers=2",
               "model.num_heads=2", "model.intermediate_size=64", "model.vocab_size=512",
               "examples.max_seq_length=32")
# Each workload shrunk for the smoke: its preset, dtype and code paths, tiny sizes.
SMOKE_SIZES = {
    "bert_base": (*_TEXT_SMOKE, "examples.max_predictions_per_seq=5"),
    "electra_base": (*_TEXT_SMOKE, "examples.max_predictions_per_seq=5",
                     "model.embedding_size=32"),
    "xlnet_base": (*_TEXT_SMOKE, "examples.reuse_len=16", "examples.perm_size=16",
                   "examples.num_predict=5", "examples.num_streams=8", "model.reuse_len=16"),
    "simclr_resnet50": ("train.batch_size=8", "model.base_width=2", "objective.image_size=32",
                        "examples.host_crop_size=32"),
    "simclr_cifar": ("train.batch_size=8", "model.base_width=2"),
}
NO_DROPOUT = ("model.hidden_dropout=0.0", "model.attention_dropout=0.0")
BF16_CURVE_STEPS, BF16_CURVE_TOLERANCE = 30, 0.02
CIFAR10_FILES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5",
                 "test_batch", "batches.meta")
CIFAR10_TRAIN_IMAGES = 50_000
CIFAR10_EVAL_RESERVE_S = 150  # kNN and linear probe of the trained and the untrained backbone
# lightly's CIFAR-10 benchmark (cifar10_benchmark.py's table), 200 epochs, batch 512.
LIGHTLY_KNN = {"simclr": 0.848, "moco": 0.847, "byol": 0.868}


@dataclasses.dataclass(frozen=True)
class TorchReference:
    """A script of ../shared/bench, its arguments, and which of our workloads each of its JSON
    lines' `model` measures."""

    script: str
    args: tuple[str, ...]
    workloads: dict[str, str]


TORCH_REFERENCES = {
    "bert": TorchReference("torch_text.py", ("bert",), {"hf-bert-base": "bert_base"}),
    "electra": TorchReference("torch_text.py", ("electra",),
                              {"hf-electra-base(gen 1/3)": "electra_base"}),
    "xlnet": TorchReference("torch_text.py", ("xlnet",), {"hf-xlnet-base": "xlnet_base"}),
    "vision": TorchReference("torch_vision.py", (), {"tv-resnet50-simclr": "simclr_resnet50",
                                                     "tv-resnet18-simclr": "simclr_cifar"}),
}
ROOFLINE_SCRIPT = "jax_roofline.py"


# ---------------------------------------------------------------------------------- budget
@dataclasses.dataclass(frozen=True)
class Part:
    """One time-boxed step: at most `cap_s` seconds, skipped when fewer than `floor_s` are
    left for it; the parts before a `reserved` one leave its floor free."""

    name: str
    cap_s: float
    floor_s: float
    reserved: bool = False


def time_box(part: Part, remaining_s: float, later: Sequence[Part]) -> tuple[float | None, str]:
    """(seconds `part` may run, "") or (None, why it is skipped)."""
    kept = sum(p.floor_s for p in later if p.reserved)
    box = min(part.cap_s, remaining_s - kept)
    if box >= part.floor_s:
        return box, ""
    keeping = f", {kept:.0f} s of it kept for {', '.join(p.name for p in later if p.reserved)}"
    return None, (f"{max(remaining_s, 0):.0f} s of the budget left{keeping if kept else ''}; "
                  f"{part.name} needs at least {part.floor_s:.0f} s")


def run_plan(workloads: Sequence[str], references: Sequence[str]) -> list[Part]:
    """The parts of `run`, in order: environment, smoke, throughput, torch, roofline."""
    torch_parts = [Part(f"torch:{name}", 150 if name in ("bert", "vision") else 120, 60)
                   for name in references]
    return [Part("environment", 90, 10), Part("smoke", 150, 20),
            *(Part(f"throughput:{name}", 90, 30) for name in workloads), *torch_parts,
            Part("roofline", 40, 20, reserved=True)]


# ------------------------------------------------------------------------------ processes
@dataclasses.dataclass
class Completed:
    """A finished (or stopped) subprocess: exit status (None when stopped at its time box),
    its output lines and wall-clock seconds."""

    returncode: int | None
    lines: list[str]
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def tail(self, lines: int = 12) -> str:
        return "".join(self.lines[-lines:]).strip()[-2000:]


def stop_group(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the process group this suite started (a trainer checkpoints on it), SIGKILL
    after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_command(command: Sequence[str], env: dict[str, str], timeout_s: float, log: TextIO,
                grace_s: float = 10) -> Completed:
    """Runs `command` in the checkout root in a new process group, its output streamed to
    stdout and `log`; stopped (`stop_group`) after `timeout_s`."""
    started = time.monotonic()
    process = subprocess.Popen(list(command), cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, errors="replace",
                               start_new_session=True)
    lines: list[str] = []

    def pump() -> None:
        for line in process.stdout:
            lines.append(line)
            log.write(line)
            sys.stdout.write(line)
        log.flush()
        sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        returncode: int | None = process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(process, grace_s)
        returncode = None
    reader.join(grace_s)
    return Completed(returncode, lines, time.monotonic() - started)


def json_objects(lines: Sequence[str]) -> list[dict[str, Any]]:
    """The lines that are JSON objects."""
    found = []
    for line in lines:
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                found.append(value)
    return found


class Suite:
    """One sitting: the budget clock, the subprocesses' environment, and the output folder's
    `results.jsonl` (one line per result) and `suite.log`."""

    def __init__(self, out: Path, budget_s: float, command: str):
        self.started = time.monotonic()
        self.budget_s = budget_s
        self.command = command
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.results_path = out / "results.jsonl"
        self.results_path.write_text("")
        self.log = (out / "suite.log").open("w", encoding="utf-8")
        self.records: list[dict[str, Any]] = []
        self.env = dict(os.environ)

    def remaining(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def say(self, message: str) -> None:
        line = f"[gpu_suite {time.monotonic() - self.started:5.0f} s] {message}\n"
        sys.stdout.write(line)
        sys.stdout.flush()
        self.log.write(line)
        self.log.flush()

    def record(self, part: str, status: str, **fields: Any) -> dict[str, Any]:
        """Appends one result line ({"part", "status", ...}) to results.jsonl."""
        line = {"part": part, "status": status, **fields}
        self.records.append(line)
        with self.results_path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(line, default=str) + "\n")
        note = line.get("error") or line.get("reason") or ""
        self.say(f"{part}: {status}{' - ' + str(note).splitlines()[-1][:200] if note else ''}")
        return line

    def run_part(self, part: Part, later: Sequence[Part], command: Sequence[str],
                 to_record: Callable[[dict[str, Any]], dict[str, Any] | None],
                 grace_s: float = 10, env: dict[str, str] | None = None) -> None:
        """Runs `part`'s command in its time box (or records it as skipped); each JSON line it
        prints that `to_record` turns into a result is recorded, and a run that failed, timed
        out or gave no result adds an error line with the end of its output."""
        box, reason = time_box(part, self.remaining(), later)
        if box is None:
            self.record(part.name, "skipped", reason=reason)
            return
        self.say(f"{part.name}: starting, time box {box:.0f} s")
        done = run_command(command, env or self.env, box - grace_s, self.log, grace_s)
        recorded = 0
        for value in json_objects(done.lines):
            result = to_record(value)
            if result is not None:
                self.record(**{"seconds": round(done.seconds, 1), **result})
                recorded += 1
        if done.timed_out:
            self.record(part.name, "timeout", seconds=round(done.seconds, 1),
                        error=f"stopped at its time box of {box:.0f} s", tail=done.tail())
        elif done.returncode or not recorded:
            self.record(part.name, "error", seconds=round(done.seconds, 1),
                        returncode=done.returncode,
                        error=done.tail() or f"exit status {done.returncode}, no output")

    def close(self) -> None:
        self.log.close()


# -------------------------------------------------------------------------------- imports
def prepare_imports(suite: Suite, wheels: Path, scratch: Path) -> None:
    """Installs the wheels of `MISSING_ON_GPU_IMAGE` that this Python lacks from `wheels`
    (no index, no dependencies) into scratch/site, links scratch/shim/pretext_jax to the
    checkout, and puts both (and the checkout, for `bench`) first on the subprocesses'
    PYTHONPATH."""
    site, shim = scratch / "site", scratch / "shim"
    shim.mkdir(parents=True, exist_ok=True)
    link = shim / "pretext_jax"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(REPO, target_is_directory=True)
    missing = [dist for dist, module in MISSING_ON_GPU_IMAGE.items()
               if importlib.util.find_spec(module) is None]
    files = sorted(wheels.glob("*.whl"))
    if not missing:
        suite.record("install", "ok", installed=[], note="grain, array-record and portpicker "
                     "are importable already")
    elif not files:
        suite.record("install", "error", missing=missing,
                     error=f"{', '.join(missing)} missing and {wheels} has no wheels; run "
                           "`python -m bench.gpu_suite wheels` where pip reaches an index")
    else:
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                   "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site),
                   *map(str, files)]
        done = subprocess.run(command, capture_output=True, text=True)
        suite.record("install", "error" if done.returncode else "ok", missing=missing,
                     installed=[f.name for f in files],
                     **({"error": (done.stderr or done.stdout).strip()[-2000:]}
                        if done.returncode else {}))
    path = [str(shim), str(site), str(REPO), os.environ.get("PYTHONPATH", "")]
    suite.env |= {"PYTHONPATH": os.pathsep.join(p for p in path if p), "PYTHONUNBUFFERED": "1"}


# ---------------------------------------------------------------- workers (subprocesses)
def emit(line: dict[str, Any]) -> None:
    print(json.dumps(line, default=str), flush=True)


def guarded(part: str, check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """{"part", "status": "ok", "seconds", **check()}, or an error line with the exception
    (a workload's SystemExit for bad input included) and the end of its traceback."""
    started = time.perf_counter()
    try:
        fields = check()
        status = "ok"
    except (Exception, SystemExit) as error:  # every failure is a result line
        fields = {"error": f"{type(error).__name__}: {error}"[:2000],
                  "traceback": "".join(traceback.format_exc().splitlines(True)[-6:])[-2000:]}
        status = "error"
    return {"part": part, "status": status, "seconds": round(time.perf_counter() - started, 1),
            **fields}


def environment_worker() -> None:
    """Prints the environment line: Python, package versions, JAX's devices, where
    `pretext_jax` is imported from, and nvidia-smi's view of the GPU."""
    versions = {}
    for name in ENVIRONMENT_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue

    def describe() -> dict[str, Any]:
        import jax

        devices = jax.devices()
        smi = shutil.which("nvidia-smi")
        gpu = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30).stdout.strip() if smi else None
        return {"python": platform.python_version(), "packages": versions,
                "backend": jax.default_backend(), "device_kind": devices[0].device_kind,
                "device_count": len(devices), "jax": jax.__version__, "nvidia_smi": gpu,
                "pretext_jax": pretext_location()}

    emit(guarded("environment", describe))


def pretext_location() -> str:
    """The folder `pretext_jax` is imported from, or why it cannot be imported."""
    try:
        import pretext_jax.pretrain.trainer  # noqa: F401  (grain, array_record, orbax, ...)
    except Exception as error:  # reported in the environment line; the workloads fail too
        return f"not importable: {type(error).__name__}: {error}"
    return str(Path(sys.modules["pretext_jax"].__file__).parent)


def smoke_worker(workloads: Sequence[str], extra: dict[str, list[str]], steps: int) -> None:
    """One line per workload at its smoke size (`SMOKE_SIZES`, then `extra` overrides), then
    the GPU-only checks (skipped lines elsewhere). Peak memory is left out: the workloads share
    this process."""
    import jax

    from bench import throughput

    on_gpu = jax.default_backend() == "gpu"

    def workload(name: str) -> Callable[[], dict[str, Any]]:
        def check() -> dict[str, Any]:
            result = throughput.measure(name, [*SMOKE_SIZES.get(name, ()), *extra.get(name, [])],
                                        steps=steps, warmup=1)
            fields = {key: result.get(key) for key in (
                "workload", "device", "batch_size", "dtype", "compile_s", "step_ms", "loss",
                "state_donated")}
            if not math.isfinite(fields["loss"]):
                raise RuntimeError(f"non-finite loss {fields['loss']}")
            if on_gpu and not fields["state_donated"]:
                raise RuntimeError("the step did not free the state it was given (donation)")
            return fields
        return check

    for name in workloads:
        emit(guarded(f"smoke:{name}", workload(name)))
    checks = {"smoke:cudnn_attention": lambda: cudnn_attention_check(throughput),
              "smoke:bf16_loss_curve": lambda: bf16_curve_check(throughput)}
    for part, check in checks.items():
        emit(guarded(part, check) if on_gpu else {
            "part": part, "status": "skipped",
            "reason": f"needs a GPU (JAX backend: {jax.default_backend()})"})


def cudnn_attention_check(throughput: Any) -> dict[str, Any]:
    """A BERT smoke step with `attention_implementation=cudnn` (no attention dropout): its
    compiled program must call cuDNN's fused attention, and its loss be finite."""
    import jax

    config = throughput.workload_config("bert_base", [
        *SMOKE_SIZES["bert_base"], *NO_DROPOUT, "model.attention_implementation=cudnn"])
    trainer, batches = throughput.trainer_and_batches(config, 1)
    state = trainer.init_state()
    compiled = trainer._train_step.lower(state, batches[0]).compile()
    calls = sorted(set(re.findall(r"__cudnn\$\w+", compiled.as_text())))
    _, metrics = compiled(state, batches[0])
    loss = float(jax.device_get(metrics["loss"][0] / metrics["loss"][1]))
    if not any("fmha" in call for call in calls):
        raise RuntimeError(f"no cuDNN fused attention in the compiled step (cuDNN calls: {calls})")
    if not math.isfinite(loss):
        raise RuntimeError(f"non-finite loss {loss}")
    return {"cudnn_calls": calls, "loss": loss}


def bf16_curve_check(throughput: Any) -> dict[str, Any]:
    """BERT's smoke size in bf16 against the plain float32 path over `BF16_CURVE_STEPS` steps,
    from the same init on the same batches: within `BF16_CURVE_TOLERANCE` relative."""
    curves = throughput.loss_curves("bert_base", [*SMOKE_SIZES["bert_base"], *NO_DROPOUT],
                                    steps=BF16_CURVE_STEPS)
    difference = curves["max_relative_difference"]
    if not difference < BF16_CURVE_TOLERANCE:
        raise RuntimeError(f"bf16 loss curve departs from float32 by {difference:.4f} "
                           f"(> {BF16_CURVE_TOLERANCE})")
    return {"max_relative_difference": difference, "bf16_first_last": [
        curves["optimised"][0], curves["optimised"][-1]]}


# ---------------------------------------------------------------------------- the sitting
def throughput_record(name: str) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    def to_record(value: dict[str, Any]) -> dict[str, Any] | None:
        if value.get("workload") != name:
            return None
        return {"part": f"throughput:{name}", "status": "ok", **value}
    return to_record


def torch_record(name: str) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    def to_record(value: dict[str, Any]) -> dict[str, Any] | None:
        if "model" not in value:
            return None
        return {"part": f"torch:{name}", "status": "error" if "error" in value else "ok",
                **value}
    return to_record


def plain_record(part: str, key: str) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    """Records every JSON line that has `key` as a result of `part`."""
    def to_record(value: dict[str, Any]) -> dict[str, Any] | None:
        return {"part": part, "status": "ok", **value} if key in value else None
    return to_record


def worker_record(value: dict[str, Any]) -> dict[str, Any] | None:
    """The lines the suite's own workers print are results as they are."""
    return value if {"part", "status"} <= set(value) else None


def run_sitting(suite: Suite, args: argparse.Namespace, plan: list[Part]) -> None:
    """Runs `plan`'s parts in order."""
    python = sys.executable
    own = [python, "-m", "bench.gpu_suite"]
    scripts = args.wheels / REFERENCE_SCRIPTS
    sets = [f"--set={w}:{o}" for w, overrides in args.set.items() for o in overrides]
    for i, part in enumerate(plan):
        later = plan[i + 1:]
        kind, _, name = part.name.partition(":")
        if kind == "environment":
            suite.run_part(part, later, [*own, "environment"], worker_record)
        elif kind == "smoke":
            suite.run_part(part, later, [*own, "smoke-worker", f"--steps={args.smoke_steps}",
                                         *sets, "--", *args.workloads], worker_record)
        elif kind == "throughput":
            suite.run_part(part, later, [
                python, "-m", "bench.throughput", "--workload", name,
                "--markdown", str(suite.out / "throughput.md"), *args.set.get(name, [])],
                throughput_record(name))
        elif kind == "profile":
            suite.run_part(part, later, [
                python, "-m", "bench.profile_step", "--workload", name, "--out",
                str(suite.out), *args.set.get(name, [])], plain_record(part.name, "workload"))
        elif kind == "torch":
            reference = TORCH_REFERENCES[name]
            if not any(w in args.workloads for w in reference.workloads.values()):
                suite.record(part.name, "skipped", reason="none of its workloads was chosen")
            elif not (scripts / reference.script).is_file():
                suite.record(part.name, "error", error=f"{scripts / reference.script} not "
                             "found; `python -m bench.gpu_suite wheels` copies ../shared/bench")
            else:
                suite.run_part(part, later, [python, str(scripts / reference.script),
                                             *reference.args], torch_record(name))
        elif kind == "roofline":
            if (scripts / ROOFLINE_SCRIPT).is_file():
                suite.run_part(part, later, [python, str(scripts / ROOFLINE_SCRIPT)],
                               plain_record("roofline", "what"))
            else:
                suite.record(part.name, "error", error=f"{scripts / ROOFLINE_SCRIPT} not found")


# ------------------------------------------------------------------------------- summary
SMOKE_TABLE = report.Table("gpu_suite_smoke", (
    "workload", "status", "compile s", "step ms", "loss", "state donated", "note"))
RATIO_TABLE = report.Table("gpu_suite", (
    "workload", "ours per s", "torch eager per s", "torch compiled per s",
    "ours / torch compiled", "recorded reference per s", "ours / reference", "MFU",
    "compile s", "peak GiB", "state donated", "status"))


def _per_s(line: dict[str, Any]) -> float | None:
    return line.get("sequences_per_s") or line.get("images_per_s") or line.get("seq_per_s")


def _number(value: Any, digits: int = 0) -> str | None:
    return None if value is None else f"{value:,.{digits}f}"


def _note(line: dict[str, Any]) -> str | None:
    note = line.get("error") or line.get("reason")
    return str(note).splitlines()[-1][:160] if note else None


def machine_cell(records: Sequence[dict[str, Any]]) -> str:
    """This host (cores, memory, load) and the environment line's devices and JAX."""
    env = next((r for r in records if r["part"] == "environment" and r["status"] == "ok"), None)
    host = report.this_machine(devices=False)
    if env is None:
        return host
    return f"{host}, {env['device_count']} x {env['device_kind']}, jax {env['jax']}"


def torch_figures(records: Sequence[dict[str, Any]], workload: str) -> dict[bool, float]:
    """{compiled?: per second} of the torch reference lines that measure `workload`."""
    figures = {}
    for line in records:
        name = line["part"].removeprefix("torch:")
        if (line["part"].startswith("torch:") and line["status"] == "ok"
                and TORCH_REFERENCES[name].workloads.get(line.get("model")) == workload):
            figures[bool(line.get("compile"))] = _per_s(line)
    return figures


def ratio_row(records: Sequence[dict[str, Any]], workload: str) -> list:
    """RATIO_TABLE's cells of one workload."""
    lines = [r for r in records if r["part"] == f"throughput:{workload}"]
    ours = next((r for r in lines if r["status"] == "ok"), {})
    torch = torch_figures(records, workload)
    per_s, compiled, reference = _per_s(ours), torch.get(True), ours.get("reference_per_s")
    return [workload, _number(per_s), _number(torch.get(False)), _number(compiled),
            f"{per_s / compiled:.2f}" if per_s and compiled else None, _number(reference),
            f"{per_s / reference:.2f}" if per_s and reference else None,
            f"{ours['mfu']:.3f}" if ours.get("mfu") else None, _number(ours.get("compile_s"), 1),
            _number(ours.get("peak_memory_gib"), 1), ours.get("state_donated"),
            ", ".join(r["status"] for r in lines) or "-"]


def summary_markdown(records: Sequence[dict[str, Any]], workloads: Sequence[str], command: str,
                     machine: str) -> str:
    """summary.md: the smoke table, the ratio table (when workloads were timed), CIFAR-10
    results, every other part that was skipped or failed, and the roofline's figures."""
    lines: list[str] = []
    smoke = [r for r in records if r["part"].startswith("smoke:")]
    if smoke:
        lines += ["## Smoke", "", SMOKE_TABLE.header()]
        lines += [SMOKE_TABLE.row([
            r["part"].removeprefix("smoke:"), r["status"], r.get("compile_s"), r.get("step_ms"),
            r.get("loss"), r.get("state_donated"), _note(r)], command, machine) for r in smoke]
    if any(r["part"].startswith("throughput:") for r in records):
        lines += ["", "## Throughput: ours / torch, same sitting", "", RATIO_TABLE.header()]
        lines += [RATIO_TABLE.row(ratio_row(records, name), command, machine)
                  for name in workloads]
    for r in records:
        if r["part"].startswith("cifar10:") and r["status"] == "ok":
            lines += ["", f"## {r['part']}", "",
                      f"kNN (k 200) {r['knn_accuracy_k200']:.4f}, linear probe "
                      f"{r['linear_probe_accuracy']:.4f} after {r['steps']} steps of "
                      f"{r['batch_size']}; lightly's kNN: {r.get('lightly_knn') or '-'}; "
                      f"{r.get('note', '')}"]
        if r["part"].startswith("semi:") and r["status"] == "ok":
            lines += ["", f"## {r['part']}", "",
                      f"top-1 {r['top1_pretrained']:.4f} from the pre-trained backbone, "
                      f"{r['top1_random_init']:.4f} from its random initialisation, majority "
                      f"class {r['majority_class']:.4f}, on {r['label_fraction']:.0%} of the "
                      f"labels ({r['steps']} steps of {r['batch_size']}); {r.get('note', '')}"]
    problems = [r for r in records if r["status"] != "ok" and not r["part"].startswith("smoke:")]
    if problems:
        lines += ["", "## Skipped, stopped and failed", ""]
        lines += [f"- {r['part']}: {r['status']}: {_note(r) or '-'}" for r in problems]
    roofline = [r for r in records if r["part"] == "roofline" and "what" in r]
    if roofline:
        lines += ["", "## Roofline (jax_roofline.py)", ""]
        lines += [f"- {r['what']}: " + ", ".join(f"{k} {v:,.1f}" for k, v in r.items()
                                                 if isinstance(v, float)) for r in roofline]
    return "\n".join(lines).strip() + "\n"


def finish(suite: Suite, workloads: Sequence[str]) -> None:
    """Writes summary.md and prints it last (the device reply shows the end of the output)."""
    text = summary_markdown(suite.records, workloads, suite.command, machine_cell(suite.records))
    (suite.out / "summary.md").write_text(text, encoding="utf-8")
    suite.say(f"done in {time.monotonic() - suite.started:.0f} s of {suite.budget_s:.0f}; "
              f"results in {suite.out}")
    print(text, flush=True)
    suite.close()


# -------------------------------------------------------------------------------- wheels
def stage_wheels(dest: Path, shared: Path, python_version: str, cifar10: bool) -> int:
    """`wheels`: the GPU image's missing wheels at the versions installed here, the reference
    scripts, optionally the CIFAR-10 parts; prints what it wrote and returns the exit status."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    problems = []
    tag = f"cp{python_version.replace('.', '')}"
    for dist in MISSING_ON_GPU_IMAGE:
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{dist} is not installed here, so there is no version to pin; "
                            "install the project first (pip install -e '.[test]')")
            continue
        done = subprocess.run([
            sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
            "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
            *(f"--platform={p}" for p in WHEEL_PLATFORMS), "-d", str(dest),
            f"{dist}=={version}"], capture_output=True, text=True)
        if done.returncode:
            reason = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
            problems.append(f"no {tag} manylinux x86_64 wheel of {dist}=={version} obtainable "
                            f"here ({reason}); the GPU machine cannot import pretext_jax "
                            "without it")
    references = dest / REFERENCE_SCRIPTS
    shutil.rmtree(references, ignore_errors=True)
    if (shared / "bench").is_dir():
        references.mkdir()
        for source in sorted((shared / "bench").glob("*")):
            if source.suffix in (".py", ".md"):
                shutil.copyfile(source, references / source.name)
    else:
        problems.append(f"{shared / 'bench'} not found: the torch references and the roofline "
                        "will be recorded as errors")
    files = sorted(p for p in dest.rglob("*") if p.is_file())
    for path in files:
        print(f"{path.stat().st_size / 2**20:8.2f} MiB  {path.relative_to(REPO)}")
    total = sum(p.stat().st_size for p in files) / 2**20
    print(f"{total:8.2f} MiB  total in {dest} (travels with carry=['{dest.name}'])")
    if total > MAX_WHEELS_MIB:
        problems.append(f"{dest} holds {total:.1f} MiB, over {MAX_WHEELS_MIB} MiB")
    if cifar10:
        problems += copy_cifar10_parts(shared / "data" / "cifar10", CIFAR10_PARTS)
    for problem in problems:
        print(f"MISSING: {problem}")
    return 1 if problems else 0


def copy_cifar10_parts(source: Path, dest: Path) -> list[str]:
    """Copies part1..3 of the shared CIFAR-10 (59 MiB each) to `dest`; returns problems."""
    parts = sorted(p for p in source.glob("part*") if p.is_dir())
    if not parts:
        return [f"{source} has no part1..3"]
    for part in parts:
        (dest / part.name).mkdir(parents=True, exist_ok=True)
        for path in sorted(part.iterdir()):
            target = dest / part.name / path.name
            if not target.is_file() or target.stat().st_size != path.stat().st_size:
                shutil.copyfile(path, target)
        size = sum(p.stat().st_size for p in (dest / part.name).iterdir()) / 2**20
        print(f"{size:8.2f} MiB  {(dest / part.name).relative_to(REPO)} (one command each: "
              f"carry=['{dest.name}/{part.name}'])")
    return []


# ------------------------------------------------------------------------------ CIFAR-10
def missing_cifar10_files(folder: Path) -> list[str]:
    return [name for name in CIFAR10_FILES if not any(folder.rglob(name))]


def stage_cifar10(part: Path, data: Path) -> int:
    """`cifar10-stage`: copies one carried part folder to data/cifar10/<part> and says which of
    the seven files are still missing."""
    if not part.is_dir():
        raise SystemExit(f"{part} is not a folder; carry one of .cifar10/part1..3")
    target = data / "cifar10" / part.name
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(part.iterdir()):
        shutil.copyfile(path, target / path.name)
    missing = missing_cifar10_files(data / "cifar10")
    print(f"staged {part} in {target}; " + (f"still missing: {', '.join(missing)}" if missing
                                            else "all seven CIFAR-10 files are staged"))
    return 0


def run_cifar10(suite: Suite, args: argparse.Namespace) -> None:
    """`cifar10`: pre-trains `<method>_cifar10` at batch `--batch-size` for `--epochs` with
    `bench.image_cifar10 --recipe` until its time box, resuming the workdir, then evaluates."""
    method, data = args.method, args.data
    part = f"cifar10:{method}"
    missing = missing_cifar10_files(data / "cifar10")
    if missing:
        suite.record(part, "error", error=f"{data / 'cifar10'} lacks {', '.join(missing)}; "
                     "stage the three parts first (cifar10-stage, one command per part)")
        return
    suite.run_part(Part("environment", 90, 10), [], [sys.executable, "-m", "bench.gpu_suite",
                                                     "environment"], worker_record)
    steps = args.epochs * CIFAR10_TRAIN_IMAGES // args.batch_size
    remaining = suite.remaining()
    train_s = remaining - CIFAR10_EVAL_RESERVE_S
    workdir = args.workdir or args.scratch / f"cifar10_{method}"
    command = [sys.executable, "-m", "bench.image_cifar10", "--preset", f"{method}_cifar10",
               "--recipe", "--steps", str(steps), "--workdir", str(workdir),
               "--train-seconds", f"{max(train_s, 0):.0f}",
               "--markdown", str(suite.out / "image_cifar10.md"),
               f"train.batch_size={args.batch_size}", "train.progress=false",
               "train.log_every=200", "train.checkpoint_every=2000",
               "train.records_in_device_memory=true", *args.set]

    def to_record(value: dict[str, Any]) -> dict[str, Any] | None:
        if value.get("benchmark") != "image_cifar10":
            return None
        if value.get("stopped_by"):
            return {"part": part, "status": "stopped", **value,
                    "reason": f"stopped at step {value['step']} of {value['steps']} with a "
                              "checkpoint; run the same command again on this warm machine"}
        return {"part": part, "status": "ok", "lightly_knn": LIGHTLY_KNN.get(method), **value}

    suite.run_part(Part(part, remaining, CIFAR10_EVAL_RESERVE_S + 30), [], command, to_record,
                   grace_s=60, env=suite.env | {"PRETEXT_SHARED_DATA": str(data)})


def run_semi(suite: Suite, args: argparse.Namespace) -> None:
    """`semi`: `bench.semi_cifar10` from the finished CIFAR-10 pre-training in `--init`, one
    row per label fraction, within the budget (an interrupted run resumes its workdirs)."""
    init = args.init or args.scratch / "cifar10_simclr"
    missing = missing_cifar10_files(args.data / "cifar10")
    if missing or not (init / "config.json").is_file():
        suite.record("semi", "error", error=(
            f"{args.data / 'cifar10'} lacks {', '.join(missing)}; stage the parts first"
            if missing else f"{init} holds no pre-training run; run `cifar10 --method simclr` "
            "first (or give --init)"))
        return
    command = [sys.executable, "-m", "bench.semi_cifar10", "--init", str(init),
               "--workdir", str(args.scratch / "semi"), "--markdown",
               str(suite.out / "semi_cifar10.md"), "train.progress=false", *args.set]

    def to_record(value: dict[str, Any]) -> dict[str, Any] | None:
        if value.get("benchmark") != "semi_cifar10":
            return None
        return {"part": f"semi:{value['label_fraction']:g}", "status": "ok", **value}

    suite.run_part(Part("semi", suite.remaining(), 60), [], command, to_record, grace_s=30,
                   env=suite.env | {"PRETEXT_SHARED_DATA": str(args.data)})


# ---------------------------------------------------------------------------------- CLI
def workload_overrides(values: Sequence[str]) -> dict[str, list[str]]:
    """`WORKLOAD:key=value` arguments as {workload: [key=value, ...]}."""
    found: dict[str, list[str]] = {}
    for value in values:
        workload, colon, override = value.partition(":")
        if not colon or "=" not in override:
            raise SystemExit(f"--set {value!r}: write WORKLOAD:section.key=value, e.g. "
                             "bert_base:model.attention_implementation=cudnn")
        found.setdefault(workload, []).append(override)
    return found


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog="python -m bench.gpu_suite",
                                   description=__doc__.split("\n\n")[0])
    modes = main.add_subparsers(dest="mode", required=True)

    def sitting(name: str, help_text: str) -> argparse.ArgumentParser:
        mode = modes.add_parser(name, help=help_text)
        mode.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or
                                                           "runs/gpu_suite"),
                          help="results folder (default $OUT, else runs/gpu_suite)")
        mode.add_argument("--budget", type=float, default=540.0,
                          help="seconds for the whole command (default %(default)s)")
        mode.add_argument("--wheels", type=Path, default=WHEELS,
                          help="the folder `wheels` filled (default .whl)")
        mode.add_argument("--scratch", type=Path, default=SCRATCH,
                          help="installed wheels, the import link, workdirs (default "
                               "%(default)s)")
        return mode

    for name, help_text in (("run", "the whole sitting (default)"),
                            ("smoke", "the environment and smoke parts alone"),
                            ("profile", "step profiles (bench.profile_step) of --workloads")):
        mode = sitting(name, help_text)
        mode.add_argument("--workloads", nargs="+",
                          default=list(PROFILED if name == "profile" else THROUGHPUT),
                          help="bench.throughput workloads (default: the five of the GPU "
                               "table; for profile, those under their target last time)")
        mode.add_argument("--set", action="append", default=[], metavar="WORKLOAD:KEY=VALUE",
                          help="an override for one workload (smoke and throughput)")
        mode.add_argument("--smoke-steps", type=int, default=2)
        if name == "run":
            mode.add_argument("--references", nargs="*", default=list(TORCH_REFERENCES),
                              choices=list(TORCH_REFERENCES),
                              help="torch references, in order, while time is left")
    cifar = sitting("cifar10", "a CIFAR-10 reproduction (resumes its workdir)")
    cifar.add_argument("--method", required=True, choices=("simclr", "moco", "byol"))
    cifar.add_argument("--epochs", type=int, default=200)
    cifar.add_argument("--batch-size", type=int, default=512)
    cifar.add_argument("--data", type=Path, default=DATA,
                       help="holds cifar10/ (default %(default)s, where cifar10-stage copies)")
    cifar.add_argument("--workdir", type=Path, default=None,
                       help="default <scratch>/cifar10_<method>")
    cifar.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    semi = sitting("semi", "1 %% and 10 %% label fine-tuning of the CIFAR-10 run (resumes)")
    semi.add_argument("--init", type=Path, default=None,
                      help="the pre-training workdir (default <scratch>/cifar10_simclr)")
    semi.add_argument("--data", type=Path, default=DATA,
                      help="holds cifar10/ (default %(default)s, where cifar10-stage copies)")
    semi.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    wheels = modes.add_parser("wheels", help="here: fill .whl/ for the GPU machine")
    wheels.add_argument("--dest", type=Path, default=WHEELS)
    wheels.add_argument("--shared", type=Path, default=SHARED,
                        help="the shared folder holding bench/ and data/cifar10/")
    wheels.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    wheels.add_argument("--cifar10", action="store_true",
                        help="also copy the CIFAR-10 parts into .cifar10/")
    stage = modes.add_parser("cifar10-stage", help="GPU machine: copy one carried part")
    stage.add_argument("part", type=Path)
    stage.add_argument("--data", type=Path, default=DATA)
    modes.add_parser("environment", help="internal: the environment line")
    worker = modes.add_parser("smoke-worker", help="internal: the smoke part's process")
    worker.add_argument("--steps", type=int, default=2)
    worker.add_argument("--set", action="append", default=[])
    worker.add_argument("workloads", nargs="*")
    return main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["run", *argv]
    args = parser().parse_args(argv)
    if args.mode == "wheels":
        return stage_wheels(args.dest, args.shared, args.python_version, args.cifar10)
    if args.mode == "cifar10-stage":
        return stage_cifar10(args.part, args.data)
    if args.mode == "environment":
        environment_worker()
        return 0
    if args.mode == "smoke-worker":
        smoke_worker(args.workloads, workload_overrides(args.set), args.steps)
        return 0
    if args.budget <= 0:
        raise SystemExit(f"--budget {args.budget} must be positive seconds, e.g. 540")
    if args.mode in ("run", "smoke", "profile"):
        args.set = workload_overrides(args.set)
        if args.smoke_steps < 1:
            raise SystemExit("--smoke-steps must be at least 1")
    suite = Suite(args.out, args.budget, report.command_line("bench.gpu_suite", argv))
    prepare_imports(suite, args.wheels, args.scratch)
    if args.mode in ("cifar10", "semi"):
        (run_cifar10 if args.mode == "cifar10" else run_semi)(suite, args)
        finish(suite, [])
        return 0
    plan = (run_plan(args.workloads, args.references) if args.mode == "run" else
            [Part("environment", 90, 10), *(Part(f"profile:{name}", 150, 40)
                                           for name in args.workloads)]
            if args.mode == "profile" else
            [Part("environment", 90, 10), Part("smoke", args.budget, 20)])
    run_sitting(suite, args, plan)
    finish(suite, args.workloads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
