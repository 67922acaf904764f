"""A training process for the chaos tests: `python resilience_worker.py SPEC WORKDIR LOG`.

SPEC is JSON `{"preset": name, "overrides": {"section.key": value}}`. It trains
`Trainer(config, workdir)` to the end (resuming like run.py) and appends one line per
executed step to LOG: the step and a digest of the batch it consumed, flushed to disk before
the step runs, so a kill at any point leaves a record of exactly what was read.

In a test's own process, `main(..., kill_at=step)` stands in for a kill: `step` is logged as
begun and `Killed` is raised in its place (tests/resilience_utils.py `abort_and_resume`);
`main(..., sigterm_at=step)` sends the process SIGTERM as that step begins, as a scheduler's
preemption would (`stop_and_resume`).
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import signal
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

# No persistent compilation cache. Reading the test process's would be faster, but XLA:CPU's
# in-process collectives can deadlock in an executable loaded from the cache (jax 0.10.2: a CI
# worker hung before step 8 of the TFDS image chaos test; see also test_resilience.py's
# non-finite skip test), and writing one could leave a truncated entry when the worker is killed.
import jax  # noqa: E402, F401

from pretext_jax import objectives  # noqa: E402, F401  (registers the methods)
from pretext_jax.pretrain.config import make_config  # noqa: E402
from pretext_jax.pretrain.trainer import Trainer  # noqa: E402


class Killed(Exception):
    """Raised by `main(..., kill_at=step)` in place of that step."""


def main(spec: str, workdir: str, log_path: str, kill_at: int | None = None,
         sigterm_at: int | None = None) -> None:
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
        if step == kill_at:
            raise Killed(f"stopped in place of step {step}, as a kill would stop it")
        if step == sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)  # handled by the trainer's PreemptionWatch
        return step_fn(state, local_batch)

    trainer.train_step = logged_step
    summary = trainer.run()
    print(json.dumps({"step": summary["step"], "stopped_by": summary["stopped_by"]}), flush=True)


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks for a test that gives up
    main(*sys.argv[1:])
