"""The single dispatch point for jaxlowbit's low-bit kernels.

``jaxlowbit.quantized_matmul`` sends every quantization and every low-bit matmul of every
recipe (forward, grad_input, grad_weight) through the three functions here; which
implementation runs is decided here and nowhere else:

- :func:`quantize_rows`   ``[R, C]`` -> int8/fp8 ``[R, C]`` + one scale per row
- :func:`quantize_cols_t` ``[R, C]`` -> int8/fp8 ``[C, R]`` + one scale per column (transposed)
- :func:`scaled_matmul`   ``[M, K] x [N, K]`` -> ``[M, N]`` with the scales applied

Backends:
- ``"xla"``: :mod:`pallas_kernels.reference` (XLA fusions).
- ``"pallas"``: the Pallas GPU kernels (Hopper wgmma GEMM, Triton-backend quantizers).

Which backend runs is :mod:`pallas_kernels.policy`'s decision (``JAXLOWBIT_BACKEND=xla|pallas|auto``
and every threshold); which kernel configuration runs a shape is :mod:`pallas_kernels.tuning`'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlowbit_numerics.formats import QuantSpec
from pallas_kernels import policy
from pallas_kernels.policy import select_backend
from pallas_kernels.reference import (
    check_operands,
    quantize_cols_t_reference,
    quantize_rows_reference,
    scaled_matmul_reference,
)

__all__ = ["quantize_cols_t", "quantize_rows", "quantize_rows_and_cols_t", "scaled_matmul", "select_backend"]


def _quantize_on_kernel(x: jax.Array, spec: QuantSpec, transposed: bool) -> bool:
  """Whether a fused quantization kernel takes ``x`` (2-D, supported spec and shape, GPU)."""
  from pallas_kernels import quantize as kernels  # keeps Pallas imports off the CPU import path

  if not policy.quantize_on_kernel():
    return False
  return x.ndim == 2 and kernels.supported(spec, *x.shape, transposed=transposed)


# Every quantization and low-bit GEMM runs inside one of these scopes, so profiles
# (benchmarks/profile_step.py) and HLO dumps can attribute kernels and fusions to them.
QUANTIZE_SCOPE = "jaxlowbit_quantize"
GEMM_SCOPE = "jaxlowbit_gemm"


def quantize_rows(x: jax.Array, spec: QuantSpec) -> tuple[jax.Array, jax.Array]:
  """``x [R, C]`` -> (``q [R, C]`` of ``spec.dtype``, float32 dequant scale ``[R, 1]`` or ``[1, 1]``)."""
  with jax.named_scope(QUANTIZE_SCOPE):
    return _quantize_rows(x, spec)


def _quantize_rows(x, spec):
  if _quantize_on_kernel(x, spec, transposed=False):
    from pallas_kernels.quantize import quantize_rows_kernel

    return quantize_rows_kernel(x, spec)
  return quantize_rows_reference(x, spec)


def quantize_cols_t(x: jax.Array, spec: QuantSpec) -> tuple[jax.Array, jax.Array]:
  """``x [R, C]`` -> (``q [C, R]``: per-column quantization written transposed, scale ``[C, 1]`` or ``[1, 1]``)."""
  with jax.named_scope(QUANTIZE_SCOPE):
    return _quantize_cols_t(x, spec)


def _quantize_cols_t(x, spec):
  if _quantize_on_kernel(x, spec, transposed=True):
    from pallas_kernels.quantize import quantize_cols_t_kernel

    return quantize_cols_t_kernel(x, spec)
  return quantize_cols_t_reference(x, spec)


def quantize_rows_and_cols_t(x: jax.Array, spec: QuantSpec):
  """Both :func:`quantize_rows` and :func:`quantize_cols_t` of ``x``, sharing one read where a kernel can."""
  if _quantize_on_kernel(x, spec, transposed=False):
    from pallas_kernels.quantize import quantize_rows_and_cols_t_kernel

    with jax.named_scope(QUANTIZE_SCOPE):
      return quantize_rows_and_cols_t_kernel(x, spec)
  return quantize_rows(x, spec), quantize_cols_t(x, spec)


def scaled_matmul(
    a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array, out_dtype=jnp.bfloat16
) -> jax.Array:
  """``(a @ b.T) * a_scale[:, None] * b_scale[None, :]`` on the selected backend.

  Args:
    a: ``[M, K]`` int8 or fp8. b: ``[N, K]`` (K-major, as tensor cores want it).
    a_scale, b_scale: float32 dequantization scales, one per row or one in all.
    out_dtype: dtype of the ``[M, N]`` result.
  """
  check_operands(a, a_scale, b, b_scale)
  m, k = a.shape
  per_tensor = a_scale.size == 1 and b_scale.size == 1
  with jax.named_scope(GEMM_SCOPE):
    if select_backend(a.dtype, m, b.shape[0], k, per_tensor=per_tensor) == "pallas":
      from pallas_kernels import tuning  # imports Mosaic GPU lazily
      from pallas_kernels.hopper_gemm import scaled_matmul_hopper

      config = tuning.config_for(m, b.shape[0], k, a.dtype)
      return scaled_matmul_hopper(a, a_scale, b, b_scale, out_dtype, config=config)
    return scaled_matmul_reference(a, a_scale, b, b_scale, out_dtype)
