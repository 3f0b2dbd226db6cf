"""Linen: run a model from parameters converted by ``quantize_params``.

``convert_for_inference(model, scheme)`` works like ``jaxlowbit.convert``: it returns an
instance of a subclass of the model's class whose public methods run under
``flax.linen.intercept_methods``. The interceptor takes over ``__call__`` of every
``nn.Dense``/``nn.DenseGeneral`` (jaxlowbit's ``Int8Dense``/``Fp8Dense``/``BitNetDense``
included) *whose parameters hold converted leaves* and runs :func:`quantized_linear` on
them; layers that still hold a ``kernel`` (filtered out at conversion, or never converted)
run unchanged. The parameter tree decides, so there is nothing to keep in sync between
the conversion and the model.
"""

from __future__ import annotations


import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxlowbit.convert import intercepted_copy
from jaxlowbit.inference.weights import CONVERTED_NAMES, check_scheme, quantized_linear, scheme_of

PARAMS = "params"


def _as_tuple(x) -> tuple:
  return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def converted_leaves(module: nn.Module) -> dict[str, jax.Array]:
  """The converted leaves a bound Dense module holds (empty when it was not converted)."""
  return {name: module.get_variable(PARAMS, name) for name in CONVERTED_NAMES if module.has_variable(PARAMS, name)}


def inference_dense(module: nn.Module, inputs: jax.Array, scheme: str, leaves: dict[str, jax.Array]) -> jax.Array:
  """The body of a converted ``Dense``/``DenseGeneral``: ``inputs [..., K]`` -> ``[..., N]``.

  Computes in ``module.dtype`` (or, when None, the promotion of the inputs' and
  ``param_dtype``, as ``DenseGeneral`` does), adds the bias (kept high precision).
  """
  name = type(module).__name__
  fqn = ".".join(str(p) for p in module.path)
  found = scheme_of(leaves)
  if scheme not in found:
    raise ValueError(f"{name} {fqn!r}: model converted for scheme {scheme} but its parameters were converted for "
                     f"{' or '.join(found) or 'nothing'}; pass the same scheme to quantize_params and "
                     "convert_for_inference")
  features = _as_tuple(module.features)
  axis = _as_tuple(getattr(module, "axis", -1))
  batch_dims = _as_tuple(getattr(module, "batch_dims", ()))
  if len(features) != 1 or len(axis) != 1 or batch_dims or axis[0] % inputs.ndim != inputs.ndim - 1:
    raise NotImplementedError(
        f"{name} {fqn!r}: inference conversion takes linears that contract the last input axis into one feature "
        f"axis (kernel [K, N]); this one has features={module.features}, axis={getattr(module, 'axis', -1)}, "
        f"batch_dims={batch_dims}. Keep it high precision: quantize_params(..., filter_fqns=(..., {fqn!r}))"
    )
  dtype = module.dtype or jnp.promote_types(jnp.result_type(inputs), module.param_dtype)
  bias = module.get_variable(PARAMS, "bias") if module.has_variable(PARAMS, "bias") else None
  inputs = jnp.asarray(inputs, dtype)
  y = quantized_linear(inputs, leaves, scheme)
  if y.shape[-1] != features[0]:
    raise ValueError(f"{name} {fqn!r}: converted weight has {y.shape[-1]} output features, the layer {features[0]}")
  if bias is not None:
    y = y + jnp.asarray(bias, dtype)
  return y


def _interceptor(scheme: str):
  def intercept(next_fun, args, kwargs, context):
    module = context.module
    if context.method_name != "__call__" or not isinstance(module, (nn.Dense, nn.DenseGeneral)):
      return next_fun(*args, **kwargs)
    leaves = converted_leaves(module)
    if not leaves:
      return next_fun(*args, **kwargs)
    inputs = args[0] if args else kwargs["inputs"]
    return inference_dense(module, inputs, scheme, leaves)

  return intercept


def convert_linen(module: nn.Module, scheme: str) -> nn.Module:
  """See :func:`jaxlowbit.inference.convert_for_inference` (Linen branch)."""
  check_scheme(scheme, "convert_for_inference")
  return intercepted_copy(module, _interceptor(scheme), "convert_for_inference", jaxlowbit_inference_scheme=scheme)
