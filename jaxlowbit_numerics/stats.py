"""Tensor statistics that quantization scales are built from: abs-max and abs-mean.

They live apart from the formats because FSDP computes them once per step for every
weight (one all-reduce) and hands them to the quantizers as precomputed values.

:class:`Split` describes a 2-D operand that is one tile of a larger matrix split over mesh
axes inside ``jax.shard_map`` (tensor parallelism: this device's tokens, or its share of the
features); :meth:`Split.absmax` reduces an abs-max over the tiles, so every tile is quantized
with the scale of the whole matrix.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

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


def check_nonempty_slices(x: jax.Array, axis: Axis, who: str) -> None:
  """ValueError when a slice reduced over ``axis`` is empty: it has no amax or mean, so no scale.

  An empty array whose reduced axes are not empty (``[0, K]`` per row) has no slices: fine.
  """
  empty = [a for a in canonical_axis(x, axis) if x.shape[a] == 0]
  if empty:
    raise ValueError(
        f"{who}: x of shape {x.shape} has size 0 along axis {empty[0]}, which each scale is computed over "
        f"(axis={axis}); an empty slice has no scale: skip quantizing empty tensors"
    )


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


@dataclasses.dataclass(frozen=True)
class Split:
  """A 2-D operand ``[R, C]`` that is one tile of a matrix split over mesh axes (inside ``shard_map``).

  Attributes:
    rows: mesh axes the matrix's rows are split over (other devices hold other rows, e.g. the
      other tokens of a sequence-parallel activation).
    cols: mesh axes its columns are split over (other devices hold other features, e.g. the
      input of a row-parallel linear).

  A statistic over a split dimension is reduced over that dimension's axes: a per-row amax
  (over the columns) over ``cols``, a per-column amax over ``rows``, a per-tensor one over both.
  MAX is exact in any order, so every tile gets the bits of the unsplit matrix's scale.
  """

  rows: tuple[str, ...] = ()
  cols: tuple[str, ...] = ()

  def __post_init__(self):
    for name in ("rows", "cols"):
      axes = getattr(self, name)
      if isinstance(axes, str) or not all(isinstance(a, str) for a in axes):
        raise TypeError(f"Split.{name} must be a tuple of mesh axis names, got {axes!r}")
      object.__setattr__(self, name, tuple(axes))

  def __bool__(self) -> bool:
    return bool(self.rows or self.cols)

  def axes(self, axis: Axis, ndim: int = 2) -> tuple[str, ...]:
    """Mesh axes a statistic of a 2-D tile reduced over ``axis`` (-1/1: per row, 0: per column,
    None: per tensor) must also be reduced over."""
    if ndim != 2:
      raise ValueError(f"Split describes 2-D operands, got rank {ndim}")
    reduced = canonical_axis(jnp.zeros((1, 1)), axis)
    return (self.cols if 1 in reduced else ()) + (self.rows if 0 in reduced else ())

  def absmax(self, x: jax.Array, axis: Axis) -> jax.Array:
    """:func:`absmax` of the tile ``x [R, C]`` over ``axis``, reduced over the tiles that split it."""
    amax = absmax(x, axis)
    axes = self.axes(axis, x.ndim)
    return lax.pmax(amax, axes) if axes else amax

  def psum(self, x: jax.Array) -> jax.Array:
    """``x`` summed over the axes the columns are split over (a per-row sum of the whole row)."""
    return lax.psum(x, self.cols) if self.cols else x

  def num_cols(self, local: int) -> int:
    """Columns of the whole matrix, from a tile's ``local`` count."""
    for axis in self.cols:
      local *= lax.axis_size(axis)
    return local


NO_SPLIT = Split()
