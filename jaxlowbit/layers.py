"""Flax Linen layers: ``Int8Dense``, ``Fp8Dense``, ``BitNetDense``.

Each is a drop-in for ``flax.linen.DenseGeneral`` (it *is* a subclass): same attributes,
same parameter tree (``kernel`` of shape ``batch + contracted + features``, ``bias`` of
shape ``batch + features``) and the same initialization, so a checkpoint trained with one
loads into the other. The extra ``recipe`` attribute chooses the numerics; ``recipe=None``
computes exactly what ``DenseGeneral`` computes.

With a recipe, the kernel is quantized from its stored ``param_dtype`` (float32 master
weights are not first rounded to the compute dtype) and the gradient reaches it in
``param_dtype``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta

from jaxlowbit.matmul import quantized_dot_general
from jaxlowbit.recipes import BitNet, Float8, Int8MixedPrecision, Recipe, check_recipe


def _as_tuple(x: int | Sequence[int]) -> tuple[int, ...]:
  return tuple(x) if isinstance(x, Sequence) else (x,)


def _reshaping_init(init, flat_shape: tuple[int, ...]):
  """Call ``init`` with DenseGeneral's flattened (fan-in, fan-out) shape, then reshape."""

  def wrapped(rng, shape, dtype=jnp.float32):
    value = init(rng, flat_shape, dtype)
    if isinstance(value, meta.AxisMetadata):
      return meta.replace_boxed(value, jnp.reshape(value.unbox(), shape))
    return jnp.reshape(value, shape)

  return wrapped


def dense_general(module: nn.Module, inputs: jax.Array, recipe: Recipe | None) -> jax.Array:
  """The body of ``DenseGeneral.__call__`` (and ``Dense``'s), with the dot run by ``recipe``.

  Reads ``features``, ``axis``, ``batch_dims``, ``use_bias``, ``dtype``, ``param_dtype``,
  ``kernel_init``, ``bias_init``, ``precision`` and ``promote_dtype`` from ``module``
  (``nn.Dense`` has no ``axis``/``batch_dims``: they default to -1 and ()), and creates the
  same ``kernel``/``bias`` parameters the Flax layer would. Must run inside a compact method
  of ``module`` (or an interceptor of one).
  """
  features = _as_tuple(module.features)
  axis = _as_tuple(getattr(module, "axis", -1))
  batch_dims = _as_tuple(getattr(module, "batch_dims", ()))
  if batch_dims and set(batch_dims) != set(range(max(batch_dims) + 1)):
    raise ValueError(f"batch_dims {batch_dims} must be consecutive leading dimensions starting from 0.")
  ndim = inputs.ndim
  for a in axis + batch_dims:
    if not -ndim <= a < ndim:
      raise ValueError(f"{type(module).__name__}: axis {a} out of range for input of shape {inputs.shape}")
  axis = tuple(a % ndim for a in axis)
  batch_dims = tuple(a % ndim for a in batch_dims)
  n_batch, n_axis = len(batch_dims), len(axis)

  batch_shape = tuple(inputs.shape[a] for a in batch_dims)
  kernel_shape = batch_shape + tuple(inputs.shape[a] for a in axis) + features
  fan_in, fan_out = math.prod(kernel_shape[: n_batch + n_axis]), math.prod(features)
  kernel_init = _reshaping_init(module.kernel_init, (fan_in, fan_out))
  kernel = module.param("kernel", kernel_init, kernel_shape, module.param_dtype)
  bias = None
  if module.use_bias:
    bias_shape = batch_shape + features
    bias_init = _reshaping_init(module.bias_init, (math.prod(bias_shape),))
    bias = module.param("bias", bias_init, bias_shape, module.param_dtype)

  inputs, promoted_kernel, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
  batch_ind = tuple(range(n_batch))
  contract_ind = tuple(range(n_batch, n_batch + n_axis))
  out = quantized_dot_general(
      inputs,
      promoted_kernel if recipe is None else kernel,
      ((axis, contract_ind), (batch_dims, batch_ind)),
      precision=module.precision,
      recipe=recipe,
  )
  if bias is not None:
    expanded = tuple(inputs.shape[a] if a in batch_dims else 1 for a in range(ndim) if a not in axis)
    out = out + jnp.reshape(bias, expanded + features)
  return out


class _LowBitDenseGeneral(nn.DenseGeneral):
  """DenseGeneral whose dot follows ``recipe``; subclasses fix the recipe family."""

  recipe: Any = None
  recipe_types: ClassVar[tuple[type, ...]] = ()

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    """Applies the quantized linear map.

    Args:
      inputs: ``[..., *contracted]`` floating array; ``axis`` picks the contracted dims.

    Returns:
      ``batch + free input dims + features`` in the promoted compute dtype.
    """
    name = type(self).__name__
    check_recipe(self.recipe, name)
    if self.recipe is not None and not isinstance(self.recipe, self.recipe_types):
      allowed = " or ".join(t.__name__ for t in self.recipe_types)
      raise TypeError(f"{name}: recipe must be {allowed} (or None), got {self.recipe!r}")
    if self.dot_general is not None or self.dot_general_cls is not None:
      raise ValueError(f"{name}: dot_general/dot_general_cls cannot be set; the recipe decides the dot")
    if not jnp.issubdtype(jnp.result_type(inputs), jnp.floating):
      raise TypeError(f"{name}: inputs must be floating point, got {jnp.result_type(inputs)}")
    return dense_general(self, inputs, self.recipe)


class Int8Dense(_LowBitDenseGeneral):
  """``DenseGeneral`` trained with INT8 mixed precision (:class:`Int8MixedPrecision`).

  Attributes:
    features, axis, batch_dims, use_bias, dtype, param_dtype, kernel_init, bias_init,
      precision, promote_dtype: as in ``flax.linen.DenseGeneral``.
    recipe: an :class:`Int8MixedPrecision` (default: all three matmuls INT8) or None.
  """

  recipe: Int8MixedPrecision | None = Int8MixedPrecision()
  recipe_types: ClassVar[tuple[type, ...]] = (Int8MixedPrecision,)


class Fp8Dense(_LowBitDenseGeneral):
  """``DenseGeneral`` trained in FP8 (:class:`Float8`, tensorwise by default).

  Attributes:
    features, axis, batch_dims, use_bias, dtype, param_dtype, kernel_init, bias_init,
      precision, promote_dtype: as in ``flax.linen.DenseGeneral``.
    recipe: a :class:`Float8` (``tensorwise``, ``rowwise`` or ``rowwise_gw_hp``) or None.
  """

  recipe: Float8 | None = Float8()
  recipe_types: ClassVar[tuple[type, ...]] = (Float8,)


class BitNetDense(_LowBitDenseGeneral):
  """``DenseGeneral`` with BitNet b1.58 ternary weights and int8 activations (:class:`BitNet`).

  BitNet models put an RMSNorm before each BitNet linear; that is the model's job (see
  ``train/model.py``), not this layer's.

  Attributes:
    features, axis, batch_dims, use_bias, dtype, param_dtype, kernel_init, bias_init,
      precision, promote_dtype: as in ``flax.linen.DenseGeneral``.
    recipe: a :class:`BitNet` or None.
  """

  recipe: BitNet | None = BitNet()
  recipe_types: ClassVar[tuple[type, ...]] = (BitNet,)


LAYER_FOR_RECIPE = {Int8MixedPrecision: Int8Dense, Float8: Fp8Dense, BitNet: BitNetDense}


def dense_for(recipe: Recipe | None, **kwargs) -> nn.Module:
  """The layer class that runs ``recipe`` (``nn.DenseGeneral`` for None), built with ``kwargs``."""
  check_recipe(recipe, "dense_for")
  if recipe is None:
    return nn.DenseGeneral(**kwargs)
  return LAYER_FOR_RECIPE[type(recipe)](recipe=recipe, **kwargs)


__all__ = ["BitNetDense", "Fp8Dense", "Int8Dense", "dense_for", "dense_general"]
