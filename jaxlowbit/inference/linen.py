"""Linen: run a model from parameters converted by ``quantize_params``.

``convert_for_inference(model, scheme)`` works like ``jaxlowbit.convert``: it returns an
instance of a subclass of the model's class whose public methods run under
``flax.linen.intercept_methods``. The interceptor takes over ``__call__`` of every
``nn.Dense``/``nn.DenseGeneral`` (jaxlowbit's ``Int8Dense``/``Fp8Dense``/``BitNetDense``
included) *whose parameters hold converted leaves* and runs :func:`quantized_linear` on
them; layers that still hold a ``kernel`` (filtered out at conversion, or never converted)
run unchanged. The parameter tree decides, so there is nothing to keep in sync between
the conversion and the model. The converted linears run on the conversion's ``execution``
options, else the model's own (a model that declares an ``execution`` field), else the
intercepted layer's (a jaxlowbit layer's ``execution``), else the defaults.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxlowbit.execution import EXECUTION_FIELD, ExecutionOptions, with_execution
from jaxlowbit.inference.weights import (CONVERTED_NAMES, check_scheme, decode_input_rows, decode_input_spec,
                                         gated_outputs, quantized_linear, scheme_of)
from jaxlowbit.interception import PASS, dense_interceptor, intercepted_copy
from jaxlowbit.layers import DenseCall, dense_general
from jaxlowbit.operand import LowBitOperand, QuantizedMatrix, is_low_bit
from pallas_kernels.reference import quantize_cols_t_reference

PARAMS = "params"


def converted_leaves(module: nn.Module) -> dict[str, jax.Array]:
  """The converted leaves a bound Dense module holds (empty when it was not converted)."""
  return {name: module.get_variable(PARAMS, name) for name in CONVERTED_NAMES if module.has_variable(PARAMS, name)}


def _inference_matmul(scheme: str, path: str, execution: ExecutionOptions | None = None):
  """The Dense body's matmul on converted leaves (``quantized_linear`` on ``execution``), for ``[K, N]`` linears."""

  def matmul(call: DenseCall, inputs, leaves) -> jax.Array:
    name = type(call.module).__name__
    found = scheme_of(leaves)
    if scheme not in found:
      raise ValueError(f"{name} {path!r}: model converted for scheme {scheme} but its parameters were converted for "
                       f"{' or '.join(found) or 'nothing'}; pass the same scheme to quantize_params and "
                       "convert_for_inference")
    if len(call.features) != 1 or len(call.axis) != 1 or call.batch_dims or call.axis[0] != len(call.input_shape) - 1:
      raise NotImplementedError(
          f"{name} {path!r}: inference conversion takes linears that contract the last input axis into one feature "
          f"axis (kernel [K, N]); this one has features={call.features}, axis={call.axis}, "
          f"batch_dims={call.batch_dims}. Keep it high precision: quantize_params(..., filter_fqns=(..., {path!r}))"
      )
    # A gated layer (jaxlowbit.LowBitDense.gated: a gated MLP's [gate | up]) returns act(gate) * up, N / 2 wide.
    gated = getattr(call.module, "gated", None)
    y = quantized_linear(inputs, leaves, scheme, options=execution, gated=gated)
    n = y.shape[-1] * (1 if gated is None else 2)  # gated: act(gate) * up, half of the weight's outputs
    if n != call.features[0]:
      raise ValueError(f"{name} {path!r}: converted weight has {n} output features, the layer {call.features[0]}")
    return y

  return matmul


def inference_dense(module: nn.Module, inputs: jax.Array, scheme: str, leaves: dict[str, jax.Array],
                    execution: ExecutionOptions | None = None) -> jax.Array:
  """The body of a converted ``Dense``/``DenseGeneral``: ``inputs [..., K]`` -> ``[..., N]``.

  Computes in ``module.dtype`` (or, when None, the promotion of the inputs' and
  ``param_dtype``, as ``DenseGeneral`` does), adds the bias (kept high precision). The GEMM
  runs on ``execution`` (None: the layer's own ``execution`` field if it has one, else the defaults).
  """
  path = ".".join(str(p) for p in module.path)
  execution = execution if execution is not None else getattr(module, EXECUTION_FIELD, None)
  return dense_general(module, inputs, _inference_matmul(scheme, path, execution), kernel=leaves, matmul_gates=True)


def _handler(scheme: str, execution: ExecutionOptions | None):
  def handle(module, inputs, path):
    del path
    leaves = converted_leaves(module)
    if leaves:
      return inference_dense(module, inputs, scheme, leaves, execution)
    if is_low_bit(inputs):  # a layer left unconverted (or being initialized) under a norm that hands codes
      recipe = getattr(module, "recipe", None)
      return dense_general(module, unconverted_input(inputs, recipe), recipe)
    return PASS

  return handle


def unconverted_input(x: LowBitOperand, recipe) -> LowBitOperand | jax.Array:
  """What a Dense left unconverted reads of a decode norm's codes ``x [M, K]``: the operand itself where its
  ``recipe`` quantizes its input rows that way, so its forward multiplies those very codes (with ``x^T`` quantized
  from their values where the recipe asks for a layout of its own: only its backward reads it); else the norm's
  output where the norm kept it (``x.values``: exactly what it reads unconverted), else the codes' values in
  float32."""
  how = None if recipe is None else recipe.input_quantization()
  if how is None or how.rows != x.rows.spec:
    return x.values if x.values is not None else x.rows.dequantize(jnp.float32)
  if how.transposed is None or how.transposed_from_rows:
    return x
  transposed = QuantizedMatrix(*quantize_cols_t_reference(x.rows.dequantize(jnp.float32), how.transposed),
                               how.transposed)
  return dataclasses.replace(x, transposed=transposed)


def convert_linen(module: nn.Module, scheme: str, execution: ExecutionOptions | None = None) -> nn.Module:
  """See :func:`jaxlowbit.inference.convert_for_inference` (Linen branch)."""
  check_scheme(scheme, "convert_for_inference")
  # The converted linears read high-precision inputs: the model's fused quantizers stay off (its
  # execution options say so, for a model that takes them); ternary's (and W8A8's, where the policy says so) take the
  # per-token codes a decode step's norm makes for them (ExecutionOptions.decode_inputs,
  # jaxlowbit.fused.decode_quantization); ternary's and W8A16's decode gate_up GEMVs write act(gate) * up
  # (ExecutionOptions.gated_outputs).
  module = with_execution(module, fused_quantizers=False, decode_inputs=decode_input_spec(scheme),
                          decode_input_rows=decode_input_rows(scheme), gated_outputs=gated_outputs(scheme))
  if execution is None:  # the model's own options, for a model that takes them
    execution = getattr(module, EXECUTION_FIELD, None)
  return intercepted_copy(module, dense_interceptor(_handler(scheme, execution)), "convert_for_inference",
                          jaxlowbit_inference_scheme=scheme)
