"""Tensor statistics that quantization scales are built from: abs-max and abs-mean.

They live apart from the formats because FSDP computes them once per step for every
weight (one all-reduce) and hands them to the quantizers as precomputed values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Axis = int | tuple[int, ...] | None


def canonical_axis(x: jax.Array, axis: Axis) -> tuple[int, ...]:
  """Sorted non-negative axes for ``axis`` (None: all axes); ValueError when out of range."""
  if axis is None:
    return tuple(range(x.ndim))
  axes = (axis,) if isinstance(axis, int) else tuple(axis)
  for a in axes:
    if not -x.ndim <= a < x.ndim:
      raise ValueError(f"axis {a} is out of range for an array of rank {x.ndim} (shape {x.shape})")
  return tuple(sorted({a % x.ndim for a in axes}))


def check_floating(x: jax.Array, who: str) -> None:
  """TypeError unless ``x`` has a floating-point dtype."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{who}: expected a floating-point array, got dtype {x.dtype}")


def absmax(x: jax.Array, axis: Axis = None) -> jax.Array:
  """float32 ``max(|x|)`` over ``axis`` (None: whole tensor), reduced dims kept as size 1.

  NaN counts as +inf, so a slice holding NaN or inf gets an infinite amax: its scale is
  then inf (int8) or 0 (FP8 multiplier) and the slice dequantizes to NaN, instead of NaN
  being rounded to a silent zero. Mapping NaN to inf (rather than relying on ``max`` to
  propagate NaN) keeps this true on every backend: vectorized max reductions on XLA:CPU
  and Triton's ``maxnumf`` both drop NaN.
  """
  x = x.astype(jnp.float32)
  magnitude = jnp.where(jnp.isnan(x), jnp.inf, jnp.abs(x))
  return jnp.max(magnitude, axis=canonical_axis(x, axis), keepdims=True)


def absmean(x: jax.Array, axis: Axis = None) -> jax.Array:
  """float32 ``mean(|x|)`` over ``axis`` (None: whole tensor), reduced dims kept as size 1."""
  return jnp.mean(jnp.abs(x.astype(jnp.float32)), axis=canonical_axis(x, axis), keepdims=True)
