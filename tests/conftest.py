"""Test set-up: 8 fake CPU devices so that sharding is exercised, and a persistent compile cache."""

import os

# The 8 fake devices run one program each on the CPU's threads, meeting at every collective.
# XLA aborts the process when one device's thread is 40 s late to a collective (its default
# `xla_cpu_collective_call_terminate_timeout_seconds`), which a 2-core machine running two test
# workers and their subprocesses can reach on a slow step: a crash, not a failure. Tests (and the
# `run.py` processes they start, which inherit XLA_FLAGS) wait up to 20 minutes instead.
#
# Compiling is most of this suite's time (its models are tiny), so XLA:CPU's LLVM runs at
# optimisation level 1, not 2: that halves compiling a ResNet step on the (2, 2, 2) mesh and
# leaves step times as they were (a 300-step demo run took as long); level 0 compiles faster
# again but doubles a step's time. A tiny model's trained parameters came out bit for bit the
# same at both levels; tests comparing two different programs (a scan against a loop, one mesh
# against another) can see float32 rounding differ. A level given in XLA_FLAGS is kept. LLVM's
# expensive passes are skipped too (`xla_llvm_disable_expensive_passes`): a BERT step compiled
# on four meshes took 57 s against 68 s with them.
#
# Convolutions run on the calling device's thread, not on Eigen's shared pool (as many threads
# as cores): twice an image run (ResNet, BatchNorm statistics all-reduced over the 8 devices)
# hung for good with every XLA:CPU thread waiting, presumably device threads blocked at a
# collective while others' convolutions waited for pool threads they held; the intra-op pool
# buys nothing with two test workers on two cores.
#
# XLA:CPU sizes its intra-op pool, which runs the thunks of every device's program that is not
# small, at max(cores, devices): 8 threads here. A collective thunk holds its pool thread until
# all 8 devices reach it, so when the devices' programs hold those 8 threads between two
# collectives (each device at one, some threads taken by another's), none can complete: the
# rare hang of image runs (BatchNorm all-reduces beside the gradients'). 32 threads
# (`PJRT_NPROC`, read by XLA's `DefaultThreadPoolSize`) leave room for four blocked thunks per
# device; tests and the `run.py` processes they start inherit it.
os.environ.setdefault("PJRT_NPROC", "32")
given = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([
    given, "--xla_force_host_platform_device_count=8",
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=300",
    "--xla_cpu_collective_call_terminate_timeout_seconds=1200",
    "--xla_cpu_multi_thread_eigen=false", "--xla_llvm_disable_expensive_passes=true",
    *([] if "--xla_backend_optimization_level" in given else
      ["--xla_backend_optimization_level=1"])]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from jax._src import core as jax_core  # noqa: E402

# flax's `Variable.__setitem__` (every BatchNorm statistics update in a traced step) compares
# `getattr(value, "sharding", None)` of two tracers; jax answers with an AttributeError whose
# message first walks the whole jaxpr traced so far for the value's origin
# (`DynamicJaxprTracer._origin_msg`), so tracing an image network grows with the square of its
# BatchNorm layers: 40 % of a BYOL step test's time. The tests raise the same error without
# that message (only the text of an error that `getattr` swallows differs).
if isinstance(getattr(jax_core.Tracer, "sharding", None), property):
    def _no_sharding_on_tracers(tracer: jax_core.Tracer) -> None:
        raise AttributeError("The 'sharding' attribute is not available on a tracer.")

    jax_core.Tracer.sharding = property(_no_sharding_on_tracers)

# One cache per pytest-xdist worker (`-n 2`), so no two processes write the same entry.
jax.config.update("jax_compilation_cache_dir", os.path.expanduser(
    "~/.cache/pretext-jax-tests" + os.environ.get("PYTEST_XDIST_WORKER", "")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent


def shared_data_dir() -> Path:
    """The shared datasets folder: $PRETEXT_SHARED_DATA, else ../shared/data beside the repo."""
    return Path(os.environ.get("PRETEXT_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


@pytest.fixture
def shared_data() -> Path:
    """Path to ../shared/data; the test is skipped (with the reason) when it is absent."""
    path = shared_data_dir()
    if not path.is_dir():
        pytest.skip(f"shared datasets not found at {path}; set PRETEXT_SHARED_DATA")
    return path


@pytest.fixture
def deterministic_torch():
    """torch in deterministic float32 mode for a parity test (skipped without torch)."""
    torch = pytest.importorskip("torch")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)
    yield torch
    torch.use_deterministic_algorithms(previous)
