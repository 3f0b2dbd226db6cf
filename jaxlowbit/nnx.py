"""Flax NNX layers: ``jaxlowbit.nnx.Int8Dense``, ``Fp8Dense``, ``BitNetDense``.

Subclasses of ``flax.nnx.Linear`` with its signature plus ``recipe``: same ``kernel``
``[in_features, out_features]`` and ``bias`` ``[out_features]`` parameters and the same
initialization, so state moves between them and ``nnx.Linear``. The kernel is quantized
from its stored ``param_dtype``; ``recipe=None`` computes what ``nnx.Linear`` computes.
``execution`` (a ``jaxlowbit.ExecutionOptions``) says how its kernels run, as for the Linen layers.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlowbit.execution import ExecutionOptions
from jaxlowbit.layers import check_sizes
from jaxlowbit.matmul import quantized_matmul
from jaxlowbit.recipes import BitNet, Float8, Int8MixedPrecision, check_recipe
from pallas_kernels.quantize import to_compute_dtype


# Marks "no recipe argument given" (None already means high precision).
_DEFAULT = object()


class _LowBitLinear(nnx.Linear):
  recipe_types: ClassVar[tuple[type, ...]] = ()
  default_recipe: ClassVar[Any] = None

  def __init__(self, in_features: int, out_features: int, *, recipe: Any = _DEFAULT, rngs: nnx.Rngs,
               execution: ExecutionOptions | None = None, **kwargs):
    """Args: as ``nnx.Linear`` (``use_bias``, ``dtype``, ``param_dtype``, ``precision``,
    ``kernel_init``, ``bias_init``, ``promote_dtype``, ``rngs``), plus ``recipe`` (the class's
    default recipe when omitted; None for high precision) and ``execution`` (None: the defaults)."""
    name = type(self).__name__
    check_sizes(name, in_features=in_features, out_features=out_features)
    if "dot_general" in kwargs:
      raise ValueError(f"{name}: dot_general cannot be set; the recipe decides the dot")
    recipe = self.default_recipe if recipe is _DEFAULT else recipe
    check_recipe(recipe, name)
    if recipe is not None and not isinstance(recipe, self.recipe_types):
      allowed = " or ".join(t.__name__ for t in self.recipe_types)
      raise TypeError(f"{name}: recipe must be {allowed} (or None), got {recipe!r}")
    super().__init__(in_features, out_features, rngs=rngs, **kwargs)
    self.recipe = recipe
    self.execution = execution

  def __call__(self, inputs: jax.Array) -> jax.Array:
    """``[..., in_features]`` floating inputs -> ``[..., out_features]`` in the compute dtype."""
    if not jnp.issubdtype(jnp.result_type(inputs), jnp.floating):
      raise TypeError(f"{type(self).__name__}: inputs must be floating point, got {jnp.result_type(inputs)}")
    kernel = self.kernel[...]
    bias = self.bias[...] if self.bias is not None else None
    if self.dtype is not None:  # narrowing rounds, as every layer's input cast does
      inputs = to_compute_dtype(inputs, self.dtype)
    inputs, promoted_kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
    if self.recipe is None:
      y = jax.lax.dot_general(
          inputs, promoted_kernel, (((inputs.ndim - 1,), (0,)), ((), ())), precision=self.precision
      )
    else:
      y = quantized_matmul(inputs, kernel, self.recipe, options=self.execution)
    if bias is not None:
      y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y


class Int8Dense(_LowBitLinear):
  """``nnx.Linear`` trained with INT8 mixed precision (default ``Int8MixedPrecision()``)."""

  recipe_types = (Int8MixedPrecision,)
  default_recipe = Int8MixedPrecision()


class Fp8Dense(_LowBitLinear):
  """``nnx.Linear`` trained in FP8 (default ``Float8("tensorwise")``)."""

  recipe_types = (Float8,)
  default_recipe = Float8()


class BitNetDense(_LowBitLinear):
  """``nnx.Linear`` with BitNet b1.58 ternary weights (default ``BitNet()``)."""

  recipe_types = (BitNet,)
  default_recipe = BitNet()


__all__ = ["BitNetDense", "Fp8Dense", "Int8Dense"]
