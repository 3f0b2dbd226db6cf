"""INT8 weight-only quantized training: int8 weights with no high-precision copy.

torchao's quantized-training recipe in JAX. A weight is stored as int8 codes and a float32
scale per output channel, and nothing else (1 byte per weight instead of 4):

    scale = max over the contracted dims |W| / 127        W ~= qvalue * scale

- Forward: the layer dequantizes (``qvalue * scale`` in the compute dtype) and runs a plain
  dot, or the INT8 matmuls of a :class:`~jaxlowbit.recipes.Int8MixedPrecision` recipe.
- Backward: JAX cannot differentiate an int8 array, so :func:`value_and_grad` hands the loss a
  float32 *view* of the codes, and the dequantization is a ``custom_vjp`` whose cotangent for
  the codes is ``dL/dW`` itself (straight through) and zero for the scale. The gradient tree
  has the parameters' structure, with ``dL/dW`` (float32) where the int8 codes are. That
  float32 gradient exists for one step anyway; no float32 weight is ever stored.
- Update: :func:`int8_weight_only` wraps any optax optimizer. The inner optimizer sees the
  dequantized float32 weights and their gradients (so weight decay and Adam work unchanged);
  the wrapper applies the update, recomputes each channel's scale and re-quantizes with
  stochastic rounding (unbiased, so updates far below one int8 step still count on average).
  It returns the update as *differences* (new codes - old codes, new scale - old scale), which
  ``optax.apply_updates`` adds back exactly, so the train step stays the standard one::

      loss, grads = quantized_training.value_and_grad(loss_fn)(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)   # tx = int8_weight_only(optax.adamw(...))
      params = optax.apply_updates(params, updates)

Put :func:`int8_weight_only` outermost (``optax.MultiSteps`` may wrap it, with
``accumulator_dtype=jnp.float32``); a transformation after it would break the exact differences.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.core import meta

from jaxlowbit_numerics.int8 import int8_scale, quantize_int8_with_scale
from jaxlowbit.execution import ExecutionOptions
from jaxlowbit.layers import DenseCall, check_sizes, dense_general, resolve
from jaxlowbit.matmul import quantized_dot_general
from jaxlowbit.recipes import Int8MixedPrecision, check_recipe
from jaxlowbit.rounding import stochastic_round


class Int8Weight(NamedTuple):
  """An int8 weight with one float32 scale per output channel (a parameter-tree node).

  Attributes:
    qvalue: ``[*contracted, *features]`` int8 codes in [-127, 127] (float32 inside
      :func:`value_and_grad`; the gradient tree holds ``dL/dW`` here).
    scale: ``[*features]`` float32 dequantization multiplier, ``W = qvalue * scale``.
  """

  qvalue: jax.Array
  scale: jax.Array


def _is_weight(x) -> bool:
  return isinstance(x, Int8Weight)


def _contracted_axes(w: Int8Weight) -> tuple[int, ...]:
  return tuple(range(w.qvalue.ndim - w.scale.ndim))


def quantize_weight(w: jax.Array, n_contracted: int = 1) -> Int8Weight:
  """Round-to-nearest :class:`Int8Weight` of a float kernel ``[*contracted, *features]``.

  Args:
    w: floating kernel; its first ``n_contracted`` dims are the contracted (input) dims.
    n_contracted: how many leading dims are contracted (1 for a ``[K, N]`` kernel).

  Returns:
    ``Int8Weight(qvalue int8 w.shape, scale float32 w.shape[n_contracted:])``.
  """
  if not 1 <= n_contracted < w.ndim:
    raise ValueError(f"quantize_weight: n_contracted={n_contracted} must be in [1, {w.ndim - 1}] for shape {w.shape}")
  axes = tuple(range(n_contracted))
  scale = int8_scale(jnp.max(jnp.abs(w.astype(jnp.float32)), axis=axes))
  return Int8Weight(quantize_int8_with_scale(w, scale), scale)


def dequantize_weight(w: Int8Weight, dtype=jnp.float32) -> jax.Array:
  """``qvalue * scale`` in ``dtype`` (a plain function: no gradient reaches the int8 codes)."""
  return (w.qvalue.astype(jnp.float32) * w.scale).astype(dtype)


@jax.custom_vjp
def _dequantize_ste(codes: jax.Array, scale: jax.Array) -> jax.Array:
  return codes * scale


def _dequantize_ste_fwd(codes, scale):
  return codes * scale, scale


def _dequantize_ste_bwd(scale, g):
  # Straight through: the codes' cotangent is dL/dW, what the optimizer needs; the scale is
  # recomputed from the weights at every update, so it gets none.
  return g, jnp.zeros_like(scale)


_dequantize_ste.defvjp(_dequantize_ste_fwd, _dequantize_ste_bwd)


class Int8WeightOnlyDense(nn.DenseGeneral):
  """``DenseGeneral`` whose kernel is stored as int8 + a float32 scale per output channel.

  The parameter tree is ``{"kernel": Int8Weight(qvalue, scale), "bias": ...}``; there is no
  float kernel. Train it with :func:`value_and_grad` and :func:`int8_weight_only`.

  Attributes:
    features, axis, use_bias, dtype, param_dtype (the bias's), kernel_init (called in float32,
      then rounded to int8), bias_init, precision: as in ``flax.linen.DenseGeneral``.
      ``batch_dims`` is not supported.
    recipe: None (dequantize, then a dot in the compute dtype) or an
      :class:`Int8MixedPrecision` (INT8 matmuls; quantizing the dequantized weight per channel
      gives back its codes when the channel's largest code is +-127, which updates keep true but
      for rare rounding).
    execution: how the recipe's matmuls run (:class:`jaxlowbit.ExecutionOptions`; None: the defaults,
      the backend from ``$JAXLOWBIT_BACKEND``), as ``jaxlowbit.LowBitDense``'s.
  """

  recipe: Int8MixedPrecision | None = None
  execution: ExecutionOptions | None = None

  def __post_init__(self):
    check_sizes(type(self).__name__, features=self.features)
    super().__post_init__()

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    """Applies the linear map.

    Args:
      inputs: ``[..., *contracted]`` floating array; ``axis`` picks the contracted dims.

    Returns:
      ``free input dims + features`` in the compute dtype (``dtype``, else the promotion of the
      inputs' and ``param_dtype``).
    """
    name = type(self).__name__
    check_recipe(self.recipe, name)
    if self.recipe is not None and not isinstance(self.recipe, Int8MixedPrecision):
      raise TypeError(f"{name}: recipe must be Int8MixedPrecision or None, got {self.recipe!r}")
    if self.batch_dims:
      raise ValueError(f"{name}: batch_dims={self.batch_dims} is not supported; use features/axis only")
    if self.dot_general is not None or self.dot_general_cls is not None:
      raise ValueError(f"{name}: dot_general/dot_general_cls cannot be set")
    call = resolve(self, inputs)
    contracted = call.kernel_shape[: len(call.axis)]

    def init_kernel(rng):
      w = meta.unbox(self.kernel_init(rng, call.kn, jnp.float32))
      return quantize_weight(jnp.reshape(w, call.kernel_shape), len(contracted))

    kernel = self.param("kernel", init_kernel)
    if not _is_weight(kernel):
      raise TypeError(f"{name}: params['kernel'] must be an Int8Weight, got {type(kernel).__name__}")
    return dense_general(self, inputs, self._matmul, kernel=kernel)

  def _matmul(self, call: DenseCall, inputs: jax.Array, kernel: Int8Weight) -> jax.Array:
    """The Dense body's dot on the dequantized int8 weight (straight through to the codes)."""
    if jnp.issubdtype(kernel.qvalue.dtype, jnp.floating):  # the float view of value_and_grad
      w = _dequantize_ste(kernel.qvalue.astype(jnp.float32), kernel.scale)
    else:
      w = kernel.qvalue.astype(jnp.float32) * kernel.scale
    if self.recipe is None:
      return jax.lax.dot_general(inputs, w.astype(call.dtype), call.dimension_numbers, precision=self.precision)
    return quantized_dot_general(inputs, w, call.dimension_numbers, precision=self.precision, recipe=self.recipe,
                                 options=self.execution)


def _float_view(params):
  """``params`` with every :class:`Int8Weight`'s codes as float32 (differentiable)."""
  return jax.tree.map(
      lambda x: Int8Weight(x.qvalue.astype(jnp.float32), x.scale) if _is_weight(x) else x, params, is_leaf=_is_weight
  )


def value_and_grad(fun: Callable, argnums: int = 0, has_aux: bool = False) -> Callable:
  """``jax.value_and_grad`` for parameter trees that hold :class:`Int8Weight` nodes.

  Args:
    fun: the loss, ``fun(*args) -> scalar`` (or ``(scalar, aux)`` with ``has_aux``).
    argnums: the position of the parameter tree (a single int).
    has_aux: as in ``jax.value_and_grad``.

  Returns:
    A function returning ``(value, grads)``; ``grads`` has the parameters' structure, with
    ``Int8Weight(qvalue=dL/dW float32, scale=zeros)`` at each int8 weight.
  """
  if not isinstance(argnums, int):
    raise TypeError(f"quantized_training.value_and_grad: argnums must be one int, got {argnums!r}")

  def wrapped(*args, **kwargs):
    args = list(args)
    args[argnums] = _float_view(args[argnums])
    return jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)(*args, **kwargs)

  return wrapped


def grad(fun: Callable, argnums: int = 0, has_aux: bool = False) -> Callable:
  """``jax.grad`` counterpart of :func:`value_and_grad`."""
  vg = value_and_grad(fun, argnums, has_aux)

  def wrapped(*args, **kwargs):
    value, g = vg(*args, **kwargs)
    return (g, value[1]) if has_aux else g

  return wrapped


def requantize_stochastic(w: jax.Array, old: Int8Weight, key: jax.Array) -> Int8Weight:
  """New codes and scale for the float32 weight ``w`` (same shape as ``old.qvalue``).

  The scale is each channel's ``amax / 127``, then expressed as ``old.scale + delta`` exactly
  as ``optax.apply_updates`` will compute it, and the codes are ``stochastic_round(w / scale)``
  with that scale. Channels whose weights did not change keep their scale and codes, so a zero
  update (e.g. a skipped ``MultiSteps`` mini-step) changes nothing.
  """
  axes = _contracted_axes(old)
  old_w = old.qvalue.astype(jnp.float32) * old.scale
  same = w == old_w
  new_scale = int8_scale(jnp.max(jnp.abs(w), axis=axes))
  # A channel whose weights did not move keeps its scale (amax * (1/127) may differ by an ulp).
  new_scale = jnp.where(jnp.all(same, axis=axes), old.scale, new_scale)
  scale = old.scale + (new_scale - old.scale)  # what apply_updates stores, bit for bit
  codes = stochastic_round(w / scale, key, jnp.int8)
  return Int8Weight(jnp.where(same & (scale == old.scale), old.qvalue, codes), scale)


class Int8WeightOnlyState(NamedTuple):
  """State of :func:`int8_weight_only`: the inner optimizer's, and uint32 key data."""

  inner: optax.OptState
  key: jax.Array


def int8_weight_only(inner: optax.GradientTransformation, seed: int = 0) -> optax.GradientTransformation:
  """Train :class:`Int8Weight` parameters with any optax optimizer (see the module doc).

  Args:
    inner: the optimizer (e.g. ``optax.adamw(...)``, ``jaxlowbit.optim.adamw_8bit(...)``). It
      sees float32 dequantized weights and their gradients; other parameters pass unchanged.
    seed: seed of the stochastic rounding; the state carries the key, so a restored checkpoint
      continues the same random stream.

  Returns:
    An ``optax.GradientTransformation``; ``update`` needs ``params``. Its updates for an
    ``Int8Weight`` are ``Int8Weight(new codes - old codes, new scale - old scale)`` in float32,
    which ``optax.apply_updates`` adds exactly (int8 codes stay int8).
  """
  key_data = jax.random.key_data(jax.random.key(seed))

  def weights_view(params):
    return jax.tree.map(lambda x: dequantize_weight(x) if _is_weight(x) else x, params, is_leaf=_is_weight)

  def init_fn(params):
    return Int8WeightOnlyState(inner=inner.init(weights_view(params)), key=key_data)

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError("int8_weight_only: update needs params (tx.update(grads, state, params))")
    grads = jax.tree.map(lambda g: g.qvalue if _is_weight(g) else g, updates, is_leaf=_is_weight)
    weights = weights_view(params)
    inner_updates, inner_state = inner.update(grads, state.inner, weights, **extra_args)
    key, step_key = jax.random.split(jax.random.wrap_key_data(state.key))
    leaves, treedef = jax.tree.flatten(params, is_leaf=_is_weight)
    flat_updates = treedef.flatten_up_to(inner_updates)
    flat_weights = treedef.flatten_up_to(weights)
    out = []
    for i, (p, u, w) in enumerate(zip(leaves, flat_updates, flat_weights)):
      if not _is_weight(p):
        out.append(u)
        continue
      new = requantize_stochastic(w + u.astype(jnp.float32), p, jax.random.fold_in(step_key, i))
      out.append(
          Int8Weight(new.qvalue.astype(jnp.float32) - p.qvalue.astype(jnp.float32), new.scale - p.scale)
      )
    return jax.tree.unflatten(treedef, out), Int8WeightOnlyState(inner=inner_state, key=jax.random.key_data(key))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def num_int8_bytes(params) -> dict[str, int]:
  """``{"int8": bytes of int8 codes, "scales": bytes of their scales, "other": the rest}``."""
  counts = {"int8": 0, "scales": 0, "other": 0}
  for leaf in jax.tree.leaves(params, is_leaf=_is_weight):
    if _is_weight(leaf):
      counts["int8"] += leaf.qvalue.size
      counts["scales"] += leaf.scale.size * 4
    else:
      counts["other"] += leaf.size * jnp.dtype(leaf.dtype).itemsize
  return counts


__all__ = [
    "Int8Weight",
    "Int8WeightOnlyDense",
    "Int8WeightOnlyState",
    "dequantize_weight",
    "grad",
    "int8_weight_only",
    "num_int8_bytes",
    "quantize_weight",
    "requantize_stochastic",
    "value_and_grad",
]
