"""``gather_weight``: a K-sharded weight all-gathered low-bit in ONE collective, as a low-bit operand.

Inside ``jax.shard_map`` each device holds the rows ``[K/n, N]`` of a weight ``W [K, N]``
(``n`` devices on the FSDP axis). ``gather_weight`` is its own ``custom_vjp``:

forward
  1. quantize the local shard with the weight's GLOBAL scale (precomputed for the step, or
     reduced over the axis by :func:`global_scale`: one small all-reduce);
  2. pack payload + float32 scales into one ``uint8`` message (:mod:`jaxlowbit.parallel.wire`;
     ternary packed 2 bits per value);
  3. ``all_gather`` the messages (the only collective of the weight) and decode them into a
     :class:`~jaxlowbit.operand.LowBitOperand`: ``W [K, N]`` and ``W^T [N, K]`` quantized.
backward
  the operand's gradient (the full ``dW [K, N]`` from this device's tokens, straight through the
  quantization) ``psum_scatter`` ed back to this device's ``[K/n, N]`` rows, summed in
  ``FsdpConfig.grad_reduce_dtype`` (float32 by default, or bfloat16: half the bytes).

:func:`gather_param` is the same for a parameter that is not a linear's kernel (an embedding), and for a fused
kernel's tensor-parallel regroup: an all-gather in its own dtype (or a narrower one its reader casts to anyway)
whose gradient is reduce-scattered in the reduce dtype.

The operand then goes to the ordinary :func:`jaxlowbit.quantized_matmul`, which runs the recipe
exactly as on one device (:func:`jaxlowbit.parallel.fsdp_linear` is the two together). A weight
whose recipe computes its forward in high precision (``None``, ``Int8MixedPrecision(output=
False)``) travels in the compute dtype instead and arrives as a plain array.

What differs from ``quantized_matmul`` on the whole weight, per scaling (``Recipe.weight_scaling``):

==================  =====================================================================
scaling             difference
==================  =====================================================================
INT8 / FP8 channel  none in the forward (per-output-channel amaxes reduce exactly); grad_input
                    re-quantizes the gathered values per input channel (two roundings for
                    INT8; FP8's power-of-two scales make it exact except for subnormals)
INT8 tensor         one scale per tensor (quantized_matmul uses one per channel); grad_input
                    reuses the gathered weight as it is
FP8 tensor          none (grad_input reuses the gathered e4m3 weight: the same values)
ternary             none, except that the abs-mean of a sharded weight is summed shard by
                    shard, so its scale may differ in the last bit
high precision      none
==================  =====================================================================
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxlowbit.parallel import wire
from jaxlowbit.parallel.tensor import ColumnParallel, RowParallel
from jaxlowbit.operand import LowBitOperand, QuantizedMatrix, carrier_like
from jaxlowbit.recipes import Recipe, check_recipe
from jaxlowbit.scaling import INT8_WEIGHT_SCALINGS, Reduction, WeightScaling
from jaxlowbit_numerics import ternary

def weight_scaling(recipe: Recipe | None, int8_weight_scaling: str = "row") -> WeightScaling:
  """How FSDP gathers the weight of a linear that runs ``recipe`` (``Recipe.weight_scaling``)."""
  check_recipe(recipe, "weight_scaling")
  if int8_weight_scaling not in INT8_WEIGHT_SCALINGS:
    raise ValueError(f"int8_weight_scaling must be one of {INT8_WEIGHT_SCALINGS}, got {int8_weight_scaling!r}")
  return WeightScaling.HIGH_PRECISION if recipe is None else recipe.weight_scaling(int8_weight_scaling)


@dataclasses.dataclass(frozen=True)
class GatherLayout:
  """Static description of one gathered weight (hashable: a custom_vjp nondiff argument)."""

  scaling: WeightScaling
  axis_name: str | None
  num_shards: int
  shard_shape: tuple[int, int]  # [K/n, N]
  param_dtype: jnp.dtype  # the shard's (and its gradient's) dtype
  compute_dtype: jnp.dtype
  pack_axis: int | None  # ternary: shard axis packed 2 bits per value; None: one byte per value
  grad_reduce_dtype: jnp.dtype = jnp.dtype(jnp.float32)  # what the gradient's reduce-scatter sums in

  @property
  def full_shape(self) -> tuple[int, int]:
    return (self.shard_shape[0] * self.num_shards, self.shard_shape[1])

  @property
  def payload_shape(self) -> tuple[int, int]:
    if self.pack_axis is None:
      return self.shard_shape
    shape = list(self.shard_shape)
    shape[self.pack_axis] //= ternary.VALUES_PER_BYTE
    return tuple(shape)


def ternary_pack_axis(shard_shape: tuple[int, int]) -> int | None:
  """Axis of a ``[K/n, N]`` ternary shard packed 4 values per byte: N if it divides by 4,
  else K/n, else None (the shard travels as int8, one byte per value)."""
  for axis in (1, 0):
    if shard_shape[axis] % ternary.VALUES_PER_BYTE == 0:
      return axis
  return None


def _encode(w: jax.Array, scale: jax.Array, layout: GatherLayout) -> jax.Array:
  q = layout.scaling.quantize(w, scale)
  if layout.pack_axis is not None:
    q = ternary.pack_2bit(q, layout.pack_axis)
  return wire.encode(q, layout.scaling.dequantization(scale))


def _decode(gathered: jax.Array, layout: GatherLayout, w: jax.Array) -> LowBitOperand:
  """The gathered messages as ``W [K, N]`` and ``W^T [N, K]``, each with its scale layout."""
  scaling = layout.scaling
  payloads, scales = wire.decode(gathered, layout.payload_shape, scaling.payload_dtype, scaling.num_scales(
      layout.shard_shape[1]))
  if layout.pack_axis is not None:
    payloads = ternary.unpack_2bit(payloads, axis=layout.pack_axis + 1)
  q = payloads.reshape(layout.full_shape)
  per_column = scales.reshape(1, -1)  # [1, N] per output channel, or [1, 1]
  return LowBitOperand(
      rows=QuantizedMatrix(q, per_column, scaling.spec),
      transposed=QuantizedMatrix(q.T, per_column.T, scaling.spec),  # K-major for the forward GEMM
      carrier=carrier_like(layout.full_shape, w.dtype, w),
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gather(w: jax.Array, scale: jax.Array, layout: GatherLayout):
  if not layout.scaling.quantized:
    full = w.astype(layout.compute_dtype)
    return full if layout.axis_name is None else lax.all_gather(full, layout.axis_name, axis=0, tiled=True)
  return _decode(wire.gather(_encode(w, scale, layout), layout.axis_name), layout, w)


def _gather_fwd(w, scale, layout):
  return _gather(w, scale, layout), scale


def _reduce_scatter(dw: jax.Array, axis_name: str | None, dim: int, reduce_dtype, param_dtype) -> jax.Array:
  """The devices' full gradients ``dw`` summed in ``reduce_dtype``, this device's slice along ``dim``
  kept, in ``param_dtype`` (no collective without an axis)."""
  dw = dw.astype(reduce_dtype)
  if axis_name is not None:
    dw = lax.psum_scatter(dw, axis_name, scatter_dimension=dim, tiled=True)
  return dw.astype(param_dtype)


def _gather_bwd(layout, scale, ct):
  dw = ct.carrier if layout.scaling.quantized else ct
  return (_reduce_scatter(dw, layout.axis_name, 0, layout.grad_reduce_dtype, layout.param_dtype),
          jnp.zeros_like(scale))


_gather.defvjp(_gather_fwd, _gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gather_dense(x: jax.Array, axis_name: str, dim: int, reduce_dtype, travel_dtype):
  return lax.all_gather(x.astype(travel_dtype), axis_name, axis=dim, tiled=True).astype(x.dtype)


def _gather_dense_fwd(x, axis_name, dim, reduce_dtype, travel_dtype):
  return _gather_dense(x, axis_name, dim, reduce_dtype, travel_dtype), None


def _gather_dense_bwd(axis_name, dim, reduce_dtype, travel_dtype, residual, ct):
  del residual, travel_dtype
  return (_reduce_scatter(ct, axis_name, dim, reduce_dtype, ct.dtype),)  # ct has x's dtype


_gather_dense.defvjp(_gather_dense_fwd, _gather_dense_bwd)


def gather_param(x: jax.Array, axis_name: str, dim: int, grad_reduce_dtype="float32", travel_dtype=None) -> jax.Array:
  """``lax.all_gather(x, axis_name, axis=dim, tiled=True)`` whose gradient is reduce-scattered in
  ``grad_reduce_dtype`` (``FsdpConfig.grad_reduce_dtype``) and returned in ``x``'s dtype.

  Args:
    x: this device's shard of a parameter, any shape and floating dtype; ``dim`` is the sharded one.
    travel_dtype: the dtype the shards cross the axis in (None: ``x``'s), for a parameter that is cast to it
      after the gather anyway (a high-precision kernel's compute dtype): the cast commutes with the gather.
  Returns:
    the whole parameter (``x.shape[dim] * n`` along ``dim``), in ``x``'s dtype.
  """
  return _gather_dense(x, axis_name, dim, jnp.dtype(grad_reduce_dtype), jnp.dtype(travel_dtype or x.dtype))


def _axes_size(axes: tuple[str, ...]) -> int:
  size = 1
  for axis in axes:
    size *= lax.axis_size(axis)
  return size


def global_scale(w: jax.Array, scaling: WeightScaling, axis_name: str | None, tensor=None) -> jax.Array:
  """The quantizer's global scale of a weight sharded along dim 0 over ``axis_name``.

  One all-reduce over the axis (MAX of the amax, or SUM of the abs-sum); none when
  ``axis_name`` is None. Use :func:`jaxlowbit.parallel.precompute_scales` to get every weight's
  scale in one collective per step instead.

  Args:
    w: local ``[K/n, N]`` shard (or the whole ``[K, N]`` weight with ``axis_name=None``).
    tensor: the linear's tensor-parallel collective (``jaxlowbit.parallel.tensor``), or None:
      ``RowParallel`` weights are split along K over its axis too, ``ColumnParallel`` ones along N
      (their per-channel scales stay this device's ``[N / n]``).
  Returns:
    float32 ``()`` or ``[N]`` (per-channel scalings), no gradient.
  """
  k_axes = ((tensor.axis_name,) if isinstance(tensor, RowParallel) else ()) + ((axis_name,) if axis_name else ())
  n_axes = (tensor.axis_name,) if isinstance(tensor, ColumnParallel) else ()
  stat = scaling.statistic(lax.stop_gradient(w))
  axes = k_axes if scaling.per_channel else k_axes + n_axes  # channels split along N are this device's own
  if axes:
    stat = lax.pmax(stat, axes) if scaling.reduction is Reduction.MAX else lax.psum(stat, axes)
  return scaling.scale(stat, w.shape[0] * _axes_size(k_axes) * w.shape[1] * _axes_size(n_axes))


def gather_weight(
    w: jax.Array,
    scaling: WeightScaling,
    compute_dtype,
    *,
    scale: jax.Array | None = None,
    axis_name: str | None = None,
    tensor=None,
    grad_reduce_dtype="float32",
) -> LowBitOperand | jax.Array:
  """The whole weight ``[K, N]`` from this device's rows ``w [K/n, N]``, gathered per ``scaling``.

  Args:
    w: the local shard ``[K/n, N]`` (or the whole weight with ``axis_name=None``).
    scaling: how the weight travels (``weight_scaling(recipe, ...)``).
    compute_dtype: the dtype a high-precision weight travels in.
    scale: the weight's global scale for this step (``precompute_scales``; per channel: this
      device's channels); None reduces it here.
    axis_name: the FSDP mesh axis, or None for an unsharded weight (no collective).
    tensor: the linear's tensor-parallel collective, for a scale reduced here (:func:`global_scale`).
    grad_reduce_dtype: what the gradient's reduce-scatter sums in (``FsdpConfig.grad_reduce_dtype``).

  Returns:
    A :class:`~jaxlowbit.operand.LowBitOperand` (quantized scalings) or a ``[K, N]`` array of
    ``compute_dtype`` (high precision); differentiable in ``w``: its gradient is this device's
    rows of the full gradient summed over the axis.
  """
  num_shards = 1 if axis_name is None else lax.axis_size(axis_name)
  if scaling.quantized:
    if scale is None:
      scale = global_scale(w, scaling, axis_name, tensor)
    expected = (scaling.num_scales(w.shape[1]),) if scaling.per_channel else ()
    if scale.shape != expected:
      raise ValueError(f"gather_weight: scale must have shape {expected} for {scaling.value} weights, got {scale.shape}")
    scale = lax.stop_gradient(scale.astype(jnp.float32))
  else:
    scale = jnp.zeros((), jnp.float32)
  layout = GatherLayout(
      scaling=scaling,
      axis_name=axis_name,
      num_shards=num_shards,
      shard_shape=tuple(w.shape),
      param_dtype=jnp.dtype(w.dtype),
      compute_dtype=jnp.dtype(compute_dtype),
      pack_axis=ternary_pack_axis(tuple(w.shape)) if scaling is WeightScaling.TERNARY else None,
      grad_reduce_dtype=jnp.dtype(grad_reduce_dtype),
  )
  return _gather(w, scale, layout)


__all__ = ["GatherLayout", "gather_param", "gather_weight", "global_scale", "ternary_pack_axis", "weight_scaling"]
