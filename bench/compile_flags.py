"""XLA:CPU flags against the compile and step time of the test suite's tiny workloads: the
evidence for the flags `tests/conftest.py` sets (compiling is over half the suite's time).

    python -m bench.compile_flags [--candidate FLAGS ...] [--workload bert_tiny ...]
        [--repeats 2]

Every candidate (default: the suite's flags as they are, and the same with XLA:CPU's MLIR
fusion emitters back on) runs each workload of `bench.throughput` in a fresh process, with the
suite's XLA flags (`tests/conftest.py`) plus the candidate's, the persistent compile cache off:
once on one CPU device and once on 8 fake devices as the (2, 2, 2) mesh. The candidates take
turns `--repeats` times (the machine's load drifts); one Markdown row per candidate
(`bench.report`): the median over repeats of the summed compile seconds of the step, and of
the summed step milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import report

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = ("bert_tiny", "xlnet_tiny", "simclr_tiny")
MESHES = {"single": (1, (1, 1, 1)), "mixed": (8, (2, 2, 2))}
CANDIDATES = ("", "--xla_cpu_use_fusion_emitters=true")  # the suite's flags; emitters on
TABLE = report.Table("compile_flags", (
    "extra XLA flags", "workloads", "compile s (sum)", "step ms (sum)", "repeats"))


def suite_flags() -> str:
    """XLA_FLAGS as tests/conftest.py sets them (its module-level set-up, run here)."""
    saved = os.environ.get("XLA_FLAGS")
    try:
        runpy.run_path(str(REPO / "tests" / "conftest.py"))
        return os.environ["XLA_FLAGS"]
    finally:
        if saved is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = saved


def measure_here(workload: str, mesh: tuple[int, int, int]) -> dict[str, float]:
    """In this process (its flags already set): the workload's step compiled and timed."""
    import jax

    from bench import throughput

    jax.config.update("jax_enable_compilation_cache", False)
    result = throughput.measure(workload, [f"mesh.{axis}={size}" for axis, size in
                                           zip(("data", "fsdp", "tensor"), mesh, strict=True)],
                                steps=10, warmup=2)
    return {"compile_s": result["compile_s"], "step_ms": result["step_ms"]}


def run_one(flags: str, workload: str, devices: int, mesh: tuple[int, int, int]
            ) -> dict[str, float]:
    """`measure_here` in a fresh process: the suite's flags, then the candidate's and
    `devices` (XLA takes the last setting of a flag)."""
    env = {key: value for key, value in os.environ.items()
           if key != "JAX_COMPILATION_CACHE_DIR"}  # conftest's, set by `suite_flags`
    env = {**env, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": " ".join([suite_flags(), flags,
                                  f"--xla_force_host_platform_device_count={devices}"])}
    code = ("import json, sys; from bench.compile_flags import measure_here; "
            f"print(json.dumps(measure_here({workload!r}, {tuple(mesh)!r})))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidate", action="append", default=None,
                        help="extra XLA flags to try (repeat; default: none, and the MLIR "
                             "fusion emitters on)")
    parser.add_argument("--workload", action="append", default=None,
                        help=f"of bench.throughput (default: {', '.join(WORKLOADS)})")
    parser.add_argument("--repeats", type=int, default=2)
    report.add_markdown_argument(parser, "compile_flags")
    args = parser.parse_args(argv)
    candidates = args.candidate or list(CANDIDATES)
    workloads = args.workload or list(WORKLOADS)
    totals: dict[str, list[tuple[float, float]]] = {flags: [] for flags in candidates}
    for repeat in range(args.repeats):
        for flags in candidates:
            started = time.perf_counter()
            runs = [run_one(flags, workload, devices, mesh) for workload in workloads
                    for devices, mesh in MESHES.values()]
            totals[flags].append((sum(r["compile_s"] for r in runs),
                                  sum(r["step_ms"] for r in runs)))
            print(f"repeat {repeat + 1}, flags {flags or '(suite)'}: compile "
                  f"{totals[flags][-1][0]:.1f} s, steps {totals[flags][-1][1]:.1f} ms "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    results = []
    for flags, values in totals.items():
        row = {"flags": flags or "(the suite's)", "compile_s": statistics.median(
            v[0] for v in values), "step_ms": statistics.median(v[1] for v in values)}
        results.append(row)
        report.write_row(TABLE, [row["flags"], ", ".join(workloads), round(row["compile_s"], 1),
                                 round(row["step_ms"], 1), args.repeats],
                         report.command_line("bench.compile_flags", argv), args.markdown)
    return results


if __name__ == "__main__":
    main()
