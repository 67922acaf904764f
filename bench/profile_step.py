"""Where a workload's training step spends its time: a JAX profiler trace of a few compiled
steps, summed per kernel and per kind of kernel, each kernel named by the JAX operation it
comes from (issue 32: a profile of every row under its target, and its cause).

    python -m bench.profile_step --workload bert_base [--steps 4] [--out DIR] [key=value ...]

The step is `bench.throughput`'s (the trainer's compiled step on synthetic device batches);
after two warm-up steps `--steps` steps run under `jax.profiler.trace`. The trace's events that
belong to an XLA operation (those with an `hlo_op` argument: GPU kernels on the device's
streams, or XLA:CPU's thunks on the host) are summed by name per step. Each kernel's name is
that of its HLO instruction (`input_scatter_fusion_2` for `input_scatter_fusion.2`), and the
compiled program's metadata gives the JAX operation it comes from (`op_name`, e.g.
`jit(_step)/transpose(jvp(jit(_take)))/scatter-add`: the gradient of an embedding lookup).
Kinds: matrix products (cuBLAS / nvjet / Triton GEMM / dot or convolution fusions), scatter,
copies, dynamic-update-slice (scan outputs), reductions, transposes, other fusions.

Written to `--out` (default runs/profile): `profile_<workload>.md` (the kinds and the top
kernels, with the command, machine and date) and `profile_<workload>.trace.json.gz` (the raw
trace, for Perfetto or TensorBoard), the markdown also printed.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

from bench import report, throughput

KINDS = (  # (kind, pattern on the kernel's name), first match wins
    ("scatter", re.compile(r"scatter")),
    ("matrix product", re.compile(r"nvjet|gemm|cublas|cutlass|dot|conv(?!ert)|matmul|xmma")),
    ("copy", re.compile(r"memcpy|memset|copy")),
    ("dynamic-update-slice", re.compile(r"dynamic_update_slice|dynamic-update-slice")),
    ("reduction", re.compile(r"reduce")),
    ("transpose", re.compile(r"transpose")),
)


WEIGHT_GRADIENT = "convolution weight gradient"


def is_kernel_shaped(dims: tuple[int, ...]) -> bool:
    """A convolution kernel's shape as XLA:CPU lays out its gradient: [out, k, k, in], k <= 7."""
    return len(dims) == 4 and dims[1] == dims[2] and 1 <= dims[1] <= 7


def kind_of(kernel: str, op_name: str = "", dims: tuple[int, ...] = ()) -> str:
    """The kind of a kernel by its name (`KINDS`), else by the last step of its JAX operation
    (XLA:CPU's `ynn_fusion` of a `dot_general`), else "other fusion". XLA:CPU's `ynn_fusion`s
    that compute a convolution's weight gradient carry no `op_name`; an output `dims` of a
    kernel's shape names them (`WEIGHT_GRADIENT`)."""
    if not op_name and "ynn_fusion" in kernel and is_kernel_shaped(dims):
        return WEIGHT_GRADIENT
    for name in (kernel.lower(), op_name.rsplit("/", 1)[-1].lower()):
        kind = next((kind for kind, pattern in KINDS if name and pattern.search(name)), None)
        if kind:
            return kind
    return "other fusion"


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name (dots as underscores, as kernels are named) -> the `op_name` of its
    metadata, from a compiled program's text."""
    names = {}
    for match in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name=\"([^\"]+)\"", hlo_text,
                             re.MULTILINE):
        names[plain(match.group(1))] = match.group(2)
    return names


def plain(name: str) -> str:
    """An instruction or kernel name with dots and dashes as underscores (GPU kernels are
    named so; XLA:CPU's keep the instruction's own name)."""
    return name.replace(".", "_").replace("-", "_")


def output_dims(hlo_text: str) -> dict[str, tuple[int, ...]]:
    """HLO instruction name (as `plain`) -> the dimensions of its (array) output."""
    return {plain(match.group(1)): tuple(int(d) for d in match.group(2).split(",") if d)
            for match in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = \w+\[([\d,]*)\]",
                                     hlo_text, re.MULTILINE)}


def kernel_times(trace: dict[str, Any]) -> dict[str, tuple[float, int]]:
    """Kernel name -> (total microseconds, count) over a Chrome trace's events of XLA
    operations: on the device processes where there are any (`/device:...`), else on the host
    (XLA:CPU)."""
    processes = {event["pid"]: event["args"]["name"] for event in trace["traceEvents"]
                 if event.get("ph") == "M" and event.get("name") == "process_name"}
    devices = {pid for pid, name in processes.items() if name.startswith("/device:")}
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for event in trace["traceEvents"]:
        if event.get("ph") != "X" or "hlo_op" not in event.get("args", {}):
            continue
        if devices and event["pid"] not in devices:
            continue
        totals[event["name"]][0] += float(event["dur"])
        totals[event["name"]][1] += 1
    return {name: (total, int(count)) for name, (total, count) in totals.items()}


def summarize(times: dict[str, tuple[float, int]], steps: int, names: dict[str, str],
              top: int = 25, dims: dict[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    """Per-step milliseconds by kind and for the `top` kernels (with their op names);
    `dims`: each instruction's output dimensions (`output_dims`), which name XLA:CPU's
    weight-gradient fusions."""
    dims = dims or {}

    def kind(kernel: str) -> str:
        return kind_of(kernel, names.get(plain(kernel), ""), dims.get(plain(kernel), ()))

    kinds: dict[str, float] = collections.Counter()
    for kernel, (total, _) in times.items():
        kinds[kind(kernel)] += total / steps / 1e3
    ranked = sorted(times.items(), key=lambda item: -item[1][0])[:top]
    return {
        "step_kernel_ms": sum(total for total, _ in times.values()) / steps / 1e3,
        "kinds": dict(sorted(kinds.items(), key=lambda item: -item[1])),
        "kernels": [{"kernel": kernel, "ms_per_step": total / steps / 1e3,
                     "calls_per_step": count / steps,
                     "kind": kind(kernel),
                     "op_name": names.get(plain(kernel), "")}
                    for kernel, (total, count) in ranked],
    }


def markdown(name: str, summary: dict[str, Any], command: str) -> str:
    """The summary as the markdown that `profile_<workload>.md` holds."""
    lines = [f"# Step profile: {name}", "",
             f"{report.this_machine()}, {time.strftime('%Y-%m-%d')}: `{command}`", "",
             f"Kernel time per step: {summary['step_kernel_ms']:.2f} ms", "",
             "| kind | ms per step | share |", "| --- | --- | --- |"]
    total = summary["step_kernel_ms"] or 1.0
    lines += [f"| {kind} | {ms:.2f} | {ms / total:.0%} |" for kind, ms in summary["kinds"].items()]
    lines += ["", "| kernel | ms per step | calls per step | kind | JAX operation |",
              "| --- | --- | --- | --- | --- |"]
    lines += [f"| {k['kernel']} | {k['ms_per_step']:.3f} | {k['calls_per_step']:g} | "
              f"{k['kind']} | `{k['op_name'][:120]}` |" for k in summary["kernels"]]
    return "\n".join(lines) + "\n"


def profile(name: str, overrides: list[str], steps: int, out: Path) -> dict[str, Any]:
    """Traces `steps` compiled steps of workload `name` and writes its summary and trace."""
    config = throughput.workload_config(name, overrides)
    trainer, batches = throughput.trainer_and_batches(config, 2)
    state = trainer.init_state()
    compiled = trainer._train_step.lower(state, batches[0]).compile()
    for step in range(2):
        state, _ = compiled(state, batches[step % 2])
    jax.block_until_ready(state)
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            for step in range(steps):
                state, metrics = compiled(state, batches[step % 2])
            jax.block_until_ready((state, metrics))
        traces = sorted(Path(folder).rglob("*.trace.json.gz"))
        if not traces:
            raise SystemExit(f"the profiler wrote no trace.json.gz under {folder}")
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(traces[-1], out / f"profile_{name}.trace.json.gz")
    with gzip.open(out / f"profile_{name}.trace.json.gz") as file:
        trace = json.load(file)
    hlo = compiled.as_text()
    summary = summarize(kernel_times(trace), steps, op_names(hlo), dims=output_dims(hlo))
    return {"workload": name, "steps": steps, "device": jax.devices()[0].device_kind,
            **summary}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", action="append", required=True,
                        help=f"one of {sorted(throughput.WORKLOADS)}; repeat for several")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="runs/profile")
    parser.add_argument("overrides", nargs="*", help="section.key=value for every workload")
    args = parser.parse_args(argv)
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    command = report.command_line("bench.profile_step", argv)
    for name in args.workload:
        summary = profile(name, args.overrides, args.steps, Path(args.out))
        text = markdown(name, summary, command)
        (Path(args.out) / f"profile_{name}.md").write_text(text)
        print(text, flush=True)
        print(json.dumps({k: v for k, v in summary.items() if k != "kernels"}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
