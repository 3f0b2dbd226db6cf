"""FP8 (e4m3fn, e5m2) quantization with float32 scales and saturating casts.

The contract (DESIGN.md, "Recipes"; torchao/torchtitan float8):

    scale = fmax / max(amax, eps)   (float32, a *multiplier*: x_fp8 = cast(clip(x * scale)))
    x    ~= x_fp8 / scale

Casts saturate: values are clipped to +-fmax before the cast, so an outlier becomes fmax
instead of inf/NaN. Axis-wise (rowwise) recipes round the scale down to a power of two,
which makes ``x * scale`` exact in the exponent and the rounding error independent of the
scale. Note the convention differs from int8 (whose scale divides): FP8 follows torchao.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlowbit_numerics.stats import Axis, absmax, check_floating, check_nonempty_slices

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
# Largest finite values (ml_dtypes finfo): e4m3fn 448, e5m2 57344.
FP8_MAX = {jnp.dtype(E4M3): 448.0, jnp.dtype(E5M2): 57344.0}
# Floor for amax before dividing (torchao's EPS for float8 scales).
AMAX_EPS = 1e-12


def fp8_max(dtype) -> float:
  """Largest finite value of an FP8 dtype (e4m3fn or e5m2)."""
  try:
    return FP8_MAX[jnp.dtype(dtype)]
  except KeyError:
    raise TypeError(f"unsupported FP8 dtype {dtype}; use jnp.float8_e4m3fn or jnp.float8_e5m2") from None


def fp8_scale(amax: jax.Array, dtype=E4M3, power_of_two: bool = False) -> jax.Array:
  """float32 multiplier ``fmax / max(amax, eps)``, optionally rounded down to a power of two."""
  scale = fp8_max(dtype) / jnp.maximum(amax.astype(jnp.float32), AMAX_EPS)
  if power_of_two:
    scale = round_down_to_power_of_two(scale)
  return scale


def round_down_to_power_of_two(scale: jax.Array) -> jax.Array:
  """Largest power of two <= ``scale`` (positive float32), exactly: clears the mantissa bits.

  ``exp2(floor(log2(s)))`` is not exact on every backend (XLA:CPU gives 2**15 - 1 ulp);
  masking the bit pattern is. inf stays inf and NaN stays NaN.
  """
  bits = jax.lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint32)
  rounded = jax.lax.bitcast_convert_type(bits & jnp.uint32(0xFF800000), jnp.float32)
  return jnp.where(jnp.isnan(scale), scale, rounded)


def cast_to_fp8(x: jax.Array, scale: jax.Array, dtype=E4M3) -> jax.Array:
  """Saturating cast of ``x * scale`` to ``dtype`` (clip to +-fmax first; NaN stays NaN)."""
  fmax = fp8_max(dtype)
  return jnp.clip(x.astype(jnp.float32) * scale, -fmax, fmax).astype(dtype)


def quantize_fp8(
    x: jax.Array, dtype=E4M3, axis: Axis = None, power_of_two: bool = False
) -> tuple[jax.Array, jax.Array]:
  """Dynamically scaled FP8 quantization.

  Args:
    x: floating array of shape ``S``.
    dtype: ``jnp.float8_e4m3fn`` (weights, activations) or ``jnp.float8_e5m2`` (gradients).
    axis: reduced axis/axes for the amax; ``None`` (default) is one scale per tensor
      (torchao ``tensorwise``); ``-1`` one per row (``rowwise``).
    power_of_two: round each scale down to a power of two (the rowwise recipes do).

  Returns:
    ``(q, scale)``: ``q`` of ``dtype`` and shape ``S``; ``scale`` float32 multiplier with
    reduced axes kept as size 1, so ``dequantize_fp8(q, scale) = q / scale``. ValueError if a
    reduced axis has size 0 (an empty slice has no scale); other empty arrays give empty results.
  """
  check_floating(x, "quantize_fp8")
  check_nonempty_slices(x, axis, "quantize_fp8")
  scale = fp8_scale(absmax(x, axis), dtype, power_of_two)
  return cast_to_fp8(x, scale, dtype), scale


def dequantize_fp8(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
  """``q / scale`` in ``dtype``; ``scale`` as returned by :func:`quantize_fp8`."""
  return (q.astype(jnp.float32) / scale).astype(dtype)
