"""Numerics helpers for tests: SQNR, relative error, fresh random inputs."""

import itertools

import jax
import numpy as np
import pytest

_counter = itertools.count()


def fresh_key() -> jax.Array:
  """A different PRNG key for every call (fresh random inputs in every test).

  The seed is printed, so pytest shows it with a failing test's captured output.
  """
  seed = int(np.random.SeedSequence().entropy % (2**31)) + next(_counter)
  print(f"fresh_key seed={seed}")
  return jax.random.key(seed)


def sqnr_db(actual, reference) -> float:
  """Signal-to-quantization-noise ratio of ``actual`` against ``reference`` in dB (float64)."""
  a = np.asarray(actual, np.float64)
  r = np.asarray(reference, np.float64)
  noise = np.sum((a - r) ** 2)
  return float("inf") if noise == 0 else float(10 * np.log10(np.sum(r**2) / noise))


def rel_err(actual, reference) -> float:
  """``||actual - reference|| / ||reference||`` in float64."""
  a = np.asarray(actual, np.float64)
  r = np.asarray(reference, np.float64)
  return float(np.linalg.norm(a - r) / np.linalg.norm(r))


def bf16_values_close(got, want, max_fraction=0.01):
  """bfloat16 values equal except where float32 ulps (``exp`` against ``sigmoid``, a sum's order)
  moved a rounding: at most ``max_fraction`` of them differ, each by at most one bfloat16 step."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  differ = got != want
  assert differ.mean() <= max_fraction, differ.mean()
  assert np.all(np.abs(got - want)[differ] <= 2.0**-7 * np.abs(want)[differ])


def needs_devices(n: int):
  """Skip unless ``n`` devices are visible: CPU runs get 8 virtual ones (tests/conftest.py); a GPU
  host shows its GPUs, often fewer."""
  return pytest.mark.skipif(jax.device_count() < n, reason=f"needs {n} devices, this host has {jax.device_count()}")
