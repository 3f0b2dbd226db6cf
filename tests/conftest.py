"""Shared pytest setup: GPU marker handling and numerics helpers."""

import os

# Eight virtual CPU devices for sharding tests; must be set before jax initializes a backend.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import pytest  # noqa: E402


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
