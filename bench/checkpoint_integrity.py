"""The cost of sealing and verifying checkpoints (`pretrain.integrity`), per GB.

    python -m bench.checkpoint_integrity [--gigabytes 1.0] [--workdir /tmp/bench_ckpt]

Saves a state of random float32 arrays (64 MB each) with Orbax as the trainer does, then times
`integrity.seal` (CRC-32 of every file, once per checkpoint after it is finished),
`integrity.verify` (before every restore) and the Orbax restore itself, and prints one JSON
line with seconds and seconds per GB, and the Markdown row of docs/benchmarks.md ("Checkpoint
integrity"). The files are read back from the page cache when memory
allows, so this is the CPU cost of the checksums; from a cold disk add the read time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp

from bench import report
from pretext_jax.pretrain import integrity

TABLE = report.Table("checkpoint_integrity", (
    "GB", "seal s/GB", "verify s/GB", "Orbax restore s/GB"))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--workdir", default="/tmp/bench_ckpt")
    report.add_markdown_argument(parser, "checkpoint_integrity")
    args = parser.parse_args(argv)
    root = Path(args.workdir).absolute()
    shutil.rmtree(root, ignore_errors=True)
    rng = np.random.default_rng(0)
    leaves = max(1, round(args.gigabytes * 16))  # 64 MB leaves
    state = {f"w{i}": rng.standard_normal(16 << 20, dtype=np.float32) for i in range(leaves)}
    size_gb = sum(a.nbytes for a in state.values()) / 1e9
    checkpointer = ocp.StandardCheckpointer()
    start = time.perf_counter()
    checkpointer.save(root / "step", state)
    checkpointer.wait_until_finished()
    save_s = time.perf_counter() - start
    timings = {}
    for name, action in (("seal", lambda: integrity.seal(root / "step")),
                         ("verify", lambda: integrity.verify(root / "step")),
                         ("restore", lambda: checkpointer.restore(root / "step"))):
        start = time.perf_counter()
        result = action()
        timings[name] = time.perf_counter() - start
        assert name != "verify" or result is None, result
    result = {"benchmark": "checkpoint_integrity", "gigabytes": round(size_gb, 3),
              "save_s": round(save_s, 2),
              **{f"{k}_s": round(v, 2) for k, v in timings.items()},
              **{f"{k}_s_per_gb": round(v / size_gb, 2) for k, v in timings.items()}}
    print(json.dumps(result))
    shutil.rmtree(root, ignore_errors=True)
    report.write_row(TABLE, [f"{size_gb:.3f}", *(f"{result[f'{k}_s_per_gb']:.2f}"
                                                  for k in ("seal", "verify", "restore"))],
                     report.command_line("bench.checkpoint_integrity", argv), args.markdown,
                     devices=False)
    return result


if __name__ == "__main__":
    main()
