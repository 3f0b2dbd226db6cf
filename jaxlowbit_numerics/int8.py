"""Symmetric INT8 quantization with float32 scales (per row, per column or per tensor).

The contract (DESIGN.md, "Recipes"; torchao's ``int8_mixed_precision``):

    scale = max(amax, eps) * float32(1/127)
    q     = clip(round_half_even(x / scale), -127, 127)   (int8)
    x    ~= q * scale

``-128`` is never produced, so negation of a quantized tensor stays representable.
A NaN anywhere in a reduced slice makes that slice's scale NaN, so NaNs survive a
quantize/dequantize round trip instead of silently turning into zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlowbit_numerics.stats import Axis, absmax, check_floating, check_nonempty_slices

INT8_MAX = 127
# Floor for amax before dividing: keeps all-zero rows finite (torchao uses 1e-12).
AMAX_EPS = 1e-12
# amax / 127 is computed as amax * float32(1/127): XLA rewrites division by a constant into
# that product anyway, so spelling it out keeps every implementation bit-identical.
_INV_INT8_MAX = 1.0 / INT8_MAX


def int8_scale(amax: jax.Array, eps: float = AMAX_EPS) -> jax.Array:
  """Dequantization scale ``max(amax, eps) * float32(1/127)`` (NaN amax stays NaN)."""
  return jnp.maximum(amax.astype(jnp.float32), eps) * jnp.float32(_INV_INT8_MAX)


def quantize_int8_with_scale(x: jax.Array, scale: jax.Array) -> jax.Array:
  """Quantize ``x`` with a given (broadcastable) float32 dequantization ``scale`` to int8."""
  q = jnp.round(x.astype(jnp.float32) / scale)  # jnp.round rounds half to even
  return jnp.clip(q, -INT8_MAX, INT8_MAX).astype(jnp.int8)


def quantize_int8(x: jax.Array, axis: Axis = -1, eps: float = AMAX_EPS) -> tuple[jax.Array, jax.Array]:
  """Symmetric int8 quantization with one float32 scale per slice.

  Args:
    x: floating array of any shape ``S``.
    axis: the axis (or axes) reduced to compute each scale. For a 2-D ``[M, K]`` tensor,
      ``axis=-1`` gives one scale per row (per token), ``axis=0`` one per column (per feature),
      ``axis=None`` one for the whole tensor.
    eps: floor on amax (1e-12 for INT8 mixed precision, 1e-5 for BitNet activations).

  Returns:
    ``(q, scale)``: ``q`` int8 of shape ``S``; ``scale`` float32 with the reduced axes kept
    as size 1, so ``dequantize_int8(q, scale) = q * scale`` broadcasts back to ``S``. ValueError
    if a reduced axis has size 0 (an empty slice has no scale); other empty arrays give empty results.
  """
  check_floating(x, "quantize_int8")
  check_nonempty_slices(x, axis, "quantize_int8")
  scale = int8_scale(absmax(x, axis), eps)
  return quantize_int8_with_scale(x, scale), scale


def dequantize_int8(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
  """``q * scale`` in ``dtype``; ``q`` int8 of shape ``S``, ``scale`` broadcastable to ``S``."""
  return (q.astype(jnp.float32) * scale).astype(dtype)
