"""Flax Linen layers: ``LowBitDense`` (any recipe), the named ``Int8Dense``, ``Fp8Dense``, ``BitNetDense``,
and the one Dense body.

Each layer is a drop-in for ``flax.linen.DenseGeneral`` (it *is* a subclass): same attributes,
same parameter tree (``kernel`` of shape ``batch + contracted + features``, ``bias`` of shape
``batch + features``) and the same initialization, so a checkpoint trained with one loads into
the other. The extra ``recipe`` attribute chooses the numerics; ``recipe=None`` computes
exactly what ``DenseGeneral`` computes.

With a recipe, the kernel is quantized from its stored ``param_dtype`` (float32 master
weights are not first rounded to the compute dtype) and the gradient reaches it in
``param_dtype``.

:func:`dense_general` is ``DenseGeneral.__call__``'s computation with the dot replaced; every
jaxlowbit path that runs a Dense (these layers, ``convert``, FSDP, inference, int8 weight-only
training) runs it, with its own matmul.

Example::

    layer = jaxlowbit.Int8Dense(features=4096)                 # kernel [2048, 4096] float32
    params = layer.init(jax.random.key(0), jnp.ones((8, 2048)))
    y = layer.apply(params, x)                                   # x [..., 2048] -> [..., 4096]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta

from jaxlowbit.execution import ExecutionOptions
from jaxlowbit.execution import resolve as resolve_execution
from jaxlowbit.fused import swiglu
from jaxlowbit.matmul import HIGH_PRECISION_DOT_GENERAL, quantized_dot_general, quantized_matmul
from jaxlowbit.operand import LowBitOperand, is_low_bit
from jaxlowbit.recipes import BitNet, Float8, Int8MixedPrecision, Recipe, check_recipe
from pallas_kernels.quantize import check_gate_activation, to_compute_dtype


def _as_tuple(x: int | Sequence[int]) -> tuple[int, ...]:
  return tuple(x) if isinstance(x, Sequence) else (x,)


def check_sizes(name: str, **sizes: int | Sequence[int]) -> None:
  """ValueError unless every size (an int or a sequence of ints, e.g. ``features=(8, 64)``) is a
  positive int: a layer of 0 or -1 outputs is a typo, not a layer."""
  for what, value in sizes.items():
    values = _as_tuple(value)
    if not values or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1 for v in values):
      raise ValueError(f"{name}: {what} must be a positive int (or a non-empty sequence of them), got {value!r}")


def _reshaping_init(init, flat_shape: tuple[int, ...]):
  """Call ``init`` with DenseGeneral's flattened (fan-in, fan-out) shape, then reshape."""

  def wrapped(rng, shape, dtype=jnp.float32):
    value = init(rng, flat_shape, dtype)
    if isinstance(value, meta.AxisMetadata):
      return meta.replace_boxed(value, jnp.reshape(value.unbox(), shape))
    return jnp.reshape(value, shape)

  return wrapped


@dataclasses.dataclass(frozen=True)
class DenseCall:
  """One call of a Dense-family layer, resolved: what every matmul of the Dense body needs.

  Attributes:
    module: the bound ``nn.Dense`` / ``nn.DenseGeneral``.
    features, axis, batch_dims: the layer's, normalized against the input's rank.
    input_shape: the inputs' shape.
    dtype: the compute dtype (``module.dtype``, else the promotion of inputs and ``param_dtype``).
  """

  module: nn.Module
  features: tuple[int, ...]
  axis: tuple[int, ...]
  batch_dims: tuple[int, ...]
  input_shape: tuple[int, ...]
  dtype: Any

  @property
  def free(self) -> tuple[int, ...]:
    """Input dims that are neither contracted nor batch, in order."""
    return tuple(a for a in range(len(self.input_shape)) if a not in self.axis + self.batch_dims)

  @property
  def kernel_shape(self) -> tuple[int, ...]:
    batch = tuple(self.input_shape[a] for a in self.batch_dims)
    return batch + tuple(self.input_shape[a] for a in self.axis) + self.features

  @property
  def kn(self) -> tuple[int, int]:
    """(K, N): contracted input size and output features of one kernel."""
    return math.prod(self.input_shape[a] for a in self.axis), math.prod(self.features)

  @property
  def dimension_numbers(self):
    n_batch = len(self.batch_dims)
    contract = tuple(range(n_batch, n_batch + len(self.axis)))
    return ((self.axis, contract), (self.batch_dims, tuple(range(n_batch))))

  def flat_inputs(self, inputs):
    """``inputs`` as ``[*free, K]`` (no batch dims): the contracted axes moved last and merged."""
    if is_low_bit(inputs):
      return inputs  # [M, K] already
    if self.batch_dims:
      raise NotImplementedError(f"{type(self.module).__name__}: batch_dims={self.batch_dims} is not supported here")
    free_shape = tuple(self.input_shape[a] for a in self.free)
    return jax.lax.transpose(inputs, self.free + self.axis).reshape(*free_shape, self.kn[0])

  def unflat_outputs(self, y: jax.Array) -> jax.Array:
    """``[*free, N]`` -> ``[*free, *features]``."""
    return y.reshape(*y.shape[:-1], *self.features)


def resolve(module: nn.Module, inputs: jax.Array) -> DenseCall:
  """The :class:`DenseCall` of ``module(inputs)``; ValueError for axes that do not fit the input."""
  name = type(module).__name__
  if is_low_bit(inputs):
    _check_low_bit_input(module, inputs)
  elif not jnp.issubdtype(jnp.result_type(inputs), jnp.floating):
    raise TypeError(f"{name}: inputs must be floating point, got {jnp.result_type(inputs)}")
  features = _as_tuple(module.features)
  axis = _as_tuple(getattr(module, "axis", -1))
  batch_dims = _as_tuple(getattr(module, "batch_dims", ()))
  if batch_dims and set(batch_dims) != set(range(max(batch_dims) + 1)):
    raise ValueError(f"batch_dims {batch_dims} must be consecutive leading dimensions starting from 0.")
  ndim = inputs.ndim
  for a in axis + batch_dims:
    if not -ndim <= a < ndim:
      raise ValueError(f"{name}: axis {a} out of range for input of shape {inputs.shape}")
  axis = tuple(a % ndim for a in axis)
  batch_dims = tuple(a % ndim for a in batch_dims)
  if len(set(axis + batch_dims)) != len(axis) + len(batch_dims):
    raise ValueError(f"{name}: axis {axis} and batch_dims {batch_dims} repeat an input dimension")
  dtype = inputs.dtype if is_low_bit(inputs) else module.dtype or jnp.result_type(inputs.dtype, module.param_dtype)
  return DenseCall(module, features, axis, batch_dims, tuple(inputs.shape), dtype)


def _check_low_bit_input(module: nn.Module, inputs: LowBitOperand) -> None:
  """A low-bit input (a fused producer's) is ``[M, K]`` contracted on its last axis, in the compute dtype."""
  name = type(module).__name__
  axis = _as_tuple(getattr(module, "axis", -1))
  if inputs.ndim != 2 or tuple(a % 2 for a in axis) != (1,) or _as_tuple(getattr(module, "batch_dims", ())):
    raise ValueError(f"{name}: a low-bit input must be [M, K] and contracted on its last axis (axis=-1, no "
                     f"batch_dims); got shape {inputs.shape}, axis={getattr(module, 'axis', -1)}")
  if module.dtype is not None and jnp.dtype(module.dtype) != inputs.dtype:
    raise ValueError(f"{name}: a low-bit input of dtype {inputs.dtype} needs the layer's dtype to match, "
                     f"got dtype={module.dtype}")


# matmul(call, inputs in the compute dtype, kernel as given or created) -> [*batch, *free, *features]
Matmul = Callable[[DenseCall, jax.Array, Any], jax.Array]


def dense_general(module: nn.Module, inputs: jax.Array, matmul: Matmul | Recipe | None, kernel: Any = None,
                  bias: Any = None, matmul_gates: bool = False):
  """The body of ``DenseGeneral.__call__`` (and ``Dense``'s) with the dot run by ``matmul``.

  Reads ``features``, ``axis``, ``batch_dims``, ``use_bias``, ``dtype``, ``param_dtype``,
  ``kernel_init``, ``bias_init``, ``precision`` from ``module`` (``nn.Dense`` has no
  ``axis``/``batch_dims``: they default to -1 and ()), and creates the same ``kernel``/``bias``
  parameters the Flax layer would. Must run inside a compact method of ``module`` (or an
  interceptor of one).

  Args:
    module: the bound Dense-family module.
    inputs: ``[..., *contracted]`` floating array.
    matmul: a recipe (or None: high precision) for the recipe's ``quantized_dot_general``, run
      with the module's ``execution`` options where it has them (:class:`LowBitDense`), or a
      function ``matmul(call, inputs, kernel)`` (FSDP, inference, weight-only training).
    matmul_gates: ``matmul`` returns a gated module's (:attr:`LowBitDense.gated`) ``act(gate) * up`` itself (the
      inference GEMVs form it in their epilogue); otherwise it is formed here from the product.
    kernel: the kernel to use instead of creating the ``kernel`` parameter (a local shard,
      converted leaves, an ``Int8Weight``).
    bias: the bias to use instead of the ``bias`` parameter (a tensor-parallel layer's share of
      its features), when ``module.use_bias``.

  Returns:
    ``batch + free input dims + features`` in the compute dtype, bias added.
  """
  call = resolve(module, inputs)
  if kernel is None:
    fan_in, fan_out = math.prod(call.kernel_shape[: len(call.batch_dims) + len(call.axis)]), call.kn[1]
    init = _reshaping_init(module.kernel_init, (fan_in, fan_out))
    kernel = module.param("kernel", init, call.kernel_shape, module.param_dtype)
  if not module.use_bias:
    bias = None
  elif bias is None:
    bias_shape = tuple(inputs.shape[a] for a in call.batch_dims) + call.features
    bias_init = _reshaping_init(module.bias_init, (math.prod(bias_shape),))
    bias = module.param("bias", bias_init, bias_shape, module.param_dtype)
  if bias is not None:
    bias = jnp.asarray(bias, call.dtype)
  gated = None if matmul_gates else getattr(module, "gated", None)
  if not callable(matmul):
    matmul = recipe_matmul(matmul, getattr(module, "execution", None), getattr(module, "measured", False))
  out = matmul(call, inputs if is_low_bit(inputs) else to_compute_dtype(inputs, call.dtype), kernel)
  if gated is not None:  # no bias (LowBitDense checks)
    return swiglu(out, gated, resolve_execution(getattr(module, "execution", None)).dispatch())
  if bias is not None:
    expanded = tuple(inputs.shape[a] if a in call.batch_dims else 1 for a in range(inputs.ndim) if a not in call.axis)
    # The bias's own feature dims: a tensor-parallel layer's (jaxlowbit.parallel) holds its share of them.
    out = out + jnp.reshape(bias, expanded + tuple(bias.shape[len(call.batch_dims):]))
  return out


def flat_linear(call: DenseCall, inputs, linear: Callable[[Any, bool], Any], measured: bool = False):
  """A Dense body's linear of the call's inputs: ``linear(x, measured)`` (``quantized_matmul`` or ``fsdp_linear`` of
  the layer's weight) on x flattened to ``[*free, K]``, its output ``[*free, *features]``; with ``measured``
  (:attr:`LowBitDense.measured`) on x ``[M, K]``, its :class:`~jaxlowbit.operand.MeasuredOutput` of ``[M, N]``
  values as it is. A low-bit input is ``[M, K]`` already."""
  x = call.flat_inputs(inputs)
  if not measured:
    return call.unflat_outputs(linear(x, False))
  if call.module.use_bias or len(call.features) != 1:
    raise ValueError(f"{type(call.module).__name__}: a measured output needs no bias and one features dimension; "
                     f"got use_bias={call.module.use_bias}, features={call.features}")
  return linear(x if is_low_bit(x) else x.reshape(-1, call.kn[0]), True)


def recipe_matmul(recipe: Recipe | None, options: ExecutionOptions | None = None, measured: bool = False) -> Matmul:
  """The Dense body's matmul for ``recipe``: the quantized dot of the stored kernel (None: DenseGeneral's dot),
  its kernels run as ``options`` say; ``measured``: :attr:`LowBitDense.measured`."""
  check_recipe(recipe, "dense_general")

  def matmul(call: DenseCall, inputs: jax.Array, kernel: jax.Array) -> jax.Array:
    if is_low_bit(inputs) or measured:  # [M, K] from a fused producer; or [M, N] values and their maxima slot
      w = kernel.reshape(-1, call.kn[1])
      return flat_linear(call, inputs, lambda x, m: quantized_matmul(x, w, recipe, options=options, measured=m),
                         measured)
    kernel = kernel if recipe is not None else jnp.asarray(kernel, call.dtype)  # low-bit: from the master weight
    return quantized_dot_general(inputs, kernel, call.dimension_numbers, precision=call.module.precision,
                                 recipe=recipe, options=options)

  return matmul


class LowBitDense(nn.DenseGeneral):
  """``flax.linen.DenseGeneral`` whose dot follows a recipe: the base of every jaxlowbit Dense layer.

  Same attributes, parameters (``kernel [*batch, *contracted, *features]``, ``bias [*batch,
  *features]``) and initialization as ``DenseGeneral``, so checkpoints move freely between the two;
  ``recipe`` chooses the three matmuls' numerics (None: ``DenseGeneral``'s dot; a one-row product on an NVIDIA GPU
  gets a zero second row, ``jaxlowbit.matmul``, so its float32 sums may run in another order). The named layers
  (:class:`Int8Dense`, :class:`Fp8Dense`, :class:`BitNetDense`) are subclasses that fix a recipe
  family (``recipe_types``) and a default recipe; ``jaxlowbit.convert`` leaves every instance of
  this class to its own recipe and FSDP (``jaxlowbit.parallel``) runs it with that recipe.

  Attributes:
    features, axis, batch_dims, use_bias, dtype, param_dtype, kernel_init, bias_init,
      precision, promote_dtype: as in ``flax.linen.DenseGeneral`` (``dot_general`` and
      ``dot_general_cls`` must stay None: the recipe decides the dot).
    recipe: any recipe (``jaxlowbit.recipes``), or None for high precision.
    execution: how its kernels run (:class:`jaxlowbit.ExecutionOptions`: the backend); None: the
      defaults, the backend from ``$JAXLOWBIT_BACKEND``.
    measured: return a :class:`jaxlowbit.operand.MeasuredOutput` ``(values [M, N], maxima)`` (``M``: the
      input's leading dims' product) for one consumer that measures the output gradient's amaxes for this
      layer's backward (``jaxlowbit.fused.swiglu_rms_norm_for``; any other through
      ``jaxlowbit.fused.measured_values``). Needs a recipe, no bias and one features dimension. Default False.
    gated: a gate activation (``"silu"``, ``"relu2"``: ``pallas_kernels.quantize.GATE_ACTIVATIONS``): the layer is a
      gated MLP's fused ``[gate | up]`` projection and returns ``act(gate) * up`` ``[..., features / 2]`` of its
      output (``jaxlowbit.fused.swiglu``), which a layer converted for inference forms in its decode GEMV's
      epilogue instead of writing both halves (``jaxlowbit.inference.quantized_linear``). Needs no bias, one
      features dimension of even size and no ``measured``. Default None (the output itself).
    recipe_types: class-level: the recipe classes a subclass accepts (empty: any).

  Example::

    layer = LowBitDense(features=4096, recipe=jaxlowbit.Float8("rowwise"))
    params = layer.init(jax.random.key(0), jnp.ones((8, 2048), jnp.bfloat16))
    # params["params"]["kernel"]: [2048, 4096] float32, ["bias"]: [4096] float32
    y = layer.apply(params, x)          # x [..., 2048] bfloat16 -> y [..., 4096] bfloat16
  """

  recipe: Any = None
  execution: ExecutionOptions | None = None
  measured: bool = False
  gated: str | None = None
  recipe_types: ClassVar[tuple[type, ...]] = ()

  def __post_init__(self):
    check_sizes(type(self).__name__, features=self.features)
    if self.gated is not None:
      check_gate_activation(self.gated)
      features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
      if self.use_bias or self.measured or len(features) != 1 or features[0] % 2:
        raise ValueError(f"{type(self).__name__}: a gated output needs no bias, no measured output and one even "
                         f"features dimension; got use_bias={self.use_bias}, measured={self.measured}, "
                         f"features={self.features}")
    super().__post_init__()

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
    if self.recipe is not None and self.recipe_types and not isinstance(self.recipe, self.recipe_types):
      allowed = " or ".join(t.__name__ for t in self.recipe_types)
      raise TypeError(f"{name}: recipe must be {allowed} (or None), got {self.recipe!r}")
    if self.dot_general is not None or self.dot_general_cls is not None:
      raise ValueError(f"{name}: dot_general/dot_general_cls cannot be set; the recipe decides the dot")
    return dense_general(self, inputs, self.recipe)


class Int8Dense(LowBitDense):
  """``DenseGeneral`` trained with INT8 mixed precision (:class:`Int8MixedPrecision`).

  Attributes:
    features, axis, batch_dims, use_bias, dtype, param_dtype, kernel_init, bias_init,
      precision, promote_dtype: as in ``flax.linen.DenseGeneral``.
    recipe: an :class:`Int8MixedPrecision` (default: all three matmuls INT8) or None.

  Example::

    layer = Int8Dense(features=4096)   # x [..., 2048] -> [..., 4096]; kernel [2048, 4096] float32
  """

  recipe: Int8MixedPrecision | None = Int8MixedPrecision()
  recipe_types: ClassVar[tuple[type, ...]] = (Int8MixedPrecision,)


class Fp8Dense(LowBitDense):
  """``DenseGeneral`` trained in FP8 (:class:`Float8`, tensorwise by default).

  Attributes:
    features, axis, batch_dims, use_bias, dtype, param_dtype, kernel_init, bias_init,
      precision, promote_dtype: as in ``flax.linen.DenseGeneral``.
    recipe: a :class:`Float8` (``tensorwise``, ``rowwise`` or ``rowwise_gw_hp``) or None.

  Example::

    layer = Fp8Dense(features=4096, recipe=Float8("rowwise"))
  """

  recipe: Float8 | None = Float8()
  recipe_types: ClassVar[tuple[type, ...]] = (Float8,)


class BitNetDense(LowBitDense):
  """``DenseGeneral`` with BitNet b1.58 ternary weights and int8 activations (:class:`BitNet`).

  BitNet models put an RMSNorm before each BitNet linear; that is the model's job (see
  ``train/model.py``), not this layer's.

  Attributes:
    features, axis, batch_dims, use_bias, dtype, param_dtype, kernel_init, bias_init,
      precision, promote_dtype: as in ``flax.linen.DenseGeneral``.
    recipe: a :class:`BitNet` or None.

  Example::

    layer = BitNetDense(features=4096)   # kernel [K, 4096] float32, ternary in the forward
  """

  recipe: BitNet | None = BitNet()
  recipe_types: ClassVar[tuple[type, ...]] = (BitNet,)


def dense_for(recipe: Recipe | None, *, execution: ExecutionOptions | None = None, gated: str | None = None,
              **kwargs) -> nn.Module:
  """The layer that runs ``recipe``, built with ``kwargs`` (``DenseGeneral``'s attributes).

  None gives ``nn.DenseGeneral`` (high precision: ``execution`` has nothing to say); a recipe gives
  the named layer of its family (``Int8Dense``, ``Fp8Dense``, ``BitNetDense``: each declares its
  ``recipe_types``), or :class:`LowBitDense` itself, with ``execution`` as its options. ``gated``
  (:attr:`LowBitDense.gated`) gives a jaxlowbit layer for None too: ``LowBitDense`` without a recipe has
  ``nn.DenseGeneral``'s parameters and dot.
  """
  check_recipe(recipe, "dense_for")
  if gated is not None:
    kwargs["gated"] = gated
  if recipe is None and gated is None:  # its dot: lax.dot_general, one-row products kept GEMMs on GPUs (decode)
    return nn.DenseGeneral(**{"dot_general": HIGH_PRECISION_DOT_GENERAL, **kwargs})
  named = [cls for cls in (Int8Dense, Fp8Dense, BitNetDense) if isinstance(recipe, cls.recipe_types)]
  return (named[0] if named else LowBitDense)(recipe=recipe, execution=execution, **kwargs)


__all__ = ["BitNetDense", "DenseCall", "Fp8Dense", "Int8Dense", "LowBitDense", "dense_for", "dense_general",
           "flat_linear", "resolve"]
