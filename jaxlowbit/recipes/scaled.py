"""Recipes whose three matmuls each quantize both operands with a scale (INT8, FP8).

A :class:`ScaledRecipe` is described by its :class:`OperandPlan`: for each matmul, the
``QuantSpec`` of its left and right operand, or None to run it in high precision. Operand
layouts per matmul (for ``x [M, K]``, ``W [K, N]``, ``g [M, N]``; both GEMM operands K-major):

=============  ===================  =====================  ===========================
matmul         left ``[rows, K']``  right ``[cols, K']``   scales
=============  ===================  =====================  ===========================
output         x   ``[M, K]``       W^T ``[N, K]``         per token x per out channel
grad_input     g   ``[M, N]``       W   ``[K, N]``         per token x per in channel
grad_weight    x^T ``[K, M]``       g^T ``[N, M]``         per in feature x per out feature
=============  ===================  =====================  ===========================

Only what the backward needs is kept: the quantized ``x^T`` (a half or a quarter of x's bytes)
when grad_weight is low-bit, x itself otherwise, and W (a parameter, alive anyway; its backward
quantization is recomputed). A weight that arrives low-bit (FSDP's gathered weight) serves
grad_input as it is when its quantization can (one scale per tensor), and is re-quantized per
input channel from its values otherwise.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxlowbit.operand import LowBitOperand, QuantizedMatrix, is_low_bit
from jaxlowbit.recipes.base import (
    GRAD_INPUT_SCOPE,
    GRAD_WEIGHT_SCOPE,
    OUTPUT_SCOPE,
    OperandQuantization,
    Recipe,
    gemm,
    hp_dot,
    provided,
    quantize_operand,
    weight_values,
)
from jaxlowbit_numerics.formats import QuantSpec
from pallas_kernels import dispatch
from pallas_kernels.dispatch import DispatchOptions

Pair = tuple[QuantSpec, QuantSpec]


@dataclasses.dataclass(frozen=True)
class OperandPlan:
  """(left, right) operand specs of each matmul; None runs that matmul in high precision."""

  output: Pair | None
  grad_input: Pair | None
  grad_weight: Pair | None

  @property
  def x(self) -> OperandQuantization:
    """x per token for the forward and, for grad_weight, per input feature (transposed)."""
    return OperandQuantization(self.output and self.output[0], self.grad_weight and self.grad_weight[0])

  @property
  def g(self) -> OperandQuantization:
    """g per token for grad_input and, for grad_weight, per output feature (transposed)."""
    return OperandQuantization(self.grad_input and self.grad_input[0], self.grad_weight and self.grad_weight[1])


class ScaledRecipe(Recipe):
  """A recipe whose matmuls follow an :class:`OperandPlan` (subclasses define ``plan``)."""

  @property
  def plan(self) -> OperandPlan:
    raise NotImplementedError

  def input_quantization(self) -> OperandQuantization | None:
    plan = self.plan
    return plan.x if plan.output and plan.grad_weight else None  # else the backward needs x itself

  def gradient_quantization(self) -> OperandQuantization | None:
    plan = self.plan
    return plan.g if plan.grad_input and plan.grad_weight else None

  def forward(self, x, w, options):
    with jax.named_scope(OUTPUT_SCOPE):
      plan = self.plan
      if is_low_bit(x):
        if self.input_quantization() is None:
          provided(x, "rows", None, self, "input")  # raises: this recipe reads x in high precision
        x_rows = provided(x, "rows", plan.output[0], self, "input")
        x_saved = provided(x, "transposed", plan.grad_weight[0], self, "input")
        out_dtype = x.dtype
      else:
        x_rows, x_cols = quantize_operand(x, plan.x, options)
        x_saved = x_cols if plan.grad_weight else x
        out_dtype = x.dtype
      if plan.output:
        if is_low_bit(w):
          w_t = provided(w, "transposed", plan.output[1], self, "weight")
        else:
          w_t = QuantizedMatrix(*dispatch.quantize_cols_t(w, plan.output[1], options), plan.output[1])  # W^T [N, K]
        y = gemm(x_rows, w_t, out_dtype, options)
      else:
        y = hp_dot(x, weight_values(w, x.dtype), out_dtype)
    return y, (x_saved, w)

  def backward(self, residuals, g, w_dtype, options, g_maxima=None):
    plan = self.plan
    x_saved, w = residuals
    if is_low_bit(g):
      g_rows = plan.grad_input and provided(g, "rows", plan.grad_input[0], self, "gradient")
      g_cols = plan.grad_weight and provided(g, "transposed", plan.grad_weight[1], self, "gradient")
      g_dtype = g.dtype
    else:
      g_rows, g_cols = quantize_operand(g, plan.g, options, g_maxima)
      g_dtype = g.dtype
    with jax.named_scope(GRAD_INPUT_SCOPE):
      if plan.grad_input:
        dx = gemm(g_rows, _weight_rows(w, plan.grad_input[1], options), g_dtype, options)
      else:
        dx = hp_dot(g, weight_values(w, g_dtype).T, g_dtype)
    with jax.named_scope(GRAD_WEIGHT_SCOPE):
      if plan.grad_weight:
        dw = gemm(x_saved, g_cols, w_dtype, options)  # x^T [K, M] (per input feature) x g^T [N, M]
      else:
        dw = hp_dot(x_saved.T, g, w_dtype)
    return dx, dw


def _weight_rows(w: jax.Array | LowBitOperand, spec: QuantSpec, options: DispatchOptions) -> QuantizedMatrix:
  """W ``[K, N]`` per input channel for grad_input: quantized from W, or from a low-bit weight."""
  if is_low_bit(w):
    if w.rows is not None and w.rows.serves(spec):
      return w.rows  # e.g. FSDP's per-tensor gathered weight: the same values grad_input would quantize
    w = weight_values(w, jax.numpy.float32)  # re-quantize the values that arrived, per input channel
  return QuantizedMatrix(*dispatch.quantize_rows(w, spec, options), spec)


__all__ = ["OperandPlan", "ScaledRecipe"]
