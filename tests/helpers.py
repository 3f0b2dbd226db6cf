"""Numerics helpers for tests: SQNR, relative error, fresh random inputs."""

import itertools
import os
import socket
import subprocess
import sys

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


def run_distributed_workers(worker: str, args: list[list[str]], timeout: float) -> list[str]:
  """Runs ``tests/<worker>`` as ``len(args)`` ``jax.distributed`` processes on this host with 2 CPU
  devices each (process ``i`` gets the command-line arguments ``args[i]``); asserts every one
  exits 0 and returns their outputs. A process still running at the end is killed."""
  here = os.path.dirname(os.path.abspath(__file__))
  with socket.socket() as s:  # a free port for the coordinator
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
             JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(len(args)))
  env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), here, env.get("PYTHONPATH", "")])
  procs = [subprocess.Popen([sys.executable, os.path.join(here, worker), *a], env=dict(env, JAX_PROCESS_ID=str(i)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i, a in enumerate(args)]
  try:
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for i, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
  return outputs
