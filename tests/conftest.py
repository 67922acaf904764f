"""Test set-up: 8 fake CPU devices so that sharding is exercised, and a persistent compile cache."""

import ctypes
import gc
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
# XLA:CPU's newer MLIR fusion emitters are off (`xla_cpu_use_fusion_emitters=false`: the LLVM IR
# emitters it used before): over two full cold runs the suite's backend compile took 3,785
# worker-seconds without them against 5,185 with them (docs/testing.md, "Compile time").
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
    *([] if "--xla_cpu_use_fusion_emitters" in given else
      ["--xla_cpu_use_fusion_emitters=false"]),
    *([] if "--xla_backend_optimization_level" in given else
      ["--xla_backend_optimization_level=1"])]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for both pytest-xdist workers (`-n 2`) and the `run.py`
# processes the tests start (set in the environment, which they inherit): a killed run's restart,
# the CLI tests' runs of one preset, and a test file on the other worker load the programs an
# earlier process compiled. Every program is kept, however fast it compiled: each test file
# starts on empty in-memory caches (`_release_memory`), so its small programs come back from
# disk. jax writes an entry in place, unlocked (a size limit would add a lock, and a scan of
# the whole folder at every write): a process reading an entry while another writes it gets a
# damaged entry, which jax reads as a miss, with a warning. XLA's GPU caches are off: their
# folder, inside this one, would enter every program's key and part the processes' entries.
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.expanduser("~/.cache/pretext-jax-tests")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES"] = "none"

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


from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent


try:
    _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim  # glibc's
except (OSError, AttributeError):
    _MALLOC_TRIM = None


@pytest.fixture(autouse=True, scope="module")
def _release_memory():
    """After each test file: drop jax's in-memory caches (traced and compiled programs) and
    hand the freed heap back to the system.

    A pytest-xdist worker runs half the suite in one process: without this a worker grew past
    8 GB in 80 minutes, and a CI run lost a worker near its end (two workers and their `run.py`
    subprocesses on a 24 GB machine; the likely cause, the log says only that it died). Most
    of it was freed memory that glibc's allocator keeps in its per-thread arenas (XLA runs on
    many threads): after test_mass.py, 1.46 GB resident, 0.54 GB after `malloc_trim`.
    Programs another file needs again come back from the persistent compilation cache."""
    yield
    jax.clear_caches()
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


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
