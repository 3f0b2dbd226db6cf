"""Shared pytest setup: GPU marker handling, numerics helpers and one XLA compilation cache per run."""

import os
import shutil
import tempfile

# Eight virtual CPU devices for sharding tests; must be set before jax initializes a backend.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# On a machine without a GPU the tests' programs are small and compile far longer than they run: LLVM's
# optimizations off cut a tiny model's tensor-parallel run from 44 to 34 s. The subprocesses the tests start inherit
# the flag (helpers.xla_flags_with_devices), so the programs a test compares compile alike. A GPU run keeps the
# compiler as users run it.
_CPU_ONLY = os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu" or not os.path.exists("/dev/nvidiactl")
if _CPU_ONLY and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# Small programs (slices of sharded arrays for a checkpoint, the init of a model) recur across tests too.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# Many tests compile the same programs (a tiny model's step on one mesh, the trainings they start as
# subprocesses): one persistent compilation cache for the whole run, made by the first process that loads this
# file (pytest-xdist's controller, whose workers and their subprocesses inherit the variable) and removed when it
# ends. Only the backend compile is skipped on a hit: tracing, lowering and the HLO tests read are unchanged.
_CACHE_DIR = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE_DIR = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxlowbit-tests-xla-cache-")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_unconfigure(config):
  if _CACHE_DIR is not None:
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)


def _has_gpu() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU; runs on the GPU runner")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def float32_matmuls():
  """float32 dots in float32: on a GPU jax's default precision runs them as TF32 (10-bit mantissa),
  which puts a float32 model ~3e-4 from a float64 reference instead of ~1e-6."""
  with jax.default_matmul_precision("highest"):
    yield
