"""``fsdp_linear``: ``y = x @ W`` for a weight sharded along K, gathered low-bit in ONE collective.

Inside ``jax.shard_map``, each device holds ``W``'s rows ``[K/n, N]`` (``n`` devices on the
FSDP axis) and its own tokens ``x [M, K]``. One ``jax.custom_vjp`` does "gather + matmul":

forward
  1. quantize the local shard with the weight's GLOBAL scale (precomputed for the step,
     or reduced over the axis here: one small all-reduce);
  2. pack payload + float32 scales into one ``uint8`` message (:mod:`jaxlowbit.fsdp.wire`;
     ternary packed 2 bits per value);
  3. ``all_gather`` the messages (the only collective of the weight), unpack to ``[K, N]``;
  4. the recipe's low-bit forward through ``pallas_kernels.dispatch.scaled_matmul``.
backward
  ``dx`` from the gathered low-bit weight (saved from the forward or gathered again, per
  ``FsdpConfig.remat``), ``dW`` per the recipe from the local tokens, then
  ``psum_scatter`` of ``dW`` back to the ``[K/n, N]`` shard.

The activation and gradient quantizations are ``quantized_matmul``'s own (its specs and
``pallas_kernels.dispatch`` quantizers, in the same order and layouts), so only the
weight's side can differ from it. Per recipe, against ``quantized_matmul`` run
on the full weight with the same tokens:

==============================  ==========  ======================================================
recipe (weight scaling)         forward     backward
==============================  ==========  ======================================================
Float8 tensorwise               identical   identical (grad_input reuses the gathered e4m3 weight,
                                            which is the one quantized_matmul computes)
Float8 rowwise, rowwise_gw_hp   identical   grad_input re-quantizes the gathered weight per input
                                            channel (power-of-two scales: equal to quantizing W
                                            except where a value is subnormal in one of the scales)
BitNet                          identical*  identical* (*the abs-mean of a sharded weight is summed
                                            shard by shard: its scale may differ from
                                            quantized_matmul's in the last bit)
INT8, ``"row"`` (default)       identical   grad_input re-quantizes the dequantized gathered weight
                                            per input channel (two roundings instead of one)
INT8, ``"tensor"``              per-tensor  grad_input uses the same per-tensor int8 weight
                                W scale
high precision (None, INT8      identical   dW accumulated and kept in float32 (quantized_matmul's
output=False)                               autodiff rounds it to a 16-bit compute dtype first); INT8
                                            grad_input quantizes the compute-dtype weight
==============================  ==========  ======================================================

grad_weight never touches W, so it is identical in every case (before the reduction over
devices). A high-precision grad_input of a low-bit-gathered weight (``Int8MixedPrecision(
grad_input=False)``) multiplies by the dequantized gathered weight: only the owning device
has the master weight's rows. Activation scales are per device, as in any data-parallel run: per-token scales
are unaffected, per-tensor and per-column (over tokens) ones see the local tokens only.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxlowbit_numerics import ternary
from jaxlowbit.fsdp import wire
from jaxlowbit.fsdp.config import FsdpConfig
from jaxlowbit.fsdp.scaling import Reduction, WeightScaling, weight_scaling
from jaxlowbit.matmul import BITNET_ACTIVATIONS, INT8_ROWS, hp_dot, match_varying_axes, operand_plan, rows_and_cols_t
from jaxlowbit.recipes import BitNet, Recipe, check_recipe
from pallas_kernels import dispatch


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Static description of one gathered linear (hashable: a custom_vjp nondiff argument)."""

  recipe: Recipe | None
  scaling: WeightScaling
  axis_name: str | None
  num_shards: int
  shard_shape: tuple[int, int]  # [K/n, N]
  param_dtype: jnp.dtype
  compute_dtype: jnp.dtype
  pack_axis: int | None  # ternary: shard axis packed 2 bits per value; None: one byte per value
  regather: bool

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

  @property
  def num_scales(self) -> int:
    return self.scaling.num_scales(self.shard_shape[1])


def ternary_pack_axis(shard_shape: tuple[int, int]) -> int | None:
  """Axis of a ``[K/n, N]`` ternary shard packed 4 values per byte: N if it divides by 4,
  else K/n, else None (the shard travels as int8, one byte per value)."""
  for axis in (1, 0):
    if shard_shape[axis] % ternary.VALUES_PER_BYTE == 0:
      return axis
  return None


# ---------------------------------------------------------------------------------------------
# Wire: local shard -> message -> gathered full weight.


def _encode(w: jax.Array, scale: jax.Array, layout: _Layout) -> jax.Array:
  if not layout.scaling.quantized:
    return w.astype(layout.compute_dtype)
  q = layout.scaling.quantize(w, scale)
  if layout.pack_axis is not None:
    q = ternary.pack_2bit(q, layout.pack_axis)
  return wire.encode(q, layout.scaling.dequantization(scale))


def _gather(message: jax.Array, layout: _Layout) -> jax.Array:
  if not layout.scaling.quantized:
    if layout.axis_name is None:
      return message
    return lax.all_gather(message, layout.axis_name, axis=0, tiled=True)
  return wire.gather(message, layout.axis_name)


def _decode(gathered: jax.Array, layout: _Layout) -> tuple[jax.Array, jax.Array | None]:
  """``(W [K, N], dequantization scale () or [N])``; high precision: ``(W, None)``."""
  if not layout.scaling.quantized:
    return gathered, None
  payloads, scales = wire.decode(
      gathered, layout.payload_shape, layout.scaling.payload_dtype, layout.num_scales
  )
  if layout.pack_axis is not None:
    payloads = ternary.unpack_2bit(payloads, axis=layout.pack_axis + 1)
  w = payloads.reshape(layout.full_shape)
  return w, (scales if layout.scaling.per_channel else scales.reshape(()))


def _dequantize(q: jax.Array, d: jax.Array) -> jax.Array:
  """float32 ``[K, N]`` values of a gathered weight (``d``: one scale or one per column)."""
  return q.astype(jnp.float32) * d


# ---------------------------------------------------------------------------------------------
# The recipe's three matmuls against the gathered weight.


def _forward(x: jax.Array, w: jax.Array, d, layout: _Layout):
  """``(y, what grad_weight keeps of x)``, as ``quantized_matmul``'s forward computes them."""
  recipe = layout.recipe
  if isinstance(recipe, BitNet):
    xq, sx = dispatch.quantize_rows(x, BITNET_ACTIVATIONS)
    # The straight-through grad_weight multiplies by the quantized x: int8 + one scale per row.
    return dispatch.scaled_matmul(xq, sx, w.T, d, x.dtype), (xq, sx)
  plan = operand_plan(recipe) if recipe is not None else None
  if plan is None or not layout.scaling.quantized:  # W arrived in the compute dtype
    y = hp_dot(x, w, x.dtype)
    x_rows, x_cols_t = None, None
    if plan and plan.grad_weight:
      x_cols_t = dispatch.quantize_cols_t(x, plan.grad_weight[0])
  else:
    # x per token for the forward and, for grad_weight, per input feature (transposed).
    x_rows, x_cols_t = rows_and_cols_t(x, plan.output[0], plan.grad_weight[0] if plan.grad_weight else None)
    y = dispatch.scaled_matmul(*x_rows, w.T, d, x.dtype)
  return y, (x_cols_t if plan and plan.grad_weight else x)


def _grad_input(g: jax.Array, g_rows, w: jax.Array, d, layout: _Layout) -> jax.Array:
  recipe, scaling = layout.recipe, layout.scaling
  if recipe is None:
    return hp_dot(g, w.T, g.dtype)
  if isinstance(recipe, BitNet):
    if recipe.grad_input:
      return dispatch.scaled_matmul(*dispatch.quantize_rows(g, INT8_ROWS), w, d, g.dtype)  # Wq is exact in int8
    w_fake = (w.astype(jnp.float32) * d).astype(g.dtype)  # weight-sized: cheap
    return hp_dot(g, w_fake.T, g.dtype)
  plan = operand_plan(recipe)
  if not plan.grad_input:
    return hp_dot(g, (_dequantize(w, d) if scaling.quantized else w).T, g.dtype)
  if not scaling.quantized:  # INT8 with a high-precision forward: W arrived in the compute dtype
    right = dispatch.quantize_rows(w, plan.grad_input[1])
  elif scaling in (WeightScaling.INT8_TENSOR, WeightScaling.FP8_TENSOR):
    right = (w, d)  # one scale serves rows and columns alike: the gathered weight as it is
  else:
    right = dispatch.quantize_rows(_dequantize(w, d), plan.grad_input[1])  # per input channel, from the gathered weight
  return dispatch.scaled_matmul(*g_rows, *right, g.dtype)


def _grad_weight(saved_x, g: jax.Array, g_cols_t, layout: _Layout) -> jax.Array:
  recipe, dtype = layout.recipe, layout.param_dtype
  if isinstance(recipe, BitNet):
    xq, sx = saved_x
    # Both forms run in g's dtype, as quantized_matmul's straight-through backward does.
    if recipe.grad_weight:
      # dW[k, n] = sum_m xq[m, k] * (sx[m] g[m, n]): xq stays exact, sx*g is quantized per n.
      scaled_g = (g.astype(jnp.float32) * sx).astype(g.dtype)
      qgt, sgt = dispatch.quantize_cols_t(scaled_g, INT8_ROWS)
      return dispatch.scaled_matmul(xq.T, jnp.ones((), jnp.float32), qgt, sgt, dtype)
    x_fake = (xq.astype(jnp.float32) * sx).astype(g.dtype)
    return hp_dot(x_fake.T, g, dtype)
  if g_cols_t is not None:
    qxt, sxt = saved_x  # x^T [K, M], per input feature
    return dispatch.scaled_matmul(qxt, sxt, *g_cols_t, dtype)
  return hp_dot(saved_x.T, g, dtype)


def _gradient_quantizations(g: jax.Array, layout: _Layout):
  """g per token (grad_input) and per output feature, transposed (grad_weight), in one pass."""
  recipe = layout.recipe
  if recipe is None or isinstance(recipe, BitNet):
    return None, None
  plan = operand_plan(recipe)
  return rows_and_cols_t(
      g, plan.grad_input[0] if plan.grad_input else None, plan.grad_weight[1] if plan.grad_weight else None
  )


# ---------------------------------------------------------------------------------------------
# custom_vjp: gather + matmul.


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gathered_linear(x: jax.Array, w: jax.Array, scale: jax.Array, layout: _Layout) -> jax.Array:
  return _gathered_linear_fwd(x, w, scale, layout)[0]


def _gathered_linear_fwd(x, w, scale, layout):
  message = _encode(w, scale, layout)
  gathered = _gather(message, layout)
  full, d = _decode(gathered, layout)
  y, saved_x = _forward(x, full, d, layout)
  kept = message if layout.regather else gathered
  return y, (saved_x, kept, scale)


def _gathered_linear_bwd(layout, residuals, g):
  saved_x, kept, scale = residuals
  if layout.regather:
    # The barrier makes this a new all-gather: XLA would otherwise merge it with the
    # forward's identical one (CSE) and keep the gathered weight alive after all.
    gathered = _gather(lax.optimization_barrier(kept), layout)
  else:
    gathered = kept
  full, d = _decode(gathered, layout)
  g_rows, g_cols_t = _gradient_quantizations(g, layout)
  dx = _grad_input(g, g_rows, full, d, layout)
  dw = _grad_weight(saved_x, g, g_cols_t, layout)
  if layout.axis_name is not None:
    dw = lax.psum_scatter(dw, layout.axis_name, scatter_dimension=0, tiled=True)
  return dx, dw, jnp.zeros_like(scale)


_gathered_linear.defvjp(_gathered_linear_fwd, _gathered_linear_bwd)


# ---------------------------------------------------------------------------------------------
# Public entry point.


def global_scale(w: jax.Array, scaling: WeightScaling, axis_name: str | None) -> jax.Array:
  """The quantizer's global scale of a weight sharded along dim 0 over ``axis_name``.

  One all-reduce over the axis (MAX of the amax, or SUM of the abs-sum); none when
  ``axis_name`` is None. Use :func:`jaxlowbit.fsdp.precompute_scales` to get every weight's
  scale in one collective per step instead.

  Args:
    w: local ``[K/n, N]`` shard (or the whole ``[K, N]`` weight with ``axis_name=None``).
  Returns:
    float32 ``()`` or ``[N]`` (per-channel scalings), no gradient.
  """
  stat = scaling.statistic(lax.stop_gradient(w))
  n = 1
  if axis_name is not None:
    n = lax.axis_size(axis_name)
    stat = lax.pmax(stat, axis_name) if scaling.reduction is Reduction.MAX else lax.psum(stat, axis_name)
  return scaling.scale(stat, w.shape[0] * n * w.shape[1])


def fsdp_linear(
    x: jax.Array,
    w: jax.Array,
    recipe: Recipe | None,
    *,
    scale: jax.Array | None = None,
    axis_name: str | None = None,
    config: FsdpConfig = FsdpConfig(),
) -> jax.Array:
  """``x @ W`` for a weight ``W [K, N]`` sharded along K over the mesh axis ``axis_name``.

  Call inside ``jax.shard_map`` (with ``axis_name`` bound) or anywhere with
  ``axis_name=None``, which runs the same numerics on a whole weight without collectives.

  Args:
    x: ``[..., K]`` float32/bfloat16/float16 activations (the local tokens).
    w: the local shard ``[K/n, N]`` (rows ``i*K/n ... (i+1)*K/n`` on device ``i`` of the
      axis), or the whole ``[K, N]`` when ``axis_name`` is None.
    recipe: :class:`Int8MixedPrecision`, :class:`Float8`, :class:`BitNet` or None.
    scale: the weight's global scale for this step (``precompute_scales``: float32 ``()``
      or ``[N]``); None computes it here with one all-reduce over the axis.
    axis_name: the FSDP mesh axis, or None for an unsharded weight.
    config: ``int8_weight_scaling`` and ``remat`` are read from it.

  Returns:
    ``[..., N]`` in x's dtype; differentiable in x (``dx`` in x's dtype) and w (``dw`` the
    ``[K/n, N]`` shard of the full gradient summed over devices, in w's dtype).
  """
  check_recipe(recipe, "fsdp_linear")
  for name, a in (("x", x), ("w", w)):
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise TypeError(f"fsdp_linear: {name} must be floating point, got {a.dtype}")
  if w.ndim != 2:
    raise ValueError(f"fsdp_linear: w must be a 2-D [K/n, N] shard, got shape {w.shape}")
  num_shards = 1 if axis_name is None else lax.axis_size(axis_name)
  k = w.shape[0] * num_shards
  if x.ndim < 1 or x.shape[-1] != k:
    raise ValueError(
        f"fsdp_linear: x {x.shape} must end in K={k} (w shard {w.shape} x {num_shards} shards on {axis_name!r})"
    )
  scaling = weight_scaling(recipe, config.int8_weight_scaling)
  if scaling.quantized:
    if scale is None:
      scale = global_scale(w, scaling, axis_name)
    expected = (scaling.num_scales(w.shape[1]),) if scaling.per_channel else ()
    if scale.shape != expected:
      raise ValueError(f"fsdp_linear: scale must have shape {expected} for {scaling.value} weights, got {scale.shape}")
    scale = lax.stop_gradient(scale.astype(jnp.float32))
  else:
    scale = jnp.zeros((), jnp.float32)
  layout = _Layout(
      recipe=recipe,
      scaling=scaling,
      axis_name=axis_name,
      num_shards=num_shards,
      shard_shape=tuple(w.shape),
      param_dtype=jnp.dtype(w.dtype),
      compute_dtype=jnp.dtype(x.dtype),
      pack_axis=ternary_pack_axis(tuple(w.shape)) if scaling is WeightScaling.TERNARY else None,
      regather=config.remat == "regather",
  )
  x, w = match_varying_axes(x, w)
  batch_shape = x.shape[:-1]
  y = _gathered_linear(x.reshape(math.prod(batch_shape), k), w, scale, layout)
  return y.reshape(*batch_shape, w.shape[1])


__all__ = ["fsdp_linear", "global_scale", "ternary_pack_axis"]
