"""Plain-XLA references that every kernel in this package must match.

Quantization (``quantize_rows_reference``, ``quantize_cols_t_reference``): a 2-D tensor is
quantized with one scale per row, or one per column and written transposed (the layout the
GEMM wants for grad_weight), or with one scale in all, as a :class:`QuantSpec` says. Scales
come back as float32 *dequantization multipliers* (``x ~= q * scale``) for every format.

GEMM: ``scaled_matmul_reference(a, a_scale, b, b_scale)`` computes

    out[m, n] = (sum_k a[m, k] * b[n, k]) * a_scale[m] * b_scale[n]

with both 8-bit operands K-major ("NT": ``b`` is stored as ``[N, K]``), exact int32
accumulation for int8 and float32 accumulation for fp8, and the scale epilogue in float32.
Scales are *dequantization multipliers* (for FP8 that is ``1 / quantize_fp8 scale``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlowbit_numerics.formats import QuantSpec, quantize
from jaxlowbit_numerics.stats import NO_SPLIT, Split

INT8 = jnp.dtype(jnp.int8)
FP8_TYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
# Largest K for which int8 x int8 sums cannot overflow int32: 127 * 127 * K < 2**31.
MAX_INT8_K = (2**31 - 1) // (127 * 127)


def quantize_rows_reference(x: jax.Array, spec: QuantSpec, split: Split = NO_SPLIT) -> tuple[jax.Array, jax.Array]:
  """``[R, C]`` -> (``q [R, C]``, scale ``[R, 1]`` or ``[1, 1]``): one scale per row.

  ``split``: ``x`` is a tile of a matrix split over mesh axes; its statistics span the whole matrix.
  """
  return quantize(x, spec, axis=-1, split=split)


def quantize_cols_t_reference(x: jax.Array, spec: QuantSpec, split: Split = NO_SPLIT) -> tuple[jax.Array, jax.Array]:
  """``[R, C]`` -> (``q^T [C, R]``, scale ``[C, 1]`` or ``[1, 1]``): one scale per column, transposed."""
  q, scale = quantize(x, spec, axis=0, split=split)
  return q.T, scale.reshape(-1, 1)


def check_operands(a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array) -> None:
  """ValueError/TypeError for operands that no backend of ``scaled_matmul`` accepts."""
  if a.ndim != 2 or b.ndim != 2:
    raise ValueError(f"scaled_matmul: a and b must be 2-D ([M, K] and [N, K]), got {a.shape} and {b.shape}")
  if a.shape[1] != b.shape[1]:
    raise ValueError(f"scaled_matmul: contraction sizes differ: a {a.shape} vs b {b.shape} (b is [N, K])")
  if a.dtype == INT8:
    if b.dtype != INT8:
      raise TypeError(f"scaled_matmul: int8 a needs int8 b, got {b.dtype}")
    if a.shape[1] > MAX_INT8_K:
      raise ValueError(f"scaled_matmul: K={a.shape[1]} could overflow int32 (max {MAX_INT8_K})")
  elif a.dtype in FP8_TYPES:
    if b.dtype not in FP8_TYPES:
      raise TypeError(f"scaled_matmul: fp8 a needs fp8 b, got {b.dtype}")
  else:
    raise TypeError(f"scaled_matmul: operands must be int8 or fp8, got {a.dtype} and {b.dtype}")
  for name, s, rows in (("a_scale", a_scale, a.shape[0]), ("b_scale", b_scale, b.shape[0])):
    if s.size not in (1, rows):
      raise ValueError(f"scaled_matmul: {name} has shape {s.shape}; expected one scale or {rows} (one per row)")


def accumulator_dtype(dtype) -> jnp.dtype:
  """int32 for int8 operands, float32 for fp8."""
  return jnp.dtype(jnp.int32) if jnp.dtype(dtype) == INT8 else jnp.dtype(jnp.float32)


def scale_column(scale: jax.Array) -> jax.Array:
  """A per-row (or single) float32 scale as a ``[R, 1]`` (or ``[1, 1]``) column."""
  return scale.astype(jnp.float32).reshape(-1, 1)


def scaled_matmul_reference(
    a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array, out_dtype=jnp.bfloat16
) -> jax.Array:
  """Reference low-bit GEMM with a scale epilogue.

  Args:
    a: ``[M, K]`` int8 or fp8 (e4m3fn / e5m2).
    a_scale: float32 ``[M]``, ``[M, 1]`` or a single value: per-row dequantization scale of ``a``.
    b: ``[N, K]`` of the same family as ``a`` (int8 with int8; fp8 types may mix).
    b_scale: float32 ``[N]``, ``[N, 1]`` or a single value: per-row scale of ``b``.
    out_dtype: dtype of the result.

  Returns:
    ``[M, N]`` array of ``out_dtype``.
  """
  check_operands(a, a_scale, b, b_scale)
  acc = jax.lax.dot_general(
      a, b, (((1,), (1,)), ((), ())), preferred_element_type=accumulator_dtype(a.dtype)
  )
  out = acc.astype(jnp.float32) * scale_column(a_scale) * scale_column(b_scale).T
  return out.astype(out_dtype)
