"""``QuantSpec``: how one matmul operand is quantized, and the quantizer it names.

The recipes (``jaxlowbit.matmul``) describe each operand of each matmul by a spec; the
kernels (``pallas_kernels``) implement specs. :func:`quantize` is the definition every
kernel is checked against. Scales are float32 *dequantization multipliers* for every
format (``x ~= q * scale``; for FP8 that is the reciprocal of ``quantize_fp8``'s scale).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxlowbit_numerics import fp8, int8, ternary
from jaxlowbit_numerics.stats import NO_SPLIT, Axis, Split


@dataclasses.dataclass(frozen=True)
class QuantSpec:
  """How one GEMM operand is quantized.

  Attributes:
    dtype: ``int8``, ``float8_e4m3fn`` or ``float8_e5m2`` payload.
    per_tensor: one scale for the whole tensor instead of one per row/column.
    power_of_two: round FP8 scales down to powers of two (rowwise FP8 recipes).
    eps: floor on amax (int8: 1e-12 generally, 1e-5 for BitNet activations).
    ternary: BitNet weights: absmean scale, values in {-1, 0, 1} (int8 payload).
  """

  dtype: str = "int8"
  per_tensor: bool = False
  power_of_two: bool = False
  eps: float = int8.AMAX_EPS
  ternary: bool = False

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def is_int8(self) -> bool:
    return self.jnp_dtype == jnp.dtype(jnp.int8)


def quantize(x: jax.Array, spec: QuantSpec, axis: Axis, split: Split = NO_SPLIT) -> tuple[jax.Array, jax.Array]:
  """Quantize ``x`` reducing over ``axis`` (None: per tensor); scale is a dequant multiplier.

  ``split``: ``x`` is a 2-D tile of a matrix split over mesh axes (:class:`~jaxlowbit_numerics.stats.Split`);
  the amax is reduced over the tiles first, so the tile is quantized with the whole matrix's scale.
  """
  if spec.ternary:
    if split:
      raise NotImplementedError("ternary weights are quantized with FSDP's global scale (jaxlowbit.parallel), not a Split")
    return ternary.quantize_ternary(x)
  if spec.per_tensor:
    axis = None
  if not split:
    if spec.is_int8:
      return int8.quantize_int8(x, axis=axis, eps=spec.eps)
    q, scale = fp8.quantize_fp8(x, spec.jnp_dtype, axis=axis, power_of_two=spec.power_of_two)
    return q, 1.0 / scale
  amax = split.absmax(x, axis)  # the same arithmetic as quantize_int8 / quantize_fp8 from here on
  if spec.is_int8:
    scale = int8.int8_scale(amax, spec.eps)
    return int8.quantize_int8_with_scale(x, scale), scale
  mult = fp8.fp8_scale(amax, spec.jnp_dtype, spec.power_of_two)
  return fp8.cast_to_fp8(x, mult, spec.jnp_dtype), 1.0 / mult
