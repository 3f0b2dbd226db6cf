"""Numerics helpers for tests: SQNR, relative error, fresh random inputs."""

import itertools
import os
import socket
import subprocess
import sys

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.kernel_sass import SM90
from jaxlowbit_numerics import fp8, int8
from pallas_kernels import policy
from pallas_kernels.reference import quantize_rows_reference

_counter = itertools.count()
# An sm_90 GPU of 132 SMs, as an abstract device: programs lowered for CUDA on a CPU host see it
# (jax.sharding.use_abstract_mesh(H100)); the one kernel_sass lowers for.
H100 = SM90


def equations(jaxpr):
  """Every equation of ``jaxpr`` and of the jaxprs nested in its equations (scan, pjit, remat, custom_vjp rules...)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from equations(sub)


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


def bf16_values_close(got, want, max_fraction=0.01, steps=1):
  """bfloat16 values equal except where float32 ulps (``exp`` against ``sigmoid``, a sum's order)
  moved a rounding: at most ``max_fraction`` of them differ, each by at most ``steps`` bfloat16 steps
  (one per bf16 rounding on the value's path: a moved rounding of an intermediate carries into the next)."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  differ = got != want
  assert differ.mean() <= max_fraction, differ.mean()
  bad = differ & ~(np.abs(got - want) <= steps * 2.0**-7 * np.abs(want))
  assert not bad.any(), (f"{bad.sum()} values over {steps} bf16 step(s), first at {np.argwhere(bad)[0]}: "
                         f"{got[bad][0]} against {want[bad][0]}")


def codes_close(got, want, spec, max_fraction=0.01):
  """Equal codes except where a rounding boundary moved (the norm's sum order, exp's ulps): one step."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  differ = got != want
  assert differ.mean() <= max_fraction, differ.mean()
  if spec.is_int8:
    assert np.all(np.abs(got - want)[differ] <= 1)
  else:  # one fp8 step: within the format's relative spacing
    assert np.all(np.abs(got - want)[differ] <= 0.13 * np.abs(want)[differ] + 1e-6)


def _scale_of(amax, spec):
  """The dequant scale ``formats.quantize`` gives a group whose amax is ``amax`` (float32, any shape)."""
  if spec.is_int8:
    return int8.int8_scale(amax, spec.eps)
  return 1.0 / fp8.fp8_scale(amax, spec.jnp_dtype, spec.power_of_two)


def _codes_at(y, scale, spec):
  """``y`` quantized with a given dequant ``scale`` (broadcast over ``y``'s groups)."""
  if spec.is_int8:
    return int8.quantize_int8_with_scale(y, scale)
  return fp8.cast_to_fp8(y, 1.0 / scale, spec.jnp_dtype)


def quantized_close(got, want, y, spec, max_fraction=0.01):
  """Codes and scales of one layout against the reference, in lockstep where a group's amax moved.

  ``y`` is the prologue's output in the layout's orientation (groups along axis 1 for per-row scales
  ``[G, 1]``, along axis 0 for ``[1, G]``). The prologue rounds to bfloat16, so an ulp of float32 in the
  norm's sum or ``exp`` can move the rounding of a group's amax element by one bfloat16 step (2**-8 to 2**-7
  relative). Each scale must be within ``rtol=1e-5`` of the scale of an amax within one step of the
  reference amax (a power-of-two scale can then double); where it differs from the reference's, that
  group's codes are compared with the reference's ``y`` quantized at the kernel's scale
  (:func:`codes_close`).
  """
  q, s = got
  want_q, want_s = want
  assert q.shape == want_q.shape and q.dtype == want_q.dtype and s.shape == want_s.shape
  y = np.asarray(y, np.float32)
  size = np.abs(y)
  amax = size.max() if spec.per_tensor else size.max(axis=1 if s.shape[1] == 1 else 0).reshape(s.shape)
  low, high = (np.asarray(_scale_of(jnp.float32(amax * f), spec)) for f in (1 - 2.0**-7, 1 + 2.0**-7))
  s, want_s = np.asarray(s), np.asarray(want_s)
  assert np.all((s >= low * (1 - 1e-5)) & (s <= high * (1 + 1e-5))), (s, want_s)
  moved = ~np.isclose(s, want_s, rtol=1e-5, atol=0)
  lockstep = np.where(moved, np.asarray(_codes_at(y, s, spec), np.float32), np.asarray(want_q, np.float32))
  codes_close(q, lockstep, spec, max_fraction)


def needs_devices(n: int):
  """Skip unless ``n`` devices are visible: CPU runs get 8 virtual ones (tests/conftest.py); a GPU
  host shows its GPUs, often fewer."""
  return pytest.mark.skipif(jax.device_count() < n, reason=f"needs {n} devices, this host has {jax.device_count()}")


def xla_flags_with_devices(devices: int) -> str:
  """``$XLA_FLAGS`` as this run sets it (``tests/conftest.py``: its compile options) with ``devices`` virtual CPU
  devices instead of its eight: the flags for a test's subprocess, so that it compiles as the test does."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
  return " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])


def run_distributed_workers(worker: str, args: list[list[str]], timeout: float) -> list[str]:
  """Runs ``tests/<worker>`` as ``len(args)`` ``jax.distributed`` processes on this host with 2 CPU
  devices each (process ``i`` gets the command-line arguments ``args[i]``); asserts every one
  exits 0 and returns their outputs. A process still running at the end is killed."""
  here = os.path.dirname(os.path.abspath(__file__))
  with socket.socket() as s:  # a free port for the coordinator
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, XLA_FLAGS=xla_flags_with_devices(2), JAX_PLATFORMS="cpu",
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


def inference_kernel_table(m: int) -> tuple[tuple[str, str, bool], ...]:
  """``(scheme, kernel name in the lowered program, whether policy sends M rows to it)`` for a converted linear
  (``jaxlowbit.inference.quantized_linear``), as ``pallas_kernels.policy`` states it; the CPU test (faked H100)
  and the GPU test check lowered programs against it."""
  return (
      ("w8a16", "jaxlowbit_w8a16_matmul", any(lo <= m <= hi for lo, hi in policy.W8A16_KERNEL_M)),
      ("ternary", "jaxlowbit_ternary_gemv", m <= policy.TERNARY_GEMV_MAX_M),
      ("ternary", "jaxlowbit_a8w2_matmul", policy.TERNARY_GEMV_MAX_M < m <= policy.TERNARY_KERNEL_MAX_M),
      ("w8a8", "jaxlowbit_a8w8_gemv", m <= policy.W8A8_GEMV_MAX_M),
      ("w8a8", "jaxlowbit_a8w8_matmul", policy.W8A8_GEMV_MAX_M < m <= policy.W8A8_KERNEL_MAX_M),
  )


TIE_MARGIN = 1e-3  # |x / scale - (n + 1/2)| below this (in code units) counts as a rounding tie


def tie_free_activations(key: jax.Array, m: int, k: int, spec) -> jax.Array:
  """bf16 ``[m, k]`` activations, rows of different magnitude, with no element on an int8 rounding tie.

  Elements whose ``x / scale`` (``spec``'s per-row int8 scale) lies within :data:`TIE_MARGIN` of a .5 are set
  to 0: a float32 quotient that close to a tie rounds by how it was computed (a correctly rounded division,
  XLA's ``x * (1 / scale)``, Triton's approximate division), so two correct implementations could round it
  apart. The amax element maps to 127 exactly and is never one of them, so the scales do not move.
  """
  kx, kr = jax.random.split(key)
  rows = jnp.exp(jax.random.uniform(kr, (m, 1), minval=-3.0, maxval=3.0))
  x = np.asarray((jax.random.normal(kx, (m, k)) * rows).astype(jnp.bfloat16), np.float64)
  scale = np.asarray(quantize_rows_reference(jnp.asarray(x, jnp.bfloat16), spec)[1], np.float64)
  quotient = x / scale
  ties = np.abs(quotient - np.floor(quotient) - 0.5) < TIE_MARGIN
  return jnp.asarray(np.where(ties, 0.0, x), jnp.bfloat16)


def check_quantizing_gemvs_on_non_finite_rows(key: jax.Array, dtype, interpret: bool) -> None:
  """Both quantizing dp4a GEMVs on four rows of 512 ``dtype`` activations, row 0 finite and rows 1-3 holding one
  NaN, +inf and -inf: == ``quantize_rows_reference`` then the reference, bit for bit. Rows 1-3 must be NaN in every
  output (their amax counts as inf, so the scale is inf and every code 0, the reference's too), row 0 finite."""
  from jaxlowbit.inference.weights import BITNET_TOKENS, INT8_TOKENS
  from jaxlowbit_numerics.ternary import pack_2bit
  from pallas_kernels import dp4a_gemv, int8_gemv

  n, k = 64, 512
  kx, kw, kv = jax.random.split(key, 3)
  x = tie_free_activations(kx, 4, k, BITNET_TOKENS)
  columns = jax.random.randint(kv, (3,), 0, k)
  for row, (col, value) in enumerate(zip(columns, (jnp.nan, jnp.inf, -jnp.inf)), start=1):
    x = x.at[row, col].set(value)
  x = x.astype(dtype)
  wt = jax.random.randint(kw, (n, k), -1, 2, jnp.int32).astype(jnp.int8)
  wq = jax.random.randint(kw, (n, k), -127, 128, jnp.int32).astype(jnp.int8)
  cases = ((dp4a_gemv.quantize_a8w2_gemv_kernel, int8_gemv.a8w2_matmul_reference, BITNET_TOKENS, pack_2bit(wt)),
           (dp4a_gemv.quantize_a8w8_gemv_kernel, int8_gemv.a8w8_matmul_reference, INT8_TOKENS, wq))
  for kernel, reference, spec, w in cases:
    w_scale = jnp.float32(0.02)
    got = np.asarray(kernel(x, w, w_scale, spec, jnp.float32, interpret=interpret))
    want = np.asarray(reference(*quantize_rows_reference(x, spec), w, w_scale, jnp.float32))
    assert np.isfinite(got[0]).all() and np.isnan(got[1:]).all(), kernel.__name__
    np.testing.assert_array_equal(got, want)


def record_measured_quantizations(monkeypatch) -> list[bool]:
  """Patch ``pallas_kernels.dispatch.quantize_rows_and_cols_t`` to record, per trace of a call, whether the caller gave
  the operand's amaxes (``maxima``: a linear's measured output gradient, ``jaxlowbit.operand.MeasuredOutput``);
  returns the list it appends to. Clear it between runs."""
  from pallas_kernels import dispatch

  calls = []
  plain = dispatch.quantize_rows_and_cols_t

  def recording(x, spec, options=None, maxima=None):
    calls.append(maxima is not None)
    return plain(x, spec, options, maxima)

  monkeypatch.setattr(dispatch, "quantize_rows_and_cols_t", recording)
  return calls
