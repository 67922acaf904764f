"""A training process for the chaos tests: `python resilience_worker.py SPEC WORKDIR LOG`.

SPEC is JSON `{"preset": name, "overrides": {"section.key": value}}`. It trains
`Trainer(config, workdir)` to the end (resuming like run.py) and appends one line per
executed step to LOG: the step and a digest of the batch it consumed, flushed to disk before
the step runs, so a kill at any point leaves a record of exactly what was read.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402

# The test process's persistent compilation cache, read only: its in-process reference run has
# compiled the same programs (same XLA_FLAGS, so the same keys), and a worker never writes an
# entry (a kill while writing one would leave it truncated for the next process to load).
if os.environ.get("PRETEXT_TEST_CACHE_DIR"):
    jax.config.update("jax_compilation_cache_dir", os.environ["PRETEXT_TEST_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))

from pretext_jax import objectives  # noqa: E402, F401  (registers the methods)
from pretext_jax.pretrain.config import make_config  # noqa: E402
from pretext_jax.pretrain.trainer import Trainer  # noqa: E402


def main(spec: str, workdir: str, log_path: str) -> None:
    settings = json.loads(spec)
    trainer = Trainer(make_config(settings["preset"], settings["overrides"]), workdir)
    step_fn = trainer.train_step

    def logged_step(state, local_batch):
        step = int(jax.device_get(state.step)) + 1
        digest = hashlib.sha1(b"".join(local_batch[k].tobytes()
                                       for k in sorted(local_batch))).hexdigest()
        with open(log_path, "a") as log:
            log.write(f"{step} {digest}\n")
            log.flush()
            os.fsync(log.fileno())
        return step_fn(state, local_batch)

    trainer.train_step = logged_step
    summary = trainer.run()
    print(json.dumps({"step": summary["step"], "stopped_by": summary["stopped_by"]}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
