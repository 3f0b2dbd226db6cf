"""The one place that picks an implementation for the inference (weight-quantized) GEMMs.

``jaxlowbit.inference`` sends every converted linear through one of three functions:

- :func:`w8a16_matmul`  bf16 ``x [M, K]`` x int8 ``wq [N, K]`` (+ per-channel scale)
- :func:`w8a8_matmul`   int8 ``xq [M, K]`` x int8 ``wq [N, K]`` (+ per-token and per-channel scales)
- :func:`ternary_matmul` int8 ``xq [M, K]`` x packed 2-bit ``[N, K/4]`` (+ per-token scales, one weight scale)

Implementations, by M (rows = tokens in the step; decode has M = batch size):

============  ===========================================  ==========================================
scheme        M <= ``*_KERNEL_MAX_M`` on sm80+              larger M
============  ===========================================  ==========================================
w8a16         ``pallas_kernels.w8a16`` (Triton, split-K)   same kernel up to ``W8A16_KERNEL_MAX_M``,
                                                           then XLA (int8->bf16 convert fused into its GEMM)
w8a8          ``pallas_kernels.int8_gemv`` A8W8            ``dispatch.scaled_matmul`` (Hopper wgmma, fused scales)
ternary       ``pallas_kernels.int8_gemv`` A8W2            unpack to int8 [N, K] once, then ``scaled_matmul``
============  ===========================================  ==========================================

Everywhere else (CPU, GPUs older than sm80, shapes a kernel does not tile) the XLA
references run, with the same numerics. ``JAXLOWBIT_BACKEND`` (see ``dispatch``) applies:
``xla`` forces the references, ``pallas`` forces the kernels for every M and raises a clear
error where they cannot run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlowbit.ternary import unpack_2bit
from pallas_kernels import dispatch
from pallas_kernels.int8_gemv import (
    A8W2_BASE,
    A8W8_BASE,
    a8w2_matmul_reference,
    a8w8_matmul_reference,
    check_a8w2,
    check_a8w8,
)
from pallas_kernels.int8_gemv import config_for as gemv_config_for
from pallas_kernels.int8_gemv import supports as gemv_supports
from pallas_kernels.w8a16 import ACTIVATION_DTYPES, check_operands, w8a16_matmul_reference
from pallas_kernels.w8a16 import config_for as w8a16_config_for
from pallas_kernels.w8a16 import supports as w8a16_supports

# The Triton-backend kernels need int8/bf16 mma: Ampere (sm80) or newer.
MIN_KERNEL_CAPABILITY = 8
# Largest M that each kernel takes under "auto". Starting points: GEMV-style kernels win while
# the weight read dominates (M up to a few dozen tokens); above that the GEMM is compute-bound
# and the wgmma kernel (int8 operands) or XLA's bf16 GEMM is faster than Triton's tensor-core
# tiles. TODO(benchmarks/inference.py): refine from the recorded crossover on H100/H200.
W8A16_KERNEL_MAX_M = 64
W8A8_KERNEL_MAX_M = 64
TERNARY_KERNEL_MAX_M = 64


def _use_kernel(who: str, m: int, max_m: int, fits: bool) -> bool:
  """True to run the Pallas kernel, False for the reference; raises where a forced kernel cannot run."""
  requested = dispatch.requested_backend()
  if requested == "xla":
    return False
  major = dispatch.compute_capability()
  if major is None or major < MIN_KERNEL_CAPABILITY:
    if requested == "pallas":
      where = "a CPU" if major is None else f"an sm{major}x GPU"
      raise NotImplementedError(
          f"{dispatch.BACKEND_ENV}=pallas: the {who} kernel needs an NVIDIA GPU with sm80+ (Ampere or newer), "
          f"this is {where}; unset {dispatch.BACKEND_ENV} (or set it to xla) to use the XLA path"
      )
    return False
  if not fits:
    if requested == "pallas":
      raise ValueError(f"{dispatch.BACKEND_ENV}=pallas: the {who} kernel cannot tile this weight (see its supports()); "
                       "unset the variable to let the XLA path take it")
    return False
  return requested == "pallas" or m <= max_m


def w8a16_matmul(x: jax.Array, wq: jax.Array, w_scale: jax.Array, out_dtype=None) -> jax.Array:
  """``(x @ wq.T) * w_scale``: x ``[M, K]`` float, wq ``[N, K]`` int8, w_scale ``[N]`` float32 -> ``[M, N]``."""
  check_operands(x, wq, w_scale)
  m, k = x.shape
  n = wq.shape[0]
  fits = jnp.dtype(x.dtype) in ACTIVATION_DTYPES and w8a16_supports(n, k, w8a16_config_for(m, n, k))
  if _use_kernel("W8A16", m, W8A16_KERNEL_MAX_M, fits):
    from pallas_kernels.w8a16 import w8a16_matmul_kernel

    return w8a16_matmul_kernel(x, wq, w_scale, out_dtype)
  return w8a16_matmul_reference(x, wq, w_scale, out_dtype)


def w8a8_matmul(xq, x_scale, wq, w_scale, out_dtype=jnp.bfloat16) -> jax.Array:
  """``(xq @ wq.T) * x_scale * w_scale``: int8 ``[M, K]`` x int8 ``[N, K]`` -> ``[M, N]`` (int32 exact)."""
  check_a8w8(xq, x_scale, wq, w_scale)
  m = xq.shape[0]
  n, k = wq.shape
  fits = gemv_supports(n, k, gemv_config_for(m, n, k, A8W8_BASE))
  if m <= W8A8_KERNEL_MAX_M and _use_kernel("W8A8", m, W8A8_KERNEL_MAX_M, fits):
    from pallas_kernels.int8_gemv import a8w8_matmul_kernel

    return a8w8_matmul_kernel(xq, x_scale, wq, w_scale, out_dtype)
  if m <= W8A8_KERNEL_MAX_M:
    return a8w8_matmul_reference(xq, x_scale, wq, w_scale, out_dtype)
  return dispatch.scaled_matmul(xq, x_scale, wq, w_scale.reshape(-1), out_dtype)


def ternary_matmul(xq, x_scale, w_packed, w_scale, out_dtype=jnp.bfloat16) -> jax.Array:
  """``(xq @ unpack(w_packed).T) * x_scale * w_scale``: int8 ``[M, K]`` x packed ``[N, K/4]`` -> ``[M, N]``."""
  check_a8w2(xq, x_scale, w_packed, w_scale)
  m = xq.shape[0]
  n, k_bytes = w_packed.shape
  fits = gemv_supports(n, k_bytes, gemv_config_for(m, n, k_bytes, A8W2_BASE))
  if m <= TERNARY_KERNEL_MAX_M and _use_kernel("ternary A8W2", m, TERNARY_KERNEL_MAX_M, fits):
    from pallas_kernels.int8_gemv import a8w2_matmul_kernel

    return a8w2_matmul_kernel(xq, x_scale, w_packed, w_scale, out_dtype)
  if m <= TERNARY_KERNEL_MAX_M:
    return a8w2_matmul_reference(xq, x_scale, w_packed, w_scale, out_dtype)
  # Large M is compute-bound: one unpack pass (N*K/4 bytes in, N*K out) buys int8 wgmma speed.
  return dispatch.scaled_matmul(xq, x_scale, unpack_2bit(w_packed, axis=-1), w_scale.reshape(-1), out_dtype)
