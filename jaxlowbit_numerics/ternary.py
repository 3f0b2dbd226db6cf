"""BitNet b1.58 ternary weights and their 2-bit packing.

Weights (BitNet b1.58 FAQ; torchao ``bitnet``):

    s  = max(mean(|W|), 1e-5)              (float32, one per tensor)
    Wq = clip(round(W / s), -1, 1)         (int8 holding -1, 0, +1)
    W ~= Wq * s

Packing stores four ternary values per int8 as 2-bit two's complement codes
(-1 -> 0b11, 0 -> 0b00, +1 -> 0b01), the first of each group of four in the most
significant bits. That is the format for storage, FSDP all-gathers and inference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlowbit_numerics.stats import absmean, check_floating, check_nonempty_slices

# Floor for the abs-mean scale (BitNet FAQ: ``w.abs().mean().clamp_(min=1e-5)``).
ABSMEAN_EPS = 1e-5
# Floor for the per-token activation absmax in BitNet layers (BitNet FAQ).
ACTIVATION_EPS = 1e-5
VALUES_PER_BYTE = 4


def ternary_scale(mean_abs: jax.Array) -> jax.Array:
  """float32 ``max(mean|W|, 1e-5)`` from a precomputed abs-mean (NaN stays NaN)."""
  return jnp.maximum(mean_abs.astype(jnp.float32), ABSMEAN_EPS)


def absmean_scale(w: jax.Array) -> jax.Array:
  """float32 ``max(mean(|w|), 1e-5)`` of the whole tensor, shape ``()``: the one scale of a ternary weight."""
  return ternary_scale(absmean(w)).reshape(())


def quantize_ternary_with_scale(w: jax.Array, scale: jax.Array) -> jax.Array:
  """``clip(round(w / scale), -1, 1)`` as int8 for a given float32 ``scale``."""
  return jnp.clip(jnp.round(w.astype(jnp.float32) / scale), -1, 1).astype(jnp.int8)


def quantize_ternary(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Absmean ternary quantization of a weight tensor.

  Args:
    w: floating array of any shape ``S`` (typically ``[K, N]``).

  Returns:
    ``(q, scale)``: ``q`` int8 of shape ``S`` with values in {-1, 0, 1}; ``scale`` float32
    of shape ``()``, so ``w ~= q * scale``. ValueError for an empty ``w`` (no mean, no scale).
  """
  check_floating(w, "quantize_ternary")
  check_nonempty_slices(w, None, "quantize_ternary")
  scale = absmean_scale(w)
  return quantize_ternary_with_scale(w, scale), scale


def dequantize_ternary(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
  """``q * scale`` in ``dtype``."""
  return (q.astype(jnp.float32) * scale).astype(dtype)


def _check_packable(shape: tuple[int, ...], axis: int, who: str) -> int:
  if not shape:
    raise ValueError(f"{who}: cannot pack a scalar")
  if not -len(shape) <= axis < len(shape):
    raise ValueError(f"{who}: axis {axis} out of range for shape {shape}")
  return axis % len(shape)


def pack_2bit(q: jax.Array, axis: int = -1) -> jax.Array:
  """Pack ternary int8 values four to a byte along ``axis``.

  Args:
    q: int8 array with values in {-1, 0, 1}; ``q.shape[axis]`` divisible by 4.
    axis: the axis to pack along.

  Returns:
    int8 array with ``shape[axis] // 4`` along ``axis``; element ``4*i + j`` of a group
    sits in bits ``7-2j .. 6-2j`` of byte ``i`` (most significant first).

  Raises:
    ValueError: a concrete ``q`` holds a value outside {-1, 0, 1} (two bits cannot store it). A
    traced ``q`` (under ``jit``) cannot be checked without a host round trip: there a value outside
    the set keeps its two low bits (``2 -> -2``, ``3 -> -1``), so produce traced inputs with
    :func:`quantize_ternary` or a clip to [-1, 1].
  """
  if q.dtype != jnp.int8:
    raise TypeError(f"pack_2bit: expected int8 ternary values, got dtype {q.dtype}")
  axis = _check_packable(q.shape, axis, "pack_2bit")
  if not isinstance(q, jax.core.Tracer) and q.size and bool(jnp.any((q < -1) | (q > 1))):
    bad = jnp.asarray(q)[(q < -1) | (q > 1)]
    raise ValueError(f"pack_2bit: values must be -1, 0 or 1, got {bad.size} others (e.g. {int(bad[0])}); "
                     "quantize with quantize_ternary or clip to [-1, 1] first")
  n = q.shape[axis]
  if n % VALUES_PER_BYTE:
    raise ValueError(f"pack_2bit: size {n} along axis {axis} is not a multiple of 4; pad it first")
  moved = jnp.moveaxis(q, axis, -1)
  groups = moved.reshape(*moved.shape[:-1], n // VALUES_PER_BYTE, VALUES_PER_BYTE)
  codes = groups.astype(jnp.uint8) & 0b11  # two's complement low bits: -1 -> 0b11
  shifts = jnp.array([6, 4, 2, 0], jnp.uint8)
  packed = jnp.bitwise_or.reduce(codes << shifts, axis=-1)
  return jnp.moveaxis(packed.astype(jnp.int8), -1, axis)


def unpack_2bit(p: jax.Array, axis: int = -1) -> jax.Array:
  """Inverse of :func:`pack_2bit`: int8 bytes -> int8 values in {-1, 0, 1} (size x4 on ``axis``)."""
  if p.dtype != jnp.int8:
    raise TypeError(f"unpack_2bit: expected packed int8 bytes, got dtype {p.dtype}")
  axis = _check_packable(p.shape, axis, "unpack_2bit")
  moved = jnp.moveaxis(p, axis, -1)[..., None]
  shifts = jnp.array([0, 2, 4, 6], jnp.int8)
  # Shift the code into the top two bits, then an arithmetic right shift sign-extends it.
  values = jnp.left_shift(moved, shifts) >> 6
  values = values.reshape(*moved.shape[:-2], moved.shape[-2] * VALUES_PER_BYTE)
  return jnp.moveaxis(values, -1, axis)
